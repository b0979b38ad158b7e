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
"""

from __future__ import annotations

import hashlib
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["Database", "MigrationError", "open_db", "migrate", "schema_version"]

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


class MigrationError(RuntimeError):
    """A component's migrations cannot be applied to this database."""


class Database:
    """One SQLite connection guarded by a re-entrant lock.

    Use ``execute``/``query`` for single statements and ``transaction()`` for several writes that
    must land together. The lock is re-entrant so a component may call ``execute`` inside its own
    ``transaction()``.
    """

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

    @classmethod
    def adopt(cls, conn: sqlite3.Connection) -> Database:
        """Use a connection someone else opened (with `isolation_level=None`, as ours) as a Database:
        same lock discipline and transactions; its pragmas and row factory are left as they are."""
        db = cls.__new__(cls)
        db.path = "<adopted>"
        db._conn = conn
        db.lock = threading.RLock()
        db._in_tx = False
        return db

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
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on error; nested calls join the outer one.

        IMMEDIATE takes the write lock up front, so two processes that read-then-write (e.g. both
        checking a schema version before migrating) serialise instead of deadlocking.
        """
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


def open_db(path: str | Path) -> Database:
    """Open (creating if needed) the database file at ``path``; ``":memory:"`` for tests."""
    return Database(path)


def _checksum(sql: str) -> str:
    # Whitespace-insensitive so re-indenting a migration is not mistaken for changing it.
    return hashlib.sha256(" ".join(sql.split()).encode()).hexdigest()[:16]


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


def schema_version(db: Database | sqlite3.Connection, component: str) -> int:
    """The highest applied version of ``component`` (0 when none)."""
    d = _as_db(db)
    d.execute(_SCHEMA_VERSIONS_DDL)
    v = d.query_value("SELECT MAX(version) FROM schema_versions WHERE component = ?", (component,))
    return int(v or 0)


def migrate(db: Database | sqlite3.Connection, component: str, migrations: list[str]) -> int:
    """Bring ``component``'s schema up to ``len(migrations)``; returns the resulting version.

    Each migration runs in its own transaction together with the row that records it, so a failed
    migration leaves the previous version intact. Safe to call on every start-up and from several
    processes at once (the version check happens inside the write transaction).
    """
    if not component or not component.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"bad component name {component!r}")
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
