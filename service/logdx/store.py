"""A small SQLite layer shared by the components that keep state (incidents, reports, later jobs).

One database file, opened once per process and shared between threads (the web server's), so the
connection is created with ``check_same_thread=False`` and every use goes through one lock:
sqlite3 connections are not safe for concurrent use, and a single writer is all this service needs.
WAL mode lets other processes (the CLI next to a running server) read while we write.

Each component owns its schema and evolves it alone: it calls ``migrate(db, "incidents", [...])``
with its own ordered list of SQL scripts; version *n* is the list's *n*-th script. Applied
versions are recorded in ``schema_versions(component, version)`` with a checksum, so

- adding a component never touches another component's list;
- an applied migration that was edited afterwards is detected (append a new one instead);
- a database written by a newer logdx (a version we do not know) is refused, not corrupted.

Two backends behind one interface (`Store`): this SQLite file (the embedded default: no server),
and PostgreSQL (`store.url: postgresql://...`, `logdx.store_postgres`), which replicas share. A
component writes its SQL once, in the subset both speak (`ON CONFLICT ... DO NOTHING|UPDATE`,
`IS DISTINCT FROM`, `coalesce`, `RETURNING`), and its schema twice: `migrate(db, name, sqlite_list,
postgres=postgres_list)`, each list versioned on its own. What the dialects do differently is asked
of the store: `transaction(lock=...)` serialises a read-then-write across processes (SQLite's
BEGIN IMMEDIATE already does; PostgreSQL takes an advisory lock), `skip_locked` claims rows no other
replica holds (`FOR UPDATE SKIP LOCKED`; SQLite has one writer). Both raise `IntegrityError` and
`StoreError`, subclasses of sqlite3's, so one `except` serves either backend.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from logdx.store_base import IntegrityError, MigrationError, Store, StoreError, _checksum

__all__ = ["Database", "Expiry", "IntegrityError", "MigrationError", "Store", "StoreError", "delete_expired",
           "expired_keys", "is_url", "migrate", "open_db", "schema_version"]

_BUSY_TIMEOUT_MS = 10_000

_SCHEMA_VERSIONS_DDL = """
CREATE TABLE IF NOT EXISTS schema_versions (
    component  TEXT    NOT NULL,
    version    INTEGER NOT NULL,
    checksum   TEXT    NOT NULL,
    applied_at REAL    NOT NULL,
    PRIMARY KEY (component, version)
)
"""


class Database:
    """One SQLite connection guarded by a re-entrant lock.

    Use ``execute``/``query`` for single statements and ``transaction()`` for several writes that
    must land together. The lock is re-entrant so a component may call ``execute`` inside its own
    ``transaction()``.
    """

    dialect = "sqlite"
    skip_locked = ""  # one writer at a time: a claimed row is nobody else's

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: no implicit BEGINs; transactions are explicit (see transaction()).
        self._conn = sqlite3.connect(
            self.path, check_same_thread=False, isolation_level=None, timeout=_BUSY_TIMEOUT_MS / 1000
        )
        self._conn.row_factory = sqlite3.Row
        self.lock = threading.RLock()
        self._in_tx = False
        with self.lock:
            if self.path != ":memory:":
                self._conn.execute("PRAGMA journal_mode=WAL")
                # NORMAL is durable across application crashes in WAL mode; only a power loss can
                # drop the last commits, which is acceptable for a diagnosis cache.
                self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")
            self._conn.execute("PRAGMA foreign_keys=ON")

    @property
    def connection(self) -> sqlite3.Connection:
        """The raw connection; hold ``lock`` while using it."""
        return self._conn

    def journal_mode(self) -> str:
        return str(self.query_value("PRAGMA journal_mode"))

    def execute(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> sqlite3.Cursor:
        """One statement, for writes (the cursor gives ``rowcount``/``lastrowid``). Read rows with
        ``query``: fetching from this cursor later would happen outside the lock."""
        with self.lock:
            return self._conn.execute(sql, params)

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        with self.lock:
            self._conn.executemany(sql, rows)

    def query(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> list[sqlite3.Row]:
        with self.lock:
            return self._conn.execute(sql, params).fetchall()

    def query_value(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> Any:
        with self.lock:
            row = self._conn.execute(sql, params).fetchone()
        return None if row is None else row[0]

    @contextmanager
    def transaction(self, lock: str | None = None) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on error; nested calls join the outer one.

        IMMEDIATE takes the write lock up front, so two processes that read-then-write (e.g. both
        checking a schema version before migrating) serialise instead of deadlocking. That already
        serialises every writer, whatever `lock` names (PostgreSQL needs the name)."""
        with self.lock:
            if self._in_tx:
                yield self._conn
                return
            self._conn.execute("BEGIN IMMEDIATE")
            self._in_tx = True
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            else:
                self._conn.execute("COMMIT")
            finally:
                self._in_tx = False

    def close(self) -> None:
        with self.lock:
            self._conn.close()

    def __enter__(self) -> Database:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def is_url(location: str | Path) -> bool:
    return str(location).startswith(("postgresql://", "postgres://"))


