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
- errors come out as `logdx.store.IntegrityError` / `StoreError`.

Migrations: each component passes its PostgreSQL scripts (`migrate(..., postgres=[...])`); they are
versioned in the same `schema_versions` table, one migration per transaction, under an advisory lock
so that replicas starting together apply each once.
"""

from __future__ import annotations

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
_CONNECT_TIMEOUT_S = 10


class Row(dict):  # type: ignore[type-arg]
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

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn

    def execute(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> Result:
        return _run(self.conn, sql, params)


def _run(conn: psycopg.Connection[Any], sql: str, params: Sequence[Any] | dict[str, Any]) -> Result:
    try:
        cur = conn.execute(to_pg(sql), params if isinstance(params, dict) else tuple(params))
        rows = cur.fetchall() if cur.description is not None else []
        return Result(cur.rowcount, rows)
    except psycopg.IntegrityError as e:
        raise IntegrityError(str(e).strip()) from e
    except psycopg.Error as e:
        raise StoreError(str(e).strip()) from e


class PostgresDatabase:
    dialect = "postgres"
    skip_locked = " FOR UPDATE SKIP LOCKED"

    def __init__(self, url: str, pool_size: int = 8) -> None:
        self.url = url
        self.path = _redacted(url)  # what messages and the retriever see; never the password
        self._local = threading.local()
        try:
            self._pool = ConnectionPool(
                url, min_size=1, max_size=max(2, pool_size), open=True, timeout=30.0, name="logdx",
                kwargs={"autocommit": True, "row_factory": _row_factory, "connect_timeout": _CONNECT_TIMEOUT_S},
            )
            self._pool.wait(timeout=_CONNECT_TIMEOUT_S)
        except Exception as e:
            pool = getattr(self, "_pool", None)
            if pool is not None:
                pool.close()
            raise StoreError(f"cannot connect to {self.path}: {e}") from e
        self.lock = threading.RLock()  # for callers that hold it around several statements (SQLite's habit)

    # -- statements ------------------------------------------------------------------------

    @contextmanager
    def _conn(self) -> Iterator[psycopg.Connection[Any]]:
        current = getattr(self._local, "tx", None)
        if current is not None:
            yield current
            return
        try:
            with self._pool.connection() as conn:
                yield conn
        except psycopg.OperationalError as e:
            raise StoreError(str(e).strip()) from e

    def execute(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> Result:
        with self._conn() as conn:
            return _run(conn, sql, params)

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        with self._conn() as conn:
            try:
                with conn.cursor() as cur:
                    cur.executemany(to_pg(sql), [tuple(r) for r in rows])
            except psycopg.IntegrityError as e:
                raise IntegrityError(str(e).strip()) from e
            except psycopg.Error as e:
                raise StoreError(str(e).strip()) from e

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
                _run(current, "SELECT pg_advisory_xact_lock(hashtext(?))", (lock,))
            yield _Tx(current)
            return
        try:
            with self._pool.connection() as conn, conn.transaction():
                self._local.tx = conn
                try:
                    if lock is not None:
                        _run(conn, "SELECT pg_advisory_xact_lock(hashtext(?))", (lock,))
                    yield _Tx(conn)
                finally:
                    self._local.tx = None
        except psycopg.IntegrityError as e:
            raise IntegrityError(str(e).strip()) from e
        except psycopg.Error as e:
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
