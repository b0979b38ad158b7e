"""The per-job spool: an append-only file of every accepted line, so no accepted line is lost.

A job's session (normaliser, Drain miner, detector) lives in memory; the spool is what it is
rebuilt from after a restart. Each request appends DATA records as its body arrives (the lines
of one piece, with their sources) and, when it completes, one END record; the END record is
fsync'd before the client gets its 2xx. A request's lines are applied (fed to the session) only
then, at its END's place in the file: a request that failed or whose client went away applies
nothing, so its retry counts once.

Reading a spool (`Reader`) therefore remembers where each request's DATA records are until its
END comes: an END "ok" commits the first `n` lines of its DATA (`n` is all of them unless a bound
stopped the request early), any other END drops them. DATA of a request whose process died before
its END is dropped too (that client got no 2xx and sends those lines again); DATA of a request still
running in a live process stays pending until its END.

Record: header ``<4s magic><B type><3x><I meta_len><I payload_len><I crc32>``, JSON meta, payload
(the lines joined by LF). A record cut short by a crash fails its length or CRC check; the file
is truncated back to the last whole record before anything is appended after it.

Several server processes may share a spool (uvicorn workers): appends happen under an exclusive
``flock``, and a process first reads what others appended so every process's session sees the
same lines in the same order. Each process holds a lock file while it lives (`InstanceLock`),
which is how a reader tells a dead writer from a live one.
"""

from __future__ import annotations

import fcntl
import json
import os
import struct
import uuid
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

MAGIC = b"LDXS"
HEADER = struct.Struct("<4sB3xIII")
DATA = 1
END = 2
_MAX_META = 64 << 20
_MAX_PAYLOAD = 1 << 30


@dataclass(slots=True)
class Record:
    type: int
    meta: dict[str, Any]
    payload: bytes
    start: int  # file offset of this record
    end: int  # file offset just after this record


class InstanceLock:
    """`<dir>/.instances/<id>.lock`, held (flock) for the life of the process."""

    def __init__(self, spool_dir: Path) -> None:
        self.dir = spool_dir / ".instances"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.id = uuid.uuid4().hex[:16]
        self.path = self.dir / f"{self.id}.lock"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._alive: dict[str, bool] = {self.id: True}

    def is_alive(self, instance: str) -> bool:
        """Whether the process that wrote as `instance` still runs (cached: the dead stay dead)."""
        known = self._alive.get(instance)
        if known is not None:
            return known
        path = self.dir / f"{instance}.lock"
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            self._alive[instance] = False
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True  # alive now; ask again next time
        else:
            self._alive[instance] = False
            path.unlink(missing_ok=True)
            return False
        finally:
            os.close(fd)

    def close(self) -> None:
        try:
            self.path.unlink(missing_ok=True)
            os.close(self._fd)
        except OSError:
            pass


@dataclass(slots=True)
class Pending:
    """A request's DATA records seen so far (their file offsets), waiting for its END."""

    instance: str
    starts: list[int]


@dataclass(slots=True)
class Commit:
    """An END record as read: for an "ok" END, the DATA records (offsets) whose first `lines` lines
    it applies; for others, none."""

    meta: dict[str, Any]
    starts: list[int]

    @property
    def ok(self) -> bool:
        return self.meta.get("st") == "ok"

    @property
    def lines(self) -> int | None:
        n = self.meta.get("n")
        return n if isinstance(n, int) else None


