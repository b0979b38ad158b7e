"""The rules stage of diagnosis: which event is the root cause, and who is the culprit.

What the job went on after is not its cause: an event after which its rank (or, for a rank that
prints no progress of its own, the whole job) kept advancing was survived (life.py). It is kept as a
note (`recovered`) and never chosen. Among what is left, symptoms never win over a root cause; among
root causes the earliest wins (by timestamp when both carry one, else by line order), and a warning
the program printed and went past gives way to a graver event. Generic fallbacks (an exception no
precise rule knows) win only when no precise root cause exists. Who is to blame is decided in
culprit.py.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from logdx.diagnose.culprit import (
    HANG_OUTPUT_BASIS,
    StuckProcess,
    attribute,
    hang_culprit,
    stuck_in_kernel,
    verify_hosts,
    with_stuck,
)
from logdx.diagnose.hangs import HANG_TYPES, fr_hit, minority_hit, silent_rank_hint, silent_rank_label, stack_minority
from logdx.diagnose.health import RunEnd, after_the_end, fails_after_the_end, run_end
from logdx.diagnose.life import MIN_ADVANCES, ends_its_process, is_warning, says_it_aborts, went_on_after
from logdx.diagnose.occupied import taken_by_another_process
from logdx.diagnose.origin import locate
from logdx.diagnose.rules import RuleHit, RuleSet, render_hint
from logdx.diagnose.timeouts import TimeoutVerdict, WorkSeen, classify, note_work, relabel
from logdx.model import (
    FT,
    READ_AS_A_WHOLE,
    Attribution,
    Category,
    CompressionSummary,
    Event,
    EventKind,
    Evidence,
    FailureContext,
    Label,
    Record,
    Role,
    Severity,
    StageVote,
    TemplateStats,
)
from logdx.patterns import mask, pci_key
from logdx.taxonomy import is_hardware, is_resubmit

_SEQNUM = re.compile(r"SeqNum=(\d+)")
# How close after a lesser fault a graver one must come to be taken as its cause.
_EXPLAIN_WINDOW_S = 900.0
_EXPLAIN_WINDOW_LINES = 5_000
# How a job ends from outside (the OOM killer, the scheduler): when it comes before the watchdog
# timeouts, those are its echo.
_ENDS_BEFORE_ECHOES = frozenset({FT.HOST_OOM, FT.TIME_LIMIT})


@dataclass(slots=True)
class Finding:
    """An event with the best rule that matched it, and how many like it were seen."""

    event: Event
    hit: RuleHit
    similar: int = 1
    ranks: set[int] = field(default_factory=set)
    hosts: set[str] = field(default_factory=set)
    seq_by_rank: dict[int, int] = field(default_factory=dict)  # NCCL collective each rank reported
    works: dict[tuple[str, int], WorkSeen] = field(default_factory=dict)  # (process group, rank): its watchdog's work
    survived: bool = False  # the job (or its rank) went on making progress after it


@dataclass(slots=True)
class RulesOutcome:
    """What the rules stage concluded, before retrieval and the LLM have their say."""

    vote: StageVote
    winner: Finding | None
    role: Role | None  # the role of the winning hit: a symptom-only verdict is weak
    findings: list[Finding]
    attribution: Attribution
    context: FailureContext
    explanation: str
    hint: str
    unexplained_events: list[Event] = field(default_factory=list)  # events no rule knew
    recovered: list[Finding] = field(default_factory=list)  # what the job went on after (notes)
    timeout: TimeoutVerdict | None = None  # why its collectives timed out, when they did


def find_root_cause(
    events: Sequence[Event],
    summary: CompressionSummary,
    templates: Sequence[TemplateStats],
    rules: RuleSet,
    exit_code: int | None = None,
) -> RulesOutcome:
    """`exit_code`: the job's, when known. Exit 0: any error its process trained past at all was
    survived, and so was anything that cannot end a process by itself (a logged error, an async
    event)."""
    dumps = [e for e in events if e.kind in READ_AS_A_WHOLE]
    everything, unexplained = _match_all([e for e in events if e.kind not in READ_AS_A_WHOLE], rules, summary,
                                         _Ending(exit_code, run_end(summary.progress)))
    findings = [f for f in everything if not f.survived]
    recovered = [f for f in everything if f.survived and f.hit.role is not Role.SYMPTOM]
    winner, role = _choose(findings, summary)
    if winner is not None and role is Role.ROOT_CAUSE:
        winner = _detailed_by_nccl(winner, events)
        if (taken := taken_by_another_process(winner, findings)) is not None:
            winner = replace(winner, hit=taken)
    winner, role, att = _hang(winner, role, findings, dumps, summary)
    stuck = _stuck_in_a_hang(winner, dumps, summary)
    if stuck:
        att = with_stuck(att, stuck, findings)
    timeout = classify(winner, role, findings, summary)
    if timeout is not None and winner is not None and (changed := relabel(winner, role, timeout, att, summary)):
        winner = replace(winner, hit=changed.hit, ranks=changed.ranks, hosts=changed.hosts)
        role, att = changed.role, changed.attribution
    att = verify_hosts(att, summary)
    vote = _vote(winner, findings)
    vote.evidence += [Evidence(line_no=p.event.line_no, text=_clip(p.event.anchor.raw), source="detect:process_state")
                      for p in stuck[:_STUCK_EVIDENCE]]
    context = failure_context(winner.hit.line if winner else likeliest_unexplained(unexplained), winner, templates)
    explanation = _explain(winner, role, findings, att.hosts, att.ranks, att.gpus)
    if stuck:
        explanation += (f" While it hung, {'; '.join(p.describe() for p in stuck[:_STUCK_EVIDENCE])}: a wait on the "
                        "host's side (a network filesystem, a driver call) that the others waited for.")
    if role is not Role.SYMPTOM:  # where a symptom was raised (KeyboardInterrupt) says nothing of a cause
        explanation += _raised_where(winner, rules)
    hint = _hint(winner, rules, att.hosts, att.ranks, att.gpus)
    if timeout is not None and not timeout.decided and timeout.hint:
        hint = f"{timeout.hint} {hint}".strip()
    return RulesOutcome(
        vote=vote,
        winner=winner,
        role=role,
        findings=findings,
        attribution=att,
        context=context,
        explanation=explanation,
        hint=hint,
        unexplained_events=unexplained,
        recovered=recovered,
        timeout=timeout,
    )


# -- matching ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Ending:
    """How the job ended, as far as the caller knows it: its exit code (None: not known), and where the
    run said it finished (None: it did not)."""

    exit_code: int | None
    end: RunEnd | None = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def at_least(self) -> int:
        """How many advances after an event make it survived: one is enough once the job exited 0."""
        return 1 if self.ok else MIN_ADVANCES


def _match_all(events: Sequence[Event], rules: RuleSet, summary: CompressionSummary,
               ending: _Ending) -> tuple[list[Finding], list[Event]]:
    """Best hit per event; events that repeat a (rule, template) already found are folded in (those
    the job went on after apart from those it did not: a start-up retry and the same line at the end
    are two findings). An exception that only re-raises or follows another (a DataLoader's "Caught
    KeyError in worker process 0", the second link of a chain) gives way to the one it wraps or
    follows: the innermost failure is the cause."""
    best = {id(e): hits[0] for e in events if (hits := rules.match(e))}
    by_key: dict[tuple[str, str, bool], Finding] = {}
    unexplained: list[Event] = []
    clearing: dict[tuple[str, str], list[Event]] = {}
    for event in events:
        hit = best.get(id(event))
        if hit is None:
            unexplained.append(event)
            continue
        if _superseded(event, best):
            continue
        survived = _survived(event, hit, summary, ending) or _cleared(event, hit, rules, events, clearing)
        key = (hit.rule_id, mask(hit.line.text), survived)
        found = by_key.get(key)
        if found is None:
            found = by_key[key] = Finding(event=event, hit=hit, similar=0, survived=survived)
        elif _earlier(event, found.event):
            found.event, found.hit = event, hit
        found.similar += 1
        _note_where(found, hit)
    return list(by_key.values()), unexplained




_STUCK_EVIDENCE = 2
_WAITED = HANG_TYPES | {FT.NCCL_TIMEOUT}


def _stuck_in_a_hang(winner: Finding | None, events: list[Event], summary: CompressionSummary) -> list[StuckProcess]:
    """The job's processes `ps` showed in uninterruptible sleep, when the job hung (alone, a process in D state is
    a snapshot of one that reads from disk: no fault)."""
    if winner is None or winner.hit.label.failure_type not in _WAITED:
        return []
    return stuck_in_kernel([e for e in events if e.kind == EventKind.PROCESS_STATE], summary)


def _hang_from_dumps(dumps: list[Event]) -> Finding | None:
    for ev in dumps:
        if ev.kind == EventKind.FR_REPORT and (found := fr_hit(ev)) is not None:
            hit, ranks = found
            return Finding(event=ev, hit=hit, ranks=ranks)
    minority = stack_minority(dumps)
    if minority is None:
        return None
    return Finding(event=minority.events[0], hit=minority_hit(minority))


def _hang(winner: Finding | None, role: Role | None, findings: list[Finding], dumps: list[Event],
          summary: CompressionSummary) -> tuple[Finding | None, Role | None, Attribution]:
    """No precise cause: who the others waited for, if the log shows it. The flight recorder, or the
    stacks' minority (over a generic error too, when there is a real minority); else, when ranks timed
    out in a collective, the rank the log shows stopping; else the stacks that show only the collective
    (the job hangs in it, for a process no dump shows: no culprit)."""
    if role not in (None, Role.SYMPTOM, Role.FALLBACK):
        return winner, role, attribute(winner, role, findings, summary)
    hang = _hang_from_dumps(dumps)
    if hang is not None and hang.hit.confidence >= _MINORITY_OVER_FALLBACK:
        findings.append(hang)
        return hang, Role.ROOT_CAUSE, attribute(hang, Role.ROOT_CAUSE, findings, summary)
    if role is Role.FALLBACK:
        return winner, role, attribute(winner, role, findings, summary)
    timeouts = [f for f in findings if f.hit.role is Role.SYMPTOM and f.event.kind != EventKind.STALL
                and f.hit.label.failure_type in _WAITED_IN_A_COLLECTIVE]
    ended = winner is not None and (winner.hit.label.failure_type in _ENDS_BEFORE_ECHOES
                                    or is_resubmit(winner.hit.label.failure_type))
    if timeouts and winner is not None and not ended:
        # Ranks timed out in a collective (whatever ended the job after): the one they waited for is the
        # cause, unless a kill or the scheduler ended the job first (the timeouts are then its echo).
        silent = _silent_rank_hang(_earliest(timeouts), findings, summary)
        if silent is not None:
            return silent[0], Role.ROOT_CAUSE, silent[1]
    if hang is not None:
        findings.append(hang)
        return hang, Role.ROOT_CAUSE, Attribution(notes=["the dumped processes wait in the collective: the one they "
                                                         "wait for is in no dump, and no rank is seen stopping"])
    return winner, role, attribute(winner, role, findings, summary)


# A hang's culprit named by two independent signals (culprit.hang_culprit) is right far more often than
# one named by one; output that merely stopped first is a guess. Measured on the hangs set (make eval).
_SILENT_RANK_CONFIDENCE = {2: 0.9, 1: 0.7, 0: 0.45}
_MINORITY_OVER_FALLBACK = 0.6
_WAITED_IN_A_COLLECTIVE = frozenset({FT.NCCL_TIMEOUT, FT.HANG})


def _silent_rank_hang(timeout: Finding, findings: list[Finding],
                      summary: CompressionSummary) -> tuple[Finding, Attribution] | None:
    """The collective timed out waiting for a rank the log shows stopping: a hang, that rank its culprit,
    the first timeout its root line; as sure as the signals that agree on the rank."""
    culprit = hang_culprit(findings, summary)
    att = culprit.attribution
    if not att.ranks:
        return None
    independent = min(2, sum(b != HANG_OUTPUT_BASIS for b in culprit.signals))
    title = f"The job hung waiting for a rank that stopped ({att.basis})"
    hit = replace(timeout.hit, rule_id="hang-silent-rank", pack="hangs", title=title, role=Role.ROOT_CAUSE,
                  label=silent_rank_label(), confidence=_SILENT_RANK_CONFIDENCE[independent],
                  hint=silent_rank_hint(att.hosts if att.corroborated else []), hint_rule=None)
    return replace(timeout, hit=hit, ranks=set(att.ranks), hosts=set(att.hosts)), att


def _survived(event: Event, hit: RuleHit, summary: CompressionSummary, ending: _Ending) -> bool:
    """The job went on after it. A loss gone NaN is survived only when the same process logs a finite
    loss again; a divergence the timeline confirmed never (training goes on, ruined). What the job printed
    after the run said it finished did not end it, unless it is a process's own last words (health.py). A
    stall is a hang only in a run that neither finished nor exited 0. What cannot end a process by itself
    (a logged error, an NIC's async event) did not end a job that exited 0, nor one whose training says it
    ran to its end, unless the job is known to have failed; a NaN loss is not made good by an exit code. A
    fault of a GPU is survived when the process on that GPU went on, when the log says which one it is.

    A kernel line whose only clock is the boot's (no line of its host said when that boot was) cannot be
    placed before or after anything: what can end a process stays a candidate cause unless the job ran
    to its end; what cannot is a note."""
    divergence = summary.progress.divergence
    if event.kind == EventKind.LOSS_NAN:
        if divergence is not None and divergence.line_no == event.line_no:
            return False  # where the divergence the timeline confirmed began (Megatron's NaN iterations)
        return summary.last_finite_loss_line.get(event.anchor.source_key, 0) > event.line_no
    if event.kind == EventKind.LOSS_SPIKE:  # unless the loss came back after all, later than the watch waited
        return divergence is None or divergence.line_no != event.line_no
    end = ending.end
    if event.kind == EventKind.STALL:
        return end is not None or ending.ok  # the quiet after the run's end, or slow work it finished
    if end is not None and after_the_end(event, end) and not fails_after_the_end(event, hit):
        return True  # teardown: NCCL closing its communicators, slurmstepd, the node's kernel past the end
    completed = ending.ok or (ending.exit_code is None and end is not None)
    if not ends_its_process(event) and hit.label.failure_type != FT.NAN_LOSS and completed:
        return True
    if event.anchor.unanchored:
        return completed or not (ends_its_process(event) or is_hardware(hit.label.failure_type) or _grave(hit))
    # A process's own last words (an exception raised, an abort) outrank an exit code of 0: only training
    # that clearly went on after them (a bar in a paste's start-up lines is one advance) says otherwise.
    last_words = bool(event.exception_type) or says_it_aborts(event.anchor.text)
    return went_on_after(event, summary, at_least=MIN_ADVANCES if last_words else ending.at_least,
                         whose=_gpu_process(hit, summary))


def _grave(hit: RuleHit) -> bool:
    """A root cause that ends a job when it happens (the OOM killer's kill, a node's failure)."""
    return hit.role is Role.ROOT_CAUSE and hit.severity.rank <= Severity.HIGH.rank


def _gpu_process(hit: RuleHit, summary: CompressionSummary) -> str | None:
    """The source key of the rank on the GPU a hardware fault names (by its host and PCI address, or the
    pid the kernel names), when the job's NCCL lines tie it to one; None otherwise."""
    if not is_hardware(hit.label.failure_type):
        return None
    host = hit.host
    if not host:
        return None
    keys = []
    if hit.gpu:
        keys.append(f"{host}|bus:{pci_key(hit.gpu)}")
    pid = hit.event.attrs.get("pid") or hit.line.pid
    if pid is not None:
        keys.append(f"{host}|pid:{pid}")
    for key in keys:
        rank = summary.gpu_ranks.get(key)
        if rank is not None:
            return f"r{rank}"
    return None


def _cleared(event: Event, hit: RuleHit, rules: RuleSet, events: Sequence[Event],
             clearing: dict[tuple[str, str], list[Event]]) -> bool:
    """A later line of the same host (the same source, when no host is known) says the condition the
    rule found cleared: an IB port that went down and came back up. Such lines are marked `clears` (they
    report no error of their own: health.py); `clearing` keeps them per rule and place, found once."""
    rule = rules.by_id.get(hit.rule_id)
    if rule is None or not rule.cleared_by:
        return False
    where = event.anchor.host or event.anchor.source_key
    found = clearing.get((rule.id, where))
    if found is None:
        found = clearing[(rule.id, where)] = []
        for e in events:
            if (e.anchor.host or e.anchor.source_key) == where and any(p.search(e.anchor.text) for p in rule.cleared_by):
                e.attrs["clears"] = True
                found.append(e)
    return any(_earlier(event, e) for e in found)


def _superseded(event: Event, best: dict[int, RuleHit]) -> bool:
    inner = event.attrs.get("wraps") or event.attrs.get("chained_from")
    while isinstance(inner, Event):
        hit = best.get(id(inner))
        if hit is not None and hit.role is not Role.SYMPTOM:
            return True
        inner = inner.attrs.get("chained_from")
    return False


def _note_where(found: Finding, hit: RuleHit) -> None:
    if hit.rank is not None:
        found.ranks.add(hit.rank)
        if "SeqNum=" in hit.line.text and (m := _SEQNUM.search(hit.line.text)):
            found.seq_by_rank[hit.rank] = int(m.group(1))
        if "NCCL work" in hit.line.text or "WorkNCCL(" in hit.line.text:
            note_work(found.works, hit.rank, hit.line.text, hit.line.line_no)
    if hit.host:
        found.hosts.add(hit.host)


def _earlier(a: Event, b: Event) -> bool:
    """By the lines' clocks; a line whose time is unknown (a boot clock) comes after one whose time is known,
    whatever the order they arrived in; else by line order."""
    if a.ts is not None and b.ts is not None and a.ts != b.ts:
        return a.ts < b.ts
    if a.anchor.unanchored != b.anchor.unanchored:
        return b.anchor.unanchored
    return a.line_no < b.line_no


def _earliest(findings: list[Finding]) -> Finding:
    best = findings[0]
    for f in findings[1:]:
        if _earlier(f.event, best.event):
            best = f
    return best


# -- choosing ----------------------------------------------------------------------------------------


def _choose(findings: list[Finding], summary: CompressionSummary) -> tuple[Finding | None, Role | None]:
    findings = _without_echoes_of_an_interrupt(findings)
    roots = _graver_than_warnings([f for f in findings if f.hit.role == Role.ROOT_CAUSE])
    if roots:
        winner = _graver_explanation(_earliest(roots), roots, summary)
        return _application_fault(_named_report(winner, roots), roots, summary), Role.ROOT_CAUSE
    # Generic evidence (an error no precise rule names) that its own process trained past at all was
    # survived: a caught exception, a warning-level "error:". Only what training did not outlive counts.
    fallbacks = _graver_than_warnings(
        [f for f in findings if f.hit.role == Role.FALLBACK and not _trained_past(f.event, summary)])
    if fallbacks:
        return _earliest(fallbacks), Role.FALLBACK
    symptoms = [f for f in findings if f.hit.role == Role.SYMPTOM]
    if symptoms:
        # The most telling symptom: a watchdog timeout says more than a stall, and a stall more than
        # the SIGTERM or "step cancelled" that ended the hung job (rule confidences rank them)...
        best = max(symptoms, key=lambda f: (f.hit.confidence, f.event.kind != EventKind.STALL))
        first = _earliest([f for f in symptoms if f.hit.rule_id == best.hit.rule_id])
        # ...unless a process was killed, or the scheduler ended the job, before anyone timed out:
        # the others then waited for the dead one, and the kill is the cause of their timeouts.
        ends = [f for f in symptoms if f.hit.label.failure_type in _ENDS_BEFORE_ECHOES and _earlier(f.event, first.event)]
        return (_earliest(ends) if ends else first), Role.SYMPTOM
    return None, None


# NCCL's exceptions carry a class ("invalid usage", "unhandled system error") and send the reader to its
# own log for the why: "run with NCCL_DEBUG=WARN for details".
_NCCL_DETAILS = re.compile(r"NCCL_DEBUG=(?:WARN|INFO) for details|\bnccl(?:InvalidUsage|SystemError|InternalError|"
                           r"InvalidArgument|RemoteError)\b")
_NCCL_WARN = re.compile(r"\bNCCL WARN\b.*(?i:error|fail|unable|invalid|not |no |refused|timed? ?out|abort)")
_NCCL_DETAIL_LINES = 60  # how far before the exception its rank's WARN may be


def _detailed_by_nccl(winner: Finding, events: Sequence[Event]) -> Finding:
    """An NCCL exception whose details are in NCCL's own WARN line, printed by the same process just
    before it: that line says what was wrong (the algorithm it could not find, the plugin it could not
    load), and is the root line; the label stays the exception's."""
    line = winner.hit.line
    if not _NCCL_DETAILS.search(" ".join(r.text for r in winner.event.lines[-4:])):
        return winner
    warns = [e.anchor for e in events
             if e.anchor.source_key == line.source_key and _NCCL_WARN.search(e.anchor.text)
             and 0 < line.line_no - e.anchor.line_no <= _NCCL_DETAIL_LINES]
    if not warns:
        return winner
    return replace(winner, hit=replace(winner.hit, line=max(warns, key=lambda r: r.line_no)))


def _without_echoes_of_an_interrupt(findings: list[Finding]) -> list[Finding]:
    """A process interrupted from outside raises the interrupt (KeyboardInterrupt, torch's
    SignalException); an exception raised after the first such one is how the job came down (a
    launcher's handler failing while it kills the ranks), not why. Lines that are not exceptions (a
    scheduler's NODE FAILURE, an Xid) stay: they may well be why somebody stopped the job."""
    stops = [f for f in findings if f.hit.label.failure_type == FT.CANCELLED and f.event.exception_type]
    if not stops:
        return findings
    stop = _earliest(stops)
    return [f for f in findings
            if f.hit.role is not Role.ROOT_CAUSE or not f.event.exception_type or not _earlier(stop.event, f.event)]


def _graver_than_warnings(findings: list[Finding]) -> list[Finding]:
    """A warning (the program's own level: it printed it and went on) gives way to an error that says
    something else: a retried connection before the traceback that ended the job. A warning that says
    what a later error says is its first, often more precise, statement ("failed to bind to :29500
    (Address already in use)", then "failed to listen on any local network address")."""
    graver = [f for f in findings if not is_warning(f.event)]
    if not graver:
        return findings
    said = {f.hit.label.failure_type for f in graver}
    return [f for f in findings if f in graver or f.hit.label.failure_type in said]


def _graver_explanation(winner: Finding, roots: list[Finding], summary: CompressionSummary) -> Finding:
    """A graver infrastructure fault just after the earliest one explains it.

    A node that dies is first noticed by its peers' connection errors; a GPU that falls off the
    bus first surfaces as a CUDA error in the application, the kernel's Xid line a moment later.
    The critical fault is the cause, the earlier lesser one its first echo.
    """
    if winner.hit.label.category != Category.INFRASTRUCTURE:
        return winner
    rank = winner.hit.severity.rank
    graver = [
        f
        for f in roots
        if f is not winner
        and f.hit.label.category == Category.INFRASTRUCTURE
        and f.hit.severity.rank < rank
        and (_soon_after(winner.event, f.event) or _same_host(winner, f, summary))
    ]
    return _earliest(graver) if graver else winner


def _application_fault(winner: Finding, roots: list[Finding], summary: CompressionSummary) -> Finding:
    """A CUDA fault that the GPU itself calls the application's (an Xid the rules label as not
    infrastructure: 13, an out-of-range access; 31, an MMU fault) is the program's bug, not the
    machine's, and a restart replays it. Whichever of the two came first, the application's own
    error line is the root line (its traceback says where), with the Xid's label."""
    def app_xid(f: Finding) -> bool:
        return f.event.kind == EventKind.XID and f.hit.label.category != Category.INFRASTRUCTURE

    def cuda_fault(f: Finding) -> bool:
        return f.hit.label.failure_type == FT.CUDA_ERROR

    if not (app_xid(winner) or cuda_fault(winner)):
        return winner
    partner = [
        f for f in roots
        if f is not winner and (cuda_fault(f) if app_xid(winner) else app_xid(f))
        and (_near(winner.event, f.event) or _same_host(winner, f, summary))
    ]
    if not partner:
        return winner
    other = _earliest(partner)
    cuda, xid = (other, winner) if app_xid(winner) else (winner, other)
    return replace(cuda, hit=replace(cuda.hit, label=xid.hit.label, hint=xid.hit.hint, hint_rule=xid.hit.rule_id,
                                     groups={**xid.hit.groups, **cuda.hit.groups}))


def _named_report(winner: Finding, roots: list[Finding]) -> Finding:
    """The same fault is often printed twice: the exception line, and the NCCL watchdog of the rank it
    happened on ("[Rank 1] ... watchdog thread terminated with exception: CUDA error: uncorrectable ECC
    error"). The exception line stays the root (the first, most specific statement); when it names no
    rank or host, the echo that does tells whose it was."""
    if winner.hit.rank is not None or winner.hit.host:
        return winner
    twins = [
        f for f in roots
        if f is not winner and f.hit.label.failure_type == winner.hit.label.failure_type
        and (f.hit.rank is not None or f.hit.host) and _near(winner.event, f.event)
    ]
    if not twins:
        return winner
    twin = _earliest(twins)
    if _earlier(twin.event, winner.event):
        return twin  # the named report came first: it is the first statement
    named = replace(winner, ranks=set(winner.ranks), hosts=set(winner.hosts))
    if twin.hit.rank is not None:
        named.ranks.add(twin.hit.rank)
    if twin.hit.host:
        named.hosts.add(twin.hit.host)
    return named


def _near(a: Event, b: Event) -> bool:
    return _soon_after(a, b) or _soon_after(b, a)


def _same_host(a: Finding, b: Finding, summary: CompressionSummary) -> bool:
    """Logs shipped per rank arrive in any order: a kernel line of the same host explains an
    application's error whichever came first (when timestamps cannot say)."""
    if a.event.ts is not None and b.event.ts is not None:
        return False  # the window above already decided
    return bool(_hosts_of(a, summary) & _hosts_of(b, summary))


def _hosts_of(f: Finding, summary: CompressionSummary) -> set[str]:
    return f.hosts | {summary.rank_hosts[r] for r in f.ranks if r in summary.rank_hosts}


def _soon_after(first: Event, later: Event) -> bool:
    if first.ts is not None and later.ts is not None:
        return 0 <= later.ts - first.ts <= _EXPLAIN_WINDOW_S
    return 0 < later.line_no - first.line_no <= _EXPLAIN_WINDOW_LINES


def _trained_past(event: Event, summary: CompressionSummary) -> bool:
    """The process that printed this made progress afterwards at all. Only a process the log tells
    apart (by rank or host) counts at once: in an unprefixed log every process shares one stream, and
    one rank's crash is followed by the others' last steps."""
    return event.anchor.source_key != "-" and went_on_after(event, summary, at_least=1)


def _hint(winner: Finding | None, rules: RuleSet, hosts: list[str], ranks: list[int], gpus: list[str]) -> str:
    """The winning rule's hint, filled with the culprit as finally resolved (the root line itself
    may name only a rank, or only a PCI address)."""
    if winner is None:
        return ""
    rule = rules.by_id.get(winner.hit.hint_rule or winner.hit.rule_id)
    if rule is None or not rule.hint:
        return winner.hit.hint
    groups = dict(winner.hit.groups)
    for key, values in (("host", hosts), ("rank", ranks), ("gpu", gpus)):
        if values and not groups.get(key):
            groups[key] = ", ".join(map(str, values[:4]))
    return render_hint(rule.hint, groups, winner.hit.line, winner.event)


# -- vote, context, words -----------------------------------------------------------------------------


def _vote(winner: Finding | None, findings: list[Finding]) -> StageVote:
    if winner is None:
        return StageVote(source="rules", scores=[])
    scores: dict[tuple[str, str], tuple[Label, float]] = {}
    w = winner.hit
    scores[(w.label.category.value, w.label.failure_type)] = (w.label, w.confidence)
    # Other root causes keep a little mass, so a later stage can still prefer one of them.
    for f in findings:
        if f is winner or f.hit.role == Role.SYMPTOM:
            continue
        key = (f.hit.label.category.value, f.hit.label.failure_type)
        if key not in scores:
            scores[key] = (f.hit.label, min(0.3, f.hit.confidence * 0.3))
    ranked = sorted(scores.values(), key=lambda s: -s[1])
    return StageVote(source="rules", scores=ranked, evidence=_evidence(winner, findings))


def _evidence(winner: Finding, findings: list[Finding], limit: int = 6) -> list[Evidence]:
    """The root line first; then other causes; then the loudest symptoms, each counted once."""
    out = [Evidence(line_no=winner.hit.line.line_no, text=winner.hit.line.raw, source=f"rule:{winner.hit.rule_id}")]
    others = [f for f in findings if f is not winner and f.event.kind != EventKind.STALL]
    others.sort(key=lambda f: (f.hit.role != Role.ROOT_CAUSE, -len(f.ranks), -f.similar, f.event.line_no))
    seen_rules = {winner.hit.rule_id}
    for f in others:
        if len(out) >= limit:
            break
        if f.hit.role == Role.SYMPTOM and f.hit.rule_id in seen_rules:
            continue
        seen_rules.add(f.hit.rule_id)
        text = _clip(f.hit.line.raw)
        if f.similar > 1:
            where = f" on {len(f.ranks)} ranks" if len(f.ranks) > 1 else ""
            text = f"{text}  (+{f.similar - 1} similar{where})"
        out.append(Evidence(line_no=f.hit.line.line_no, text=text, source=f"rule:{f.hit.rule_id}"))
    return out


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def failure_context(root: Record | None, winner: Finding | None, templates: Sequence[TemplateStats]) -> FailureContext:
    root_text = root.raw if root else ""
    near = _nearby_error_templates(templates, root.line_no if root else None)
    excerpt: list[str] = []
    if winner is not None:
        excerpt = [r.raw for r in winner.event.lines[-12:]]
    elif root is not None:
        excerpt = [root.raw]
    event = winner.event if winner else None
    hosts = {r.host for r in (winner.event.lines if winner else ())} | {root.host if root else None}
    hosts |= {h for t in templates if t.error_bearing for h in t.hosts}
    return FailureContext(
        root_text=root_text,
        root_masked=mask(root.text) if root else "",
        templates=near,
        excerpt=excerpt,
        exception_type=event.exception_type if event else None,
        root_message=root.text if root else "",
        hosts=tuple(sorted(h for h in hosts if h)),
    )


def _nearby_error_templates(templates: Sequence[TemplateStats], line_no: int | None, limit: int = 8) -> list[str]:
    errors = [t for t in templates if t.error_bearing and t.template_id >= 0]
    if line_no is not None:
        errors.sort(key=lambda t: abs(t.first_line - line_no))
    return [t.template for t in errors[:limit]]


def likeliest_unexplained(events: Sequence[Event]) -> Record | None:
    """With no rule to go by: the last exception raised, else the last error line before the end; None when the
    only lines that look like errors are warnings (a program that warns goes on: they do not say why it ended)."""
    raised = [e for e in events if e.exception_type]
    errors = [e for e in events if e.kind not in (EventKind.STALL, EventKind.LOSS_SPIKE)]
    # Python prints a warning's source line right after it ("  warnings.warn(...)"): part of the warning.
    echoes = {(e.anchor.feed, e.anchor.line_no + 1) for e in errors if is_warning(e)}
    plain = [e for e in errors if not is_warning(e)
             and not ((e.anchor.feed, e.anchor.line_no) in echoes and e.anchor.raw[:1].isspace())]
    pool = raised or plain or ([] if errors else list(events))
    return pool[-1].anchor if pool else None


def _explain(
    winner: Finding | None, role: Role | None, findings: list[Finding], hosts: list[str], ranks: list[int], gpus: list[str]
) -> str:
    if winner is None:
        return "No failure signature found in the log."
    where = _where(hosts, ranks, gpus)
    title = winner.hit.title
    if role == Role.SYMPTOM and winner.hit.label.failure_type == FT.CANCELLED:
        return f"{title}, at line {winner.hit.line.line_no}; nothing failed before it."
    if role == Role.SYMPTOM and is_resubmit(winner.hit.label.failure_type) and not any(
            f.hit.role == Role.SYMPTOM and not is_resubmit(f.hit.label.failure_type) for f in findings):
        # The scheduler's own word that it ended the job, and no other symptom beside it: that is the story.
        return f"{title}, at line {winner.hit.line.line_no}: the scheduler ended the job; nothing failed before it."
    if role == Role.SYMPTOM:
        reporters = set().union(*(f.ranks for f in findings if f.hit.role == Role.SYMPTOM))
        on = f" on {len(reporters)} rank{'s' * (len(reporters) != 1)}" if reporters else ""
        text = f"Only symptoms found: {title}{on}"
        return text + (f"; the culprit is likely {where}, which fell silent or lagged." if where else ".")
    text = f"{title}{' on ' + where if where else ''} (line {winner.hit.line.line_no})"
    symptom_ranks: dict[str, set[int]] = defaultdict(set)
    for f in findings:
        if f.hit.role == Role.SYMPTOM:
            symptom_ranks[f.hit.title] |= f.ranks or {-1}
    if symptom_ranks:
        title2, rs = max(symptom_ranks.items(), key=lambda kv: len(kv[1]))
        n = len(rs - {-1})
        text += f"; then {n} other rank{'s' if n != 1 else ''} reported: {title2}" if n else f"; then: {title2}"
    return text + "."


def _raised_where(winner: Finding | None, rules: RuleSet) -> str:
    """For an exception: what it said, and where in the user's own code it was raised (the file
    and line to open), or which library raised it."""
    if winner is None or not winner.event.exception_type:
        return ""
    ev = winner.event
    said = f" {ev.exception_type}: {_clip(ev.exception_message or '', 160)}".rstrip(": ")
    info = locate(ev, rules.origin)
    if info.where == "user" and info.path:
        at = f"{info.path}:{info.line}" if info.line else info.path
        return f"{said} — raised in your code at {at}" + (f" ({info.function})." if info.function else ".")
    if info.where == "library" and info.module:
        return f"{said} — raised inside {info.module}."
    return f"{said}."


def _where(hosts: list[str], ranks: list[int], gpus: list[str]) -> str:
    parts = []
    if hosts:
        parts.append(", ".join(hosts[:4]))
    if ranks:
        parts.append("rank " + ", ".join(map(str, ranks[:8])) + ("…" if len(ranks) > 8 else ""))
    if gpus:
        parts.append("GPU " + ", ".join(gpus[:4]))
    return " ".join(parts[:1]) + (f" ({', '.join(parts[1:])})" if len(parts) > 1 else "")
