"""`GET /v1/cluster`: the replicas, the partitions of the line bus, their owners and lag."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from logdx.access.auth import READ
from logdx.api.deps import ServicesDep, permit

cluster_router = APIRouter(prefix="/v1", dependencies=[Depends(permit(READ, "read the cluster's state", cluster_wide=True))], tags=["cluster"])


@cluster_router.get("/cluster", summary="Replicas, partitions, owners and lag (one replica without a bus)")
async def get_cluster(services: ServicesDep) -> dict[str, Any]:
    cluster = services.cluster
    if cluster is None:
        return {"replica": "local", "role": "all", "bus": None, "replicas": [], "partitions": [],
                "note": "one process: no line bus configured (bus.url)"}
    return await services.run(cluster.cluster)
