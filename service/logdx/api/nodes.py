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

from logdx.access.auth import OPERATE, READ, Principal, audit_name
from logdx.act.actuators import NodeName
from logdx.api.deps import ServicesDep, permit, require_token
from logdx.wire.errors import ApiError, ErrorBody
from logdx.wire.nodes import (
    ActionOut,
    ActionsOut,
    CostList,
    NodeLines,
    NodeList,
    NodeOut,
    ResetRequest,
    UncordonRequest,
)

__all__ = ["nodes_router"]

_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorBody} for code in (400, 401, 403, 404, 422)}
nodes_router = APIRouter(prefix="/v1", dependencies=[Depends(require_token)], responses=_ERRORS)

NodeParam = Annotated[str, Path(max_length=253, description="one plain host name", examples=["gpu-node-07"])]


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
