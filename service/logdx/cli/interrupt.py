"""Ctrl-C on a live stream ends the reading, not the diagnosis.

`kubectl logs -f trainer-0 | diagnose -` reads until the user has seen enough: the first Ctrl-C stops the
reading at a boundary between pieces of input (never in the middle of feeding a line to the session), and
what was read is diagnosed and printed, marked partial, with exit code 130. A second Ctrl-C, while the
report is being made, interrupts as usual.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import TypeVar

__all__ = ["Interrupted", "until_interrupted"]

T = TypeVar("T")


class _StopReading(Exception):
    """Raised by the handler only while the input is being read: nothing half-fed is left behind."""


class Interrupted:
    def __init__(self) -> None:
        self.stopped = False
        self.reading = False  # the main thread waits on the input (the one place the handler may raise)

    @contextmanager
    def on_sigint(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach the main thread only: nothing to catch here
            return
        previous = signal.getsignal(signal.SIGINT)

        def handler(signum: int, frame: FrameType | None) -> None:
            if self.stopped:
                raise KeyboardInterrupt  # the second Ctrl-C
            self.stopped = True
            if self.reading:
                raise _StopReading

        signal.signal(signal.SIGINT, handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)


def until_interrupted(items: Iterable[T], interrupted: Interrupted) -> Iterator[T]:
    """`items` until the first Ctrl-C: the item being read then is given up, every earlier one was yielded."""
    it = iter(items)
    while not interrupted.stopped:
        try:
            interrupted.reading = True
            item = next(it)
        except (StopIteration, _StopReading):
            return
        finally:
            interrupted.reading = False
        yield item
