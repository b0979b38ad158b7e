"""Fuse the votes of the diagnosis stages (rules, retrieval, LLM) into one label and a confidence.

Each stage hands over a ``StageVote``: a distribution over labels (scores 0..1) with evidence.
Labels are compared by ``(category, failure_type)``; actions are decided afterwards (see below).

The decision
------------
Every source gets a weight for this diagnosis (all weights live in ``FusionWeights``):

- ``rules``: ``rules_precise`` when a precise (root-cause) rule hit, else ``rules_fallback`` (only
  a generic catch-all fired, e.g. "uncategorised exception");
- ``retrieval``: ``retrieval``;
- ``arbiter``: ``arbiter`` (the classifier of arbiter.py, asked where the LLM would be: see cascade.py);
- ``llm``: ``llm_arbiter`` when it has to arbitrate, i.e. no precise rule hit AND retrieval is
  empty or split (its two best labels are within ``split_margin``); otherwise ``llm_advisor``,
  small, because a 270M base model must not overrule a precise rule or a clear neighbour vote.

The support of a label is ``sum(weight[source] * score[source][label])``; the best-supported label
wins (ties: the label the rules scored higher, then retrieval, then the LLM). With the defaults a
precise rule hit (0.9+) outweighs even a unanimous neighbour vote (<= 0.6 * 0.95), while a
confident neighbour vote beats a fallback rule (0.35 * its confidence). Below ``min_support``
nothing wins and the label is ``None`` (the pipeline reports category "unknown").

The confidence
--------------
A noisy-OR over the sources that support the winner, damped by the sources that contradict it:

    agree   = 1 - prod_s (1 - w_s * p_s(winner))
    dissent = prod_s (1 - dissent_penalty * w_s * (p_s(top_s) - p_s(winner)))   sources whose top is another label
    conf    = min(max_confidence, agree * dissent)

so a precise rule alone keeps its own confidence, agreement raises it, and a confident
contradiction lowers it. A source that voted for another failure type *of the same category*
gives the winner ``category_credit`` of its score instead of dissenting fully (the category, and
therefore usually the action, is still right). The weights are hand-set (and only sanity-checked
on the 19-case development sample); fit them on held-out data before trusting absolute values.

The action
----------
Sources in ``trusted_action_sources`` (default: rules, whose packs state actions on purpose) keep
the action they gave. Otherwise the action is derived from the label so that the report is always
consistent, from the taxonomy (``logdx/taxonomy.yaml``). A neighbour's stored
action is not trusted because it described *that* incident's culprit, not this one's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from logdx.config import FusionSettings
from logdx.model import Action, Category, Evidence, Label, StageVote
from logdx.taxonomy import default_action

__all__ = [
    "FusionResult",
    "FusionWeights",
    "format_neighbour_evidence",
    "fuse",
    "parse_evidence_label",
]

# Retrieval evidence names the neighbour's label so fusion can keep only the neighbours that
# support the winner. Kept here (a light module) so fusion never imports the heavy retrieval code.
_NEIGHBOUR_RE = re.compile(r"^\[(?P<cat>[a-z]+)/(?P<ft>[a-z_]+) sim=(?P<sim>[0-9.]+)\] ")


def format_neighbour_evidence(label: Label, similarity: float, text: str) -> str:
    return f"[{label.category.value}/{label.failure_type} sim={similarity:.2f}] {text}"


def parse_evidence_label(ev: Evidence) -> tuple[str, str] | None:
    m = _NEIGHBOUR_RE.match(ev.text)
    return (m["cat"], m["ft"]) if m else None


def _weight(name: str) -> float:
    """A fusion weight's default, declared once in config.FusionSettings."""
    return float(FusionSettings.model_fields[name].default)


@dataclass(frozen=True, slots=True)
class FusionWeights:
    """Every number fusion uses. The tunable ones are settings (config.FusionSettings, `fusion:`)."""

    rules_precise: float = _weight("rules_precise")
    rules_fallback: float = _weight("rules_fallback")
    retrieval: float = _weight("retrieval")
    catalog: float = _weight("catalog")
    llm_arbiter: float = _weight("llm_arbiter")
    llm_advisor: float = _weight("llm_advisor")
    arbiter: float = _weight("arbiter")
    other: float = 0.3  # a source fusion does not know (e.g. a future stage)
    split_margin: float = _weight("split_margin")
    category_credit: float = _weight("category_credit")
    dissent_penalty: float = _weight("dissent_penalty")
    min_support: float = _weight("min_support")
    max_confidence: float = _weight("max_confidence")
    trusted_action_sources: tuple[str, ...] = ("rules",)

    @classmethod
    def from_settings(cls, section: FusionSettings) -> FusionWeights:
        return cls(**section.model_dump())


@dataclass(slots=True)
class FusionResult:
    label: Label | None
    confidence: float
    evidence: list[Evidence]
    notes: list[str]
    decided_by: str | None = None  # the source that contributed most to the winner
    ranking: list[tuple[Label, float]] = field(default_factory=list)  # support per label, best first
    explanation: str | None = None  # from a source whose best label is the winner, when it wrote one
    weights_used: dict[str, float] = field(default_factory=dict)


_Key = tuple[Category, str]
_SOURCE_ORDER = ("rules", "catalog", "retrieval", "arbiter", "llm")


@dataclass(slots=True)
class _Dist:
    source: str
    vote: StageVote
    p: dict[_Key, float]
    action: dict[_Key, Action]

    @property
    def top(self) -> tuple[_Key, float] | None:
        if not self.p:
            return None
        key = max(self.p, key=lambda k: self.p[k])
        return key, self.p[key]


