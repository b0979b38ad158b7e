"""Reading flight-recorder dumps: a directory of per-rank files, or one file.

torch writes one file per rank, named `<prefix><rank>` (`TORCH_FR_DUMP_TEMP_FILE`, formerly
`TORCH_NCCL_DEBUG_INFO_TEMP_FILE`, default prefix `/tmp/nccl_trace_rank_`): a pickle of plain data
(`torch._C._distributed_c10d._dump_fr_trace()`), or the same content as JSON when saved from
`_dump_fr_trace_json()` or the debug server's `/fr_trace_json`. Both are read here, gzipped or not,
through a bounded, refusing unpickler (`safepickle`): the files come from users.

The fields are read by name, so every format version torch has written reads the same way: 2.x
(`collective_seq_id`/`p2p_seq_id`/`op_id`, `process_group` as (name, desc), `pg_config`,
`pg_status`, dtypes, `is_p2p`, `timeout_ms`, thread fields, `nccl_version` then `comm_lib_version`)
and the 1.x dumps before them (`seq_id`, groups known by `pg_id` only)."""

from __future__ import annotations

import gc
import gzip
import io
import json
import os
import pickle
import re
import sys
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from logdx.flightrec.model import DumpSet, Frame, FrDumpError, FrEntry, FrLimits, PgConfig, RankTrace, Skipped
from logdx.flightrec.safepickle import RefusedPickle, unpickle

__all__ = ["load_dump_bytes", "load_dump_file", "load_dumps", "rank_of"]

_SUFFIXES = (".gz", ".json", ".pkl", ".pickle", ".pk", ".bin", ".dump")
_RANK_AT_END = re.compile(r"^(.*?)(\d{1,9})$")
_READ_ERRORS = (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError,
                OverflowError, MemoryError, RecursionError, UnicodeError)
KNOWN_MAJOR = 2


def rank_of(name: str) -> tuple[str, int] | None:
    """("nccl_trace_rank_", 17) for "nccl_trace_rank_17" (also with .gz/.json/.pkl), None when the name
    does not end in a rank."""
    base = name
    changed = True
    while changed:
        changed = False
        for suffix in _SUFFIXES:
            if base.lower().endswith(suffix) and len(base) > len(suffix):
                base, changed = base[: -len(suffix)], True
    m = _RANK_AT_END.match(base)
    return (m.group(1), int(m.group(2))) if m else None


def load_dumps(path: Path | str, limits: FrLimits | None = None) -> DumpSet:
    """The rank traces in `path`: a directory of per-rank dumps (walked recursively; files named
    `<prefix><rank>`, the most common prefix wins) or one dump file.

    A file in a directory that cannot be read (corrupt, truncated, a pickle asking for code) is
    skipped and listed in `DumpSet.skipped`, its rank then counts as one without a dump. Raises
    `FrDumpError` when nothing can be read, for a bad single file, or when a bound is exceeded."""
    limits = limits or FrLimits()
    p = Path(path)
    if not p.exists():
        raise FrDumpError(f"{p}: no such file or directory")
    if p.is_file():
        named = rank_of(p.name)
        if named is None:
            raise FrDumpError(f"{p}: cannot tell the rank from the file name (torch names dumps <prefix><rank>, "
                              "e.g. nccl_trace_rank_17)")
        return DumpSet([load_dump_file(p, named[1], limits)])
    if not p.is_dir():
        raise FrDumpError(f"{p}: neither a file nor a directory")
    return _load_dir(p, limits)


