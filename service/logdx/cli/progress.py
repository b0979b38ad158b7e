"""How far `diagnose` has read, on stderr, while a big input is read (a 400 MB log takes minutes).

A thread wakes every second and reads two numbers the reader already keeps: the lines fed (the session's
counter) and, for a file, the OS's position in it (`lseek` on its descriptor: the compressed position of a
`.gz`, so the share is of the file on disk). The reading loop does no work for it. On a terminal the line is
redrawn in place and wiped at the end; nothing is printed for an input read within two seconds.
`--progress always` prints one line per update (a CI log, a test), `never` nothing.
"""

from __future__ import annotations

import os
import stat
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["MODES", "Progress", "file_position"]

MODES = ("auto", "always", "never")
_DELAY_S = 2.0  # a terminal shows nothing for an input read this fast
_EVERY_S = 1.0


def file_position(fd: int) -> Callable[[], tuple[int, int] | None]:
    """(bytes read, size) of a regular file by its descriptor; None for a pipe or a terminal."""
    try:
        st = os.fstat(fd)
    except OSError:
        return lambda: None
    if not stat.S_ISREG(st.st_mode) or st.st_size <= 0:
        return lambda: None
    size = st.st_size

    def position() -> tuple[int, int] | None:
        try:
            return min(os.lseek(fd, 0, os.SEEK_CUR), size), size
        except OSError:
            return None
    return position


class Progress:
    """A context manager: progress of `name` on `stream` while the block runs."""

    def __init__(self, name: str, lines: Callable[[], int], position: Callable[[], tuple[int, int] | None] | None = None,
                 *, mode: str = "auto", stream: TextIO | None = None) -> None:
        self.name, self.lines, self.position = name, lines, position
        self.stream = stream or sys.stderr
        self.live = mode == "auto" and _is_tty(self.stream)
        self.enabled = self.live or mode == "always"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = 0.0
        self._drawn = False

    def __enter__(self) -> Progress:
        if self.enabled:
            self._start = time.monotonic()
            self._thread = threading.Thread(target=self._run, name="logdx-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        if self.live and self._drawn:
            self._write("\r\x1b[K")
        elif not self.live and exc[0] is None:
            self._write(f"{self._status(done=True)}\n")

    def _run(self) -> None:
        if self.live and self._stop.wait(_DELAY_S):
            return
        while True:
            if self.live:
                self._write(f"\r\x1b[K{self._status()}")
                self._drawn = True
            else:
                self._write(f"{self._status()}\n")
            if self._stop.wait(_EVERY_S):
                return

    def _status(self, *, done: bool = False) -> str:
        elapsed = time.monotonic() - self._start
        where = self.position() if self.position is not None else None
        share = ""
        if where is not None:
            read, size = where
            share = f" {100 * (size if done else read) / size:.0f}% of {_size(size)},"
        verb = "read" if done else "reading"
        return f"{verb} {self.name}:{share} {self.lines():,} lines, {elapsed:.0f} s"

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            self._stop.set()  # stderr went away (a closed pipe): progress is not worth failing for


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (OSError, ValueError):
        return False


def _size(n: int) -> str:
    if n < 1000:
        return f"{n} B"
    value = n / 1000
    for unit in ("KB", "MB"):
        if value < 1000:
            return f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} GB"
