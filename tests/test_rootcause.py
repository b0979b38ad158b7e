"""Choosing the root cause across ranks: symptoms never win, the earliest cause does, with the
exceptions that make that rule right (graver faults, survived errors, silent ranks)."""

from __future__ import annotations

import pytest

from logdx.config import load_settings
from logdx.pipeline import Engine


@pytest.fixture(scope="module")
def engine() -> Engine:
    s = load_settings(env={})
    s.llm.enabled = s.retrieval.enabled = False
    return Engine.create(s)


def diagnose(engine: Engine, lines: list[str], exit_code: int | None = None):
    session = engine.new_session()
    session.feed_lines(lines)
    return session.report(exit_code=exit_code)


def progress(rank: int, i: int, t: str = "12:00:00") -> str:
    return f"[rank{rank}]:2024-05-01 {t},000 - INFO - iteration {i} | loss 2.{i % 10} | lr 1e-4"


def watchdog(rank: int, seq: int = 42, t: str = "12:30:00") -> str:
    return (f"[rank{rank}]:[E501 {t}.000 ProcessGroupNCCL.cpp:607] [Rank {rank}] Watchdog caught collective "
            f"operation timeout: WorkNCCL(SeqNum={seq}, OpType=ALLREDUCE, Timeout(ms)=1800000) ran for 1800004 milliseconds before timing out.")


def test_symptoms_only_name_the_silent_rank(engine):
    lines = [progress(r, 1) for r in range(16)] + [watchdog(r) for r in range(16) if r != 5]
    report = diagnose(engine, lines)
    assert (report.category, report.failure_type, report.action) == ("infrastructure", "nccl_timeout", "restart")
    assert report.culprits.ranks == [5]
    assert report.confidence <= 0.6


def test_symptoms_only_name_the_rank_lagging_in_collective_sequence(engine):
    lines = [progress(r, 1) for r in range(8)] + [watchdog(r, seq=100) for r in range(8) if r != 3] + [watchdog(3, seq=99)]
    assert diagnose(engine, lines).culprits.ranks == [3]


def test_a_graver_fault_just_after_explains_an_earlier_lesser_one(engine):
    lines = [progress(r, 1) for r in range(8)]
    lines.append("[rank1]:2024-05-01 12:00:05,000 - ERROR - torch.distributed.DistNetworkError: The client socket has "
                 "timed out after 600s while trying to connect to (node-0, 29500).")
    lines.append("slurmstepd: error: *** JOB 77 ON node-1 CANCELLED AT 2024-05-01T12:01:00 DUE TO NODE FAILURE, SEE SLURMCTLD LOG FOR DETAILS ***")
    report = diagnose(engine, lines)
    assert report.failure_type == "node_failure"
    assert report.culprits.hosts == ["node-1"]
    assert report.root_cause.line_no == 10


def test_the_earliest_root_cause_wins_over_later_ones(engine):
    lines = [progress(r, 1) for r in range(4)]
    lines.append("[rank2]:2024-05-01 12:00:07,000 - ERROR - RuntimeError: CUDA error: uncorrectable ECC error encountered")
    lines.append("[rank0]:2024-05-01 12:00:09,000 - ERROR - OSError: [Errno 28] No space left on device")
    report = diagnose(engine, lines)
    assert report.failure_type == "ecc_error" and report.culprits.ranks == [2]


def test_an_error_the_rank_trained_past_is_not_the_root(engine):
    lines = ["[rank0]:2024-05-01 12:00:00,000 - WARNING - OSError: [Errno 28] No space left on device"]
    lines += [progress(0, i, f"12:{10 + i // 60:02d}:{i % 60:02d}") for i in range(0, 600, 5)]
    lines.append("[rank0]:2024-05-01 12:30:00,000 - ERROR - RuntimeError: CUDA error: uncorrectable ECC error encountered")
    assert diagnose(engine, lines).failure_type == "ecc_error"


def test_exit_code_zero_forgives_what_training_survived(engine):
    lines = [progress(0, 1), "[rank0]: NVRM: Xid (PCI:0000:3b:00): 13, pid=77, Graphics SM Warp Exception", progress(0, 2)]
    assert diagnose(engine, lines, exit_code=0).status == "healthy"
    assert diagnose(engine, lines).status == "failed"


def test_failed_exit_with_nothing_recognised_is_unknown(engine):
    lines = [progress(0, 1), "[rank0]: frobnicator says: the flux capacitor is out of phase (code 7)"]
    report = diagnose(engine, lines, exit_code=3)
    assert (report.status, report.category, report.failure_type) == ("failed", "unknown", "unknown")


def test_the_hint_names_the_culprit_resolved_from_other_lines(engine):
    lines = [f"node-4: node-4:9{r}:9{r} [{r}] NCCL INFO comm 0xab rank {8 + r} nranks 16 cudaDev {r} busId {r + 1}a000 - Init COMPLETE"
             for r in range(8)]
    lines.append("node-4: [Wed May  1 12:00:05 2024] NVRM: Xid (PCI:0000:3a:00): 79, pid=93, GPU has fallen off the bus.")
    report = diagnose(engine, lines)
    assert report.failure_type == "gpu_fell_off_bus"
    assert (report.culprits.hosts, report.culprits.ranks) == (["node-4"], [10])
    assert "node-4" in report.hint and "?" not in report.hint
