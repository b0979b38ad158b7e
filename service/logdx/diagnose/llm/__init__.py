"""The LLM stage: one interface (``LLMStage.score(ctx, votes)``), two backends.

- ``embedded`` (default, offline): Gemma 3 270M scoring a closed label set (``embedded.py``), from
  the GGUF converted once into a cache (``convert.py``).
- ``openai``: any OpenAI-compatible chat endpoint (``openai.py``).

Both share the stage base (``stage.py``: few-shot examples from an ``ExampleSource`` such as
``Retriever.examples``, leaving out ``exclude_ids``; never raising), the label set and the
templated explanation (``labels.py``) and the Jinja2 prompts (``prompts.py``).

Whatever goes wrong (timeout, HTTP error, invalid JSON twice, model missing), ``score`` returns a
``StageVote`` with no scores and the note "llm unavailable: <reason>; fell back to rules +
retrieval". It never raises into the pipeline.
"""

from __future__ import annotations

from logdx.config import LLMSettings
from logdx.diagnose.llm.convert import ConversionInfo, ensure_converted, model_dir
from logdx.diagnose.llm.embedded import EmbeddedScorer
from logdx.diagnose.llm.labels import DEFAULT_CANDIDATES, candidate_labels, render_explanation
from logdx.diagnose.llm.openai import LLMAnswer, OpenAICompatibleClient
from logdx.diagnose.llm.prompts import PromptError, Prompts, neutralize
from logdx.diagnose.llm.stage import BaseStage, Disabled, ExampleSource, LLMStage, LLMUnavailable, unavailable

__all__ = [
    "DEFAULT_CANDIDATES",
    "ConversionInfo",
    "EmbeddedScorer",
    "ExampleSource",
    "LLMAnswer",
    "LLMStage",
    "LLMUnavailable",
    "OpenAICompatibleClient",
    "PromptError",
    "Prompts",
    "candidate_labels",
    "ensure_converted",
    "make_llm",
    "model_dir",
    "neutralize",
    "render_explanation",
    "unavailable",
]


def make_llm(settings: LLMSettings | None = None, *, examples: ExampleSource | None = None) -> BaseStage:
    """The stage `llm.backend` names; a misconfiguration gives a stage that always reports why.

    ``examples``: where few-shot incidents come from when ``score`` is not given any (pass
    ``retriever.examples``)."""
    s = settings or LLMSettings()
    if not s.enabled:
        return Disabled("disabled by configuration")
    try:
        prompts = Prompts(s.prompts_dir)
    except PromptError as e:
        return Disabled(f"prompt error: {e}")
    if s.backend == "embedded":
        return EmbeddedScorer(s, prompts, examples=examples)
    if not s.base_url:
        return Disabled("backend 'openai' needs llm.base_url")
    return OpenAICompatibleClient(s, prompts, examples=examples)
