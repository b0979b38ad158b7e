"""One-line progress notes for slow first-time work (converting the model, indexing incidents).

A CLI user who waits a minute must see why; a server's or a pipe's stderr stays quiet: the notes
go to stderr only when it is a terminal."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["step"]


@contextmanager
def step(what: str) -> Iterator[None]:
    """`with step("converting the model (about a minute, once)"):` -> "logdx: converting ... done in 41 s"."""
    loud = sys.stderr.isatty()
    t0 = time.perf_counter()
    if loud:
        print(f"logdx: {what} ...", end="", file=sys.stderr, flush=True)
    try:
        yield
    except BaseException:
        if loud:
            print(" failed", file=sys.stderr, flush=True)
        raise
    if loud:
        print(f" done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
