"""The service's background threads: the diagnosis timers and the actor.

- `Timer` runs a callback for a job at a given time (the debounced early diagnosis, the hang
  checks): one thread, one heap, so a thousand open jobs cost one thread.
- `Actor` turns diagnosis changes into effects, one at a time and in order: the actions and the
  alert (`logdx.act.respond`, the same path as `logdx run`), then it records that the diagnosis
  was acted on; "resolved" follow-ups when a job succeeds; and, every
  `actions.health_check_interval_s`, the health checks that uncordon nodes. Effects leave the
  request path: a slow Kubernetes API never holds up an upload.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from logdx.act.capsule import Evidence
from logdx.act.policy import RestartVerdict
from logdx.act.report import DegradationBlock, Report
from logdx.act.respond import Responder, Response

log = logging.getLogger("logdx.api")


class Timer:
    def __init__(self, callback: Callable[[str], None], name: str = "logdx-timer") -> None:
        self._callback = callback
        self._heap: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Timer:
        self._thread.start()
        return self

    def schedule(self, key: str, delay_s: float) -> None:
        with self._cond:
            heapq.heappush(self._heap, (time.monotonic() + delay_s, next(self._seq), key))
            self._cond.notify()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop:
                    now = time.monotonic()
                    if self._heap and self._heap[0][0] <= now:
                        break
                    self._cond.wait(None if not self._heap else self._heap[0][0] - now)
                if self._stop:
                    return
                _, _, key = heapq.heappop(self._heap)
            try:
                self._callback(key)
            except Exception:
                log.exception("scheduled diagnosis of job %s failed", key)


@dataclass(slots=True)
class Effect:
    """A diagnosis change to act on (or, with `resolved`, a job that succeeded after failing)."""

    job_id: str
    report: Report | None
    key: str
    verdict: RestartVerdict | None = None  # the job's history (`logdx.act.policy.restart_verdict`)
    seen_hosts: tuple[str, ...] = ()  # the job's hosts: nodes the cluster-wide breaker knows
    resolved: str = ""  # why the failures of `resolved_jobs` are over
    resolved_jobs: tuple[str, ...] = field(default_factory=tuple)
    evidence: Evidence | None = None  # the job's recent lines, for the evidence capsule before a cordon
    # A healthy job: the nodes it ran on that a sender who may speak for them named, and for how long (grades).
    healthy: Report | None = None
    healthy_hosts: tuple[str, ...] = ()
    runtime_s: float = 0.0
    advice: tuple[DegradationBlock, ...] = ()  # a running job's start-up degradations not advised yet: an alert only


class Actor:
    """Alerts and actions for each diagnosis change, in order, off the request path."""

    def __init__(self, responder: Responder, on_done: Callable[[Effect, Response], None]) -> None:
        self._responder = responder
        self._on_done = on_done
        self._queue: queue.Queue[Effect | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="logdx-actor", daemon=True)
        self._health_every = responder.actions.settings.health_check_interval_s
        self._next_health = time.monotonic() + self._health_every

    def start(self) -> Actor:
        self._thread.start()
        return self

    def submit(self, effect: Effect) -> None:
        self._queue.put(effect)

    def stop(self, timeout: float = 10.0) -> None:
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            try:
                effect = self._queue.get(timeout=max(0.0, self._next_health - time.monotonic()))
            except queue.Empty:
                self._health_checks()
                continue
            if effect is None:
                return
            try:
                self._act(effect)
            except Exception:
                log.exception("acting on the diagnosis of job %s failed", effect.job_id)

    def _act(self, effect: Effect) -> None:
        if effect.healthy is not None and effect.healthy_hosts:
            self._responder.credit(effect.job_id, effect.healthy, effect.healthy_hosts, effect.runtime_s)
        if effect.advice:
            self._responder.advise(effect.job_id, effect.advice)
            return
        if effect.resolved:
            for job_id in effect.resolved_jobs:
                self._responder.resolved_job(job_id, effect.resolved)
            return
        assert effect.report is not None
        response = self._responder.respond(effect.job_id, effect.report, verdict=effect.verdict,
                                           seen_hosts=effect.seen_hosts, evidence=effect.evidence)
        self._on_done(effect, response)

    def _health_checks(self) -> None:
        """Uncordon the nodes whose health check passes (`actions.health_check_command`)."""
        self._next_health = time.monotonic() + self._health_every
        try:
            self._responder.health_checks()
        except Exception:
            log.exception("node health checks failed")
