"""The LLM stage's interface, and what both backends share: fetching few-shot examples, and never
raising into the pipeline (any failure is a vote with no scores and a note)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from logdx.diagnose.llm.prompts import PromptError
from logdx.model import FailureContext, StageVote

log = logging.getLogger("logdx.diagnose.llm")


class LLMUnavailable(RuntimeError):
    """The backend cannot answer; the message is the reason shown in the vote's note."""


# Where few-shot examples come from when the caller passes none: typically
# ``Retriever.examples`` (nearest incidents, no similarity threshold), called with the context and
# the incident ids to leave out (leave-one-out evaluation must not show the model the answer).
ExampleSource = Callable[[FailureContext, Sequence[str]], Sequence[Any]]


class LLMStage(Protocol):
    name: str

    def score(
        self,
        ctx: FailureContext,
        votes: Sequence[StageVote],
        *,
        examples: Sequence[Any] | None = None,
        exclude_ids: Sequence[str] = (),
    ) -> StageVote:
        """The stage's vote given the earlier stages' votes. Never raises: on any failure it
        returns ``unavailable(reason)``."""
        ...


class BaseStage:
    """What both backends share: fetching examples, and never raising."""

    name = "llm"

    def __init__(self, examples: ExampleSource | None) -> None:
        self.example_source = examples

    def score(
        self,
        ctx: FailureContext,
        votes: Sequence[StageVote],
        *,
        examples: Sequence[Any] | None = None,
        exclude_ids: Sequence[str] = (),
    ) -> StageVote:
        excluded = set(exclude_ids)
        if examples is None and self.example_source is not None:
            try:
                examples = self.example_source(ctx, tuple(excluded))
            except Exception as e:  # noqa: BLE001 - examples help; their absence must not hurt
                log.warning("no few-shot examples for the LLM: %s", e)
                examples = ()
        kept = [ex for ex in (examples or ()) if getattr(getattr(ex, "incident", ex), "id", None) not in excluded]
        return self.vote(ctx, prior_votes=votes, examples=kept)

    def vote(
        self, ctx: FailureContext, *, prior_votes: Sequence[StageVote] = (), examples: Sequence[Any] = ()
    ) -> StageVote:
        try:
            return self._vote(ctx, prior_votes, examples)
        except LLMUnavailable as e:
            return unavailable(str(e))
        except PromptError as e:
            return unavailable(f"prompt error: {e}")
        except Exception as e:
            log.exception("%s backend failed", self.name)
            return unavailable(f"{type(e).__name__}: {e}")

    def _vote(self, ctx: FailureContext, prior_votes: Sequence[StageVote], examples: Sequence[Any]) -> StageVote:
        raise NotImplementedError


def unavailable(reason: str) -> StageVote:
    return StageVote(source="llm", scores=[], note=f"llm unavailable: {reason}; fell back to rules + retrieval")


class Disabled(BaseStage):
    """A stage that cannot run (disabled, misconfigured): every vote says why."""

    name = "none"

    def __init__(self, reason: str) -> None:
        super().__init__(None)
        self.reason = reason

    def _vote(self, ctx: FailureContext, prior_votes: Sequence[StageVote], examples: Sequence[Any]) -> StageVote:
        return unavailable(self.reason)
