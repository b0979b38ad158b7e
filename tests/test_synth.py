"""The synthetic log generator: deterministic, truthful about its root line, streaming, realistic."""

from __future__ import annotations

import io
import json
import re
import tracemalloc
from collections import defaultdict
from datetime import datetime
from pathlib import Path

import pytest

from logdx.model import Action, Category
from logdx.synth import SCENARIOS, Truth, generate, main
from logdx.synth.flavours import FLAVOURS
from logdx.synth.styles import STYLES
from logdx.taxonomy import failure_types_of
from logdx.testing import cpu_seconds

SMALL = dict(ranks=16, lines=4000)
PCI = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}$")
# The rank a line came from, per prefix style (plain pdsh carries no rank).
RANK_PREFIX = {
    "torchrun": re.compile(r"^\[rank(\d+)\]:"),
    "torchrun_tee": re.compile(r"^\[default\d+\]:\[rank(\d+)\]:"),
    "srun": re.compile(r"^ *(\d+): "),
    "srun_torchrun": re.compile(r"^ *\d+: \[rank(\d+)\]:"),
    "pdsh_torchrun": re.compile(r"^[\w-]+: \[rank(\d+)\]:"),
    "mpirun": re.compile(r"^\[1,(\d+)\]<stdout>:"),
}
PY_STAMP = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}")

# What each scenario must be labelled (DESIGN.md's canonical values and the brief's actions).
EXPECTED_LABELS = {
    "healthy": (None, None, "none"),
    "xid79": ("infrastructure", "gpu_fell_off_bus", "cordon_and_restart"),
    "ecc": ("infrastructure", "ecc_error", "cordon_and_restart"),
    "nvlink": ("infrastructure", "nvlink_error", "cordon_and_restart"),
    "ib_error": ("infrastructure", "network_error", "restart"),
    "node_lost": ("infrastructure", "node_failure", "cordon_and_restart"),
    "nccl_hang": ("infrastructure", "hang", "restart"),
    "s3_timeout": ("infrastructure", "storage_error", "restart"),
    "disk_full": ("infrastructure", "disk_full", "restart"),
    "cuda_oom": ("framework", "cuda_oom", "no_restart"),
    "dataloader_killed": ("framework", "dataloader_killed", "no_restart"),
    "host_oom": ("framework", "host_oom", "no_restart"),
    "nan_loss": ("framework", "nan_loss", "no_restart"),
    "lib_attr_error": ("framework", "framework_error", "no_restart"),
    "import_error": ("script", "import_error", "no_restart"),
    "syntax_error": ("script", "syntax_error", "no_restart"),
    "key_error": ("script", "key_error", "no_restart"),
    "stall": ("infrastructure", "hang", "restart"),
}


def make(scenario: str, **kwargs: object) -> tuple[Truth, list[str]]:
    buf = io.StringIO()
    truth = generate(buf, scenario=scenario, **{**SMALL, **kwargs})  # type: ignore[arg-type]
    text = buf.getvalue()
    assert text.endswith("\n")
    return truth, text[:-1].split("\n")


def ranks_of(lines: list[str], style: str) -> list[int | None]:
    pattern = RANK_PREFIX[style]
    return [int(m.group(1)) if (m := pattern.match(line)) else None for line in lines]


# -- determinism ----------------------------------------------------------------------------------


def test_same_seed_gives_same_bytes_and_another_seed_does_not() -> None:
    a = io.StringIO()
    b = io.StringIO()
    c = io.StringIO()
    ta = generate(a, scenario="xid79", seed=7, **SMALL)  # type: ignore[arg-type]
    tb = generate(b, scenario="xid79", seed=7, **SMALL)  # type: ignore[arg-type]
    generate(c, scenario="xid79", seed=8, **SMALL)  # type: ignore[arg-type]
    assert a.getvalue() == b.getvalue()
    assert ta == tb
    assert a.getvalue() != c.getvalue()


def test_every_scenario_is_deterministic() -> None:
    for name in SCENARIOS:
        first, second = io.StringIO(), io.StringIO()
        generate(first, scenario=name, seed=3, ranks=16, lines=1500)
        generate(second, scenario=name, seed=3, ranks=16, lines=1500)
        assert first.getvalue() == second.getvalue(), name


