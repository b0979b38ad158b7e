"""What a failure cost: the GPU time since the last checkpoint saved before it, read from the log.

The infrastructure failures are few but take most of the lost GPU time (they strike long, large jobs late),
so a report says what its failure cost, part by part, from what the timeline already holds (no work per
line): the job's GPUs, the last checkpoint saved before the failure, the failure's time, and, when the log
holds the attempt restarted after it, how long the job stood still and how long until it was back at the
step where it failed. A part the log does not give is None with a note saying what is missing; nothing
is guessed.

    lost_gpu_hours = gpus * (failure time - since) / 3600

`since` is the later of the last checkpoint saved before the failure and the first progress line of the
attempt the failure is in (the work before that attempt began is the earlier failure's cost), or the job's
first line when neither is known (a note says so).

A fall of the step counter is a restarted attempt when it went on from a checkpoint the log saved before
(at or just after its step); an epoch's bar starting again falls to no checkpoint and is not one.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from logdx.model import CompressionSummary, Cost, Diagnosis, LostWork, ProgressSummary, Restart, TemplateStats

__all__ = ["cost_of", "restarts_of"]

_HOUR = 3600.0
# The world size as launchers print it once at start-up (read from each template's sample, at diagnosis time).
_WORLD_SIZE = re.compile(
    r"\bdist_world_size=(\d+)"                      # DeepSpeed's launcher
    r"|\busing world size: (\d+)"                   # Megatron-LM's arguments
    r"|\bglobal_world_sizes=\[(\d+)"                # torchrun's elastic agent, "Rendezvous complete"
    r"|\bNum processes: (\d+)"                      # Hugging Face accelerate's environment
    r"|\bNCCL INFO comm \S+ rank \d+ nranks (\d+)")  # NCCL's communicator init (the largest is the world)


def cost_of(diagnosis: Diagnosis, summary: CompressionSummary, templates: Sequence[TemplateStats] = ()) -> Cost:
    """The cost of a failed diagnosis's failure (and of earlier attempts' failures the log shows)."""
    notes: list[str] = []
    gpus, gpus_from = _gpus(summary, templates)
    if gpus is None:
        notes.append("GPUs unknown: the log names no rank and no launcher world size")
    p = summary.progress
    restarts = restarts_of(p)
    root = diagnosis.root
    failure_ts = None
    if root is not None:
        failure_ts = root.ts if root.ts is not None else root.at
    if failure_ts is None:
        failure_ts = summary.last_ts
        if failure_ts is not None:
            notes.append(("the root line has no time" if root is not None else "no root line")
                         + ": the failure is taken at the log's last timestamp")
    if failure_ts is None:
        notes.append("failure time unknown: the log's lines carry no timestamps")
    line = root.line_no if root is not None else None
    before = [r for r in restarts if _before(r, failure_ts, line)]
    after = [r for r in restarts if r not in before]
    attempt_start = before[-1] if before else None
    failure = _lost(p, failure_ts, line, _step_at_failure(p, attempt_start, after), attempt_start,
                    after[0] if after else None, gpus, summary.first_ts, notes, _diverged_at(p, line))
    earlier = [_lost(p, r.from_ts, None, r.from_step, before[i - 1] if i else None, r, gpus, summary.first_ts, [])
               for i, r in enumerate(before)]
    return Cost(gpus=gpus, gpus_from=gpus_from, failure=failure, earlier=earlier, notes=notes)


def restarts_of(p: ProgressSummary) -> list[Restart]:
    """The falls of the step counter that resumed from a checkpoint saved before them."""
    delta = min((s.step_delta for s in p.sources if s.step_delta), default=1.0)
    out = []
    for r in p.restarts:
        saved = [step for i, (step, line) in enumerate(p.checkpoints) if line < r.line_no
                 and _saved_by(p, i, r.ts)]
        if any(step <= r.to_step <= step + 2 * delta + 1 for step in saved):
            out.append(r)
    return out


def _saved_by(p: ProgressSummary, i: int, ts: float | None) -> bool:
    saved = p.checkpoint_ts[i] if i < len(p.checkpoint_ts) else None
    return saved is None or ts is None or saved <= ts


def _gpus(summary: CompressionSummary, templates: Sequence[TemplateStats]) -> tuple[int | None, str]:
    """The launcher's world size (the log may hold some nodes' lines only), else 1 + the highest rank seen."""
    said = [int(g) for t in templates if (m := _WORLD_SIZE.search(t.sample)) for g in m.groups() if g]
    if said and max(said) >= summary.world_size:
        return max(said), "launcher"
    if summary.world_size > 0:
        return summary.world_size, "ranks"
    if summary.rank_hosts:
        return len(summary.rank_hosts), "ranks"
    return None, ""


def _before(r: Restart, failure_ts: float | None, line: int | None) -> bool:
    """The restarted attempt began before the failure (by the clocks, else by the lines)."""
    if failure_ts is not None and r.ts is not None:
        return r.ts <= failure_ts
    return line is not None and r.line_no < line


def _diverged_at(p: ProgressSummary, line: int | None) -> float | None:
    """The step where the loss went wrong, when the failure is that divergence or came after it: a checkpoint
    saved since holds the damage (the run rolls back to one before it: `rollback_to_step`)."""
    d = p.divergence
    if d is None or d.step is None or (line is not None and line < d.line_no):
        return None
    return d.step


def _step_at_failure(p: ProgressSummary, attempt: Restart | None, after: list[Restart]) -> float | None:
    """Where the job was when it failed: where it fell back from, when a restart followed the failure; else
    the furthest its sources got (the failure ended them)."""
    if after:
        return after[0].from_step
    steps = [s.last_step for s in p.sources if s.last_step is not None]
    return max(steps) if steps else (p.last_step if attempt is None else None)


def _lost(p: ProgressSummary, failure_ts: float | None, line: int | None, step: float | None,
          attempt: Restart | None, restart: Restart | None, gpus: int | None, first_ts: float | None,
          notes: list[str], diverged: float | None = None) -> LostWork:
    w = LostWork(failure_ts=failure_ts, failure_step=step, failure_line=line)
    ck = _last_checkpoint(p, failure_ts, line, step, diverged)
    if diverged is not None:
        notes.append(f"the loss diverged at step {diverged:g}: checkpoints saved since hold the damage and do not count")
    if ck is not None:
        w.checkpoint_step, w.checkpoint_line, w.checkpoint_ts = ck
    starts = [("checkpoint", w.checkpoint_ts), ("attempt_start", attempt.ts if attempt is not None else None)]
    known = [(ts, what) for what, ts in starts if ts is not None]
    if known:
        w.since_ts, w.since = max(known)
    elif first_ts is not None:
        w.since, w.since_ts = "job_start", first_ts
        notes.append("no checkpoint line with a time before the failure: lost work counted from the job's first line"
                     if ck is None else f"the checkpoint at step {ck[0]} has no time: lost work counted from the "
                     "job's first line")
    else:
        notes.append("lost work unknown: no time for a checkpoint or for the job's first line")
    if ck is None and w.since != "job_start":
        notes.append("no checkpoint line before the failure")
    if w.since_ts is not None and failure_ts is not None:
        w.lost_s = max(0.0, failure_ts - w.since_ts)
        if gpus is not None:
            w.lost_gpu_hours = round(gpus * w.lost_s / _HOUR, 3)
    if restart is not None:
        w.restart_ts, w.resumed_step = restart.ts, restart.to_step
        if restart.ts is not None and failure_ts is not None:
            w.stood_still_s = max(0.0, restart.ts - failure_ts)
        w.passed_ts = restart.passed_ts
        if restart.passed_ts is not None and failure_ts is not None:
            w.back_after_s = max(0.0, restart.passed_ts - failure_ts)
        elif restart.passed_ts is None:
            notes.append("the restarted attempt never got back to the step where this failure struck")
    return w


def _last_checkpoint(p: ProgressSummary, failure_ts: float | None, line: int | None, step: float | None,
                     diverged: float | None = None) -> tuple[int, int, float | None] | None:
    """The last checkpoint saved before the failure (by the clocks, else by the lines), at or below its step."""
    best: tuple[int, int, float | None] | None = None
    for i, (ck_step, ck_line) in enumerate(p.checkpoints):
        ts = p.checkpoint_ts[i] if i < len(p.checkpoint_ts) else None
        if failure_ts is not None and ts is not None:
            if ts > failure_ts:
                continue
        elif line is not None and ck_line >= line:
            continue
        if (step is not None and ck_step > step) or (diverged is not None and ck_step >= diverged):
            continue
        best = (ck_step, ck_line, ts)  # in the order the log said them: the last one that qualifies
    return best
