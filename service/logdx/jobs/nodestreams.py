"""Node streams: the lines that name a host but no job (the kernel's, journald's kernel transport,
syslog, the NVIDIA driver's `NVRM: Xid`, DCGM or NVSentinel health events), joined to the jobs that ran
on that host by host and time.

On Kubernetes the line that says a GPU fell off the bus is in the node's kernel log, not in any pod's
output; on Slurm the kernel log is often shipped per node apart from the job's stdout. Such records
used to be refused (`no_job`), and the job was diagnosed from a victim's watchdog.

- Kept. A record without a job that names a host is stored in its host's stream (the shared store:
  SQLite, or PostgreSQL with replicas), bounded per host by `nodes.max_events_per_host` and
  `nodes.retain_s`; a record that names neither is refused (422 when nothing else was usable): a 2xx
  never hides a dropped record. Each line is marked `notable` when a rule could match it: only those
  are joined (a kernel's harmless chatter stays in the stream).
- Where jobs ran. Each upload notes, per job, the hosts its lines came from and the time span seen
  there (`nodestream_job_hosts`); the final diagnosis adds the hosts the lines' own prefixes named.
- Joined. A job sees a host's notable events from `nodes.lead_s` before its first line on that host
  to `nodes.after_end_s` after its last line (no end while it is open), at most
  `nodes.max_joined_per_host` per host, each once (`nodestream_joined`, shared by replicas). An open job gets
  them through its own ingestion path, as if one of its streams had sent them (its spool, or the line
  bus to the job's owner in cluster mode): the diagnosis reads them with their host and timestamp, in
  time order with the job's lines. Node events of a host where the job did not run, or outside its
  window, never reach it.
- Late. Kernel logs are often late. When a job ends its session is kept (`nodestream_ended_jobs`) for
  `nodes.reopen_grace_s`; a notable node event of one of its hosts, in its window, that arrives in
  that time re-opens the diagnosis: the saved session takes the event, is diagnosed again, and a
  changed verdict is stored and acted on like any diagnosis change (one alert per distinct
  diagnosis, saying what changed).
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from logdx.act.report import Report
from logdx.config import NodeStreamSettings
from logdx.hosts import HostScope
from logdx.jobs.manager import IngestRequest, JobManager
from logdx.normalize import Source
from logdx.pipeline import Session, SnapshotError
from logdx.store import Store, migrate
from logdx.store_base import StoreError
from logdx.wire.errors import ApiError

log = logging.getLogger("logdx.nodes")

COMPONENT = "node_streams"
_TABLES = """
    CREATE TABLE nodestream_lines (
        id          TEXT PRIMARY KEY,
        host        TEXT NOT NULL,
        ts          {real} NOT NULL,
        received_at {real} NOT NULL,
        notable     INTEGER NOT NULL,
        text        TEXT NOT NULL
    );
    CREATE INDEX nodestream_lines_host_ts ON nodestream_lines(host, notable, ts);
    CREATE INDEX nodestream_lines_host_received ON nodestream_lines(host, received_at);
    CREATE INDEX nodestream_lines_notable_received ON nodestream_lines(notable, received_at);
    CREATE TABLE nodestream_job_hosts (
        job_id   TEXT NOT NULL,
        host     TEXT NOT NULL,
        first_ts {real} NOT NULL,
        last_ts  {real} NOT NULL,
        PRIMARY KEY (job_id, host)
    );
    CREATE INDEX nodestream_job_hosts_host ON nodestream_job_hosts(host);
    CREATE TABLE nodestream_joined (
        job_id   TEXT NOT NULL,
        event_id TEXT NOT NULL,
        PRIMARY KEY (job_id, event_id)
    );
    CREATE TABLE nodestream_ended_jobs (
        job_id    TEXT PRIMARY KEY,
        ended_at  {real} NOT NULL,
        exit_code INTEGER,
        session   {blob} NOT NULL
    );
