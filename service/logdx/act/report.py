"""The report: the one contract every interface shares (CLI `--json`, HTTP, alerts).

Its shape is fixed by DESIGN.md; this module builds it from a Diagnosis and renders it for people.
"""

from __future__ import annotations

import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from logdx.model import (
    Action,
    Category,
    CompressionSummary,
    Cost,
    Diagnosis,
    Divergence,
    LostWork,
    ProgressSummary,
    Straggler,
)

_MAX_SOURCES = 1024
_MAX_RECOVERED = 50


class Culprits(BaseModel):
    hosts: list[str] = Field(default_factory=list)
    ranks: list[int] = Field(default_factory=list)
    gpus: list[str] = Field(default_factory=list)
    basis: str = Field("", description="how the culprit was found; empty when it was not")
    corroborated: bool = Field(False, description="a second signal agrees: the host printed the fault itself, "
                               "or the blamed rank stopped")
    verified: bool = Field(True, description="every host here was named by a sender that may speak for it (a node's "
                           "own credential, a collector of the operator's, the reader's own files); false: a claim "
                           "(a tenant's shipper, a token not bound to the host), reported and never cordoned")


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


class StepPoint(BaseModel):
    step: float | None = None
    line_no: int
    ts: float | None = None


class StoppedFirstBlock(BaseModel):
    ranks: list[int]
    hosts: list[str]
    step: float | None = None
    line_no: int
    basis: str = Field(description="how it was told: by progress, or by output")


class SourceBlock(BaseModel):
    rank: int | None = None
    host: str | None = None
    first_line: int
    last_line: int
    first_step: float | None = None
    last_step: float | None = None
    last_ts: float | None = None
    steps_per_s: float | None = None


class DivergenceBlock(BaseModel):
    kind: Literal["spike", "nan", "nan_iterations", "skipped", "grad_norm"]
    step: float | None = None
    line_no: int
    loss_before: float | None = None
    loss_after: float | None = None
    rollback_to_step: int | None = Field(None, description="the last checkpoint the log says was saved before "
                                         "`step`: roll back to it and skip the data that followed")


class ProgressBlock(BaseModel):
    """The job's training progress: where each rank got to, where the job stopped advancing."""

    lines: int = Field(description="progress lines seen")
    ranks: int = Field(description="sources (ranks, else hosts) that made progress")
    last_step: float | None = None
    stopped: StepPoint | None = Field(None, description="where the job stopped advancing; null when it ran to its end")
    first_stopped: StoppedFirstBlock | None = Field(
        None, description="the rank(s) whose progress or output ended before the others' (a hang's silent rank)")
    per_source: list[SourceBlock] = Field(default_factory=list, description=f"at most {_MAX_SOURCES} entries")
    loss: list[tuple[float, float]] = Field(default_factory=list, description="(step, loss), decimated")
    step_time_s: list[tuple[float, float]] = Field(default_factory=list, description="(step, seconds per step)")
    divergence: DivergenceBlock | None = None
    recovered_spikes: list[DivergenceBlock] = Field(default_factory=list, description="loss spikes that came back")
    checkpoints: list[tuple[int, int]] = Field(default_factory=list, description="(step, line_no) saved")


class RecoveredItem(BaseModel):
    """An event the job went on making progress after: never the root cause, never an action."""

    line_no: int
    text: str
    kind: str
    rank: int | None = None
    host: str | None = None
    source: str


class DegradationBlock(BaseModel):
    """Something the job's start-up says will make it slow: advice, never an action."""

    kind: Literal["network_fallback", "gdr_disabled", "p2p_disabled", "bootstrap_interface", "fewer_channels",
                  "nccl_version_differs", "driver_version_differs"]
    host: str
    line_no: int
    text: str
    effect: str


