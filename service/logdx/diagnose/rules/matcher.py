"""Matching events against compiled rules: ``RuleSet.match(event)`` returns every hit, best first.

Ordering of hits: role (root_cause > fallback > symptom), then `refines` (a rule before every rule it
refines, see precedence.py), then severity, then confidence, then the order rules were loaded; a fallback is dropped when anything else hit the same event. That
is what makes "watchdog thread terminated with exception: CUDA error: uncorrectable ECC error"
an ECC root cause, and a ChildFailedError traceback a symptom rather than "uncategorised".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from logdx.diagnose.origin import OriginInfo, classify_origin, locate, owner_label
from logdx.diagnose.rules.compiled import ANY_EXCEPTION, CUT_OFF, Origin, OriginConfig, PackTest, Rule, RuleHit
from logdx.diagnose.rules.keywords import Prefilter
from logdx.diagnose.rules.precedence import in_precedence, refined_by
from logdx.model import Event, Label, Record, Role


@dataclass(slots=True)
class _Text:
    """One text of an event a pattern is searched in, and the line a hit on it is blamed on."""

    record: Record
    text: str
    keywords: frozenset[str]  # the rule keywords it contains (see Prefilter)
    joined: bool = False  # an exception's whole message, its lines joined: searched after single lines


# Lines of a traceback that are code or location, never the message: a pattern hit there would
# be a quote of the source ("# avoid CUDA out of memory"), not an error.
_FRAME_LINE = re.compile(r'^\s*(?:File "|frame #\d+:|[│╭╰┃┏┗]|[~^]+\s*$|\.\.\.\s*$)')


@dataclass
class RuleSet:
    rules: list[Rule]
    origin: OriginConfig
    packs: dict[str, str] = field(default_factory=dict)  # pack name -> description
    files: list[Path] = field(default_factory=list)
    tests: list[PackTest] = field(default_factory=list)  # the packs' raw-input tests

    def __post_init__(self) -> None:
        self.by_id: dict[str, Rule] = {r.id: r for r in self.rules}
        self.prefilter = Prefilter.build(self.rules)
        # rule id -> every rule it refines (through chains): only rules that refine something
        self.outranks: dict[str, frozenset[str]] = refined_by(self.rules)

    def __len__(self) -> int:
        return len(self.rules)

    # -- the pre-filter ---------------------------------------------------------------------------

    def could_match(self, text: str) -> bool:
        """Whether some rule pattern (or a rule's exception name) occurs in this line.

        Exact for one line (the same answer as one alternation of every pattern), and fast for millions of lines:
        a line without any rule keyword costs one search of a trie-shaped regex of lower-case
        keywords; only lines that contain keywords run the few patterns that need them. Give it the
        raw message, not a masked template: patterns may need the numbers (``Xid ...: 79``)."""
        return self.prefilter.could_match(text)

    # -- matching ---------------------------------------------------------------------------------

    def match(self, event: Event) -> list[RuleHit]:
        """All rule hits on one event, best first (fallbacks only when nothing else hit)."""
        texts = event_texts(event, self.prefilter)
        origin: OriginInfo | None = None
        hits: list[tuple[tuple[int, int, float, int], RuleHit]] = []
        # Only rules whose keywords occur in the event (plus those without keywords) are tried.
        for i in self.prefilter.candidate_rules(t.keywords for t in texts):
            rule = self.rules[i]
            found = _check(rule, event, texts)[1]  # match_rule's, a call less (this is the hot loop)
            if found is None:
                continue
            record, groups = found
            if rule.by_origin is not None:
                if origin is None:
                    origin = locate(event, self.origin)
                # None: the library's own owner decides (logdx/taxonomy.yaml "owners").
                label = rule.by_origin[origin.where] or owner_label(origin, event)
            else:
                assert rule.label is not None
                label = rule.label
            hit = RuleHit(
                rule_id=rule.id,
                pack=rule.pack,
                title=rule.title,
                role=rule.role,
                label=Label(label.category, label.failure_type, label.action),
                severity=rule.severity,
                confidence=rule.confidence,
                line=record,
                groups=groups,
                hint=render_hint(rule.hint, groups, record, event),
                event=event,
            )
            hits.append(((*hit.sort_key(), rule.order), hit))
        hits.sort(key=lambda kh: kh[0])
        ranked = [h for _, h in hits]
        if len(ranked) > 1 and self.outranks:
            ranked = in_precedence(ranked, self.outranks)  # a refining rule before the rules it refines
        # A fallback explains an event nothing else explains: once any precise rule (root cause
        # or symptom) hit it, a generic "uncategorised exception" would only add noise; worse, it
        # would outrank a symptom and turn an echo (ChildFailedError) into a root cause.
        if any(h.role is not Role.FALLBACK for h in ranked):
            return [h for h in ranked if h.role is not Role.FALLBACK]
        return ranked

    def classify_origin(self, event: Event) -> Origin:
        return classify_origin(event, self.origin)


# Which condition of a rule an event failed (`_check`), in the order they are checked.
_MATCHED, _WRONG_KIND, _WRONG_EXCEPTION, _NO_PATTERN, _UNLESS = range(5)


def match_rule(rule: Rule, event: Event, texts: list[_Text]) -> tuple[Record, dict[str, str]] | None:
    """The line and named groups of this rule's first hit on the event, or None."""
    return _check(rule, event, texts)[1]


def _check(rule: Rule, event: Event, texts: list[_Text]) -> tuple[int, tuple[Record, dict[str, str]] | None]:
    """The rule's conditions on the event: (_MATCHED, its hit), or (the condition that failed, None)."""
    if rule.kinds is not None and event.kind not in rule.kinds:
        return _WRONG_KIND, None
    if rule.exceptions is not None and not _exception_accepted(rule.exceptions, event.exception_type,
                                                               bool(event.attrs.get("ends_log"))):
        return _WRONG_EXCEPTION, None
    found: tuple[Record, dict[str, str]] | None = None
    if rule.patterns:
        found = _search(rule, texts)
        if found is None:
            return _NO_PATTERN, None
    else:
        found = (event.anchor, {})
    if rule.unless and _unless_hit(rule, event, texts) is not None:
        return _UNLESS, None
    return _MATCHED, found


def _unless_hit(rule: Rule, event: Event, texts: list[_Text]) -> re.Pattern[str] | None:
    """The `unless` pattern found in the event (a traceback's 'File "...", line N' frames too, which
    patterns never search)."""
    for u in rule.unless:
        if any(u.search(t.text) for t in texts) or any(
                u.search(r.text) for r in event.lines if _FRAME_LINE.match(r.text)):
            return u
    return None


def why_not(rule: Rule, event: Event, prefilter: Prefilter) -> str | None:
    """Why the rule does not match the event, in words (None: it matches): the first of its
    conditions the event fails, as the matcher checks them (`logdx rules explain`)."""
    texts = event_texts(event, prefilter)
    failed, _ = _check(rule, event, texts)
    if failed == _WRONG_KIND:
        return f"event kind {event.kind} is not in match.kinds ({', '.join(rule.kinds or ())})"
    if failed == _WRONG_EXCEPTION:
        wanted = ", ".join(sorted(rule.exceptions or ()))
        return f"exception {event.exception_type or '(none)'} is not in match.exceptions ({wanted})"
    if failed == _NO_PATTERN:
        shown = "; ".join(repr(p.pattern) for p in rule.patterns[:4])
        return f"no pattern matches the event's text {[t.text for t in texts][:3]!r} (patterns: {shown})"
    if failed == _UNLESS:
        u = _unless_hit(rule, event, texts)
        return f"match.unless {u.pattern if u is not None else '?'!r} matches the event"
    return None


def _search(rule: Rule, texts: list[_Text]) -> tuple[Record, dict[str, str]] | None:
    """The first pattern (rules list their most telling pattern first) that matches, on the most
    specific text: a line of its own before the exception's whole message joined into one, so the
    root line is the line that says it ("The NVIDIA driver on your system is too old"), not the bare
    "AssertionError:" above it."""
    lits = rule.literals
    candidates = [t for t in texts if lits is None or not lits.isdisjoint(t.keywords)]
    if not candidates:
        return None
    joined = [t for t in candidates if t.joined]
    lines = [t for t in candidates if not t.joined]
    for pat in rule.patterns:
        for t in (*lines, *joined):
            m = pat.search(t.text)
            if m:
                groups = {k: v for k, v in m.groupdict().items() if v is not None}
                return t.record, groups
    return None


def event_texts(event: Event, prefilter: Prefilter) -> list[_Text]:
    """What patterns are searched in, in order: the exception (whole message, its lines joined),
    the anchor line, then the event's other lines that are not traceback frames or code."""
    out: list[_Text] = []

    def add(record: Record, text: str, joined: bool = False) -> None:
        out.append(_Text(record, text, prefilter.keywords_in(text.lower()), joined))

    if event.exception_type:
        msg = " ".join((event.exception_message or "").split("\n")).strip()
        add(event.anchor, f"{event.exception_type}: {msg}" if msg else event.exception_type, joined=True)
    seen = {id(event.anchor)}
    add(event.anchor, event.anchor.text)
    after_file_line = False
    for rec in event.lines:
        if id(rec) in seen:
            continue
        seen.add(id(rec))
        text = rec.text
        is_frame = bool(_FRAME_LINE.match(text))
        # The indented source line printed under 'File "...", line N' is code, not a message.
        is_code = after_file_line and text[:1].isspace()
        after_file_line = text.lstrip().startswith('File "')
        if is_frame or is_code:
            continue
        add(rec, text)
    return out


def _exception_accepted(wanted: frozenset[str], exception_type: str | None, ends_log: bool = False) -> bool:
    """``OutOfMemoryError`` accepts ``torch.OutOfMemoryError``; ``torch.OutOfMemoryError``
    accepts itself, and the bare ``OutOfMemoryError`` when a log printed it unqualified. ``*``
    accepts any exception but a warning (a warning is printed, not raised); ``-`` accepts a traceback
    the log ends inside, before its exception line."""
    if not exception_type:
        return CUT_OFF in wanted and ends_log
    if ANY_EXCEPTION in wanted and not exception_type.endswith("Warning"):
        return True
    if exception_type in wanted:
        return True
    if "." in exception_type:
        return exception_type.rsplit(".", 1)[-1] in wanted
    return any(w.rsplit(".", 1)[-1] == exception_type for w in wanted)


# ---------------------------------------------------------------------------------------------
# Hints
# ---------------------------------------------------------------------------------------------


# What a hint says for a field the line does not give, so that it still reads as a sentence.
_UNKNOWN_WORDS = {"host": "its node", "rank": "unknown", "local_rank": "unknown"}


class _OrUnknownWords(dict[str, str]):
    def __missing__(self, key: str) -> str:
        return _UNKNOWN_WORDS.get(key, "?")


def render_hint(template: str, groups: dict[str, str], line: Record, event: Event) -> str:
    """The rule's hint with named groups, then the line's own host/rank/gpu; words that say so when unknown."""
    if not template:
        return ""
    ctx = _OrUnknownWords()
    for key, value in (
        ("host", line.host),
        ("rank", line.rank),
        ("local_rank", line.local_rank),
        ("gpu", event.gpu),
        ("line_no", line.line_no),
        ("exception", event.exception_type),
    ):
        if value is not None:
            ctx[key] = str(value)
    ctx.update(groups)
    try:
        return template.format_map(ctx)
    except (ValueError, IndexError, KeyError, AttributeError):  # validated at load; belt and braces
        return template


