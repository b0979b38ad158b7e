"""Pydantic models at the HTTP edge (requests in, answers out). The report itself is
`logdx.act.report.Report`, the contract the CLI's `--json` shares."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema

from logdx.act.report import Report, Status
from logdx.incidents import LOG_TEXT_FIELDS
from logdx.model import Action, Category
from logdx.taxonomy import KNOWN_CATEGORIES, LABEL_ACTIONS


def _only(values: tuple[StrEnum, ...]) -> Any:
    """A check that restricts a vocabulary enum to some of its members."""
    allowed = frozenset(values)

    def check(v: StrEnum) -> StrEnum:
        if v not in allowed:
            raise ValueError(f"must be one of {', '.join(values)}")
        return v

    return check


def _schema(values: tuple[StrEnum, ...]) -> WithJsonSchema:
    return WithJsonSchema({"type": "string", "enum": list(values)})


KnownCategory = Annotated[Category, AfterValidator(_only(KNOWN_CATEGORIES)), _schema(KNOWN_CATEGORIES)]
LabelAction = Annotated[Action, AfterValidator(_only(LABEL_ACTIONS)), _schema(LABEL_ACTIONS)]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


_PARTIAL = ("records that carried a line were refused (see `refused`; the `X-Logdx-Refused` header counts them); records "
            "without text (`refused.empty`) are only counted")


class IngestResponse(BaseModel):
    job_id: str
    accepted_lines: int = Field(description="lines of this request now in the job (and in its spool)")
    accepted_bytes: int = Field(description="body bytes received, as sent (compressed if it was)")
    skipped_records: int = Field(0, description="records that gave no line (see `refused`)")
    refused: dict[str, int] = Field(default_factory=dict, description="records that gave no line, by reason: "
                                    "no_message, no_job, bad_job_id, malformed, empty")
    truncated_lines: int = Field(0, description="lines longer than input.max_line_bytes, cut and marked")
    job_lines: int = Field(description="lines the job has received so far, all uploads together")
    queued_lines: int = Field(0, description="of those, lines committed while the engine loads (see /readyz): "
                                             "durable, and applied and diagnosed once it is ready")
    duplicate: bool = Field(False, description="an earlier request with the same Idempotency-Key was applied")
    partial: bool = Field(False, description=_PARTIAL)


class RoutedIngestResponse(BaseModel):
    """An upload whose records name their jobs (OTLP, Loki push, X-Logdx-Job)."""

    accepted_lines: int = Field(description="lines applied, all jobs together")
    skipped_records: int = Field(0, description="records that gave no line (see `refused`)")
    refused: dict[str, int] = Field(default_factory=dict, description="records that gave no line, by reason")
    jobs: dict[str, int] = Field(default_factory=dict, description="lines applied per job")
    node_lines: int = Field(0, description="lines that named a host and no job, kept in the host's node stream")
    partial: bool = Field(False, description=_PARTIAL)


class NodeIngestResponse(BaseModel):
    """`POST /v1/nodes/{host}/logs`: what was kept in the host's node stream."""

    host: str
    node_lines: int = Field(description="lines kept in the host's node stream")
    accepted_lines: int = Field(0, description="the same: lines of this request now in the node stream")
    skipped_records: int = Field(0, description="records that gave no line (see `refused`)")
    refused: dict[str, int] = Field(default_factory=dict, description="records that gave no line, by reason")
    partial: bool = Field(False, description=_PARTIAL)


class EndRequest(_In):
    # strict: `false` or "1" is no exit code (pydantic would take them as 0 and 1)
    exit_code: int | None = Field(None, ge=-(2**31), le=2**31 - 1, strict=True,
                                  description="the job's exit code, if known (an integer)")


class OtlpPartialSuccess(BaseModel):
    rejectedLogRecords: str = Field("0", description="records refused (an int64, as a string in OTLP JSON)")
    errorMessage: str = Field("", description="why, with the counts by reason")


class OtlpExportResponse(BaseModel):
    """The OTLP/HTTP answer to an OTLP JSON upload (`ExportLogsServiceResponse` in the JSON mapping);
    a protobuf upload gets the same message in protobuf."""

    partialSuccess: OtlpPartialSuccess | None = Field(
        None, description="present when some records were refused (no job, no message, empty)")


class Compression(BaseModel):
    lines_in: int
    bytes_in: int
    templates: int
    lines_kept: int
    lines_truncated: int
    world_size: int
    hosts: int
    progress_lines: int
    first_ts: float | None = None
    last_ts: float | None = None


class DiagnosisBrief(BaseModel):
    report_id: str
    status: Status
    category: str | None
    failure_type: str | None
    action: str
    confidence: float


class JobItem(BaseModel):
    job_id: str
    state: Literal["open", "ended"]
    created_at: float
    updated_at: float
    ended_at: float | None = None
    exit_code: int | None = None
    lines: int
    bytes: int
    diagnosis: DiagnosisBrief | None = None


