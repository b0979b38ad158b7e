"""Writing lines: a counting, chunked sink, and bursts that several processes write at once."""

from __future__ import annotations

from random import Random
from typing import TextIO


class LineSink:
    """Writes lines to a text stream in chunks, counts them, and remembers the root line.

    Memory stays bounded by the chunk size whatever the length of the log.
    """

    def __init__(self, out: TextIO, chunk_lines: int = 4096) -> None:
        self._out = out
        self._chunk_lines = chunk_lines
        self._buffer: list[str] = []
        self.count = 0  # lines emitted so far == 1-based number of the last one
        self.root_no: int | None = None
        self.root_line: str | None = None
        # A generator that must find lines again after a burst (where did rank 17's dump land?) asks
        # for them with ``record()``; it holds only the end of a log, never the whole of it.
        self.recorded: list[str] | None = None
        self.recorded_from = 0  # line number of recorded[0]

    def emit(self, line: str) -> None:
        self._buffer.append(line)
        self.count += 1
        if self.recorded is not None:
            self.recorded.append(line)
        if len(self._buffer) >= self._chunk_lines:
            self.flush()

    def extend(self, lines: list[str]) -> None:
        self._buffer.extend(lines)
        self.count += len(lines)
        if self.recorded is not None:
            self.recorded.extend(lines)
        if len(self._buffer) >= self._chunk_lines:
            self.flush()

    def record(self) -> None:
        """Keep every line emitted from now on in ``recorded`` (the first one is line ``recorded_from``)."""
        self.recorded = []
        self.recorded_from = self.count + 1

    def emit_root(self, line: str) -> None:
        """Emit a line that shows the root cause; the first such line is the ground truth."""
        self.emit(line)
        if self.root_no is None:
            self.root_no = self.count
            self.root_line = line

    def mark_root(self, line_no: int, line: str) -> None:
        """Name an already emitted line as the root (for lines written in a batch)."""
        if self.root_no is None:
            self.root_no = line_no
            self.root_line = line

    def flush(self) -> None:
        if self._buffer:
            self._out.write("\n".join(self._buffer))
            self._out.write("\n")
            self._buffer.clear()


class Burst:
    """Lines that several processes write during the same seconds, merged by time as a log
    collector would: each process keeps its own order, different processes' lines mix.

    A burst holds only the failure window (a few thousand lines), never the whole log.
    """

    def __init__(self, rng: Random) -> None:
        self.rng = rng
        self._items: list[tuple[float, int, str, bool]] = []
        self._procs: dict[object, Proc] = {}
        self._tags: dict[int, object] = {}  # item index -> tag, for lines whose line number is wanted

    def proc(self, key: object, prefix: str, t: float) -> Proc:
        """The writer ``key`` (a rank, a node's launcher...), its clock moved on to at least ``t``.

        One writer keeps one clock for the whole burst, so its lines never go back in time
        even when several parts of the code write for it.
        """
        proc = self._procs.get(key)
        if proc is None:
            proc = self._procs[key] = Proc(self, prefix, t)
        else:
            proc.t = max(proc.t, t)
        return proc

    def add(self, t: float, line: str, root: bool = False, tag: object = None) -> None:
        """Queue ``line`` at time ``t``; a ``tag`` asks ``drain`` to report where the line landed."""
        if tag is not None:
            self._tags[len(self._items)] = tag
        self._items.append((t, len(self._items), line, root))

    @property
    def end(self) -> float:
        return max((item[0] for item in self._items), default=0.0)

    def drain(self, sink: LineSink, marks: dict[object, int] | None = None) -> float:
        """Emit everything in time order; returns the time of the last line.

        ``marks`` (when given) receives tag -> 1-based line number of every tagged line.
        """
        self._items.sort()
        last = 0.0
        tags = self._tags
        for t, index, line, root in self._items:
            if root:
                sink.emit_root(line)
            else:
                sink.emit(line)
            if tags and marks is not None and index in tags:
                marks[tags[index]] = sink.count
            last = t
        self._items.clear()
        self._tags.clear()
        return last


class Proc:
    """One writer inside a burst (a rank, a launcher, the kernel) with its own monotone clock."""

    __slots__ = ("burst", "prefix", "t")

    def __init__(self, burst: Burst, prefix: str, t: float) -> None:
        self.burst = burst
        self.prefix = prefix
        self.t = t

    def tick(self, gap: float = 0.0004) -> float:
        """Advance this writer's clock by about ``gap`` seconds and return the new time."""
        self.t += gap * (0.2 + 1.6 * self.burst.rng.random())
        return self.t

    def put(self, text: str, root: bool = False) -> None:
        """Write at the current time (after a ``tick``, for lines that print it)."""
        self.burst.add(self.t, self.prefix + text, root)

    def say(self, text: str, gap: float = 0.0004, root: bool = False) -> None:
        self.tick(gap)
        self.put(text, root)

    def says(self, texts: list[str], gap: float = 0.0004, root_index: int | None = None) -> None:
        for i, text in enumerate(texts):
            self.say(text, gap, root=(i == root_index))
