"""Stage 4a: the rule engine. Precise, explainable matches of events against YAML rule packs.

A rule pack (``rules/*.yaml``, format in ``rules/README.md``) is data: this module validates it
at load (pydantic at the file edge, then regexes, labels and each rule's own examples), with
errors that name file, line and rule id, and compiles it into plain dataclasses. At run time,
``RuleSet.match(event)`` returns every rule hit on one event, best first.

Ordering of hits: role (root_cause > fallback > symptom), then severity, then confidence, then
the order rules were loaded; a fallback is dropped when anything else hit the same event. That
is what makes "watchdog thread terminated with exception: CUDA error: uncorrectable ECC error"
an ECC root cause, and a ChildFailedError traceback a symptom rather than "uncategorised".

Speed: every pattern's required literal keywords are read off its regex parse tree once. A
trie-shaped regex of those keywords is the pre-filter (``RuleSet.could_match``: is this line
error-bearing?) and also picks the few rules worth trying on an event.
"""

from __future__ import annotations

import functools
import os
import re
import re._constants as sre_c  # the parse tree is only read, to find literal keywords
import re._parser as sre_parse
import string
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from logdx.model import FAILURE_TYPES, Action, Category, Event, Label, Record, Role

__all__ = [
    "ENV_RULES_DIR",
    "KNOWN_KINDS",
    "Origin",
    "OriginConfig",
    "Rule",
    "RuleError",
    "RuleHit",
    "RuleSet",
    "check_examples",
    "classify_origin",
    "default_rules_dir",
    "example_event",
    "load_rules",
    "render_hint",
]

ENV_RULES_DIR = "LOGDX_RULES_DIR"

# Event kinds the detect stage produces (see logdx.model.Event); a rule naming another kind is a typo.
KNOWN_KINDS: frozenset[str] = frozenset(
    {"traceback", "line", "nccl", "xid", "signal_exit", "child_failed", "loss_nan", "loss_spike", "stall"}
)

_ROLE_RANK = {Role.ROOT_CAUSE: 0, Role.FALLBACK: 1, Role.SYMPTOM: 2}
_SEVERITY_RANK = {"critical": 0, "high": 1, "medium": 2, "low": 3}
_DEFAULT_ACTION = {
    Category.INFRASTRUCTURE: Action.RESTART,
    Category.FRAMEWORK: Action.NO_RESTART,
    Category.SCRIPT: Action.NO_RESTART,
    Category.UNKNOWN: Action.NO_RESTART,
}
Origin = Literal["user", "library"]


class RuleError(Exception):
    """A rule pack that does not load. ``problems`` holds one "file:line: rule 'id': what" each."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


# ---------------------------------------------------------------------------------------------
# The file format (pydantic: shape only; meaning is checked when compiling)
# ---------------------------------------------------------------------------------------------

_Strict = ConfigDict(extra="forbid", strict=True)
_NonEmpty = Annotated[str, Field(min_length=1)]


class _LabelSpec(BaseModel):
    model_config = _Strict
    category: Literal["infrastructure", "framework", "script", "unknown"]
    failure_type: _NonEmpty
    action: Literal["cordon_and_restart", "restart", "no_restart"] | None = None


class _ByOriginSpec(BaseModel):
    model_config = _Strict
    user: _LabelSpec
    library: _LabelSpec


class _MatchSpec(BaseModel):
    model_config = _Strict
    patterns: list[_NonEmpty] = []
    kinds: list[_NonEmpty] | None = None
    exceptions: list[_NonEmpty] | None = None
    unless: list[_NonEmpty] = []


class _RuleSpec(BaseModel):
    model_config = _Strict
    id: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9-]*$")]
    title: _NonEmpty
    role: Literal["root_cause", "symptom", "fallback"]
    category: Literal["infrastructure", "framework", "script", "unknown"] | None = None
    failure_type: _NonEmpty | None = None
    action: Literal["cordon_and_restart", "restart", "no_restart"] | None = None
    by_origin: _ByOriginSpec | None = None
    severity: Literal["critical", "high", "medium", "low"] = "medium"
    confidence: Annotated[float, Field(ge=0.0, le=1.0, strict=False)]
    match: _MatchSpec
    hint: str = ""
    examples: list[str] = []
    counterexamples: list[str] = []


class _OriginSpec(BaseModel):
    model_config = _Strict
    library_paths: list[_NonEmpty] = []
    passthrough: list[_NonEmpty] = []  # "file-regex:function-regex"


class _PackSpec(BaseModel):
    model_config = _Strict
    pack: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_-]*$")]
    description: str = ""
    origin: _OriginSpec | None = None
    rules: list[dict[str, Any]] = []  # validated one by one, so one bad rule names its own id


# ---------------------------------------------------------------------------------------------
# Compiled, plain data
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OriginConfig:
    """Where an exception was raised: library code, or the user's own."""

    library_paths: tuple[re.Pattern[str], ...] = ()
    # (file regex, function regex): frames that only pass an error through (nn.Module.__getattr__).
    passthrough: tuple[tuple[re.Pattern[str], re.Pattern[str]], ...] = ()

    def is_library(self, path: str) -> bool:
        return any(p.search(path) for p in self.library_paths)

    def is_passthrough(self, path: str, function: str | None) -> bool:
        fn = function or ""
        return any(f.search(path) and g.fullmatch(fn) for f, g in self.passthrough)

    def merged(self, other: OriginConfig) -> OriginConfig:
        return OriginConfig(self.library_paths + other.library_paths, self.passthrough + other.passthrough)


