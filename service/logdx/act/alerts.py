"""Alerts: tell people (Slack) and systems (signed JSON webhooks) that a job failed, and why.

Alerts leave through a persisted outbox, so that a diagnosis made just before a crash or a restart
is still delivered, and delivered once:

- `Outbox.enqueue(job_id, report)` records one row per configured destination, in one transaction,
  keyed by the diagnosis (job id + category + failure type + root line number). The same diagnosis
  of the same job is never enqueued twice, even by a restarted server: `enqueue` returns False.
- `Outbox.deliver_due()` sends what is due. A 2xx answer is a delivery; anything else (or no answer)
  is retried with capped exponential backoff and jitter, up to `alerts.max_attempts` attempts, after
  which the failure is recorded. `410 Gone` is final at once; `Retry-After` is honoured (capped).
  Rows are claimed with a lease before sending, so two workers on one database do not double-send,
  and a worker that dies mid-send leaves the row to be retried when the lease expires.
- `OutboxWorker` calls `deliver_due()` every half second in a background thread.

Destinations come only from the settings (`alerts.slack`, `alerts.webhooks`), never from a request;
the database stores a destination's fingerprint and a redacted label, not its URL (a Slack webhook
URL is a credential) nor its secret: both are looked up in the settings at send time.

Generic webhooks follow the Standard Webhooks specification (https://www.standardwebhooks.com):
headers `webhook-id` (stable across retries: the receiver's idempotency key), `webhook-timestamp`
(the attempt's time, unix seconds) and `webhook-signature: v1,<base64 HMAC-SHA256>` of
`"{webhook-id}.{webhook-timestamp}.{body}"`, keyed by the secret `whsec_<base64 key>`. `verify()`
is the receiver's side, for tests and for users' own receivers.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import logging
import random
import sqlite3
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlsplit

import httpx

from logdx import __version__
from logdx.act.report import Report
from logdx.config import AlertsSettings
from logdx.store import Database, migrate

log = logging.getLogger(__name__)

__all__ = [
    "Outbox",
    "OutboxWorker",
    "slack_payload",
    "webhook_payload",
    "sign",
    "verify",
    "report_url",
    "DB",
]

EVENT_TYPE = "logdx.diagnosis"
_SECRET_PREFIX = "whsec_"
_CLAIM_BATCH = 50

MIGRATIONS = [
    """
    CREATE TABLE alert_keys (
        dedupe_key TEXT PRIMARY KEY,
        job_id     TEXT NOT NULL,
        report_id  TEXT NOT NULL,
        created_at REAL NOT NULL
    );
    CREATE TABLE alert_outbox (
        id            INTEGER PRIMARY KEY AUTOINCREMENT,
        msg_id        TEXT NOT NULL UNIQUE,
        dedupe_key    TEXT NOT NULL REFERENCES alert_keys(dedupe_key),
        job_id        TEXT NOT NULL,
        report_id     TEXT NOT NULL,
        kind          TEXT NOT NULL,
        dest_key      TEXT NOT NULL,
        dest_label    TEXT NOT NULL,
        body          BLOB NOT NULL,
        created_at    REAL NOT NULL,
        next_at       REAL NOT NULL,
        attempts      INTEGER NOT NULL DEFAULT 0,
        status        TEXT NOT NULL DEFAULT 'pending',
        last_status   INTEGER,
        last_error    TEXT,
        last_attempt_at REAL,
        done_at       REAL,
        UNIQUE (dedupe_key, dest_key)
    );
    CREATE INDEX alert_outbox_due ON alert_outbox(status, next_at);
    CREATE INDEX alert_outbox_job ON alert_outbox(job_id);
    """,
]


# -- the database, whichever way it was handed to us ------------------------------------------------

# sqlite3.Connection takes no weak references: key by id. One adopted Database per bare connection,
# so that alerts and actions sharing it also share its lock and transaction state.
_ADOPTED: dict[int, Database] = {}
_ADOPTED_GUARD = threading.Lock()


class DB:
    """A `store.Database` or a bare `sqlite3.Connection` (opened with `isolation_level=None`),
    used through the Database's lock and transactions. Shared by alerts and actions."""

    def __init__(self, conn: Database | sqlite3.Connection) -> None:
        self.handle = conn
        if isinstance(conn, Database):
            self._db = conn
        else:
            with _ADOPTED_GUARD:
                db = _ADOPTED.get(id(conn))
                if db is None or db.connection is not conn:
                    db = _ADOPTED[id(conn)] = Database.adopt(conn)
            self._db = db
        self._conn = self._db.connection
        self.lock = self._db.lock

    def migrate(self, component: str, migrations: list[str]) -> int:
        with self.lock:
            return migrate(self.handle, component, migrations)

    def execute(self, sql: str, params: Sequence[Any] = ()) -> sqlite3.Cursor:
        with self.lock:
            return self._conn.execute(sql, params)

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        with self.lock:
            cur = self._conn.execute(sql, params)
            names = [d[0] for d in cur.description or ()]
            return [dict(zip(names, tuple(row))) for row in cur.fetchall()]

    @contextmanager
    def transaction(self) -> Iterator[DB]:
        with self._db.transaction():
            yield self


