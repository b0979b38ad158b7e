"""The line bus on NATS JetStream (`bus.url: nats://...`).

One stream, `PREFIX-lines`, subjects `PREFIX.lines.<partition>`, file storage, kept `bus.max_age_s`
at most, with JetStream's duplicate window (`bus.duplicate_window_s`): a record published again
with the same message id (`Nats-Msg-Id`: job, request, piece) is stored once.

Each partition has one durable pull consumer, `PREFIX-p<partition>`, acked "all up to here" when
the owner has saved a snapshot that holds those records. A new owner deletes it and creates it again
starting after the last snapshot: the old owner, if it still runs, stops getting records (a fence
on the bus side; the lease epoch in PostgreSQL is the other), and the new one re-reads in stream
order exactly what the snapshot does not hold.

nats-py is asyncio; the service calls it from worker threads. The client runs on an event loop of its
own in a daemon thread, and every call waits for its result there (`_call`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import nats
from nats.errors import TimeoutError as NatsTimeout
from nats.js import api
from nats.js.errors import NotFoundError

from logdx.bus.records import BusRecord, Names, decode, encode, partition_of
from logdx.config import BusSettings

log = logging.getLogger("logdx.bus")
T = TypeVar("T")

__all__ = ["BusError", "JetStreamBus"]

_CALL_TIMEOUT_S = 30.0
_ACK_WAIT_S = 3600.0  # acks come with snapshots; an unacked record is re-read only by a new owner


class BusError(RuntimeError):
    """The bus cannot be reached or refused a record."""


class JetStreamBus:
    def __init__(self, settings: BusSettings, name: str = "logdx") -> None:
        self.settings = settings
        self.names = Names(settings.prefix)
        self.partitions = settings.partitions
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="logdx-nats", daemon=True)
        self._thread.start()
        try:
            self._call(self._connect(name), timeout=15.0)
        except Exception:
            self._stop_loop()
            raise

    # -- plumbing ---------------------------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float = _CALL_TIMEOUT_S) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except TimeoutError as e:
            future.cancel()
            raise BusError(f"NATS did not answer within {timeout:g} s") from e
        except (nats.errors.Error, OSError) as e:
            raise BusError(f"NATS: {type(e).__name__}: {e}") from e

    async def _connect(self, name: str) -> None:
        await _reachable(self.settings.url)
        self.nc = await nats.connect(self.settings.url, name=name, connect_timeout=5, reconnect_time_wait=0.5,
                                     max_reconnect_attempts=-1, allow_reconnect=True, error_cb=_log_error,
                                     disconnected_cb=_log_disconnected, reconnected_cb=_log_reconnected)
        self.js = self.nc.jetstream(timeout=10)
        config = api.StreamConfig(
            name=self.names.stream, subjects=[self.names.subjects], retention=api.RetentionPolicy.LIMITS,
            storage=api.StorageType.FILE, max_age=self.settings.max_age_s,
            duplicate_window=self.settings.duplicate_window_s, discard=api.DiscardPolicy.OLD,
        )
        try:
            await self.js.stream_info(self.names.stream)
            await self.js.update_stream(config)
        except NotFoundError:
            await self.js.add_stream(config)

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def close(self) -> None:
        try:
            self._call(self.nc.drain(), timeout=10.0)
        except Exception:  # noqa: BLE001 - closing: nothing left to do about it
            pass
        self._stop_loop()

    # -- publishing -------------------------------------------------------------------------------

    def publish(self, record: BusRecord, msg_id: str) -> int:
        subject = self.names.subject(partition_of(record.job_id, self.partitions))
        ack = self._call(self.js.publish(subject, encode(record), headers={"Nats-Msg-Id": msg_id}))
        return int(ack.seq)

    def get(self, seq: int) -> BusRecord | None:
        try:
            msg = self._call(self.js.get_msg(self.names.stream, seq))
        except BusError as e:
            if isinstance(e.__cause__, NotFoundError):
                return None
            raise
        return decode(msg.data or b"")

    # -- reading ----------------------------------------------------------------------------------

    def open_partition(self, partition: int, after_seq: int) -> Reader:
        return Reader(self, partition, after_seq)

    def lag(self, partition: int) -> int | None:
        try:
            info = self._call(self.js.consumer_info(self.names.stream, self.names.consumer(partition)), timeout=5.0)
        except BusError:
            return None
        return int(info.num_pending or 0)


async def _reachable(url: str) -> None:
    """Fail at once, in one line, when nothing listens (the client would retry forever, loudly)."""
    from urllib.parse import urlparse

    u = urlparse(url)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(u.hostname or "127.0.0.1", u.port or 4222), 5)
    except (OSError, TimeoutError) as e:
        raise BusError(f"cannot connect to {u.hostname}:{u.port or 4222}: {e}") from None
    writer.close()


async def _log_error(e: Exception) -> None:
    log.warning("NATS: %s: %s", type(e).__name__, e)


async def _log_disconnected() -> None:
    log.warning("NATS: disconnected; reconnecting")


async def _log_reconnected() -> None:
    log.info("NATS: reconnected")


class Reader:
    """One partition's durable consumer, created anew from `after_seq + 1` (see the module docstring)."""

    def __init__(self, bus: JetStreamBus, partition: int, after_seq: int) -> None:
        self.bus = bus
        self.partition = partition
        self._last: tuple[int, Any] | None = None  # the last record fetched, to ack through it
        self._sub = bus._call(self._open(after_seq))

    async def _open(self, after_seq: int) -> Any:
        js, names = self.bus.js, self.bus.names
        durable = names.consumer(self.partition)
        try:
            await js.delete_consumer(names.stream, durable)
        except NotFoundError:
            pass
        config = api.ConsumerConfig(
            durable_name=durable, ack_policy=api.AckPolicy.ALL, ack_wait=_ACK_WAIT_S, max_ack_pending=-1,
            filter_subject=names.subject(self.partition),
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE if after_seq else api.DeliverPolicy.ALL,
            opt_start_seq=after_seq + 1 if after_seq else None,
        )
        await js.add_consumer(names.stream, config)
        return await js.pull_subscribe_bind(durable=durable, stream=names.stream)

    def fetch(self, max_records: int, timeout_s: float) -> list[tuple[int, BusRecord]]:
        try:
            msgs = self.bus._call(self._fetch(max_records, timeout_s), timeout=timeout_s + _CALL_TIMEOUT_S)
        except BusError as e:
            if isinstance(e.__cause__, NatsTimeout | TimeoutError):
                return []
            raise
        out: list[tuple[int, BusRecord]] = []
        for msg in msgs:
            seq = int(msg.metadata.sequence.stream)
            self._last = (seq, msg)
            try:
                out.append((seq, decode(msg.data)))
            except ValueError as e:
                log.warning("partition %d: record %d is not a logdx record (%s): skipped", self.partition, seq, e)
        return out

    async def _fetch(self, n: int, timeout_s: float) -> list[Any]:
        try:
            return await self._sub.fetch(n, timeout=timeout_s)
        except (TimeoutError, NatsTimeout):
            return []

    def ack(self, seq: int) -> None:
        last = self._last
        if last is None or last[0] != seq:
            return  # acks go with the last record fetched; an older one waits for the next snapshot
        self.bus._call(last[1].ack())

    def pending(self) -> int:
        lag = self.bus.lag(self.partition)
        return lag or 0

    def close(self) -> None:
        try:
            self.bus._call(self._sub.unsubscribe(), timeout=5.0)
        except Exception:  # noqa: BLE001 - the consumer may be gone already (taken over)
            pass
