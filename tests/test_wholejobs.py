"""The whole-job generators (healthy runs, hangs, divergences, realistic burials): their ground truth
is what the written log shows. Small jobs, no pipeline: these run in the fast suite."""

from __future__ import annotations

import io
import re
from collections import Counter

import pytest

from logdx.synth.bury import bury
from logdx.synth.divergence import KINDS, divergence_job, divergence_set
from logdx.synth.hangs import WHERE, culprit_stack, hang_set, owner_is_user, silent_rank_hang, stack_hang
from logdx.synth.healthy import healthy_job, healthy_set
from logdx.synth.longjob import JobTruth
from logdx.synth.noise import FAMILIES

C10D_REFUSED = re.compile(r"\[W(?:\d{3,4} [\d:.]+)? socket\.cpp:\d+\] \[c10d\] The client socket has failed to connect to "
                          r"\S+:\d+ \(errno: 111 - Connection refused\)\.")
WATCHDOG = re.compile(r"\[Rank (\d+)\] Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=(\d+),")
PLAIN_STEP = re.compile(r"train\.py:212 - step (\d+) \| loss (\S+)")
TORCHRUN_RANK = re.compile(r"^\[rank(\d+)\]:")


def lines_of(write, **kwargs) -> tuple[JobTruth, list[str]]:  # type: ignore[no-untyped-def]
    buf = io.StringIO()
    truth = write(buf, **kwargs)
    text = buf.getvalue()
    assert text.endswith("\n")
    out = text[:-1].split("\n")
    assert len(out) == truth.lines_written
    return truth, out


def assert_root_lines_are_where_the_truth_says(truth: JobTruth, lines: list[str]) -> None:
    assert truth.root_line_nos, "a failed job has a root line"
    assert all(1 <= n <= len(lines) for n in truth.root_line_nos)
    assert truth.root_line in (lines[n - 1] for n in truth.root_line_nos)


# -- healthy runs ------------------------------------------------------------------------------------


def test_healthy_job_is_deterministic_in_its_seed() -> None:
    kw = dict(seed=5, flavour="megatron", style="srun", ranks=16, lines=3000)
    a, b, c = io.StringIO(), io.StringIO(), io.StringIO()
    assert healthy_job(a, **kw) == healthy_job(b, **kw)  # type: ignore[arg-type]
    healthy_job(c, **{**kw, "seed": 6})  # type: ignore[arg-type]
    assert a.getvalue() == b.getvalue() != c.getvalue()


@pytest.mark.parametrize("flavour", ["megatron", "deepspeed", "hf", "lightning", "fsdp", "nemo", "plain"])
def test_healthy_runs_end_well_whatever_the_framework(flavour: str) -> None:
    truth, lines = lines_of(healthy_job, seed=3, flavour=flavour, style="torchrun", ranks=8, lines=2500)
    assert (truth.status, truth.category, truth.failure_type, truth.action) == ("healthy", None, None, "none")
    assert truth.exit_code == 0 and truth.root_line_nos == []
    assert abs(len(lines) - 2500) < 400
    assert any("worker group successfully finished" in line for line in lines[-40:])
    assert not any(WATCHDOG.search(line) for line in lines)


def test_a_cut_healthy_log_has_no_exit_code_and_no_end() -> None:
    truth, lines = lines_of(healthy_job, seed=2, flavour="plain", style="torchrun", ranks=8, lines=2500, ending="cut")
    assert truth.exit_code is None
    assert not any("successfully finished" in line for line in lines)
    assert PLAIN_STEP.search(lines[-1]) or any(PLAIN_STEP.search(line) for line in lines[-12:])


def test_store_retries_come_at_start_up_and_training_runs_long_after() -> None:
    seen = 0
    for seed in range(6):
        truth, lines = lines_of(healthy_job, seed=seed, flavour="plain", style="torchrun", ranks=16, lines=2500)
        refused = [i for i, line in enumerate(lines) if C10D_REFUSED.search(line)]
        assert bool(refused) == ("store_retries" in truth.families)
        if refused:
            assert max(refused) < len(lines) * 0.2, "the store comes up at start; the job then runs for hours"
            seen += 1
    assert seen >= 2


def test_the_healthy_set_covers_every_framework_style_and_size() -> None:
    cases = healthy_set(32, seed=0)
    assert len(cases) == 32 and len({c.case_id for c in cases}) == 32
    assert {c.kwargs["flavour"] for c in cases} == {"megatron", "deepspeed", "hf", "lightning", "fsdp", "nemo", "plain"}
    assert len({c.kwargs["style"] for c in cases}) == 7
    assert {8, 128} <= {c.kwargs["ranks"] for c in cases}
    assert all(2000 <= c.kwargs["lines"] <= 20000 for c in cases)
    assert healthy_set(32, seed=0) == cases and healthy_set(32, seed=1) != cases