@dataclass(frozen=True, slots=True)
class Rule:
    id: str
    pack: str
    title: str
    role: Role
    severity: str
    confidence: float
    label: Label | None  # None when the label depends on the origin (by_origin)
    by_origin: dict[str, Label] | None
    patterns: tuple[re.Pattern[str], ...]
    kinds: tuple[str, ...] | None
    exceptions: frozenset[str] | None
    unless: tuple[re.Pattern[str], ...]
    hint: str
    examples: tuple[str, ...]
    counterexamples: tuple[str, ...]
    file: str
    line: int
    order: int
    # Lower-cased strings one of which must occur in a line for some pattern to match it; None
    # when a pattern has no usable literal (then every line is tried).
    literals: frozenset[str] | None = None
    example_lines: tuple[int, ...] = ()
    counterexample_lines: tuple[int, ...] = ()

    def where(self) -> str:
        return f"{self.file}:{self.line}: rule '{self.id}'"


@dataclass(slots=True)
class RuleHit:
    rule_id: str
    pack: str
    title: str
    role: Role
    label: Label
    severity: str
    confidence: float
    line: Record  # the event line the pattern matched: it becomes the root line
    groups: dict[str, str]
    hint: str
    event: Event

    @property
    def source(self) -> str:
        """How evidence cites this hit."""
        return f"rule:{self.rule_id}"

    # Where the hit points: a named group of the pattern, else the matched line's prefixes (or
    # the event's GPU). For a symptom that is the rank that reported it, not the culprit.
    @property
    def host(self) -> str | None:
        return self.groups.get("host") or self.line.host

    @property
    def rank(self) -> int | None:
        g = self.groups.get("rank")
        return int(g) if g is not None and g.isdigit() else self.line.rank

    @property
    def gpu(self) -> str | None:
        return self.groups.get("gpu") or self.event.gpu

    def sort_key(self) -> tuple[int, int, float]:
        return (_ROLE_RANK[self.role], _SEVERITY_RANK[self.severity], -self.confidence)


@dataclass(slots=True)
class _Text:
    """One text of an event a pattern is searched in, and the line a hit on it is blamed on."""

    record: Record
    text: str
    keywords: frozenset[str]  # the rule keywords it contains (see _Prefilter)


# Lines of a traceback that are code or location, never the message: a pattern hit there would
# be a quote of the source ("# avoid CUDA out of memory"), not an error.
_FRAME_LINE = re.compile(r'^\s*(?:File "|frame #\d+:|[│╭╰┃┏┗]|[~^]+\s*$|\.\.\.\s*$)')
_ORIGINAL_TB = "Traceback (most recent call last)"
_TB_FRAME = re.compile(r'File "(?P<path>[^"]+)", line (?P<line>\d+)(?:, in (?P<func>[^\s,]+))?')
# An example line written as an exception ("KeyError: 'x'", "torch.OutOfMemoryError: CUDA ...").
_EXCEPTION_LINE = re.compile(
    r"^(?P<type>(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Warning|Fault|Failure"
    r"|Iteration|Timeout|Abort)\w*|KeyboardInterrupt|SystemExit|StopIteration)(?::\s?(?P<msg>.*))?$"
)


@dataclass
class RuleSet:
    rules: list[Rule]
    origin: OriginConfig
    packs: dict[str, str] = field(default_factory=dict)  # pack name -> description
    files: list[Path] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.by_id: dict[str, Rule] = {r.id: r for r in self.rules}
        # One alternation of every pattern: exact, but slow on long lines (hundreds of branches
        # tried at each position). could_match() is the fast path; this is for callers that need
        # a single regex object.
        self.error_regex: re.Pattern[str] = _combined_regex(self.rules)
        self._prefilter = _Prefilter.build(self.rules)

    def __len__(self) -> int:
        return len(self.rules)

    # -- the pre-filter ---------------------------------------------------------------------------

    def could_match(self, text: str) -> bool:
        """Whether some rule pattern (or a rule's exception name) occurs in this line.

        Exact for one line (the same answer as ``error_regex``), and fast for millions of lines:
        a line without any rule keyword costs one search of a trie-shaped regex of lower-case
        keywords; only lines that contain keywords run the few patterns that need them. Give it the
        raw message, not a masked template: patterns may need the numbers (``Xid ...: 79``)."""
        return self._prefilter.could_match(text)

    @property
    def keyword_regex(self) -> re.Pattern[str]:
        """Searched in the lower-cased line: no hit means no rule can match it."""
        return self._prefilter.keywords

    # -- matching ---------------------------------------------------------------------------------

    def match(self, event: Event) -> list[RuleHit]:
        """All rule hits on one event, best first (fallbacks only when nothing else hit)."""
        texts = _event_texts(event, self._prefilter)
        origin: Origin | None = None
        hits: list[tuple[tuple[int, int, float, int], RuleHit]] = []
        # Only rules whose keywords occur in the event (plus those without keywords) are tried.
        for i in self._prefilter.candidate_rules(t.keywords for t in texts):
            rule = self.rules[i]
            found = _match_rule(rule, event, texts)
            if found is None:
                continue
            record, groups = found
            if rule.by_origin is not None:
                if origin is None:
                    origin = self.classify_origin(event)
                label = rule.by_origin[origin]
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
        # A fallback explains an event nothing else explains: once any precise rule (root cause
        # or symptom) hit it, a generic "uncategorised exception" would only add noise; worse, it
        # would outrank a symptom and turn an echo (ChildFailedError) into a root cause.
        if any(h.role is not Role.FALLBACK for _, h in hits):
            return [h for _, h in hits if h.role is not Role.FALLBACK]
        return [h for _, h in hits]

    def classify_origin(self, event: Event) -> Origin:
        return classify_origin(event, self.origin)