"""
MIGRATIONS = [_TABLES.format(real="REAL", blob="BLOB")]
PG_MIGRATIONS = [_TABLES.format(real="DOUBLE PRECISION", blob="BYTEA")]

_SPAN_SLACK_S = 60.0  # a job's span on a host is written again only when it grows by more than this
_SPANS_CACHED = 100_000
_SWEEP_EVERY_S = 600.0
_LATE_SCAN_S = 2.0  # cluster workers look this often for late node lines an ingest replica stored
_LATE_SCAN_LINES = 10_000
_LATE_SCAN_OUTAGE_S = 10.0
_LATE_SCAN_LAG_S = 5.0  # lines are read this long after they were stamped: a slow commit is not skipped


@dataclass(frozen=True, slots=True)
class NodeEvent:
    id: str
    host: str
    ts: float
    text: str


@dataclass(frozen=True, slots=True)
class JobOnHost:
    """A job that ran on a host: its span there, and whether (and when) it ended."""

    job_id: str
    first_ts: float
    state: str
    ended_at: float | None


# --- the store ----------------------------------------------------------------------------------------


class NodeStreams:
    """Node lines per host, which jobs ran where and when, what was joined, ended jobs' sessions."""

    def __init__(self, settings: NodeStreamSettings, db: Store) -> None:
        self.settings = settings
        self.db = db
        # Line ids: this process's random prefix and a counter (unique across replicas, cheaper than a uuid each).
        self._id_prefix, self._id_count = uuid.uuid4().hex[:16], itertools.count()  # next(count) is atomic
        migrate(db, COMPONENT, MIGRATIONS, postgres=PG_MIGRATIONS)

    def keep(self, host: str, lines: Iterable[tuple[float, str, bool]], now: float) -> list[NodeEvent]:
        """Store a host's lines (ts, text, notable); returns the notable ones as events. The host's
        stream is then cut to its bounds (count, age)."""
        rows, notable = [], []
        for k, (ts, text, flag) in enumerate(lines):
            event = NodeEvent(f"{self._id_prefix}{next(self._id_count):x}", host, ts, text)
            # arrival order within a batch too: the count bound cuts between lines, never through a batch
            rows.append((event.id, host, ts, now + k * 1e-6, int(flag), text))
            if flag:
                notable.append(event)
        if rows:
            with self.db.transaction():  # one commit for the batch (a statement alone commits itself)
                self.db.executemany("INSERT INTO nodestream_lines(id, host, ts, received_at, notable, text)"
                                    " VALUES (?,?,?,?,?,?)", rows)
                self._bound(host, now)
        return notable

    def _bound(self, host: str, now: float) -> None:
        s = self.settings
        self.db.execute("DELETE FROM nodestream_lines WHERE host = ? AND received_at < ?", (host, now - s.retain_s))
        cut = self.db.query_value("SELECT received_at FROM nodestream_lines WHERE host = ? ORDER BY received_at DESC"
                                  " LIMIT 1 OFFSET ?", (host, s.max_events_per_host))
        if cut is not None:
            self.db.execute("DELETE FROM nodestream_lines WHERE host = ? AND received_at <= ?", (host, cut))

    def lines_of(self, host: str, limit: int) -> list[dict[str, Any]]:
        rows = self.db.query("SELECT ts, received_at, notable, text FROM nodestream_lines WHERE host = ?"
                             " ORDER BY ts DESC LIMIT ?", (host, limit))
        return [{"ts": r["ts"], "received_at": r["received_at"], "notable": bool(r["notable"]), "text": r["text"]}
                for r in rows]

    def note_span(self, job_id: str, host: str, first_ts: float, last_ts: float) -> bool:
        """The job had lines on `host` from `first_ts` to `last_ts`; True when the host is new to it."""
        with self.db.transaction() as conn:
            new = conn.execute("INSERT INTO nodestream_job_hosts(job_id, host, first_ts, last_ts) VALUES (?,?,?,?)"
                               " ON CONFLICT DO NOTHING", (job_id, host, first_ts, last_ts)).rowcount > 0
            if not new:
                conn.execute("UPDATE nodestream_job_hosts SET first_ts = CASE WHEN ? < first_ts THEN ? ELSE first_ts END,"
                             " last_ts = CASE WHEN ? > last_ts THEN ? ELSE last_ts END WHERE job_id = ? AND host = ?",
                             (first_ts, first_ts, last_ts, last_ts, job_id, host))
        return new

    def spans(self, job_id: str) -> dict[str, tuple[float, float]]:
        rows = self.db.query("SELECT host, first_ts, last_ts FROM nodestream_job_hosts WHERE job_id = ?", (job_id,))
        return {r["host"]: (r["first_ts"], r["last_ts"]) for r in rows}

    def jobs_on(self, host: str, ended_since: float) -> list[JobOnHost]:
        """The jobs that ran on `host` and are open, or ended since `ended_since`."""
        rows = self.db.query(
            "SELECT h.job_id, h.first_ts, j.state, j.ended_at FROM nodestream_job_hosts h JOIN api_jobs j"
            " ON j.job_id = h.job_id WHERE h.host = ? AND (j.state = 'open' OR j.ended_at >= ?)", (host, ended_since))
        return [JobOnHost(r["job_id"], r["first_ts"], r["state"], r["ended_at"]) for r in rows]

    def created_at(self, job_id: str) -> float | None:
        return self.db.query_value("SELECT created_at FROM api_jobs WHERE job_id = ?", (job_id,))

    def job_end_ts(self, job_id: str) -> float | None:
        """The last time the job had a line anywhere (its clock: the lines' timestamps)."""
        return self.db.query_value("SELECT MAX(last_ts) FROM nodestream_job_hosts WHERE job_id = ?", (job_id,))

    def notable_between(self, host: str, lo: float, hi: float | None, limit: int,
                        unjoined_to: str | None = None) -> list[NodeEvent]:
        """A host's notable lines from `lo` to `hi` (None: no end), earliest first; with `unjoined_to`,
        only those not joined to that job yet (the limit counts what is left to join)."""
        sql = "SELECT id, host, ts, text FROM nodestream_lines WHERE host = ? AND notable = 1 AND ts >= ?"
        params: list[Any] = [host, lo]
        if unjoined_to is not None:
            sql += (" AND NOT EXISTS (SELECT 1 FROM nodestream_joined j WHERE j.job_id = ?"
                    " AND j.event_id = nodestream_lines.id)")
            params.append(unjoined_to)
        if hi is not None:
            sql += " AND ts <= ?"
            params.append(hi)
        rows = self.db.query(sql + " ORDER BY ts, id LIMIT ?", (*params, limit))
        return [NodeEvent(r["id"], r["host"], r["ts"], r["text"]) for r in rows]

    def notable_received(self, since: float, until: float, limit: int) -> list[NodeEvent]:
        """Notable lines that arrived in (since, until], of any host."""
        rows = self.db.query("SELECT id, host, ts, text FROM nodestream_lines WHERE notable = 1 AND received_at > ?"
                             " AND received_at <= ? ORDER BY received_at LIMIT ?", (since, until, limit))
        return [NodeEvent(r["id"], r["host"], r["ts"], r["text"]) for r in rows]

    def claim(self, job_id: str, events: Iterable[NodeEvent]) -> list[NodeEvent]:
        """The events not yet joined to the job, now marked joined (once, whichever replica asks)."""
        mine = []
        with self.db.transaction() as conn:
            for e in events:
                if conn.execute("INSERT INTO nodestream_joined(job_id, event_id) VALUES (?,?) ON CONFLICT DO NOTHING",
                                (job_id, e.id)).rowcount > 0:
                    mine.append(e)
        return mine

    def unclaim(self, job_id: str, events: Iterable[NodeEvent]) -> None:
        with self.db.transaction():
            self.db.executemany("DELETE FROM nodestream_joined WHERE job_id = ? AND event_id = ?",
                                [(job_id, e.id) for e in events])

    def joined_count(self, job_id: str) -> int:
        return int(self.db.query_value("SELECT COUNT(*) FROM nodestream_joined WHERE job_id = ?", (job_id,)) or 0)

    def save_ended(self, job_id: str, ended_at: float, exit_code: int | None, session: bytes) -> None:
        self.db.execute("INSERT INTO nodestream_ended_jobs(job_id, ended_at, exit_code, session) VALUES (?,?,?,?)"
                        " ON CONFLICT(job_id) DO UPDATE SET session = excluded.session",
                        (job_id, ended_at, exit_code, session))

    def ended(self, job_id: str) -> tuple[float, int | None, bytes] | None:
        rows = self.db.query("SELECT ended_at, exit_code, session FROM nodestream_ended_jobs WHERE job_id = ?", (job_id,))
        if not rows:
            return None
        return rows[0]["ended_at"], rows[0]["exit_code"], bytes(rows[0]["session"])

    def sweep(self, now: float, grace_s: float) -> None:
        """Ended jobs' sessions past their grace, and the join records of jobs that are gone."""
        self.db.execute("DELETE FROM nodestream_ended_jobs WHERE ended_at < ?", (now - grace_s,))
        self.db.execute("DELETE FROM nodestream_job_hosts WHERE job_id NOT IN (SELECT job_id FROM api_jobs)")
        self.db.execute("DELETE FROM nodestream_joined WHERE job_id NOT IN (SELECT job_id FROM api_jobs)")


