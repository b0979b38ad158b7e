"""Burying real failure lines in a long multi-rank job (``logdx.synth.bury``) and scoring buried runs."""

from __future__ import annotations

import io
import json
import re
import time
from collections import Counter
from datetime import UTC, datetime

import pytest

from logdx.act.report import Culprits, Report, RootCause
from logdx.evaluate import buried_culprit_correct, buried_root_line_correct, bury_variants, label_culprit_rank
from logdx.synth.bury import AGENT, BARE, PREFIXED, RANK, BuriedTruth, bury, classify, line_time, main
from logdx.synth.styles import STYLES

# Made-up failure excerpts (not from any labelled set).
TRACEBACK = [
    "Traceback (most recent call last):",
    '  File "/home/alice/proj/run_pretrain.py", line 77, in <module>',
    "    trainer.fit(cfg)",
    '  File "/home/alice/proj/trainer.py", line 140, in fit',
    "    batch = self.tokenize(raw, max_len=cfg.max_len)",
    '  File "/home/alice/proj/trainer.py", line 96, in tokenize',
    "    return self.tok(raw)[: self.lengths[idx]]",
    "NameError: name 'idx' is not defined",
]
ROOT = "NameError: name 'idx' is not defined"
ODD = [
    "  trailing spaces and a tab\t  ",
    "ünïcödé ✓ — box │ ╰──╯",
    "\x1b[31mred ANSI\x1b[0m text",
    "carriage return at the end\r",
    "",
    "RuntimeError: something odd",
]
MIXED = [
    "[rank5]:[E1203 10:00:01.000000000 ProcessGroupNCCL.cpp:1515] [PG 0 (default_pg) Rank 5] Process group "
    "watchdog thread terminated with exception: CUDA error: an illegal memory access was encountered",
    "Dec  3 10:00:01 gpu-n7 kernel: NVRM: Xid (PCI:0000:3b:00): 13, pid=4242, Graphics SM Warp Exception",
    "slurmstepd: error: *** STEP 123.0 ON gpu-n7 CANCELLED AT 2024-12-03T10:00:05 ***",
    "W1203 10:00:03.000000 4100 torch/distributed/elastic/multiprocessing/api.py:897] Sending process 4243 closing "
    "signal SIGTERM",
    "some plain line the rank printed",
]
SMALL = dict(ranks=16, lines=5000)
# The rank a line came from, per prefix style (plain pdsh carries no rank).
RANK_OF = {
    "torchrun": re.compile(r"^\[rank(\d+)\]:"),
    "torchrun_tee": re.compile(r"^\[default\d+\]:\[rank(\d+)\]:"),
    "srun": re.compile(r"^ *(\d+): "),
    "srun_torchrun": re.compile(r"^ *\d+: \[rank(\d+)\]:"),
    "pdsh_torchrun": re.compile(r"^[\w-]+: \[rank(\d+)\]:"),
    "mpirun": re.compile(r"^\[1,(\d+)\]<stdout>:"),
}
CASCADE = re.compile(r"Watchdog caught collective operation timeout|closing signal SIGTERM|ChildFailedError|"
                     r"^srun: error: .*: (?:Terminated|Exited with exit code|Killed)|Killing subprocess|"
                     r"ssh exited with exit code|Connection closed by remote peer")
C10_STAMP = re.compile(r"\[E(\d{3,4}) (\d\d):(\d\d):(\d\d)\.(\d{9}) ")
PY_STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})")


def run(real: list[str], **kwargs: object) -> tuple[BuriedTruth, list[str], str]:
    buf = io.StringIO()
    args = {**SMALL, "seed": 1, **kwargs}
    truth = bury(real, buf, **args)  # type: ignore[arg-type]
    text = buf.getvalue()
    assert text.endswith("\n")
    return truth, text[:-1].split("\n"), text


def py_epoch(stamp: str, millis: str) -> float:
    dt = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)
    return dt.timestamp() + int(millis) / 1000


