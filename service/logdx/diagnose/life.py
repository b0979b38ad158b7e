"""Reading the life of a job, as an on-call engineer does, from its timeline (logdx/timeline.py).

- Did the job (or the rank that printed an event) go on making progress after the event? Then the
  event was survived: a note, never the root cause and never a reason to act. Start-up connection
  retries, NIC async events, retried uploads, skipped fp16 steps, one-off warnings: one mechanism
  for all of them, not a list of harmless messages.
- Where did the job stop advancing, and which rank stopped first (the silent rank of a hang)?
- Did its progress run to the end it announced?

In a job that never made progress (it died while starting), what a line says of itself decides
instead: a warning the program printed and went past is not the failure while a graver event
follows it (see `is_warning`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from logdx.model import (
    CompressionSummary,
    Event,
    EventKind,
    ProgressMark,
    ProgressSummary,
    SourceProgress,
    StoppedFirst,
)

__all__ = ["Stop", "ends_its_process", "first_stopped", "is_warning", "ran_to_completion", "said_it_completed", "says_it_aborts",
           "stop_of", "stopped_by_output", "stopped_by_progress", "went_on_after"]

# The job, or the rank, advanced this many times after an event: it went on. One is not enough: a step
# already in flight when a rank died can still be printed by the others (a collective needs everyone
# for the next one).
MIN_ADVANCES = 2
# A warning as the program itself prints it: glog/c10d "[W1113 ..." / "W1113 ...", Python logging's
# WARNING, warnings.warn "...: UserWarning: ...", "Warning:". NCCL prints its errors as "NCCL WARN": not a
# warning level.
_WARNING_LEVEL = re.compile(
    r"^\s*(?:\[W\s?\d{3,4}\b|\[W [\w.]+:\d+\]|W\d{3,4} \d|\[?WARN(?:ING)?\]?[\s:\]]|[\w.]*Warning: |Warning: )"
    r"|^\S*\s*-\s*WARNING\s*-|\|\s*WARNING\s*\||\[WARNING\]|:\d+: \w*Warning: ")


def is_warning(event: Event) -> bool:
    """The program says it goes on after this: the line is printed at warning level, or the program
    announced right after it that it tries again ("Retrying in 1s [Retry 1/5]")."""
    if event.attrs.get("retried"):
        return True
    text = event.anchor.text
    return "NCCL WARN" not in text and _WARNING_LEVEL.search(text) is not None


def _source(progress: ProgressSummary, key: str) -> SourceProgress | None:
    for s in progress.sources:
        if s.key == key:
            return s
    return None


# Events that end what printed them, by their nature: an exception that reached the top, a process
# killed, a launcher's report of it, a GPU the kernel gave up on. The others (a line that says
# something went wrong: a retry, an async event, a logged error) may be what the process went on after.
_TERMINAL_KINDS = frozenset({
    EventKind.TRACEBACK, EventKind.SIGNAL_EXIT, EventKind.CHILD_FAILED, EventKind.XID, EventKind.LOSS_NAN,
    EventKind.LOSS_SPIKE, EventKind.STALL, EventKind.STACK_DUMP, EventKind.FR_REPORT,
})
# How much a process must go on printing (lines without an error word) after such a line, in a job that
# makes no progress to judge by, for the line to be one it went on after: its own lines when the log
# tells the processes apart, the job's when it does not (every process shares one stream).
_OWN_LINES_AFTER = 20
_JOB_LINES_AFTER = 100


# A process saying it ends itself: "NaN detected in loss, aborting.", "Aborted (core dumped)", glog's and
# loggers' FATAL level, "Fatal Python error", C++'s "terminate called after throwing" and its "  what():  ..."
# line, a segfault, NCCL's watchdog "taking the entire process down". Not git's lowercase "fatal: not a git
# repository" (a child a script ran), nor NCCL's INFO "Abort COMPLETE" of a communicator being closed.
_ABORTS = re.compile(
    r"(?i:\baborting\b|\bfatal error\b|segmentation fault|\bcore dumped\b|terminate called after throwing"
    r"|taking the entire process down)|\bAborted\b|\bFATAL\b|^\s*Fatal\b|Fatal Python error|^\s*what\(\):\s")


def says_it_aborts(text: str) -> bool:
    """The line is a process's own word that it ends: it outranks an exit code of 0 and an end marker."""
    return _ABORTS.search(text) is not None


