"""What a failure cost, from the log: multi-attempt jobs with known timings (logdx.synth.attempts)."""

from __future__ import annotations

import io

import pytest

from logdx.act.report import Report
from logdx.diagnose.cost import restarts_of
from logdx.model import ProgressSummary, Restart
from logdx.pipeline import Engine
from logdx.synth.attempts import AttemptPlan, AttemptsTruth, write_attempts_job
from logdx.testing import diagnose_lines


def _job(plans: list[AttemptPlan], hosts: int = 4, seed: int = 0, **kw: object) -> tuple[list[str], AttemptsTruth]:
    out = io.StringIO()
    truth = write_attempts_job(out, plans, hosts=[f"gpu-node-{i:02d}" for i in range(hosts)], seed=seed, **kw)  # type: ignore[arg-type]
    return out.getvalue().splitlines(), truth


def _near(got: float | None, want: float, within: float = 0.10) -> bool:
    return got is not None and abs(got - want) <= within * abs(want)


@pytest.mark.parametrize("seed,hosts,fail_at", [(1, 2, 2340), (2, 4, 4777), (3, 8, 1260)])
def test_one_failure_costs_the_work_since_the_last_checkpoint(engine: Engine, seed: int, hosts: int, fail_at: int) -> None:
    lines, truth = _job([AttemptPlan(fail_at, "xid79", culprit_host=hosts - 1)], hosts=hosts, seed=seed)
    report = diagnose_lines(engine, lines)
    assert report.status == "failed" and report.cost is not None
    c, t = report.cost, truth.attempts[0]
    assert c.gpus == truth.gpus == hosts * 8
    assert c.since == "checkpoint" and c.checkpoint_step == t.checkpoint_step
    assert t.lost_gpu_hours is not None and _near(c.lost_gpu_hours, t.lost_gpu_hours)
    assert c.failure_ts is not None and t.failure_ts is not None and abs(c.failure_ts - t.failure_ts) < 1
    assert c.notes == []


def test_a_restarted_attempt_is_found_and_each_failure_costed(engine: Engine) -> None:
    plans = [AttemptPlan(4350, "xid79", culprit_host=2, downtime_s=900), AttemptPlan(5230, "oom", culprit_rank=5)]
    lines, truth = _job(plans, seed=7)
    report = diagnose_lines(engine, lines)
    assert report.status == "failed" and report.failure_type == "cuda_oom" and report.cost is not None
    c = report.cost
    first, second = truth.attempts
    assert second.lost_gpu_hours is not None and _near(c.lost_gpu_hours, second.lost_gpu_hours)
    assert c.checkpoint_step == 5000
    [earlier] = c.earlier_attempts
    assert earlier.failure_step == 4350 and earlier.checkpoint_step == 4000 and earlier.resumed_step == 4010
    assert first.lost_gpu_hours is not None and _near(earlier.lost_gpu_hours, first.lost_gpu_hours)
    assert first.next_first_step_ts is not None and first.failure_ts is not None and first.passed_ts is not None
    assert _near(earlier.stood_still_s, first.next_first_step_ts - first.failure_ts)
    assert _near(earlier.back_after_s, first.passed_ts - first.failure_ts)


def test_a_failure_in_the_restarted_attempt_counts_from_that_attempt_not_the_old_checkpoint(engine: Engine) -> None:
    # Attempt 2 resumes from step 4000 and fails at 4200 before its own next save: the checkpoint at 4000
    # was saved long before, in attempt 1; this failure lost only what attempt 2 did.
    plans = [AttemptPlan(4350, "xid79", culprit_host=1), AttemptPlan(4200, "oom", culprit_rank=3)]
    lines, truth = _job(plans, seed=3)
    report = diagnose_lines(engine, lines)
    assert report.cost is not None
    second = truth.attempts[1]
    assert report.cost.since == "attempt_start" and report.cost.checkpoint_step == 4000
    assert second.lost_gpu_hours is not None and _near(report.cost.lost_gpu_hours, second.lost_gpu_hours)


