"""Who owns which partition: leases in PostgreSQL, and the replicas' heartbeats.

A partition is diagnosed by exactly one worker at a time. Its row in `bus_partitions` names the
owner, a lease end and an `epoch` that grows by one at every change of owner. An owner renews its
leases every `bus.lease_s / 3`; a partition whose lease ran out is free, and any worker below its
fair share (partitions / live workers, rounded up) claims it: with `bus.lease_s` 6 s a dead owner's
partitions move within about 8 s. A worker above its share, or above the lower bound while
another worker is below it (a new worker joined), hands a partition back after saving it, so the
load evens out. Every time is the database's clock, never a
replica's: clocks of different machines may disagree, the leases do not.

The epoch fences: a snapshot is saved only by the owner of the current epoch (`save_snapshot`
checks it in the same transaction), so an owner that paused past its lease (and whose partition
was taken over) cannot overwrite what the new owner saved.

`job_sessions` holds each job's saved session (`Session.snapshot()`) with the last stream sequence
it holds; `bus_partitions.snapshot_seq` is where a new owner starts reading.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from logdx.store import Store, migrate

__all__ = ["Claim", "JobState", "Ownership", "SavedJob"]

PG_MIGRATIONS = [
    """
    CREATE TABLE cluster_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE cluster_replicas (
        replica      TEXT PRIMARY KEY,
        role         TEXT NOT NULL,
        url          TEXT NOT NULL DEFAULT '',
        started_at   DOUBLE PRECISION NOT NULL,
        heartbeat_at DOUBLE PRECISION NOT NULL,
        stopped_at   DOUBLE PRECISION
    );
    CREATE TABLE bus_partitions (
        partition    INTEGER PRIMARY KEY,
        owner        TEXT,
        epoch        BIGINT NOT NULL DEFAULT 0,
        lease_until  DOUBLE PRECISION NOT NULL DEFAULT 0,
        taken_at     DOUBLE PRECISION,
        snapshot_seq BIGINT NOT NULL DEFAULT 0,
        snapshot_at  DOUBLE PRECISION,
        applied_seq  BIGINT NOT NULL DEFAULT 0,
        previous_owner TEXT
    );
    CREATE TABLE job_sessions (
        job_id    TEXT PRIMARY KEY,
        partition INTEGER NOT NULL,
        seq       BIGINT NOT NULL,
        saved_at  DOUBLE PRECISION NOT NULL,
        session   BYTEA NOT NULL,
        bus_state TEXT NOT NULL DEFAULT '{}'
    );
    CREATE INDEX job_sessions_partition ON job_sessions(partition);
    CREATE TABLE upload_keys (
        job_id     TEXT NOT NULL,
        key        TEXT NOT NULL,
        result     TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (job_id, key)
    );
    """,
    # No silent gap, and a bus that is emptied as owners save (logdx.bus.jetstream):
    # - bus_partitions.keep_from: the first stream record the partition still needs (the one after its
    #   snapshot, or the first DATA of a request not yet ended); the stream is purged below the least
    #   of all partitions'. stream_created: the stream the positions refer to (another one: reset).
    # - job_sessions.pending_seq: the first DATA record of the job's requests not yet ended.
    # - bus_job_acks: lines acknowledged to clients per job (counted once per Idempotency-Key), so that
    #   the owner can tell at the job's end whether every acknowledged line reached it.
    # - bus_gaps: what an owner found missing, per job (the job's state, and notes in its reports).
    """
    ALTER TABLE bus_partitions ADD COLUMN keep_from BIGINT NOT NULL DEFAULT 0;
    ALTER TABLE bus_partitions ADD COLUMN stream_created TEXT NOT NULL DEFAULT '';
    ALTER TABLE job_sessions ADD COLUMN pending_seq BIGINT;
    CREATE TABLE bus_job_acks (
        job_id   TEXT PRIMARY KEY,
        lines    BIGINT NOT NULL DEFAULT 0,
        requests BIGINT NOT NULL DEFAULT 0
    );
    CREATE TABLE bus_gaps (
        id        BIGSERIAL PRIMARY KEY,
        job_id    TEXT NOT NULL,
        partition INTEGER NOT NULL,
        found_at  DOUBLE PRECISION NOT NULL,
        kind      TEXT NOT NULL,
        lines     BIGINT,
        detail    TEXT NOT NULL
    );
    CREATE INDEX bus_gaps_job ON bus_gaps(job_id);
    """,
]
_NOW = "EXTRACT(EPOCH FROM clock_timestamp())::double precision"
WORKER_ROLES = ("worker", "all")


@dataclass(frozen=True, slots=True)
class Claim:
    partition: int
    epoch: int
    snapshot_seq: int
    stream_created: str = ""  # the stream `snapshot_seq` refers to ("" when never saved)


@dataclass(slots=True)
class SavedJob:
    """One job's saved state, as a snapshot writes it."""

    job_id: str
    seq: int
    session: bytes
    bus_state: dict[str, Any]
    pending_seq: int | None = None  # the first DATA record of a request not ended yet


