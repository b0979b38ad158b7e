"""Small helpers several test modules share."""

from __future__ import annotations


class Clock:
    """A clock the test moves by hand (`clock.t += 60`), for code that takes `clock=time.time`."""

    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t
