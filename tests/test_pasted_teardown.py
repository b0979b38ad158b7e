"""The generators of issue 28's two evaluation sets: short pasted excerpts that end in a fatal exception
(`synth/pasted.py`) and healthy runs with teardown noise and kernel lines past their end (`synth/teardown.py`).
Their truth is what the written log shows. No pipeline: these run in the fast suite."""

from __future__ import annotations

import io
import re
import time

import pytest

from logdx.synth.healthy import healthy_job, teardown_set
from logdx.synth.longjob import JobTruth
from logdx.synth.pasted import CRASHES, FRAMEWORKS, ORDERS, STYLES, pasted_excerpt, pasted_set
from logdx.timeline import is_completion

# What the process's last words look like, per crash: the line a right root line is.
LAST_WORDS = re.compile(r"(?:Error|Exception): |^\s*what\(\):|terminate called after throwing|NaN detected in loss, aborting"
                        r"|\bloss = nan\b")
PREFIXES = re.compile(r"^(?:\[rank0\]: |\[default0\]:|0: |\d{4}-\d\d-\d\dT[\d:.]+Z )")
DMESG = re.compile(r"^(\S+): \[(\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4})\] ")


def lines_of(write, **kwargs) -> tuple[JobTruth, list[str]]:  # type: ignore[no-untyped-def]
    buf = io.StringIO()
    truth = write(buf, **kwargs)
    out = buf.getvalue()[:-1].split("\n")
    assert len(out) == truth.lines_written
    return truth, out


# -- pasted excerpts -----------------------------------------------------------------------------------


@pytest.mark.parametrize("crash", CRASHES)
def test_a_pasted_excerpt_ends_in_its_crash_and_its_root_lines_are_the_last_words(crash: str) -> None:
    for order in ORDERS:
        truth, lines = lines_of(pasted_excerpt, seed=7, crash=crash, framework="hf", style="bare", order=order)
        assert truth.status == "failed" and truth.category and truth.failure_type and truth.action
        assert truth.root_line in (lines[n - 1] for n in truth.root_line_nos)
        assert all(LAST_WORDS.search(lines[n - 1]) for n in truth.root_line_nos), [lines[n - 1] for n in truth.root_line_nos]
        if order == "crash_first":
            assert min(truth.root_line_nos) < len(lines) - 3  # the start-up lines come after the crash
            assert any("Loading checkpoint shards" in line for line in lines[max(truth.root_line_nos):])
        else:
            assert max(truth.root_line_nos) >= len(lines) - 10  # nothing much after it: the end of the output


def test_a_syntax_error_of_the_main_script_is_printed_without_a_traceback_header() -> None:
    shapes = set()
    for seed in range(12):
        _, lines = lines_of(pasted_excerpt, seed=seed, crash="bad_syntax", framework="plain", style="bare", order="alone")
        shapes.add(lines[0].startswith("Traceback"))
        assert re.match(r"(?:Syntax|Indentation)Error: ", lines[-1])
    assert shapes == {True, False}


@pytest.mark.parametrize("style", STYLES)
def test_every_line_of_a_paste_carries_its_style(style: str) -> None:
    truth, lines = lines_of(pasted_excerpt, seed=3, crash="out_of_memory", framework="deepspeed", style=style,
                            order="startup_first", launcher_box=True)
    prefixed = [bool(PREFIXES.match(line)) for line in lines]
    assert all(prefixed) if style != "bare" else not any(prefixed)
    assert any("ChildFailedError" in line for line in lines[max(truth.root_line_nos):])


def test_the_set_covers_every_crash_framework_style_and_order_and_a_third_exit_0() -> None:
    cases = pasted_set(48, seed=0)
    assert len({c.case_id for c in cases}) == 48
    for key, values in (("crash", CRASHES), ("framework", FRAMEWORKS), ("style", STYLES), ("order", ORDERS)):
        assert {c.kwargs[key] for c in cases} == set(values), key
    assert sum(c.kwargs["exit_code"] == 0 for c in cases) == 16
    a, b = io.StringIO(), io.StringIO()
    assert cases[5].generate(a) == cases[5].generate(b) and a.getvalue() == b.getvalue()


# -- healthy runs that come down noisily ---------------------------------------------------------------------


def _end_marker(lines: list[str]) -> int:
    """1-based line of the run's last end marker (the framework's or a launcher's completion line)."""
    return max(i for i, line in enumerate(lines, start=1) if is_completion(PREFIXES.sub("", line.split("]:", 1)[-1])))


@pytest.mark.parametrize("flavour", ["megatron", "hf", "lightning", "plain"])
def test_the_teardown_comes_after_the_run_said_it_finished(flavour: str) -> None:
    truth, lines = lines_of(healthy_job, seed=11, flavour=flavour, style="srun_torchrun", ranks=16, lines=3000,
                            teardown=True, exit_known=False)
    assert (truth.status, truth.exit_code, truth.action) == ("healthy", None, "none")
    families = truth.variant["teardown"]
    assert families
    end = _end_marker(lines)
    after = lines[end:]
    said = {"nccl_teardown": "NCCL WARN", "slurm_teardown": "slurmstepd: error:", "nvml": "Can't initialize NVML",
            "late_kernel": "NVRM: Xid"}
    for family in families:
        assert any(said[family] in line for line in after), family
        assert not any(said[family] in line for line in lines[:end]) or family == "nccl_teardown", family


def test_kernel_lines_past_the_end_are_stamped_after_it_and_a_late_fatal_xid_names_its_host() -> None:
    runs = [lines_of(healthy_job, seed=s, flavour="megatron", style="pdsh", ranks=16, lines=3000, teardown=True)
            for s in range(40, 52)]
    late = [(t, lines) for t, lines in runs if t.variant.get("late_xid")]
    assert late and len(late) < len(runs)
    for truth, lines in late:
        end = _end_marker(lines)
        fatal = [line for line in lines[end:] if re.search(r"Xid \(PCI:[\w:]+\): (?:79|48),", line)]
        assert fatal and all(line.startswith(f"{truth.variant['late_xid']}:") for line in fatal)
        stamps = [time.mktime(time.strptime(m.group(2), "%a %b %d %H:%M:%S %Y")) for line in lines[end:]
                  if (m := DMESG.match(line))]
        before = [time.mktime(time.strptime(m.group(2), "%a %b %d %H:%M:%S %Y")) for line in lines[:end]
                  if (m := DMESG.match(line))]
        assert stamps and (not before or min(stamps) >= max(before))


def test_the_teardown_set_mixes_frameworks_styles_and_known_exit_codes() -> None:
    cases = teardown_set(24, seed=0)
    assert {c.kwargs["flavour"] for c in cases} == {"megatron", "deepspeed", "hf", "lightning", "fsdp", "nemo", "plain"}
    assert len({c.kwargs["style"] for c in cases}) >= 6
    assert sum(c.kwargs["exit_known"] for c in cases) == 8 and all(c.kwargs["teardown"] for c in cases)
