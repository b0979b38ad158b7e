"""The wire models of the nodes, actions and costs: what `/v1/nodes`, `/v1/actions`, `/v1/costs` answer
and the MCP tools return (`logdx.api.nodes` routes them, `logdx.agent` reuses them)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from logdx.config import actuator_choices, choices_schema


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class UncordonRequest(_Body):
    by: str = Field("", max_length=200, description="on whose behalf (noted as stated; the audit's who is the token's name)")
    reason: str = Field("", max_length=2000)


class ResetRequest(_Body):
    by: str = Field("", max_length=200, description="on whose behalf (noted as stated; the audit's who is the token's name)")
    note: str = Field("", max_length=2000)


class BlameOut(BaseModel):
    ts: float
    job_id: str
    failure_type: str
    gpu: str
    xid: int | None
    report_id: str | None
    text: str


class GradeBlameOut(BaseModel):
    ts: float
    job_id: str
    failure_type: str
    family: str
    report_id: str | None


class GradeOut(BaseModel):
    grade: str = Field(description="ok | suspect (blamed once) | avoid (the scheduler prefers other nodes) | exclude "
                       "(cordoned, within the budget and the breaker): actions.grades")
    family: str | None = Field(description="the family of failure (taxonomy.yaml `families`) whose blames set it")
    reason: str
    counted: list[GradeBlameOut] = Field(description="the blames that set it, within actions.grades.window_s")
    live: int = Field(description="blames still counted")
    forgiven: list[GradeBlameOut] = Field(description="blames healthy runtime on the node forgave")
    healthy_jobs: int = Field(description="healthy jobs on the node since its last blame")
    credit_s: float = Field(description="their runtime toward the next step down")
    decay_s: float
    decay_due_s: float | None = Field(description="healthy runtime still due before the grade drops a step; null: ok")


class NodeOut(BaseModel):
    node: str
    first_seen: float
    last_seen: float
    state: str = Field(description="ok | cordoned")
    state_since: float | None
    state_by: str | None
    state_reason: str | None
    events: int = Field(description="distinct events blamed on the node (repeats of one event count once)")
    jobs: list[str] = Field(description="the jobs that blamed it, most recent first")
    blamed_by_several_jobs: bool
    failure_types: dict[str, int]
    recent: list[BlameOut]
    grade: GradeOut | None = None
    avoided: bool = Field(False, description="logdx's avoid mark is on the node (a PreferNoSchedule taint, a Slurm "
                          "weight)")


class NodeList(BaseModel):
    nodes: list[NodeOut]
    count: int


class ActionOut(BaseModel):
    id: int
    ts: float
    job_id: str
    node: str | None
    action: str
    actuator: str
    dry_run: bool
    outcome: str
    detail: str
    report_id: str | None = None
    failure_type: str | None = None
    action_key: str | None = None


class BreakerOut(BaseModel):
    state: str = Field(description="closed | open")
    since: float | None
    reason: str
    by: str


class ActionsOut(BaseModel):
    dry_run: bool
    actuator: str = Field(json_schema_extra=choices_schema(actuator_choices()),
                          description="actions.actuator: none, or a registered actuator")
    breaker: BreakerOut
    cordoned_in_window: list[str] = Field(description="nodes cordoned for real within actions.window_s")
    max_cordons: int
    window_s: float
    known_nodes: int
    breaker_max_share: float
    cordoned_nodes: list[str] = Field(description="nodes logdx holds cordoned now")
    audit: list[ActionOut] = Field(description="the latest audit rows, oldest first")


class CostGroup(BaseModel):
    key: str = Field(description="the failure type, the culprit node or the category")
    jobs: int
    lost_gpu_hours: float
    unknown: int = Field(description="jobs of the group whose log did not give their cost")


class CostList(BaseModel):
    by: str
    since: float | None = Field(description="epoch seconds; null: every failure recorded")
    failed_jobs: int
    lost_gpu_hours: float
    unknown: int
    groups: list[CostGroup]


class NodeLine(BaseModel):
    ts: float = Field(description="the line's time (its record's, else its arrival)")
    received_at: float
    notable: bool = Field(description="a rule could match it: it joins the jobs that ran on the node")
    text: str


class NodeLines(BaseModel):
    host: str
    lines: list[NodeLine] = Field(description="newest first")
