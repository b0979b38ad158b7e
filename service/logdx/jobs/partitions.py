"""A partition of the line bus, on its owner: a thread that reads its records in stream order and
applies them to its jobs' sessions (DATA waits for its END; an END commits its request's lines,
once per key; FIN ends the job), and saves the partition periodically (`ClusterCoordinator.snapshot`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

from logdx.bus.base import BusError, LineBus, PartitionReader
from logdx.bus.ownership import Claim, Ownership
from logdx.bus.records import DATA, END, FIN, BusRecord
from logdx.config import Settings
from logdx.jobs.jobstate import Job
from logdx.jobs.ports import CoordinatedJobs
from logdx.jobs.spool import decode_runs
from logdx.pipeline import Session, SnapshotError
from logdx.store_base import StoreError
from logdx.wire.errors import ApiError

log = logging.getLogger("logdx.cluster")

_FETCH = 512  # records per read
_FETCH_WAIT_S = 0.25
_RETRY_APPLY_S = 0.5  # a record that met a store outage is applied again after this
_BUSY_BUS = 0.5  # above this share of its size the bus is saved (and purged) every second


class PartitionOwner(Protocol):
    """What a partition's worker asks of the cluster coordinator that owns it (`ClusterCoordinator`)."""

    applied_lines: int  # lines fed to sessions of owned partitions, counted by the workers

    @property
    def settings(self) -> Settings: ...

    @property
    def bus(self) -> LineBus: ...

    @property
    def own(self) -> Ownership: ...

    @property
    def jobs(self) -> CoordinatedJobs: ...

    def gap(self, job_id: str, partition: int, kind: str, lines: int | None, detail: str) -> None: ...

    def snapshot(self, worker: PartitionWorker) -> bool: ...

    def evict_if_needed(self, keep: Job | None) -> None: ...

    def store_failed(self) -> None: ...

    def warn(self, key: str, msg: str, *args: Any) -> None: ...

    def worker_stopped(self, worker: PartitionWorker) -> None: ...


