"""Stage 4: diagnosis, a cascade.

Rules are precise and explainable: when a precise rule names the root cause, it decides, and the
models are not even loaded. Otherwise (a generic fallback, symptoms only, an error nobody wrote a
rule for) the later stages fill in what the rules did not decide: the error catalog (which known
message, raised where), retrieval over past incidents, and the local LLM, whose votes are fused.
A stage that fails becomes a note in the report; the diagnosis carries on without it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from logdx.diagnose.cost import cost_of
from logdx.diagnose.culprit import UNNAMED_CORDON_MIN_CONFIDENCE, blames_one_node
from logdx.diagnose.degradations import degradations_of
from logdx.diagnose.fusion import FusionResult, FusionWeights, fuse, needs_arbiter
from logdx.diagnose.hangs import HANG_TYPES
from logdx.diagnose.health import faults_after_the_end, health_of
from logdx.diagnose.life import first_stopped
from logdx.diagnose.rootcause import Finding, RulesOutcome, find_root_cause, likeliest_unexplained
from logdx.diagnose.rules import RuleSet
from logdx.diagnose.shortlist import shortlist
from logdx.diagnose.stragglers import stragglers_of
from logdx.diagnose.untrusted import guard_action, without_instructions
from logdx.model import (
    FT,
    Action,
    Category,
    CompressionSummary,
    Diagnosis,
    Event,
    EventKind,
    FailureContext,
    Label,
    Recovered,
    Role,
    StageVote,
    TemplateStats,
    rests_on_evidence,
)
from logdx.taxonomy import is_resubmit


class Retrieval(Protocol):
    def search(self, ctx: FailureContext, k: int = 5, exclude_ids: Sequence[str] = ()) -> StageVote: ...


class LabelScorer(Protocol):
    def score(
        self, ctx: FailureContext, votes: Sequence[StageVote], *, exclude_ids: Sequence[str] = ()
    ) -> StageVote: ...


CatalogStage = Callable[[FailureContext], StageVote]


@dataclass
class Diagnoser:
    """Rules first. When they do not decide (no precise root cause): the catalog, retrieval, and
    where past incidents are absent or split the arbiter and/or the LLM (arbiter.stage) vote, and their votes are fused with the rules' tentative label. `llm_always` consults
    the later stages even when a precise rule decided; they still cannot overturn it, only explain."""

    rules: RuleSet
    catalog: CatalogStage | None = None
    retrieval: Retrieval | None = None
    arbiter: LabelScorer | None = None  # the classifier over retrieval's embedding (arbiter.py)
    llm: LabelScorer | None = None
    weights: FusionWeights = field(default_factory=FusionWeights)
    llm_always: bool = False
    exclude_incidents: Sequence[str] = field(default_factory=tuple)  # leave-one-out evaluation

    def diagnose(
        self,
        events: Sequence[Event],
        summary: CompressionSummary,
        templates: Sequence[TemplateStats],
        exit_code: int | None = None,
    ) -> Diagnosis:
        t0 = time.perf_counter()
        outcome = find_root_cause(events, summary, templates, self.rules, exit_code=exit_code)
        stage_ms = {"rules": _ms_since(t0)}
        diagnosis = self._diagnose(outcome, summary, templates, exit_code, stage_ms)
        diagnosis.recovered = [_recovered(f) for f in outcome.recovered if not _inside_divergence(f, summary)]
        diagnosis.degradations = degradations_of(summary)
        diagnosis.stragglers = stragglers_of(summary, events)  # advice: the action stays what it was
        if diagnosis.status == "failed":
            diagnosis.stopped_first = first_stopped(summary)
            diagnosis.hypotheses = shortlist(diagnosis)
            diagnosis.cost = cost_of(diagnosis, summary, templates)
        return diagnosis

    def _diagnose(self, outcome: RulesOutcome, summary: CompressionSummary, templates: Sequence[TemplateStats],
                  exit_code: int | None, stage_ms: dict[str, float]) -> Diagnosis:
        if not exit_code and not any(t.template.strip() for t in templates):
            return Diagnosis(status="empty", label=None, confidence=1.0, root=None,
                             explanation="No log lines: the input is empty or holds only blank lines.",
                             stage_ms=stage_ms)
        if outcome.winner is None and not _has_failure_signal(outcome, exit_code):
            health = health_of(summary, outcome.unexplained_events, exit_code)
            notes = faults_after_the_end([(f.event, f.hit) for f in outcome.recovered], summary.progress)
            return Diagnosis(status="healthy" if health.healthy else "unknown", label=None,
                             confidence=health.confidence, root=None, explanation=health.explanation,
                             hint=health.hint, notes=notes, stage_ms=stage_ms)
        diagnosis = _from_rules(outcome, exit_code)
        diagnosis.context = outcome.context
        diagnosis.stage_ms = stage_ms
        if _rules_decide(outcome) and not self.llm_always:
            return settle_action(diagnosis)
        return settle_action(self._cascade(outcome, diagnosis))

    def _cascade(self, outcome: RulesOutcome, diagnosis: Diagnosis) -> Diagnosis:
        ctx = outcome.context
        votes = [outcome.vote]
        if (catalog := self.catalog) is not None:
            self._consult("catalog", diagnosis, votes, lambda: catalog(ctx))
        # What a model reads is data, not instructions to it (untrusted.py).
        learned = self.retrieval is not None or self.arbiter is not None or self.llm is not None
        learned_ctx, withheld = without_instructions(ctx) if learned else (ctx, 0)
        if withheld:
            diagnosis.notes.append(f"{withheld} line(s) shaped as instructions to a model were withheld from "
                                   "retrieval and the LLM")
        if self.retrieval is not None:
            retrieval = self.retrieval
            self._consult("retrieval", diagnosis, votes,
                          lambda: retrieval.search(learned_ctx, exclude_ids=self.exclude_incidents))
        # Asked only where past incidents do not agree on one label (or retrieval is off): votes as they stand.
        arbitrate = self.llm_always or needs_arbiter(votes, self.weights.split_margin)
        if self.arbiter is not None and arbitrate:
            arbiter = self.arbiter
            self._consult("arbiter", diagnosis, votes,
                          lambda: arbiter.score(learned_ctx, votes, exclude_ids=self.exclude_incidents))
        if self.llm is not None and arbitrate:
            llm = self.llm
            self._consult("llm", diagnosis, votes,
                          lambda: llm.score(learned_ctx, votes, exclude_ids=self.exclude_incidents))
        elif self.llm is not None:
            diagnosis.notes.append("llm not consulted: past incidents agree on one label")
        if _rules_decide(outcome):
            # A precise rule is not overturned: the other stages may only agree or explain.
            return _explain_only(diagnosis, votes)
        return _merge(diagnosis, fuse(votes, rule_hit_precise=False, weights=self.weights), votes)

    @staticmethod
    def _consult(name: str, diagnosis: Diagnosis, votes: list[StageVote], ask: Callable[[], StageVote]) -> None:
        """One later stage's vote; a stage that fails is a note, never the end of the diagnosis."""
        t0 = time.perf_counter()
        try:
            vote = ask()
        except Exception as e:  # noqa: BLE001 - any failure of an optional stage must not lose the report
            diagnosis.notes.append(f"{name} unavailable: {type(e).__name__}: {e}"[:300])
            return
        finally:
            diagnosis.stage_ms[name] = _ms_since(t0)
        votes.append(vote)