class Spool:
    """One job's append-only record file, and how far this process has read it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        new = not path.exists()
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        if new:
            _fsync_dir(path.parent)
        self.offset = 0  # how far this process has read (and applied)
        self.pending: dict[str, Pending] = {}  # request id -> its DATA records, until its END

    @contextmanager
    def locked(self) -> Iterator[None]:
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def append(self, rtype: int, meta: dict[str, Any], payload: bytes = b"") -> int:
        """Write one record at the end (call under `locked()`); returns where it ends. The reader
        position moves past it only when it was at the end already (this process has then seen
        the record: it is its own)."""
        meta_b = json.dumps(meta, separators=(",", ":"), ensure_ascii=False).encode()
        crc = zlib.crc32(payload, zlib.crc32(meta_b))
        start = self.size()
        data = HEADER.pack(MAGIC, rtype, len(meta_b), len(payload), crc) + meta_b + payload
        view = memoryview(data)
        while view:
            written = os.write(self.fd, view)
            view = view[written:]
        end = start + len(data)
        if self.offset == start:
            self._see(rtype, meta, start)
            self.offset = end
        return end

    def _see(self, rtype: int, meta: dict[str, Any], start: int) -> Pending | None:
        """Note a record as read: DATA waits for its END; an END takes its request's DATA."""
        r = meta.get("r", "")
        if rtype == DATA:
            pending = self.pending.get(r)
            if pending is None:
                pending = self.pending[r] = Pending(meta.get("i", ""), [])
            pending.starts.append(start)
            return None
        return self.pending.pop(r, None)

    def read_new(self, stop: int, is_alive: Callable[[str], bool] | None = None) -> Iterator[Commit]:
        """Read from `offset` to `stop`: remember DATA records, yield each END as a `Commit` (in file
        order: the order requests are applied in). With `is_alive`, the DATA of requests whose
        process is gone is dropped once the end is reached (a replay after a crash)."""
        for rec in self.records(self.offset, stop):
            pending = self._see(rec.type, rec.meta, rec.start)
            self.offset = rec.end
            if rec.type == END:
                yield Commit(rec.meta, pending.starts if pending is not None else [])
        if is_alive is not None:
            for r in [r for r, p in self.pending.items() if not is_alive(p.instance)]:
                del self.pending[r]

    def take_pending(self, request_id: str) -> list[int]:
        """This process's own request: its DATA records, now that it is being committed."""
        pending = self.pending.pop(request_id, None)
        return pending.starts if pending is not None else []

    def data_runs(self, starts: list[int], lines: int | None = None) -> Iterator[list[tuple[Any, list[bytes]]]]:
        """The runs of the DATA records at `starts`, record by record, the first `lines` lines only
        (all when None)."""
        left = lines
        for start in starts:
            if left is not None and left <= 0:
                return
            rec = next(self.records(start), None)
            if rec is None or rec.type != DATA:
                continue
            runs = []
            for src, chunk in decode_runs(rec.meta["s"], rec.payload):
                if left is not None:
                    chunk = chunk[:left]
                    left -= len(chunk)
                runs.append((src, chunk))
            yield runs

    def reset(self) -> None:
        """Forget what was read (a replay from the start follows)."""
        self.offset = 0
        self.pending.clear()

    def sync(self) -> None:
        os.fsync(self.fd)

    def records(self, start: int, stop: int | None = None) -> Iterator[Record]:
        """Whole, valid records from `start`; stops at the end or at the first torn record."""
        end = self.size() if stop is None else stop
        pos = start
        while (frame := self._frame(pos, end)) is not None:
            rtype, body_end = frame
            rec = self._read(rtype, pos, body_end)
            if rec is None:
                return
            yield rec
            pos = body_end

    def ends(self, start: int) -> Iterator[Record]:
        """The END records from `start` (DATA records are skipped by their lengths, never read):
        the ledger of committed requests, cheap to read whatever the spool holds. Stops at the end
        or at the first torn record."""
        end = self.size()
        pos = start
        while (frame := self._frame(pos, end)) is not None:
            rtype, body_end = frame
            if rtype == END:
                rec = self._read(rtype, pos, body_end)
                if rec is None:
                    return
                yield rec
            pos = body_end

    def _frame(self, pos: int, end: int) -> tuple[int, int] | None:
        """(type, where it ends) of the record whose header is at `pos`; None past `end` or when torn."""
        if pos + HEADER.size > end:
            return None
        head = os.pread(self.fd, HEADER.size, pos)
        if len(head) < HEADER.size:
            return None
        magic, rtype, meta_len, payload_len, _ = HEADER.unpack(head)
        if magic != MAGIC or meta_len > _MAX_META or payload_len > _MAX_PAYLOAD:
            return None
        body_end = pos + HEADER.size + meta_len + payload_len
        return (rtype, body_end) if body_end <= end else None

    def _read(self, rtype: int, pos: int, body_end: int) -> Record | None:
        """The record at `pos` (its frame checked), or None when its CRC or meta is broken."""
        whole = os.pread(self.fd, body_end - pos, pos)
        if len(whole) != body_end - pos:
            return None
        _, _, meta_len, _, crc = HEADER.unpack(whole[:HEADER.size])
        body = whole[HEADER.size:]
        if zlib.crc32(body) != crc:
            return None
        try:
            meta = json.loads(body[:meta_len])
        except ValueError:
            return None
        return Record(rtype, meta, body[meta_len:], pos, body_end)

    def truncate(self, offset: int) -> None:
        """Cut a torn tail (call under `locked()`)."""
        os.ftruncate(self.fd, offset)
        os.fsync(self.fd)

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass

    def remove(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def encode_runs(runs: list[tuple[Any, list[bytes]]], scope: str = "") -> tuple[list[list[Any]], bytes]:
    """A batch's runs as (meta, payload): per run [rank, host, ts, stream, n, scope] (`scope`: the hosts its
    sender may speak for, `HostScope.spec`); lines joined by LF."""
    meta = [[s.rank, s.host, s.ts, s.stream, len(lines), scope] for s, lines in runs]
    payload = b"\n".join(chain.from_iterable(lines for _, lines in runs))  # C-level: a flood of lines stays cheap
    return meta, payload


def decode_runs(meta: list[list[Any]], payload: bytes) -> Iterator[tuple[tuple[Any, Any, Any, Any, str], list[bytes]]]:
    """(rank, host, ts, stream, scope) and lines of each run; a run spooled before scopes were kept speaks for no
    host."""
    lines = payload.split(b"\n")
    i = 0
    for rank, host, ts, stream, n, *scope in meta:
        yield (rank, host, ts, stream, scope[0] if scope else ""), lines[i:i + n]
        i += n
