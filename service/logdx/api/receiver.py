"""One upload request as it is received: its body read chunk by chunk, decoded and parsed in a worker
thread, each job's lines spooled (or published to the line bus) as they arrive, the lines that name a
host but no job held for the node streams, and, once the body is complete, each job's part committed.
The endpoints that use it are `api/uploads.py`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
from fastapi import Request
from starlette.requests import ClientDisconnect

from logdx.api.deps import retry_after
from logdx.api.ingest import Upload, runs_by_job
from logdx.api.services import Services
from logdx.formats import Batch
from logdx.hosts import HostScope
from logdx.jobs.manager import IngestRequest, Job
from logdx.normalize import Source
from logdx.wire.errors import ApiError

T = TypeVar("T")
log = logging.getLogger("logdx.api")
_WATCH_S = 0.1  # how often a request whose body is read checks that its client is still there




@dataclass
class Received:
    """What a request did: its parts per job (committed or not), what it refused, how it ended."""

    parts: dict[str, tuple[Job, IngestRequest]] = field(default_factory=dict)
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    failure: ApiError | None = None
    disconnected: bool = False
    created: list[str] = field(default_factory=list)  # jobs this request created
    node_lines: int = 0  # lines that named a host and no job, kept in the host's node stream (nodestreams.py)
    live: dict[str, dict[str, Any]] = field(default_factory=dict)  # a live stream's pieces applied so far, per job

    @property
    def applied(self) -> int:
        return (sum(req.applied for _, req in self.parts.values())
                + sum(r.get("accepted_lines", 0) for r in self.live.values()))

    def keep_live(self) -> None:
        """The parts just committed become a live stream's applied pieces; the next chunk opens new parts."""
        for job_id, result in self.results.items():
            self.live[job_id] = _summed(self.live.get(job_id), result)
        self.parts.clear()
        self.results.clear()

    def merge_live(self) -> None:
        """The answer counts every piece of a live stream, the last one included."""
        for job_id, earlier in self.live.items():
            self.results[job_id] = _summed(earlier, self.results.get(job_id))
        self.live.clear()


_SUMMED = ("accepted_lines", "accepted_bytes", "skipped_records", "truncated_lines")


def _summed(earlier: dict[str, Any] | None, later: dict[str, Any] | None) -> dict[str, Any]:
    if earlier is None or later is None:
        return dict(earlier or later or {})
    return {**later, **{k: earlier.get(k, 0) + later.get(k, 0) for k in _SUMMED}}