def _inside_divergence(f: Finding, summary: CompressionSummary) -> bool:
    """A loss spike or NaN printed after the loss diverged is a point of that divergence, not one the job came back from."""
    d = summary.progress.divergence
    return d is not None and f.event.kind in (EventKind.LOSS_SPIKE, EventKind.LOSS_NAN) and f.hit.line.line_no >= d.line_no


def _recovered(f: Finding) -> Recovered:
    line = f.hit.line
    return Recovered(line_no=line.line_no, text=line.raw, kind=f.event.kind, rank=line.rank, host=line.host,
                     source=f"rule:{f.hit.rule_id}")


def settle_action(diagnosis: Diagnosis) -> Diagnosis:
    """The last word on the action, whichever stage chose the label: a cordon only when the log
    blames exactly one machine (culprit.py), otherwise a restart, and the report says why."""
    label = diagnosis.label
    timeout = diagnosis.timeout
    if label is not None and timeout is not None and timeout.decided and (action := timeout.spec.action) is not None \
            and label.action is not action:
        # The timeout's cause set the verdict (the code's or the config's): its action, whichever stage spoke last.
        diagnosis.label = label = Label(label.category, label.failure_type, action)
        diagnosis.notes.append(f"{action.value}: the collectives timed out because {timeout.spec.title}")
    if label is None or label.action is not Action.CORDON_AND_RESTART:
        return diagnosis
    att = diagnosis.attribution
    if not rests_on_evidence(diagnosis.decided_by):
        # The hard floor, under every setting: no rule or catalog entry chose this verdict.
        ok, why = False, f"{diagnosis.decided_by} chose this verdict, and no rule or catalog entry supports it"
    elif label.failure_type in HANG_TYPES:
        # A hang takes its silent rank's node out only when the log names it and a second signal agrees.
        ok, why = (True, "") if len(att.hosts) == 1 and att.corroborated else (
            False, "the hang's silent rank is not on one named, corroborated host")
    else:
        unnamed_ok = diagnosis.decided_by == "rules" and diagnosis.confidence >= UNNAMED_CORDON_MIN_CONFIDENCE
        ok, why = blames_one_node(att, unnamed_ok=unnamed_ok)
    if not ok:
        diagnosis.label = Label(label.category, label.failure_type, Action.RESTART)
        diagnosis.notes.append(f"restart, not cordon: {why}")
    return diagnosis


