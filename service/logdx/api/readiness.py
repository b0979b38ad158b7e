"""`/readyz`: named checks, each a function that says why the replica is not ready (None: ready).

A replica is ready when its engine is loaded and what it stands on answers: the database (a
`SELECT 1`, which with PostgreSQL fails within a second while the server is known to be down) and,
with several replicas, the line bus (NATS connected). While one is down the answer is 503
`not_ready` with every failing check and its reason, so that a load balancer sends uploads to
replicas that can take them; the replica itself keeps running and recovers on its own.

A new check is one function here and one line in `CHECKS`.
"""

from __future__ import annotations

from collections.abc import Callable

from logdx.api.services import Services
from logdx.bus.base import BusError
from logdx.store_base import StoreError

__all__ = ["CHECKS", "failing_checks"]


def engine_loaded(services: Services) -> str | None:
    if services.engine is not None:
        return None
    if services.startup_error:
        return f"the engine failed to start: {services.startup_error}"
    return "the engine is still loading"


def store_reachable(services: Services) -> str | None:
    try:
        services.db.query_value("SELECT 1")
    except (StoreError, OSError) as e:
        return f"the database ({services.db.path}) is unreachable: {str(e).splitlines()[0][:200]}"
    return None


def bus_connected(services: Services) -> str | None:
    cluster = services.cluster
    if cluster is None:
        return None
    try:
        if not cluster.bus.connected:
            return f"not connected to NATS ({services.settings.bus.url})"
    except BusError as e:
        return f"the line bus is unreachable: {e}"
    return None


CHECKS: dict[str, Callable[[Services], str | None]] = {
    "engine": engine_loaded,
    "store": store_reachable,
    "bus": bus_connected,
}


def failing_checks(services: Services) -> dict[str, str]:
    """The checks that fail, with their reasons (empty: ready). Runs in a worker thread (it may wait
    on the database)."""
    out: dict[str, str] = {}
    for name, check in CHECKS.items():
        why = check(services)
        if why is not None:
            out[name] = why
    return out
