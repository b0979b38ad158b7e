"""Rule precedence as data: a rule's ``refines:`` names the rules it is a narrower reading of.

When a refining rule and a rule it refines hit the same event, the refining one wins, whatever
their severities, confidences or load order say (those still order the rules that do not overlap).
Two root-cause rules of different failure types that hit the same example (a rule's example, a
pack test's event) with no declared precedence between them are a problem ``logdx rules test``
lists: which one wins would otherwise be decided by numbers nobody chose for that purpose, and a
new rule could silently shadow an old one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from logdx.diagnose.rules.compiled import Rule, RuleHit
from logdx.model import Role


def refined_by(rules: Sequence[Rule]) -> dict[str, frozenset[str]]:
    """For each rule that refines others: every rule it outranks, through chains of ``refines``
    (a refines b, b refines c: a outranks c too). Rules that refine nothing are absent."""
    direct = {r.id: frozenset(r.refines) for r in rules if r.refines}
    out: dict[str, frozenset[str]] = {}
    for rid in direct:
        seen: set[str] = set()
        todo = list(direct[rid])
        while todo:
            nxt = todo.pop()
            if nxt in seen or nxt == rid:
                continue
            seen.add(nxt)
            todo.extend(direct.get(nxt, ()))
        out[rid] = frozenset(seen)
    return out


def refines_problems(rules: Sequence[Rule]) -> list[str]:
    """What is wrong with the rules' ``refines``: an unknown rule, itself, a rule of another role,
    a circle (a refines b refines a)."""
    by_id = {r.id: r for r in rules}
    problems: list[str] = []
    for r in rules:
        for other in r.refines:
            target = by_id.get(other)
            if other == r.id:
                problems.append(f"{r.where()}: refines itself")
            elif target is None:
                problems.append(f"{r.where()}: refines unknown rule '{other}'")
            elif target.role is not r.role:
                problems.append(f"{r.where()}: refines '{other}', a {target.role} rule: a {r.role} rule may only "
                                f"refine rules of its own role (the role ranks first)")
    if problems:
        return problems
    closure = refined_by(rules)
    for r in rules:
        if r.id in closure and any(r.id in closure.get(o, ()) for o in r.refines):
            back = next(o for o in r.refines if r.id in closure.get(o, ()))
            problems.append(f"{r.where()}: refines '{back}', which refines it back (through refines): "
                            f"precedence must not go in a circle")
    return problems


def in_precedence(hits: list[RuleHit], outranks: Mapping[str, frozenset[str]]) -> list[RuleHit]:
    """`hits` (sorted by role, severity, confidence, load order) reordered so that a rule comes before
    every rule it refines; the order otherwise stays as it was. The role still ranks first: a rule
    only refines rules of its own role."""
    ids = {h.rule_id for h in hits}
    if not any(ids & outranks.get(i, frozenset()) for i in ids):
        return hits  # nothing here refines anything else here: the common case
    rest = list(hits)
    out: list[RuleHit] = []
    while rest:
        # the first hit no other remaining hit refines (there is one: refines has no circles)
        k = next((i for i, h in enumerate(rest)
                  if not any(h.rule_id in outranks.get(o.rule_id, ()) for o in rest if o is not h)), 0)
        out.append(rest.pop(k))
    return out


@dataclass(frozen=True, slots=True)
class Overlap:
    """Two root-cause rules of different failure types that hit one example, with no precedence."""

    winner: Rule  # the rule that wins today (severity, confidence, load order)
    loser: Rule
    winner_type: str
    loser_type: str
    where: str  # "example of rule 'x' (file:line)" / "test 'name' (file:line), line 3"

    def problem(self) -> str:
        w, lo = self.winner, self.loser
        return (f"{w.where()}: overlaps rule '{lo.id}' ({lo.file}:{lo.line}): both hit the {self.where} as root "
                f"causes of different types ({self.winner_type}, {self.loser_type}) and no refines between them "
                f"decides; '{w.id}' wins today on severity/confidence/load order: if it is the narrower cause, "
                f"add `refines: [{lo.id}]` to it, else `refines: [{w.id}]` to '{lo.id}'")


def overlaps(hit_lists: Iterable[tuple[str, Sequence[RuleHit]]], by_id: Mapping[str, Rule],
             outranks: Mapping[str, frozenset[str]]) -> list[Overlap]:
    """Each pair of root-cause rules (of different types, without precedence) that hit one event,
    once a pair (at the first event it was seen on). `hit_lists`: (where, the event's hits, best first)."""
    found: dict[frozenset[str], Overlap] = {}
    for where, hits in hit_lists:
        roots = [h for h in hits if h.role is Role.ROOT_CAUSE]
        for i, a in enumerate(roots):
            for b in roots[i + 1:]:
                pair = frozenset((a.rule_id, b.rule_id))
                if a.label.failure_type == b.label.failure_type or pair in found or len(pair) < 2:
                    continue
                if b.rule_id in outranks.get(a.rule_id, ()) or a.rule_id in outranks.get(b.rule_id, ()):
                    continue
                found[pair] = Overlap(by_id[a.rule_id], by_id[b.rule_id], a.label.failure_type,
                                      b.label.failure_type, where)
    return list(found.values())