class StragglerBlock(BaseModel):
    """A host whose ranks step slower than the others', or whose step time jumped up and stayed there: advice,
    never an action, never a cordon on this alone."""

    host: str
    ranks: list[int] = Field(description="its ranks the log shows")
    kind: Literal["lagging", "slowed"] = Field(description="lagging: slower than the other hosts all along; slowed: "
                                               "its step time jumped up mid-run and stayed there")
    steps_per_s: float = Field(description="its pace (since the jump, for slowed)")
    others_steps_per_s: float = Field(description="the other hosts' median pace (its own before the jump, for slowed)")
    since_ts: float | None = Field(None, description="since when (epoch seconds): its first timed step, or the jump")
    since_step: float | None = None
    since_line: int | None = None
    evidence: list[EvidenceItem] = Field(default_factory=list, description="its kernel/NIC lines in that window "
                                         "(PCIe AER, thermal throttling, corrected ECC, link flaps)")
    effect: str


class TimeoutBlock(BaseModel):
    """Why the job's collectives timed out (diagnose/timeouts.py; the classes: taxonomy.yaml `timeout_classes`)."""

    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)

    cause: Literal["cpu_side", "gpu_hang", "misconfig", "network", "unknown"] = Field(
        alias="class", description="cpu_side: ranks ran different code; misconfig: different ops or sizes at the same "
        "sequence number; gpu_hang: a rank's work was enqueued and never completed; network: a link or HCA failed "
        "under the collective; unknown: the log does not say (see `missing`)")
    title: str = ""
    evidence: list[str] = Field(default_factory=list, description="what decided the class, with line numbers")
    missing: list[str] = Field(default_factory=list, description="when unknown: what would tell the classes apart")
    culprit_ranks: list[int] = Field(default_factory=list)
    culprit_hosts: list[str] = Field(default_factory=list)
    action: Action | None = Field(None, description="the action this cause implies; null: the verdict's own")
    decided: bool = Field(False, description="the class set the report's label and action (a timeout verdict)")
    explained_by: str | None = Field(None, description="the rule of the root cause that explains the timeouts")


class HypothesisBlock(BaseModel):
    """One label an unsure report still holds possible (its confidence below the cordon threshold)."""

    category: Category
    failure_type: str
    action: Action
    p: float = Field(ge=0, le=1, description="its share of the report's belief; the report's own label comes first")
    check: str = Field(description="the one check that would confirm it")
class LostWorkBlock(BaseModel):
    """One failure's lost work (README, "What a failure cost"); null parts: the log does not say (see `notes`)."""

    failure_ts: float | None = Field(None, description="when it failed (epoch seconds): the root line's time")
    failure_step: float | None = Field(None, description="the step the job had reached")
    failure_line: int | None = None
    checkpoint_step: int | None = Field(None, description="the last checkpoint saved before the failure")
    checkpoint_ts: float | None = None
    checkpoint_line: int | None = None
    since: Literal["checkpoint", "attempt_start", "job_start", ""] = Field(
        "", description="what the lost work is counted from: the checkpoint, the first progress line of the attempt "
        "the failure is in (when later than the checkpoint), the job's first line (no checkpoint); empty: unknown")
    since_ts: float | None = None
    lost_hours: float | None = Field(None, description="failure_ts - since_ts, in hours")
    lost_gpu_hours: float | None = Field(None, description="gpus x lost_hours")
    restart_ts: float | None = Field(None, description="the restarted attempt's first progress line, when the log holds it")
    resumed_step: float | None = None
    stood_still_s: float | None = Field(None, description="restart_ts - failure_ts: the job made no progress")
    passed_ts: float | None = Field(None, description="when the restarted attempt was back at failure_step")
    back_after_s: float | None = Field(None, description="passed_ts - failure_ts")


class CostBlock(LostWorkBlock):
    """What the failure cost, part by part, from the log (failed reports only)."""

    gpus: int | None = Field(None, description="the job's world size: the launcher's, else 1 + the highest rank seen")
    gpus_from: Literal["launcher", "ranks", ""] = ""
    earlier_attempts: list[LostWorkBlock] = Field(
        default_factory=list, description="failures of earlier attempts in the same log that were restarted "
        "(their time is their last progress line's); not charged to this failure's cause")
    notes: list[str] = Field(default_factory=list, description="each part the log does not give, and why")


# "unknown": the log shows neither a failure nor the job's health (no end of the run, no exit code, training
# that did not go on past its errors; logdx/diagnose/health.py); "empty": the input held no log text at all.
Status = Literal["failed", "healthy", "unknown", "empty"]


