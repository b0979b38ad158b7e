"""What `/readyz` waits for: a list of named checks, each saying whether its part is ready and, if
not, why (one line an operator can act on) and how far it got.

Two kinds, one shape. A part the service loads once reports itself as it goes (`Component`: the
engine's rules, retrieval, the LLM). A dependency the service talks to is asked when `/readyz` is
(a probe: any callable returning `Check`). Both are added the same way:

    readiness = Readiness()
    rules = readiness.component("rules", "waiting to start")   # the loader calls rules.loading()/.ready()
    readiness.add("store", lambda: Check(ready=db_answers(), reason="PostgreSQL at ... refuses connections"))

The service is ready when every check is. A probe that raises is not ready, with the error as its
reason: one broken probe never hides the others.

What a replica stands on is probed the same way (`dependency_probes`): the database (a `SELECT 1`,
which with PostgreSQL fails within a second while the server is known to be down) and, with several
replicas, the line bus (NATS connected). While one is down the answer is 503 `not_ready` with every
failing check and its reason, so that a load balancer sends uploads to replicas that can take them;
the replica keeps running and recovers on its own. A new dependency is one probe there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # annotations only, and neither imports this module: no circle
    from logdx.bus.base import LineBus
    from logdx.config import Settings
    from logdx.store_base import Store

__all__ = ["Check", "Component", "Dependencies", "Probe", "Readiness", "dependency_probes"]


@dataclass(frozen=True, slots=True)
class Check:
    ready: bool
    reason: str = ""  # not ready: what it waits for; ready: what it has ("412 rules")
    progress: float | None = None  # 0..1 while loading, when known
    since_s: float | None = None  # seconds in its current state

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ready": self.ready, "reason": self.reason}
        if self.progress is not None:
            out["progress"] = round(self.progress, 3)
        if self.since_s is not None:
            out["since_s"] = round(self.since_s, 1)
        return out


Probe = Callable[[], Check]


@dataclass
class Component:
    """A part loaded once, reporting its own state (thread-safe); call it to read that state."""

    name: str
    reason: str = "waiting to start"
    ready: bool = False
    progress: float | None = None
    changed: float = field(default_factory=time.monotonic)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _set(self, ready: bool, reason: str, progress: float | None) -> None:
        with self._lock:
            if (ready, reason) != (self.ready, self.reason):
                self.changed = time.monotonic()
            self.ready, self.reason, self.progress = ready, reason, progress

    def loading(self, what: str, progress: float | None = None) -> None:
        self._set(False, what, progress)

    def done(self, what: str = "") -> None:
        self._set(True, what or "ready", None)

    def failed(self, why: str) -> None:
        self._set(False, f"failed: {why}", None)

    def __call__(self) -> Check:
        with self._lock:
            return Check(self.ready, self.reason, self.progress, time.monotonic() - self.changed)


class Readiness:
    def __init__(self) -> None:
        self._checks: dict[str, Probe] = {}
        self._lock = threading.Lock()

    def add(self, name: str, probe: Probe) -> None:
        """A check (replacing one of the same name): `probe()` says whether that part is ready."""
        with self._lock:
            self._checks[name] = probe

    def component(self, name: str, reason: str = "waiting to start") -> Component:
        """A part that reports itself (see `Component`), added as a check of that name."""
        part = Component(name, reason)
        self.add(name, part)
        return part

    def get(self, name: str) -> Probe | None:
        with self._lock:
            return self._checks.get(name)

    def checks(self) -> dict[str, Check]:
        """Every check's state now, in the order they were added."""
        with self._lock:
            probes = list(self._checks.items())
        out = {}
        for name, probe in probes:
            try:
                out[name] = probe()
            except Exception as e:  # noqa: BLE001 - a failing probe is a reason, not a crash
                out[name] = Check(False, f"check failed: {type(e).__name__}: {e}")
        return out

    @staticmethod
    def waiting_for(checks: dict[str, Check]) -> dict[str, str]:
        """The reason of each check that is not ready, with how far it got when known."""
        return {name: c.reason + (f" ({c.progress:.0%})" if c.progress is not None else "")
                for name, c in checks.items() if not c.ready}

    @staticmethod
    def summary(waiting: dict[str, str]) -> str:
        return "waiting for " + "; ".join(f"{name}: {reason}" for name, reason in waiting.items())


class _Cluster(Protocol):
    @property
    def bus(self) -> LineBus: ...


class Dependencies(Protocol):
    """What the probes look at (the service's `Services`): the settings, the store, the cluster if any."""

    @property
    def settings(self) -> Settings: ...

    @property
    def db(self) -> Store: ...

    @property
    def cluster(self) -> _Cluster | None: ...


def dependency_probes(services: Dependencies) -> dict[str, Probe]:
    """The probes of what the replica stands on: the store always, the line bus with several replicas."""
    from logdx.bus.base import BusError
    from logdx.store_base import StoreError

    def store() -> Check:
        try:
            services.db.query_value("SELECT 1")
        except (StoreError, OSError) as e:
            return Check(False, f"the database ({services.db.path}) is unreachable: {str(e).splitlines()[0][:200]}")
        return Check(True, "reachable")

    def bus() -> Check:
        cluster = services.cluster
        if cluster is None:
            return Check(True, "one replica: no bus")
        try:
            if not cluster.bus.connected:
                return Check(False, f"not connected to NATS ({services.settings.bus.url})")
        except BusError as e:
            return Check(False, f"the line bus is unreachable: {e}")
        return Check(True, "connected")

    return {"store": store, "bus": bus}