def _load_dir(root: Path, limits: FrLimits) -> DumpSet:
    files, notes = _dump_files(root, limits)
    total = 0
    for f, _ in files:
        try:
            total += f.stat().st_size
        except OSError as e:
            raise FrDumpError(f"{f}: cannot read ({e.strerror})") from None
    if total > limits.max_total_bytes:
        raise FrDumpError(f"{root}: {total / 2**20:.0f} MiB of dumps, more than the {limits.max_total_bytes / 2**20:.0f} "
                          "MiB read at once: point at fewer ranks")
    keep = min(limits.keep_entries_per_rank, max(64, limits.max_total_entries // max(1, len(files))))
    traces: list[RankTrace] = []
    skipped: list[Skipped] = []
    read = 0
    for f, rank in files:
        try:
            trace = load_dump_file(f, rank, limits, keep=keep)
        except FrDumpError as e:
            skipped.append(Skipped(str(f), rank, str(e)))
            continue
        traces.append(trace)
        read += trace.size_bytes
        if read > limits.max_total_bytes:  # gzipped dumps can hold more than their files' sizes said
            raise FrDumpError(f"{root}: more than {limits.max_total_bytes / 2**20:.0f} MiB of dumps once gunzipped, "
                              "more than read at once: point at fewer ranks")
    if not traces:
        reasons = "; ".join(s.reason for s in skipped[:3])
        raise FrDumpError(f"{root}: none of the {len(files)} dump files could be read: {reasons}")
    dropped = sum(1 for t in traces if t.entries_dropped)
    if dropped:
        notes.append(f"{dropped} of {len(traces)} dumps held more than {keep} entries: the newest {keep} entries "
                     "of each were analysed")
    return DumpSet(sorted(traces, key=lambda t: t.rank), skipped, notes)


def _walk(root: Path, limits: FrLimits) -> Iterator[Path]:
    seen = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            seen += 1
            if seen > limits.max_dir_entries:
                raise FrDumpError(f"{root}: more than {limits.max_dir_entries} files: point at one job's dump directory")
            if not name.startswith("."):
                yield Path(dirpath) / name


def _dump_files(root: Path, limits: FrLimits) -> tuple[list[tuple[Path, int]], list[str]]:
    """The files of the most common `<prefix><rank>` family under `root`, and notes on the others."""
    families: dict[str, list[tuple[Path, int]]] = defaultdict(list)
    other = 0
    for f in _walk(root, limits):
        named = rank_of(f.name)
        if named is None or not f.is_file():
            other += 1
            continue
        families[named[0]].append((f, named[1]))
    if not families:
        raise FrDumpError(f"{root}: no flight-recorder dumps (files named <prefix><rank>, e.g. nccl_trace_rank_0)")
    prefix = max(families, key=lambda k: (len(families[k]), "trace" in k or "rank" in k, k))
    files = sorted(families[prefix], key=lambda fr: fr[1])
    notes: list[str] = []
    if len(files) > limits.max_files:
        raise FrDumpError(f"{root}: {len(files)} dump files, more than the {limits.max_files} read at once")
    by_rank: dict[int, Path] = {}
    for f, rank in files:
        if rank in by_rank:
            raise FrDumpError(f"{root}: two dumps for rank {rank} ({by_rank[rank]} and {f}): point at one job's dumps")
        by_rank[rank] = f
    ignored = sum(len(v) for k, v in families.items() if k != prefix) + other
    if ignored:
        notes.append(f"{ignored} other files under {root} ignored (dumps read: {prefix or '<rank>'}*)")
    return files, notes


def load_dump_file(path: Path | str, rank: int, limits: FrLimits | None = None, *, keep: int | None = None) -> RankTrace:
    """One rank's dump; `FrDumpError` naming the file when it is not a readable flight-recorder dump."""
    limits = limits or FrLimits()
    p = Path(path)
    return _from_bytes(_read_bounded(p, limits), str(p), rank, limits, keep)


def load_dump_bytes(name: str, data: bytes, limits: FrLimits | None = None, rank: int | None = None) -> RankTrace:
    """One rank's dump from its bytes (an upload), `name` its file name (the rank is read from it
    unless given); the same checks and bounds as a file."""
    limits = limits or FrLimits()
    if rank is None:
        named = rank_of(Path(name).name)
        if named is None:
            raise FrDumpError(f"{name}: cannot tell the rank from the file name (torch names dumps <prefix><rank>)")
        rank = named[1]
    if data[:2] == b"\x1f\x8b" or len(data) > limits.max_file_bytes:
        data = _bounded(io.BytesIO(data), name, limits)
    if not data:
        raise FrDumpError(f"{name}: empty file")
    return _from_bytes(data, name, rank, limits, None)


def _from_bytes(data: bytes, label: str, rank: int, limits: FrLimits, keep: int | None) -> RankTrace:
    with _no_cyclic_gc():
        obj, fmt = _decode(data, label)
        if not isinstance(obj, dict):
            raise FrDumpError(f"{label}: not a flight-recorder dump (a {type(obj).__name__}, not a dict with 'entries')")
        try:
            trace = _trace(obj, rank, label, fmt, limits, keep if keep is not None else limits.keep_entries_per_rank)
            trace.size_bytes = len(data)
            return trace
        except _BadField as e:
            raise FrDumpError(f"{label}: not a flight-recorder dump torch wrote: {e}") from None


@contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """A dump unpickles into hundreds of thousands of small acyclic containers, on which the cyclic
    collector runs again and again for nothing (a third of the reading time); off for one file."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _read_bounded(p: Path, limits: FrLimits) -> bytes:
    try:
        with p.open("rb") as f:
            data = _bounded(f, str(p), limits)
    except OSError as e:
        raise FrDumpError(f"{p}: cannot read ({e.strerror})") from None
    if not data:
        raise FrDumpError(f"{p}: empty file")
    return data


def _bounded(f: BinaryIO, label: str, limits: FrLimits) -> bytes:
    """At most `max_file_bytes` of `f`, gunzipped when it is gzip (a bomb stops at the bound)."""
    cap = limits.max_file_bytes
    data = f.read(cap + 1)
    if data[:2] == b"\x1f\x8b":
        try:
            with gzip.GzipFile(fileobj=io.BytesIO(data)) as g:
                data = g.read(cap + 1)
        except (OSError, EOFError, zlib.error) as e:
            raise FrDumpError(f"{label}: a broken gzip file ({e})") from None
    if len(data) > cap:
        raise FrDumpError(f"{label}: larger than {cap / 2**20:.0f} MiB, the most read from one dump")
    return data


def _decode(data: bytes, p: str) -> tuple[Any, str]:
    if data[:1] == b"\x80":
        try:
            return unpickle(data), "pickle"
        except RefusedPickle as e:
            raise FrDumpError(f"{p}: refused: {e}") from None
        except _READ_ERRORS as e:
            raise FrDumpError(f"{p}: a corrupt or truncated pickle ({type(e).__name__}: {str(e)[:120]})") from None
    head = data[:64].lstrip()
    if head[:1] == b"{":
        try:
            return json.loads(data), "json"
        except _READ_ERRORS as e:
            raise FrDumpError(f"{p}: broken JSON ({str(e)[:120]})") from None
    if head[:2] == b"PK":
        raise FrDumpError(f"{p}: a zip archive (torch.save?), not a flight-recorder dump")
    raise FrDumpError(f"{p}: not a flight-recorder dump (neither a pickle nor JSON)")


class _BadField(Exception):
    pass


class _Reader:
    """Type-checked field access over one dump's plain data, with its bounds and caches."""

    def __init__(self, limits: FrLimits) -> None:
        self.limits = limits
        self.frames: dict[tuple[str, str, int], Frame] = {}
        # torch's pickle shares one dict per distinct frame between entries: read each once
        self.frame_dicts: dict[int, tuple[dict[Any, Any], Frame]] = {}
        self.sizes: dict[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]] = {}
        self.entry: int | None = None   # the entry being read, for error messages

    def bad(self, what: str, problem: str) -> _BadField:
        where = " ".join(x for x in ("" if self.entry is None else f"entry {self.entry}", what) if x)
        return _BadField(f"{where} {problem}")

    def text(self, v: Any, what: str, default: str | None = None) -> str:
        if type(v) is str and len(v) <= self.limits.max_str_chars:
            return sys.intern(v)
        if v is None and default is not None:
            return default
        if isinstance(v, bytes):
            v = v.decode("utf-8", "replace")
        if not isinstance(v, str):
            raise self.bad(what, f"is a {type(v).__name__}, not a string")
        return sys.intern(v[: self.limits.max_str_chars])

    def integer(self, v: Any, what: str) -> int:
        if type(v) is int:
            return v
        if isinstance(v, bool):
            return int(v)
        if isinstance(v, int):
            return int(v)
        if isinstance(v, str) and v.strip().lstrip("-").isdigit() and len(v) < 24:
            return int(v)
        if isinstance(v, float) and v.is_integer():
            return int(v)
        raise self.bad(what, f"is {type(v).__name__} {str(v)[:40]!r}, not an integer")

    def opt_int(self, v: Any, what: str, zero_is_none: bool = False) -> int | None:
        if v is None:
            return None
        n = self.integer(v, what)
        return None if zero_is_none and n == 0 else n

    def flag(self, v: Any, what: str) -> bool | None:
        if v is None:
            return None
        if isinstance(v, bool | int):
            return bool(v)
        if isinstance(v, str) and v.lower() in ("true", "false", "0", "1"):
            return v.lower() in ("true", "1")
        raise self.bad(what, f"is {type(v).__name__}, not a boolean")

    def size_list(self, v: Any, what: str) -> tuple[tuple[int, ...], ...]:
        if v is None:
            return ()
        if not isinstance(v, list | tuple):
            raise self.bad(what, f"is a {type(v).__name__}, not a list of shapes")
        cap, dims = self.limits.max_tensors_per_entry, self.limits.max_dims
        try:  # the shapes seen before were checked: a hit needs no second look
            hit = self.sizes.get(tuple(tuple(s[:dims]) for s in v[:cap]))
        except TypeError:
            hit = None
        if hit is not None:
            return hit
        shapes: list[tuple[int, ...]] = []
        for shape in v[: self.limits.max_tensors_per_entry]:
            if not isinstance(shape, list | tuple):
                raise self.bad(what, f"holds a {type(shape).__name__}, not a shape")
            shapes.append(tuple(self.integer(d, what) for d in shape[: self.limits.max_dims]))
        key = tuple(shapes)
        return self.sizes.setdefault(key, key)

    def dtypes(self, v: Any, what: str) -> tuple[str, ...]:
        if v is None:
            return ()
        if isinstance(v, str):  # torch's own tests write one string
            return (self.text(v, what),)
        if not isinstance(v, list | tuple):
            raise self.bad(what, f"is a {type(v).__name__}, not a list of dtypes")
        return tuple(self.text(d, what) for d in v[: self.limits.max_tensors_per_entry])

    def frame_list(self, v: Any) -> tuple[Frame, ...]:
        if not isinstance(v, list | tuple):
            return ()
        out: list[Frame] = []
        for f in v[: self.limits.max_frames_per_entry]:
            known = self.frame_dicts.get(id(f))
            if known is not None and known[0] is f:
                out.append(known[1])
                continue
            if not isinstance(f, dict):
                raise self.bad("frame", f"is a {type(f).__name__}, not a dict")
            key = (self.text(f.get("name"), "frame name", ""), self.text(f.get("filename"), "frame filename", ""),
                   self.opt_int(f.get("line"), "frame line") or 0)
            frame = self.frames.get(key)
            if frame is None:
                frame = self.frames[key] = Frame(*key)
            self.frame_dicts[id(f)] = (f, frame)
            out.append(frame)
        return tuple(out)


def _trace(obj: dict[Any, Any], rank: int, path: str, fmt: str, limits: FrLimits, keep: int) -> RankTrace:
    rd = _Reader(limits)
    raw_entries = obj.get("entries", [])
    if raw_entries is None:
        raw_entries = []
    if not isinstance(raw_entries, list | tuple):
        raise _BadField(f"'entries' is a {type(raw_entries).__name__}, not a list")
    if "entries" not in obj and "version" not in obj and "pg_config" not in obj:
        raise _BadField("none of 'entries', 'version', 'pg_config'")
    if len(raw_entries) > limits.max_entries_per_file:
        raise _BadField(f"{len(raw_entries)} entries, more than the {limits.max_entries_per_file} read from one dump")
    kept = raw_entries[-keep:] if keep and len(raw_entries) > keep else raw_entries
    entries = [_entry(e, i, rd) for i, e in enumerate(kept)]
    entries.sort(key=lambda e: e.record_id)
    version = obj.get("version", "")
    return RankTrace(
        rank=rank, path=path, version=rd.text(version, "version", "") if not isinstance(version, int | float)
        else str(version), fmt=fmt, entries=entries, pg_config=_pg_config(obj.get("pg_config"), rd, limits),
        pg_status=_pg_status(obj.get("pg_status"), rd, limits),
        comm_lib_version=rd.text(obj.get("comm_lib_version", obj.get("nccl_version")), "comm_lib_version", ""),
        entries_dropped=len(raw_entries) - len(kept),
    )


def _entry(e: Any, index: int, rd: _Reader) -> FrEntry:
    rd.entry = index
    if not isinstance(e, dict):
        raise rd.bad("", f"is a {type(e).__name__}, not a dict")
    get = e.get
    op = rd.text(get("profiling_name"), "profiling_name")
    pg_id = rd.opt_int(get("pg_id"), "pg_id")
    pg = get("process_group")
    if isinstance(pg, list | tuple) and len(pg) >= 2:
        pg_name, pg_desc = rd.text(pg[0], "process_group"), rd.text(pg[1], "process_group")
    elif pg is None and pg_id is not None:  # dumps before format 2 name a group by its uid only
        pg_name, pg_desc = str(pg_id), ""
    else:
        raise rd.bad("", "has no process_group")
    raw_seq = get("collective_seq_id", get("seq_id"))
    if raw_seq is None:
        raise rd.bad("", "has no collective_seq_id")
    seq = rd.integer(raw_seq, "collective_seq_id")
    is_p2p = rd.flag(get("is_p2p"), "is_p2p")
    if is_p2p is None:
        kind = op.partition(":")[2].split(" ")[0]
        is_p2p = kind in ("send", "recv", "recvAnySource")
    entry = FrEntry(
        record_id=rd.integer(get("record_id", index), "record_id"),
        pg_name=pg_name, pg_desc=pg_desc, pg_id=pg_id, seq=seq,
        p2p_seq=rd.opt_int(get("p2p_seq_id"), "p2p_seq_id") or 0,
        op_id=rd.opt_int(get("op_id"), "op_id") or seq,
        is_p2p=is_p2p, op=op,
        input_sizes=rd.size_list(get("input_sizes"), "input_sizes"),
        output_sizes=rd.size_list(get("output_sizes"), "output_sizes"),
        input_dtypes=rd.dtypes(get("input_dtypes"), "input_dtypes"),
        output_dtypes=rd.dtypes(get("output_dtypes"), "output_dtypes"),
        state=rd.text(get("state"), "state", ""),
        retired=rd.flag(get("retired"), "retired"),
        time_created_ns=rd.opt_int(get("time_created_ns"), "time_created_ns", zero_is_none=True),
        time_started_ns=rd.opt_int(get("time_discovered_started_ns"), "time_discovered_started_ns", zero_is_none=True),
        time_completed_ns=rd.opt_int(get("time_discovered_completed_ns"), "time_discovered_completed_ns",
                                     zero_is_none=True),
        timeout_ms=rd.opt_int(get("timeout_ms"), "timeout_ms"),
        frames=rd.frame_list(get("frames")),
    )
    rd.entry = None
    return entry


def _items(v: Any, limit: int, what: str) -> list[tuple[Any, Any]]:
    if not isinstance(v, dict):
        return []
    if len(v) > limit:
        raise _BadField(f"{len(v)} {what}, more than {limit}")
    return list(v.items())


def _pg_config(v: Any, rd: _Reader, limits: FrLimits) -> dict[str, PgConfig]:
    out: dict[str, PgConfig] = {}
    for key, info in _items(v, limits.max_groups_per_rank, "process groups in pg_config"):
        if not isinstance(info, dict):
            continue
        name = rd.text(info.get("name", key), "pg_config name", "")
        out[name] = PgConfig(name, rd.text(info.get("desc"), "pg_config desc", ""), _ranks(info.get("ranks"), rd, limits))
    return out


_RANKS_LIST = re.compile(r"^\s*\[[\d,\s]*\]\s*$")


def _ranks(v: Any, rd: _Reader, limits: FrLimits) -> tuple[int, ...] | None:
    if isinstance(v, list | tuple):
        return tuple(sorted({rd.integer(r, "pg_config ranks") for r in v}))
    if not isinstance(v, str) or len(v) > limits.max_ranks_str_chars or not _RANKS_LIST.match(v):
        return None
    return tuple(sorted({int(x) for x in re.findall(r"\d+", v)}))


def _pg_status(v: Any, rd: _Reader, limits: FrLimits) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    parse: Callable[[Any, str], int] = rd.integer
    for key, status in _items(v, limits.max_groups_per_rank, "process groups in pg_status"):
        if isinstance(status, dict):
            try:
                out[str(key)] = {rd.text(k, "pg_status key"): parse(n, "pg_status") for k, n in list(status.items())[:8]}
            except _BadField:
                continue
    return out