def _match_rule(rule: Rule, event: Event, texts: list[_Text]) -> tuple[Record, dict[str, str]] | None:
    """The line and named groups of this rule's first hit on the event, or None."""
    if rule.kinds is not None and event.kind not in rule.kinds:
        return None
    if rule.exceptions is not None and not _exception_accepted(rule.exceptions, event.exception_type):
        return None
    found: tuple[Record, dict[str, str]] | None = None
    if rule.patterns:
        found = _search(rule, texts)
        if found is None:
            return None
    else:
        found = (event.anchor, {})
    if rule.unless and any(u.search(t.text) for t in texts for u in rule.unless):
        return None
    return found


def _search(rule: Rule, texts: list[_Text]) -> tuple[Record, dict[str, str]] | None:
    lits = rule.literals
    for t in texts:
        if lits is not None and lits.isdisjoint(t.keywords):
            continue
        for pat in rule.patterns:
            m = pat.search(t.text)
            if m:
                groups = {k: v for k, v in m.groupdict().items() if v is not None}
                return t.record, groups
    return None


def _event_texts(event: Event, prefilter: _Prefilter) -> list[_Text]:
    """What patterns are searched in, in order: the exception (whole message, its lines joined),
    the anchor line, then the event's other lines that are not traceback frames or code."""
    out: list[_Text] = []

    def add(record: Record, text: str) -> None:
        out.append(_Text(record, text, prefilter.keywords_in(text.lower())))

    if event.exception_type:
        msg = " ".join((event.exception_message or "").split("\n")).strip()
        add(event.anchor, f"{event.exception_type}: {msg}" if msg else event.exception_type)
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


def _exception_accepted(wanted: frozenset[str], exception_type: str | None) -> bool:
    """``OutOfMemoryError`` accepts ``torch.OutOfMemoryError``; ``torch.OutOfMemoryError``
    accepts itself, and the bare ``OutOfMemoryError`` when a log printed it unqualified."""
    if not exception_type:
        return False
    if exception_type in wanted:
        return True
    if "." in exception_type:
        return exception_type.rsplit(".", 1)[-1] in wanted
    return any(w.rsplit(".", 1)[-1] == exception_type for w in wanted)


# ---------------------------------------------------------------------------------------------
# Where an exception was raised
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _FrameRef:
    path: str
    function: str | None


def classify_origin(event: Event, origin: OriginConfig) -> Origin:
    """``library`` when the innermost frame that is not a pass-through is library code.

    An exception re-raised from a DataLoader worker (or another process) carries the original
    traceback in its message: its frames are the ones that say where the error was raised."""
    frames = _original_frames(event) or [_FrameRef(f.path, f.function) for f in event.frames]
    for fr in reversed(frames):  # printed outermost first: the innermost is last
        if origin.is_passthrough(fr.path, fr.function):
            continue
        return "library" if origin.is_library(fr.path) else "user"
    # No frame at all (a bare "KeyError: 'x'"): a qualified type names the module that raised it.
    etype = event.exception_type or ""
    if "." in etype and not etype.startswith("__main__."):
        return "library"
    return "user"


def _original_frames(event: Event) -> list[_FrameRef]:
    msg = event.exception_message or ""
    if _ORIGINAL_TB in msg:
        tail = msg[msg.rindex(_ORIGINAL_TB) :]
        return [_FrameRef(m["path"], m["func"]) for m in _TB_FRAME.finditer(tail)]
    # The message continued on the event's lines after the exception line.
    start = next((i for i, r in enumerate(event.lines) if r is event.anchor), None)
    if start is None:
        return []
    rest = event.lines[start + 1 :]
    for i, rec in enumerate(rest):
        if _ORIGINAL_TB in rec.text:
            refs = [_TB_FRAME.search(r.text) for r in rest[i + 1 :]]
            return [_FrameRef(m["path"], m["func"]) for m in refs if m]
    return []


# ---------------------------------------------------------------------------------------------
# Hints
# ---------------------------------------------------------------------------------------------


class _OrQuestionMark(dict[str, str]):
    def __missing__(self, key: str) -> str:
        return "?"


def render_hint(template: str, groups: dict[str, str], line: Record, event: Event) -> str:
    """The rule's hint with named groups, then the line's own host/rank/gpu; "?" when unknown."""
    if not template:
        return ""
    ctx = _OrQuestionMark()
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


def _hint_problem(template: str) -> str | None:
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        return f"bad hint template: {exc}"
    for f in fields:
        if not f.isidentifier():
            return f"hint field {{{f}}} must be a plain name like {{host}}"
    return None


