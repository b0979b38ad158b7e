"""A request's CPU budget (`server.max_request_cpu_s`), charged by whichever thread does its work: the face
that reads the body (decoding, parsing) and the runtime that spools and applies its lines."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from logdx.wire.errors import ApiError


@dataclass
class CpuBudget:
    """CPU seconds a request may cost, charged from the worker threads that do its work (0: no limit).
    Call `start()` at the beginning of a piece of work and `charge()` at its end (same thread)."""

    limit_s: float
    spent_s: float = 0.0
    _t0: float = field(default=0.0, repr=False)

    def start(self) -> None:
        self._t0 = time.thread_time()

    def charge(self) -> None:
        now = time.thread_time()
        self.spent_s += now - self._t0
        self._t0 = now

    def exceeded(self) -> bool:
        return self.limit_s > 0 and self.spent_s > self.limit_s

    def error(self, applied: int) -> ApiError:
        return ApiError(429, "cpu_limit",
                        f"the request cost more than {self.limit_s:g} s of CPU (server.max_request_cpu_s); "
                        f"{applied} line(s) were applied, the rest were not: send smaller requests",
                        headers={"Retry-After": "1"}, accepted_lines=applied)
