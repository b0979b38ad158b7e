"""Stage 4: diagnosis, a cascade. Rules are precise and explainable; retrieval over past incidents
covers what rules miss; a local LLM arbitrates the rest. `Diagnoser` runs the cascade."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

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
    def score(self, ctx: FailureContext, votes: Sequence[StageVote]) -> StageVote: ...


@dataclass
class Diagnoser:
    rules: RuleSet
    retrieval: Retrieval | None = None
    llm: LabelScorer | None = None
    exclude_incidents: Sequence[str] = field(default_factory=tuple)  # leave-one-out evaluation

    def diagnose(
        self,
        events: Sequence[Event],
        summary: CompressionSummary,
        templates: Sequence[TemplateStats],
        exit_code: int | None = None,
    ) -> Diagnosis:
        outcome = find_root_cause(events, summary, templates, self.rules, exited_ok=exit_code == 0)
        if outcome.winner is None and not _has_failure_signal(outcome, exit_code):
            return Diagnosis(status="healthy", label=None, confidence=_healthy_confidence(summary), root=None,
                             explanation="No failure found: no error, traceback, hardware fault or stall in the log.")
        return _from_rules(outcome, exit_code)


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