def ends_its_process(event: Event) -> bool:
    """By its nature the event can end what printed it: a terminal kind, an exception raised, or a
    process saying it aborts."""
    return event.kind in _TERMINAL_KINDS or bool(event.exception_type) or says_it_aborts(event.anchor.text)


def went_on_after(event: Event, summary: CompressionSummary, *, at_least: int = MIN_ADVANCES,
                  whose: str | None = None) -> bool:
    """The rank that printed the event (`whose`: the source whose progress counts instead, such as the
    process on a GPU the kernel reported), when it prints progress of its own, else the whole job,
    advanced `at_least` times after it; or, for an event that does not end its process by nature, the
    process went on doing its work (printing) long after it.

    "After" is read where it is sure, whatever order the job's streams (files, uploads of a host) arrive in:
    a rank's own lines, and the lines of one stream, come in the order they were written; across streams,
    the lines' own clocks tell (a line without a stamp keeps its stream's time before it, so its time
    is a lower bound: read only where the event carries a stamp of its own). Only where neither can tell is
    the order of arrival read."""
    mark = event.attrs.get("progress_at")
    if whose is not None and whose != event.anchor.source_key:
        by_time = _advanced_after_in_time(event, summary, whose, at_least)
        if by_time is not None:
            return by_time
    if not isinstance(mark, ProgressMark):
        return False
    own = _own_progress(event, summary)
    if own is not None:
        if _advanced_after(event, summary, mark, at_least):
            return True
    else:
        by_time = _advanced_after_in_time(event, summary, event.anchor.source_key, at_least)
        if by_time is not None:
            return by_time
        in_stream = _stream_went_on(mark, summary, at_least)
        if in_stream is not None:
            return in_stream
        if event.ts is None and event.anchor.at is not None and event.anchor.until is None and ends_its_process(event):
            # When it was written is unknown past its stream's last stamp, and nothing of its stream says the
            # job went on after it: the order other streams arrived in cannot say so either.
            return False
        if _advanced_after(event, summary, mark, at_least):
            return True
    if ends_its_process(event) or not is_warning(event):
        return False  # only what the program itself says it goes on after (a warning, a retry)
    # Only where training says nothing: once the job makes progress after an event, its progress
    # decides (the steps in flight when a rank died are printed by the others).
    return summary.progress.lines == mark.job_lines and _printed_on_after(event, summary, mark)


def _own_progress(event: Event, summary: CompressionSummary) -> SourceProgress | None:
    key = event.anchor.source_key
    own = _source(summary.progress, key) if key != "-" else None
    return own if own is not None and own.advances >= MIN_ADVANCES else None


def _stream_went_on(mark: ProgressMark, summary: CompressionSummary, at_least: int) -> bool | None:
    """Whether a source of the event's stream that prints progress advanced `at_least` times since; None when
    no source of that stream prints any (a kernel log, a launcher's): the stream cannot tell."""
    if not mark.stream_advances:
        return None
    now = {s.key: s.advances for s in summary.progress.sources}
    return any(now.get(key, then) - then >= at_least for key, then in mark.stream_advances)


def _printed_on_after(event: Event, summary: CompressionSummary, mark: ProgressMark) -> bool:
    progress = summary.progress
    key = event.anchor.source_key
    if key != "-" and key in progress.quiet:
        return progress.quiet[key] - mark.source_quiet >= _OWN_LINES_AFTER
    return progress.job_quiet - mark.job_quiet >= _JOB_LINES_AFTER


def _advanced_after_in_time(event: Event, summary: CompressionSummary, key: str, at_least: int) -> bool | None:
    """Whether the source `key` (when it prints progress of its own), else any source of the job, advanced
    `at_least` times after the event's time; None when the clocks cannot tell: the event, or that progress,
    has no time, or its times equal the event's (a line without a stamp keeps the time of the one before)."""
    # A line without a stamp of its own was written by its stream's next stamp (unknown: no later stamp).
    t = event.ts if event.ts is not None else event.anchor.until
    if t is None:
        return None
    progress = summary.progress
    own = _source(progress, key) if key != "-" else None
    if own is not None and own.advances >= MIN_ADVANCES:
        return _rose_after(own, t, at_least) if own.advanced_at else None
    verdicts = [_rose_after(s, t, at_least) for s in progress.sources if s.advanced_at]
    if not verdicts:
        return None
    if any(verdicts):
        return True
    return None if None in verdicts else False


