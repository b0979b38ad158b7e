"""Progress of slow first-time work (converting the packaged model, indexing the incidents), told
to whoever listens.

The code doing the work names each stage and, when it can, how far it got; it prints nothing:

    with step("converting the packaged LLM once", part="llm", total=n) as s:
        s.advance(k)

Listeners decide what to show. `to_stderr()` (the command lines): on a terminal one line redrawn
with the percentage, ending "done in 14 s"; on a pipe or a file one line per stage, never a bar.
`to_log()` (the server): a log line when a stage starts, at each quarter, and when it ends. Any
callable (the service's readiness checks: what it waits for, and how far it got).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TextIO

__all__ = ["Stage", "add_listener", "remove_listener", "step", "to_log", "to_stderr"]


@dataclass
class Stage:
    what: str  # "converting the packaged LLM once (later runs reuse it)"
    part: str = ""  # the component it belongs to ("llm", "retrieval"): readiness keys on it
    total: float | None = None  # in units of `advance` (bytes, items); None: unknown
    done: float = 0.0
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    error: str | None = None

    @property
    def fraction(self) -> float | None:
        return min(1.0, self.done / self.total) if self.total else None

    @property
    def seconds(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    def advance(self, done: float) -> None:
        """How far the stage got, in units of `total` (absolute, not an increment)."""
        self.done = done
        _tell("advance", self)


Listener = Callable[[str, Stage], None]  # (event: "start" | "advance" | "end" | "fail", stage)

_listeners: list[Listener] = []
_lock = threading.Lock()


def add_listener(listener: Listener) -> Listener:
    with _lock:
        _listeners.append(listener)
    return listener


def remove_listener(listener: Listener) -> None:
    with _lock:
        if listener in _listeners:
            _listeners.remove(listener)


def _tell(event: str, stage: Stage) -> None:
    with _lock:
        listeners = list(_listeners)
    for listener in listeners:
        try:
            listener(event, stage)
        except Exception:
            logging.getLogger("logdx").debug("progress listener failed", exc_info=True)


@contextmanager
def step(what: str, *, part: str = "", total: float | None = None) -> Iterator[Stage]:
    stage = Stage(what, part, total)
    _tell("start", stage)
    try:
        yield stage
    except BaseException as e:
        stage.ended, stage.error = time.monotonic(), f"{type(e).__name__}: {e}"
        _tell("fail", stage)
        raise
    stage.ended = time.monotonic()
    if stage.total:
        stage.done = stage.total
    _tell("end", stage)


# --- listeners --------------------------------------------------------------------------------------


class _Console:
    """The command lines' stderr: a redrawn line on a terminal, one line per stage elsewhere."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.last_draw = 0.0
        self.lock = threading.Lock()

    def __call__(self, event: str, stage: Stage) -> None:
        with self.lock:
            if not self.tty:
                if event == "start":
                    print(f"logdx: {stage.what} ...", file=self.stream, flush=True)
                return
            if event == "advance":
                now = time.monotonic()
                if now - self.last_draw < 0.2 or stage.fraction is None:
                    return
                self.last_draw = now
                print(f"\rlogdx: {stage.what} ... {stage.fraction:.0%}", end="", file=self.stream, flush=True)
            elif event == "start":
                print(f"logdx: {stage.what} ...", end="", file=self.stream, flush=True)
            else:
                outcome = f"done in {stage.seconds:.0f} s" if event == "end" else "failed"
                print(f"\r\033[Klogdx: {stage.what} ... {outcome}", file=self.stream, flush=True)


def to_stderr(stream: TextIO | None = None) -> Listener:
    """Show stages on stderr (the command lines)."""
    return add_listener(_Console(stream or sys.stderr))


class _Log:
    """The server's log: start, each quarter of the way, end (with its seconds), or the failure."""

    def __init__(self, logger: logging.Logger) -> None:
        self.log = logger
        self.quarters: dict[int, int] = {}

    def __call__(self, event: str, stage: Stage) -> None:
        if event == "start":
            self.log.info("%s ...", stage.what)
        elif event == "advance":
            fraction = stage.fraction
            if fraction is None:
                return
            quarter = int(fraction * 4)
            if 0 < quarter < 4 and quarter > self.quarters.get(id(stage), 0):
                self.quarters[id(stage)] = quarter
                self.log.info("%s: %d%%", stage.what, quarter * 25)
        else:
            self.quarters.pop(id(stage), None)
            if event == "end":
                self.log.info("%s: done in %.1fs", stage.what, stage.seconds)
            else:
                self.log.error("%s: failed after %.1fs: %s", stage.what, stage.seconds, stage.error)


def to_log(logger: logging.Logger | None = None) -> Listener:
    """Log stages (the server)."""
    return add_listener(_Log(logger or logging.getLogger("logdx")))
