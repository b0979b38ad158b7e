"""The recent lines of a job, per source, kept for the evidence capsule (`logdx.act.capsule`).

Once a node is drained the evidence goes with it, so before logdx acts it writes down what the log said
around the root line. The compressor keeps only what it needs to diagnose; the `EvidenceRecorder` keeps
what a person needs to check the diagnosis: the last `context_lines` lines of every source (a rank, a
host), a ring each, and each host's kernel lines (a ring of their own: a kernel's Xid must not be
pushed out by the training lines of its host). When the session sees a root cause, the recorder freezes
the rings of every source that printed near it (`near_s` on the log's clock, every source when the
lines carry no time) and goes on collecting the `context_lines` lines each of them prints after it.

What it costs per line: one deque append (and a list append while a frozen window still collects);
what it holds: at most `max_sources` rings of `context_lines` lines, `MAX_WINDOWS` windows.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field

from logdx.model import Record

__all__ = ["EvidenceRecorder", "Window", "is_kernel_line"]

MAX_WINDOWS = 4  # root causes frozen per session: the first ones (the later are their cascade)
KERNEL_LINES_PER_HOST = 2000
_OVERFLOW = "overflow"
# Syslog's "<host> kernel: ...", raw dmesg's "[ 1234.5] ...", the GPU driver's own words.
_KERNEL = re.compile(r" kernel: |^\[\s*\d+\.\d+\] |NVRM: |Xid \(|SXid|mlx5_core|EDAC ")


def is_kernel_line(raw: str) -> bool:
    return _KERNEL.search(raw) is not None


@dataclass
class Window:
    """The lines around one root line: each near source's lines before it (frozen) and after it."""

    root: Record
    before: dict[str, list[Record]]
    after: dict[str, list[Record]] = field(default_factory=dict)
    budget: int = 0  # lines still to look at before the window closes
    filling: int = 0  # near sources whose lines after the root are still to come
    open: bool = True


class EvidenceRecorder:
    def __init__(self, context_lines: int = 200, max_sources: int = 1024, near_s: float = 600.0) -> None:
        self.context_lines = max(1, context_lines)
        self.max_sources = max_sources
        self.near_s = near_s
        self.tails: dict[str, deque[Record]] = {}  # by `Record.source_key`
        self._ranks: dict[int, deque[Record]] = {}  # the same rings of the ranks, by rank number
        self.kernel: dict[str, deque[Record]] = {}  # per host
        self.windows: list[Window] = []
        self._open: list[Window] = []

    # A session moving to another process (`Session.snapshot`) leaves its rings behind: they are rebuilt there
    # from the lines it reads next (a replayed spool refills them), and the snapshot stays small.
    def __getstate__(self) -> dict[str, object]:
        return {"context_lines": self.context_lines, "max_sources": self.max_sources, "near_s": self.near_s}

    def __setstate__(self, state: dict[str, float]) -> None:
        self.__init__(int(state["context_lines"]), int(state["max_sources"]), float(state["near_s"]))  # type: ignore[misc]

    def copy(self) -> EvidenceRecorder:
        """What it holds now, apart from the lines that come next (the capsule is written by another thread)."""
        out = EvidenceRecorder(self.context_lines, self.max_sources, self.near_s)
        out.tails = {k: deque(v, maxlen=self.context_lines) for k, v in self.tails.items()}
        out.kernel = {k: deque(v, maxlen=KERNEL_LINES_PER_HOST) for k, v in self.kernel.items()}
        out.windows = [Window(w.root, {k: list(v) for k, v in w.before.items()},
                              {k: list(v) for k, v in w.after.items()}, open=False) for w in self.windows]
        return out

    def add(self, rec: Record) -> None:
        """One line (the hot path: a rank's line costs a dict lookup by its number and a deque append)."""
        rank = rec.rank
        if rank is not None:
            tail = self._ranks.get(rank)
            if tail is None:
                tail = self._ranks[rank] = self._new_tail(rec.source_key)
        else:
            key = rec.source_key
            tail = self.tails.get(key)
            if tail is None:
                tail = self._new_tail(key)
            if rec.host is not None and is_kernel_line(rec.raw):
                self._kernel_line(rec.host, rec)
        tail.append(rec)
        if self._open:
            self._collect(rec.source_key, rec)

    def _new_tail(self, key: str) -> deque[Record]:
        if len(self.tails) >= self.max_sources:
            key = _OVERFLOW
            if key in self.tails:
                return self.tails[key]
        tail: deque[Record] = deque(maxlen=self.context_lines)
        self.tails[key] = tail
        return tail

    def _kernel_line(self, host: str, rec: Record) -> None:
        ring = self.kernel.get(host)
        if ring is None:
            if len(self.kernel) >= self.max_sources:
                return
            ring = self.kernel[host] = deque(maxlen=KERNEL_LINES_PER_HOST)
        ring.append(rec)

    def _collect(self, key: str, rec: Record) -> None:
        closed = False
        for w in self._open:
            if rec is w.root:
                continue
            after = w.after.get(key)
            if after is None and (key in w.before or len(w.after) < self.max_sources):
                # A source that starts printing after the root line printed near it too.
                after = w.after[key] = []
                if key not in w.before:
                    w.filling += 1
            if after is not None and len(after) < self.context_lines:
                after.append(rec)
                if len(after) == self.context_lines:
                    w.filling -= 1
            w.budget -= 1
            if w.budget <= 0 or w.filling <= 0:
                w.open, closed = False, True
        if closed:
            self._open = [w for w in self._open if w.open]

    def freeze(self, root: Record) -> None:
        """A root cause: keep what every source near it printed before it, and collect what they print after."""
        if len(self.windows) >= MAX_WINDOWS or any(w.root.line_no == root.line_no for w in self.windows):
            return
        before = {key: [r for r in tail if r.line_no < root.line_no] for key, tail in self.tails.items()
                  if self._near(tail, root)}
        before.setdefault(root.source_key, [])
        w = Window(root=root, before=before, budget=self.context_lines * max(1, len(before)) * 4, filling=len(before))
        self.windows.append(w)
        self._open.append(w)

    def _near(self, tail: deque[Record], root: Record) -> bool:
        if not tail:
            return False
        when = root.at if root.at is not None else root.ts
        last = tail[-1].at
        if when is None or last is None:
            return True  # no clock to tell: every source that printed is near
        return abs(last - when) <= self.near_s or any(r.at is not None and abs(r.at - when) <= self.near_s
                                                       for r in tail)

    def window_of(self, line_no: int | None) -> Window | None:
        """The window frozen at this root line, else the one nearest before it."""
        if line_no is None or not self.windows:
            return self.windows[0] if self.windows else None
        exact = [w for w in self.windows if w.root.line_no == line_no]
        if exact:
            return exact[0]
        before = [w for w in self.windows if w.root.line_no <= line_no]
        return before[-1] if before else self.windows[0]

    def kernel_lines(self, host: str, around: float | None, window_s: float) -> list[Record]:
        """A host's kernel lines within `window_s` of `around` (all of them kept, when there is no time)."""
        ring = self.kernel.get(host)
        if ring is None:
            lower = host.lower()
            ring = next((r for h, r in self.kernel.items() if h.lower() == lower), None)
        if not ring:
            return []
        if around is None:
            return list(ring)
        return [r for r in ring if r.at is None or abs(r.at - around) <= window_s]