@dataclass(slots=True)
class JobState:
    seq: int
    session: bytes
    bus_state: dict[str, Any]


class PartitionCountChanged(RuntimeError):
    """bus.partitions differs from what the stream was created with."""


class Ownership:
    def __init__(self, db: Store, replica: str, role: str, partitions: int, lease_s: float, url: str = "") -> None:
        self.db = db
        self.replica = replica
        self.role = role
        self.partitions = partitions
        self.lease_s = lease_s
        self.url = url
        migrate(db, "cluster", [], postgres=PG_MIGRATIONS)
        self._check_partition_count()

    def _check_partition_count(self) -> None:
        self.db.execute("INSERT INTO cluster_meta(key, value) VALUES ('partitions', ?) ON CONFLICT DO NOTHING",
                        (str(self.partitions),))
        known = int(self.db.query_value("SELECT value FROM cluster_meta WHERE key = 'partitions'"))
        if known != self.partitions:
            raise PartitionCountChanged(
                f"bus.partitions is {self.partitions} but this deployment's jobs are spread over {known}: "
                f"set bus.partitions: {known} (or a new bus.prefix and database for a new layout)")
        self.db.executemany("INSERT INTO bus_partitions(partition) VALUES (?) ON CONFLICT DO NOTHING",
                            [(p,) for p in range(self.partitions)])

    # -- replicas -------------------------------------------------------------------------------

    def heartbeat(self) -> None:
        self.db.execute(
            f"INSERT INTO cluster_replicas(replica, role, url, started_at, heartbeat_at) VALUES (?,?,?,{_NOW},{_NOW})"
            f" ON CONFLICT(replica) DO UPDATE SET heartbeat_at = {_NOW}, role = excluded.role, url = excluded.url,"
            " stopped_at = NULL", (self.replica, self.role, self.url))

    def stopped(self) -> None:
        self.db.execute(f"UPDATE cluster_replicas SET stopped_at = {_NOW} WHERE replica = ?", (self.replica,))

    def live_workers(self) -> int:
        return int(self.db.query_value(
            f"SELECT COUNT(*) FROM cluster_replicas WHERE role IN ('worker', 'all') AND stopped_at IS NULL"
            f" AND heartbeat_at >= {_NOW} - ?", (self.lease_s,)) or 0)

    def dead_replicas(self, among: Iterable[str], silent_s: float | None = None) -> set[str]:
        """Which of these replicas stopped, or have not beaten for `silent_s` (default `lease_s`)."""
        ids = sorted(set(among))
        if not ids:
            return set()
        alive = {r["replica"] for r in self.db.query(
            f"SELECT replica FROM cluster_replicas WHERE replica = ANY(?) AND stopped_at IS NULL"
            f" AND heartbeat_at >= {_NOW} - ?", (ids, self.lease_s if silent_s is None else silent_s))}
        return set(ids) - alive

    def fair_share(self) -> tuple[int, int]:
        """How many partitions each live worker should own: at least the first, at most the second."""
        n = max(1, self.live_workers())
        return self.partitions // n, math.ceil(self.partitions / n)

    def starved(self, below: int) -> bool:
        """Whether a live worker owns fewer than `below` partitions (someone should hand one over)."""
        return bool(self.db.query_value(
            f"SELECT COUNT(*) FROM cluster_replicas r WHERE r.role IN ('worker', 'all') AND r.stopped_at IS NULL"
            f" AND r.heartbeat_at >= {_NOW} - ? AND (SELECT COUNT(*) FROM bus_partitions p WHERE p.owner = r.replica"
            f" AND p.lease_until >= {_NOW}) < ?", (self.lease_s, below)))

    # -- leases ---------------------------------------------------------------------------------

    def renew(self, owned: dict[int, int]) -> set[int]:
        """Extend the leases of `owned` (partition -> epoch); returns the partitions lost meanwhile."""
        if not owned:
            return set()
        kept = {r["partition"] for r in self.db.query(
            f"UPDATE bus_partitions SET lease_until = {_NOW} + ? WHERE partition = ANY(?) AND owner = ?"
            " AND epoch = ANY(?) RETURNING partition", (self.lease_s, list(owned), self.replica, list(owned.values())))}
        return set(owned) - kept

    def claimable(self, held: bool = True) -> list[int]:
        """Partitions nobody holds a live lease on (`held`: also those whose owner let its lease run
        out; else only those nobody owns), starting at an offset of this replica's own so that
        replicas starting together reach for different ones first."""
        expired = f" OR lease_until < {_NOW}" if held else ""
        rows = self.db.query(f"SELECT partition FROM bus_partitions WHERE owner IS NULL{expired} ORDER BY partition")
        free = [r["partition"] for r in rows]
        if not free:
            return []
        start = hash(self.replica) % len(free)
        return free[start:] + free[:start]

    def claim(self, partition: int) -> Claim | None:
        row = self.db.query(
            f"UPDATE bus_partitions SET previous_owner = owner, owner = ?, epoch = epoch + 1,"
            f" lease_until = {_NOW} + ?, taken_at = {_NOW} WHERE partition = ? AND (owner IS NULL"
            f" OR lease_until < {_NOW}) RETURNING epoch, snapshot_seq, stream_created",
            (self.replica, self.lease_s, partition))
        if not row:
            return None
        return Claim(partition, int(row[0]["epoch"]), int(row[0]["snapshot_seq"]), str(row[0]["stream_created"]))

    def release(self, partition: int, epoch: int) -> None:
        self.db.execute("UPDATE bus_partitions SET owner = NULL, lease_until = 0 WHERE partition = ? AND owner = ?"
                        " AND epoch = ?", (partition, self.replica, epoch))

    # -- snapshots ------------------------------------------------------------------------------

    def save_snapshot(self, partition: int, epoch: int, seq: int | None, jobs: list[SavedJob],
                      stream_created: str = "") -> bool:
        """Save these jobs' sessions and mark the partition saved through `seq` (None: only the jobs,
        an eviction), in one transaction, only while this replica still owns it at `epoch`; False
        when it does not (nothing saved). The partition's `keep_from` (what the stream must still
        hold for it) becomes the record after `seq`, or the first DATA of a request of its jobs that
        has not ended, whichever comes first."""
        with self.db.transaction() as tx:
            row = tx.execute("SELECT owner, epoch FROM bus_partitions WHERE partition = ? FOR UPDATE",
                             (partition,)).fetchone()
            if row is None or row["owner"] != self.replica or int(row["epoch"]) != epoch:
                return False
            for job in jobs:
                tx.execute(
                    f"INSERT INTO job_sessions(job_id, partition, seq, saved_at, session, bus_state, pending_seq)"
                    f" VALUES (?,?,?,{_NOW},?,?,?) ON CONFLICT(job_id) DO UPDATE SET seq = excluded.seq,"
                    " saved_at = excluded.saved_at, session = excluded.session, bus_state = excluded.bus_state,"
                    " pending_seq = excluded.pending_seq",
                    (job.job_id, partition, job.seq, job.session, json.dumps(job.bus_state), job.pending_seq))
            if seq is not None:
                tx.execute(
                    f"UPDATE bus_partitions SET snapshot_seq = ?, applied_seq = ?, snapshot_at = {_NOW},"
                    " keep_from = LEAST(?, COALESCE((SELECT MIN(pending_seq) FROM job_sessions WHERE partition = ?),"
                    " ?)), stream_created = ? WHERE partition = ?",
                    (seq, seq, seq + 1, partition, seq + 1, stream_created, partition))
        return True

    def purge_floor(self) -> int:
        """The first stream record any partition still needs: every record before it is saved in a
        snapshot (or belongs to a job that ended), so the stream may drop it."""
        return int(self.db.query_value("SELECT MIN(keep_from) FROM bus_partitions") or 0)

    def reset_partition(self, partition: int, epoch: int) -> list[str]:
        """The stream was replaced or lost its newest records: the partition's saved positions mean
        nothing in it. Positions go back to its start, requests that had not ended are dropped (their
        records are gone); returns the partition's open jobs (each to be told)."""
        with self.db.transaction() as tx:
            row = tx.execute("SELECT owner, epoch FROM bus_partitions WHERE partition = ? FOR UPDATE",
                             (partition,)).fetchone()
            if row is None or row["owner"] != self.replica or int(row["epoch"]) != epoch:
                return []
            jobs = tx.execute("SELECT s.job_id, s.bus_state FROM job_sessions s JOIN api_jobs j ON j.job_id = s.job_id"
                              " WHERE s.partition = ? AND j.state = 'open'", (partition,)).fetchall()
            for job in jobs:
                state = json.loads(job["bus_state"] or "{}")
                state["pending"] = {}
                tx.execute("UPDATE job_sessions SET seq = 0, pending_seq = NULL, bus_state = ? WHERE job_id = ?",
                           (json.dumps(state), job["job_id"]))
            tx.execute("UPDATE bus_partitions SET snapshot_seq = 0, applied_seq = 0, keep_from = 0,"
                       " stream_created = '' WHERE partition = ?", (partition,))
        return [job["job_id"] for job in jobs]

    # -- gaps: acknowledged lines that did not reach their owner -----------------------------------

    def record_gap(self, job_id: str, partition: int, kind: str, lines: int | None, detail: str) -> None:
        self.db.execute(f"INSERT INTO bus_gaps(job_id, partition, found_at, kind, lines, detail)"
                        f" VALUES (?,?,{_NOW},?,?,?)", (job_id, partition, kind, lines, detail))

    def gaps(self, job_id: str) -> list[dict[str, Any]]:
        return [dict(r) for r in self.db.query(
            "SELECT found_at, kind, lines, detail FROM bus_gaps WHERE job_id = ? ORDER BY id", (job_id,))]

    def acked_lines(self, job_id: str) -> int | None:
        """Lines acknowledged to clients for this job (None: no upload of it was acknowledged yet)."""
        value = self.db.query_value("SELECT lines FROM bus_job_acks WHERE job_id = ?", (job_id,))
        return None if value is None else int(value)

    def job_state(self, job_id: str) -> JobState | None:
        row = self.db.query("SELECT seq, session, bus_state FROM job_sessions WHERE job_id = ?", (job_id,))
        if not row:
            return None
        return JobState(int(row[0]["seq"]), bytes(row[0]["session"]), json.loads(row[0]["bus_state"]))

    def forget_job(self, job_id: str) -> None:
        self.db.execute("DELETE FROM job_sessions WHERE job_id = ?", (job_id,))

    def forget_job_entirely(self, job_id: str) -> None:
        """Retention deleted the job: its session, acknowledged-line count and gaps go too."""
        with self.db.transaction() as tx:
            for table in ("job_sessions", "bus_job_acks", "bus_gaps"):
                tx.execute(f"DELETE FROM {table} WHERE job_id = ?", (job_id,))

    # -- reading --------------------------------------------------------------------------------

    def partitions_table(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self.db.query(
            f"SELECT partition, owner, epoch, lease_until - {_NOW} AS lease_left_s, taken_at, snapshot_seq,"
            " snapshot_at, applied_seq, keep_from, previous_owner FROM bus_partitions ORDER BY partition")]

    def replicas_table(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self.db.query(
            f"SELECT replica, role, url, started_at, heartbeat_at, stopped_at, {_NOW} - heartbeat_at AS silent_s,"
            " (stopped_at IS NULL AND heartbeat_at >= " + _NOW + " - ?) AS alive FROM cluster_replicas"
            " ORDER BY replica", (self.lease_s,))]

    # -- upload keys (Idempotency-Key beyond the bus's duplicate window) -------------------------

    def committed_upload(self, job_id: str, key: str) -> dict[str, Any] | None:
        row = self.db.query_value("SELECT result FROM upload_keys WHERE job_id = ? AND key = ?", (job_id, key))
        return json.loads(row) if row else None

    def acknowledged(self, job_id: str, lines: int, key: str | None, result: dict[str, Any]) -> None:
        """An upload's lines are acknowledged (JetStream has its END): remember its Idempotency-Key
        (answers retries beyond the duplicate window) and count its lines for the job, once per key,
        in one statement."""
        count = ("INSERT INTO bus_job_acks(job_id, lines, requests) {} ON CONFLICT(job_id) DO UPDATE SET"
                 " lines = bus_job_acks.lines + excluded.lines, requests = bus_job_acks.requests + 1")
        if key is None:
            self.db.execute(count.format("VALUES (?, ?, 1)"), (job_id, lines))
            return
        self.db.execute(
            f"WITH k AS (INSERT INTO upload_keys(job_id, key, result, created_at) VALUES (?,?,?,{_NOW})"
            " ON CONFLICT DO NOTHING RETURNING 1) "
            + count.format("SELECT ?, ?, 1 WHERE EXISTS (SELECT 1 FROM k)"),
            (job_id, key, json.dumps(result), job_id, lines))
