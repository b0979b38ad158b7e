"""The error catalog as a prebuilt SQLite index: what `Catalog` computes from its 23k entries at every
load (~2.3 CPU-s and ~90 MB: parse, mask, tokenise, weigh), computed once and read a row at a time.

`Catalog.match` runs unchanged on an index: its tables (entries, patterns, anchors, postings and
weights, Xid codes, symbols) are views that fetch a row the first time it is asked for, so a diagnosis
costs the few rows its root line's words reach, and the answers are the in-memory catalog's by
construction (tests/test_startup_caches.py compares both on a sample of lines).

The index is built at install time (`make catalog-index`, the Dockerfile) next to the catalog
(`kb/catalog.index.sqlite`), and records the sha256 of the catalog it was built from and its own
format: an index of another catalog, of another format, or one SQLite cannot read, is never used.
Without a usable one (a fresh clone, a read-only site), the first process that needs the catalog
builds one into the data dir's cache; when even that cannot be written, the catalog is parsed in
memory as before.

    python -m logdx.diagnose.catalog_index [PATH]    # build (default: next to the catalog)
"""

from __future__ import annotations

import array
import gzip
import hashlib
import json
import os
import sqlite3
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from logdx.diagnose.catalog import CATALOG_PATH, Catalog, CatalogEntry, _Pattern

INDEX_FORMAT = 1
SHIPPED_INDEX = CATALOG_PATH.with_name("catalog.index.sqlite")
_MISSING = object()


_HERE = Path(__file__).resolve().parent
# What an index's rows are computed by besides the catalog: a change to the masking or the indexing
# is a new index, as a new catalog is.
_CODE = (_HERE / "catalog.py", _HERE / "catalog_index.py", _HERE.parent / "patterns.py")


def source_sha(path: Path = CATALOG_PATH) -> str:
    """The sha256 an index of the catalog at `path` must record: of the catalog and of the code that indexes it."""
    h = hashlib.sha256(path.read_bytes())
    for code in _CODE:
        h.update(hashlib.sha256(code.read_bytes()).digest())
    return h.hexdigest()


def _ints(values: list[int]) -> bytes:
    return array.array("i", values).tobytes()


def _unints(blob: bytes) -> list[int]:
    out = array.array("i")
    out.frombytes(blob)
    return out.tolist()


def build_index(path: Path, *, source: Path = CATALOG_PATH, catalog_sha: str | None = None,
                built: Catalog | None = None) -> None:
    """Write the index of the catalog at `source` to `path` (atomically: a temporary file renamed).
    `built`: that catalog already parsed; `catalog_sha`: the catalog the index says it was built from."""
    raw = _raw_entries(source)
    cat = built if built is not None else Catalog([CatalogEntry.from_json(json.loads(line)) for line in raw])
    sha = catalog_sha or source_sha(source)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".catalog-index-", suffix=".sqlite", dir=path.parent)
    os.close(fd)
    try:
        db = sqlite3.connect(tmp)
        try:
            _write(db, cat, raw, sha)
        finally:
            db.close()
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _raw_entries(source: Path) -> list[str]:
    with gzip.open(source, "rt", encoding="utf-8") as f:
        return [line for line in f if line.strip()]  # as Catalog.load reads it