# --- joining ------------------------------------------------------------------------------------------


class NodeJoiner:
    """Node lines in (uploads), joined to the jobs of their host and time; the job manager's hooks."""

    def __init__(self, settings: NodeStreamSettings, streams: NodeStreams, jobs: JobManager, *,
                 acts: bool = True, ingests: bool = True) -> None:
        self.settings = settings
        self.streams = streams
        self.jobs = jobs
        self.acts = acts  # this replica alerts and acts: it re-opens ended jobs' diagnoses itself
        self.ingests = ingests
        self._stop = threading.Event()
        self._scanner: threading.Thread | None = None
        self._spans: OrderedDict[tuple[str, str], tuple[float, float]] = OrderedDict()
        self._reopen_lock = threading.Lock()  # one re-opened diagnosis at a time in this process
        self._swept = 0.0
        jobs.node_hooks = self

    @property
    def notable(self) -> Callable[[str], bool]:
        """A rule could match the line (what the detector keeps as an event); every line while the
        rules are not loaded yet."""
        engine = self.jobs.engine
        return engine.rules.could_match if engine is not None else (lambda _text: True)

    # -- node lines arrive ------------------------------------------------------------------------

    def receive(self, runs: list[tuple[Source, list[bytes]]]) -> tuple[int, int]:
        """Store node lines (each run names its host), then join the notable ones to the jobs of their
        host and time. Returns the lines stored and the blank ones left out."""
        if not self.ingests:
            raise ApiError(503, "not_ingest", "this replica only diagnoses (server.role: worker); "
                           "send logs to an ingest replica")
        now = time.time()
        by_host: dict[str, list[tuple[float, str, bool]]] = {}
        notable = self.notable
        blank = 0
        for source, lines in runs:
            assert source.host
            ts = source.ts if source.ts is not None else now
            for raw in lines:
                text = raw.decode("utf-8", "replace").rstrip("\r\n")
                if text.strip():
                    by_host.setdefault(source.host, []).append((ts, text, notable(text)))
                else:
                    blank += 1
        self._sweep(now)
        stored = 0
        for host, kept in by_host.items():
            events = self.streams.keep(host, kept, now)
            stored += len(kept)
            if events:
                self._join_new(host, events, now, late=self.acts)
        return stored, blank

    def _join_new(self, host: str, events: list[NodeEvent], now: float, *, late: bool, live: bool = True) -> None:
        """Events new to a host's stream, to the jobs that ran there: open ones (`live`), ended ones
        within the grace window (`late`: only a replica that acts re-opens a diagnosis)."""
        s = self.settings
        for job in self.streams.jobs_on(host, now - s.reopen_grace_s):
            lo = job.first_ts - s.lead_s
            if job.state == "open":
                mine = [e for e in events if e.ts >= lo]
                if mine and live:
                    self._inject(job.job_id, mine[: s.max_joined_per_host])
                continue
            if not late or job.ended_at is None or now - job.ended_at > s.reopen_grace_s:
                continue
            end = self.streams.job_end_ts(job.job_id)
            mine = [e for e in events if e.ts >= lo and (end is None or e.ts <= end + s.after_end_s)]
            if mine:
                self._reopen(job.job_id, mine[: s.max_joined_per_host])

    def _sweep(self, now: float) -> None:
        if now - self._swept >= _SWEEP_EVERY_S:
            self._swept = now
            self.streams.sweep(now, self.settings.reopen_grace_s)

    # -- cluster workers: late lines that an ingest replica stored ------------------------------------------

    def start(self) -> None:
        """On a cluster worker: look for late node lines other replicas stored (they do not act)."""
        self._scanner = threading.Thread(target=self._scan_late, name="logdx-nodes-late", daemon=True)
        self._scanner.start()

    def stop(self) -> None:
        self._stop.set()
        if self._scanner is not None:
            self._scanner.join(10)

    def _scan_late(self) -> None:
        since = time.time() - self.settings.reopen_grace_s
        wait, warned = _LATE_SCAN_S, 0.0
        while not self._stop.wait(wait):
            wait = _LATE_SCAN_S
            try:
                until = time.time() - _LATE_SCAN_LAG_S  # lines committed late are still read (no gap)
                events = self.streams.notable_received(since, until, _LATE_SCAN_LINES)
                by_host: dict[str, list[NodeEvent]] = {}
                for e in events:
                    by_host.setdefault(e.host, []).append(e)
                for host, mine in by_host.items():
                    self._join_new(host, mine, time.time(), late=True, live=False)
                if len(events) == _LATE_SCAN_LINES:
                    log.warning("node streams: more than %d notable node lines in %.0f s; some late ones may not "
                                "re-open a diagnosis", _LATE_SCAN_LINES, until - since)
                since = until
            except StoreError as e:  # an outage: the scan waits it out quietly (it resumes where it stopped)
                wait = _LATE_SCAN_OUTAGE_S
                if time.monotonic() - warned >= 30.0:
                    warned = time.monotonic()
                    log.warning("node streams: the scan for late node lines waits for the store (%s)", e)
            except Exception:
                log.exception("node streams: the scan for late node lines failed (retrying)")

    # -- a job's lines arrive ---------------------------------------------------------------------------

    def job_spans(self, job_id: str, spans: dict[str, tuple[float, float]]) -> None:
        """A committed upload had lines of `job_id` on these hosts over these spans: note them, and
        join what the hosts' streams already hold for the job."""
        for host, (t0, t1) in spans.items():
            known = self._spans.get((job_id, host))
            if known is not None and t0 >= known[0] - _SPAN_SLACK_S and t1 <= known[1] + _SPAN_SLACK_S:
                continue
            self._spans[(job_id, host)] = (min(t0, known[0]), max(t1, known[1])) if known else (t0, t1)
            if len(self._spans) > _SPANS_CACHED:
                self._spans.popitem(last=False)
            if self.streams.note_span(job_id, host, t0, t1):
                held = self.streams.notable_between(host, t0 - self.settings.lead_s, None,
                                                    self.settings.max_joined_per_host, unjoined_to=job_id)
                if held:
                    self._inject(job_id, held)

    def _inject(self, job_id: str, events: list[NodeEvent]) -> None:
        """Feed node events to an open job through its own ingestion path (its spool, or the line bus
        to its owner), as if one of its streams had sent them, each once."""
        job = self.jobs.get(job_id)
        if job is None or job.state != "open":
            return
        mine = self.streams.claim(job_id, events)
        if not mine:
            return
        runs = [(Source(host=e.host, ts=e.ts), [e.text.encode()]) for e in sorted(mine, key=lambda e: e.ts)]
        # Each host's lines were kept only from a sender that may speak for it: they vouch for their host.
        req = IngestRequest("node", scope=HostScope({e.host for e in mine}).spec())
        job.active += 1
        try:
            self.jobs.check_open(job)
            self.jobs.spool_runs(job, req, runs, len(runs))
            self.jobs.finish_request(job, req, ok=True)
            log.info("job %s: %d node event(s) of %s joined", job_id, len(runs),
                     ", ".join(sorted({e.host for e in mine})))
        except (ApiError, StoreError) as e:
            self.streams.unclaim(job_id, mine)  # tried again with the next event or at the job's end
            log.warning("job %s: node events not joined now: %s", job_id, getattr(e, "message", e))
        finally:
            job.active -= 1

    # -- hooks of the job manager ------------------------------------------------------------------------

    def before_final(self, job_id: str, session: Session, exit_code: int | None) -> None:
        """The job ends: join what its hosts' streams hold for it (hosts named by its lines' prefixes
        too), then keep its session for the late events of `nodes.reopen_grace_s`. A failure here is
        logged and the job diagnosed without them (a store outage is raised: the end is tried again)."""
        try:
            self._join_at_end(job_id, session, exit_code)
        except StoreError:
            raise
        except Exception:
            log.exception("job %s: its hosts' node events could not be joined; diagnosed without them", job_id)

    def _join_at_end(self, job_id: str, session: Session, exit_code: int | None) -> None:
        s = self.settings
        self._sweep(time.time())
        summary = session.summary()
        spans = self.streams.spans(job_id)
        first, last = summary.first_ts, summary.last_ts
        if first is None or last is None:  # lines without times: the job's own life, by the clock
            first, last = self.streams.created_at(job_id) or time.time(), time.time()
        for host in summary.hosts:
            if host not in spans:
                self.streams.note_span(job_id, host, first, last)
                spans[host] = (first, last)
        if not spans:
            return
        end = max(t1 for _, t1 in spans.values())
        held: list[NodeEvent] = []
        for host, (t0, _) in spans.items():
            held += self.streams.notable_between(host, t0 - s.lead_s, end + s.after_end_s, s.max_joined_per_host,
                                                 unjoined_to=job_id)
        _feed(session, self.streams.claim(job_id, held))
        if s.reopen_grace_s > 0:
            self.streams.save_ended(job_id, time.time(), exit_code, session.snapshot())

    def _reopen(self, job_id: str, events: list[NodeEvent]) -> None:
        """A late node event of an ended job: diagnose its saved session again with it."""
        engine = self.jobs.engine
        if engine is None:
            return
        with self._reopen_lock:
            saved = self.streams.ended(job_id)
            if saved is None:
                return
            ended_at, exit_code, blob = saved
            try:
                session = Session.restore(engine, blob)
            except SnapshotError as e:
                log.warning("job %s: a late node event not joined: %s", job_id, e)
                return
            mine = self.streams.claim(job_id, events)
            if not mine:
                return
            _feed(session, mine)
            self.streams.save_ended(job_id, ended_at, exit_code, session.snapshot())
            report = session.report(exit_code=exit_code, final=True)
            hosts = ", ".join(sorted({e.host for e in mine}))
            if self.jobs.reopen(job_id, session, report, lambda before: _what_changed(before, report, hosts)):
                log.info("job %s: a late node event of %s changed its diagnosis to %s/%s", job_id, hosts,
                         report.failure_type, report.action)


def _feed(session: Session, events: list[NodeEvent]) -> None:
    """A node's kept lines into a job's session: kept only from a sender that may speak for their host, each
    vouches for its own."""
    for e in sorted(events, key=lambda e: e.ts):
        session.feed(e.text, Source(host=e.host, ts=e.ts, scope=_own(e.host)))


@functools.lru_cache(maxsize=4096)
def _own(host: str) -> HostScope:
    return HostScope({host})


def _what_changed(before: Report | None, after: Report, hosts: str) -> str:
    def verdict(r: Report | None) -> str:
        if r is None:
            return "no diagnosis"
        if r.status != "failed":
            return r.status  # healthy, unknown
        culprit = f" on {', '.join(r.culprits.hosts)}" if r.culprits.hosts else ""
        return f"{r.failure_type} ({r.category}){culprit}, action {r.action}"

    return (f"follow-up: node log lines of {hosts} that arrived after the job ended changed the diagnosis "
            f"from {verdict(before)} to {verdict(after)}")
