"""Hangs, from what the log shows.

A hung job prints little: the ranks wait in a collective until a watchdog fires (or forever). What
points at the culprit:

- **stack dumps** (py-spy `dump`, faulthandler) of the processes: most of them sit in the same
  collective (`all_reduce`, `broadcast`, `barrier`...); the few that do not - waiting on the
  DataLoader's queue, in file I/O, on a lock, in the user's own function - are why the others wait.
  The minority's innermost frame is the root line, and who owns the code it waits in decides the
  category: the user's code (`script_hang`), a library (`framework_hang`), nothing but the
  interpreter and native code (`hang`: the machine, the GPU, the network);
- **the silent rank** (culprit.py, life.py): the rank missing from the watchdogs' reports, lagging
  in collective sequence numbers, or whose progress or output stopped first;
- **flight-recorder dumps** (logdx/flightrec.py): the ranks missing from the last collective.

This module reads the stack dumps and builds the verdicts the rules stage takes as root causes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from logdx.diagnose.rules import RuleHit
from logdx.flightrec import FrFindings
from logdx.model import FT, Event, EventKind, Frame, Label, Record, Role, Severity
from logdx.stacks import frame_owner
from logdx.taxonomy import category_of, make_label, module_of_path

__all__ = ["HANG_TYPES", "Minority", "fr_hit", "hang_label", "in_collective", "minority_hit", "silent_rank_hint",
           "silent_rank_label", "stack_minority"]

HANG_TYPES = frozenset({FT.HANG, FT.FRAMEWORK_HANG, FT.SCRIPT_HANG})
# Functions a process waits in when it is inside a collective (or waiting for the GPU to finish one).
_COLLECTIVES = frozenset({
    "all_reduce", "allreduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "_all_gather_base",
    "all_gather_object", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast",
    "broadcast_object_list", "barrier", "monitored_barrier", "all_to_all", "all_to_all_single", "reduce", "gather",
    "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv", "wait", "_wait", "synchronize", "wait_stream",
})
_DISTRIBUTED_PATHS = ("distributed", "c10d", "nccl", "deepspeed/comm", "torch/cuda", "megatron/core/parallel_state")
_INNERMOST = 8  # how deep into a stack a collective is looked for
_MIN_PROCESSES = 3


@dataclass(slots=True)
class Minority:
    """The processes that are not where the others are (or, with too few dumps to tell a majority,
    the processes the log shows stuck)."""

    events: list[Event]  # their stack dumps
    majority_op: str | None  # the collective the others wait in (None: no majority to compare with)
    processes: int  # how many processes dumped their stack
    owner: str  # "user" | "library" | "stdlib" | "native" | "": who owns the code the minority waits in
    frame: Frame | None  # the innermost frame of that owner
    line: Record  # that frame's line: the root line
    confidence: float
    op: str | None = None  # the other collective the minority waits in (a desync), None: outside any


def in_collective(frames: Sequence[Frame]) -> str | None:
    """The collective a stack waits in (outermost first, as tracebacks are), or None."""
    for f in list(reversed(frames))[:_INNERMOST]:
        name = (f.function or "").rsplit(".", 1)[-1].rsplit("::", 1)[-1]
        path = f.path.replace("\\", "/")
        if name in _COLLECTIVES and (any(p in path for p in _DISTRIBUTED_PATHS) or name not in ("wait", "_wait", "synchronize")):
            return name
    return None


def stack_minority(events: Sequence[Event]) -> Minority | None:
    """When most processes wait in a collective and a few do not: those few. With one or two dumps and
    none of them in a collective, the processes the log shows are the stuck ones (someone dumped the
    hung process); with dumps all in a collective, the job hangs in it for a process nobody dumped."""
    dumps = _latest_per_process([e for e in events if e.kind == EventKind.STACK_DUMP and e.frames])
    if not dumps:
        return None
    ops = [in_collective(e.frames) for e in dumps]
    inside = [op for op in ops if op is not None]
    outside = [e for e, op in zip(dumps, ops) if op is None]
    if len(dumps) >= _MIN_PROCESSES and outside and len(inside) >= 2 and len(outside) <= max(1, len(dumps) // 8):
        return _minority(outside, max(set(inside), key=inside.count), len(dumps), 0.8)
    if outside and not inside and len(dumps) <= 2:
        return _minority(outside, None, len(dumps), 0.6)
    if inside and not outside:
        return _desync(dumps, inside) or _minority(dumps[:1], None, len(dumps), 0.45)
    return None


def _desync(dumps: list[Event], ops: list[str]) -> Minority | None:
    """Every process waits in a collective, a few in another than the rest (a barrier the others never reach,
    a broadcast only some ranks call): those few took another code path, and the others wait for them. Roles
    that differ by design (pipeline stages in send/recv and all_reduce) are groups too large to be a few."""
    if len(dumps) < _MIN_PROCESSES or len(set(ops)) < 2:
        return None
    majority = max(set(ops), key=ops.count)
    few = [e for e, op in zip(dumps, ops) if op != majority]
    if len(few) > max(1, len(dumps) // 8):
        return None
    owner, frame, line = _caller_of_collective(few[0])
    return Minority(events=few, majority_op=majority, processes=len(dumps), owner=owner, frame=frame, line=line,
                    confidence=0.7, op=in_collective(few[0].frames))


def _caller_of_collective(ev: Event) -> tuple[str, Frame | None, Record]:
    """Where a process called the collective it waits in: the innermost frame outside the distributed
    package's own code that the user or a library owns (the code path that differs between ranks)."""
    lines = ev.attrs.get("frame_lines")
    records: list[Record] = list(lines) if isinstance(lines, list) else []
    for i in range(len(ev.frames) - 1, -1, -1):
        f = ev.frames[i]
        path = f.path.replace("\\", "/")
        if (f.function or "").rsplit("::", 1)[-1] in _COLLECTIVES or any(p in path for p in _DISTRIBUTED_PATHS):
            continue
        owner = frame_owner(f, module_of_path(f.path))
        if owner in ("library", "user"):
            return owner, f, records[i] if i < len(records) else ev.anchor
    return _owner_of_wait(ev)