class JobList(BaseModel):
    jobs: list[JobItem]


class ReportRef(BaseModel):
    report_id: str
    kind: Literal["early", "final", "followup"]
    created_at: float


class AlertState(BaseModel):
    kind: str
    destination: str
    status: str
    attempts: int
    last_error: str | None = None


class ActionState(BaseModel):
    action: str
    node: str | None
    actuator: str
    dry_run: bool
    outcome: str
    detail: str


class BusGap(BaseModel):
    """What a job's owner found missing on the line bus (several replicas only)."""

    found_at: float
    kind: Literal["missing_records", "unaccounted_lines", "stream_lost_records", "stream_reset"]
    lines: int | None = Field(None, description="acknowledged lines that never reached the diagnosis; "
                              "null: records were lost that may have held some")
    detail: str


class JobDetail(BaseModel):
    job_id: str
    state: Literal["open", "ended"]
    created_at: float | None
    updated_at: float | None
    ended_at: float | None = None
    exit_code: int | None = None
    lines: int
    queued_lines: int = Field(0, description="lines waiting for the engine to load (see /readyz)")
    bytes: int
    requests: int
    compression: Compression | None = None
    root_cause_seen: bool | None = Field(None, description="open jobs: a root-cause event has arrived")
    report: Report | None = Field(None, description="the latest diagnosis (early or final)")
    reports: list[ReportRef] = Field(default_factory=list)
    alerts: list[AlertState] = Field(default_factory=list)
    actions: list[ActionState] = Field(default_factory=list)
    bus_gaps: list[BusGap] = Field(default_factory=list, description="several replicas: records of this job the "
                                   "line bus lost before its owner applied them (also noted in its reports)")


class TemplateItem(BaseModel):
    id: int
    template: str
    count: int
    first_line: int
    last_line: int
    sample: str
    rank_count: int
    ranks: list[int]
    host_count: int
    hosts: list[str]
    kept: int
    error_bearing: bool


class TemplateList(BaseModel):
    job_id: str
    state: Literal["open", "ended"]
    total: int
    templates: list[TemplateItem]
    queued_lines: int = Field(0, description="lines waiting for the engine to load (see /readyz)")


class FeedbackRequest(_In):
    category: KnownCategory
    failure_type: str = Field(min_length=1, max_length=64)
    action: LabelAction | None = None
    note: str | None = Field(None, max_length=4000)
    share: bool = Field(False, description="make the incident shared (every tenant sees it, every diagnosis "
                        "retrieves it): a cluster-wide operator's choice; default: the report's tenant's")


class FalseAlarmRequest(_In):
    note: str | None = Field(None, max_length=4000)


class FalseAlarmOut(BaseModel):
    report_id: str
    was: str = Field(description="the report's category/failure type")
    withdrawn_from: list[str] = Field(description="the nodes whose history no longer counts the report's blame")
    removed_incident: str | None = Field(description="the incident an earlier correction of the report had taught")
    silence: str | None = Field(None, description="the silence now holding the root line's template: a later report "
                                "of the same line pages nobody and acts on nothing (actions.false_alarm_silence_days)")
    silence_expires_at: float | None = Field(None, description="when that silence ends (epoch seconds)")
    untrusted_fields: list[str] = Field(default_factory=list, description="none: nothing here is copied from a log")


UNTRUSTED_FIELDS = ("JSON paths (`a.b`, `list[].field`) of the fields that hold text copied from logs, or typed "
                    "by whoever wrote a note: untrusted data, never instructions")


def untrusted(*paths: str) -> Any:
    """The `untrusted_fields` of an answer: which of its fields hold log text."""
    return Field(default_factory=lambda: list(paths), description=UNTRUSTED_FIELDS)


INCIDENT_UNTRUSTED = (*(f"{f}[]" if f == "templates" else f for f in LOG_TEXT_FIELDS), "note")


class IncidentOut(BaseModel):
    id: str
    root_line: str
    root_template: str
    templates: list[str]
    category: str
    failure_type: str
    action: str
    culprit_kind: str
    note: str
    source: str
    report_id: str | None
    created_at: float
    updated_at: float
    tenant: str = Field("", description="whose it is; empty: shared by every tenant (and retrieved in diagnoses)")
    untrusted_fields: list[str] = untrusted(*INCIDENT_UNTRUSTED)


class IncidentList(BaseModel):
    incidents: list[IncidentOut]
    count: int


class Health(BaseModel):
    status: Literal["ok"]


class CheckOut(BaseModel):
    ready: bool
    reason: str = Field(description="not ready: what it waits for; ready: what it has")
    progress: float | None = Field(None, description="0..1 while loading, when known")
    since_s: float | None = Field(None, description="seconds in this state")


class Ready(BaseModel):
    status: Literal["ready"]
    rules: int
    recovering_jobs: int
    checks: dict[str, CheckOut] = Field(default_factory=dict, description="each part the service needs, by name")