def _dist(vote: StageVote) -> _Dist:
    p: dict[_Key, float] = {}
    action: dict[_Key, Action] = {}
    for label, score in vote.scores:
        key = (label.category, label.failure_type)
        s = min(1.0, max(0.0, float(score)))
        if s > p.get(key, -1.0):
            p[key] = s
            action[key] = label.action
    return _Dist(vote.source, vote, p, action)


def needs_arbiter(votes: list[StageVote], margin: float) -> bool:
    """No clear neighbour vote: retrieval is absent, empty or split between two labels. Only then does
    the LLM's vote weigh much (``llm_arbiter``), so only then is it worth asking."""
    retrieval = next((v for v in votes if v.source == "retrieval" and v.scores), None)
    return _is_split(_dist(retrieval) if retrieval is not None else None, margin)


def _is_split(d: _Dist | None, margin: float) -> bool:
    if d is None or not d.p:
        return True
    s = sorted(d.p.values(), reverse=True)
    return len(s) > 1 and s[0] - s[1] < margin


def _weights(dists: dict[str, _Dist], rule_hit_precise: bool, w: FusionWeights) -> dict[str, float]:
    out: dict[str, float] = {}
    arbitrate = not rule_hit_precise and _is_split(dists.get("retrieval"), w.split_margin)
    for src in dists:
        if src == "rules":
            out[src] = w.rules_precise if rule_hit_precise else w.rules_fallback
        elif src == "retrieval":
            out[src] = w.retrieval
        elif src == "catalog":
            out[src] = w.catalog
        elif src == "llm":
            out[src] = w.llm_arbiter if arbitrate else w.llm_advisor
        elif src == "arbiter":
            out[src] = w.arbiter
        else:
            out[src] = w.other
    return out


def _order(src: str) -> int:
    return _SOURCE_ORDER.index(src) if src in _SOURCE_ORDER else len(_SOURCE_ORDER)


def fuse(
    votes: list[StageVote],
    *,
    rule_hit_precise: bool,
    weights: FusionWeights | None = None,
) -> FusionResult:
    """Combine stage votes into one decision; see the module docstring for the logic."""
    w = weights or FusionWeights()
    notes: list[str] = [v.note for v in votes if v.note]
    dists: dict[str, _Dist] = {}
    for v in sorted(votes, key=lambda v: _order(v.source)):
        if v.scores and v.source not in dists:
            dists[v.source] = _dist(v)
    if not dists:
        return FusionResult(None, 0.0, [], notes + ["no stage proposed a label"])
    sw = _weights(dists, rule_hit_precise, w)
    if "llm" in sw and sw["llm"] == w.llm_arbiter and not rule_hit_precise:
        notes.append("llm arbitrates: no precise rule hit and retrieval is empty or split")

    keys = {k for d in dists.values() for k in d.p}
    support = {k: sum(sw[s] * d.p.get(k, 0.0) for s, d in dists.items()) for k in keys}

    def rank(k: _Key) -> tuple[float, ...]:
        return (support[k], *(dists[s].p.get(k, 0.0) if s in dists else 0.0 for s in _SOURCE_ORDER))

    ordered = sorted(keys, key=rank, reverse=True)
    win = ordered[0]
    if support[win] < w.min_support:
        return FusionResult(
            None, 0.0, [],
            notes + [f"best label {win[0].value}/{win[1]} has support {support[win]:.2f} < {w.min_support}"],
            weights_used=sw,
        )

    agree_miss = 1.0
    dissent = 1.0
    for s, d in dists.items():
        p_win = d.p.get(win, 0.0)
        top = d.top
        assert top is not None
        if p_win > 0.0:
            agree_miss *= 1.0 - sw[s] * p_win
            if top[0] != win and top[1] > p_win:
                dissent *= 1.0 - w.dissent_penalty * sw[s] * (top[1] - p_win)
        elif top[0][0] == win[0]:
            agree_miss *= 1.0 - sw[s] * w.category_credit * top[1]
            notes.append(f"{s} agrees on category {win[0].value} but proposed {top[0][1]} ({top[1]:.2f})")
        else:
            dissent *= 1.0 - w.dissent_penalty * sw[s] * top[1]
            notes.append(f"{s} disagrees: proposed {top[0][0].value}/{top[0][1]} ({top[1]:.2f})")
    confidence = round(min(w.max_confidence, (1.0 - agree_miss) * dissent), 4)

    decided_by = max(dists, key=lambda s: (sw[s] * dists[s].p.get(win, 0.0), -_order(s)))
    if decided_by in w.trusted_action_sources:
        action = dists[decided_by].action[win]
    else:
        action = default_action(*win)
    label = Label(win[0], win[1], action)

    evidence: list[Evidence] = []
    explanation: str | None = None
    for s in sorted(dists, key=lambda s: (-(sw[s] * dists[s].p.get(win, 0.0)), _order(s))):
        d = dists[s]
        if d.p.get(win, 0.0) <= 0.0:
            continue
        for ev in d.vote.evidence:
            lab = parse_evidence_label(ev)
            if lab is not None and lab != (win[0].value, win[1]):
                continue  # a neighbour with another label is not evidence for this one
            if all((e.line_no, e.text, e.source) != (ev.line_no, ev.text, ev.source) for e in evidence):
                evidence.append(ev)
        top = d.top
        if explanation is None and d.vote.explanation and top is not None and top[0] == win:
            explanation = d.vote.explanation  # only a source that explains *this* label
    ranking = [(Label(k[0], k[1], default_action(*k)), round(support[k], 4)) for k in ordered[:5]]
    return FusionResult(label, confidence, evidence, notes, decided_by, ranking, explanation, sw)