def _rose_after(source: SourceProgress, t: float, at_least: int) -> bool | None:
    """The source's counter rose `at_least` times after time `t`, or went `at_least` logging intervals past
    the step it had reached by then (a line read in eight stands for the ones between); None when some of
    its rises are stamped with `t` itself (the clock cannot tell them apart from the event)."""
    after = [step for ts, step in source.advanced_at if ts > t]
    if len(after) >= at_least:
        return True
    before = [step for ts, step in source.advanced_at if ts < t]
    reached = before[-1] if before else source.first_step
    delta = source.step_delta or 1.0
    if after and reached is not None and max(after) - reached >= at_least * delta * 0.999:
        return True
    if any(ts == t for ts, _ in source.advanced_at):
        return None
    return False


def _advanced_after(event: Event, summary: CompressionSummary, mark: ProgressMark, at_least: int) -> bool:
    """Steps, where the log numbers them: the source's (its own progress), else the job's highest, went
    `at_least` of its logging intervals (the smallest step between two progress lines) past where they
    were. Where it does not, progress lines counted instead."""
    progress = summary.progress
    key = event.anchor.source_key
    own = _source(progress, key) if key != "-" else None
    if own is not None and own.advances >= MIN_ADVANCES:  # a loop of its own (not one summary line)
        # Its own counter rising again after the event is the rank going on, whatever its numbers read
        # (a source whose lines give a step on some and an epoch on others has no one step series).
        if own.advances - mark.source_advances >= at_least:
            return True
        if own.last_step is not None and own.step_delta:
            before = mark.source_step if mark.source_step is not None else own.first_step
            return before is not None and own.last_step - before >= at_least * own.step_delta * 0.999
        return False
    if progress.last_step is not None:
        # Many ranks print the same step: the job's highest step must have moved on, not more ranks
        # printed it.
        if mark.job_step is None:
            # Training started after it: it must have advanced, not merely printed a line (a bar of
            # "Loading checkpoint shards 2/2" after a traceback pasted before the start-up lines).
            return progress.job_advances - mark.job_advances >= at_least
        delta = min((s.step_delta for s in progress.sources if s.step_delta), default=None)
        if delta:
            return progress.last_step - mark.job_step >= at_least * delta * 0.999
        return progress.job_rises - mark.job_rises >= at_least
    return progress.job_advances - mark.job_advances >= at_least


@dataclass(slots=True)
class Stop:
    """Where the job stopped advancing: its last progress."""

    step: float | None
    line_no: int
    ts: float | None


def stop_of(progress: ProgressSummary) -> Stop | None:
    if progress.lines == 0:
        return None
    return Stop(step=progress.last_step, line_no=progress.last_line, ts=progress.last_ts)


def said_it_completed(progress: ProgressSummary) -> bool:
    """After its last step, the run said its training is over ("Training completed", the trainer's final
    metrics); a progress line after it that does not advance (a bar's last refresh) does not take that
    back. Said before training advanced again, it was about something else: Lightning's batch-size finder
    runs a fit of three steps ("`Trainer.fit` stopped: `max_steps=3` reached.") before the real one."""
    if not progress.completed_line:
        return False
    return progress.completed_line > progress.last_line or progress.job_advances == progress.completed_advances


def ran_to_completion(progress: ProgressSummary, totals: dict[str, float] | None = None) -> bool:
    """Progress reached the total it announced ("iteration 100000/100000", a bar at 1000/1000)."""
    if not totals or progress.last_step is None:
        return False
    return any(progress.last_step >= t > 0 for t in totals.values())


def first_stopped(summary: CompressionSummary) -> StoppedFirst | None:
    """By progress when several ranks print it (the laggards), else by output (ranks that printed
    during training and fell silent while the job went on, or while the others reported the cascade)."""
    return stopped_by_progress(summary) or stopped_by_output(summary)


