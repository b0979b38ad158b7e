"""Nodes and actions: what logdx knows about the cluster's nodes, and the safety switches.

- `GET /v1/nodes`: every node seen in job logs, most recently blamed first: state (ok | cordoned),
  how many events, by which jobs (`blamed_by_several_jobs`), the latest events, and the grade (ok | suspect |
  avoid | exclude) with its reason: which blames set it, when, and the healthy runtime still due before it decays.
- `GET /v1/nodes/{node}`, `POST /v1/nodes/{node}/uncordon` (a person's all-clear, audited).
- `GET /v1/actions`: dry run or not, the actuator, the circuit breaker, the budget used, the audit.
- `POST /v1/actions/reset`: close the circuit breaker (a person, audited).
- `GET /v1/costs`: the GPU-hours failed jobs lost since their last checkpoint, by cause, node or category.

The same as `logdx nodes` and `logdx actions` on the command line, over the same database.

Nodes are the cluster's, shared by every tenant's jobs (their histories name those jobs, their streams
hold what every job on them printed): these views and actions need a token without a tenant. A
tenant's token sees a culprit node's history on its job's page, with its own jobs only.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path, Query
from pydantic import BaseModel, ConfigDict, Field

from logdx.act.actuators import NodeName
from logdx.api.auth import OPERATE, READ, Principal, audit_name
from logdx.api.deps import ServicesDep, permit, require_token
from logdx.api.errors import ApiError, ErrorBody
from logdx.config import actuator_choices, choices_schema

__all__ = ["nodes_router"]

_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorBody} for code in (400, 401, 403, 404, 422)}
nodes_router = APIRouter(prefix="/v1", dependencies=[Depends(require_token)], responses=_ERRORS)

NodeParam = Annotated[str, Path(max_length=253, description="one plain host name", examples=["gpu-node-07"])]


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


def _node(name: str) -> NodeName:
    try:
        return NodeName(name)
    except ValueError:
        raise ApiError(400, "invalid_node", "a node is one plain host name (letters, digits, '-', '.')") from None


@nodes_router.get("/nodes", response_model=NodeList, tags=["nodes"], dependencies=[Depends(permit(READ, "read nodes", cluster_wide=True))],
                  summary="Nodes seen in job logs, what was blamed on them, which are cordoned")
def list_nodes(services: ServicesDep, blamed_only: bool = False,
               limit: Annotated[int, Query(ge=1, le=10_000)] = 500) -> dict[str, Any]:
    nodes = services.responder.actions.nodes.list(blamed_only=blamed_only, limit=limit)
    return {"nodes": [n.to_dict() for n in nodes], "count": len(nodes)}


@nodes_router.get("/costs", response_model=CostList, tags=["nodes"],
                  dependencies=[Depends(permit(READ, "read nodes", cluster_wide=True))],
                  summary="GPU-hours lost to failures since their last checkpoint (logdx costs)")
def list_costs(services: ServicesDep, by: Literal["cause", "node", "category"] = "cause",
               since_s: Annotated[float | None, Query(gt=0, le=10 * 365 * 86400,
                                                      description="only the last since_s seconds")] = None,
               limit: Annotated[int, Query(ge=1, le=10_000)] = 100) -> dict[str, Any]:
    costs = services.responder.costs
    since = time.time() - since_s if since_s is not None else None
    jobs, hours, unknown = costs.total(since)
    return {"by": by, "since": since, "failed_jobs": jobs, "lost_gpu_hours": hours, "unknown": unknown,
            "groups": [r.to_dict() for r in costs.rollup(by, since, limit=limit)]}


@nodes_router.get("/nodes/{node}", response_model=NodeOut, tags=["nodes"], summary="One node and its history",
                  dependencies=[Depends(permit(READ, "read nodes", cluster_wide=True))])
def get_node(node: NodeParam, services: ServicesDep) -> dict[str, Any]:
    info = services.responder.actions.nodes.get(_node(node))
    if info is None:
        raise ApiError(404, "node_not_found", f"logdx has not seen node {node!r}")
    return info.to_dict()


class NodeLine(BaseModel):
    ts: float = Field(description="the line's time (its record's, else its arrival)")
    received_at: float
    notable: bool = Field(description="a rule could match it: it joins the jobs that ran on the node")
    text: str


class NodeLines(BaseModel):
    host: str
    lines: list[NodeLine] = Field(description="newest first")


@nodes_router.get("/nodes/{node}/logs", response_model=NodeLines, tags=["nodes"],
                  summary="The node's own lines (kernel, journald, syslog) kept in its node stream",
                  dependencies=[Depends(permit(READ, "read nodes", cluster_wide=True))])
def get_node_logs(node: NodeParam, services: ServicesDep,
                  limit: Annotated[int, Query(ge=1, le=10_000)] = 200) -> dict[str, Any]:
    host = str(_node(node))
    lines = services.nodes.streams.lines_of(host, limit) if services.nodes is not None else []
    return {"host": host, "lines": lines}


Operator = Annotated[Principal, Depends(permit(OPERATE, "act on the cluster (uncordon, breaker reset)", cluster_wide=True))]


def _why(reason: str, note: str) -> str:
    return "; ".join(part for part in (reason.strip(), note) if part)


@nodes_router.post("/nodes/{node}/uncordon", response_model=ActionOut, tags=["nodes"],
                   summary="Put a node back into scheduling (a person's all-clear; audited; operator)")
def uncordon(node: NodeParam, body: UncordonRequest, services: ServicesDep, principal: Operator) -> dict[str, Any]:
    name = _node(node)
    if services.responder.actions.nodes.get(name) is None:
        raise ApiError(404, "node_not_found", f"logdx has not seen node {node!r}")
    who, note = audit_name(principal, body.by)
    return services.responder.uncordon(name, who, _why(body.reason, note)).to_dict()


@nodes_router.get("/actions", response_model=ActionsOut, tags=["actions"], dependencies=[Depends(permit(READ, "read actions", cluster_wide=True))],
                  summary="Dry run, breaker, budget, and the latest audited actions")
def actions_status(services: ServicesDep, limit: Annotated[int, Query(ge=0, le=10_000)] = 100) -> dict[str, Any]:
    actions = services.responder.actions
    out = actions.status().to_dict()
    out["audit"] = [r.to_dict() for r in actions.audit(limit=limit)] if limit else []
    return out


@nodes_router.post("/actions/reset", response_model=ActionOut, tags=["actions"],
                   summary="Close the circuit breaker (a person decided the cluster is fine; audited; operator)")
def reset_breaker(body: ResetRequest, services: ServicesDep, principal: Operator) -> dict[str, Any]:
    who, note = audit_name(principal, body.by)
    return services.responder.actions.reset_breaker(who, _why(body.note, note)).to_dict()