def test_no_checkpoint_counts_from_the_first_line_and_says_so(engine: Engine) -> None:
    lines, truth = _job([AttemptPlan(1800, "xid79", culprit_host=0)], save_every=10_000, seed=4)
    report = diagnose_lines(engine, lines)
    assert report.cost is not None
    t = truth.attempts[0]
    assert t.failure_ts is not None
    assert report.cost.checkpoint_step is None and report.cost.since in ("attempt_start", "job_start")
    assert _near(report.cost.lost_gpu_hours, truth.gpus * (t.failure_ts - truth.first_ts) / 3600)
    if report.cost.since == "job_start":
        assert any("no checkpoint" in n for n in report.cost.notes)


def test_no_timestamps_give_notes_not_a_guess(engine: Engine) -> None:
    lines, _ = _job([AttemptPlan(2350, "xid79", culprit_host=1)], seed=5)
    report = diagnose_lines(engine, [line.split(" ", 1)[1] for line in lines])
    assert report.status == "failed" and report.cost is not None
    assert report.cost.lost_gpu_hours is None and report.cost.failure_ts is None
    assert report.cost.checkpoint_step == 2000  # known by its line, only its time is missing
    assert any("no timestamps" in n for n in report.cost.notes)


def test_every_failed_report_has_a_cost_and_healthy_ones_none(engine: Engine) -> None:
    failed = diagnose_lines(engine, ["Traceback (most recent call last):", '  File "train.py", line 3, in <module>',
                                     "KeyError: 'lr'"])
    assert failed.status == "failed" and failed.cost is not None
    assert failed.cost.lost_gpu_hours is None and failed.cost.notes  # nothing to count with: says what is missing
    lines, _ = _job([AttemptPlan(600, "ok")], seed=6)
    healthy = diagnose_lines(engine, lines)
    assert healthy.status == "healthy" and healthy.cost is None
    assert Report.model_validate_json(failed.model_dump_json()).cost == failed.cost


def test_a_counter_falling_to_no_checkpoint_is_no_restart() -> None:
    # An epoch's bar starting again (0 -> 1000, then 0 again) falls to no saved checkpoint.
    p = ProgressSummary(checkpoints=[(500, 10)], checkpoint_ts=[100.0],
                        restarts=[Restart(from_step=1000, from_ts=200.0, to_step=1, line_no=20, ts=210.0),
                                  Restart(from_step=1000, from_ts=300.0, to_step=501, line_no=30, ts=320.0)])
    assert [r.to_step for r in restarts_of(p)] == [501]


def test_the_launchers_world_size_counts_the_gpus_whose_lines_are_not_in_the_log(engine: Engine) -> None:
    # Only node 0's file (ranks 0-7) was collected; DeepSpeed's launcher said the job had 64 GPUs.
    lines, truth = _job([AttemptPlan(2350, "xid79", culprit_host=0)], hosts=1, seed=8)
    head = "2026-01-01T00:00:00.000Z gpu-node-00: [2026-01-01 00:00:00,000] [INFO] [launch.py:164:main] dist_world_size=64"
    report = diagnose_lines(engine, [head, *lines])
    assert report.cost is not None and report.cost.gpus == 64 and report.cost.gpus_from == "launcher"
    t = truth.attempts[0]
    assert t.lost_gpu_hours is not None
    assert _near(report.cost.lost_gpu_hours, t.lost_gpu_hours * 64 / truth.gpus)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["spike", "nan"])
def test_a_diverged_run_loses_the_work_since_the_checkpoint_before_the_divergence(engine: Engine, kind: str) -> None:
    from logdx.synth.divergence import FLAVOURS_OF, divergence_job

    out = io.StringIO()
    truth = divergence_job(out, seed=3, flavour=FLAVOURS_OF[kind][0], style="torchrun", ranks=8, lines=6000, kind=kind)
    report = diagnose_lines(engine, out.getvalue().splitlines(), exit_code=truth.exit_code)
    assert report.status == "failed" and report.cost is not None
    assert report.cost.checkpoint_step == truth.variant["rollback_to"]  # not a checkpoint saved with the damage
    assert report.cost.since == "checkpoint" and report.cost.lost_gpu_hours
