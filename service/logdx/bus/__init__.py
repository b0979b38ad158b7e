"""The line bus: how uploads reach the worker that owns their job when several replicas run.

`records` (what travels, partitions, names), `base` (the Protocol), `jetstream` (NATS JetStream),
`ownership` (which worker owns which partition: leases in PostgreSQL).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from logdx.bus.records import DATA, END, FIN, BusRecord, Names, partition_of

if TYPE_CHECKING:
    from logdx.bus.base import LineBus
    from logdx.config import BusSettings

__all__ = ["DATA", "END", "FIN", "BusRecord", "Names", "open_bus", "partition_of"]


def open_bus(settings: BusSettings, name: str = "logdx") -> LineBus:
    """The configured bus (`bus.url`), connected; raises `BusError` when it cannot be reached.
    (nats is imported here, not when the package is: the embedded service never loads it.)"""
    from logdx.bus.jetstream import JetStreamBus

    return JetStreamBus(settings, name=name)
