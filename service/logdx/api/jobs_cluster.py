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
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from logdx.act.report import Report
from logdx.api.errors import ApiError
from logdx.api.ingest import CpuBudget
from logdx.api.jobs import IngestRequest, Job, JobManager, summary_dict, templates_snapshot
from logdx.api.metrics import Metrics
from logdx.api.spool import decode_runs, encode_runs
from logdx.bus.base import LineBus, PartitionReader
from logdx.bus.ownership import WORKER_ROLES, Claim, Ownership, SavedJob
from logdx.bus.records import DATA, END, FIN, BusRecord, partition_of
from logdx.config import Settings
from logdx.incidents import IncidentStore
from logdx.normalize import Source
from logdx.pipeline import Session, SnapshotError
from logdx.store import Store

log = logging.getLogger("logdx.cluster")

_FETCH = 512  # records per read
_FETCH_WAIT_S = 0.25
_END_POLL_S = 0.05
_COMMITTED_SAVED = 1000  # Idempotency-Keys kept in a saved session (upload_keys has them all)
_PENDING_MAX_AGE_S = 3600.0  # a request that never ended (its replica lost it) is dropped after this


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
            except Exception:
                log.exception("cluster coordination failed (retrying)")
            if self._stop.wait(interval):
                return

    def _tick(self) -> None:
        self.own.heartbeat()
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
            for p in self.own.claimable():
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
        reader = self.bus.open_partition(claim.partition, claim.snapshot_seq)
        worker = PartitionWorker(self, claim, reader)
        with self._workers_lock:
            self._workers[claim.partition] = worker
        self.takeovers += 1
        restored = self._restore_partition(worker)
        worker.start()
        for effect in self.unacted():
            if partition_of(effect.job_id, self.partitions) == claim.partition and self.actor is not None:
                log.info("job %s: acting on a diagnosis its previous owner stored", effect.job_id)
                self.actor.submit(effect)
        log.info("partition %d: owned (epoch %d) from record %d on, %d job session(s) restored in %.2fs",
                 claim.partition, claim.epoch, claim.snapshot_seq, restored, time.perf_counter() - t0)

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
                self._apply_end(job, session, rec)
            elif rec.kind == FIN:
                self._apply_fin(job, session, rec, worker)
                return
            job.bus_seq = seq
            job.dirty = True

    def _apply_end(self, job: Job, session: Session, rec: BusRecord) -> None:
        meta = rec.meta
        pending = job.bus_pending.pop(meta.get("r", ""), None)
        seqs = pending["seqs"] if pending else []
        data = [job.bus_data.pop(s, None) for s in seqs]
        key = meta.get("k")
        if meta.get("st") != "ok" or (key and key in job.committed):
            return  # aborted, or a retry of a request that committed: its lines count once
        left = meta.get("n")
        fed = 0
        for s, d in zip(seqs, data):
            d = d if d is not None else self.bus.get(s)  # restored: re-read from the stream
            if d is None:
                log.error("job %s: record %d of a committed request is gone from the stream", job.id, s)
                continue
            runs = []
            for src, chunk in decode_runs(d.meta.get("s", []), d.payload):
                if isinstance(left, int):
                    chunk = chunk[:max(0, left)]
                    left -= len(chunk)
                runs.append((src, chunk))
            fed += self._feed_runs(session, runs)
        self._note_end(job, meta)
        job.lines = session.lines
        self.applied_lines += fed
        if fed:
            self._lines_arrived(job)
        self._after_feed(job)

    def _apply_fin(self, job: Job, session: Session, rec: BusRecord, worker: PartitionWorker) -> None:
        exit_code = rec.meta.get("x")
        self._final_diagnosis(job, session, exit_code if isinstance(exit_code, int) else None)
        self.own.forget_job(job.id)
        self._drop_session(job)
        worker.jobs.discard(job.id)
        with self._registry_lock:
            if self._jobs.get(job.id) is job:
                del self._jobs[job.id]

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
            try:
                session = Session.restore(self.engine, state.session)
            except SnapshotError as e:
                log.error("job %s: saved session not restored (%s): its earlier lines are not in the diagnosis",
                          job.id, e)
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
        super()._scheduled_diagnosis(job_id)

    def _evict_if_needed(self, keep: Job | None) -> None:
        """Over `server.max_sessions`: save the least recently used sessions, then drop them."""
        limit = self.settings.server.max_sessions
        loaded = self.loaded_jobs()
        for job in sorted(loaded, key=lambda j: j.last_used)[: max(0, len(loaded) - limit)]:
            if job is keep or job.scheduled or not job.tlock.acquire(blocking=False):
                continue
            try:
                worker = self._worker_of(job.id)
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
        """Save the partition's changed sessions and mark it saved through its last applied record;
        ack the bus. False when the partition is no longer ours."""
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
                self._drop_abandoned(job)
                saved.append(self._saved(job))
                figures.append(self._figures(job, job.session))
                job.dirty = False
        if not saved and worker.applied == worker.saved:
            return True
        if not self.own.save_snapshot(worker.partition, worker.epoch, worker.applied, saved):
            return False
        if figures:
            self.db.executemany("UPDATE api_jobs SET lines = ?, summary = ?, templates = ? WHERE job_id = ?"
                                " AND state = 'open'", figures)
        worker.reader.ack(worker.applied)
        worker.saved = worker.applied
        return True

    def _saved(self, job: Job) -> SavedJob:
        assert job.session is not None
        committed = list(job.committed.items())[-_COMMITTED_SAVED:]
        return SavedJob(job.id, job.bus_seq, job.session.snapshot(),
                        {"pending": job.bus_pending, "committed": committed})

    @staticmethod
    def _figures(job: Job, session: Session) -> tuple[Any, ...]:
        return (session.lines, json.dumps(summary_dict(session)), json.dumps(templates_snapshot(session)), job.id)

    def _drop_abandoned(self, job: Job) -> None:
        """Requests whose replica died before their END (the client got no 2xx: it sends again), or
        that never ended, are dropped."""
        if not job.bus_pending:
            return
        dead = self.own.dead_replicas(p["i"] for p in job.bus_pending.values())
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
        from logdx.bus.jetstream import BusError

        try:
            return self.bus.publish(record, msg_id)
        except BusError as e:
            log.warning("bus publish failed: %s", e)
            raise ApiError(503, "bus_unavailable", f"the line bus did not take the lines ({e}); retry",
                           headers={"Retry-After": "2"}) from None

    def spool_runs(self, job: Job, req: IngestRequest, runs: list[tuple[Source, list[bytes]]], lines: int) -> None:
        """Publish a piece of a request's lines (DATA records of at most `bus.max_message_bytes`)."""
        t0 = time.perf_counter()
        if job.state != "open":
            raise ApiError(409, "job_ended", f"job {job.id} has ended")
        for piece in _pieces(runs, self.settings.bus.max_message_bytes):
            meta, payload = encode_runs(piece)
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
        """Publish the request's END; once JetStream has it, the lines are accepted (a 2xx)."""
        row = self._row(job.id) or {}
        known = int(row.get("lines") or 0)
        if ok and req.key is not None and self.own.committed_upload(job.id, req.key) is not None:
            ok, req.duplicate = False, True  # a retry whose first try committed meanwhile
        if ok:
            req.applied = req.lines
        result = req.result(known + req.applied)
        if req.wrote or (ok and req.key is not None):
            meta: dict[str, Any] = {"r": req.id, "st": "ok" if ok else "aborted", "n": req.applied}
            if ok and req.key:
                meta["k"], meta["res"] = req.key, result
            try:
                self._publish(BusRecord(END, job.id, meta), f"{job.id}/{req.id}/end")
            except ApiError:
                if ok:
                    raise
                # An aborted request whose END is lost: its owner drops its DATA with the replica's death
                # or after an hour; nothing of it is ever applied.
            if ok and req.key:
                self.own.commit_upload(job.id, req.key, result)
        if req.duplicate and req.key is not None:
            result = {**(self.own.committed_upload(job.id, req.key) or result), "duplicate": True}
        job.bytes += req.raw_bytes
        self.db.execute("UPDATE api_jobs SET bytes = bytes + ?, requests = requests + 1, updated_at = ? WHERE job_id = ?",
                        (req.raw_bytes, time.time(), job.id))
        job.bucket.take(req.applied)
        self.metrics.lines.labels(req.fmt).inc(req.applied)
        if req.truncated:
            self.metrics.truncated.inc(req.truncated)
        if req.refused:
            self.metrics.skipped.inc(req.refused)
        return result

    def end(self, job: Job, exit_code: int | None) -> Report:
        """Publish FIN and wait for the job's owner to store the final diagnosis."""
        stored = self.stored_final(job)
        if stored is not None:
            return stored
        self._publish(BusRecord(FIN, job.id, {"x": exit_code, "i": self.replica}), f"{job.id}/fin")
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
        self.own.forget_job(job_id)
        return True

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
        next_save = time.monotonic() + interval
        try:
            while not self._stop.is_set():
                for seq, rec in self.reader.fetch(_FETCH, _FETCH_WAIT_S):
                    if self._stop.is_set() and not self._graceful:
                        break
                    try:
                        m.apply(self, seq, rec)
                    except ApiError as e:
                        log.warning("partition %d: record %d of job %s not applied: %s", self.partition, seq,
                                    rec.job_id, e.message)
                    except Exception:
                        log.exception("partition %d: record %d of job %s failed", self.partition, seq, rec.job_id)
                    self.applied = seq
                if time.monotonic() >= next_save:
                    next_save = time.monotonic() + interval
                    if not m.snapshot(self):
                        log.warning("partition %d: no longer ours (epoch %d): stopping", self.partition, self.epoch)
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