def test_every_noise_family_is_drawn_somewhere() -> None:
    from logdx.synth.generate import make_job
    from logdx.synth.noise import Realism

    seen: set[str] = set()
    for seed in range(40):
        for flavour, style in (("megatron", "srun"), ("lightning", "mpirun"), ("plain", "pdsh_torchrun")):
            job = make_job(io.StringIO(), name="t", seed=seed, ranks=16, gpus_per_host=8, lines=5000, style=style,
                           noise=1.0, flavour=flavour)
            seen |= Realism.draw(job, steps=200).families
    assert seen == set(FAMILIES)


def test_an_ib_port_flap_comes_back_on_the_same_device() -> None:
    for seed in range(20):
        truth, lines = lines_of(healthy_job, seed=seed, flavour="fsdp", style="torchrun", ranks=8, lines=2000)
        if "ib_flap" not in truth.families:
            continue
        errors = [line for line in lines if "Got async event : port error" in line]
        active = [line for line in lines if "Got async event : port active" in line]
        assert errors and len(errors) == len(active) == 8, "every rank of the node"
        dev = re.search(r"NET/IB : (\S+) Got", errors[0]).group(1)  # type: ignore[union-attr]
        assert all(f"NET/IB : {dev} Got" in line for line in active)
        return
    pytest.fail("no job flaps its IB port")


# -- hangs -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("report", ["absent", "lower"])
def test_silent_rank_is_missing_from_the_watchdogs_or_reports_a_lower_seqnum(report: str) -> None:
    truth, lines = lines_of(silent_rank_hang, seed=4, flavour="plain", style="torchrun", ranks=16, lines=3000,
                            report=report, gap=True)
    culprit = truth.culprit_ranks[0]
    # Two signals (the watchdogs' reports, and its own progress stopping first): its named node is cordoned.
    want = "cordon_and_restart" if truth.culprit_hosts else "restart"
    assert (truth.category, truth.failure_type, truth.action) == ("infrastructure", "hang", want)
    seqs = {int(m.group(1)): int(m.group(2)) for line in lines if (m := WATCHDOG.search(line))}
    others = {seq for rank, seq in seqs.items() if rank != culprit}
    assert len(others) == 1, "every other rank times out on the same collective"
    if report == "absent":
        assert culprit not in seqs
    else:
        assert seqs[culprit] < min(others)
    # the gap: the culprit's last step is below the others'
    last: dict[int, int] = {}
    for line in lines:
        if (r := TORCHRUN_RANK.match(line)) and (m := PLAIN_STEP.search(line)):
            last[int(r.group(1))] = int(m.group(1))
    assert last[culprit] < min(v for k, v in last.items() if k != culprit)
    assert_root_lines_are_where_the_truth_says(truth, lines)
    assert lines[truth.root_line_nos[0] - 1].startswith(f"[rank{culprit}]:")


