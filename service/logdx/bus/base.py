"""The line bus between ingestion and diagnosis, as the service sees it (one Protocol).

Implementations: `jetstream.JetStreamBus` (NATS JetStream, `bus.url`). Without a bus, each job's
spool file is its durable log (`logdx.jobs.spool`), read by the one process that serves the job.
A new transport implements these two classes in one module of this package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from logdx.bus.records import BusRecord

__all__ = ["BusError", "BusFull", "BusUsage", "LineBus", "PartitionReader"]


class BusError(RuntimeError):
    """The bus cannot be reached, did not answer in time, or refused a record."""


class BusFull(BusError):
    """The bus refuses new records: its stream (or the server's store) is full."""


@dataclass(frozen=True, slots=True)
class BusUsage:
    """What the stream holds now: its records, their bytes, its limit (0: none of its own), and the
    sequences of its first and last records (first = last + 1 when it is empty)."""

    records: int
    bytes: int
    max_bytes: int
    first_seq: int
    last_seq: int
    created: str = ""  # when the stream was created: another value means another stream

    def free(self) -> int | None:
        """Bytes left before the stream refuses records (None: it has no limit of its own)."""
        return max(0, self.max_bytes - self.bytes) if self.max_bytes > 0 else None


class PartitionReader(Protocol):
    """One partition's records, in stream order, for its one owner."""

    def fetch(self, max_records: int, timeout_s: float) -> list[tuple[int, BusRecord]]:
        """The next records after those fetched before, with their stream sequence; [] when none
        arrived within `timeout_s` (or the bus is unreachable: the owner keeps the partition and
        asks again)."""
        ...

    def ack(self, seq: int) -> None:
        """Everything up to `seq` is applied and saved (a snapshot): the bus need not deliver it again."""
        ...

    def caught_up_to(self) -> int | None:
        """A stream sequence through which every record of the partition has been fetched (the
        stream's last when nothing is left to fetch), or None when records are still coming."""
        ...

    def pending(self) -> int:
        """Records of the partition not yet fetched (its lag)."""
        ...

    def close(self) -> None: ...


class LineBus(Protocol):
    partitions: int

    @property
    def connected(self) -> bool:
        """Whether the bus is reachable now (as far as the client knows)."""
        ...

    def publish(self, record: BusRecord, msg_id: str) -> int:
        """Durably append `record` to its job's partition; returns its stream sequence. Publishing
        the same `msg_id` again within the duplicate window returns the first one's sequence.
        Raises `BusFull` when the stream refuses records, `BusError` when it cannot be reached."""
        ...

    def has_room(self, nbytes: int) -> bool:
        """Whether a record of `nbytes` may go in and still leave the reserve for END and FIN
        records (`bus.reserve_bytes`)."""
        ...

    def usage(self, max_age_s: float = 1.0) -> BusUsage | None:
        """The stream's usage, at most `max_age_s` old (None when it cannot be read)."""
        ...

    def purge_before(self, seq: int) -> None:
        """Drop every record of the stream before `seq` (they are saved, or no longer needed)."""
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
