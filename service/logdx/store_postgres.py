"""The PostgreSQL backend of the store (`store.url: postgresql://...`): what replicas share.

The same interface as the SQLite `Database` (`logdx.store.Store`), over a psycopg 3 connection pool:

- statements are written once, with SQLite's `?` placeholders; they are turned into psycopg's
  `%s` here (and a literal `%` into `%%`), and `rowid` (the retention sweep's batch key) into `ctid`;
- `execute`/`query` outside a transaction take a pooled connection in autocommit mode; inside
  `transaction()` every call of the same thread joins that transaction's connection, as SQLite's
  re-entrant lock does;
- `transaction(lock="name")` takes a transaction-scoped advisory lock first, so that a
  read-then-write (the cordon budget, an alert's dedupe key) is serialised across replicas as
  SQLite's single writer serialises it; `skip_locked` lets each replica claim rows the others
  do not hold (the alert outbox);
- errors come out as `logdx.store.IntegrityError` / `StoreError` (the service answers the latter with
  503 `store_unavailable` and Retry-After).

Outages. A statement waits at most `store.timeout_s` for a connection, and 1 s while the database is
known to be down (a connection broke, or none could be had), so that callers fail fast instead of
queueing behind a dead server. When one pooled connection turns out broken (a restart ends every
session), the others are checked at once in the background rather than failing one request each;
the pool gives up a reconnection attempt after `store.timeout_s` (at least 2 s) and starts afresh,
so a server that is back is used again within about a second or two.

Migrations: each component passes its PostgreSQL scripts (`migrate(..., postgres=[...])`); they are
versioned in the same `schema_versions` table, one migration per transaction, under an advisory lock
so that replicas starting together apply each once.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from logdx.store_base import IntegrityError, MigrationError, StoreError, _checksum

__all__ = ["PostgresDatabase", "Row", "to_pg"]

_SCHEMA_VERSIONS_DDL = """
CREATE TABLE IF NOT EXISTS schema_versions (
    component  TEXT             NOT NULL,
    version    INTEGER          NOT NULL,
    checksum   TEXT             NOT NULL,
    applied_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (component, version)
)
"""
_MIGRATION_LOCK = "logdx:migrations"
_WAIT_WHILE_DOWN_S = 1.0
log = logging.getLogger("logdx.store")


class _Throttle(logging.Filter):
    """psycopg's pool logs every failed reconnection attempt (several a second while the server is
    down): the same message at most once every 30 s."""

    def __init__(self, every_s: float = 30.0) -> None:
        super().__init__()
        self.every_s = every_s
        self._last: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = str(record.msg)
        now = time.monotonic()
        if now - self._last.get(key, -self.every_s) < self.every_s:
            return False
        self._last[key] = now
        return True


_pool_log = logging.getLogger("psycopg.pool")
if not any(isinstance(f, _Throttle) for f in _pool_log.filters):
    _pool_log.addFilter(_Throttle())


class Row(dict):
    """A result row read by name (`row["node"]`) or position (`row[0]`), like sqlite3.Row."""

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, int):
            return tuple(self.values())[key]
        return super().__getitem__(key)


def _row_factory(cursor: Any) -> Any:
    names = [c.name for c in cursor.description or ()]
    return lambda values: Row(zip(names, values))


def to_pg(sql: str) -> str:
    """SQLite-style placeholders to psycopg's, outside quoted text; `%` doubled everywhere."""
    out: list[str] = []
    quoted = False
    for ch in sql:
        if ch == "'":
            quoted = not quoted
        if ch == "%":
            out.append("%%")
        elif ch == "?" and not quoted:
            out.append("%s")
        else:
            out.append(ch)
    text = "".join(out)
    return text.replace("SELECT rowid FROM", "SELECT ctid FROM").replace("WHERE rowid IN", "WHERE ctid IN")


class Result:
    """What `execute` returns: the row count, and the rows of a statement that returns some."""

    def __init__(self, rowcount: int, rows: list[Row]) -> None:
        self.rowcount = rowcount
        self.rows = rows
        self.lastrowid = None  # PostgreSQL has none: use `INSERT ... RETURNING id`

    def fetchone(self) -> Row | None:
        return self.rows[0] if self.rows else None

    def fetchall(self) -> list[Row]:
        return self.rows