def _write(db: sqlite3.Connection, cat: Catalog, raw: list[str], sha: str) -> None:
    db.executescript("""
        PRAGMA journal_mode = OFF; PRAGMA synchronous = OFF;
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE entries (i INTEGER PRIMARY KEY, id TEXT NOT NULL, raw TEXT NOT NULL);
        CREATE INDEX entries_id ON entries (id);
        CREATE TABLE patterns (i INTEGER PRIMARY KEY, entry INTEGER NOT NULL, text TEXT NOT NULL,
                               pieces TEXT NOT NULL, required TEXT NOT NULL, literal INTEGER NOT NULL,
                               tokens TEXT NOT NULL, norm REAL NOT NULL);
        CREATE TABLE anchors (word TEXT PRIMARY KEY, patterns BLOB NOT NULL) WITHOUT ROWID;
        CREATE TABLE postings (word TEXT PRIMARY KEY, idf REAL NOT NULL, patterns BLOB NOT NULL) WITHOUT ROWID;
        CREATE TABLE xids (code INTEGER PRIMARY KEY, entry INTEGER NOT NULL);
        CREATE TABLE symbols (symbol TEXT PRIMARY KEY, entry INTEGER NOT NULL) WITHOUT ROWID;
    """)
    db.executemany("INSERT INTO entries VALUES (?, ?, ?)", ((i, e.id, raw[i]) for i, e in enumerate(cat.entries)))
    db.executemany("INSERT INTO patterns VALUES (?, ?, ?, ?, ?, ?, ?, ?)", (
        (i, p.entry, p.text, json.dumps(p.pieces), json.dumps(sorted(p.required)), p.literal,
         json.dumps(sorted(p.tokens)), cat._norms[i]) for i, p in enumerate(cat._patterns)))
    db.executemany("INSERT INTO anchors VALUES (?, ?)", ((w, _ints(ps)) for w, ps in cat._anchors.items()))
    db.executemany("INSERT INTO postings VALUES (?, ?, ?)",
                   ((w, cat._idf[w], _ints(ps)) for w, ps in cat._postings.items()))
    db.executemany("INSERT INTO xids VALUES (?, ?)", cat._xids.items())
    db.executemany("INSERT INTO symbols VALUES (?, ?)", cat._symbols.items())
    meta = {"format": INDEX_FORMAT, "catalog_sha256": sha, "entries": len(cat.entries),
            "patterns": len(cat._patterns), "postings": len(cat._postings), "symbols": len(cat._symbols),
            "anchors": len(cat._anchors), "xids": len(cat._xids)}
    db.executemany("INSERT INTO meta VALUES (?, ?)", ((k, str(v)) for k, v in meta.items()))
    db.commit()


class _Rows(dict[Any, Any]):
    """A table of the index seen as the dict (or, keyed by position, the list) `Catalog` holds in
    memory: a row is fetched the first time it is asked for, then remembered."""

    def __init__(self, fetch: Callable[[Any], Any], size: int) -> None:
        super().__init__()
        self._fetch = fetch
        self._size = size

    def get(self, key: Any, default: Any = None) -> Any:
        if dict.__contains__(self, key):
            value = dict.__getitem__(self, key)
        else:
            value = self._fetch(key)
            dict.__setitem__(self, key, value)
        return default if value is _MISSING else value

    def __getitem__(self, key: Any) -> Any:
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise KeyError(key)
        return value

    def __contains__(self, key: object) -> bool:
        return self.get(key, _MISSING) is not _MISSING

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0


@dataclass
class CatalogIndex:
    """An opened index: `catalog` is a `Catalog` whose tables are the index's rows."""

    path: Path
    catalog: Catalog
    db: sqlite3.Connection

    @classmethod
    def open(cls, path: Path, sha: str | None = None) -> CatalogIndex | None:
        """The index at `path` if it is one of this format built from the shipped catalog (`sha`:
        its sha256, computed when not given); None otherwise (absent, stale, unreadable)."""
        if not path.is_file():
            return None
        try:
            db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro&immutable=1", uri=True, check_same_thread=False)
        except sqlite3.Error:
            return None
        try:
            meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
            if meta.get("format") != str(INDEX_FORMAT) or meta.get("catalog_sha256") != (sha or source_sha()):
                db.close()
                return None
            counts = {k: int(meta[k]) for k in ("entries", "patterns", "postings", "symbols", "anchors", "xids")}
        except (sqlite3.Error, KeyError, ValueError, OSError):
            db.close()
            return None
        return cls(path, _catalog_over(db, counts), db)

    def __len__(self) -> int:
        return len(self.catalog)

    def match(self, line: str, exception_type: str | None = None, limit: int = 5) -> list[Any]:
        return self.catalog.match(line, exception_type, limit)