# -- determinism ------------------------------------------------------------------------------------


def test_same_arguments_give_same_bytes_and_truth_another_seed_does_not() -> None:
    ta, _, a = run(TRACEBACK, seed=5)
    tb, _, b = run(TRACEBACK, seed=5)
    tc, _, c = run(TRACEBACK, seed=6)
    assert a == b and ta == tb
    assert a != c
    assert ta.culprit_rank != tc.culprit_rank or ta.line_map != tc.line_map or ta.hosts != tc.hosts


# -- the real lines ---------------------------------------------------------------------------------


@pytest.mark.parametrize("style", sorted(STYLES))
def test_real_text_is_kept_byte_identical_after_the_culprits_prefix(style: str) -> None:
    truth, lines, _ = run(TRACEBACK, style=style, seed=3)
    assert sorted(truth.line_map) == list(range(len(TRACEBACK)))
    nos = [truth.line_map[i] for i in range(len(TRACEBACK))]
    assert nos == sorted(nos) and len(set(nos)) == len(nos), "real lines keep their order"
    for i, real in enumerate(TRACEBACK):
        written = lines[truth.line_map[i] - 1]
        assert written == truth.prefixes[i] + real
        assert truth.strip_prefix(truth.line_map[i], written) == real
        if style in RANK_OF:
            m = RANK_OF[style].match(written)
            assert m and int(m.group(1)) == truth.culprit_rank
        else:  # plain pdsh: only the host
            assert truth.prefixes[i] == f"{truth.culprit_host}: "
    assert truth.root_line_no_for(ROOT) == truth.line_map[len(TRACEBACK) - 1]
    assert lines[truth.root_line_no_for(ROOT) - 1].endswith(ROOT)


def test_odd_bytes_survive_and_bare_lines_get_no_prefix() -> None:
    buf = io.StringIO()
    truth = bury(ODD, buf, seed=2, prefix_real=False, **SMALL)  # type: ignore[arg-type]
    raw = buf.getvalue().split("\n")
    for i, real in enumerate(ODD):
        assert truth.prefixes[i] == ""
        assert raw[truth.line_map[i] - 1] == real


def test_bury_writes_to_a_file_exactly(tmp_path) -> None:
    path = tmp_path / "b.log"
    with open(path, "w", encoding="utf-8", errors="surrogateescape", newline="") as out:
        truth = bury([*ODD, "bad byte \udcff here"], out, seed=4, style="srun", **SMALL)  # type: ignore[arg-type]
    data = path.read_bytes().split(b"\n")
    assert data[truth.line_map[3] - 1].endswith(b"carriage return at the end\r")
    assert data[truth.line_map[6] - 1].endswith(b"bad byte \xff here")
    assert data[truth.line_map[1] - 1].endswith("ünïcödé ✓ — box │ ╰──╯".encode())


def test_line_classification() -> None:
    assert [classify(line) for line in MIXED] == [PREFIXED, BARE, BARE, AGENT, RANK]
    assert classify("[  +0.000316] pcieport 0000:00:03.0: AER: Corrected error received") == BARE
    assert classify("pdsh@node-01: node-02: ssh exited with exit code 255") == BARE
    assert classify("ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: 1)") == AGENT
    assert classify("ERROR: Unexpected bus error encountered in worker.") == RANK
    assert classify("RuntimeError: CUDA error: unknown error") == RANK


@pytest.mark.parametrize("style,outer", [("torchrun", ""), ("torchrun_tee", ""), ("srun", "{rank}: "),
                                          ("srun_torchrun", "{host_index}: "), ("pdsh", "{host}: "),
                                          ("pdsh_torchrun", "{host}: ")])
