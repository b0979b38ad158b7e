"""`logdx prompts check`: every template compiles, and renders with sample data through the same
code paths the backends use (a template that compiles can still use a variable nobody passes)."""

from __future__ import annotations

from logdx.config import LLMSettings
from logdx.diagnose.llm.embedded import EmbeddedScorer
from logdx.diagnose.llm.labels import candidate_labels, render_explanation
from logdx.diagnose.llm.openai import OpenAICompatibleClient
from logdx.diagnose.llm.prompts import PromptError, Prompts
from logdx.model import FT, Action, Category, FailureContext, Label, StageVote

_SAMPLE_CONTEXT = FailureContext(
    root_text="[rank3]: RuntimeError: CUDA error: uncorrectable ECC error encountered",
    root_masked="[rank<*>]: RuntimeError: CUDA error: uncorrectable ECC error encountered",
    templates=["NVRM: Xid (PCI:<*>): <*>, pid=<*>, name=python, An uncorrectable double bit error"],
    excerpt=["[rank3]: RuntimeError: CUDA error: uncorrectable ECC error encountered"],
    exception_type="RuntimeError",
)
_SAMPLE_LABEL = Label(Category.INFRASTRUCTURE, FT.ECC_ERROR, Action.CORDON_AND_RESTART)


class _SampleIncident:
    id = "inc-sample"
    root_line = "NVRM: Xid (PCI:0000:8a:00): 48, pid=1, name=python, An uncorrectable double bit error (DBE)"
    templates = ["NVRM: Xid (PCI:<*>): <*>, pid=<*>, name=python, An uncorrectable double bit error (DBE)"]
    category = Category.INFRASTRUCTURE
    failure_type = FT.ECC_ERROR
    action = Action.CORDON_AND_RESTART
    note = "GPU replaced"


def check_prompts(prompts: Prompts) -> list[str]:
    """Problems as "<file>:<line>: message", empty when every template compiles and renders."""
    problems = prompts.check()
    if problems:
        return problems
    examples = [_SampleIncident()]
    votes = [StageVote(source="rules", scores=[(_SAMPLE_LABEL, 0.9)])]
    settings = LLMSettings()
    renders = {
        "explanation.j2": lambda: render_explanation(prompts, _SAMPLE_LABEL, _SAMPLE_CONTEXT, probability=0.8,
                                                     n_candidates=6, examples=examples),
        "score/prompt.j2": lambda: EmbeddedScorer(settings, prompts).build_prompt(_SAMPLE_CONTEXT, examples),
        "score/candidate.j2": lambda: [
            prompts.render("score/candidate.j2", category=lab.category.value, failure_type=lab.failure_type)
            for lab in candidate_labels(votes, _SAMPLE_CONTEXT)
        ],
        "chat/*.j2": lambda: _chat(prompts, settings, votes, examples),
    }
    for name, render in renders.items():
        try:
            render()
        except PromptError as e:
            problems.append(str(e))
        except Exception as e:  # noqa: BLE001 - a check reports, it does not crash
            problems.append(f"{prompts.directory / name}: cannot render with sample data: {type(e).__name__}: {e}")
    return problems


def _chat(prompts: Prompts, settings: LLMSettings, votes: list[StageVote], examples: list[_SampleIncident]) -> None:
    client = OpenAICompatibleClient(settings, prompts)
    try:
        client.messages(_SAMPLE_CONTEXT, votes, examples)
        prompts.render("chat/retry.j2", error="failure_type 'x' is not allowed for category infrastructure")
    finally:
        client.close()
