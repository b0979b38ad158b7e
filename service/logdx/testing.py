"""Helpers for testing code that uses logdx (shipped with it, like `structlog.testing`).

    from logdx.testing import Clock, cpu_seconds, failed_report, wait_until
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from logdx.act.report import CompressionFigures, Culprits, Report, RootCause

__all__ = ["Clock", "CpuSeconds", "cpu_seconds", "failed_report", "wait_until"]

T = TypeVar("T")


class Clock:
    """A clock the test moves by hand (`clock.t += 60`), for code that takes `clock=time.time`."""

    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def failed_report(hosts: tuple[str, ...] = ("node-17",), line_no: int = 33, **overrides: Any) -> Report:
    """A sure infrastructure diagnosis (a GPU fell off the bus on `hosts[0]`, rank 3, the host printed
    it: corroborated) that asks for `cordon_and_restart`; `overrides` replace any field of the report."""
    fields: dict[str, Any] = dict(
        status="failed", category="infrastructure", failure_type="gpu_fell_off_bus", action="cordon_and_restart",
        confidence=0.97, culprits=Culprits(hosts=list(hosts), ranks=[3], corroborated=bool(hosts),
                                           basis="the root line's own host" if hosts else ""),
        root_cause=RootCause(line_no=line_no, text="NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",
                             rank=3, host=hosts[0] if hosts else None),
        evidence=[], explanation="GPU fell off the bus.", hint="Drain the node.",
        compression=CompressionFigures(lines_in=40, templates=8, lines_kept=40), timings_ms={},
    )
    fields.update(overrides)
    return Report(**fields)


class CpuSeconds:
    """CPU-seconds spent in a block, for bounding work where wall time would measure the machine's
    load instead: `with cpu_seconds() as cpu: work()` then `assert cpu.seconds < 2`.

    Counts the calling thread by default (other threads of the test process, a server fixture's,
    do not count); `process=True` counts every thread of the process (work that fans out)."""

    def __init__(self, process: bool = False) -> None:
        self._clock = time.process_time if process else time.thread_time
        self._start = 0.0
        self.seconds = 0.0

    def __enter__(self) -> CpuSeconds:
        self._start = self._clock()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = self._clock() - self._start


def cpu_seconds(process: bool = False) -> CpuSeconds:
    return CpuSeconds(process)


def wait_until(condition: Callable[[], T], what: str, timeout: float = 120.0, interval: float = 0.02) -> T:
    """Poll `condition` until it returns something truthy, and return that. The deadline is there
    only to fail a test that hangs: make it generous, never a measure of speed."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)