def _minority(events: list[Event], majority: str | None, processes: int, confidence: float) -> Minority:
    ev = events[0]
    owner, frame, line = _owner_of_wait(ev)
    return Minority(events=events, majority_op=majority, processes=processes, owner=owner, frame=frame, line=line,
                    confidence=confidence)


def _latest_per_process(dumps: list[Event]) -> list[Event]:
    """A process dumped twice (py-spy run again a minute later): its last dump says where it is. The same pid
    under two nodes' names (a collection of every node's dumps) is two processes; a dump without a pid
    (faulthandler's) is its main thread's."""
    latest: dict[tuple[str, object, object], Event] = {}
    for e in dumps:
        pid = e.attrs.get("pid")
        latest[(e.anchor.source_key, e.attrs.get("section"), pid if pid is not None else e.attrs.get("tid"))] = e
    return list(latest.values())


def _owner_of_wait(ev: Event) -> tuple[str, Frame | None, Record]:
    """Who owns the code a process waits in, the frame and its line: from its innermost frame outwards,
    past the interpreter's own modules (queue.get, threading.wait) and native frames, the first library
    or user frame. A process in a collective waits where it called it: the collective's own frame."""
    lines = ev.attrs.get("frame_lines")
    records: list[Record] = list(lines) if isinstance(lines, list) else []
    frames = ev.frames
    if in_collective(frames) is not None:
        for i in range(len(frames) - 1, -1, -1):
            if (frames[i].function or "").rsplit("::", 1)[-1] in _COLLECTIVES:
                return "library", frames[i], records[i] if i < len(records) else ev.anchor
    for i in range(len(frames) - 1, -1, -1):
        owner = frame_owner(frames[i], module_of_path(frames[i].path))
        if owner in ("library", "user"):
            return owner, frames[i], records[i] if i < len(records) else ev.anchor
    return ("native" if frames else ""), (frames[-1] if frames else None), ev.anchor


def hang_label(owner: str) -> Label:
    """`script_hang` in the user's code, `framework_hang` in a library, else `hang` (the machine)."""
    failure_type = {"user": FT.SCRIPT_HANG, "library": FT.FRAMEWORK_HANG}.get(owner, FT.HANG)
    return _label_of(failure_type)


def _label_of(failure_type: FT) -> Label:
    """The taxonomy's label for a failure type code decided on (its category, its default action)."""
    category = category_of(failure_type)
    if category is None:  # the taxonomy checks FT against itself at load: cannot happen
        raise ValueError(f"failure type {failure_type} is not in the taxonomy")
    return make_label(category, failure_type)


