"""Stage 4: diagnosis, a cascade. Rules are precise and explainable; retrieval over past incidents
covers what rules miss; a local LLM arbitrates the rest. `Diagnoser` runs the cascade."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from logdx.diagnose.fusion import FusionResult, FusionWeights, fuse
from logdx.diagnose.rootcause import RulesOutcome, find_root_cause
from logdx.diagnose.rules import RuleSet
from logdx.model import (
    Action,
    Category,
    CompressionSummary,
    Diagnosis,
    Event,
    FailureContext,
    Label,
    Role,
    StageVote,
    TemplateStats,
)


class Retrieval(Protocol):
    def search(self, ctx: FailureContext, k: int = 5, exclude_ids: Sequence[str] = ()) -> StageVote: ...


class LabelScorer(Protocol):
    def score(
        self, ctx: FailureContext, votes: Sequence[StageVote], *, exclude_ids: Sequence[str] = ()
    ) -> StageVote: ...


@dataclass
class Diagnoser:
    """Rules first; retrieval whenever it is on; the LLM when the rules are not decisive (no
    precise root cause, or retrieval disagrees) or `llm_always`; then fusion of their votes."""

    rules: RuleSet
    retrieval: Retrieval | None = None
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
        outcome = find_root_cause(events, summary, templates, self.rules, exited_ok=exit_code == 0)
        stage_ms = {"rules": _ms_since(t0)}
        if outcome.winner is None and not _has_failure_signal(outcome, exit_code):
            return Diagnosis(status="healthy", label=None, confidence=_healthy_confidence(summary), root=None,
                             explanation="No failure found: no error, traceback, hardware fault or stall in the log.",
                             stage_ms=stage_ms)
        diagnosis = _from_rules(outcome, exit_code)
        diagnosis.context = outcome.context
        diagnosis.stage_ms = stage_ms
        if self.retrieval is None and self.llm is None:
            return diagnosis
        return self._cascade(outcome, diagnosis)

    def _cascade(self, outcome: RulesOutcome, diagnosis: Diagnosis) -> Diagnosis:
        ctx = outcome.context
        votes = [outcome.vote]
        if self.retrieval is not None:
            t0 = time.perf_counter()
            votes.append(self.retrieval.search(ctx, exclude_ids=self.exclude_incidents))
            diagnosis.stage_ms["retrieval"] = _ms_since(t0)
        if self.llm is not None:
            if self.llm_always or not _rules_decide(outcome, votes):
                t0 = time.perf_counter()
                votes.append(self.llm.score(ctx, votes, exclude_ids=self.exclude_incidents))
                diagnosis.stage_ms["llm"] = _ms_since(t0)
            else:
                diagnosis.notes.append("llm not consulted: a precise rule decided and retrieval agrees")
        result = fuse(votes, rule_hit_precise=outcome.role == Role.ROOT_CAUSE, weights=self.weights)
        return _merge(diagnosis, result, votes)


def _ms_since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def _rules_decide(outcome: RulesOutcome, votes: Sequence[StageVote]) -> bool:
    """A precise root-cause rule, and retrieval does not say otherwise: nothing to arbitrate."""
    if outcome.role != Role.ROOT_CAUSE or outcome.winner is None:
        return False
    rule_label = outcome.winner.hit.label
    for vote in votes:
        if vote.source == "retrieval" and vote.scores:
            top = vote.scores[0][0]
            if (top.category, top.failure_type) != (rule_label.category, rule_label.failure_type):
                return False
    return True


def _merge(diagnosis: Diagnosis, result: FusionResult, votes: list[StageVote]) -> Diagnosis:
    """The fused label and confidence over the rules' diagnosis; rules keep the root line."""
    diagnosis.votes = votes
    diagnosis.notes.extend(n for n in result.notes if n not in diagnosis.notes)
    if result.label is None:
        return diagnosis
    changed = diagnosis.label is None or (
        (diagnosis.label.category, diagnosis.label.failure_type) != (result.label.category, result.label.failure_type)
    )
    if changed:
        was = f"{diagnosis.label.category.value}/{diagnosis.label.failure_type}" if diagnosis.label else "nothing"
        diagnosis.notes.append(f"{result.decided_by} changed the rules' verdict ({was})")
        diagnosis.hint = _hint_from_neighbours(result) or diagnosis.hint
        if diagnosis.label is not None and result.label.category != Category.INFRASTRUCTURE:
            diagnosis.culprit_hosts = []  # a node is only to blame for an infrastructure cause
    diagnosis.label = result.label
    diagnosis.confidence = result.confidence
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
    return bool(exit_code) or any(e.kind == "traceback" and e.exception_type for e in outcome.unexplained_events)


def _likeliest_unexplained(events: Sequence[Event]):  # noqa: ANN202 - Record | None
    """With no rule to go by: the last exception raised, else the last error line before the end."""
    raised = [e for e in events if e.exception_type]
    pool = raised or [e for e in events if e.kind not in ("stall", "loss_spike")] or list(events)
    return pool[-1].anchor if pool else None


def _healthy_confidence(summary: CompressionSummary) -> float:
    # A log that shows training progress and no error is healthy with some confidence; an empty
    # or tiny log tells little.
    return 0.9 if summary.progress_lines > 0 else 0.6


def _from_rules(outcome: RulesOutcome, exit_code: int | None) -> Diagnosis:
    winner = outcome.winner
    if winner is None:
        label = Label(Category.UNKNOWN, "unknown", Action.NO_RESTART)
        root = _likeliest_unexplained(outcome.unexplained_events)
        explanation = (
            f"The job failed (exit code {exit_code}) but no known failure signature was found."
            if exit_code
            else "An error was found that no rule recognises."
        )
        return Diagnosis(status="failed", label=label, confidence=0.3, root=root, explanation=explanation,
                         hint="Read the excerpt around the root line; add a rule or feed back the right label.")
    hit = winner.hit
    confidence = hit.confidence
    if outcome.role == Role.SYMPTOM:
        confidence = min(confidence, 0.6 if outcome.culprit_ranks else 0.45)
    elif outcome.role == Role.FALLBACK:
        confidence = min(confidence, 0.6)
    return Diagnosis(
        status="failed",
        label=hit.label,
        confidence=confidence,
        root=hit.line,
        culprit_hosts=outcome.culprit_hosts,
        culprit_ranks=outcome.culprit_ranks,
        culprit_gpus=outcome.culprit_gpus,
        evidence=outcome.vote.evidence,
        explanation=outcome.explanation,
        hint=outcome.hint,
        votes=[outcome.vote],
    )
