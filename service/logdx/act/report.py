"""The report: the one contract every interface shares (CLI `--json`, HTTP, alerts).

Its shape is fixed by DESIGN.md; this module builds it from a Diagnosis and renders it for people.
"""

from __future__ import annotations

import uuid
from typing import Literal

from pydantic import BaseModel, Field

from logdx.model import CompressionSummary, Diagnosis


class Culprits(BaseModel):
    hosts: list[str] = Field(default_factory=list)
    ranks: list[int] = Field(default_factory=list)
    gpus: list[str] = Field(default_factory=list)
    basis: str = Field("", description="how the culprit was found; empty when it was not")
    corroborated: bool = Field(False, description="a second signal agrees: the host printed the fault itself, "
                               "or the blamed rank stopped")


class RootCause(BaseModel):
    line_no: int
    text: str
    rank: int | None = None
    host: str | None = None


class EvidenceItem(BaseModel):
    line_no: int | None
    text: str
    source: str


class CompressionFigures(BaseModel):
    lines_in: int
    templates: int
    lines_kept: int


class Report(BaseModel):
    id: str = Field(default_factory=lambda: uuid.uuid4().hex[:12])
    # "empty": the input held no log text at all (nothing to call healthy or failed).
    status: Literal["failed", "healthy", "empty"]
    category: Literal["infrastructure", "framework", "script", "unknown"] | None
    failure_type: str | None
    action: Literal["cordon_and_restart", "restart", "no_restart", "none"]
    confidence: float = Field(ge=0, le=1)
    culprits: Culprits
    root_cause: RootCause | None
    evidence: list[EvidenceItem]
    explanation: str
    hint: str
    compression: CompressionFigures
    timings_ms: dict[str, float]
    notes: list[str] = Field(default_factory=list)


def build_report(diagnosis: Diagnosis, summary: CompressionSummary, timings_ms: dict[str, float]) -> Report:
    d = diagnosis
    healthy = d.status in ("healthy", "empty") or d.label is None
    root = d.root
    return Report(
        status=d.status if d.status == "empty" else "healthy" if healthy else "failed",
        category=None if healthy else d.label.category.value,  # type: ignore[union-attr]
        failure_type=None if healthy else d.label.failure_type,  # type: ignore[union-attr]
        action="none" if healthy else d.label.action.value,  # type: ignore[union-attr]
        confidence=round(min(1.0, max(0.0, d.confidence)), 3),
        culprits=Culprits(hosts=d.attribution.hosts, ranks=d.attribution.ranks, gpus=d.attribution.gpus,
                          basis=d.attribution.basis, corroborated=d.attribution.corroborated),
        root_cause=RootCause(line_no=root.line_no, text=root.raw, rank=root.rank, host=root.host) if root else None,
        evidence=[EvidenceItem(line_no=e.line_no, text=e.text, source=e.source) for e in d.evidence],
        explanation=d.explanation,
        hint=d.hint,
        compression=CompressionFigures(lines_in=summary.lines_in, templates=summary.templates, lines_kept=summary.lines_kept),
        timings_ms={k: round(v, 1) for k, v in timings_ms.items()},
        notes=d.notes,
    )