# ---------------------------------------------------------------------------------------------
# Examples
# ---------------------------------------------------------------------------------------------


def example_event(text: str, rule: Rule | None = None) -> Event:
    """An event made of one example (several lines when it holds newlines).

    A line written as an exception becomes a traceback without frames; otherwise the event is
    of the first kind the rule accepts (so an ``xid`` rule is tested on an ``xid`` event)."""
    lines = text.split("\n")
    records = [Record(line_no=i + 1, raw=ln, text=ln) for i, ln in enumerate(lines)]
    m = _EXCEPTION_LINE.match(lines[0].strip())
    kinds = rule.kinds if rule is not None else None
    if m and (kinds is None or "traceback" in kinds):
        kind = "traceback"
    else:
        kind = next((k for k in kinds or () if k != "traceback"), "line")
    event = Event(kind=kind, anchor=records[0], lines=records)
    if m:
        event.exception_type = m["type"]
        event.exception_message = "\n".join([m["msg"] or "", *lines[1:]]).strip()
    return event


def _example_problems(rule: Rule, prefilter: _Prefilter) -> list[tuple[int, str]]:
    """Examples go through the same path as real events, pre-filter included."""
    out: list[tuple[int, str]] = []
    for i, ex in enumerate(rule.examples):
        ev = example_event(ex, rule)
        if _match_rule(rule, ev, _event_texts(ev, prefilter)) is None:
            line = rule.example_lines[i] if i < len(rule.example_lines) else rule.line
            out.append((line, f"example does not match: {ex!r}"))
    for i, ex in enumerate(rule.counterexamples):
        ev = example_event(ex, rule)
        if _match_rule(rule, ev, _event_texts(ev, prefilter)) is not None:
            line = rule.counterexample_lines[i] if i < len(rule.counterexample_lines) else rule.line
            out.append((line, f"counterexample matches: {ex!r}"))
    return out


def check_examples(ruleset: RuleSet, *, require_examples: bool = True) -> list[str]:
    """Every rule against its own examples and counterexamples: one problem a line, empty if fine.
    A rule without examples is a problem too (unless ``require_examples`` is off)."""
    problems: list[str] = []
    for rule in ruleset.rules:
        for line, what in _example_problems(rule, ruleset._prefilter):
            problems.append(f"{rule.file}:{line}: rule '{rule.id}': {what}")
        if require_examples and not rule.examples:
            problems.append(f"{rule.where()}: has no examples")
    return problems


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def default_rules_dir() -> Path:
    """The rules shipped with logdx: $LOGDX_RULES_DIR, the repo's rules/, or <prefix>/share/logdx/rules."""
    candidates: list[Path] = []
    env = os.environ.get(ENV_RULES_DIR)
    if env:
        candidates.append(Path(env))
    here = Path(__file__).resolve()
    if len(here.parents) > 3:
        candidates.append(here.parents[3] / "rules")  # service/logdx/diagnose/rules.py -> repo/rules
    candidates.append(Path(sys.prefix) / "share" / "logdx" / "rules")
    candidates.append(Path("/usr/share/logdx/rules"))
    for c in candidates:
        if c.is_dir() and any(c.glob("*.yaml")):
            return c
    tried = ", ".join(str(c) for c in candidates)
    raise RuleError([f"no rules directory found (tried {tried}); set {ENV_RULES_DIR}"])


def load_rules(dirs: Sequence[Path | str] | Path | str, *, verify: bool = True) -> RuleSet:
    """Load every ``*.yaml`` pack of each folder (or pack file) in order.

    ``verify`` also runs every rule's examples and counterexamples (the CLI's ``rules test``
    loads with ``verify=False`` and lists all problems with ``check_examples``)."""
    if isinstance(dirs, (str, Path)):
        dirs = [dirs]
    files: list[Path] = []
    problems: list[str] = []
    for d in dirs:
        p = Path(d)
        if p.is_dir():
            files.extend(sorted([*p.glob("*.yaml"), *p.glob("*.yml")]))
        elif p.is_file():
            files.append(p)
        else:
            problems.append(f"{_display(p)}: no such rules directory or file")
    rules: list[Rule] = []
    origin = OriginConfig()
    packs: dict[str, str] = {}
    seen: dict[str, Rule] = {}
    for f in files:
        loaded = _load_pack(f, start_order=len(rules))
        problems.extend(loaded.problems)
        if loaded.origin is not None:
            origin = origin.merged(loaded.origin)
        if loaded.name:
            packs.setdefault(loaded.name, loaded.description)
        for r in loaded.rules:
            if r.id in seen:
                problems.append(f"{r.where()}: duplicate rule id (first defined at {seen[r.id].file}:{seen[r.id].line})")
                continue
            seen[r.id] = r
            rules.append(r)
    if problems:
        raise RuleError(problems)
    ruleset = RuleSet(rules=rules, origin=origin, packs=packs, files=files)
    if verify:
        bad = check_examples(ruleset, require_examples=False)
        if bad:
            raise RuleError(bad)
    return ruleset


@dataclass
class _LoadedPack:
    name: str = ""
    description: str = ""
    rules: list[Rule] = field(default_factory=list)
    origin: OriginConfig | None = None
    problems: list[str] = field(default_factory=list)


