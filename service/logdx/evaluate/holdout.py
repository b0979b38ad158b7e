"""Rule packs held out: the honest test of a log no rule knows (``python -m logdx.evaluate ... --hold-out each``).

A precise pack is one with a root-cause rule (the generic evidence rules and the symptoms' are fallbacks and
echoes: they stay). ``each``: every precise pack held out in turn, every other in place; ``precise``: all of them
at once (their root-cause rules: the fallbacks they carry, such as Python's by-origin one, stay, as the generic
and symptom packs do); ``cuda,nccl``: those packs together, whole. The learned stages stay loaded; only the engine's rules change, and
retrieval is leave-one-out as always (a case never sees its own incident).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from logdx.diagnose.rules import RuleSet
from logdx.evaluate.runner import Cascade, JobResult
from logdx.model import Role

__all__ = ["LEARNED", "held_out_lines", "hold_out_groups", "learned_decisions", "precise_packs", "without_packs"]

# The stages whose verdict is an opinion learned from examples (Report.decided_by).
LEARNED = frozenset({"arbiter", "llm"})


def precise_packs(rules: RuleSet) -> list[str]:
    return sorted({r.pack for r in rules.rules if r.role is Role.ROOT_CAUSE})


def hold_out_groups(spec: str, rules: RuleSet) -> list[tuple[str, RuleSet]]:
    """(name, the rules without them) per run; raises ValueError naming a pack the rules do not have."""
    precise = precise_packs(rules)
    if spec == "each":
        return [(p, without_packs(rules, {p})) for p in precise]
    if spec == "precise":
        return [("every precise rule", without_packs(rules, precise, roles={Role.ROOT_CAUSE}))]
    packs = frozenset(p.strip() for p in spec.split(",") if p.strip())
    unknown = sorted(packs - set(rules.packs) - {r.pack for r in rules.rules})
    if unknown or not packs:
        raise ValueError(f"no rule pack named {', '.join(unknown) or '(none given)'}; precise packs: {', '.join(precise)}")
    return [(",".join(sorted(packs)), without_packs(rules, packs))]


def without_packs(rules: RuleSet, packs: Iterable[str], *, roles: set[Role] | None = None) -> RuleSet:
    """The rule set without these packs (or only their rules of these `roles`)."""
    gone = set(packs)
    kept = [r for r in rules.rules if r.pack not in gone or (roles is not None and r.role not in roles)]
    whole = gone if roles is None else set()
    return RuleSet(kept, rules.origin, {k: v for k, v in rules.packs.items() if k not in whole}, list(rules.files),
                   [t for t in rules.tests if t.pack not in gone])


def learned_decisions(results: list[JobResult], cascade: str) -> Counter[str]:
    """Failure types of the verdicts a learned stage decided, in `cascade`'s reports."""
    out: Counter[str] = Counter()
    for r in results:
        rep = r.reports.get(cascade)
        if rep is not None and rep.decided_by in LEARNED:
            out[rep.failure_type or "unknown"] += 1
    return out


def held_out_lines(rows: list[tuple[str, dict[str, dict]]], cascades: list[Cascade],
                  decisions: dict[str, Counter[str]]) -> list[str]:
    """One row per held-out run: category / action / type of each cascade; then what the learned stages decided."""
    names = [c.name for c in cascades]
    out = ["\n== packs held out: category / action / failure type per cascade ==",
           "| held out | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    total: dict[str, list[int]] = {n: [0, 0, 0, 0] for n in names}
    for group, figures in rows:
        cells = []
        for n in names:
            acc = figures.get(n, {}).get("accuracy")
            if acc is None:
                cells.append("")
                continue
            cells.append(" / ".join(f"{acc[f]['accuracy']:.3f}" for f in ("category", "action", "failure_type")))
            for i, f in enumerate(("category", "action", "failure_type")):
                total[n][i] += int(acc[f]["correct"])
            total[n][3] += int(acc["category"]["n"])
        out.append(f"| {group} | " + " | ".join(cells) + " |")
    if len(rows) > 1:
        out.append("| all runs | " + " | ".join(
            " / ".join(f"{t[i] / t[3]:.3f}" for i in range(3)) if t[3] else "" for t in total.values()) + " |")
    for n in names:
        c = decisions.get(n)
        if not c:
            continue
        top, k = c.most_common(1)[0]
        share = k / sum(c.values())
        out.append(f"  {n}: a learned stage decided {sum(c.values())} verdicts; most common type {top} "
                   f"({k}, {share:.0%}){' - more than a third' if share > 1 / 3 else ''}: "
                   + ", ".join(f"{t} {m}" for t, m in c.most_common(8)))
    return out
