"""How many jobs uploads may create: job ids are free to name, so their number is bounded (issue: one
1.3 MB request once created 20,041 jobs and 20,041 spool files).

- per request: at most `server.max_new_jobs_per_request` jobs it did not find (413 `too_many_jobs`);
- per client (the credential's name, else the client's address): `server.max_new_jobs_per_client`
  per `server.new_jobs_window_s` (429 `job_quota`, with Retry-After);
- overall: `server.max_new_jobs` per window (429 `job_quota`);
- open jobs: at most `server.max_open_jobs` at once (429 `open_jobs_limit`: jobs end, or retention
  drops idle ones).

A request refused for any of these applies nothing, and the jobs it had created are dropped again.
The rates are counted in this process (each replica, each worker process, has its own); open jobs
are counted in the database, so they hold across replicas.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from logdx.config import ServerSettings
from logdx.jobs.limits import TokenBucket
from logdx.wire.errors import ApiError

_CLIENTS = 10_000  # clients whose rate is remembered (least recently seen forgotten first)
_OPEN_CACHE_S = 1.0


def retry_after(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


class JobQuota:
    def __init__(self, settings: ServerSettings, count_open: Callable[[], int], clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.count_open = count_open
        self.clock = clock
        self._lock = threading.Lock()
        self._clients: OrderedDict[str, TokenBucket] = OrderedDict()
        self._overall = self._bucket(settings.max_new_jobs)
        self._open: tuple[float, int] | None = None  # (when counted, how many) + the ones admitted since

    def _bucket(self, per_window: int) -> TokenBucket:
        return TokenBucket(per_window / self.settings.new_jobs_window_s, per_window, clock=self.clock)

    def admit(self, client: str, new_in_request: int) -> None:
        """A request of `client` is about to create its `new_in_request`-th new job: raise when a
        bound refuses it (call from a worker thread: it may count open jobs in the database)."""
        s = self.settings
        if new_in_request > s.max_new_jobs_per_request:
            raise ApiError(413, "too_many_jobs",
                           f"the request names more than {s.max_new_jobs_per_request} jobs the server does not know "
                           "(server.max_new_jobs_per_request); send each job's lines in fewer, separate requests")
        self._check_open()
        with self._lock:
            bucket = self._clients.get(client)
            if bucket is None:
                bucket = self._clients[client] = self._bucket(s.max_new_jobs_per_client)
                while len(self._clients) > _CLIENTS:
                    self._clients.popitem(last=False)
            self._clients.move_to_end(client)
            for which, b, limit in (("this client", bucket, s.max_new_jobs_per_client),
                                    ("all clients", self._overall, s.max_new_jobs)):
                if b.tokens_now() < 1:
                    wait = (1 - b.tokens_now()) / b.rate
                    raise ApiError(429, "job_quota",
                                   f"{which} created {limit} jobs in the last {s.new_jobs_window_s:g} s "
                                   f"(server.max_new_jobs{'_per_client' if b is bucket else ''}); retry later",
                                   headers=retry_after(wait), retry_after_s=round(wait, 2))
            bucket.take(1)
            self._overall.take(1)
            if self._open is not None:
                self._open = (self._open[0], self._open[1] + 1)

    def refund(self, client: str, n: int) -> None:
        """`n` jobs admitted for `client` were dropped again (their request was refused)."""
        with self._lock:
            for bucket in (self._clients.get(client), self._overall):
                if bucket is not None and bucket.enabled:
                    bucket.take(-n)
                    bucket.tokens = min(bucket.tokens, bucket.burst)

    def _check_open(self) -> None:
        now = self.clock()
        with self._lock:
            cached = self._open
        if cached is None or now - cached[0] > _OPEN_CACHE_S:
            cached = (now, self.count_open())
            with self._lock:
                self._open = cached
        if cached[1] >= self.settings.max_open_jobs:
            raise ApiError(429, "open_jobs_limit",
                           f"{cached[1]} jobs are open (server.max_open_jobs {self.settings.max_open_jobs}); end "
                           "finished jobs (POST /v1/jobs/{id}/end) or wait for retention to drop idle ones",
                           headers=retry_after(60), retry_after_s=60)