class _Lines:
    """Line numbers of a YAML document by path: ("rules", 3, "failure_type") -> 41."""

    def __init__(self, root: yaml.Node | None) -> None:
        self.at: dict[tuple[Any, ...], int] = {}
        self.duplicates: list[tuple[tuple[Any, ...], int]] = []
        if root is not None:
            self._walk(root, ())

    def _walk(self, node: yaml.Node, path: tuple[Any, ...]) -> None:
        self.at.setdefault(path, node.start_mark.line + 1)  # a key's own line was set first
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = k.value if isinstance(k, yaml.ScalarNode) else str(k.start_mark)
                kpath = (*path, key)
                if kpath in self.at:
                    self.duplicates.append((kpath, k.start_mark.line + 1))
                # The key's line, not the value's: that is where a wrong value is reported.
                self.at[kpath] = k.start_mark.line + 1
                self._walk(v, kpath)
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                self._walk(v, (*path, i))

    def line(self, path: Sequence[Any]) -> int:
        """The line of the deepest known prefix of path."""
        p = tuple(path)
        while p and p not in self.at:
            p = p[:-1]
        return self.at.get(p, 1)


def _load_pack(path: Path, start_order: int) -> _LoadedPack:
    out = _LoadedPack()
    shown = _display(path)
    try:
        text = path.read_text(encoding="utf-8")
        root, data = _compose_and_construct(text)
    except (OSError, UnicodeDecodeError) as exc:
        out.problems.append(f"{shown}: cannot read: {exc}")
        return out
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 1
        out.problems.append(f"{shown}:{line}: invalid YAML: {getattr(exc, 'problem', None) or exc}")
        return out
    lines = _Lines(root)
    for dpath, dline in lines.duplicates:
        out.problems.append(f"{shown}:{dline}: {_rule_ref(data, dpath)}duplicate key '{dpath[-1]}'")
    if not isinstance(data, dict):
        out.problems.append(f"{shown}:1: a pack is a mapping with 'pack', 'description' and 'rules'")
        return out
    try:
        spec = _PackSpec.model_validate(data)
    except ValidationError as exc:
        out.problems.extend(_pydantic_problems(exc, shown, lines, data, ()))
        return out
    out.name, out.description = spec.pack, spec.description
    if spec.origin is not None:
        out.origin = _compile_origin(spec.origin, shown, lines, out.problems)
    for i, raw in enumerate(spec.rules):
        rpath = ("rules", i)
        if not isinstance(raw, dict):
            out.problems.append(f"{shown}:{lines.line(rpath)}: rule #{i + 1} is not a mapping")
            continue
        try:
            rspec = _RuleSpec.model_validate(raw)
        except ValidationError as exc:
            out.problems.extend(_pydantic_problems(exc, shown, lines, data, rpath))
            continue
        rule = _compile_rule(rspec, spec.pack, shown, lines, rpath, start_order + len(out.rules), out.problems)
        if rule is not None:
            out.rules.append(rule)
    return out