class PartitionWorker:
    """One owned partition: a thread that applies its records and saves it periodically."""

    def __init__(self, manager: PartitionOwner, claim: Claim, reader: PartitionReader) -> None:
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
            m.worker_stopped(self)

    def _apply(self, seq: int, rec: BusRecord) -> bool:
        """Apply one record; while the store is unreachable, again and again (a record is never
        skipped for an outage). False when the worker was stopped meanwhile."""
        m = self.manager
        while True:
            try:
                self.apply(seq, rec)
                return True
            except StoreError as e:
                m.store_failed()
                m.warn("apply", "partition %d: record %d waits for the store (%s)", self.partition, seq, e)
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
            m.warn("save", "partition %d: snapshot put off (%s)", self.partition, e)
            return True

    def _save_every(self, interval: float) -> float:
        """`bus.snapshot_interval_s`, or every second while the bus is over half full (saving lets it
        be purged)."""
        usage = self.manager.bus.usage(max_age_s=1.0)
        if usage is not None and usage.max_bytes > 0 and usage.bytes > _BUSY_BUS * usage.max_bytes:
            return min(interval, 1.0)
        return interval

    # -- applying records -----------------------------------------------------------------------

    def apply(self, seq: int, rec: BusRecord) -> None:
        m = self.manager
        job = m.jobs.get(rec.job_id)
        if job is None or job.state != "open":
            return  # an unknown or ended job: what follows its end is not part of it
        with job.tlock:
            session = self.owned_session(job)
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
                self._apply_fin(job, session, rec)
                return
            job.bus_seq = seq
            job.dirty = True

    def _apply_end(self, job: Job, session: Session, rec: BusRecord) -> None:
        m = self.manager
        meta = rec.meta
        pending = job.bus_pending.pop(meta.get("r", ""), None)
        seqs = pending["seqs"] if pending else []
        data = [job.bus_data.get(s) for s in seqs]
        key = meta.get("k")
        if meta.get("st") != "ok" or (key and key in job.committed):
            for s in seqs:
                job.bus_data.pop(s, None)
            return  # aborted, or a retry of a request that committed: its lines count once
        data = [d if d is not None else m.bus.get(s) for s, d in zip(seqs, data)]  # restored: from the stream
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
            fed += m.jobs.feed_runs(session, runs)
        pieces = meta.get("p")
        missing = sum(d is None for d in data) + (max(0, pieces - len(seqs)) if isinstance(pieces, int) else 0)
        if missing or (isinstance(meta.get("n"), int) and fed < meta["n"]):
            lost = meta["n"] - fed if isinstance(meta.get("n"), int) else None
            m.gap(job.id, self.partition, "missing_records", lost,
                  f"{missing} record(s) of an acknowledged upload are gone from the line bus"
                  + (f" (Idempotency-Key {key!r})" if key else ""))
        else:
            m.jobs.note_end(job, meta)  # committed only with all its lines
        if job.bus_fed is not None:
            job.bus_fed += fed
        job.lines = session.lines
        m.applied_lines += fed
        if fed:
            m.jobs.lines_arrived(job)
        m.jobs.after_feed(job)

    def _apply_fin(self, job: Job, session: Session, rec: BusRecord) -> None:
        m = self.manager
        exit_code = rec.meta.get("x")
        self._check_acknowledged(job, rec.meta.get("a"))
        try:
            m.jobs.final_diagnosis(job, session, exit_code if isinstance(exit_code, int) else None)
        except StoreError:
            job.state = "open"  # applied again when the store is back
            raise
        m.own.forget_job(job.id)
        job.drop_session()
        self.jobs.discard(job.id)
        m.jobs.unregister(job)

    def _check_acknowledged(self, job: Job, acked: Any) -> None:
        """At the job's end: every line acknowledged to its clients before `/end` (counted by the
        ingest replicas, carried by the FIN) was applied, or the shortfall is a gap."""
        m = self.manager
        if not isinstance(acked, int) or job.bus_fed is None or acked <= job.bus_fed:
            return
        told = sum(int(g["lines"] or 0) for g in m.own.gaps(job.id))
        unseen = acked - job.bus_fed - told
        if unseen > 0:
            m.gap(job.id, self.partition, "unaccounted_lines", unseen,
                  f"{acked} line(s) were acknowledged to its clients, {job.bus_fed} reached its owner")

    def owned_session(self, job: Job) -> Session:
        """The job's session on its owner: in memory, else restored from its saved state, else new
        (hold `tlock`)."""
        m = self.manager
        job.last_used = time.monotonic()
        if job.session is not None:
            return job.session
        assert m.jobs.engine is not None
        state = m.own.job_state(job.id)
        session: Session | None = None
        if state is not None:
            fed = state.bus_state.get("fed")
            job.bus_fed = fed if isinstance(fed, int) else None  # None: saved by a logdx that did not count
            try:
                session = Session.restore(m.jobs.engine, state.session)
            except SnapshotError as e:
                log.error("job %s: saved session not restored (%s): its earlier lines are not in the diagnosis",
                          job.id, e)
                job.bus_fed = 0
            job.bus_seq = state.seq
            job.bus_pending = state.bus_state.get("pending", {})
            for key, res in state.bus_state.get("committed", []):
                job.committed[key] = res
        if session is None:
            session = m.jobs.engine.new_session(live=True, vouching=True, evidence=True)
        job.session = session
        job.lines = session.lines
        job.last_line_at = time.monotonic()
        job.templates_count = len(session.templates())
        self.jobs.add(job.id)
        if session.root_cause_seen and not job.scheduled:
            # Whoever owned it before may have died between the root cause and its diagnosis.
            job.scheduled = True
            m.jobs.timer.schedule(job.id, m.settings.server.early_diagnosis_delay_s)
        m.evict_if_needed(keep=job)
        return session


def gap_note(gaps: list[dict[str, Any]]) -> str:
    """One note for a report: what its owners found missing on the bus."""
    if not gaps:
        return ""
    lost = sum(int(g["lines"] or 0) for g in gaps)
    unknown = any(g["lines"] is None for g in gaps)
    what = f"{lost} acknowledged line(s) never reached this diagnosis" if lost else "acknowledged lines may be missing"
    more = " (and perhaps more)" if lost and unknown else ""
    return f"incomplete: {what}{more}: {gaps[-1]['detail']} (see the job's bus_gaps)"