# -- ground truth ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("style", sorted(STYLES))
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_root_line_is_the_line_at_root_line_no(tmp_path: Path, scenario: str, style: str) -> None:
    path = tmp_path / "job.log"
    with path.open("w", encoding="utf-8", newline="\n") as out:
        truth = generate(out, scenario=scenario, seed=11, style=style, **SMALL)  # type: ignore[arg-type]
    lines = path.read_text(encoding="utf-8").split("\n")[:-1]
    assert len(lines) == truth.lines_written
    if truth.status == "healthy":
        assert truth.root_line_no is None and truth.root_line is None
    else:
        assert truth.root_line_no is not None and 1 <= truth.root_line_no <= len(lines)
        assert lines[truth.root_line_no - 1] == truth.root_line


@pytest.mark.slow
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_scenario_has_a_valid_truth(scenario: str) -> None:
    for seed, flavour in enumerate(FLAVOURS):
        truth, _ = make(scenario, seed=seed, flavour=flavour)
        category, failure_type, action = EXPECTED_LABELS[scenario]
        assert (truth.category, truth.failure_type, truth.action) == (category, failure_type, action)
        assert truth.action in {a.value for a in Action}
        if truth.status == "healthy":
            assert truth.category is None and truth.failure_type is None
            continue
        assert truth.status == "failed"
        assert truth.failure_type in failure_types_of(Category(truth.category))
        assert set(truth.culprit_hosts) <= set(truth.hosts)
        assert all(0 <= r < truth.ranks for r in truth.culprit_ranks)
        assert all(PCI.match(g) for g in truth.culprit_gpus)
        for gpu in truth.culprit_gpus:  # a culprit GPU is one the log prints
            assert gpu in (truth.root_line or "")


@pytest.mark.parametrize("scenario", ["xid79", "nvlink"])
def test_gpu_faults_name_one_host_rank_and_gpu(scenario: str) -> None:
    for seed in range(4):
        truth, lines = make(scenario, seed=seed)
        assert len(truth.culprit_hosts) == len(truth.culprit_ranks) == len(truth.culprit_gpus) == 1
        assert truth.culprit_hosts[0] in truth.root_line  # kernel lines always name their node
        assert f"PCI:{truth.culprit_gpus[0]}" in truth.root_line


def test_node_lost_names_every_rank_of_the_silent_host() -> None:
    truth, lines = make("node_lost", seed=2, ranks=32, gpus_per_host=8)
    assert len(truth.culprit_hosts) == 1 and len(truth.culprit_ranks) == 8
    lost = set(truth.culprit_ranks)
    after_root = ranks_of(lines[truth.root_line_no:], "torchrun")
    assert not lost & {r for r in after_root if r is not None}


def test_nccl_hang_culprit_is_the_only_rank_without_a_timeout() -> None:
    truth, lines = make("nccl_hang", seed=4, ranks=32)
    timed_out = {r for r, line in zip(ranks_of(lines, "torchrun"), lines)
                 if r is not None and "Watchdog caught collective operation timeout" in line}
    assert len(truth.culprit_ranks) == 1
    assert timed_out == set(range(32)) - set(truth.culprit_ranks)
    seqs = set(re.findall(r"SeqNum=(\d+)", "\n".join(lines)))
    assert len(seqs) == 1  # everybody waits on the same collective


def test_symptoms_follow_the_root_cause() -> None:
    truth, lines = make("xid79", seed=1, ranks=64)
    first_timeout = next(i for i, line in enumerate(lines) if "Watchdog caught collective operation timeout" in line)
    first_child_failed = next(i for i, line in enumerate(lines) if "ChildFailedError" in line)
    assert truth.root_line_no - 1 < min(first_timeout, first_child_failed)
    assert sum("Watchdog caught collective operation timeout" in line for line in lines) >= 56


# -- size, streaming, speed -----------------------------------------------------------------------