def _compose_and_construct(text: str) -> tuple[yaml.Node | None, Any]:
    """Parse once: the node tree (for line numbers) and the data built from it (libyaml if present)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)(text)
    try:
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else None
    finally:
        loader.dispose()
    return root, data


def _rule_ref(data: Any, path: Sequence[Any]) -> str:
    if len(path) >= 2 and path[0] == "rules" and isinstance(path[1], int) and isinstance(data, dict):
        rules = data.get("rules")
        if isinstance(rules, list) and path[1] < len(rules) and isinstance(rules[path[1]], dict):
            rid = rules[path[1]].get("id")
            if rid is not None:
                return f"rule '{rid}': "
        return f"rule #{path[1] + 1}: "
    return ""


def _pydantic_problems(
    exc: ValidationError, shown: str, lines: _Lines, data: Any, prefix: tuple[Any, ...]
) -> list[str]:
    out = []
    for err in exc.errors():
        loc = (*prefix, *err["loc"])
        field_name = ".".join(str(x) for x in err["loc"]) or "(top)"
        kind = err["type"]
        if kind == "extra_forbidden":
            what = f"unknown key '{err['loc'][-1]}'"
        elif kind == "missing":
            what = f"missing field '{field_name}'"
        else:
            what = f"{field_name}: {err['msg']}"
            if "input" in err and kind != "model_type":
                what += f" (got {err['input']!r})"
        out.append(f"{shown}:{lines.line(loc)}: {_rule_ref(data, loc)}{what}")
    return out


def _compile_origin(spec: _OriginSpec, shown: str, lines: _Lines, problems: list[str]) -> OriginConfig:
    libs: list[re.Pattern[str]] = []
    for i, src in enumerate(spec.library_paths):
        pat = _compile_regex(src, f"{shown}:{lines.line(('origin', 'library_paths', i))}: origin", problems)
        if pat is not None:
            libs.append(pat)
    passes: list[tuple[re.Pattern[str], re.Pattern[str]]] = []
    for i, src in enumerate(spec.passthrough):
        where = f"{shown}:{lines.line(('origin', 'passthrough', i))}: origin"
        file_src, func_src = _split_passthrough(src)
        if not file_src or not func_src:
            problems.append(f"{where}: passthrough must be 'file-regex:function-regex', got {src!r}")
            continue
        f, g = _compile_regex(file_src, where, problems), _compile_regex(func_src, where, problems)
        if f is not None and g is not None:
            passes.append((f, g))
    return OriginConfig(tuple(libs), tuple(passes))


def _split_passthrough(src: str) -> tuple[str, str]:
    """'file-regex:function-regex' split at the last ':' outside parentheses (not '(?:')."""
    depth, cut, i = 0, -1, 0
    while i < len(src):
        ch = src[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == ":" and depth == 0:
            cut = i
        i += 1
    return (src[:cut], src[cut + 1 :]) if cut >= 0 else ("", "")


def _compile_regex(src: str, where: str, problems: list[str]) -> re.Pattern[str] | None:
    try:
        pat = re.compile(src)
    except re.error as exc:
        problems.append(f"{where}: bad regex {src!r}: {exc}")
        return None
    return pat


def _make_label(category: str, failure_type: str, action: str | None) -> tuple[Label | None, str | None]:
    cat = Category(category)
    if failure_type not in FAILURE_TYPES[cat]:
        return None, f"unknown failure_type '{failure_type}' for category {category}"
    act = Action(action) if action is not None else _DEFAULT_ACTION[cat]
    return Label(cat, failure_type, act), None


def _compile_rule(
    spec: _RuleSpec, pack: str, shown: str, lines: _Lines, rpath: tuple[Any, ...], order: int, problems: list[str]
) -> Rule | None:
    n_before = len(problems)

    def where(*sub: Any) -> str:
        return f"{shown}:{lines.line((*rpath, *sub))}: rule '{spec.id}'"

    label: Label | None = None
    by_origin: dict[str, Label] | None = None
    if spec.by_origin is not None:
        if spec.category is not None or spec.failure_type is not None or spec.action is not None:
            problems.append(f"{where('by_origin')}: give either category/failure_type/action or by_origin, not both")
        by_origin = {}
        for which in ("user", "library"):
            ls: _LabelSpec = getattr(spec.by_origin, which)
            lab, err = _make_label(ls.category, ls.failure_type, ls.action)
            if err:
                problems.append(f"{where('by_origin', which, 'failure_type')}: {err}")
            elif lab is not None:
                by_origin[which] = lab
        if not spec.match.exceptions and spec.match.kinds != ["traceback"]:
            problems.append(f"{where('by_origin')}: by_origin needs match.exceptions (or kinds: [traceback])")
    else:
        if spec.category is None:
            problems.append(f"{where()}: missing field 'category' (or by_origin)")
        if spec.failure_type is None:
            problems.append(f"{where()}: missing field 'failure_type' (or by_origin)")
        if spec.category is not None and spec.failure_type is not None:
            label, err = _make_label(spec.category, spec.failure_type, spec.action)
            if err:
                problems.append(f"{where('failure_type')}: {err}")

    m = spec.match
    if not m.patterns and not m.exceptions and not m.kinds:
        problems.append(f"{where('match')}: match needs patterns, exceptions or kinds")
    patterns = []
    for i, src in enumerate(m.patterns):
        pat = _compile_regex(src, where("match", "patterns", i), problems)
        if pat is not None and _pattern_problem(src):
            problems.append(f"{where('match', 'patterns', i)}: {_pattern_problem(src)} in {src!r}")
        elif pat is not None:
            patterns.append(pat)
    unless = [u for i, src in enumerate(m.unless) if (u := _compile_regex(src, where("match", "unless", i), problems))]
    if m.kinds is not None:
        for i, k in enumerate(m.kinds):
            if k not in KNOWN_KINDS:
                problems.append(f"{where('match', 'kinds', i)}: unknown event kind '{k}' (known: {', '.join(sorted(KNOWN_KINDS))})")
    for i, e in enumerate(m.exceptions or []):
        if not re.fullmatch(r"(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*", e):
            problems.append(f"{where('match', 'exceptions', i)}: not an exception type name: {e!r}")
    hint_err = _hint_problem(spec.hint)
    if hint_err:
        problems.append(f"{where('hint')}: {hint_err}")
    if len(problems) > n_before:
        return None
    return Rule(
        id=spec.id,
        pack=pack,
        title=spec.title,
        role=Role(spec.role),
        severity=spec.severity,
        confidence=float(spec.confidence),
        label=label,
        by_origin=by_origin,
        patterns=tuple(patterns),
        kinds=tuple(m.kinds) if m.kinds is not None else None,
        exceptions=frozenset(m.exceptions) if m.exceptions is not None else None,
        unless=tuple(unless),
        hint=spec.hint,
        examples=tuple(spec.examples),
        counterexamples=tuple(spec.counterexamples),
        file=shown,
        line=lines.line(rpath),
        order=order,
        literals=_rule_literals(m.patterns),
        example_lines=tuple(lines.line((*rpath, "examples", i)) for i in range(len(spec.examples))),
        counterexample_lines=tuple(
            lines.line((*rpath, "counterexamples", i)) for i in range(len(spec.counterexamples))
        ),
    )


def _display(path: Path) -> str:
    """rules/gpu.yaml rather than /work/main/rules/gpu.yaml when under the working directory."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


# ---------------------------------------------------------------------------------------------
# The pre-filter: one alternation of all patterns, and one of their literal keywords
# ---------------------------------------------------------------------------------------------