class Receiver:
    """Reads one upload's body into per-job parts, then commits them."""

    def __init__(self, request: Request, services: Services, upload: Upload, key: str | None,
                 node_host: str | None = None) -> None:
        self.request = request
        self.services = services
        self.upload = upload
        self.key = key
        self.limit = services.settings.server.max_request_bytes
        self.out = Received()
        self.client = client_of(request)
        # Node streams: lines naming a host and no job, kept when the request commits; where each job's
        # lines came from (host: first, last time), joined to those hosts' streams then.
        self.node_host = node_host  # POST /v1/nodes/{host}/logs: every line is this host's
        # The hosts the caller may speak for: its node lines for any other host are refused, and what its job
        # lines say of other hosts is kept as a claim (never grounds for a cordon).
        self.scope: HostScope = request.state.principal.hosts
        # A tenant's token writes only into its tenant's jobs, and node lines join every job on their host:
        # from such a token they stay refused (`no_job`), as before node streams.
        takes_nodes = services.nodes is not None and not tenant_of(request)
        self.node_runs: list[tuple[Source, list[bytes]]] | None = [] if takes_nodes else None
        self.node_bytes = 0
        self.spans: dict[str, dict[str, tuple[float, float]]] = {}
        self.stored: dict[str, str] = {}  # the job ids the request names -> the jobs they are
        # A live stream (`srun ... | curl -T -`): chunked, no declared length, no key a retry could repeat. What
        # arrived is applied every live_commit_s, or a job that runs for hours is diagnosed only once it ends.
        live = ("content-length" not in request.headers and key is None
                and "chunked" in request.headers.get("transfer-encoding", "").lower())
        self.live_s = services.settings.server.live_commit_s if live else 0.0
        self.last_commit = time.monotonic()

    async def open_part(self, given: str) -> tuple[Job, IngestRequest]:
        """A job's part of this request: the job the caller names (a tenant's token names its tenant's
        jobs, `Tenants.job_id`) must be open, under its rate limit, and not already have this
        Idempotency-Key in flight."""
        services, jobs = self.services, self.services.jobs
        job_id = self.stored.get(given)
        if job_id is None:
            principal = self.request.state.principal
            job_id = self.stored[given] = await services.run(
                lambda: services.tenants.job_id(principal, given, write=True))
        part = self.out.parts.get(job_id)
        if part is not None:
            return part
        job = await services.run(jobs.get, job_id)
        if job is None:  # a new job: within the caps on job creation
            await services.run(services.quota.admit, self.client, len(self.out.created) + 1)
            job = await services.run(jobs.get_or_create, job_id)
            self.out.created.append(job_id)
        else:
            job = await services.run(jobs.get_or_create, job_id)  # (ended meanwhile: 409 below)
        await services.run(jobs.check_open, job)
        wait = job.bucket.wait_s()
        if wait > 0:
            services.metrics.rejected.labels("rate_limited").inc()
            raise ApiError(429, "rate_limited",
                           f"job {job_id} is over its rate limit "
                           f"({services.settings.server.rate_limit_lines_per_s:g} lines/s)",
                           headers=retry_after(wait), retry_after_s=round(wait, 2))
        if self.key is not None:
            if self.key in job.inflight_keys:
                raise ApiError(409, "request_in_progress", "a request with this Idempotency-Key is still being received")
            job.inflight_keys.add(self.key)
        req = IngestRequest(self.upload.fmt, self.key, scope=self.scope.spec())
        job.active += 1
        self.out.parts[job_id] = (job, req)
        return job, req

    async def receive(self) -> Received:
        try:
            try:
                received = 0
                async for chunk in self._body():
                    if chunk:
                        received += len(chunk)
                        self.services.metrics.bytes.labels(self.upload.fmt).inc(len(chunk))
                        if received > self.limit:
                            raise too_large(self.limit)
                        await self._chunk(chunk)
                    if self.live_s and time.monotonic() - self.last_commit >= self.live_s:
                        await self._commit_live()
                        received = 0
                async with watching(self.request, self.upload):
                    await self._chunk(None)
                    await self._spool(await self.services.run(self.upload.finish), 0)
                if self.upload.gone.is_set():
                    raise ClientDisconnect()
            except ApiError as e:
                self.out.failure = e
            except ClientDisconnect:
                self.out.disconnected = True
            except Exception:
                await self._commit(ok=False)  # a bug: close the parts (nothing applied), then a 500
                raise
            await self._commit(ok=self.out.failure is None and not self.out.disconnected)
            self.out.merge_live()
            if self.out.failure is None and not self.out.disconnected:
                await self._commit_nodes()
        finally:
            self._release()
        if self.out.failure is not None or self.out.disconnected:
            await self._drop_created()
        return self.out

    async def _drop_created(self) -> None:
        """A request that applied nothing leaves no job behind: the jobs it created are dropped again,
        unless another request used them meanwhile (its own commit is the only one the row counts).
        With several replicas a job is shared the moment it exists (its owner may hold lines of other
        requests not yet counted in the row): retention sweeps those instead."""
        if self.services.cluster is not None:
            return
        dropped = 0
        for job_id in self.out.created:
            job = self.out.parts.get(job_id, (None, None))[0]
            if job is not None and (job.lines or job.active):
                continue
            try:
                dropped += await self.services.run(self._forget_unused, job_id)
            except Exception:
                log.exception("job %s: could not drop it after a refused request", job_id)
        self.services.quota.refund(self.client, dropped)

    def _forget_unused(self, job_id: str) -> bool:
        row = self.services.db.query("SELECT lines, requests FROM api_jobs WHERE job_id = ?", (job_id,))
        if not row or row[0]["lines"] or row[0]["requests"] > 1:
            return False
        return self.services.jobs.forget(job_id, time.time() + 1)

    async def _chunk(self, chunk: bytes | None) -> None:
        """Decode, parse and spool a received chunk one piece at a time."""
        self.upload.begin(chunk)
        raw = len(chunk) if chunk is not None else 0
        while (batch := await self.services.run(self.upload.step)) is not None:
            await self._spool(batch, raw)
            raw = 0

    async def _spool(self, batch: Batch, raw: int) -> None:
        before = len(self.node_runs) if self.node_runs is not None else 0
        by_job = runs_by_job(batch, self.upload.refused, self.node_runs)
        if self.node_runs is not None and len(self.node_runs) > before:
            self._held_node_lines(before)
        for given, runs in by_job.items():
            job, req = await self.open_part(given)
            lines = sum(len(chunk) for _, chunk in runs)
            if self.node_runs is not None:
                _note_spans(self.spans.setdefault(job.id, {}), runs)
            await self.services.run_locked(job, self._charged(self.services.jobs.spool_runs), job, req, runs, lines)
        for _, req in self.out.parts.values():
            req.raw_bytes += raw if len(self.out.parts) == 1 else 0

    def _held_node_lines(self, since: int) -> None:
        """Node lines wait for the commit (a failed request keeps none), within a bound of their own. A node
        line joins every job on its host and may cordon it: one for a host the caller may not speak for is
        refused (`host_not_allowed`), never kept."""
        assert self.node_runs is not None
        kept = self.node_runs[:since]
        for source, lines in self.node_runs[since:]:
            if self.node_host is not None:
                source = Source(host=self.node_host, ts=source.ts)
            if not self.scope.allows(source.host):
                self.upload.refused["host_not_allowed"] = self.upload.refused.get("host_not_allowed", 0) + len(lines)
                continue
            kept.append((source, lines))
            self.node_bytes += sum(len(line) for line in lines)
        self.node_runs[:] = kept
        if self.node_bytes > _MAX_NODE_BYTES:
            raise ApiError(413, "node_lines_too_large",
                           f"one request may hold at most {_MAX_NODE_BYTES >> 20} MB of node lines "
                           "(lines naming a host and no job): send smaller batches")

    async def _commit_nodes(self) -> None:
        """Keep the node lines, then note where the jobs' lines came from (each joins its hosts' streams)."""
        nodes = self.services.nodes
        if nodes is None or not (self.node_runs or self.spans):
            return

        def commit() -> None:
            assert nodes is not None
            if self.node_runs:
                self.out.node_lines, blank = nodes.receive(self.node_runs)
                if blank:  # a blank line makes no node event: counted, as an empty record is
                    self.upload.refused["empty"] = self.upload.refused.get("empty", 0) + blank
            for job_id, spans in self.spans.items():
                if self.out.results.get(job_id, {}).get("accepted_lines"):
                    nodes.job_spans(job_id, spans)

        await self.services.run(self._charged(commit))

    def _charged(self, fn: Callable[..., T]) -> Callable[..., T]:
        budget = self.upload.budget

        def run(*args: Any) -> T:
            budget.start()
            try:
                return fn(*args)
            finally:
                budget.charge()

        return run

    async def _body(self) -> AsyncIterator[bytes]:
        """The body's chunks; a live stream's also an empty one every live_commit_s while nothing arrives (a job
        that prints a traceback, then hangs, still has it applied)."""
        if not self.live_s:
            async for chunk in self.request.stream():
                yield chunk
            return
        queue: asyncio.Queue[bytes | Exception | None] = asyncio.Queue(maxsize=4)

        async def pull() -> None:
            try:
                async for chunk in self.request.stream():
                    await queue.put(chunk)
                await queue.put(None)
            except Exception as e:  # noqa: BLE001 - ClientDisconnect or a parse of the body: the reader raises it
                await queue.put(e)

        task = asyncio.get_running_loop().create_task(pull())
        try:
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), self.live_s)
                except TimeoutError:
                    yield b""
                    continue
                if item is None:
                    return
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    async def _commit_live(self) -> None:
        """Apply a live stream's lines so far (its pieces' lines are durable and diagnosed as they come); a
        dropped stream keeps what was applied before the drop. Each piece has its own CPU budget."""
        self.last_commit = time.monotonic()
        if not self.out.parts:
            return
        await self._commit(ok=True)
        self._release()
        self.out.keep_live()
        self.upload.budget.spent_s = 0.0

    async def _commit(self, ok: bool) -> None:
        jobs = self.services.jobs
        for job_id in sorted(self.out.parts):
            job, req = self.out.parts[job_id]
            self.out.results[job_id] = await self.services.run_locked(
                job, self._charged(jobs.finish_request), job, req, ok, self.upload.budget)

    def _release(self) -> None:
        for job, _ in self.out.parts.values():
            job.active -= 1
            if self.key is not None:
                job.inflight_keys.discard(self.key)