def open_db(location: str | Path, pool_size: int = 8, timeout_s: float = 5.0) -> Any:
    """Open the store: a SQLite file at ``location`` (created if needed; ``":memory:"`` for tests),
    or a PostgreSQL database when it is a ``postgresql://`` URL (`store.url`; `timeout_s`: how long a
    statement waits for a connection, `store.timeout_s`)."""
    if is_url(location):
        from logdx.store_postgres import PostgresDatabase

        return PostgresDatabase(str(location), pool_size=pool_size, timeout_s=timeout_s)
    return Database(location)


def _statements(script: str) -> list[str]:
    """Split a script into statements; sqlite3.complete_statement understands triggers' BEGIN/END."""
    out: list[str] = []
    buf = ""
    for part in script.split(";"):
        buf += part + ";"
        if sqlite3.complete_statement(buf):
            if buf.strip(" \t\r\n;"):
                out.append(buf.strip())
            buf = ""
    if buf.strip(" \t\r\n;"):
        raise MigrationError(f"incomplete SQL statement at end of migration: {buf.strip()[:80]!r}")
    return out


def _as_db(db: Database | sqlite3.Connection) -> Database:
    if isinstance(db, Database):
        return db
    # A bare connection (tests, scripts): wrap it without taking ownership of its settings.
    wrapper = Database.__new__(Database)
    wrapper.path = "<connection>"
    wrapper._conn = db
    wrapper.lock = threading.RLock()
    wrapper._in_tx = False
    if db.isolation_level is not None:
        raise MigrationError("migrate() needs a connection opened with isolation_level=None")
    return wrapper


def schema_version(db: Any, component: str) -> int:
    """The highest applied version of ``component`` (0 when none)."""
    if getattr(db, "dialect", "sqlite") != "sqlite":
        return int(db.schema_version(component))
    d = _as_db(db)
    d.execute(_SCHEMA_VERSIONS_DDL)
    v = d.query_value("SELECT MAX(version) FROM schema_versions WHERE component = ?", (component,))
    return int(v or 0)


def migrate(db: Any, component: str, migrations: list[str], postgres: list[str] | None = None) -> int:
    """Bring ``component``'s schema up to ``len(migrations)``; returns the resulting version.
    On PostgreSQL the ``postgres`` list is applied instead (its own versions).

    Each migration runs in its own transaction together with the row that records it, so a failed
    migration leaves the previous version intact. Safe to call on every start-up and from several
    processes at once (the version check happens inside the write transaction).
    """
    if not component or not component.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"bad component name {component!r}")
    if getattr(db, "dialect", "sqlite") != "sqlite":
        if postgres is None:
            raise MigrationError(f"{component} has no PostgreSQL schema")
        return db.migrate(component, postgres)
    d = _as_db(db)
    with d.lock:
        d.execute(_SCHEMA_VERSIONS_DDL)
        for version, sql in enumerate(migrations, start=1):
            with d.transaction() as conn:
                applied = conn.execute(
                    "SELECT checksum FROM schema_versions WHERE component = ? AND version = ?",
                    (component, version),
                ).fetchone()
                if applied is not None:
                    if applied[0] != _checksum(sql):
                        raise MigrationError(
                            f"{component} migration {version} was changed after it was applied "
                            f"to {d.path}; never edit an applied migration, append a new one"
                        )
                    continue
                try:
                    for stmt in _statements(sql):
                        conn.execute(stmt)
                except sqlite3.Error as e:
                    raise MigrationError(f"{component} migration {version} failed: {e}") from e
                conn.execute(
                    "INSERT INTO schema_versions(component, version, checksum, applied_at) VALUES (?,?,?,?)",
                    (component, version, _checksum(sql), time.time()),
                )
        current = schema_version(d, component)
    if current > len(migrations):
        raise MigrationError(
            f"{d.path} has {component} schema version {current}, newer than this logdx knows "
            f"({len(migrations)}); upgrade logdx or use another database file"
        )
    return current


# -- retention -------------------------------------------------------------------------------------

_RETENTION_BATCH = 500  # rows per statement: the one connection's lock is never held for long


@dataclass(frozen=True)
class Expiry:
    """Rows of `table` whose `column` (a `time.time()` stamp) is older than a cutoff, among those
    `where` selects. Table, column and condition are the code's own, never user input."""

    table: str
    column: str
    where: str = "1"

    def _condition(self) -> str:
        return f"{self.column} < ? AND ({self.where})"


def expired_keys(db: Database, expiry: Expiry, cutoff: float, key: str, limit: int = _RETENTION_BATCH) -> list[Any]:
    """Up to `limit` values of `key` of the expired rows, oldest first (for deletions a component
    does itself, such as a job with its spool)."""
    rows = db.query(f"SELECT {key} FROM {expiry.table} WHERE {expiry._condition()} ORDER BY {expiry.column} LIMIT ?",
                    (cutoff, limit))
    return [r[0] for r in rows]


def delete_expired(db: Database, expiry: Expiry, cutoff: float) -> int:
    """Delete the expired rows, in batches; returns how many."""
    total = 0
    sql = (f"DELETE FROM {expiry.table} WHERE rowid IN "
           f"(SELECT rowid FROM {expiry.table} WHERE {expiry._condition()} LIMIT {_RETENTION_BATCH})")
    while True:
        n = db.execute(sql, (cutoff,)).rowcount
        total += n
        if n < _RETENTION_BATCH:
            return total
