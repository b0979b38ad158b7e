"""A job's streams merged in time order, each line read once.

Each stream (a file of the job) is read by a normaliser of its own, in its own order: its clock (the year of
its stamps without one, its boot clock), its prompt's host and its launcher's labels are its own. Each line is
keyed by its own timestamp (a line without one keeps the time of the line before it in its stream), so a
kernel's Xid lands between the training lines it interrupted; the lines before a stream's first timestamp
take that time; a stream without any timestamp in its first `LOOKAHEAD_LINES` lines cannot be placed in time:
it goes first, whole, in the order given. The records the merge made its keys from are what the session is fed
(`merged_records`, `Session.feed_records`): a line is normalised once.

Line numbers in a report count the merged stream; `LineMap` says which file and line they are.
"""

from __future__ import annotations

import bisect
import heapq
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from logdx.model import Record
from logdx.normalize import Normalizer, Source

__all__ = ["LOOKAHEAD_LINES", "LineMap", "Merge", "merged_lines"]

# How far into a stream to look for its first timestamp: the lines before it take its time.
LOOKAHEAD_LINES = 5000
_UNTIMED = float("-inf")

F = TypeVar("F")


@dataclass
class LineMap(Generic[F]):
    """Which file and line a line of the merged stream is: runs of consecutive lines of one file."""

    files: list[F]
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

    def locate(self, merged_line: int) -> tuple[F, int] | None:
        i = bisect.bisect_right(self._starts, merged_line) - 1
        if i < 0:
            return None
        return self.files[self._file[i]], self._first[i] + merged_line - self._starts[i]


Timed = tuple[float, int, bytes, Record, "Source | None"]


def _timed(pairs: Iterator[tuple[bytes, Source | None]], index: int,
           clock: Normalizer) -> Iterator[Timed]:
    """(time key, stream index, line, its record, source), every line normalised once by the stream's own
    `clock`: the key never goes back within a stream, and the lines before its first timestamp take it (a
    stream with none in its first lines is untimed)."""
    normalize = clock.normalize
    held: list[tuple[bytes, Record, Source | None]] = []
    key: float | None = None
    for raw, source in pairs:
        rec = normalize(raw, source)
        if key is None:
            held.append((raw, rec, source))
            if rec.ts is None and len(held) < LOOKAHEAD_LINES:
                continue
            key = rec.ts if rec.ts is not None else _UNTIMED
            for h_raw, h_rec, h_source in held:
                yield key, index, h_raw, h_rec, h_source
            held = []
            continue
        ts = rec.ts
        if ts is not None and ts > key and key != _UNTIMED:
            key = ts
        yield key, index, raw, rec, source
    for h_raw, h_rec, h_source in held:
        yield _UNTIMED, index, h_raw, h_rec, h_source


def _key(item: Timed) -> float:
    return item[0]


class Merge:
    """The streams' lines in time order (ties: the order the streams were given). `year`: what stamps without a
    year belong to before a line says (`files.year_of`). `clocks`: each stream's normaliser, which made its
    records (what they read counts as the session's reading: `Session.feed_records`)."""

    def __init__(self, streams: Sequence[Iterator[tuple[bytes, Source | None]]], max_line_bytes: int,
                 year: tuple[int, int] | None = None) -> None:
        self.clocks = [Normalizer(max_line_bytes=max_line_bytes) for _ in streams]
        if year is not None:
            for clock in self.clocks:
                clock.hint_year(*year)
        self._timed = [_timed(s, i, clock) for i, (s, clock) in enumerate(zip(streams, self.clocks))]

    def items(self) -> Iterator[Timed]:
        return heapq.merge(*self._timed, key=_key)

    def records(self) -> Iterator[tuple[int, Record, Source | None]]:
        """(stream index, record, source) in time order; the record's `line_no` counts its own stream's lines."""
        for _, index, _, rec, source in self.items():
            yield index, rec, source


def merged_lines(streams: Sequence[Iterator[tuple[bytes, Source | None]]], max_line_bytes: int,
                 year: tuple[int, int] | None = None) -> Iterator[tuple[int, bytes, Source | None]]:
    """The streams' lines in time order: (stream index, line, source)."""
    for _, index, raw, _, source in Merge(streams, max_line_bytes, year).items():
        yield index, raw, source