def _ms_since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def _rules_decide(outcome: RulesOutcome) -> bool:
    """A precise root cause, or the scheduler's own word that it ended the job (a time limit or a
    preemption ends a job that did nothing wrong, whatever else it printed)."""
    if outcome.role is Role.ROOT_CAUSE:
        return True
    return outcome.winner is not None and is_resubmit(outcome.winner.hit.label.failure_type)


def _explain_only(diagnosis: Diagnosis, votes: list[StageVote]) -> Diagnosis:
    """The rules' label stands; a stage that agrees may explain it, one that does not is noted."""
    diagnosis.votes = votes
    label = diagnosis.label
    if label is None:
        return diagnosis
    for vote in votes[1:]:
        if vote.note and vote.note not in diagnosis.notes:
            diagnosis.notes.append(vote.note)
        if not vote.scores:
            continue
        top = vote.scores[0][0]
        if (top.category, top.failure_type) == (label.category, label.failure_type):
            if vote.explanation:
                diagnosis.explanation = vote.explanation
        else:
            diagnosis.notes.append(
                f"{vote.source} suggested {top.category.value}/{top.failure_type}; the precise rule stands")
    return diagnosis


def _merge(diagnosis: Diagnosis, result: FusionResult, votes: list[StageVote]) -> Diagnosis:
    """The fused label and confidence over the rules' diagnosis; rules keep the root line."""
    diagnosis.votes = votes
    diagnosis.notes.extend(n for n in result.notes if n not in diagnosis.notes)
    if result.label is None:
        return diagnosis
    guarded, why = guard_action(result.label, result.decided_by, votes)
    if why:
        result.label = guarded
        diagnosis.notes.append(why)
    changed = diagnosis.label is None or (
        (diagnosis.label.category, diagnosis.label.failure_type) != (result.label.category, result.label.failure_type)
    )
    if changed:
        was = f"{diagnosis.label.category.value}/{diagnosis.label.failure_type}" if diagnosis.label else "nothing"
        diagnosis.notes.append(f"{result.decided_by} changed the rules' verdict ({was})")
        diagnosis.hint = _hint_from_neighbours(result) or diagnosis.hint
        if diagnosis.label is not None and result.label.category != Category.INFRASTRUCTURE:
            diagnosis.attribution.hosts = []  # a node is only to blame for an infrastructure cause
    diagnosis.label = result.label
    diagnosis.confidence = result.confidence
    if changed:
        diagnosis.decided_by = result.decided_by or "fusion"
    known = {(e.source, e.line_no, e.text) for e in diagnosis.evidence}
    diagnosis.evidence.extend(e for e in result.evidence if (e.source, e.line_no, e.text) not in known)
    if result.explanation:
        diagnosis.explanation = result.explanation
    return diagnosis


def _hint_from_neighbours(result: FusionResult) -> str:
    for e in result.evidence:
        if e.source.startswith("retrieval:"):
            return f"Like past incident {e.source.split(':', 1)[1]}: {e.text}"
    return ""


def _has_failure_signal(outcome: RulesOutcome, exit_code: int | None) -> bool:
    return bool(exit_code) or any(e.kind == EventKind.TRACEBACK and e.exception_type for e in outcome.unexplained_events)


def _from_rules(outcome: RulesOutcome, exit_code: int | None) -> Diagnosis:
    winner = outcome.winner
    if winner is None:
        label = Label(Category.UNKNOWN, FT.UNKNOWN, Action.NO_RESTART)
        root = likeliest_unexplained(outcome.unexplained_events)
        explanation = (
            f"The job failed (exit code {exit_code}) but no known failure signature was found."
            if exit_code
            else "An error was found that no rule recognises."
        )
        hint = ("Read the excerpt around the root line; add a rule or feed back the right label." if root is not None
                else "No line of the log says why it ended (warnings at most): look at its last lines, and at what "
                     "ended it (the scheduler's record, the kernel's log of the node: an OOM kill prints nothing here).")
        return Diagnosis(status="failed", label=label, confidence=0.3, root=root, explanation=explanation, hint=hint)
    hit = winner.hit
    confidence = hit.confidence
    if outcome.role == Role.SYMPTOM:
        confidence = min(confidence, 0.6 if outcome.attribution.ranks else 0.45)
    elif outcome.role == Role.FALLBACK:
        confidence = min(confidence, 0.6)
    return Diagnosis(
        status="failed",
        label=hit.label,
        confidence=confidence,
        root=hit.line,
        attribution=outcome.attribution,
        # Why no node is named matters only where a node could be to blame.
        notes=list(outcome.attribution.notes) if hit.label.category is Category.INFRASTRUCTURE else [],
        evidence=outcome.vote.evidence,
        explanation=outcome.explanation,
        hint=outcome.hint,
        votes=[outcome.vote],
        timeout=outcome.timeout,
    )
