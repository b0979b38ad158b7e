"""The line bus on NATS JetStream (`bus.url: nats://...`).

One stream, `PREFIX-lines`, subjects `PREFIX.lines.<partition>`, file storage, with JetStream's
duplicate window (`bus.duplicate_window_s`): a record published again with the same message id
(`Nats-Msg-Id`: job, request, piece) is stored once.

Nothing acknowledged is dropped behind an owner's back. logdx creates the stream with a size
(`bus.max_bytes`, which NATS reserves on the server) and `discard: new`: when full it refuses new
records instead of dropping old ones, and uploads are answered 503 `bus_full`. Uploads stop short
of the limit (`bus.reserve_bytes` stays free) so that the small records that end an upload or a job
still go in: a full bus still lets `/end` make its diagnosis. A stream that exists keeps its limits
(they are the operator's, `nats stream edit`); logdx only makes it refuse rather than discard.
Records are not kept by age by default (`bus.max_age_s: 0`): they are purged as soon as every
owner has saved them (`purge_before`, driven by the owners' snapshots, `logdx.bus.ownership`).

Each partition has one durable pull consumer, `PREFIX-p<partition>`, acked "all up to here" when
the owner has saved a snapshot that holds those records. A new owner deletes it and creates it again
starting after the last snapshot: the old owner, if it still runs, stops getting records (a fence
on the bus side; the lease epoch in PostgreSQL is the other), and the new one re-reads in stream
order exactly what the snapshot does not hold.

Outages. The client does not buffer while disconnected (`pending_size=0`): a publish then fails at
once (`BusError`, an upload's 503 `bus_unavailable`), never after a long wait, and never reaches the
stream later behind the client's back. Every call waits at most `bus.timeout_s`. A reader whose
NATS is gone gets no records and asks again: its owner keeps the partition through the outage.

nats-py is asyncio; the service calls it from worker threads. The client runs on an event loop of its
own in a daemon thread, and every call waits for its result there (`_call`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import nats
from nats.errors import TimeoutError as NatsTimeout
from nats.js import api
from nats.js.errors import APIError, NotFoundError

from logdx.bus.base import BusError, BusFull, BusUsage
from logdx.bus.records import BusRecord, Names, decode, encode, partition_of
from logdx.config import BusSettings

log = logging.getLogger("logdx.bus")
T = TypeVar("T")

__all__ = ["BusError", "BusFull", "JetStreamBus"]

_ACK_WAIT_S = 3600.0  # acks come with snapshots; an unacked record is re-read only by a new owner
# JetStream's answers to a record it has no room for: insufficient resources, memory or storage
# resources exceeded, the stream's store refused it (maximum bytes or messages exceeded).
_FULL_CODES = frozenset({10023, 10028, 10047, 10077})
_WARN_EVERY_S = 30.0


class _Throttled:
    """A warning logged at most once per `every` seconds per key (NATS retries every half second)."""

    def __init__(self, every: float = _WARN_EVERY_S) -> None:
        self.every = every
        self._last: dict[str, float] = {}

    def warning(self, key: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -self.every) >= self.every:
            self._last[key] = now
            log.warning(msg, *args)


_throttled = _Throttled()


class JetStreamBus:
    def __init__(self, settings: BusSettings, name: str = "logdx") -> None:
        self.settings = settings
        self.names = Names(settings.prefix)
        self.partitions = settings.partitions
        self.timeout_s = settings.timeout_s
        self._usage: BusUsage | None = None
        self._usage_at = 0.0
        self._published = 0  # bytes this replica published since `_usage` was read
        self._usage_lock = threading.Lock()
        self._refreshing = threading.Lock()
        self._closing = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="logdx-nats", daemon=True)
        self._thread.start()
        try:
            self._call(self._connect(name), timeout=max(15.0, self.timeout_s))
        except Exception:
            self._stop_loop()
            raise

    # -- plumbing ---------------------------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        timeout = self.timeout_s if timeout is None else timeout
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except TimeoutError as e:
            future.cancel()
            raise BusError(f"NATS did not answer within {timeout:g} s") from e
        except APIError as e:
            if e.err_code in _FULL_CODES:
                raise BusFull(f"the stream refuses records ({e.description or 'full'})") from e
            raise BusError(f"NATS: {e}") from e
        except NatsTimeout as e:
            raise BusError(f"NATS did not answer within {timeout:g} s") from e
        except (nats.errors.Error, OSError) as e:
            raise BusError(f"NATS: {type(e).__name__}: {e}") from e

    async def _connect(self, name: str) -> None:
        await _reachable(self.settings.url)
        self.nc = await nats.connect(self.settings.url, name=name, connect_timeout=5, reconnect_time_wait=0.5,
                                     max_reconnect_attempts=-1, allow_reconnect=True, pending_size=0,
                                     error_cb=_log_error, disconnected_cb=self._disconnected,
                                     reconnected_cb=_log_reconnected)
        self.js = self.nc.jetstream(timeout=self.timeout_s)
        await self._ensure_stream()

    async def _ensure_stream(self) -> None:
        """Create the stream with logdx's settings, or take an existing one as it is, except that it
        must refuse new records when full rather than discard old ones."""
        s, name = self.settings, self.names.stream
        try:
            info = await self.js.stream_info(name)
        except NotFoundError:
            config = api.StreamConfig(
                name=name, subjects=[self.names.subjects], retention=api.RetentionPolicy.LIMITS,
                storage=api.StorageType.FILE, max_bytes=s.max_bytes or -1, max_age=s.max_age_s,
                duplicate_window=s.duplicate_window_s, discard=api.DiscardPolicy.NEW,
            )
            try:
                await self.js.add_stream(config)
            except APIError as e:
                if e.err_code in _FULL_CODES:
                    raise BusError(f"NATS cannot reserve bus.max_bytes ({s.max_bytes} bytes) for stream {name}: "
                                   "lower bus.max_bytes, or give the server's JetStream more storage "
                                   "(max_file_store)") from None
                raise
            log.info("stream %s created: at most %s, records kept %s, refuses new records when full", name,
                     f"{s.max_bytes} bytes" if s.max_bytes else "what the server's store allows",
                     f"{s.max_age_s:g} s at most" if s.max_age_s else "until saved")
            return
        config = info.config
        if config.discard != api.DiscardPolicy.NEW:
            config.discard = api.DiscardPolicy.NEW
            await self.js.update_stream(config)
            log.warning("stream %s discarded its oldest records when full, which can drop acknowledged lines "
                        "nobody saved yet: it now refuses new records instead (discard: new)", name)
        log.info("stream %s: its limits are the operator's: max_bytes %s, max_age %s s, max_msgs %s", name,
                 config.max_bytes, config.max_age, config.max_msgs)

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _disconnected(self) -> None:
        if not self._closing:
            log.warning("NATS: disconnected; reconnecting (uploads are answered 503 bus_unavailable meanwhile)")

    def close(self) -> None:
        self._closing = True
        try:
            self._call(self.nc.drain(), timeout=10.0)
        except Exception:  # noqa: BLE001 - closing: nothing left to do about it
            pass
        self._stop_loop()

    @property
    def connected(self) -> bool:
        return bool(self.nc.is_connected)

    # -- publishing -------------------------------------------------------------------------------

    def publish(self, record: BusRecord, msg_id: str) -> int:
        if not self.nc.is_connected:
            raise BusError(f"not connected to NATS at {self.settings.url} (reconnecting)")
        subject = self.names.subject(partition_of(record.job_id, self.partitions))
        data = encode(record)
        ack = self._call(self.js.publish(subject, data, headers={"Nats-Msg-Id": msg_id}))
        with self._usage_lock:
            self._published += len(data)
        return int(ack.seq)

    def has_room(self, nbytes: int) -> bool:
        usage = self.usage(max_age_s=0.5)
        if usage is None or usage.max_bytes <= 0:
            return True  # no limit of the stream's own: NATS refuses when its store is full
        reserve = min(self.settings.reserve_bytes, usage.max_bytes // 4)
        with self._usage_lock:
            free = usage.max_bytes - usage.bytes - self._published
        return free - nbytes >= reserve

    def usage(self, max_age_s: float = 1.0) -> BusUsage | None:
        with self._usage_lock:
            if self._usage is not None and time.monotonic() - self._usage_at <= max_age_s:
                return self._usage
            stale = self._usage
        if not self._refreshing.acquire(blocking=stale is None or max_age_s <= 0):
            return stale  # another thread is reading it
        try:
            try:
                info = self._call(self.js.stream_info(self.names.stream))
            except BusError as e:
                _throttled.warning("usage", "stream %s not readable: %s", self.names.stream, e)
                return None
            st, cfg = info.state, info.config
            created = getattr(info, "created", None)
            usage = BusUsage(records=int(st.messages or 0), bytes=int(st.bytes or 0),
                             max_bytes=max(0, int(cfg.max_bytes or 0)), first_seq=int(st.first_seq or 0),
                             last_seq=int(st.last_seq or 0), created=str(created or ""))
            with self._usage_lock:
                self._usage, self._usage_at, self._published = usage, time.monotonic(), 0
            return usage
        finally:
            self._refreshing.release()

    def purge_before(self, seq: int) -> None:
        if seq > 1:
            self._call(self.js.purge_stream(self.names.stream, seq=seq))
            with self._usage_lock:
                self._usage_at = 0.0  # read it again

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
            info = self._call(self.js.consumer_info(self.names.stream, self.names.consumer(partition)),
                              timeout=min(self.timeout_s, 5.0))
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
    _throttled.warning(f"error:{type(e).__name__}", "NATS: %s: %s", type(e).__name__, e)


async def _log_reconnected() -> None:
    log.warning("NATS: reconnected")


class Reader:
    """One partition's durable consumer, created anew from `after_seq + 1` (see the module docstring)."""

    def __init__(self, bus: JetStreamBus, partition: int, after_seq: int) -> None:
        self.bus = bus
        self.partition = partition
        self._last: tuple[int, Any] | None = None  # the last record fetched, to ack through it
        self._delivered = 0  # the consumer sequence of the last message fetched
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
        if not self.bus.connected:
            time.sleep(timeout_s)  # NATS is away: the partition stays ours, ask again
            return []
        try:
            msgs = self.bus._call(self._fetch(max_records, timeout_s), timeout=timeout_s + self.bus.timeout_s)
        except BusError as e:
            if isinstance(e.__cause__, NatsTimeout | TimeoutError) or not self.bus.connected:
                return []
            raise
        out: list[tuple[int, BusRecord]] = []
        for msg in msgs:
            seq = int(msg.metadata.sequence.stream)
            self._last = (seq, msg)
            self._delivered = max(self._delivered, int(msg.metadata.sequence.consumer))
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
        try:
            self.bus._call(last[1].ack())
        except BusError as e:
            _throttled.warning("ack", "partition %d: ack through record %d not sent (%s): the next snapshot "
                               "acks again", self.partition, seq, e)

    def caught_up_to(self) -> int | None:
        usage = self.bus.usage(max_age_s=0)  # the stream's last record, read before the consumer's state
        if usage is None:
            return None
        try:
            info = self.bus._call(self.bus.js.consumer_info(self.bus.names.stream,
                                                            self.bus.names.consumer(self.partition)))
        except BusError:
            return None
        if int(info.num_pending or 0) == 0 and int(info.delivered.consumer_seq or 0) == self._delivered:
            return usage.last_seq  # every record of the partition up to it was delivered, and fetched
        return None

    def pending(self) -> int:
        lag = self.bus.lag(self.partition)
        return lag or 0

    async def _disconnected(self) -> None:
        if not self._closing:
            log.warning("NATS: disconnected; reconnecting (uploads are answered 503 bus_unavailable meanwhile)")

    def close(self) -> None:
        self._closing = True
        try:
            self.bus._call(self._sub.unsubscribe(), timeout=5.0)
        except Exception:  # noqa: BLE001 - the consumer may be gone already (taken over)
            pass