def test_prefixes_follow_who_printed_the_line(style: str, outer: str) -> None:
    truth, lines, _ = run(MIXED, style=style, seed=8)
    assert truth.culprit_rank == 5, "the culprit comes from the torchrun prefix in the real lines"
    host_index = truth.hosts.index(truth.culprit_host)
    want_outer = outer.format(rank=f"{5:>2}", host_index=host_index, host=truth.culprit_host)
    assert truth.prefixes[0] == want_outer
    assert truth.prefixes[1] == truth.prefixes[2] == ""  # kernel, slurmstepd
    assert truth.prefixes[3] == ("" if style in ("torchrun", "torchrun_tee", "srun") else want_outer)  # launcher
    full = truth.prefixes[4]  # the rank's full prefix
    assert (m := RANK_OF[style].match(full)) and int(m.group(1)) == 5 if style in RANK_OF else full == want_outer
    for i, real in enumerate(MIXED):
        assert lines[truth.line_map[i] - 1] == truth.prefixes[i] + real


def test_culprit_rank_argument_wins_and_the_culprit_does_not_time_out() -> None:
    truth, lines, _ = run(TRACEBACK, culprit_rank=11, seed=9)
    assert truth.culprit_rank == 11
    assert all(p == "[rank11]:" for p in truth.prefixes.values())
    assert not any("[Rank 11] Watchdog caught" in line for line in lines)
    with pytest.raises(ValueError):
        run(TRACEBACK, culprit_rank=16)


def test_root_line_lookup() -> None:
    real = ["x", "KeyError: 'lr'", "  KeyError:   'lr' ", "AssertionError: batch 64 != 4 * 8"]
    truth, lines, _ = run(real, seed=1)
    assert truth.root_line_nos_for("KeyError: 'lr'") == [truth.line_map[1]]  # exact beats squashed
    assert truth.root_line_nos_for("KeyError:  'lr'") == [truth.line_map[1], truth.line_map[2]]
    assert truth.root_line_no_for("batch 64 != 4") == truth.line_map[3]  # a quoted part of a line
    assert truth.root_line_no_for("not there") is None
    assert truth.original_index_at(truth.line_map[3]) == 3
    assert truth.original_index_at(1) is None
    assert truth.strip_prefix(1, lines[0]) == lines[0]


def test_rejects_bad_input() -> None:
    for bad in ([], ["two\nlines"]):
        with pytest.raises(ValueError):
            bury(bad, io.StringIO(), seed=0)
    with pytest.raises(ValueError):
        bury(["x"], io.StringIO(), seed=0, style="nope")
    with pytest.raises(ValueError):
        bury(["x"], io.StringIO(), seed=0, ranks=1)


# -- the job around them ------------------------------------------------------------------------------


def test_healthy_part_is_long_and_has_every_rank() -> None:
    truth, lines, _ = run(TRACEBACK, ranks=64, lines=30000, seed=4)
    assert 25000 <= truth.lines_written <= 36000
    assert truth.lines_written == len(lines)
    before = lines[: truth.failure_line_no - 1]
    assert len(before) > 20000
    per_rank = Counter(int(m.group(1)) for line in before if (m := RANK_OF["torchrun"].match(line)))
    assert set(per_rank) == set(range(64))
    assert min(per_rank.values()) > 100, "every rank writes many lines (a progress line per step)"
    assert not any(CASCADE.search(line) for line in before), "no symptom before the failure"


