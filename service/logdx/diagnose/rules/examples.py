"""Rules against their own examples and counterexamples, through the same path as real events."""

from __future__ import annotations

from collections.abc import Sequence

from logdx.diagnose.rules.compiled import ExampleExpect, Rule, RuleHit
from logdx.diagnose.rules.keywords import Prefilter
from logdx.diagnose.rules.matcher import RuleSet, event_texts, match_rule, render_hint
from logdx.diagnose.rules.precedence import overlaps
from logdx.model import Event, EventKind, Record
from logdx.patterns import exception_line


def example_event(text: str, rule: Rule | None = None) -> Event:
    """An event made of one example (several lines when it holds newlines).

    A line written as an exception becomes a traceback without frames; otherwise the event is
    of the first kind the rule accepts (so an ``xid`` rule is tested on an ``xid`` event)."""
    lines = text.split("\n")
    records = [Record(line_no=i + 1, raw=ln, text=ln) for i, ln in enumerate(lines)]
    m = exception_line(lines[0])  # an example written as an exception ("KeyError: 'x'")
    kinds = rule.kinds if rule is not None else None
    kind: EventKind
    if m and (kinds is None or EventKind.TRACEBACK in kinds):
        kind = EventKind.TRACEBACK
    else:
        # a rule about tracebacks alone (one cut off before its exception) is tested on a traceback
        kind = next((k for k in kinds or () if k != EventKind.TRACEBACK),
                    EventKind.TRACEBACK if kinds else EventKind.LINE)
    event = Event(kind=kind, anchor=records[0], lines=records)
    if kind == EventKind.TRACEBACK and not m:
        event.attrs["ends_log"] = True  # an example is a whole excerpt: it ends where the example does
    if m:
        event.exception_type = m["type"]
        event.exception_message = "\n".join([m["msg"] or "", *lines[1:]]).strip()
    return event


def _example_problems(rule: Rule, prefilter: Prefilter) -> list[tuple[int, str]]:
    """Examples go through the same path as real events, pre-filter included."""
    out: list[tuple[int, str]] = []
    for i, ex in enumerate(rule.examples):
        ev = example_event(ex, rule)
        found = match_rule(rule, ev, event_texts(ev, prefilter))
        line = rule.example_lines[i] if i < len(rule.example_lines) else rule.line
        if found is None:
            out.append((line, f"example does not match: {ex!r}"))
            continue
        expect = rule.example_expects[i] if i < len(rule.example_expects) else None
        if expect is not None:
            out.extend((line, f"example {ex!r}: {what}") for what in _expect_problems(rule, expect, ev, *found))
    for i, ex in enumerate(rule.counterexamples):
        ev = example_event(ex, rule)
        if match_rule(rule, ev, event_texts(ev, prefilter)) is not None:
            line = rule.counterexample_lines[i] if i < len(rule.counterexample_lines) else rule.line
            out.append((line, f"counterexample matches: {ex!r}"))
    return out


def _expect_problems(rule: Rule, expect: ExampleExpect, ev: Event, record: Record,
                     groups: dict[str, str]) -> list[str]:
    """What the hit on an example gives that its mapping says it must not (hint, culprit), as a RuleHit names them."""
    out: list[str] = []
    hint = render_hint(rule.hint, groups, record, ev)
    if expect.hint is not None and expect.hint not in hint:
        out.append(f"hint {hint!r} does not contain {expect.hint!r}")
    rank_group = groups.get("rank")
    named = {"host": groups.get("host") or record.host,
             "rank": int(rank_group) if rank_group is not None and rank_group.isdigit() else record.rank,
             "gpu": groups.get("gpu") or ev.gpu}
    for key in ("host", "rank", "gpu"):
        want = getattr(expect, key)
        if want is not None and named[key] != want:
            out.append(f"culprit {key} {named[key]!r}, expected {want!r}")
    return out


def example_hits(ruleset: RuleSet) -> list[tuple[str, list[RuleHit]]]:
    """Every rule's examples through the whole rule set: (which example, every hit on it, best first)."""
    return [(f"example of rule '{rule.id}' ({rule.file}:{line})", ruleset.match(example_event(ex, rule)))
            for rule in ruleset.rules
            for ex, line in zip(rule.examples, rule.example_lines or (rule.line,) * len(rule.examples))]


def precedence_problems(ruleset: RuleSet, more: Sequence[tuple[str, Sequence[RuleHit]]] = ()) -> list[str]:
    """Root-cause rules of different types that hit one example (a rule's, or an event of the hits in
    `more`: the packs' raw-input tests) with no `refines` between them: one problem a pair."""
    found = overlaps([*example_hits(ruleset), *more], ruleset.by_id, ruleset.outranks)
    return [o.problem() for o in found]


def check_examples(ruleset: RuleSet, *, require_examples: bool = True) -> list[str]:
    """Every rule against its own examples and counterexamples: one problem a line, empty if fine.
    A rule without examples is a problem too (unless ``require_examples`` is off)."""
    problems: list[str] = []
    for rule in ruleset.rules:
        for line, what in _example_problems(rule, ruleset.prefilter):
            problems.append(f"{rule.file}:{line}: rule '{rule.id}': {what}")
        if require_examples and not rule.examples:
            problems.append(f"{rule.where()}: has no examples")
    return problems