def _catalog_over(db: sqlite3.Connection, counts: dict[str, int]) -> Catalog:
    lock = threading.Lock()  # one connection, shared by the threads of a server

    def one(sql: str, decode: Callable[[tuple[Any, ...]], Any]) -> Callable[[Any], Any]:
        def fetch(key: Any) -> Any:
            with lock:
                row = db.execute(sql, (key,)).fetchone()
            return _MISSING if row is None else decode(row)
        return fetch

    def entry(row: tuple[Any, ...]) -> CatalogEntry:
        return CatalogEntry.from_json(json.loads(row[0]))

    def pattern(row: tuple[Any, ...]) -> _Pattern:
        return _Pattern(row[0], row[1], tuple(json.loads(row[2])), frozenset(json.loads(row[3])), row[4],
                        frozenset(json.loads(row[5])))

    cat = Catalog.__new__(Catalog)  # no __post_init__: the index is already built
    cat.entries = _Rows(one("SELECT raw FROM entries WHERE i = ?", entry), counts["entries"])  # type: ignore[assignment]
    cat._patterns = _Rows(one("SELECT entry, text, pieces, required, literal, tokens FROM patterns WHERE i = ?",  # type: ignore[assignment]
                              pattern), counts["patterns"])
    cat._norms = _Rows(one("SELECT norm FROM patterns WHERE i = ?", lambda r: r[0]), counts["patterns"])  # type: ignore[assignment]
    cat._anchors = _Rows(one("SELECT patterns FROM anchors WHERE word = ?", lambda r: _unints(r[0])), counts["anchors"])
    cat._postings = _Rows(one("SELECT patterns FROM postings WHERE word = ?", lambda r: _unints(r[0])),
                          counts["postings"])
    cat._idf = _Rows(one("SELECT idf FROM postings WHERE word = ?", lambda r: r[0]), counts["postings"])
    cat._xids = _Rows(one("SELECT entry FROM xids WHERE code = ?", lambda r: r[0]), counts["xids"])
    cat._symbols = _Rows(one("SELECT entry FROM symbols WHERE symbol = ?", lambda r: r[0]), counts["symbols"])
    cat._by_id = _Rows(one("SELECT i FROM entries WHERE id = ? ORDER BY i DESC LIMIT 1", lambda r: r[0]),
                       counts["entries"])  # the last of an id, as Catalog's own index keeps
    return cat


def cached_index_path(cache_dir: Path, sha: str) -> Path:
    return cache_dir / f"catalog-{sha[:16]}.sqlite"


def find_or_build(shipped: Path = SHIPPED_INDEX, cache_dir: Path | None = None,
                  parsed: Callable[[], Catalog] | None = None) -> CatalogIndex | None:
    """The shipped index, else the data dir's (`cache_dir`), else one built there now (from `parsed()`,
    the catalog parsed in memory, when given); None when none can be had (no cache dir, or it cannot
    be written): then the catalog is parsed in memory."""
    sha = source_sha()
    found = CatalogIndex.open(shipped, sha)
    if found is not None or cache_dir is None:
        return found
    path = cached_index_path(cache_dir, sha)
    found = CatalogIndex.open(path, sha)
    if found is not None:
        return found
    try:
        build_index(path, catalog_sha=sha, built=parsed() if parsed is not None else None)
    except (OSError, sqlite3.Error):
        return None
    return CatalogIndex.open(path, sha)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0]) if args else SHIPPED_INDEX
    build_index(path)
    found = CatalogIndex.open(path)
    if found is None:
        print(f"{path}: built but not readable as an index", file=sys.stderr)
        return 1
    print(f"{path}: {len(found):,} catalog entries indexed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