def test_requested_line_count_is_approximately_met() -> None:
    healthy, _ = make("healthy", ranks=64, lines=20000)
    assert abs(healthy.lines_written - 20000) < 0.03 * 20000
    full, _ = make("xid79", ranks=64, lines=20000, fail_at=1.0)
    assert 20000 <= full.lines_written < 20000 + 64 * 60
    half, _ = make("ib_error", ranks=64, lines=20000, fail_at=0.5)
    assert 10000 <= half.lines_written < 10000 + 64 * 60
    assert 0.49 < half.root_line_no / 20000 < 0.53


def test_startup_failures_write_a_short_log_whatever_lines_says() -> None:
    for scenario in ("import_error", "syntax_error"):
        truth, lines = make(scenario, ranks=16, lines=100000)
        assert truth.lines_written < 1000
        assert not any("NCCL INFO" in line for line in lines)


@pytest.mark.slow
def test_streams_a_big_log_in_bounded_memory(tmp_path: Path) -> None:
    tracemalloc.start()
    try:
        with (tmp_path / "big.log").open("w", encoding="utf-8") as out:
            truth = generate(out, scenario="xid79", seed=5, ranks=64, lines=300_000, fail_at=1.0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert truth.lines_written >= 300_000
    assert (tmp_path / "big.log").stat().st_size > 20_000_000
    assert peak < 12 * 2**20, f"peak {peak / 2**20:.1f} MiB"


@pytest.mark.slow
def test_is_fast_enough_for_benchmarks() -> None:
    with cpu_seconds() as cpu:
        truth = generate(io.StringIO(), scenario="healthy", seed=1, ranks=64, lines=200_000)
    assert truth.lines_written / cpu.seconds > 20_000  # ~400k lines a CPU-second


# -- realism --------------------------------------------------------------------------------------


@pytest.mark.parametrize("style", sorted(RANK_PREFIX))
def test_all_ranks_appear_under_each_prefix_style(style: str) -> None:
    truth, lines = make("xid79", seed=9, ranks=24, gpus_per_host=8, style=style)
    assert {r for r in ranks_of(lines, style) if r is not None} == set(range(24))


def test_plain_pdsh_prefixes_name_every_host() -> None:
    truth, lines = make("healthy", seed=9, ranks=24, style="pdsh")
    assert {line.split(":", 1)[0] for line in lines if not line.startswith("pdsh@")} >= set(truth.hosts)


def _interleaved_ranks(region: list[int | None]) -> set[int]:
    """Ranks whose lines in ``region`` are split by lines of another rank."""
    last_seen: dict[int, int] = {}
    split: set[int] = set()
    for i, rank in enumerate(region):
        if rank is None:
            continue
        if rank in last_seen and any(r not in (None, rank) for r in region[last_seen[rank] + 1:i]):
            split.add(rank)
        last_seen[rank] = i
    return split


def test_cascade_lines_of_different_ranks_interleave() -> None:
    truth, lines = make("xid79", seed=1, ranks=64)
    cascade = ranks_of(lines[truth.root_line_no:], "torchrun")
    assert len(_interleaved_ranks(cascade)) >= 32


def test_tracebacks_printed_by_all_ranks_are_mixed_line_by_line() -> None:
    truth, lines = make("import_error", seed=2, ranks=64)
    ranks = ranks_of(lines, "torchrun")
    assert len(_interleaved_ranks(ranks)) >= 16
    exception_lines = [line for line in lines if "No module named" in line or "cannot import name" in line]
    assert len(exception_lines) == 64  # every rank keeps its own prefix on its own copy
    assert truth.root_line == exception_lines[0]


@pytest.mark.parametrize("flavour", ["deepspeed", "fsdp", "lightning", "plain"])  # they stamp every rank's lines
def test_timestamps_are_monotone_per_rank_but_not_across_ranks(flavour: str) -> None:
    _, lines = make("cuda_oom", seed=3, ranks=32, lines=6000, flavour=flavour)
    stamps: dict[int, list[datetime]] = defaultdict(list)
    merged: list[datetime] = []
    for rank, line in zip(ranks_of(lines, "torchrun"), lines):
        m = PY_STAMP.search(line)
        if rank is not None and m:
            stamp = datetime.strptime(m.group(0), "%Y-%m-%d %H:%M:%S,%f")
            stamps[rank].append(stamp)
            merged.append(stamp)
    assert len(stamps) == 32
    for rank, series in stamps.items():
        assert series == sorted(series), f"rank {rank} goes back in time"
    assert merged != sorted(merged)  # clock skew and jitter: the merged log is not sorted


def test_healthy_logs_carry_harmless_error_words() -> None:
    truth, lines = make("healthy", seed=1, ranks=32, lines=20000, flavour="plain")
    text = "\n".join(lines)
    assert "error_if_nonfinite=False" in text
    assert re.search(r"\b0 errors\b", text)
    assert "Traceback" not in text and "Watchdog caught" not in text
    quiet, quiet_lines = make("healthy", seed=1, ranks=32, lines=20000, flavour="plain", noise=0.0)
    assert sum("Warning" in line for line in quiet_lines) < sum("Warning" in line for line in lines)


def test_nan_loss_root_is_a_progress_line_with_a_nan_loss() -> None:
    for seed, flavour in enumerate(FLAVOURS):
        truth, lines = make("nan_loss", seed=seed, flavour=flavour)
        assert re.search(r"loss\W{0,4}\s*nan\b", truth.root_line, re.IGNORECASE), flavour
        assert not any(re.search(r"loss\W{0,4}\s*nan\b", line, re.IGNORECASE) for line in lines[:truth.root_line_no - 1])


def test_stall_ends_in_silence_hours_after_the_last_progress_line() -> None:
    truth, lines = make("stall", seed=1, flavour="plain", style="srun")  # under Slurm: a CANCELLED line
    last_progress = datetime.strptime(PY_STAMP.search(truth.root_line).group(0), "%Y-%m-%d %H:%M:%S,%f")
    later = [PY_STAMP.search(line) or re.search(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", line)
             for line in lines[truth.root_line_no:]]
    assert not any("step " in line for line in lines[truth.root_line_no:])
    stamps = [m.group(0) for m in later if m]
    assert stamps, "something after the stall must show how long it lasted"
    end = datetime.fromisoformat(stamps[-1].replace(",", "."))
    assert (end - last_progress).total_seconds() > 1800


def test_library_attribute_error_is_raised_inside_a_library() -> None:
    for seed, flavour in enumerate(FLAVOURS):
        truth, lines = make("lib_attr_error", seed=seed, flavour=flavour)
        i = truth.root_line_no - 1
        assert "AttributeError" in truth.root_line
        prefix = truth.root_line[:truth.root_line.index("]:") + 2]  # the same rank's innermost frame
        frame = next(line for line in reversed(lines[:i]) if line.startswith(prefix + '  File "'))
        assert re.search(r"/(site|dist)-packages/", frame) and "__getattr__" not in frame


# -- command line ---------------------------------------------------------------------------------


def test_cli_writes_log_and_truth(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log, truth_path = tmp_path / "job.log", tmp_path / "truth.json"
    code = main(["--scenario", "ecc", "--ranks", "16", "--lines", "3000", "--seed", "2",
                 "-o", str(log), "--truth", str(truth_path)])
    assert code == 0
    truth = json.loads(truth_path.read_text())
    lines = log.read_text(encoding="utf-8").split("\n")
    assert lines[truth["root_line_no"] - 1] == truth["root_line"]
    assert truth["failure_type"] == "ecc_error"
    assert "lines/s" in capsys.readouterr().err


def test_cli_lists_scenarios_and_rejects_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--list"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in SCENARIOS)
    assert main(["--scenario", "xid79", "--ranks", "1"]) == 2
    with pytest.raises(ValueError, match="at least 2 hosts"):
        generate(io.StringIO(), scenario="node_lost", ranks=8, gpus_per_host=8)
    with pytest.raises(ValueError):
        generate(io.StringIO(), scenario="no_such_thing")
    with pytest.raises(ValueError):
        generate(io.StringIO(), scenario="xid79", fail_at=1.5)
