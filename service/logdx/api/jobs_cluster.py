"""Jobs when several replicas run (`bus.url` + `store.url`): the same `JobManager` interface, with
the line bus instead of the spool files and partitions owned by one worker at a time.

Ingestion (any replica with role `ingest` or `all`): an upload's lines are published to the job's
partition as DATA records as the body arrives, then one END record; the 2xx is sent once JetStream
acknowledged the END. Idempotency-Keys: the END carries the key, JetStream drops a record published
again within its duplicate window (the message ids are job/request/piece), `upload_keys` in
PostgreSQL answers retries after that, and the owner applies one END per key whatever happens.
`POST /end` publishes a FIN record and waits for the owner's final diagnosis.

Diagnosis (role `worker` or `all`): the coordinator thread heartbeats, renews its partitions' leases
and claims free ones up to its fair share (`logdx.bus.ownership`). Each owned partition has a thread
that reads its records in stream order and applies them to the jobs' sessions as the spool reader
does (DATA waits for its END; an END commits its request's lines, once per key; FIN ends the job),
then the usual machinery runs: early diagnosis 2 s after a root cause, hang checks, reports stored
and acted on through the job row's compare-and-set, alerts through the shared outbox. Every
`bus.snapshot_interval_s` the owner saves its changed sessions (`Session.snapshot()`) with the last
sequence each holds, marks the partition saved through its last record, and acks the bus. A new
owner restores those sessions (and re-arms the early diagnosis of a job that saw a root cause) and
re-reads the partition from after the snapshot; a record a session already holds is skipped by its
sequence: no accepted line is lost and none is applied twice.

Reads (any replica): a job's row, its figures and templates as its owner last saved them.

Faults (the README's "Running more than one replica" says what a client sees):

- No silent gap. The stream refuses records when full rather than dropping old ones
  (`logdx.bus.jetstream`), and nothing is purged before every partition saved it. An owner still
  checks: an END whose DATA records are missing, a stream that lost records after the partition's
  snapshot (or was replaced), a job whose acknowledged lines (counted per job by the ingest
  replicas, `bus_job_acks`) exceed the lines its owner applied when it ends. Each is logged as an
  error, counted (`logdx_bus_gaps_total`, `logdx_bus_lost_lines_total`), stored with the job
  (`GET /v1/jobs/{id}`: `bus_gaps`) and noted first in its reports; an upload whose lines are missing
  is never recorded as committed.
- Reclaim. After each snapshot the owner marks what its partition still needs (`keep_from`) and
  the stream is purged below the least of all partitions': it holds what was not saved yet, not
  history. Uploads are refused with 503 `bus_full` before the stream is full, so that END and FIN
  records still fit: a full bus lets `/end` through. Owners save sooner while the bus is half full.
- Outages. A store or bus error is a 503 with Retry-After (`store_unavailable`, `bus_unavailable`).
  A record that cannot be applied because PostgreSQL is down is applied again when it is back,
  never skipped; snapshots wait. The owner keeps its partitions through a NATS or PostgreSQL
  outage; after one, a replica takes over no other owner's partition for `bus.store_grace_s`
  (owners renew first) and treats no ingest replica as dead. A request whose end could not be
  published is ended (aborted) later, so its records do not pin the stream.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from logdx.act.report import Report
from logdx.api.errors import ApiError
from logdx.api.ingest import CpuBudget
from logdx.api.jobs import IngestRequest, Job, JobManager, summary_dict, templates_snapshot
from logdx.api.metrics import Metrics
from logdx.api.spool import decode_runs, encode_runs
from logdx.bus.base import BusError, BusFull, BusUsage, LineBus, PartitionReader
from logdx.bus.ownership import WORKER_ROLES, Claim, Ownership, SavedJob
from logdx.bus.records import DATA, END, FIN, BusRecord, partition_of
from logdx.config import Settings
from logdx.incidents import IncidentStore
from logdx.normalize import Source
from logdx.pipeline import Session, SnapshotError
from logdx.store import Store
from logdx.store_base import StoreError

log = logging.getLogger("logdx.cluster")

_FETCH = 512  # records per read
_FETCH_WAIT_S = 0.25
_END_POLL_S = 0.05
_COMMITTED_SAVED = 1000  # Idempotency-Keys kept in a saved session (upload_keys has them all)
_PENDING_MAX_AGE_S = 3600.0  # a request that never ended (its replica lost it) is dropped after this
_ABANDONED_AFTER_S = 60.0  # a replica silent this long (and 5 leases) died: its unfinished uploads are void
_ABORTS_KEPT = 10_000  # requests whose aborting END waits for the bus to come back
_RETRY_APPLY_S = 0.5  # a record that met a store outage is applied again after this
_BUSY_BUS = 0.5  # above this share of its size the bus is saved (and purged) every second
_WARN_EVERY_S = 30.0


class ClusterJobManager(JobManager):
    def __init__(self, settings: Settings, db: Store, incidents: IncidentStore, metrics: Metrics, bus: LineBus,
                 ownership: Ownership) -> None:
        super().__init__(settings, db, incidents, metrics)
        self.bus = bus
        self.own = ownership
        self.replica = ownership.replica
        self.role = settings.server.role
        self.partitions = settings.bus.partitions
        self._workers: dict[int, PartitionWorker] = {}
        self._workers_lock = threading.Lock()
        self._stop = threading.Event()
        self._coordinator: threading.Thread | None = None
        self.takeovers = 0
        self.applied_lines = 0  # fed to sessions of owned partitions (the work balance)
        self._aborts: deque[tuple[str, str]] = deque(maxlen=_ABORTS_KEPT)  # (job, request) to end as aborted
        self._store_down_since: float | None = None  # monotonic; set while this replica cannot reach the store
        self._store_back_at = -float("inf")  # monotonic: when it last came back
        self._purged_before = 0
        self._warned: dict[str, float] = {}
        self.own.heartbeat()

    # -- life cycle -----------------------------------------------------------------------------

    def start_cluster(self) -> None:
        """Start heartbeats and, on workers, partition ownership (call once the engine is attached)."""
        self._coordinator = threading.Thread(target=self._coordinate, name="logdx-cluster", daemon=True)
        self._coordinator.start()

    def close(self) -> None:
        self._stop.set()
        if self._coordinator is not None:
            self._coordinator.join(10)
        for worker in self.owned_workers():
            worker.stop(graceful=True)
        for worker in self.owned_workers():
            worker.join()
        try:
            self.own.stopped()
        except Exception:
            log.exception("could not record this replica's stop")
        super().close()

    def owned_workers(self) -> list[PartitionWorker]:
        with self._workers_lock:
            return list(self._workers.values())

    def owned(self) -> list[int]:
        with self._workers_lock:
            return sorted(self._workers)

    # -- the coordinator: heartbeats, leases, balance -----------------------------------------

    def _coordinate(self) -> None:
        interval = self.settings.bus.lease_s / 3
        while True:
            try:
                self._tick()
            except (StoreError, BusError) as e:
                self._warn("tick", "cluster coordination: %s (retrying every %.1f s)", e, interval)
            except Exception:
                log.exception("cluster coordination failed (retrying)")
            if self._stop.wait(interval):
                return

    def _warn(self, key: str, msg: str, *args: Any) -> None:
        """A warning at most every 30 s per kind (outages are retried several times a second)."""
        now = time.monotonic()
        if now - self._warned.get(key, -_WARN_EVERY_S) >= _WARN_EVERY_S:
            self._warned[key] = now
            log.warning(msg, *args)

    def store_failed(self) -> None:
        if self._store_down_since is None:
            self._store_down_since = time.monotonic()
            log.warning("store unreachable: partitions are kept, snapshots wait, records wait to be applied")

    def _store_reached(self) -> None:
        if self._store_down_since is not None:
            log.warning("store reachable again after %.1f s; no partition of another owner is taken for %g s",
                        time.monotonic() - self._store_down_since, self.settings.bus.store_grace_s)
            self._store_down_since = None
            self._store_back_at = time.monotonic()

    @property
    def store_settled(self) -> bool:
        """Whether the store has been reachable, without a break, for `bus.store_grace_s`: only then
        is a silent replica taken for dead (after an outage every owner needs time to renew)."""
        return (self._store_down_since is None
                and time.monotonic() - self._store_back_at >= self.settings.bus.store_grace_s)

    def _tick(self) -> None:
        try:
            self.own.heartbeat()
        except StoreError:
            self.store_failed()
            raise
        self._store_reached()
        self._publish_aborts()
        with self._workers_lock:
            owned = {p: w.epoch for p, w in self._workers.items() if not w.stopping}
        for p in self.own.renew(owned):
            log.warning("partition %d: lease lost (another worker owns it now)", p)
            lost = self._workers.get(p)
            if lost is not None:
                lost.stop(graceful=False)
        if self.role not in WORKER_ROLES or self.engine is None:
            return
        low, high = self.own.fair_share()
        if len(owned) < high:
            for p in self.own.claimable(held=self.store_settled):
                if len(self.owned()) >= high:
                    break
                if p in owned:
                    continue
                claim = self.own.claim(p)
                if claim is not None:
                    self._take(claim)
        extra = len(owned) - high if len(owned) > high else int(len(owned) > low and self.own.starved(low))
        for p in sorted(owned, reverse=True)[:extra]:
            log.info("partition %d: handed back for balance (%d owned, fair share %d..%d)", p, len(owned), low, high)
            worker = self._workers.get(p)
            if worker is not None:
                worker.stop(graceful=True)

    def _take(self, claim: Claim) -> None:
        t0 = time.perf_counter()
        try:
            usage = self.bus.usage(max_age_s=0)
            claim = self._check_stream_at_takeover(claim, usage)
            reader = self.bus.open_partition(claim.partition, claim.snapshot_seq)
        except (BusError, StoreError) as e:
            self._warn("take", "partition %d: not taken now (%s); handed back", claim.partition, e)
            try:
                self.own.release(claim.partition, claim.epoch)
            except StoreError:
                pass  # its lease runs out
            return
        worker = PartitionWorker(self, claim, reader)
        worker.stream_created = usage.created if usage is not None else ""
        with self._workers_lock:
            self._workers[claim.partition] = worker
        self.takeovers += 1
        restored = self._restore_partition(worker)
        if usage is not None and usage.first_seq > claim.snapshot_seq + 1:
            self._stream_lost_records(worker, claim.snapshot_seq, usage.first_seq)
        worker.start()
        for effect in self.unacted():
            if partition_of(effect.job_id, self.partitions) == claim.partition and self.actor is not None:
                log.info("job %s: acting on a diagnosis its previous owner stored", effect.job_id)
                self.actor.submit(effect)
        log.info("partition %d: owned (epoch %d) from record %d on, %d job session(s) restored in %.2fs",
                 claim.partition, claim.epoch, claim.snapshot_seq, restored, time.perf_counter() - t0)

    def _check_stream_at_takeover(self, claim: Claim, usage: BusUsage | None) -> Claim:
        """The saved position refers to this stream: else (the stream was replaced, or lost its
        newest records) the partition starts again from the stream's first record, and its open jobs
        are told that records may be missing."""
        if usage is None:
            raise BusError("the stream cannot be read")
        replaced = bool(claim.stream_created and usage.created and claim.stream_created != usage.created)
        if not replaced and usage.last_seq >= claim.snapshot_seq:
            return claim
        why = ("the stream was replaced" if replaced else
               f"the stream ends at record {usage.last_seq}, before this partition's saved position {claim.snapshot_seq}")
        jobs = self.own.reset_partition(claim.partition, claim.epoch)
        log.error("partition %d: %s: reading it again from its first record; what its %d open job(s) had "
                  "sent since their last snapshot may be lost", claim.partition, why, len(jobs))
        for job_id in jobs:
            self._gap(job_id, claim.partition, "stream_reset", None,
                      f"{why}: lines acknowledged before it and not yet saved may be missing")
        return Claim(claim.partition, claim.epoch, 0, "")

    def _stream_lost_records(self, worker: PartitionWorker, after: int, first: int) -> None:
        """Records after the partition's saved position were dropped from the stream (by its age limit,
        an operator's purge or limit): the partition's open jobs may miss lines."""
        if first <= worker.gap_reported_to:
            return
        worker.gap_reported_to = first
        rows = self.db.query("SELECT s.job_id FROM job_sessions s JOIN api_jobs j ON j.job_id = s.job_id"
                             " WHERE s.partition = ? AND j.state = 'open'", (worker.partition,))
        ids = {r["job_id"] for r in rows} | set(worker.jobs)
        log.error("partition %d: records %d..%d were removed from the stream before this partition's owner "
                  "saved them (an age limit, or an operator's purge or limit): %d open job(s) may miss lines",
                  worker.partition, after + 1, first - 1, len(ids))
        self.metrics.bus_gaps.labels("stream_lost_records").inc()
        for job_id in sorted(ids):
            self._gap(job_id, worker.partition, "stream_lost_records", None,
                      f"records {after + 1}..{first - 1} of the line bus were removed before they were saved")

    def _gap(self, job_id: str, partition: int, kind: str, lines: int | None, detail: str) -> None:
        """Tell what an owner found missing: the error log, the metrics, the job's state and reports."""
        if lines is not None:
            log.error("job %s: %d acknowledged line(s) missing from the diagnosis: %s", job_id, lines, detail)
            self.metrics.bus_lost_lines.inc(lines)
        self.metrics.bus_gaps.labels(kind).inc()
        self.own.record_gap(job_id, partition, kind, lines, detail)

    def _restore_partition(self, worker: PartitionWorker) -> int:
        """Load the partition's open jobs that have a saved session, so an early diagnosis that was
        due (or a hang) is not forgotten while no new line arrives."""
        rows = self.db.query("SELECT s.job_id FROM job_sessions s JOIN api_jobs j ON j.job_id = s.job_id"
                             " WHERE s.partition = ? AND j.state = 'open' ORDER BY j.updated_at DESC LIMIT ?",
                             (worker.partition, self.settings.server.max_sessions))
        n = 0
        for r in rows:
            job = self.get(r["job_id"])
            if job is not None and job.state == "open":
                with job.tlock:
                    self._owned_session(job, worker)
                n += 1
        return n

    def _worker_stopped(self, worker: PartitionWorker) -> None:
        """A partition's thread ended (lost, handed back, or shutting down): drop its sessions."""
        with self._workers_lock:
            if self._workers.get(worker.partition) is worker:
                del self._workers[worker.partition]
        for job_id in list(worker.jobs):
            job = self._jobs.get(job_id)
            if job is None:
                continue
            with job.tlock:
                self._drop_session(job)
                job.bus_seq = 0
                job.bus_pending = {}
                job.bus_data = {}

    # -- applying records (the partition's thread) -----------------------------------------------

    def apply(self, worker: PartitionWorker, seq: int, rec: BusRecord) -> None:
        job = self.get(rec.job_id)
        if job is None or job.state != "open":
            return  # an unknown or ended job: what follows its end is not part of it
        with job.tlock:
            session = self._owned_session(job, worker)
            if seq <= job.bus_seq:
                return  # the saved session holds it already
            if rec.kind == DATA:
                pending = job.bus_pending.setdefault(rec.meta.get("r", ""), {"i": rec.meta.get("i", ""),
                                                                            "at": rec.meta.get("at", time.time()),
                                                                            "seqs": []})
                pending["seqs"].append(seq)
                job.bus_data[seq] = rec
            elif rec.kind == END:
                self._apply_end(job, session, rec, worker.partition)
            elif rec.kind == FIN:
                self._apply_fin(job, session, rec, worker)
                return
            job.bus_seq = seq
            job.dirty = True

    def _apply_end(self, job: Job, session: Session, rec: BusRecord, partition: int) -> None:
        meta = rec.meta
        pending = job.bus_pending.pop(meta.get("r", ""), None)
        seqs = pending["seqs"] if pending else []
        data = [job.bus_data.get(s) for s in seqs]
        key = meta.get("k")
        if meta.get("st") != "ok" or (key and key in job.committed):
            for s in seqs:
                job.bus_data.pop(s, None)
            return  # aborted, or a retry of a request that committed: its lines count once
        data = [d if d is not None else self.bus.get(s) for s, d in zip(seqs, data)]  # restored: from the stream
        for s in seqs:
            job.bus_data.pop(s, None)
        left = meta.get("n")
        fed = 0
        for d in data:
            if d is None:
                continue
            runs = []
            for src, chunk in decode_runs(d.meta.get("s", []), d.payload):
                if isinstance(left, int):
                    chunk = chunk[:max(0, left)]
                    left -= len(chunk)
                runs.append((src, chunk))
            fed += self._feed_runs(session, runs)
        pieces = meta.get("p")
        missing = sum(d is None for d in data) + (max(0, pieces - len(seqs)) if isinstance(pieces, int) else 0)
        if missing or (isinstance(meta.get("n"), int) and fed < meta["n"]):
            lost = meta["n"] - fed if isinstance(meta.get("n"), int) else None
            self._gap(job.id, partition, "missing_records", lost,
                      f"{missing} record(s) of an acknowledged upload are gone from the line bus"
                      + (f" (Idempotency-Key {key!r})" if key else ""))
        else:
            self._note_end(job, meta)  # committed only with all its lines
        if job.bus_fed is not None:
            job.bus_fed += fed
        job.lines = session.lines
        self.applied_lines += fed
        if fed:
            self._lines_arrived(job)
        self._after_feed(job)

    def _apply_fin(self, job: Job, session: Session, rec: BusRecord, worker: PartitionWorker) -> None:
        exit_code = rec.meta.get("x")
        self._check_acknowledged(job, rec.meta.get("a"), worker.partition)
        try:
            self._final_diagnosis(job, session, exit_code if isinstance(exit_code, int) else None)
        except StoreError:
            job.state = "open"  # applied again when the store is back
            raise
        self.own.forget_job(job.id)
        self._drop_session(job)
        worker.jobs.discard(job.id)
        with self._registry_lock:
            if self._jobs.get(job.id) is job:
                del self._jobs[job.id]

    def _check_acknowledged(self, job: Job, acked: Any, partition: int) -> None:
        """At the job's end: every line acknowledged to its clients before `/end` (counted by the
        ingest replicas, carried by the FIN) was applied, or the shortfall is a gap."""
        if not isinstance(acked, int) or job.bus_fed is None or acked <= job.bus_fed:
            return
        told = sum(int(g["lines"] or 0) for g in self.own.gaps(job.id))
        unseen = acked - job.bus_fed - told
        if unseen > 0:
            self._gap(job.id, partition, "unaccounted_lines", unseen,
                      f"{acked} line(s) were acknowledged to its clients, {job.bus_fed} reached its owner")

    def _owned_session(self, job: Job, worker: PartitionWorker) -> Session:
        """The job's session on its owner: in memory, else restored from its saved state, else new
        (hold `tlock`)."""
        job.last_used = time.monotonic()
        if job.session is not None:
            return job.session
        assert self.engine is not None
        state = self.own.job_state(job.id)
        session: Session | None = None
        if state is not None:
            fed = state.bus_state.get("fed")
            job.bus_fed = fed if isinstance(fed, int) else None  # None: saved by a logdx that did not count
            try:
                session = Session.restore(self.engine, state.session)
            except SnapshotError as e:
                log.error("job %s: saved session not restored (%s): its earlier lines are not in the diagnosis",
                          job.id, e)
                job.bus_fed = 0
            job.bus_seq = state.seq
            job.bus_pending = state.bus_state.get("pending", {})
            for key, res in state.bus_state.get("committed", []):
                job.committed[key] = res
        if session is None:
            session = self.engine.new_session()
        job.session = session
        job.lines = session.lines
        job.last_line_at = time.monotonic()
        job.templates_count = len(session.templates())
        worker.jobs.add(job.id)
        if session.root_cause_seen and not job.scheduled:
            # Whoever owned it before may have died between the root cause and its diagnosis.
            job.scheduled = True
            self.timer.schedule(job.id, self.settings.server.early_diagnosis_delay_s)
        self._evict_if_needed(keep=job)
        return session

    def _ensure_loaded(self, job: Job) -> Session:
        if job.session is None:
            raise ApiError(503, "not_owner", f"job {job.id} is diagnosed by another replica")
        return job.session

    def _loaded_and_current(self, job: Job) -> Session:
        return self._ensure_loaded(job)

    def _scheduled_diagnosis(self, job_id: str) -> None:
        job = self._jobs.get(job_id)
        if job is None or job.session is None:
            if job is not None:
                job.scheduled = False
            return  # not ours (any more): its owner diagnoses it
        try:
            super()._scheduled_diagnosis(job_id)
        except StoreError as e:
            self.store_failed()
            self._warn("diagnosis", "job %s: early diagnosis put off (%s): tried again in 1 s", job_id, e)
            job.scheduled = True
            self.timer.schedule(job_id, 1.0)

    def _record_report(self, job: Job, report: Report, kind: str) -> None:
        """Reports of a job that the bus failed say so first (the gaps its owners found)."""
        note = gap_note(self.own.gaps(job.id))
        if note and note not in report.notes:
            report.notes.insert(0, note)
        super()._record_report(job, report, kind)

    def _evict_if_needed(self, keep: Job | None) -> None:
        """Over `server.max_sessions`: save the least recently used sessions, then drop them."""
        limit = self.settings.server.max_sessions
        loaded = self.loaded_jobs()
        for job in sorted(loaded, key=lambda j: j.last_used)[: max(0, len(loaded) - limit)]:
            if job is keep or job.scheduled or not job.tlock.acquire(blocking=False):
                continue
            try:
                worker = self._worker_of(job.id)
                if self.store_settled:
                    self._drop_abandoned(job)
                if worker is not None and self.own.save_snapshot(worker.partition, worker.epoch, None,
                                                                 [self._saved(job)]):
                    self._drop_session(job)
                    worker.jobs.discard(job.id)
                    log.info("job %s: session saved and evicted from memory (max_sessions=%d)", job.id, limit)
            finally:
                job.tlock.release()

    def _worker_of(self, job_id: str) -> PartitionWorker | None:
        with self._workers_lock:
            return self._workers.get(partition_of(job_id, self.partitions))

    # -- snapshots ---------------------------------------------------------------------------------

    def snapshot(self, worker: PartitionWorker) -> bool:
        """Save the partition's changed sessions and mark it saved through its last applied record
        (through the stream's last when the partition has nothing left to read); ack the bus; purge
        what every partition has saved. False when the partition is no longer ours."""
        if worker.idle:
            position = worker.reader.caught_up_to()
            if position is not None and position > worker.applied:
                worker.applied = position
        usage = self.bus.usage(max_age_s=0)  # read after `applied`: its last record cannot be older
        if usage is not None:
            if usage.last_seq < worker.applied or (worker.stream_created and usage.created
                                                   and usage.created != worker.stream_created):
                log.error("partition %d: the stream was replaced or lost its newest records: handing the "
                          "partition back to be read again from the start", worker.partition)
                return False
            if usage.first_seq > worker.applied + 1:
                self._stream_lost_records(worker, worker.applied, usage.first_seq)
        saved: list[SavedJob] = []
        figures: list[tuple[Any, ...]] = []
        for job_id in list(worker.jobs):
            job = self._jobs.get(job_id)
            if job is None or job.session is None:
                worker.jobs.discard(job_id)
                continue
            with job.tlock:
                if not job.dirty or job.session is None:
                    continue
                if self.store_settled:
                    self._drop_abandoned(job)
                saved.append(self._saved(job))
                figures.append(self._figures(job, job.session))
                job.dirty = False
        if not saved and worker.applied == worker.saved:
            return True
        try:
            if not self.own.save_snapshot(worker.partition, worker.epoch, worker.applied, saved,
                                          stream_created=worker.stream_created):
                return False
        except StoreError:
            for job_id in {j.job_id for j in saved}:
                job = self._jobs.get(job_id)
                if job is not None:
                    job.dirty = True  # saved next time
            raise
        if figures:
            self.db.executemany("UPDATE api_jobs SET lines = ?, summary = ?, templates = ? WHERE job_id = ?"
                                " AND state = 'open'", figures)
        worker.reader.ack(worker.applied)
        worker.saved = worker.applied
        self._purge(usage)
        return True

    def _purge(self, usage: BusUsage | None) -> None:
        """Drop from the stream what every partition has saved (once per new floor)."""
        floor = self.own.purge_floor()
        if floor <= max(self._purged_before, usage.first_seq if usage is not None else 0):
            return
        try:
            self.bus.purge_before(floor)
            self._purged_before = floor
        except BusError as e:
            self._warn("purge", "the stream was not purged before record %d (%s): next snapshot", floor, e)

    def _saved(self, job: Job) -> SavedJob:
        assert job.session is not None
        committed = list(job.committed.items())[-_COMMITTED_SAVED:]
        seqs = [s for p in job.bus_pending.values() for s in p.get("seqs", [])]
        state: dict[str, Any] = {"pending": job.bus_pending, "committed": committed}
        if job.bus_fed is not None:
            state["fed"] = job.bus_fed
        return SavedJob(job.id, job.bus_seq, job.session.snapshot(), state, min(seqs) if seqs else None)

    @staticmethod
    def _figures(job: Job, session: Session) -> tuple[Any, ...]:
        return (session.lines, json.dumps(summary_dict(session)), json.dumps(templates_snapshot(session)), job.id)

    def _drop_abandoned(self, job: Job) -> None:
        """Requests whose replica died before their END (the client got no 2xx: it sends again), or
        that never ended, are dropped."""
        if not job.bus_pending:
            return
        # Silent for long, not just past a lease: a busy replica that is late to beat still sends its END.
        silent_s = max(_ABANDONED_AFTER_S, 5 * self.settings.bus.lease_s)
        dead = self.own.dead_replicas((p["i"] for p in job.bus_pending.values()), silent_s)
        now = time.time()
        for r, p in list(job.bus_pending.items()):
            if p["i"] in dead or now - float(p.get("at", now)) > _PENDING_MAX_AGE_S:
                del job.bus_pending[r]
                for s in p["seqs"]:
                    job.bus_data.pop(s, None)

    # -- ingestion (any ingest replica) -----------------------------------------------------------

    def check_open(self, job: Job) -> None:
        if self.role == "worker":
            raise ApiError(503, "not_ingest", "this replica only diagnoses (server.role: worker); "
                           "send logs to an ingest replica")
        super().check_open(job)

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

    def _publish_aborts(self) -> None:
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
            meta, payload = encode_runs(piece)
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
        row = self._row(job.id) or {}
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
            self.db.execute("UPDATE api_jobs SET bytes = bytes + ?, requests = requests + 1, updated_at = ?"
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
        stored = self.stored_final(job)
        if stored is not None:
            return stored
        acked = self.own.acked_lines(job.id)
        self._publish(BusRecord(FIN, job.id, {"x": exit_code, "i": self.replica, "a": acked}), f"{job.id}/fin")
        deadline = time.monotonic() + self.settings.bus.end_timeout_s
        while time.monotonic() < deadline:
            if self.state_in_db(job.id) == "ended":
                with self._registry_lock:
                    if self._jobs.get(job.id) is job:
                        del self._jobs[job.id]
                stored = self.stored_final(job)
                assert stored is not None
                return stored
            time.sleep(_END_POLL_S)
        raise ApiError(503, "owner_unavailable",
                       f"no worker made job {job.id}'s final diagnosis within {self.settings.bus.end_timeout_s:g} s "
                       "(its partition is being taken over?); retry: the request is idempotent",
                       headers={"Retry-After": "5"})

    # -- reading (any replica) ------------------------------------------------------------------

    def _view(self, job: Job) -> tuple[dict[str, Any], dict[str, Any] | None, bool | None, int]:
        if job.session is not None:
            return super()._view(job)
        row = self._row(job.id) or {}
        compression = json.loads(row["summary"]) if row.get("summary") else None
        return row, compression, None, int(row.get("lines") or 0)

    def templates(self, job: Job, limit: int, errors_only: bool) -> dict[str, Any]:
        if job.session is not None:
            return super().templates(job, limit, errors_only)
        row = self._row(job.id) or {}
        snap = json.loads(row["templates"]) if row.get("templates") else {"total": 0, "templates": []}
        items = [t for t in snap["templates"] if t["error_bearing"]] if errors_only else snap["templates"]
        return {"job_id": job.id, "state": row.get("state", job.state), "total": snap["total"],
                "templates": items[:limit]}

    def forget(self, job_id: str, unused_since: float) -> bool:
        if not super().forget(job_id, unused_since):
            return False
        self.own.forget_job_entirely(job_id)
        return True

    def describe(self, job: Job) -> dict[str, Any]:
        detail = super().describe(job)
        detail["bus_gaps"] = self.own.gaps(job.id)
        return detail

    def open_job_ids(self) -> list[str]:
        return []  # owners restore their partitions' jobs when they take them

    def cluster(self) -> dict[str, Any]:
        """Replicas, partitions (owner, lease, saved and applied records, lag), this replica."""
        parts = self.own.partitions_table()
        for p in parts:
            p["lag"] = self.bus.lag(p["partition"]) if p["owner"] else None
            p["applied_seq"] = max(p["applied_seq"], self._applied_here(p["partition"]))
        return {"replica": self.replica, "role": self.role, "partitions": parts, "replicas": self.own.replicas_table(),
                "bus": {"prefix": self.settings.bus.prefix, "partitions": self.partitions}}

    def _applied_here(self, partition: int) -> int:
        with self._workers_lock:
            worker = self._workers.get(partition)
        return worker.applied if worker is not None else 0


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


class PartitionWorker:
    """One owned partition: a thread that applies its records and saves it periodically."""

    def __init__(self, manager: ClusterJobManager, claim: Claim, reader: PartitionReader) -> None:
        self.manager = manager
        self.partition = claim.partition
        self.epoch = claim.epoch
        self.reader = reader
        self.applied = claim.snapshot_seq
        self.saved = claim.snapshot_seq
        self.jobs: set[str] = set()
        self.stream_created = claim.stream_created
        self.idle = False  # the last read returned nothing
        self.gap_reported_to = 0  # records removed from the stream were reported up to here
        self.stopping = False
        self._graceful = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"logdx-partition-{claim.partition}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, graceful: bool) -> None:
        """Graceful: save, then hand the partition back (another worker takes it at once); else drop it."""
        self.stopping = True
        self._graceful = graceful
        self._stop.set()

    def join(self, timeout: float = 30.0) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        m = self.manager
        interval = m.settings.bus.snapshot_interval_s
        last_save = time.monotonic()
        try:
            while not self._stop.is_set():
                records = self.reader.fetch(_FETCH, _FETCH_WAIT_S)
                self.idle = not records
                for seq, rec in records:
                    if self._stop.is_set() and not self._graceful:
                        break
                    if not self._apply(seq, rec):
                        break  # stopped while the store was away: the next owner reads it again
                    self.applied = seq
                if time.monotonic() - last_save >= self._save_every(interval):
                    last_save = time.monotonic()
                    if not self._save():
                        log.warning("partition %d: no longer ours (epoch %d): stopping", self.partition, self.epoch)
                        m.own.release(self.partition, self.epoch)  # a no-op unless it still is (a reset)
                        return
            if self._graceful and m.snapshot(self):
                m.own.release(self.partition, self.epoch)
                log.info("partition %d: saved through record %d and handed back", self.partition, self.applied)
        except Exception:
            log.exception("partition %d: worker failed; the partition goes to another worker", self.partition)
            try:
                m.own.release(self.partition, self.epoch)
            except Exception:
                log.exception("partition %d: could not hand it back (its lease will run out)", self.partition)
        finally:
            self.reader.close()
            m._worker_stopped(self)

    def _apply(self, seq: int, rec: BusRecord) -> bool:
        """Apply one record; while the store is unreachable, again and again (a record is never
        skipped for an outage). False when the worker was stopped meanwhile."""
        m = self.manager
        while True:
            try:
                m.apply(self, seq, rec)
                return True
            except StoreError as e:
                m.store_failed()
                m._warn("apply", "partition %d: record %d waits for the store (%s)", self.partition, seq, e)
                if self._stop.wait(_RETRY_APPLY_S):
                    return False
            except ApiError as e:
                log.warning("partition %d: record %d of job %s not applied: %s", self.partition, seq, rec.job_id,
                            e.message)
                return True
            except Exception:
                log.exception("partition %d: record %d of job %s failed", self.partition, seq, rec.job_id)
                return True

    def _save(self) -> bool:
        """A snapshot; one that meets a store or bus outage waits for the next turn."""
        m = self.manager
        try:
            return m.snapshot(self)
        except (StoreError, BusError) as e:
            if isinstance(e, StoreError):
                m.store_failed()
            m._warn("save", "partition %d: snapshot put off (%s)", self.partition, e)
            return True

    def _save_every(self, interval: float) -> float:
        """`bus.snapshot_interval_s`, or every second while the bus is over half full (saving lets it
        be purged)."""
        usage = self.manager.bus.usage(max_age_s=1.0)
        if usage is not None and usage.max_bytes > 0 and usage.bytes > _BUSY_BUS * usage.max_bytes:
            return min(interval, 1.0)
        return interval


def gap_note(gaps: list[dict[str, Any]]) -> str:
    """One note for a report: what its owners found missing on the bus."""
    if not gaps:
        return ""
    lost = sum(int(g["lines"] or 0) for g in gaps)
    unknown = any(g["lines"] is None for g in gaps)
    what = f"{lost} acknowledged line(s) never reached this diagnosis" if lost else "acknowledged lines may be missing"
    more = " (and perhaps more)" if lost and unknown else ""
    return f"incomplete: {what}{more}: {gaps[-1]['detail']} (see the job's bus_gaps)"

