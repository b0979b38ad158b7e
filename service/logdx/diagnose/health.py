"""Healthy is earned: what a log must show for its job to be called healthy, and what its end means.

A job is `healthy` when its log shows it (`health_of`):

- the run said it finished: an end marker after its last step (the completion lines of the frameworks
  and launchers, timeline.yaml `completions`: torchelastic's `worker group successfully finished`,
  MLPerf's `run_stop` with `"status": "success"`, the HF Trainer's final metrics...);
- it exited 0 (the caller knows it) and nothing in its log ended a process;
- its training went on after every error the log shows (and it trained at all).

A log that shows neither a fault nor health (a few start-up lines, a warning pasted alone, training
that stops on an error nobody knows) is `unknown`, and the report says what it lacked.

What a job prints after its end marker cannot fail it (`after_the_end`): teardown warnings (NCCL closing
its communicators, slurmstepd while the step is torn down, NVML), a launcher's agent stopped while it waits
for the others, the node's kernel lines past the end. Only the job's own last words still do
(`fails_after_the_end`): an uncaught exception its code raised, or a process saying it aborts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from logdx.diagnose.life import (
    MIN_ADVANCES,
    ends_its_process,
    is_warning,
    said_it_completed,
    says_it_aborts,
    went_on_after,
)
from logdx.diagnose.rules import RuleHit
from logdx.model import FT, CompressionSummary, Event, EventKind, ProgressSummary, Role
from logdx.patterns import mask
from logdx.taxonomy import is_hardware, is_resubmit

__all__ = ["Health", "RunEnd", "after_the_end", "fails_after_the_end", "faults_after_the_end", "health_of", "run_end",
           "unsettled_loss_jump"]

# How sure a healthy verdict is, by what showed it: the run's own end, or the job's exit code, is
# stronger than training that merely went on past its errors (the log may stop short of its end).
_CONFIDENCE_EXIT_OR_END = 0.95
_CONFIDENCE_WENT_ON = 0.85
_UNKNOWN_CONFIDENCE = 0.5


@dataclass(frozen=True, slots=True)
class RunEnd:
    """Where the run said it finished: its last end marker after its last step."""

    line_no: int
    ts: float | None


def run_end(progress: ProgressSummary) -> RunEnd | None:
    if not said_it_completed(progress):
        return None
    return RunEnd(line_no=progress.completed_line, ts=progress.completed_ts)


def after_the_end(event: Event, end: RunEnd) -> bool:
    """The event came after the run's end marker: by the lines' own clocks when both say a time (a node's
    kernel file arrives in any order), else by line."""
    if event.ts is not None and end.ts is not None and event.ts != end.ts:
        return event.ts > end.ts
    if event.anchor.unanchored:
        return False  # a boot clock nobody anchored: its time is unknown, and arrival says nothing
    at = event.anchor.at  # a line without a stamp: written no earlier than its stream's last stamp
    if event.ts is None and at is not None and end.ts is not None and at > end.ts:
        return True
    return event.line_no > end.line_no


def fails_after_the_end(event: Event, hit: RuleHit | None) -> bool:
    """What even a run's end marker does not outrank: a process saying it aborts, or an exception raised
    by the job's own code that is neither an echo of another failure nor a stop from outside (a launcher's
    agent interrupted while it waits for the others, the scheduler ending the step)."""
    if says_it_aborts(event.anchor.text):
        return True
    if not event.exception_type:
        return False
    if hit is None:
        return True
    ft = hit.label.failure_type
    return hit.role is not Role.SYMPTOM and ft != FT.CANCELLED and not is_resubmit(ft)


@dataclass(frozen=True, slots=True)
class Health:
    """What the log shows of the job's health when no failure was found."""

    healthy: bool
    confidence: float
    explanation: str
    hint: str = ""  # unknown: what would show it


