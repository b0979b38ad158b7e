"""Several log files as one job: `diagnose DIR` or `diagnose node-01.log node-02.log ...`.

Each file is one stream of the job (a node's output, a rank's, a node's kernel log). Its host or rank
comes from its name (`input.name_patterns`, tried on the name without its extensions, then on the
folders it is in: `node-01.log`, `node-01.stdout.log.gz`, `host=node-01.log`, `logs/node-01/stdout.log`,
`rank-3.log`), as stream metadata: a line's own prefix still wins. The files' lines are merged in time
order, each line keyed by its own timestamp (a line without one keeps the time of the line before it
in its file), so a kernel's Xid lands between the training lines it interrupted. A file without any
timestamp in its first lines cannot be placed in time: it goes first, whole, in the order given.

Line numbers in the report count the merged stream; `LineMap` says which file and line they are.
"""

from __future__ import annotations

import bisect
import heapq
import os
import re
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from logdx.config import InputSettings
from logdx.faces import UsageError
from logdx.hosts import clean_hostname
from logdx.normalize import InputError, Normalizer, Source, open_input

__all__ = ["LineMap", "LogFile", "collect", "merged_lines", "name_of"]

# How far into a file to look for its first timestamp: the lines before it take its time.
LOOKAHEAD_LINES = 5000
_UNTIMED = float("-inf")
_ROTATED = re.compile(r"\.\d{1,3}$")  # node-01.log.1
# What follows the host in a file's name: node-01.stdout.log, node-01.dmesg.txt, node-01.kernel.json
_EXTENSION = re.compile(r"\.(?:log|txt|out|err|stdout|stderr|kernel|kmsg|dmesg|syslog|journal|messages|console"
                        r"|json|jsonl|ndjson|otlp|pb|msgpack)$", re.I)


@dataclass(frozen=True, slots=True)
class LogFile:
    path: Path
    shown: str  # as the user named it, or relative to the folder named
    host: str | None = None
    rank: int | None = None
    found: bool = False  # found in a folder (a file that is no log is skipped), not named (it is an error)

    @property
    def source(self) -> Source | None:
        return Source(rank=self.rank, host=self.host) if self.host or self.rank is not None else None


def name_of(file_name: str) -> str:
    """A file's name without its extensions: node-01.stdout.log.1.gz -> node-01."""
    name = file_name[:-3] if file_name.endswith(".gz") else file_name
    name = _ROTATED.sub("", name)
    for _ in range(3):
        stripped = _EXTENSION.sub("", name)
        if stripped == name or not stripped:
            break
        name = stripped
    return name


def _identity(names: Sequence[str], patterns: Sequence[re.Pattern[str]]) -> tuple[str | None, int | None]:
    """The host or rank the first matching pattern reads from the first name it matches."""
    for name in names:
        for pattern in patterns:
            m = pattern.search(name)
            if m is None:
                continue
            groups = m.groupdict()
            host = clean_hostname(groups.get("host"))
            rank = int(groups["rank"]) if groups.get("rank") and groups["rank"].isdigit() else None
            if host is not None or rank is not None:
                return host, rank
    return None, None


def _describe(path: Path, shown: str, parents: Sequence[str], patterns: Sequence[re.Pattern[str]],
              found: bool) -> LogFile:
    host, rank = _identity([name_of(path.name), *reversed(parents)], patterns)
    return LogFile(path=path, shown=shown, host=host, rank=rank, found=found)


def _walk(root: Path) -> Iterator[Path]:
    """Regular files under `root`, sorted, hidden names (and folders) left out."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            path = Path(folder) / name
            if not name.startswith(".") and path.is_file():
                yield path


def collect(args: Sequence[str], settings: InputSettings) -> list[LogFile]:
    """The files named (a folder stands for the files in it), each with the host or rank its name gives."""
    if "-" in args:
        raise UsageError("- (stdin) is one log on its own: name files or a folder, or pipe one log")
    patterns = [re.compile(p) for p in settings.name_patterns]
    out: list[LogFile] = []
    seen: set[Path] = set()

    def add(f: LogFile) -> None:
        key = f.path.resolve()
        if key not in seen:
            seen.add(key)
            out.append(f)
        if len(out) > settings.max_files:
            raise UsageError(f"more than {settings.max_files} files (input.max_files): name fewer, "
                             "or raise input.max_files (each file is open while they are merged)")

    for arg in args:
        path = Path(arg)
        if path.is_dir():
            before = len(out)
            for f in _walk(path):
                rel = f.relative_to(path)
                add(_describe(f, str(path / rel), rel.parts[:-1], patterns, found=True))
            if len(out) == before:
                raise UsageError(f"{arg}: no log files in this folder")
        elif path.exists():
            add(_describe(path, arg, path.parts[:-1], patterns, found=False))
        else:
            raise UsageError(f"{arg}: no such file or folder")
    return out


@dataclass
class LineMap:
    """Which file and line a line of the merged stream is: runs of consecutive lines of one file."""

    files: list[LogFile]
    _starts: array = field(default_factory=lambda: array("q"))  # merged line number where a run starts
    _file: array = field(default_factory=lambda: array("l"))  # its file
    _first: array = field(default_factory=lambda: array("q"))  # the file's line number at its start

    def note(self, merged_line: int, file_index: int, file_line: int) -> None:
        if self._file and self._file[-1] == file_index and \
                file_line - self._first[-1] == merged_line - self._starts[-1]:
            return
        self._starts.append(merged_line)
        self._file.append(file_index)
        self._first.append(file_line)

    def locate(self, merged_line: int) -> tuple[LogFile, int] | None:
        i = bisect.bisect_right(self._starts, merged_line) - 1
        if i < 0:
            return None
        return self.files[self._file[i]], self._first[i] + merged_line - self._starts[i]


def _timed(pairs: Iterator[tuple[bytes, Source | None]], index: int, max_line_bytes: int,
           ) -> Iterator[tuple[float, int, bytes, Source | None]]:
    """(time key, file index, line, source): the key never goes back within a file, and the lines
    before the file's first timestamp take it (a file with none in its first lines is untimed)."""
    clock = Normalizer(max_line_bytes=max_line_bytes)
    held: list[tuple[bytes, Source | None]] = []
    key: float | None = None
    for raw, source in pairs:
        if key is None:
            ts = clock.normalize(raw, source).ts
            held.append((raw, source))
            if ts is None and len(held) < LOOKAHEAD_LINES:
                continue
            key = ts if ts is not None else _UNTIMED
            for h_raw, h_source in held:
                yield key, index, h_raw, h_source
            held = []
            continue
        if key != _UNTIMED:
            ts = clock.normalize(raw, source).ts
            if ts is not None and ts > key:
                key = ts
        yield key, index, raw, source
    for h_raw, h_source in held:
        yield _UNTIMED, index, h_raw, h_source


def merged_lines(streams: Sequence[Iterator[tuple[bytes, Source | None]]], max_line_bytes: int,
                 ) -> Iterator[tuple[int, bytes, Source | None]]:
    """The streams' lines in time order (ties: the order the streams were given): (stream index, line, source)."""
    timed = [_timed(s, i, max_line_bytes) for i, s in enumerate(streams)]
    for _, index, raw, source in heapq.merge(*timed, key=lambda item: item[0]):
        yield index, raw, source


def open_log(f: LogFile) -> BinaryIO:
    try:
        return open_input(f.path)
    except InputError as e:
        raise UsageError(str(e)) from None
