"""The service's two background threads: the diagnosis timer and the actor.

- `Timer` runs a callback for a job at a given time (the debounced early diagnosis): one thread,
  one heap, so a thousand open jobs cost one thread.
- `Actor` turns diagnosis changes into effects, one at a time and in order: enqueue the alert
  (the outbox dedupes per job and diagnosis), apply actions (dry-run by default), then record
  that the diagnosis was acted on. Effects leave the request path: a slow Kubernetes API never
  holds up an upload.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from logdx.act.report import Report

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
            except Exception:  # noqa: BLE001 - one job's failure must not stop the timer
                log.exception("scheduled diagnosis of job %s failed", key)


@dataclass(slots=True)
class Effect:
    job_id: str
    report: Report
    key: str


class Actor:
    """Alerts and actions for each diagnosis change, in order, off the request path."""

    def __init__(
        self,
        enqueue_alert: Callable[[str, Report], bool] | None,
        apply_actions: Callable[[str, Report], list[Any]] | None,
        on_done: Callable[[Effect, bool, list[Any]], None],
    ) -> None:
        self._enqueue_alert = enqueue_alert
        self._apply_actions = apply_actions
        self._on_done = on_done
        self._queue: queue.Queue[Effect | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="logdx-actor", daemon=True)

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
            effect = self._queue.get()
            if effect is None:
                return
            try:
                self._act(effect)
            except Exception:  # noqa: BLE001 - keep acting on the next diagnosis
                log.exception("acting on the diagnosis of job %s failed", effect.job_id)

    def _act(self, effect: Effect) -> None:
        queued = False
        records: list[Any] = []
        if self._enqueue_alert is not None:
            queued = self._enqueue_alert(effect.job_id, effect.report)
        if self._apply_actions is not None:
            records = list(self._apply_actions(effect.job_id, effect.report) or [])
        self._on_done(effect, queued, records)
