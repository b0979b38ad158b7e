"""Rules against their own examples and counterexamples, through the same path as real events."""

from __future__ import annotations

from logdx.diagnose.rules.compiled import Rule
from logdx.diagnose.rules.keywords import Prefilter
from logdx.diagnose.rules.matcher import RuleSet, event_texts, match_rule
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
        if match_rule(rule, ev, event_texts(ev, prefilter)) is None:
            line = rule.example_lines[i] if i < len(rule.example_lines) else rule.line
            out.append((line, f"example does not match: {ex!r}"))
    for i, ex in enumerate(rule.counterexamples):
        ev = example_event(ex, rule)
        if match_rule(rule, ev, event_texts(ev, prefilter)) is not None:
            line = rule.counterexample_lines[i] if i < len(rule.counterexample_lines) else rule.line
            out.append((line, f"counterexample matches: {ex!r}"))
    return out


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

