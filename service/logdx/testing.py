"""Helpers for testing code that uses logdx (shipped with it, like `structlog.testing`).

    from logdx.testing import Clock, failed_report
"""

from __future__ import annotations

from typing import Any

from logdx.act.report import CompressionFigures, Culprits, Report, RootCause

__all__ = ["Clock", "failed_report"]


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