_GLOBAL_FLAGS = re.compile(r"^\(\?([aiLmsux]+)\)")
_NAMED_GROUP = re.compile(r"(?<!\\)\(\?P<\w+>")


def _pattern_problem(src: str) -> str | None:
    """What keeps a pattern out of the combined alternation. (Inline flags anywhere but at the
    start are already a re.error in Python 3.11.)"""
    if _has_op(sre_parse.parse(src), {sre_c.GROUPREF, sre_c.GROUPREF_EXISTS}):
        return "back-references are not supported"
    return None


def _has_op(items: Iterable[Any], ops: set[Any]) -> bool:
    for op, av in items:
        if op in ops:
            return True
        if op == sre_c.SUBPATTERN and _has_op(av[3], ops):
            return True
        if op == sre_c.BRANCH and any(_has_op(b, ops) for b in av[1]):
            return True
        if op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT, sre_c.POSSESSIVE_REPEAT) and _has_op(av[2], ops):
            return True
        if op in (sre_c.ASSERT, sre_c.ASSERT_NOT) and _has_op(av[1], ops):
            return True
    return False


def _as_alternative(src: str) -> str:
    """One pattern as a branch of a larger alternation: no names, flags scoped to it."""
    body = _NAMED_GROUP.sub("(?:", src)
    m = _GLOBAL_FLAGS.match(body)
    if m:
        return f"(?{m.group(1)}:{body[m.end():]})"
    return f"(?:{body})"


def _exception_pattern(names: Iterable[str]) -> str:
    shorts = sorted({n.rsplit(".", 1)[-1] for n in names})
    return r"\b(?:" + "|".join(re.escape(s) for s in shorts) + r")\b"


def _combined_regex(rules: Sequence[Rule]) -> re.Pattern[str]:
    parts = [_as_alternative(p.pattern) for r in rules for p in r.patterns]
    exc_names = [e for r in rules if r.exceptions for e in r.exceptions]
    if exc_names:
        parts.append(_exception_pattern(exc_names))
    if not parts:
        return re.compile(r"(?!x)x")  # matches nothing
    return re.compile("|".join(dict.fromkeys(parts)))


@dataclass(frozen=True, slots=True)
class _Prefilter:
    """Which rules and patterns can possibly match a text, from the literal keywords they need."""

    keywords: re.Pattern[str]  # trie-shaped alternation of every lower-case keyword
    prefixes: dict[str, tuple[str, ...]]  # keyword -> the keywords that are prefixes of it (itself too)
    patterns_by_keyword: dict[str, tuple[re.Pattern[str], ...]]
    patterns_always: tuple[re.Pattern[str], ...]  # patterns without a usable keyword
    rules_by_keyword: dict[str, frozenset[int]]  # keyword -> positions of the rules that need it
    rules_always: frozenset[int]  # rules to try on every event (no pattern, or one without keyword)

    @staticmethod
    def build(rules: Sequence[Rule]) -> _Prefilter:
        needs: list[tuple[re.Pattern[str], frozenset[str] | None]] = []
        for r in rules:
            needs.extend((p, _required_literals(p.pattern)) for p in r.patterns)
        names = {e.rsplit(".", 1)[-1] for r in rules for e in (r.exceptions or ())}
        if names:
            needs.append((re.compile(_exception_pattern(names)), frozenset(n.lower() for n in names)))
        patterns_by_kw: dict[str, list[re.Pattern[str]]] = {}
        patterns_always: list[re.Pattern[str]] = []
        for pat, lits in needs:
            if not lits:
                patterns_always.append(pat)
            for w in lits or ():
                patterns_by_kw.setdefault(w, []).append(pat)
        rules_by_kw: dict[str, set[int]] = {}
        rules_always: set[int] = set()
        for i, r in enumerate(rules):
            if not r.patterns or r.literals is None:
                rules_always.add(i)
            for w in r.literals or ():
                rules_by_kw.setdefault(w, set()).add(i)
        words = sorted(patterns_by_kw)
        trie = _trie_regex(words) if words else r"(?!x)x"
        return _Prefilter(
            keywords=re.compile(trie),
            prefixes={w: tuple(w[:i] for i in range(1, len(w) + 1) if w[:i] in patterns_by_kw) for w in words},
            patterns_by_keyword={k: tuple(dict.fromkeys(v)) for k, v in patterns_by_kw.items()},
            patterns_always=tuple(patterns_always),
            rules_by_keyword={k: frozenset(v) for k, v in rules_by_kw.items()},
            rules_always=frozenset(rules_always),
        )

    def keywords_in(self, low: str) -> frozenset[str]:
        """Every keyword occurring in a lower-cased text.

        The trie regex finds the longest keyword starting at a position; the shorter ones starting
        there are its prefixes, and searching again one character further finds the rest."""
        found: set[str] = set()
        m = self.keywords.search(low)
        while m is not None:
            found.update(self.prefixes[m.group()])
            m = self.keywords.search(low, m.start() + 1)
        return frozenset(found)

    def could_match(self, text: str) -> bool:
        if self.patterns_always and any(p.search(text) for p in self.patterns_always):
            return True
        low = text.lower()
        if self.keywords.search(low) is None:  # the common case: one search, no keyword
            return False
        return any(p.search(text) for kw in self.keywords_in(low) for p in self.patterns_by_keyword[kw])

    def candidate_rules(self, keyword_sets: Iterable[frozenset[str]]) -> list[int]:
        """Positions of the rules that could hit texts with these keywords, in load order."""
        cands = set(self.rules_always)
        for kws in keyword_sets:
            for kw in kws:
                cands |= self.rules_by_keyword.get(kw, frozenset())
        return sorted(cands)


