"""The rule pack file format (``rules/*.yaml``, documented in ``rules/README.md``).

pydantic checks the shape only, at the file edge; what a rule means (regexes, labels, event kinds,
hints) is checked when the loader compiles it into plain data (``logdx.diagnose.rules.loader``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from logdx.diagnose.rules.compiled import KNOWN_KINDS
from logdx.model import Action, Category, Role, Severity

__all__ = ["KNOWN_KINDS"]  # defined with the compiled rules (a rule set read from its cache needs no spec)

# Event kinds the detect stage produces; a rule naming another kind is a typo (the loader says so, by line).

_Strict = ConfigDict(extra="forbid", strict=True)
_NonEmpty = Annotated[str, Field(min_length=1)]
# The vocabulary's enums, read from the YAML's strings (strict mode would want enum members).
_Category = Annotated[Category, Field(strict=False)]
_Action = Annotated[Action, Field(strict=False)]  # `none` is refused by the loader: no label allows it
_Role = Annotated[Role, Field(strict=False)]
_Severity = Annotated[Severity, Field(strict=False)]


class LabelSpec(BaseModel):
    model_config = _Strict
    category: _Category
    failure_type: _NonEmpty
    action: _Action | None = None


class ByOriginSpec(BaseModel):
    model_config = _Strict
    user: LabelSpec
    # "owner": the module that raised it decides, through the taxonomy's owners (logdx/taxonomy.yaml).
    library: LabelSpec | Literal["owner"]


class MatchSpec(BaseModel):
    model_config = _Strict
    patterns: list[_NonEmpty] = []
    kinds: list[_NonEmpty] | None = None
    exceptions: list[_NonEmpty] | None = None
    unless: list[_NonEmpty] = []


class CulpritExpect(BaseModel):
    """The culprit a hit or a verdict names, field by field (a field left out is not checked)."""

    model_config = _Strict
    host: _NonEmpty | None = None
    rank: int | None = None
    gpu: _NonEmpty | None = None


class ExampleSpec(BaseModel):
    """An example written as a mapping: the line, and what the rule's hit on it must give."""

    model_config = _Strict
    text: _NonEmpty
    hint: _NonEmpty | None = None  # a substring of the rendered hint
    culprit: CulpritExpect | None = None  # the host / rank / GPU the hit names


class RuleSpec(BaseModel):
    model_config = _Strict
    id: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9-]*$")]
    title: _NonEmpty
    role: _Role
    category: _Category | None = None
    failure_type: _NonEmpty | None = None
    action: _Action | None = None
    by_origin: ByOriginSpec | None = None
    severity: _Severity = Severity.MEDIUM
    confidence: Annotated[float, Field(ge=0.0, le=1.0, strict=False)]
    match: MatchSpec
    # Lines that say the condition cleared (an IB port active again): one from the same host after the
    # event makes the event one the job recovered from.
    cleared_by: list[_NonEmpty] = []
    hint: str = ""
    # Rules this one is a narrower reading of: when both hit one event, this one wins (rules/README.md).
    refines: list[Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9-]*$")]] = []
    examples: list[str | ExampleSpec] = []
    counterexamples: list[str] = []


class OriginSpec(BaseModel):
    model_config = _Strict
    library_paths: list[_NonEmpty] = []
    passthrough: list[_NonEmpty] = []  # "file-regex:function-regex"


_LineIndex = Annotated[int, Field(ge=1)]  # 1-based, into the test's `lines`


class RecordExpect(BaseModel):
    """What the normaliser must make of one raw line; a field left out is not checked, `null` must be unset."""

    model_config = _Strict
    line: _LineIndex
    rank: int | None = None
    local_rank: int | None = None
    host: str | None = None
    stream: str | None = None
    text: str | None = None


class EventExpect(BaseModel):
    """An event the lines must give: of this kind, hit by this rule, anchored (or hit) on this line."""

    model_config = _Strict
    rule: _NonEmpty | None = None
    kind: _NonEmpty | None = None
    line: _LineIndex | None = None


class VerdictExpect(BaseModel):
    """The job-level diagnosis of the lines, as `logdx diagnose` would give it (rules, catalog)."""

    model_config = _Strict
    status: Literal["failed", "healthy"] = "failed"
    category: _Category | None = None
    failure_type: _NonEmpty | None = None
    action: _Action | None = None
    root_line: _LineIndex | None = None
    hosts: list[_NonEmpty] | None = None  # the culprit hosts, exactly ([]: none)
    ranks: list[int] | None = None  # the culprit ranks, exactly ([]: none)
    # the one culprit named (each field stated: that host / rank / GPU and no other); `none`: no culprit at all
    culprit: CulpritExpect | Literal["none"] | None = None
    hint: _NonEmpty | None = None  # a substring of the verdict's hint


class PackTestSpec(BaseModel):
    """A raw-input test: a few raw lines, launcher prefixes and all, through the real normaliser, detector
    and rules (`logdx rules test`)."""

    model_config = _Strict
    name: _NonEmpty
    lines: Annotated[list[str], Field(min_length=1)]
    exit_code: int | None = None  # the job's exit code, as `logdx diagnose --exit-code` gives it
    records: list[RecordExpect] = []
    events: list[EventExpect] = []
    verdict: VerdictExpect | None = None


class PackSpec(BaseModel):
    model_config = _Strict
    pack: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_-]*$")]
    description: str = ""
    origin: OriginSpec | None = None
    rules: list[dict[str, Any]] = []  # validated one by one, so one bad rule names its own id
    tests: list[dict[str, Any]] = []  # likewise, one by one (PackTestSpec)

