"""Input checks and rate limits: job ids, bearer tokens, token buckets."""

from __future__ import annotations

import ipaddress
import threading
import time

from logdx.tenancy import JOB_ID_PATTERN, is_job_id
from logdx.wire.errors import ApiError

JOB_ID_RULE = (f"must match {JOB_ID_PATTERN} (letters, digits, '.', '_', '-'; a tenant's job may be named "
               "<tenant>:<name>)")


def check_job_id(job_id: str) -> str:
    """A job id is a file name too (its spool): letters, digits, `.`, `_`, `-`, no leading dot; a
    tenant's job may be called by its qualified id, `<tenant>:<name>` (`logdx.tenancy`)."""
    if not is_job_id(job_id):
        raise ApiError(400, "invalid_job_id", f"job_id {JOB_ID_RULE}")
    return job_id


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class TokenBucket:
    """Lines per second with a burst allowance. A request may overdraw the bucket (it is not cut
    mid-stream); the next request of the job then waits until the debt is repaid (429 with
    Retry-After). The long-run rate is therefore the configured one."""

    def __init__(self, rate: float, burst: float, clock=time.monotonic) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self._clock = clock
        self._last = clock()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def _refill(self) -> None:
        now = self._clock()
        self.tokens = min(self.burst, self.tokens + (now - self._last) * self.rate)
        self._last = now

    def wait_s(self) -> float:
        """Seconds until the bucket is out of debt; 0 when a request may start now."""
        if not self.enabled:
            return 0.0
        with self._lock:
            self._refill()
            return 0.0 if self.tokens > 0 else (-self.tokens + 1) / self.rate

    def tokens_now(self) -> float:
        """The tokens in the bucket now (refilled)."""
        if not self.enabled:
            return float("inf")
        with self._lock:
            self._refill()
            return self.tokens

    def take(self, n: int) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._refill()
            self.tokens -= n