def test_the_culprits_host_is_only_labelled_when_the_log_names_it() -> None:
    named, _ = lines_of(silent_rank_hang, seed=1, flavour="plain", style="pdsh_torchrun", ranks=16, lines=3000,
                        nccl_debug=False)
    assert named.culprit_hosts == [named.hosts[named.culprit_ranks[0] // 8]]
    labelled = 0
    for seed in range(8):  # torchrun prefixes carry no host: only the culprit's own NCCL lines can name it
        bare, lines = lines_of(silent_rank_hang, seed=seed, flavour="fsdp", style="torchrun", ranks=16, lines=2500,
                               nccl_debug=False)
        culprit = bare.culprit_ranks[0]
        host = bare.hosts[culprit // 8]
        in_log = any(line.startswith(f"[rank{culprit}]:") and host in line for line in lines)
        assert bool(bare.culprit_hosts) == in_log, seed
        labelled += in_log
    assert labelled < 8


@pytest.mark.parametrize("dumper", ["py-spy", "faulthandler"])
@pytest.mark.parametrize("where", sorted(WHERE))
def test_one_rank_sits_outside_the_collective_in_the_stack_dumps(where: str, dumper: str) -> None:
    truth, lines = lines_of(stack_hang, seed=7, flavour="plain", style="torchrun", ranks=8, lines=2500, where=where,
                            dumper=dumper, op="all_reduce")
    culprit = truth.culprit_ranks[0]
    assert (truth.category, truth.failure_type) == WHERE[where][:2]
    in_collective = {int(r.group(1)) for line in lines if "distributed_c10d.py" in line and "all_reduce" in line
                     and (r := TORCHRUN_RANK.match(line))}
    assert in_collective == set(range(8)) - {culprit}
    assert_root_lines_are_where_the_truth_says(truth, lines)
    assert all(lines[n - 1].startswith(f"[rank{culprit}]:") for n in truth.root_line_nos)
    assert not any("distributed_c10d" in lines[n - 1] for n in truth.root_line_nos)


def test_stack_hang_label_follows_who_owns_the_innermost_frame() -> None:
    from logdx.synth.generate import make_job

    for where, (category, failure_type, _) in WHERE.items():
        job = make_job(io.StringIO(), name="t", seed=1, ranks=8, gpus_per_host=8, lines=1000, style="torchrun",
                                noise=1.0, flavour="plain")
        assert owner_is_user(culprit_stack(job, where), job) == (failure_type == "script_hang"), where
        assert category == ("script" if failure_type == "script_hang" else "framework")


def test_the_hang_set_varies_and_is_stable() -> None:
    cases = hang_set(seed=0)
    assert len(cases) == 40 and len({c.case_id for c in cases}) == 40
    assert {c.kwargs.get("where") for c in cases} >= set(WHERE)
    assert {c.kwargs.get("report") for c in cases} >= {"absent", "lower"}
    assert [c.case_id for c in hang_set(seed=0)] == [c.case_id for c in cases]


# -- divergences -------------------------------------------------------------------------------------


def _plain_losses(lines: list[str]) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for line in lines:
        if m := PLAIN_STEP.search(line):
            out.setdefault(int(m.group(1)), []).append(float(m.group(2)))
    return out


def test_a_loss_spike_that_does_not_recover_is_found_at_its_first_step() -> None:
    truth, lines = lines_of(divergence_job, seed=3, flavour="plain", style="torchrun", ranks=8, lines=3000,
                            kind="spike", ending="cut")
    assert (truth.category, truth.failure_type, truth.action) == ("framework", "nan_loss", "no_restart")
    losses = _plain_losses(lines)
    step = truth.divergence_step
    assert step is not None
    before = [v for s, vs in losses.items() if s < step for v in vs][-40:]
    after = [v for s, vs in losses.items() if s > step + 2 for v in vs]
    assert after and min(after) > 1.6 * max(before), "it never comes back"
    assert all(re.search(rf"\bstep {step}\b", lines[n - 1]) for n in truth.root_line_nos)
    assert truth.exit_code is None and truth.step_tolerance == 2


@pytest.mark.parametrize("kind", KINDS)
def test_every_divergence_kind_shows_from_its_step_on(kind: str) -> None:
    flavour = {"nan_iterations": "megatron", "skipped": "megatron", "grad_norm": "megatron"}.get(kind, "plain")
    truth, lines = lines_of(divergence_job, seed=11, flavour=flavour, style="srun", ranks=8, lines=3500, kind=kind)
    assert_root_lines_are_where_the_truth_says(truth, lines)
    assert str(truth.divergence_step) in truth.root_line  # type: ignore[operator]
    first = min(truth.root_line_nos)
    if kind == "nan":
        assert not any(re.search(r"loss\W{0,4}\s*nan\b", line) for line in lines[: first - 1])
    if kind in ("nan_iterations", "skipped"):
        key = "nan" if kind == "nan_iterations" else "skipped"
        counts = [int(m.group(1)) for line in lines[first - 1:]
                  if (m := re.search(rf"number of {key} iterations:\s*(\d+)", line))]
        assert counts and min(counts) > 0, "it never goes back to zero"
    assert truth.exit_code == 143 and any("CANCELLED" in line or "SIGTERM" in line for line in lines[-400:])


def test_the_divergence_set_holds_every_kind_and_recovering_spikes() -> None:
    cases = divergence_set(seed=0)
    assert {c.kwargs["kind"] for c in cases if "kind" in c.kwargs} == set(KINDS)
    spikes = [c for c in cases if c.case_id.startswith("spike-recovers")]
    assert len(spikes) == 8
    truth = spikes[0].generate(io.StringIO())
    assert truth.status == "healthy" and truth.variant["spike_step"] is not None


# -- realistic burials -------------------------------------------------------------------------------

IMPORT_ERROR = ["Traceback (most recent call last):", '  File "/home/u/train.py", line 3, in <module>',
                "    import flash_attn_2_cuda as flash_attn_cuda",
                "ImportError: libcudart.so.11.0: cannot open shared object file: No such file or directory"]


def test_a_startup_failure_is_buried_before_any_training_step() -> None:
    buf = io.StringIO()
    truth = bury(IMPORT_ERROR, buf, seed=3, ranks=16, lines=3000, style="torchrun", realism=True, phase="launch",
                 flavour="plain")
    lines = buf.getvalue().split("\n")
    root = truth.root_line_no_for(IMPORT_ERROR[-1])
    assert root is not None
    assert not any(PLAIN_STEP.search(line) for line in lines[: root - 1])
    assert not any(WATCHDOG.search(line) for line in lines), "nobody was in a collective yet"
    assert not any("train.py:88 - rank" in line for line in lines), "the workers died before the banner"
    buf = io.StringIO()
    later = bury(IMPORT_ERROR, buf, seed=3, ranks=16, lines=3000, style="torchrun", realism=True, phase="startup",
                 flavour="plain")
    lines = buf.getvalue().split("\n")
    before = lines[: later.root_line_no_for(IMPORT_ERROR[-1]) - 1]  # type: ignore[operator]
    assert any("train.py:88 - rank" in line for line in before) and not any(PLAIN_STEP.search(x) for x in before)


def test_a_healthy_excerpt_is_buried_in_a_run_that_ends_well() -> None:
    warning = ["UserWarning: Grad strides do not match bucket view strides. This may indicate grad was not created "
               "according to the gradient layout contract"]
    buf = io.StringIO()
    truth = bury(warning, buf, seed=5, ranks=8, lines=3000, style="srun_torchrun", realism=True, healthy=True)
    lines = buf.getvalue()[:-1].split("\n")
    assert truth.exit_code == 0 and truth.failure_line_no < len(lines) * 0.9
    steps_after = [line for line in lines[truth.failure_line_no:] if "INFO" in line or "iteration" in line]
    assert len(steps_after) > 50, "training goes on after the real lines"
    assert not any(WATCHDOG.search(line) for line in lines)


def test_realistic_burial_is_deterministic_and_keeps_the_real_text() -> None:
    a, b = io.StringIO(), io.StringIO()
    ta = bury(IMPORT_ERROR, a, seed=9, ranks=32, lines=4000, style="mpirun", realism=True)
    tb = bury(IMPORT_ERROR, b, seed=9, ranks=32, lines=4000, style="mpirun", realism=True)
    assert a.getvalue() == b.getvalue() and ta == tb
    lines = a.getvalue().split("\n")
    for i, real in enumerate(IMPORT_ERROR):
        assert lines[ta.line_map[i] - 1] == ta.prefixes[i] + real
    assert Counter(line.startswith("mpirun ") for line in lines)[True] >= 1


def test_a_noise_family_can_be_left_out_of_every_generator() -> None:
    without = frozenset({"store_retries", "hub_retries"})
    for write, kw in ((healthy_job, {}), (silent_rank_hang, {}), (stack_hang, {"where": "io"}),
                      (divergence_job, {"kind": "nan"})):
        truth, lines = lines_of(write, seed=1, flavour="plain", style="torchrun", ranks=16, lines=2500,
                                without=without, **kw)
        assert not without & set(truth.families)
        assert not any(C10D_REFUSED.search(line) or "thrown while requesting" in line for line in lines)
    buf = io.StringIO()
    buried = bury(IMPORT_ERROR, buf, seed=1, ranks=16, lines=2500, realism=True, without=without)
    assert not without & set(buried.families) and not C10D_REFUSED.search(buf.getvalue())


def test_a_silent_rank_only_the_watchdogs_name_is_restarted() -> None:
    truth, _ = lines_of(silent_rank_hang, seed=4, flavour="plain", style="torchrun", ranks=16, lines=3000,
                        report="absent", gap=False)
    assert (truth.failure_type, truth.action) == ("hang", "restart")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["spike", "nan_iterations", "grad_norm"])
def test_no_point_of_a_divergence_is_listed_as_recovered(engine, kind: str) -> None:
    # The loss's later spikes and NaNs are the divergence going on, not events the job came back from.
    from logdx.testing import diagnose_lines

    flavour = "plain" if kind == "spike" else "megatron"
    truth, lines = lines_of(divergence_job, seed=1, flavour=flavour, style="torchrun", ranks=32, lines=4000, kind=kind)
    report = diagnose_lines(engine, lines, truth.exit_code)
    assert report.failure_type == truth.failure_type and report.progress and report.progress.divergence
    begun = report.progress.divergence.line_no
    assert [r.line_no for r in report.recovered if r.kind in ("loss_spike", "loss_nan") and r.line_no >= begun] == []
