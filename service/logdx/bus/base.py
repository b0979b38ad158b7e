"""The line bus between ingestion and diagnosis, as the service sees it (one Protocol).

Implementations: `jetstream.JetStreamBus` (NATS JetStream, `bus.url`). Without a bus, each job's
spool file is its durable log (`logdx.api.spool`), read by the one process that serves the job.
A new transport implements these two classes in one module of this package.
"""

from __future__ import annotations

from typing import Protocol

from logdx.bus.records import BusRecord


class PartitionReader(Protocol):
    """One partition's records, in stream order, for its one owner."""

    def fetch(self, max_records: int, timeout_s: float) -> list[tuple[int, BusRecord]]:
        """The next records after those fetched before, with their stream sequence; [] when none
        arrived within `timeout_s`."""
        ...

    def ack(self, seq: int) -> None:
        """Everything up to `seq` is applied and saved (a snapshot): the bus need not deliver it again."""
        ...

    def pending(self) -> int:
        """Records of the partition not yet fetched (its lag)."""
        ...

    def close(self) -> None: ...


class LineBus(Protocol):
    partitions: int

    def publish(self, record: BusRecord, msg_id: str) -> int:
        """Durably append `record` to its job's partition; returns its stream sequence. Publishing
        the same `msg_id` again within the duplicate window returns the first one's sequence."""
        ...

    def get(self, seq: int) -> BusRecord | None:
        """A record by its sequence (a restored owner re-reads a request's DATA at its END)."""
        ...

    def open_partition(self, partition: int, after_seq: int) -> PartitionReader:
        """Read `partition` from `after_seq + 1` on; whoever read it before stops getting records."""
        ...

    def lag(self, partition: int) -> int | None:
        """Records of `partition` its owner has not fetched yet (None when unknown)."""
        ...

    def close(self) -> None: ...