@pytest.mark.parametrize("style", sorted(STYLES))
def test_cascade_comes_after_the_failure(style: str) -> None:
    truth, lines, _ = run(TRACEBACK, style=style, seed=12, ranks=64, lines=8000)
    first = truth.failure_line_no
    cascade = [(no, line) for no, line in enumerate(lines, start=1) if CASCADE.search(line)]
    if STYLES[style].launcher == "mpirun":  # mpirun kills every process at the first exit: no watchdog
        epilogue = [no for no, line in enumerate(lines, start=1) if line.startswith("mpirun ")]
        assert epilogue and all(no > first for no in epilogue)
        return
    assert len(cascade) >= 5
    assert all(no > first for no, _ in cascade)
    assert any("Watchdog caught collective operation timeout" in line for _, line in cascade)
    if STYLES[style].launcher == "torchrun":
        assert any("closing signal SIGTERM" in line for _, line in cascade)
        assert any("ChildFailedError" in line for _, line in cascade)
    elif STYLES[style].launcher == "srun":
        assert any(line.startswith("srun: error: ") for _, line in cascade)
    # the timeouts come on other ranks, stamped after the failure
    year = time.gmtime(truth.failure_time).tm_year
    for _, line in cascade:
        if "Watchdog caught" in line:
            assert f"[Rank {truth.culprit_rank}] Watchdog" not in line
            if m := C10_STAMP.search(line):
                md = m.group(1)
                t = datetime(year, int(md[:-2]), int(md[-2:]), int(m.group(2)), int(m.group(3)), int(m.group(4)),
                             tzinfo=UTC).timestamp()
                assert t >= int(truth.failure_time)


def test_neighbours_sometimes_notice_the_culprit_is_gone() -> None:
    noticed = 0
    for seed in range(6):
        truth, lines, _ = run(TRACEBACK, seed=seed)
        hits = [no for no, line in enumerate(lines, start=1) if "Connection closed by remote peer" in line]
        assert all(no > truth.line_map[len(TRACEBACK) - 1] for no in hits)
        assert all(f"remote peer {truth.culprit_host}<" in lines[no - 1] for no in hits)
        noticed += bool(hits)
    assert 1 <= noticed <= 5


def test_without_cascade_there_are_no_symptoms() -> None:
    truth, lines, _ = run(TRACEBACK, cascade=False, seed=12)
    assert not any(CASCADE.search(line) for line in lines)
    assert truth.line_map[len(TRACEBACK) - 1] > len(lines) - 200


def test_real_lines_interleave_with_other_ranks() -> None:
    interleaved = 0
    for seed in range(6):
        truth, lines, _ = run(TRACEBACK, ranks=64, lines=8000, seed=seed)
        span = lines[truth.line_map[0] - 1: truth.line_map[len(TRACEBACK) - 1]]
        others = [line for line in span if not line.startswith(f"[rank{truth.culprit_rank}]:")]
        interleaved += bool(others)
    assert interleaved >= 3


def test_clock_follows_a_timestamp_in_the_real_lines() -> None:
    real = ["2021-06-01 12:00:00,250 ERROR saving failed", "OSError: [Errno 28] No space left on device"]
    truth, lines, _ = run(real, seed=3)
    assert truth.anchored
    assert abs(truth.failure_time - datetime(2021, 6, 1, 12, 0, 0, 250000, tzinfo=UTC).timestamp()) < 0.01
    stamps = [(no, py_epoch(*m.groups())) for no, line in enumerate(lines, start=1)
              if no not in truth.line_map.values() and (m := PY_STAMP.search(line))]
    before = [t for no, t in stamps if no < truth.failure_line_no]
    after = [t for no, t in stamps if no > truth.line_map[1]]
    assert before and all(t.startswith("2021") for t in (time.strftime("%Y", time.gmtime(t)) for t in before))
    assert max(before) <= truth.failure_time + 0.3  # the last healthy lines print about then
    assert all(t >= truth.failure_time - 0.02 for t in after)
    # no timestamp: the job keeps its own date
    assert not run(TRACEBACK, seed=3)[0].anchored


def test_line_time_formats() -> None:
    assert line_time("2023-04-29 06:01:12.977 x", 2000) == datetime(2023, 4, 29, 6, 1, 12, 977000,
                                                                     tzinfo=UTC).timestamp()
    assert line_time("Mon Nov 27 10:39:24 2017[1,17]<stderr>:x", 2000) == datetime(
        2017, 11, 27, 10, 39, 24, tzinfo=UTC).timestamp()
    assert line_time("[rank1]:[E817 17:40:34.227531918 X.cpp:1] y", 2022) == pytest.approx(datetime(
        2022, 8, 17, 17, 40, 34, 227532, tzinfo=UTC).timestamp(), abs=1e-3)
    assert line_time("[E ProcessGroupNCCL.cpp:737] [Rank 2] Watchdog", 2022) is None
    assert line_time("Epoch 0: 6843.771 seconds", 2022) is None


