"""An honest shortlist when unsure: below the confidence at which a node may be cordoned, the report names the two
or three labels the evidence still holds possible, each with its share of the belief and the one check that would
confirm it (`nvidia-smi -q -d ECC` on the named host, a rerun with NCCL's INIT,NET debug, the flight recorder).

Candidates are what an evidence-bearing stage proposed — every stage's vote (the rules' other root causes, the
catalog, retrieval, the LLM) — and, for collective timeouts whose cause the log does not settle, the causes a
timeout may have. The report's own label keeps the report's confidence; the others share the rest by their
strongest support. Nothing here changes the verdict: it says what else to rule out."""

from __future__ import annotations

from logdx.model import FT, Category, Diagnosis, Hypothesis, Label
from logdx.taxonomy import default_action, taxonomy

# The confidence below which a report lists hypotheses: the default below which no node is cordoned
# (actions.min_confidence), where a person has to decide and needs to know what to rule out.
SHORTLIST_BELOW = 0.8
_MAX = 3
_MIN_SHARE = 0.05  # a hypothesis worth a person's check

# A timeout whose cause is unknown: the labels its causes (taxonomy.yaml timeout_classes) would give the job.
_TIMEOUT_CAUSES = (FT.HANG, FT.NETWORK_ERROR, FT.SCRIPT_HANG)  # gpu_hang, network, cpu_side


def shortlist(d: Diagnosis) -> list[Hypothesis]:
    if d.status != "failed" or d.label is None or d.confidence >= SHORTLIST_BELOW:
        return []
    support = _support(d)
    winner = (d.label.category, d.label.failure_type)
    others = sorted(((k, p) for k, p in support.items() if k != winner), key=lambda kp: -kp[1])[: _MAX - 1]
    rest = max(0.0, 1.0 - d.confidence)
    total = sum(p for _, p in others)
    shares = [(k, rest * p / total) for k, p in others] if total > 0 else []
    shares = [(k, p) for k, p in shares if p >= _MIN_SHARE]
    if not shares:
        return []
    out = [Hypothesis(d.label, round(d.confidence, 3), _check(d.label.failure_type, d))]
    for (category, ft), p in shares:
        out.append(Hypothesis(Label(category, ft, default_action(category, ft)), round(p, 3), _check(ft, d)))
    return out


def _support(d: Diagnosis) -> dict[tuple[Category, str], float]:
    """Each label's strongest support from any stage that voted."""
    support: dict[tuple[Category, str], float] = {}
    for vote in d.votes:
        for label, p in vote.scores:
            if label.failure_type == FT.UNKNOWN:
                continue
            key = (label.category, label.failure_type)
            support[key] = max(support.get(key, 0.0), p)
    if d.timeout is not None and d.timeout.cause == "unknown":
        types = taxonomy().types
        for ft in _TIMEOUT_CAUSES:
            key = (types[ft].category, ft)
            # each cause a timeout may have, as likely as the others: the log did not tell them apart
            support[key] = max(support.get(key, 0.0), 0.3)
    return support


def _check(failure_type: str, d: Diagnosis) -> str:
    spec = taxonomy().types.get(failure_type)
    check = spec.check if spec is not None else ""
    if not check:
        return "the root line's own message: the component it names and what it says failed"
    a = d.attribution
    host = a.hosts[0] if a.hosts else "the node that printed it"
    rank = f"rank {a.ranks[0]}" if a.ranks else "each rank"
    return check.replace("{host}", host).replace("{rank}", rank)


__all__ = ["SHORTLIST_BELOW", "shortlist"]