def minority_hit(m: Minority) -> RuleHit:
    """The minority as a root cause the rules stage can rank and explain."""
    label = hang_label(m.owner) if m.majority_op is not None or m.confidence >= 0.6 else hang_label("native")
    where = f"{m.frame.function} ({m.frame.path}{':' + str(m.frame.line) if m.frame.line else ''})" \
        if m.frame is not None else m.line.text.strip()
    n = len(m.events)
    if m.op is not None:
        title = (f"{n} of {m.processes} processes {'waits' if n == 1 else 'wait'} in {m.op}, the others in "
                 f"{m.majority_op}: a desync, called from {where}")
    elif m.majority_op is not None:
        title = (f"{n} of {m.processes} processes {'is' if n == 1 else 'are'} not in the collective the others "
                 f"wait in ({m.majority_op}): stuck in {where}")
    elif m.confidence >= 0.6:
        title = f"The dumped process{'es are' if n > 1 else ' is'} stuck in {where}, outside any collective"
    else:
        title = f"The job hangs in a collective: the dumped process waits in {where} for a rank no dump shows"
    op = m.majority_op or "the collective"
    hints: dict[str, str] = {  # FT keys; label.failure_type is a str
        FT.SCRIPT_HANG: "The process is stuck in your code (see the root frame) while the others wait for it in "
                       f"{op}: fix the code path (a loop, a lock, I/O without a timeout) before restarting.",
        FT.FRAMEWORK_HANG: "The process waits inside a library (see the root frame: a DataLoader queue, storage I/O, a "
                          f"lock) while the others wait for it in {op}: check its data loading and storage; "
                          "a restart alone will likely hang again.",
        FT.HANG: "The job hangs with no Python code of its own to blame (native code, the GPU, the network, or a "
                "rank no dump shows): dump every rank's stack (py-spy dump) to find the one outside the "
                "collective; restart without its node if the log names it.",
    }
    if m.op is not None:
        hints = dict.fromkeys(hints, f"The ranks took different code paths: {n} {'waits' if n == 1 else 'wait'} in {m.op} "
                              f"while the others wait in {op} (a desync: a collective called under a condition that "
                              "differs between ranks, a rank that skipped or repeated a step). Fix the code path at the "
                              "root frame before restarting; TORCH_NCCL_DESYNC_DEBUG=1 names the collective if it "
                              "happens again.")
    return RuleHit(
        rule_id="hang-desync" if m.op is not None else "hang-outside-collective", pack="hangs", title=title, role=Role.ROOT_CAUSE, label=label,
        severity=Severity.HIGH, confidence=m.confidence, line=m.line, groups={}, hint=hints[label.failure_type],
        event=m.events[0],
    )


def fr_hit(ev: Event) -> tuple[RuleHit, set[int]] | None:
    """A flight-recorder report (from dumps, or torch's fr_trace text in the log) as a root cause, with
    the ranks it blames: outside every collective, else on the other side of a desync, else missing
    from the stuck collective. A desync (ranks calling different collectives) is the code's; a rank
    that never came is the machine's until more is known."""
    findings = ev.attrs.get("findings")
    if not isinstance(findings, FrFindings) or not findings.stuck_groups:
        return None
    ranks = findings.culprit_ranks or findings.desync_ranks or findings.missing_ranks
    desync = next((g for g in findings.stuck_groups if g.mismatch), None)
    line = ev.anchor
    if desync is not None or (not findings.culprit_ranks and any(g.stack for g in findings.stuck_groups)):
        group = desync or next(g for g in findings.stuck_groups if g.stack)
        frames = [Frame(path=f.filename, line=f.line, function=f.name) for f in reversed(group.stack)]
        owner, frame = _owner_of_frames(frames)
        label = hang_label(owner or "user")
        line = _line_naming(ev, frame) or line
    else:
        label = hang_label("native")
    summary = findings.summary().splitlines()
    title = f"Flight recorder: {summary[0]}" if summary else "Flight recorder: a collective no rank finished"
    hint = ("The flight recorder names the rank(s) that left the collective everyone else waits in: restart without "
            "their node if it is named (check its GPU and kernel log)" if label.failure_type == FT.HANG else
            "The ranks ran different collectives (a desync): the code path that differs between ranks is a bug "
            "(see the collective's stack); fix it before restarting")
    hit = RuleHit(rule_id="hang-flight-recorder", pack="hangs", title=title, role=Role.ROOT_CAUSE, label=label,
                  severity=Severity.HIGH, confidence=0.85, line=line, groups={}, hint=hint + ".", event=ev)
    return hit, set(ranks)


def _owner_of_frames(frames: Sequence[Frame]) -> tuple[str, Frame | None]:
    for f in reversed(frames):
        owner = frame_owner(f, module_of_path(f.path))
        if owner in ("library", "user") and (f.function or "") not in _COLLECTIVES:
            return owner, f
    return "", None


def _line_naming(ev: Event, frame: Frame | None) -> Record | None:
    if frame is None:
        return None
    for rec in ev.lines:
        if frame.path in rec.text and (frame.function or "") in rec.text:
            return rec
    return None


def silent_rank_hint(hosts: list[str]) -> str:
    """What to do about a hang whose culprit is the rank that went quiet."""
    if len(hosts) == 1:
        return (f"The job waited for a rank on {hosts[0]} that stopped: restart without {hosts[0]} and check its GPU, "
                "NIC and kernel log (dmesg, Xid); py-spy dump of that rank shows where it sits if it hangs again.")
    return ("The job waited for a rank that stopped: restart from the last checkpoint; if it hangs again, dump every "
            "rank's stack (py-spy dump) and set TORCH_NCCL_TRACE_BUFFER_SIZE to find the one outside the collective.")


def silent_rank_label() -> Label:
    """A hang whose culprit is the rank that went quiet: the machine's, until more is known."""
    return _label_of(FT.HANG)