def _trie_regex(words: Iterable[str]) -> str:
    """An alternation of literal words shaped as a prefix tree: the regex engine tries a handful of
    first characters at each position instead of hundreds of words (about 10x faster)."""
    root: dict[str, Any] = {}
    for w in words:
        node = root
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}  # end of a word

    def build(node: dict[str, Any]) -> str:
        ends = "" in node
        alts = [re.escape(ch) + build(child) for ch, child in sorted(node.items()) if ch]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 and not ends else "(?:" + "|".join(alts) + ")"
        return body + "?" if ends else body

    return build(root)


def _rule_literals(patterns: Sequence[str]) -> frozenset[str] | None:
    out: set[str] = set()
    for src in patterns:
        lits = _required_literals(src)
        if lits is None:
            return None
        out |= lits
    return frozenset(out) if out else None


_MIN_LITERAL = 3
_MAX_EXPANSION = 64
# Words nearly every progress line contains: as a pattern's keyword they would let every line
# through the pre-filter, so a rarer literal of the same pattern is preferred when there is one.
_COMMON_WORDS = frozenset({"loss", "step", "epoch", "iteration", "info", "train", "time", "rank"})


@functools.lru_cache(maxsize=4096)
def _required_literals(src: str) -> frozenset[str] | None:
    """Lower-cased strings one of which occurs in every text the pattern matches (None: unknown).

    Read off the regex parse tree: runs of literal characters (alternations of literals expanded,
    so ``Node(?:NotReady|Lost)`` gives both words), and alternations whose every branch has such a
    run. Lower-casing makes it valid for (?i) too."""
    try:
        tree = sre_parse.parse(src)
    except re.error:
        return None
    _, candidates = _analyze(list(tree))
    good = [c for c in candidates if min(len(x) for x in c) >= _MIN_LITERAL]
    if not good:
        return None
    return frozenset(max(good, key=_selectivity))


def _selectivity(lits: set[str]) -> tuple[bool, int]:
    return (not any(x.strip() in _COMMON_WORDS for x in lits), min(len(x) for x in lits))


def _analyze(items: list[Any]) -> tuple[set[str] | None, list[set[str]]]:
    """(the exact strings the sequence matches if it is a finite set of literals, else None;
    sets of strings one of which must occur)."""
    candidates: list[set[str]] = []
    cur: set[str] | None = None  # the exact strings of the current run of literal pieces
    exact_so_far = True

    def flush() -> None:
        nonlocal cur
        if cur:
            candidates.append(cur)
        cur = None

    def extend(strings: set[str]) -> None:
        nonlocal cur
        if cur is None:
            cur = set(strings)
        elif len(cur) * len(strings) <= _MAX_EXPANSION:
            cur = {a + b for a in cur for b in strings}
        else:
            flush()
            cur = set(strings)

    for op, av in items:
        sub_exact: set[str] | None = None
        sub_cands: list[set[str]] = []
        if op == sre_c.LITERAL:
            sub_exact = {chr(av).lower()}
        elif op == sre_c.IN and (one := _single_char(av)) is not None:
            sub_exact = {one}  # [Xx]
        elif op in (sre_c.AT, sre_c.ASSERT, sre_c.ASSERT_NOT):
            continue  # zero-width: the characters on either side are still adjacent
        elif op == sre_c.SUBPATTERN:
            sub_exact, sub_cands = _analyze(list(av[3]))
        elif op == sre_c.BRANCH:
            sub_exact, sub_cands = _analyze_branch(av[1])
        elif op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT, sre_c.POSSESSIVE_REPEAT) and av[0] >= 1:
            body_exact, sub_cands = _analyze(list(av[2]))
            if body_exact:
                sub_cands = [*sub_cands, body_exact]
        if sub_exact is not None:
            extend(sub_exact)
            continue
        exact_so_far = False
        flush()
        candidates.extend(sub_cands)
    exact = cur if exact_so_far and cur is not None else None
    flush()
    return exact, candidates


def _analyze_branch(alternatives: list[Any]) -> tuple[set[str] | None, list[set[str]]]:
    results = [_analyze(list(b)) for b in alternatives]
    if all(ex is not None for ex, _ in results):
        exact: set[str] = set().union(*(ex for ex, _ in results if ex is not None))
        return exact, [exact]
    bests = []
    for ex, cands in results:
        options = ([ex] if ex else []) + [c for c in cands if min(len(x) for x in c) >= _MIN_LITERAL]
        if not options:
            return None, []
        bests.append(max(options, key=_selectivity))
    return None, [set().union(*bests)]


def _single_char(av: list[Any]) -> str | None:
    """[Xx] is the literal x once lower-cased."""
    if not all(op == sre_c.LITERAL for op, _ in av):
        return None
    chars = {chr(v).lower() for _, v in av}
    return chars.pop() if len(chars) == 1 else None
