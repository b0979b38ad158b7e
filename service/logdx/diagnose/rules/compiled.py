"""Rules compiled from their packs: plain, frozen data the matcher runs on."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from logdx.model import Event, EventKind, Label, Record, Role, Severity

# Entries of `match.exceptions` that are no class name: "*" any exception but a warning, "-" a
# traceback the log ends inside, before its exception line.
ANY_EXCEPTION, CUT_OFF = "*", "-"
EXCEPTION_MARKERS = frozenset({ANY_EXCEPTION, CUT_OFF})
KNOWN_KINDS: frozenset[str] = frozenset(k.value for k in EventKind)  # what `match.kinds` may name

_ROLE_RANK = {Role.ROOT_CAUSE: 0, Role.FALLBACK: 1, Role.SYMPTOM: 2}
Origin = Literal["user", "library"]


@dataclass(frozen=True, slots=True)
class PackTest:
    """A pack's raw-input test (`tests:` in a pack), checked by `logdx.explain.run_pack_tests`.

    Line numbers are 1-based indexes into `lines`; `records` holds, per line, the Record fields the
    normaliser must give it (None: must be unset)."""

    name: str
    pack: str
    file: str
    line: int  # where the test is written in its pack
    lines: tuple[str, ...]
    records: tuple[tuple[int, tuple[tuple[str, object], ...]], ...] = ()
    events: tuple[tuple[str | None, EventKind | None, int | None], ...] = ()  # (rule id, kind, line)
    status: str | None = None  # the verdict's, when the test states one
    category: str | None = None
    failure_type: str | None = None
    action: str | None = None
    root_line: int | None = None
    hosts: tuple[str, ...] | None = None  # the culprit, when the test states it
    ranks: tuple[int, ...] | None = None
    # `culprit:` the one culprit the verdict names, field by field (host, rank, gpu); None: not stated.
    # An empty tuple: the verdict names no culprit at all (`culprit: none`).
    culprit: tuple[tuple[str, object], ...] | None = None
    hint: str | None = None  # a substring the verdict's hint must hold
    exit_code: int | None = None  # the job's exit code, given to the diagnosis as `diagnose --exit-code` does

    def where(self) -> str:
        return f"{self.file}:{self.line}: test '{self.name}'"


class RuleError(Exception):
    """A rule pack that does not load. ``problems`` holds one "file:line: rule 'id': what" each."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


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
class ExampleExpect:
    """What a rule's hit on one of its examples must give besides matching (an example written as a
    mapping): a substring of the rendered hint, the culprit it names (host, rank, GPU)."""

    hint: str | None = None
    host: str | None = None
    rank: int | None = None
    gpu: str | None = None


@dataclass(frozen=True, slots=True)
class Rule:
    id: str
    pack: str
    title: str
    role: Role
    severity: Severity
    confidence: float
    label: Label | None  # None when the label depends on the origin (by_origin)
    by_origin: dict[str, Label | None] | None  # None for a side: the library's owner decides
    patterns: tuple[re.Pattern[str], ...]
    kinds: tuple[EventKind, ...] | None
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
    cleared_by: tuple[re.Pattern[str], ...] = ()  # a later line of the same host saying the condition cleared
    # The rules this one is a narrower reading of: when both hit one event, this one wins (precedence.py).
    refines: tuple[str, ...] = ()
    # Per example (same order as `examples`): what its hit must render and name, when the pack says so.
    example_expects: tuple[ExampleExpect | None, ...] = ()

    def where(self) -> str:
        return f"{self.file}:{self.line}: rule '{self.id}'"


@dataclass(slots=True)
class RuleHit:
    rule_id: str
    pack: str
    title: str
    role: Role
    label: Label
    severity: Severity
    confidence: float
    line: Record  # the event line the pattern matched: it becomes the root line
    groups: dict[str, str]
    hint: str
    event: Event
    hint_rule: str | None = None  # whose hint applies when another rule's label was borrowed

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
        return (_ROLE_RANK[self.role], self.severity.rank, -self.confidence)