class Report(BaseModel):
    id: str = Field(default_factory=lambda: uuid.uuid4().hex[:12])
    status: Status
    category: Category | None
    failure_type: str | None
    action: Action
    confidence: float = Field(ge=0, le=1)
    culprits: Culprits
    root_cause: RootCause | None
    evidence: list[EvidenceItem]
    explanation: str
    hint: str
    compression: CompressionFigures
    timings_ms: dict[str, float]
    notes: list[str] = Field(default_factory=list)
    progress: ProgressBlock | None = Field(None, description="null when the log has no training progress lines")
    recovered: list[RecoveredItem] = Field(default_factory=list)
    decided_by: str = Field("rules", description="the stage whose verdict stands: rules, catalog, or a learned stage "
                            "(retrieval, llm, fusion) that changed it; a learned stage's verdict never cordons")
    timeout: TimeoutBlock | None = Field(None, description="why the collectives timed out; null when none did")
    degradations: list[DegradationBlock] = Field(
        default_factory=list, description="what the job's start-up says will make it slow (a host on TCP sockets "
        "while the others use InfiniBand, GPU Direct RDMA off on one host): advice, healthy jobs included")
    stragglers: list[StragglerBlock] = Field(
        default_factory=list, description="hosts whose ranks step slower than the others' or whose step time jumped "
        "up, with their kernel/NIC lines in that window: advice, never an action, healthy jobs included")
    hypotheses: list[HypothesisBlock] = Field(
        default_factory=list, description="when the report is unsure (confidence below 0.8): its own label and the "
        "one or two others the evidence still holds possible, each with the check that would confirm it")
    cost: CostBlock | None = Field(None, description="what the failure cost (GPU-hours since the last checkpoint); "
                                   "null unless failed")


def build_report(diagnosis: Diagnosis, summary: CompressionSummary, timings_ms: dict[str, float]) -> Report:
    d = diagnosis
    healthy = d.status in ("healthy", "unknown", "empty") or d.label is None  # nothing failed: no label, no action
    root = d.root
    return Report(
        status=d.status if d.status in ("unknown", "empty") else "healthy" if healthy else "failed",
        category=None if healthy else d.label.category,  # type: ignore[union-attr]
        failure_type=None if healthy else d.label.failure_type,  # type: ignore[union-attr]
        action=Action.NONE if healthy else d.label.action,  # type: ignore[union-attr]
        confidence=round(min(1.0, max(0.0, d.confidence)), 3),
        culprits=Culprits(hosts=d.attribution.hosts, ranks=d.attribution.ranks, gpus=d.attribution.gpus,
                          basis=d.attribution.basis, corroborated=d.attribution.corroborated,
                          verified=d.attribution.verified),
        root_cause=RootCause(line_no=root.line_no, text=root.raw, rank=root.rank, host=root.host) if root else None,
        evidence=[EvidenceItem(line_no=e.line_no, text=e.text, source=e.source) for e in d.evidence],
        explanation=d.explanation,
        hint=d.hint,
        compression=CompressionFigures(lines_in=summary.lines_in, templates=summary.templates, lines_kept=summary.lines_kept),
        timings_ms={k: round(v, 1) for k, v in timings_ms.items()},
        notes=d.notes,
        progress=_progress_block(summary.progress, d, failed=not healthy),
        recovered=[RecoveredItem(line_no=r.line_no, text=_clip(r.text), kind=r.kind, rank=r.rank, host=r.host,
                                 source=r.source) for r in d.recovered[:_MAX_RECOVERED]],
        decided_by=d.decided_by,
        timeout=_timeout_block(d) if not healthy else None,
        degradations=[DegradationBlock(kind=g.kind, host=g.host, line_no=g.line_no, text=_clip(g.text), effect=g.effect)
                      for g in d.degradations[:_MAX_DEGRADATIONS]],
        stragglers=[_straggler_block(s) for s in d.stragglers[:_MAX_DEGRADATIONS]],
        hypotheses=[] if healthy else [
            HypothesisBlock(category=h.label.category, failure_type=h.label.failure_type, action=h.label.action,
                            p=h.p, check=h.check) for h in d.hypotheses],
        cost=_cost_block(d.cost) if not healthy and d.cost is not None else None,
    )


