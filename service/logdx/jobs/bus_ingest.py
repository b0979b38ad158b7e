"""Uploads when several replicas run: any replica with role `ingest` or `all` publishes them to the
line bus, and the job's owner (`jobs/partitions.py`) applies them.

Ingestion (any replica with role `ingest` or `all`): an upload's lines are published to the job's
partition as DATA records as the body arrives, then one END record; the 2xx is sent once JetStream
acknowledged the END. Idempotency-Keys: the END carries the key, JetStream drops a record published
again within its duplicate window (the message ids are job/request/piece), `upload_keys` in
PostgreSQL answers retries after that, and the owner applies one END per key whatever happens.
`POST /end` publishes a FIN record and waits for the owner's final diagnosis.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from logdx.act.report import Report
from logdx.bus.base import BusError, BusFull, LineBus
from logdx.bus.ownership import Ownership
from logdx.bus.records import DATA, END, FIN, BusRecord
from logdx.jobs.budget import CpuBudget
from logdx.jobs.jobstate import IngestRequest, Job
from logdx.jobs.ports import CoordinatedJobs
from logdx.jobs.spool import encode_runs
from logdx.normalize import Source
from logdx.store_base import StoreError
from logdx.wire.errors import ApiError

log = logging.getLogger("logdx.cluster")

_END_POLL_S = 0.05
_ABORTS_KEPT = 10_000  # requests whose aborting END waits for the bus to come back


class BusIngest:
    """Publishes uploads and `/end` to the line bus (`ClusterCoordinator`'s ingestion side)."""

    def __init__(self, jobs: CoordinatedJobs, bus: LineBus, ownership: Ownership,
                 warn: Callable[..., None]) -> None:
        self.jobs = jobs
        self.settings = jobs.settings
        self.metrics = jobs.metrics
        self.bus = bus
        self.own = ownership
        self.replica = ownership.replica
        self._warn = warn  # rate-limited warnings (outages are retried several times a second)
        self._aborts: deque[tuple[str, str]] = deque(maxlen=_ABORTS_KEPT)  # (job, request) to end as aborted

    def _publish(self, record: BusRecord, msg_id: str) -> int:
        try:
            return self.bus.publish(record, msg_id)
        except BusFull as e:
            self._warn("full", "bus full: %s", e)
            raise self._bus_full(str(e)) from None
        except BusError as e:
            self._warn("publish", "bus publish failed: %s", e)
            raise ApiError(503, "bus_unavailable", f"the line bus did not take the lines ({e}); retry",
                           headers={"Retry-After": "2"}) from None

    def _bus_full(self, why: str) -> ApiError:
        wait = max(1, round(self.settings.bus.snapshot_interval_s))
        return ApiError(503, "bus_full", f"the line bus is full ({why}): new uploads are refused until its owners "
                        "have saved what it holds; /end still works", headers={"Retry-After": str(wait)})

    def publish_aborts(self) -> None:
        """End, as aborted, requests whose end could not be published: their DATA records would keep
        the stream from being purged for an hour. (Publishing it twice is harmless: same message id.)"""
        while self._aborts:
            job_id, req_id = self._aborts[0]
            try:
                self.bus.publish(BusRecord(END, job_id, {"r": req_id, "st": "aborted", "n": 0}), f"{job_id}/{req_id}/end")
            except BusError:
                return
            self._aborts.popleft()

    def spool_runs(self, job: Job, req: IngestRequest, runs: list[tuple[Source, list[bytes]]], lines: int) -> None:
        """Publish a piece of a request's lines (DATA records of at most `bus.max_message_bytes`)."""
        t0 = time.perf_counter()
        if job.state != "open":
            raise ApiError(409, "job_ended", f"job {job.id} has ended")
        for piece in _pieces(runs, self.settings.bus.max_message_bytes):
            meta, payload = encode_runs(piece, req.scope)
            if not self.bus.has_room(len(payload) + 1024):
                raise self._bus_full("less than bus.reserve_bytes left")
            self._publish(BusRecord(DATA, job.id, {"r": req.id, "i": self.replica, "at": time.time(), "s": meta},
                                    payload), f"{job.id}/{req.id}/{req.pieces}")
            req.pieces += 1
        req.lines += lines
        req.wrote = True
        self.metrics.stage.labels("publish").observe(time.perf_counter() - t0)

    def duplicate_of(self, job: Job, key: str) -> dict[str, Any] | None:
        if key in job.inflight_keys:
            raise ApiError(409, "request_in_progress", "a request with this Idempotency-Key is still being received")
        return self.own.committed_upload(job.id, key)

    def finish_request(self, job: Job, req: IngestRequest, ok: bool, budget: CpuBudget | None = None) -> dict[str, Any]:
        """Publish the request's END; once JetStream has it, the lines are accepted (a 2xx). A
        request that fails before its END is in (a bus or store outage) is ended as aborted later."""
        try:
            return self._finish_request(job, req, ok)
        except BaseException:
            if req.wrote and not req.ended:
                self._aborts.append((job.id, req.id))
            raise

    def _finish_request(self, job: Job, req: IngestRequest, ok: bool) -> dict[str, Any]:
        row = self.jobs.row(job.id) or {}
        known = int(row.get("lines") or 0)
        if ok and req.key is not None and self.own.committed_upload(job.id, req.key) is not None:
            ok, req.duplicate = False, True  # a retry whose first try committed meanwhile
        if ok:
            req.applied = req.lines
        result = req.result(known + req.applied)
        if req.wrote or (ok and req.key is not None):
            meta: dict[str, Any] = {"r": req.id, "st": "ok" if ok else "aborted", "n": req.applied, "p": req.pieces}
            if ok and req.key:
                meta["k"], meta["res"] = req.key, result
            try:
                self._publish(BusRecord(END, job.id, meta), f"{job.id}/{req.id}/end")
                req.ended = True
            except ApiError:
                if ok:
                    raise
                self._aborts.append((job.id, req.id))  # ended when the bus takes it
                req.ended = True
            if ok:
                self._acknowledged(job, req, result)
        if req.duplicate and req.key is not None:
            result = {**(self.own.committed_upload(job.id, req.key) or result), "duplicate": True}
        job.bytes += req.raw_bytes
        try:
            self.jobs.db.execute("UPDATE api_jobs SET bytes = bytes + ?, requests = requests + 1, updated_at = ?"
                            " WHERE job_id = ?", (req.raw_bytes, time.time(), job.id))
        except StoreError as e:
            if not (ok and req.ended):
                raise
            self._warn("figures", "job %s: request figures not counted (%s); its lines are in", job.id, e)
        job.bucket.take(req.applied)
        self.metrics.lines.labels(req.fmt).inc(req.applied)
        if req.truncated:
            self.metrics.truncated.inc(req.truncated)
        if req.refused:
            self.metrics.skipped.inc(req.refused)
        return result

    def _acknowledged(self, job: Job, req: IngestRequest, result: dict[str, Any]) -> None:
        """The END is in: the lines are accepted whatever happens next. Count them for the job's
        final check and keep the Idempotency-Key; when the store fails now, the 2xx still goes (the
        owner applies one END per key, and counts what it applies)."""
        try:
            self.own.acknowledged(job.id, req.applied, req.key, result)
        except StoreError as e:
            self._warn("acked", "job %s: an acknowledged upload not counted (%s)", job.id, e)

    def end(self, job: Job, exit_code: int | None) -> Report:
        """Publish FIN and wait for the job's owner to store the final diagnosis. The FIN carries the
        lines acknowledged so far: every one of them was published before it."""
        stored = self.jobs.stored_final(job)
        if stored is not None:
            return stored
        acked = self.own.acked_lines(job.id)
        self._publish(BusRecord(FIN, job.id, {"x": exit_code, "i": self.replica, "a": acked}), f"{job.id}/fin")
        deadline = time.monotonic() + self.settings.bus.end_timeout_s
        while time.monotonic() < deadline:
            if self.jobs.state_in_db(job.id) == "ended":
                self.jobs.unregister(job)
                stored = self.jobs.stored_final(job)
                assert stored is not None
                return stored
            time.sleep(_END_POLL_S)
        raise ApiError(503, "owner_unavailable",
                       f"no worker made job {job.id}'s final diagnosis within {self.settings.bus.end_timeout_s:g} s "
                       "(its partition is being taken over?); retry: the request is idempotent",
                       headers={"Retry-After": "5"})


def _pieces(runs: list[tuple[Source, list[bytes]]], limit: int) -> Iterator[list[tuple[Source, list[bytes]]]]:
    """Runs cut into pieces of about `limit` bytes of lines (a longer single line is a piece alone)."""
    piece: list[tuple[Source, list[bytes]]] = []
    size = 0
    for source, lines in runs:
        chunk: list[bytes] = []
        for line in lines:
            if size + len(line) > limit and (chunk or piece):
                if chunk:
                    piece.append((source, chunk))
                yield piece
                piece, chunk, size = [], [], 0
            chunk.append(line)
            size += len(line) + 1
        if chunk:
            piece.append((source, chunk))
    if piece:
        yield piece