_MAX_NODE_BYTES = 64 << 20


def tenant_of(request: Request) -> str:
    return getattr(getattr(request.state, "principal", None), "tenant", "") or ""


def _note_spans(spans: dict[str, tuple[float, float]], runs: list[tuple[Source, list[bytes]]]) -> None:
    """Where a job's lines came from: host -> (first, last) timestamp (arrival time when a line has none)."""
    now = time.time()
    for source, _ in runs:
        if source.host:
            ts = source.ts if source.ts is not None else now
            known = spans.get(source.host)
            spans[source.host] = (min(ts, known[0]), max(ts, known[1])) if known else (ts, ts)


def client_of(request: Request) -> str:
    """Who sends: the credential's name when there is one, else the peer's address."""
    principal = getattr(request.state, "principal", None)
    name = getattr(principal, "name", None)
    if name:
        return f"token:{name}"
    return f"addr:{request.client.host}" if request.client is not None else "addr:-"


def too_large(limit: int) -> ApiError:
    return ApiError(413, "request_too_large", f"the body is larger than server.max_request_bytes ({limit})")


@asynccontextmanager
async def watching(request: Request, upload: Upload) -> AsyncIterator[None]:
    """While the work after the body (a document parsed whole, the commit) runs: notice when the
    client goes away, so that the work stops (`Upload.check`) instead of going on for nobody.
    Only once the body is read: before that, receiving is the stream's own business."""

    async def watch() -> None:
        while not await request.is_disconnected():
            await anyio.sleep(_WATCH_S)
        upload.gone.set()

    # a bare task, not a task group: the work's own errors must reach the caller as they are
    task = asyncio.get_running_loop().create_task(watch())
    try:
        yield
    finally:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