class _Tx:
    """The connection of a transaction in progress, with the same `execute` as the database."""

    def __init__(self, db: PostgresDatabase, conn: psycopg.Connection[Any]) -> None:
        self.db = db
        self.conn = conn

    def execute(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> Result:
        return self.db._run(self.conn, sql, params)


class PostgresDatabase:
    dialect = "postgres"
    skip_locked = " FOR UPDATE SKIP LOCKED"

    def __init__(self, url: str, pool_size: int = 8, timeout_s: float = 5.0) -> None:
        self.url = url
        self.path = _redacted(url)  # what messages and the retriever see; never the password
        self.timeout_s = timeout_s
        self._local = threading.local()
        self._down_since: float | None = None  # monotonic: since when the server is known unreachable
        self._checking = threading.Lock()
        connect_timeout = max(2, math.ceil(timeout_s))  # libpq's minimum is 2 s
        try:
            self._pool = ConnectionPool(
                url, min_size=1, max_size=max(2, pool_size), open=True, timeout=timeout_s, name="logdx",
                reconnect_timeout=max(2.0, timeout_s),
                kwargs={"autocommit": True, "row_factory": _row_factory, "connect_timeout": connect_timeout},
            )
            self._pool.wait(timeout=max(10.0, timeout_s))
        except Exception as e:
            pool = getattr(self, "_pool", None)
            if pool is not None:
                pool.close()
            raise StoreError(f"cannot connect to {self.path}: {e}") from e
        self.lock = threading.RLock()  # for callers that hold it around several statements (SQLite's habit)

    # -- outages ------------------------------------------------------------------------------

    def _wait_s(self) -> float:
        return min(_WAIT_WHILE_DOWN_S, self.timeout_s) if self._down_since is not None else self.timeout_s

    def _lost(self, conn: psycopg.Connection[Any] | None = None) -> None:
        """A connection broke, or none could be had: the server is away (a statement's own error,
        on a connection that still works, is not this)."""
        if conn is not None and not (conn.broken or conn.closed):
            return
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning("PostgreSQL at %s unreachable: requests are answered 503 until it is back", self.path)
        if self._checking.acquire(blocking=False):
            threading.Thread(target=self._check_pool, name="logdx-pg-check", daemon=True).start()

    def _check_pool(self) -> None:
        try:
            self._pool.check()  # drops every dead connection at once, and refills
        except Exception:  # noqa: BLE001 - the next statement tells
            pass
        finally:
            self._checking.release()

    def _reached(self) -> None:
        if self._down_since is not None:
            log.warning("PostgreSQL at %s reachable again after %.1f s", self.path, time.monotonic() - self._down_since)
            self._down_since = None

    # -- statements ------------------------------------------------------------------------

    def _run(self, conn: psycopg.Connection[Any], sql: str, params: Sequence[Any] | dict[str, Any]) -> Result:
        try:
            cur = conn.execute(to_pg(sql), params if isinstance(params, dict) else tuple(params))
            rows = cur.fetchall() if cur.description is not None else []
        except psycopg.IntegrityError as e:
            raise IntegrityError(str(e).strip()) from e
        except psycopg.Error as e:
            self._lost(conn)
            raise StoreError(str(e).strip()) from e
        self._reached()
        return Result(cur.rowcount, rows)

    @contextmanager
    def _conn(self) -> Iterator[psycopg.Connection[Any]]:
        current = getattr(self._local, "tx", None)
        if current is not None:
            yield current
            return
        try:
            with self._pool.connection(timeout=self._wait_s()) as conn:
                yield conn
        except psycopg.OperationalError as e:  # no connection within the wait (PoolTimeout), or it broke
            self._lost()
            raise StoreError(str(e).strip()) from e

    def execute(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> Result:
        with self._conn() as conn:
            return self._run(conn, sql, params)

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        with self._conn() as conn:
            try:
                with conn.cursor() as cur:
                    cur.executemany(to_pg(sql), [tuple(r) for r in rows])
            except psycopg.IntegrityError as e:
                raise IntegrityError(str(e).strip()) from e
            except psycopg.Error as e:
                self._lost(conn)
                raise StoreError(str(e).strip()) from e
            self._reached()

    def query(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> list[Row]:
        return self.execute(sql, params).rows

    def query_value(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> Any:
        row = self.execute(sql, params).fetchone()
        return None if row is None else row[0]

    @contextmanager
    def transaction(self, lock: str | None = None) -> Iterator[_Tx]:
        """One transaction; nested calls (same thread) join it. `lock` names an advisory lock held
        until it ends: every transaction taking the same name runs one at a time, cluster-wide."""
        current = getattr(self._local, "tx", None)
        if current is not None:
            if lock is not None:
                self._run(current, "SELECT pg_advisory_xact_lock(hashtext(?))", (lock,))
            yield _Tx(self, current)
            return
        try:
            with self._pool.connection(timeout=self._wait_s()) as conn, conn.transaction():
                self._local.tx = conn
                try:
                    if lock is not None:
                        self._run(conn, "SELECT pg_advisory_xact_lock(hashtext(?))", (lock,))
                    yield _Tx(self, conn)
                finally:
                    self._local.tx = None
        except psycopg.IntegrityError as e:
            raise IntegrityError(str(e).strip()) from e
        except psycopg.Error as e:
            self._lost()
            raise StoreError(str(e).strip()) from e

    # -- migrations ---------------------------------------------------------------------------

    def schema_version(self, component: str) -> int:
        self.execute(_SCHEMA_VERSIONS_DDL)
        v = self.query_value("SELECT MAX(version) FROM schema_versions WHERE component = ?", (component,))
        return int(v or 0)

    def migrate(self, component: str, migrations: list[str]) -> int:
        with self.transaction(lock=_MIGRATION_LOCK) as tx:
            tx.execute(_SCHEMA_VERSIONS_DDL)
        for version, sql in enumerate(migrations, start=1):
            with self.transaction(lock=_MIGRATION_LOCK) as tx:
                applied = tx.execute("SELECT checksum FROM schema_versions WHERE component = ? AND version = ?",
                                     (component, version)).fetchone()
                if applied is not None:
                    if applied[0] != _checksum(sql):
                        raise MigrationError(
                            f"{component} migration {version} was changed after it was applied to {self.path}; "
                            "never edit an applied migration, append a new one")
                    continue
                try:
                    tx.conn.execute(sql)  # the whole script at once: no parameters, `$$` bodies intact
                except psycopg.Error as e:
                    raise MigrationError(f"{component} migration {version} failed: {e}") from e
                tx.execute("INSERT INTO schema_versions(component, version, checksum, applied_at) VALUES (?,?,?,?)",
                           (component, version, _checksum(sql), time.time()))
        current = self.schema_version(component)
        if current > len(migrations):
            raise MigrationError(
                f"{self.path} has {component} schema version {current}, newer than this logdx knows "
                f"({len(migrations)}); upgrade logdx or use another database")
        return current

    def close(self) -> None:
        self._pool.close()

    def __enter__(self) -> PostgresDatabase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _redacted(url: str) -> str:
    """The URL without its password (it goes into logs and messages)."""
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    if not at:
        return url
    user = creds.split(":", 1)[0]
    return f"{scheme}{sep}{user}@{host}"