# -- Standard Webhooks signatures -------------------------------------------------------------------


def _secret_key(secret: str) -> bytes:
    """The HMAC key of a `whsec_<base64>` secret (a secret that is not base64 is used as bytes)."""
    raw = secret[len(_SECRET_PREFIX):] if secret.startswith(_SECRET_PREFIX) else secret
    try:
        key = base64.b64decode(raw + "=" * (-len(raw) % 4), validate=True)
    except (binascii.Error, ValueError):
        key = raw.encode()
    if not key:
        raise ValueError("webhook secret is empty")
    return key


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` header value: `v1,<base64 HMAC-SHA256 of "{id}.{ts}.{body}">`."""
    to_sign = f"{msg_id}.{int(timestamp)}.".encode() + body
    digest = hmac.new(_secret_key(secret), to_sign, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode("ascii")


def verify(secret: str, headers: Mapping[str, str], body: bytes, tolerance_s: int = 300) -> bool:
    """True when `headers` carry a valid, fresh Standard Webhooks signature of `body`.

    Headers are matched case-insensitively; the signature header may list several space-separated
    signatures (key rotation): one valid `v1` signature is enough. Stale or future timestamps
    (beyond `tolerance_s`) are rejected, which is what stops replays."""
    h = {k.lower(): v for k, v in headers.items()}
    msg_id, ts, sigs = h.get("webhook-id"), h.get("webhook-timestamp"), h.get("webhook-signature")
    if not (msg_id and ts and sigs):
        return False
    try:
        timestamp = int(ts)
    except ValueError:
        return False
    if abs(time.time() - timestamp) > tolerance_s:
        return False
    try:
        expected = sign(secret, msg_id, timestamp, body).split(",", 1)[1].encode()
    except ValueError:
        return False
    for versioned in sigs.split(" "):
        version, _, sig = versioned.partition(",")
        if version == "v1" and hmac.compare_digest(sig.encode(), expected):
            return True
    return False


# -- payloads --------------------------------------------------------------------------------------


def report_url(public_url: str, report: Report) -> str | None:
    return f"{public_url.rstrip('/')}/v1/reports/{report.id}" if public_url else None


_ACTION_WORDS = {
    "cordon_and_restart": "Cordon the node, then restart",
    "restart": "Restart the job",
    "no_restart": "Do not restart: the owner must fix it",
    "none": "Nothing to do",
}


def _esc(text: str) -> str:
    """Slack mrkdwn escaping (the only three characters Slack wants escaped)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def culprit_text(report: Report) -> str:
    c = report.culprits
    parts = []
    if c.hosts:
        parts.append(", ".join(c.hosts[:8]) + (f" (+{len(c.hosts) - 8})" if len(c.hosts) > 8 else ""))
    if c.ranks:
        parts.append("rank " + ", ".join(str(r) for r in c.ranks[:8]) + (" …" if len(c.ranks) > 8 else ""))
    if c.gpus:
        parts.append("GPU " + ", ".join(c.gpus[:4]))
    return "; ".join(parts)


def slack_payload(job_id: str, report: Report, report_url: str | None) -> dict:
    """A Block Kit message: what failed, where, what to do, and the root line."""
    if report.status == "healthy":
        headline = f"logdx: job {job_id}: no failure found"
    else:
        headline = f"logdx: job {job_id} failed: {report.category or 'unknown'} / {report.failure_type or 'unknown'}"
    culprit = culprit_text(report) or "unknown"
    action = _ACTION_WORDS.get(report.action, report.action)
    fields = [
        ("Job", f"`{_esc(_clip(job_id, 200))}`"),
        ("Category", _esc(report.category or "-")),
        ("Failure type", f"`{_esc(report.failure_type or '-')}`"),
        ("Culprit", _esc(_clip(culprit, 500))),
        ("Action", f"*{_esc(action)}*"),
        ("Confidence", f"{report.confidence:.2f}"),
    ]
    blocks: list[dict[str, Any]] = [
        {"type": "header", "text": {"type": "plain_text", "text": _clip(headline, 150), "emoji": False}},
        {"type": "section", "fields": [{"type": "mrkdwn", "text": f"*{k}*\n{v}"} for k, v in fields]},
    ]
    if report.root_cause is not None:
        rc = report.root_cause
        code = _clip(rc.text, 1500).replace("```", "'''")
        blocks.append({
            "type": "section",
            "text": {"type": "mrkdwn", "text": f"*Root line* (line {rc.line_no})\n```{_esc(code)}```"},
        })
    if report.explanation:
        blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": _esc(_clip(report.explanation, 2000))}})
    context = []
    if report.hint:
        context.append({"type": "mrkdwn", "text": f"*Next:* {_esc(_clip(report.hint, 1500))}"})
    if report_url:
        context.append({"type": "mrkdwn", "text": f"<{report_url}|Open the full report>"})
    if context:
        blocks.append({"type": "context", "elements": context})
    fallback = f"{headline} on {culprit}: {report.action}" if report.status != "healthy" else headline
    return {"text": _clip(fallback, 300), "blocks": blocks}


def webhook_payload(job_id: str, report: Report, report_url: str | None, now: float | None = None) -> dict:
    """The generic webhook body (Standard Webhooks' `type`/`timestamp`/`data` shape)."""
    ts = datetime.fromtimestamp(time.time() if now is None else now, tz=timezone.utc)
    return {
        "type": EVENT_TYPE,
        "timestamp": ts.isoformat().replace("+00:00", "Z"),
        "data": {"job_id": job_id, "report_url": report_url, "report": report.model_dump(mode="json")},
    }


def _body(payload: dict) -> bytes:
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


# -- destinations ----------------------------------------------------------------------------------


def _dest_key(kind: str, url: str) -> str:
    return hashlib.sha256(f"{kind}\n{url}".encode()).hexdigest()[:16]


def _redact(url: str) -> str:
    """Enough of a URL to recognise it, without its credentials (path tokens, query, user info)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or ''}{':' + str(parts.port) if parts.port else ''}"


def _destinations(settings: AlertsSettings) -> list[tuple[str, str, str, str]]:
    """(kind, dest_key, label, url) for every configured destination."""
    out = []
    for i, s in enumerate(settings.slack):
        out.append(("slack", _dest_key("slack", s.webhook_url), f"slack[{i}] {_redact(s.webhook_url)}", s.webhook_url))
    for i, w in enumerate(settings.webhooks):
        parts = urlsplit(w.url)
        label = f"webhook[{i}] {_redact(w.url)}{parts.path}"
        out.append(("webhook", _dest_key("webhook", w.url), label, w.url))
    return out


def dedupe_key(job_id: str, report: Report) -> str:
    line = report.root_cause.line_no if report.root_cause else ""
    return "\x1f".join([job_id, report.category or "", report.failure_type or "", str(line)])


# -- the outbox ------------------------------------------------------------------------------------


class Outbox:
    """The persisted queue of alerts, and their delivery."""

    def __init__(
        self,
        conn: Database | sqlite3.Connection,
        settings: AlertsSettings,
        public_url: str = "",
        clock: Callable[[], float] = time.time,
        on_delivery: Callable[[str, str], None] | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        """`on_delivery(kind, outcome)` is called after every attempt: kind `slack`|`webhook`,
        outcome `ok`|`retry`|`failed` (failed: given up). `counters` counts the same pairs."""
        self.db = DB(conn)
        self.db.migrate("alerts", MIGRATIONS)
        self.settings = settings
        self.public_url = public_url
        self.clock = clock
        self.on_delivery = on_delivery
        self.counters: Counter[tuple[str, str]] = Counter()
        self._transport = transport
        self._client: httpx.Client | None = None
        self._client_lock = threading.Lock()
        self._send_lock = threading.Lock()  # one deliver_due at a time per Outbox

    # -- queueing --

    def enqueue(self, job_id: str, report: Report) -> bool:
        """Queue an alert about `report` for every destination; False when there is nothing to
        send (healthy report, below `alerts.min_confidence`, no destination) or when this
        diagnosis of this job was already queued (by this process or an earlier one)."""
        if report.status != "failed" or report.confidence < self.settings.min_confidence:
            return False
        dests = _destinations(self.settings)
        if not dests:
            return False
        now = self.clock()
        key = dedupe_key(job_id, report)
        url = report_url(self.public_url, report)
        bodies = {
            "slack": _body(slack_payload(job_id, report, url)),
            "webhook": _body(webhook_payload(job_id, report, url, now)),
        }
        with self.db.transaction() as db:
            cur = db.execute(
                "INSERT OR IGNORE INTO alert_keys(dedupe_key, job_id, report_id, created_at) VALUES (?,?,?,?)",
                (key, job_id, report.id, now),
            )
            if cur.rowcount == 0:
                self.counters[("enqueue", "duplicate")] += 1
                return False
            for kind, dkey, label, _url in dests:
                db.execute(
                    "INSERT OR IGNORE INTO alert_outbox(msg_id, dedupe_key, job_id, report_id, kind, dest_key,"
                    " dest_label, body, created_at, next_at) VALUES (?,?,?,?,?,?,?,?,?,?)",
                    ("msg_" + uuid.uuid4().hex, key, job_id, report.id, kind, dkey, label, bodies[kind], now, now),
                )
        self.counters[("enqueue", "ok")] += 1
        return True

    # -- delivery --

    def _http(self) -> httpx.Client:
        with self._client_lock:
            if self._client is None:
                self._client = httpx.Client(
                    timeout=self.settings.timeout_s,
                    follow_redirects=False,
                    transport=self._transport,
                    headers={"user-agent": f"logdx/{__version__}"},
                )
            return self._client

    def close(self) -> None:
        with self._client_lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    def backoff(self, attempts: int) -> float:
        """Delay before the next attempt after `attempts` failed ones: exponential, capped,
        with 'equal jitter' (between half and all of the capped exponential delay)."""
        s = self.settings
        delay = min(s.backoff_max_s, s.backoff_initial_s * (2 ** max(0, attempts - 1)))
        return delay / 2 + random.uniform(0, delay / 2)

    def _claim(self, now: float) -> list[dict[str, Any]]:
        lease = now + self.settings.timeout_s + 30.0
        with self.db.transaction() as db:
            rows = db.query(
                "SELECT id, msg_id, job_id, kind, dest_key, dest_label, body, attempts FROM alert_outbox"
                " WHERE status = 'pending' AND next_at <= ? ORDER BY next_at, id LIMIT ?",
                (now, _CLAIM_BATCH),
            )
            for r in rows:
                db.execute("UPDATE alert_outbox SET next_at = ? WHERE id = ?", (lease, r["id"]))
        return rows

    def deliver_due(self, now: float | None = None) -> int:
        """Send every alert that is due; returns how many were delivered (2xx)."""
        with self._send_lock:
            now = self.clock() if now is None else now
            rows = self._claim(now)
            if not rows:
                return 0
            dests = {dkey: (kind, url) for kind, dkey, _label, url in _destinations(self.settings)}
            secrets = {_dest_key("webhook", w.url): w.secret for w in self.settings.webhooks}
            delivered = 0
            for row in rows:
                delivered += self._deliver_one(row, dests, secrets, now)
            return delivered

    def _deliver_one(self, row: dict[str, Any], dests: dict, secrets: dict, now: float) -> int:
        kind = row["kind"]
        attempts = row["attempts"] + 1
        dest = dests.get(row["dest_key"])
        if dest is None:
            self._finish(row["id"], attempts, "failed", None, "destination no longer configured", now)
            self._count(kind, "failed")
            return 0
        _kind, url = dest
        body = bytes(row["body"])
        headers = {"content-type": "application/json"}
        if kind == "webhook":
            ts = int(time.time())  # the attempt's time, for the receiver's replay check
            headers["webhook-id"] = row["msg_id"]
            headers["webhook-timestamp"] = str(ts)
            secret = secrets.get(row["dest_key"], "")
            if secret:
                headers["webhook-signature"] = sign(secret, row["msg_id"], ts, body)
        status: int | None = None
        retry_after: float | None = None
        try:
            resp = self._http().post(url, content=body, headers=headers)
            status = resp.status_code
            retry_after = _retry_after(resp.headers.get("retry-after"))
            error = None if 200 <= status < 300 else f"HTTP {status}: {_clip(resp.text.strip(), 200)}"
        except httpx.HTTPError as e:
            error = f"{type(e).__name__}: {_clip(str(e), 200) or 'no answer'}"
        except Exception as e:  # noqa: BLE001 - one bad destination must not stop the others
            error = f"{type(e).__name__}: {_clip(str(e), 200)}"
        if error is None:
            self._finish(row["id"], attempts, "delivered", status, None, now)
            self._count(kind, "ok")
            return 1
        if status == 410 or attempts >= self.settings.max_attempts:
            self._finish(row["id"], attempts, "failed", status, error, now)
            self._count(kind, "failed")
            log.warning("alert %s to %s failed for good after %d attempt(s): %s",
                        row["msg_id"], row["dest_label"], attempts, error)
            return 0
        delay = self.backoff(attempts)
        if retry_after is not None:
            delay = max(delay, min(retry_after, self.settings.backoff_max_s))
        self.db.execute(
            "UPDATE alert_outbox SET attempts = ?, next_at = ?, last_status = ?, last_error = ?,"
            " last_attempt_at = ? WHERE id = ?",
            (attempts, now + delay, status, error, now, row["id"]),
        )
        self._count(kind, "retry")
        return 0

    def _finish(self, row_id: int, attempts: int, status: str, http_status: int | None,
                error: str | None, now: float) -> None:
        self.db.execute(
            "UPDATE alert_outbox SET attempts = ?, status = ?, last_status = ?, last_error = ?,"
            " last_attempt_at = ?, done_at = ? WHERE id = ?",
            (attempts, status, http_status, error, now, now, row_id),
        )

    def _count(self, kind: str, outcome: str) -> None:
        self.counters[(kind, outcome)] += 1
        if self.on_delivery is not None:
            try:
                self.on_delivery(kind, outcome)
            except Exception:  # noqa: BLE001 - metrics must not break delivery
                log.exception("alerts on_delivery callback failed")

    # -- inspection --

    _COLUMNS = ("id, msg_id, job_id, report_id, kind, dest_label AS destination, status, attempts, created_at,"
                " next_at, last_attempt_at, done_at, last_status, last_error")

    def pending(self) -> list[dict]:
        return self.db.query(
            f"SELECT {self._COLUMNS} FROM alert_outbox WHERE status = 'pending' ORDER BY next_at, id"
        )

    def history(self, job_id: str | None = None) -> list[dict]:
        if job_id is None:
            return self.db.query(f"SELECT {self._COLUMNS} FROM alert_outbox ORDER BY id")
        return self.db.query(f"SELECT {self._COLUMNS} FROM alert_outbox WHERE job_id = ? ORDER BY id", (job_id,))


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None  # an HTTP date: rare for webhooks; the backoff applies


class OutboxWorker:
    """Delivers the outbox in the background: `deliver_due()` every `interval_s`, or at once
    after `wake()` (call it after `enqueue`)."""

    def __init__(self, outbox: Outbox, interval_s: float = 0.5) -> None:
        self.outbox = outbox
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> OutboxWorker:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="logdx-alerts", daemon=True)
            self._thread.start()
        return self

    def wake(self) -> None:
        self._wake.set()

    def stop(self, timeout: float | None = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.outbox.deliver_due()
            except Exception:  # noqa: BLE001 - keep delivering whatever happens to one round
                log.exception("alert delivery round failed")
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def __enter__(self) -> OutboxWorker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
