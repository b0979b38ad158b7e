"""The rule pack file format (``rules/*.yaml``, documented in ``rules/README.md``).

pydantic checks the shape only, at the file edge; what a rule means (regexes, labels, event kinds,
hints) is checked when the loader compiles it into plain data (``logdx.diagnose.rules.loader``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Event kinds the detect stage produces (see logdx.model.Event); a rule naming another kind is a typo.
KNOWN_KINDS: frozenset[str] = frozenset(
    {"traceback", "line", "nccl", "xid", "signal_exit", "child_failed", "loss_nan", "loss_spike", "stall",
     "stack_dump", "fr_report"}
)

_Strict = ConfigDict(extra="forbid", strict=True)
_NonEmpty = Annotated[str, Field(min_length=1)]


class LabelSpec(BaseModel):
    model_config = _Strict
    category: Literal["infrastructure", "framework", "script", "unknown"]
    failure_type: _NonEmpty
    action: Literal["cordon_and_restart", "restart", "no_restart"] | None = None


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


class RuleSpec(BaseModel):
    model_config = _Strict
    id: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9-]*$")]
    title: _NonEmpty
    role: Literal["root_cause", "symptom", "fallback"]
    category: Literal["infrastructure", "framework", "script", "unknown"] | None = None
    failure_type: _NonEmpty | None = None
    action: Literal["cordon_and_restart", "restart", "no_restart"] | None = None
    by_origin: ByOriginSpec | None = None
    severity: Literal["critical", "high", "medium", "low"] = "medium"
    confidence: Annotated[float, Field(ge=0.0, le=1.0, strict=False)]
    match: MatchSpec
    # Lines that say the condition cleared (an IB port active again): one from the same host after the
    # event makes the event one the job recovered from.
    cleared_by: list[_NonEmpty] = []
    hint: str = ""
    examples: list[str] = []
    counterexamples: list[str] = []


class OriginSpec(BaseModel):
    model_config = _Strict
    library_paths: list[_NonEmpty] = []
    passthrough: list[_NonEmpty] = []  # "file-regex:function-regex"


class PackSpec(BaseModel):
    model_config = _Strict
    pack: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_-]*$")]
    description: str = ""
    origin: OriginSpec | None = None
    rules: list[dict[str, Any]] = []  # validated one by one, so one bad rule names its own id