def health_of(summary: CompressionSummary, unexplained: Sequence[Event], exit_code: int | None) -> Health:
    """Healthy by the job's exit code, by its end marker, or by training that went on after every error
    no rule knew; else unknown, saying what the log lacks."""
    progress = summary.progress
    if exit_code == 0:
        return Health(True, _CONFIDENCE_EXIT_OR_END,
                      "No failure found: the job exited 0 and nothing in its log ended a process.")
    end = run_end(progress)
    if end is not None:
        return Health(True, _CONFIDENCE_EXIT_OR_END,
                      f"No failure found: the run said it finished (line {end.line_no}), and nothing before "
                      "it ended a process.")
    if progress.job_advances < MIN_ADVANCES:
        what = "no training progress" if progress.lines == 0 else "too little training progress to judge by"
        return _unknown(f"the log shows {what}, no end of the run, and no exit code")
    jump = unsettled_loss_jump(progress.loss)
    if jump is not None:
        at, before, peak, now = jump
        return _unknown(f"the loss jumped from {before:.4g} to {peak:.4g} at step {at:.0f} and was still at "
                        f"{now:.4g} when the log ends; too few loss points to tell a passing "
                        "spike from a divergence, and the log shows no end of the run and no exit code")
    stuck = _not_gone_past(unexplained, summary)
    if stuck:
        last = max(stuck, key=lambda e: e.line_no)
        return _unknown(f"training did not go on after line {last.line_no} ({_clip(last.anchor.raw)}), and the "
                        "log shows no end of the run and no exit code")
    return Health(True, _CONFIDENCE_WENT_ON,
                  "No failure found: training went on after everything the log reports, to the end of the log.")


# A course of fewer loss points than this is too short for the timeline's divergence watch to know the
# loss's usual wobble (its first jump is its only measure of it), so a blow-up that fell back part of the
# way reads to it as noise. Health must then be shown another way.
_SHORT_COURSE = 10
_WARM_UP_STEP = 50  # the first steps jump about (as the timeline's watch): no blow-up there
_BACK_ON_COURSE = 1.05  # within 5% of the loss before the jump: back on its course


def unsettled_loss_jump(loss: Sequence[tuple[float, float]]) -> tuple[float, float, float, float] | None:
    """In a loss course too short to judge by its wobble: a point half as high again as every loss before it
    (6.4 -> 11.4), after warm-up, with the last point still above where the loss was before it. Returns
    (step, loss before, peak, last loss)."""
    points = [(s, v) for s, v in loss if math.isfinite(v)]
    if not 3 <= len(points) < _SHORT_COURSE:
        return None
    low = points[0][1]
    for i in range(1, len(points)):
        step, value = points[i]
        if step >= _WARM_UP_STEP and value > 1.5 * low + 0.3:
            last = points[-1][1]
            if last > _BACK_ON_COURSE * low:
                peak = max(v for _, v in points[i:])
                return step, low, peak, last
            return None
        low = min(low, value)
    return None


def faults_after_the_end(after: Sequence[tuple[Event, RuleHit]], progress: ProgressSummary, limit: int = 3) -> list[str]:
    """Notes for the hardware faults a node reported after the run had finished (a fatal Xid in the kernel
    lines an epilog appended): not this job's failure, but the node's, before it runs the next one."""
    end = run_end(progress)
    if end is None:
        return []
    out: list[str] = []
    seen: set[tuple[str, str]] = set()
    for event, hit in sorted(after, key=lambda eh: eh[0].line_no):
        ft = hit.label.failure_type
        where = hit.host or (f"rank {hit.rank}" if hit.rank is not None else "a node")
        if not is_hardware(ft) or not after_the_end(event, end) or (where, ft) in seen:
            continue
        seen.add((where, ft))
        out.append(f"after the run had finished (line {end.line_no}), {where} reported {hit.title} (line "
                   f"{event.line_no}): not this job's failure; check the node before it runs another job")
        if len(out) >= limit:
            break
    return out


def _not_gone_past(events: Sequence[Event], summary: CompressionSummary) -> list[Event]:
    """The events training did not go on after, but for a line that only says a condition cleared, and for
    one the job already ran past earlier in the log (the same line, digits aside: a tokenizer warning in
    the last step of a log cut while it trains)."""
    stuck: list[Event] = []
    gone_past: list[Event] = []
    for e in events:
        if e.attrs.get("clears"):
            continue
        (gone_past if _went_on(e, summary) else stuck).append(e)
    if not stuck or not gone_past:
        return stuck
    seen = {mask(e.anchor.text) for e in gone_past}
    return [e for e in stuck if ends_its_process(e) or mask(e.anchor.text) not in seen]


def _went_on(event: Event, summary: CompressionSummary) -> bool:
    """Training advanced after it; after a warning (the program says it goes on), one progress line
    after it is enough."""
    if event.kind == EventKind.STALL:
        return False
    return went_on_after(event, summary) or (is_warning(event) and went_on_after(event, summary, at_least=1))


def _unknown(why: str) -> Health:
    return Health(False, _UNKNOWN_CONFIDENCE, f"No failure found, and no health shown: {why}.",
                  hint="Give the job's exit code if you know it, or its whole log: the run's end, or training "
                       "going on past its errors, shows health.")


def _clip(text: str, limit: int = 120) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[: limit - 1] + "…"