def _minority(n: int, of: int) -> bool:
    return 0 < n <= max(1, of // 8)


def stopped_by_progress(summary: CompressionSummary, *, min_lag: float = 1.5) -> StoppedFirst | None:
    """The few ranks whose training progress ended before the others' (by step, else by time), at least
    `min_lag` logging intervals behind. One step behind is, at the end of most logs, only the order in
    which ranks print the same step; once the others are known to have waited for someone in a
    collective, the one that did not print the step they all finished stopped first."""
    ranked = [s for s in summary.progress.sources if s.rank is not None and s.advances >= MIN_ADVANCES]
    if len(ranked) < 2:
        return None
    steps = [s.last_step for s in ranked if s.last_step is not None]
    if len(steps) == len(ranked) and len(set(steps)) > 1:
        top = max(steps)
        behind = [s for s in ranked if s.last_step is not None and s.last_step < top]
        per = _step_per_advance(ranked)
        behind = [s for s in behind if s.last_step is not None and top - s.last_step > min_lag * per]
        # A rank still printing after most of the leaders' last lines has not stopped first (its last line
        # is a summary of an earlier step: the logging rank's "[step N] global loss" after step N+1).
        leaders = sorted(s.last_line for s in ranked if s.last_step == top)
        behind = [s for s in behind if s.last_line < leaders[len(leaders) // 2]]
    else:
        behind = _behind_in_time(ranked, summary)
    if not _minority(len(behind), len(ranked)):
        return None
    return _stopped(behind, summary, "its training progress stopped before the other ranks'")


def _step_per_advance(sources: list[SourceProgress]) -> float:
    """The logging interval in steps: the sources' own (the smallest step between two of their progress
    lines), else estimated from how often their counters rose (which the fast path may undercount)."""
    own = sorted(s.step_delta for s in sources if s.step_delta)
    if own:
        return own[len(own) // 2]
    deltas = [(s.last_step - s.first_step) / s.advances for s in sources
              if s.last_step is not None and s.first_step is not None and s.advances]
    return sorted(deltas)[len(deltas) // 2] if deltas else 1.0


def _behind_in_time(ranked: list[SourceProgress], summary: CompressionSummary) -> list[SourceProgress]:
    interval = summary.step_interval_s
    if interval is None or any(s.last_ts is None for s in ranked):
        return []
    top = max(s.last_ts for s in ranked if s.last_ts is not None)
    return [s for s in ranked if s.last_ts is not None and top - s.last_ts > 3 * interval]


def stopped_by_output(summary: CompressionSummary) -> StoppedFirst | None:
    """The few ranks that printed during training and fell silent before the job's progress ended."""
    progress = summary.progress
    if progress.lines == 0:
        return None
    started = min((s.first_line for s in progress.sources), default=0)
    # Ranks that printed something once training was under way: the ones whose output can stop.
    active = {k: v for k, v in progress.last_output.items() if k[:1] == "r" and k[1:].isdigit() and v[0] > started}
    if len(active) < 4:
        return None
    stop_line = progress.last_line
    quiet = [k for k, (line, _) in active.items() if line < stop_line]
    if not _minority(len(quiet), len(active)):
        return None
    sources = [SourceProgress(key=k, rank=int(k[1:]), host=None, first_line=0, last_line=active[k][0],
                              first_step=None, last_step=None, first_ts=None, last_ts=active[k][1],
                              lines=0, advances=0, steps_per_s=None) for k in quiet]
    return _stopped(sources, summary, "it fell silent while the other ranks went on")


def _stopped(sources: list[SourceProgress], summary: CompressionSummary, basis: str) -> StoppedFirst:
    ranks = sorted(s.rank for s in sources if s.rank is not None)
    hosts = sorted({h for s in sources if (h := s.host or summary.rank_hosts.get(s.rank if s.rank is not None else -1))})
    steps = [s.last_step for s in sources if s.last_step is not None]
    return StoppedFirst(ranks=ranks, hosts=hosts, step=min(steps) if steps else None,
                        line_no=min(s.last_line for s in sources), basis=basis)