def _straggler_block(s: Straggler) -> StragglerBlock:
    return StragglerBlock(host=s.host, ranks=list(s.ranks[:64]), kind=s.kind,
                          steps_per_s=round(s.steps_per_s, 4), others_steps_per_s=round(s.others_steps_per_s, 4),
                          since_ts=s.since_ts, since_step=s.since_step, since_line=s.since_line,
                          evidence=[EvidenceItem(line_no=n, text=_clip(t), source="kernel") for n, t in s.evidence],
                          effect=s.effect)


def _lost_fields(w: LostWork) -> dict[str, object]:
    return {"failure_ts": w.failure_ts, "failure_step": w.failure_step, "failure_line": w.failure_line,
            "checkpoint_step": w.checkpoint_step, "checkpoint_ts": w.checkpoint_ts,
            "checkpoint_line": w.checkpoint_line, "since": w.since, "since_ts": w.since_ts,
            "lost_hours": round(w.lost_s / 3600, 4) if w.lost_s is not None else None,
            "lost_gpu_hours": w.lost_gpu_hours, "restart_ts": w.restart_ts, "resumed_step": w.resumed_step,
            "stood_still_s": _round(w.stood_still_s), "passed_ts": w.passed_ts, "back_after_s": _round(w.back_after_s)}


def _round(x: float | None) -> float | None:
    return round(x, 1) if x is not None else None


def _cost_block(c: Cost) -> CostBlock:
    return CostBlock.model_validate({
        **_lost_fields(c.failure), "gpus": c.gpus, "gpus_from": c.gpus_from, "notes": c.notes,
        "earlier_attempts": [LostWorkBlock.model_validate(_lost_fields(w)) for w in c.earlier[:16]]})


_MAX_DEGRADATIONS = 32


def _timeout_block(d: Diagnosis) -> TimeoutBlock | None:
    t = d.timeout
    if t is None:
        return None
    spec = t.spec
    return TimeoutBlock(cause=t.cause, title=spec.title, evidence=[_clip(e) for e in t.evidence[:8]],
                        missing=t.missing, culprit_ranks=t.ranks[:64], culprit_hosts=t.hosts[:16], action=spec.action,
                        decided=t.decided, explained_by=t.explained_by)


def _progress_block(p: ProgressSummary, d: Diagnosis, *, failed: bool) -> ProgressBlock | None:
    if p.lines == 0:
        return None
    first = d.stopped_first
    return ProgressBlock(
        lines=p.lines,
        ranks=len(p.sources),
        last_step=p.last_step,
        stopped=StepPoint(step=p.last_step, line_no=p.last_line, ts=p.last_ts) if failed else None,
        first_stopped=StoppedFirstBlock(ranks=first.ranks, hosts=first.hosts, step=first.step, line_no=first.line_no,
                                        basis=first.basis) if first is not None else None,
        per_source=[SourceBlock(rank=s.rank, host=s.host, first_line=s.first_line, last_line=s.last_line,
                                first_step=s.first_step, last_step=s.last_step, last_ts=s.last_ts,
                                steps_per_s=round(s.steps_per_s, 4) if s.steps_per_s else None)
                    for s in sorted(p.sources, key=_source_order)[:_MAX_SOURCES]],
        loss=[(x, round(y, 6)) for x, y in p.loss if y == y and abs(y) != float("inf")],
        step_time_s=p.step_time_s,
        divergence=_divergence(p.divergence),
        recovered_spikes=[b for x in p.recovered_spikes if (b := _divergence(x)) is not None],
        checkpoints=p.checkpoints,
    )


def _source_order(s: object) -> tuple[int, str]:
    rank = getattr(s, "rank", None)
    return (rank if rank is not None else 1 << 30, getattr(s, "key", ""))


def _divergence(x: Divergence | None) -> DivergenceBlock | None:
    if x is None:
        return None
    return DivergenceBlock(kind=x.kind, step=x.step, line_no=x.line_no, loss_before=x.loss_before,
                           loss_after=x.loss_after, rollback_to_step=x.rollback_to_step)


def _clip(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