def test_cli_writes_log_and_truth(tmp_path) -> None:
    src = tmp_path / "real.log"
    src.write_text("\n".join(TRACEBACK) + "\n", encoding="utf-8")
    out, tj = tmp_path / "out.log", tmp_path / "t.json"
    assert main([str(src), "-o", str(out), "--truth", str(tj), "--seed", "2", "--ranks", "16", "--lines", "3000",
                 "--style", "srun"]) == 0
    truth = json.loads(tj.read_text())
    lines = out.read_text(encoding="utf-8").split("\n")
    last = str(len(TRACEBACK) - 1)
    assert lines[truth["line_map"][last] - 1] == truth["prefixes"][last] + ROOT


# -- scoring buried runs (evaluate.py) ---------------------------------------------------------------


def _report(line_no: int, text: str, ranks: list[int] | None = None, hosts: list[str] | None = None) -> Report:
    return Report(status="failed", category="script", failure_type="name_error", action="no_restart",
                  confidence=0.9, culprits=Culprits(ranks=ranks or [], hosts=hosts or []),
                  root_cause=RootCause(line_no=line_no, text=text), evidence=[], explanation="", hint="",
                  compression={"lines_in": 1, "templates": 1, "lines_kept": 1}, timings_ms={})


def test_buried_root_line_scoring_needs_the_right_place_and_text() -> None:
    truth, lines, _ = run(TRACEBACK, seed=1)
    no = truth.root_line_no_for(ROOT)
    assert buried_root_line_correct(ROOT, _report(no, lines[no - 1]), truth)
    assert not buried_root_line_correct(ROOT, _report(no + 1, lines[no - 1]), truth)  # right text, wrong line
    assert not buried_root_line_correct(ROOT, _report(no, "[rank0]:something else"), truth)
    assert not buried_root_line_correct("not in the log", _report(no, lines[no - 1]), truth)


def test_buried_culprit_scoring() -> None:
    truth, lines, _ = run(TRACEBACK, seed=1, culprit_rank=3)
    assert buried_culprit_correct(None, _report(1, ""), truth) is None
    assert buried_culprit_correct("rank 3", _report(1, "", ranks=[3]), truth)
    assert buried_culprit_correct("some-host", _report(1, "", hosts=[truth.culprit_host]), truth)
    assert not buried_culprit_correct("some-host", _report(1, "", ranks=[4], hosts=["elsewhere"]), truth)
    assert label_culprit_rank({"culprit": "rank 12"}, 64) == 12
    assert label_culprit_rank({"culprit": "rank 99"}, 64) is None
    assert label_culprit_rank({"culprit": "node-3 (GPU 1c:00.0)"}, 64) is None


def test_bury_variants_differ_and_are_stable() -> None:
    a = bury_variants("x1", 0, 4)
    assert a == bury_variants("x1", 0, 4)
    assert len({v["seed"] for v in a}) == 4 and len({v["style"] for v in a}) == 4
    assert any(not v["prefix_real"] for v in a) and any(v["prefix_real"] for v in a)
    assert bury_variants("x1", 0, 2, base_seed=1)[0]["seed"] != a[0]["seed"]


@pytest.mark.slow
def test_pipeline_finds_a_buried_root_line(tmp_path) -> None:
    from logdx.config import load_settings
    from logdx.pipeline import Engine

    settings = load_settings()
    settings.llm.enabled = False
    engine = Engine.create(settings)
    path = tmp_path / "job.log"
    with open(path, "w", encoding="utf-8", newline="") as out:
        truth = bury(TRACEBACK, out, seed=21, ranks=32, lines=10000, style="torchrun_tee")
    report, _ = engine.diagnose_path(path)
    assert buried_root_line_correct(ROOT, report, truth)
