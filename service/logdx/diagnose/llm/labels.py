"""The closed label set the LLM scores, the failure as prompt lines, and the templated explanation."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from logdx.diagnose.llm.prompts import Prompts
from logdx.model import FT, Action, Category, FailureContext, Label, StageVote
from logdx.taxonomy import category_of, is_canonical, is_learnable, make_label, title_of

MAX_QUERY_LINES = 10


# Category-level defaults: always in the candidate set, so the model can disagree with the earlier
# stages at least about the category (the generic type of each category, plus a few frequent ones).
DEFAULT_CANDIDATES: tuple[FT, ...] = (
    FT.FRAMEWORK_ERROR, FT.SCRIPT_ERROR, FT.GPU_HARDWARE_ERROR, FT.NETWORK_ERROR, FT.CUDA_OOM, FT.CONFIG_ERROR,
)

# Exception classes that name their failure type outright (a cheap, precise candidate).
_EXCEPTION_CANDIDATES: dict[str, FT] = {
    "SyntaxError": FT.SYNTAX_ERROR,
    "IndentationError": FT.SYNTAX_ERROR,
    "ModuleNotFoundError": FT.IMPORT_ERROR,
    "ImportError": FT.IMPORT_ERROR,
    "NameError": FT.NAME_ERROR,
    "AttributeError": FT.ATTRIBUTE_ERROR,
    "TypeError": FT.TYPE_ERROR,
    "KeyError": FT.KEY_ERROR,
    "IndexError": FT.INDEX_ERROR,
    "ValueError": FT.VALUE_ERROR,
    "FileNotFoundError": FT.FILE_NOT_FOUND,
    "PermissionError": FT.PERMISSION_ERROR,
    "CalledProcessError": FT.CALLED_PROCESS_ERROR,
    "OutOfMemoryError": FT.CUDA_OOM,
}


def _exception_name(text: str | None) -> str | None:
    if not text:
        return None
    m = re.search(r"([A-Z]\w*(?:Error|Exception))\b", text)
    return m.group(1) if m else None


def candidate_labels(
    prior_votes: Sequence[StageVote], ctx: FailureContext | None = None, max_candidates: int = 12,
    examples: Sequence[Any] = (),
) -> list[Label]:
    """The closed label set to score: labels proposed by rules and retrieval (best first), the
    label the exception class names, the labels of the nearest incidents (`examples`, below the
    voting threshold too: a near miss is still evidence of what this may be), then category-level
    defaults; unique, at most ``max_candidates``. `proposed_labels` says which of them evidence proposed."""
    out: dict[tuple[str, str], Label] = {}

    def add(cat: str | Category, ft: str, action: Action | None = None) -> None:
        key = (Category(cat).value, ft)
        if key not in out and is_canonical(cat, ft) and is_learnable(ft) and len(out) < max_candidates:
            out[key] = make_label(cat, ft, action)

    def add_type(ft: FT) -> None:
        cat = category_of(ft)
        if cat is not None:
            add(cat, ft)

    proposed = sorted(
        ((lab, s) for v in prior_votes for lab, s in v.scores), key=lambda ls: ls[1], reverse=True
    )
    for lab, _ in proposed[: max(1, max_candidates - len(DEFAULT_CANDIDATES) - 1)]:
        add(lab.category, lab.failure_type, lab.action)
    if ctx is not None:
        exc = _exception_name(ctx.exception_type) or _exception_name(ctx.root_text)
        if exc in _EXCEPTION_CANDIDATES:
            add_type(_EXCEPTION_CANDIDATES[exc])
    for ex in examples:
        d = example_dict(ex)
        add(d["category"], d["failure_type"])
    for ft in DEFAULT_CANDIDATES:
        add_type(ft)
    return list(out.values())


def near_misses(prior_votes: Sequence[StageVote], examples: Sequence[Any]) -> Sequence[Any]:
    """The nearest incidents whose labels count as evidence: all of them when retrieval cast no vote (none
    above its threshold: its near misses are then the only evidence of what this may be), else none (its
    vote says it)."""
    voted = any(v.source == "retrieval" and v.scores for v in prior_votes)
    return () if voted else examples


def proposed_labels(prior_votes: Sequence[StageVote], ctx: FailureContext | None, examples: Sequence[Any]) -> set[tuple[str, str]]:
    """The (category, failure_type) pairs some evidence proposed: an earlier stage, the exception's class,
    a near incident. A label only the defaults put in the set may be scored, never chosen alone."""
    out = {(lab.category.value, lab.failure_type) for v in prior_votes for lab, _ in v.scores}
    out |= {(d["category"], d["failure_type"]) for d in map(example_dict, examples)}
    if ctx is not None:
        exc = _exception_name(ctx.exception_type) or _exception_name(ctx.root_text)
        if exc in _EXCEPTION_CANDIDATES and (cat := category_of(_EXCEPTION_CANDIDATES[exc])) is not None:
            out.add((cat.value, _EXCEPTION_CANDIDATES[exc]))
    return out


def query_lines(ctx: FailureContext, max_lines: int = MAX_QUERY_LINES) -> list[str]:
    """The failure as lines for a prompt: the root line, the masked templates near it, the raw
    excerpt; duplicates dropped."""
    lines: list[str] = []
    nearby = [t for t in ctx.templates[:4] if t != ctx.root_masked]  # the root is already first
    for line in [ctx.root_text or ctx.root_masked, *nearby, *ctx.excerpt]:
        line = (line or "").strip()
        if line and line not in lines:
            lines.append(line)
        if len(lines) >= max_lines:
            break
    return lines


def example_dict(ex: Any) -> dict[str, Any]:
    """An incident (or a retrieval Neighbour of one) as template variables."""
    similarity = getattr(ex, "similarity", None)
    inc = getattr(ex, "incident", ex)
    cat = inc.category.value if isinstance(inc.category, Category) else str(inc.category)
    act = inc.action.value if isinstance(inc.action, Action) else str(inc.action)
    return {
        "id": inc.id, "root_line": inc.root_line, "templates": list(inc.templates), "category": cat,
        "failure_type": inc.failure_type, "action": act, "note": inc.note, "similarity": similarity,
    }


def render_explanation(
    prompts: Prompts,
    label: Label,
    ctx: FailureContext,
    *,
    probability: float | None = None,
    n_candidates: int = 0,
    examples: Sequence[Any] = (),
) -> str:
    """The templated explanation of a label (usable by the pipeline for the fused label too)."""
    example = None
    for ex in examples:
        d = example_dict(ex)
        if (d["category"], d["failure_type"]) == (label.category.value, label.failure_type):
            example = d if d["similarity"] is not None else {**d, "similarity": 0.0}
            break
    text = prompts.render(
        "explanation.j2", category=label.category.value, failure_type=label.failure_type,
        title=title_of(label.failure_type),
        probability=probability, n_candidates=n_candidates, root_text=ctx.root_text, example=example,
    )
    return " ".join(text.split())
