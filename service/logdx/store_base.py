"""What every store backend shares: the interface (`Store`), its errors, migration checksums.

`logdx.store` is the SQLite backend and `open_db`; `logdx.store_postgres` the PostgreSQL one.
"""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["IntegrityError", "MigrationError", "Store", "StoreError"]


class MigrationError(RuntimeError):
    """A component's migrations cannot be applied to this database."""


class IntegrityError(sqlite3.IntegrityError):
    """A constraint refused a write (any backend)."""


class StoreError(sqlite3.OperationalError):
    """The store cannot be reached or refused a statement (any backend)."""


class Store(Protocol):
    """What components use of a database, whichever backend holds it."""

    path: str
    dialect: str  # "sqlite" | "postgres"
    skip_locked: str  # appended to a SELECT that claims rows for this process

    def execute(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> Any: ...

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None: ...

    def query(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> list[Any]: ...

    def query_value(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> Any: ...

    def transaction(self, lock: str | None = None) -> Any: ...

    def close(self) -> None: ...


def _checksum(sql: str) -> str:
    # Whitespace-insensitive so re-indenting a migration is not mistaken for changing it.
    return hashlib.sha256(" ".join(sql.split()).encode()).hexdigest()[:16]
