"""Helpers for testing code that uses logdx (shipped with it, like `structlog.testing`).

    from logdx.testing import Clock, cpu_seconds, failed_report, wait_until
    from logdx.testing import TempNats, TempPostgres   # servers of a test's own, to restart or kill
    from logdx.testing import Fleet                     # shippers that retry, and what they saw
    from logdx.testing import rules_engine, diagnose_lines   # the pipeline, rules only, on a list of lines
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from logdx.act.report import CompressionFigures, Culprits, Report, RootCause
from logdx.model import FT, Action, Category

if TYPE_CHECKING:
    from logdx.pipeline import Engine

__all__ = ["Clock", "CpuSeconds", "Fleet", "Outcome", "TempNats", "TempPostgres", "cpu_budget", "cpu_seconds", "diagnose_lines",
           "failed_report", "free_port", "rules_engine", "shipper_logs", "wait_until", "yardstick"]

T = TypeVar("T")


class Clock:
    """A clock the test moves by hand (`clock.t += 60`), for code that takes `clock=time.time`."""

    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def rules_engine() -> Engine:
    """The pipeline with its defaults but no learned stage (no retrieval, no LLM): what the rules,
    the catalog and the reading of the job's life decide. Build it once and share it: it is stateless."""
    from logdx.config import load_settings
    from logdx.pipeline import Engine

    settings = load_settings(env={})
    settings.llm.enabled = settings.retrieval.enabled = False
    return Engine.create(settings)


def diagnose_lines(engine: Engine, lines: list[str], exit_code: int | None = None) -> Report:
    """One job of these lines, in order, diagnosed at its end (`exit_code`: how it ended, when known)."""
    session = engine.new_session()
    session.feed_lines(lines)
    return session.report(exit_code=exit_code)


def failed_report(hosts: tuple[str, ...] = ("node-17",), line_no: int = 33, **overrides: Any) -> Report:
    """A sure infrastructure diagnosis (a GPU fell off the bus on `hosts[0]`, rank 3, the host printed
    it: corroborated) that asks for `cordon_and_restart`; `overrides` replace any field of the report."""
    fields: dict[str, Any] = dict(
        status="failed", category=Category.INFRASTRUCTURE, failure_type=FT.GPU_FELL_OFF_BUS, action=Action.CORDON_AND_RESTART,
        confidence=0.97, culprits=Culprits(hosts=list(hosts), ranks=[3], corroborated=bool(hosts),
                                           basis="the root line's own host" if hosts else ""),
        root_cause=RootCause(line_no=line_no, text="NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",
                             rank=3, host=hosts[0] if hosts else None),
        evidence=[], explanation="GPU fell off the bus.", hint="Drain the node.",
        compression=CompressionFigures(lines_in=40, templates=8, lines_kept=40), timings_ms={},
    )
    fields.update(overrides)
    return Report(**fields)


class CpuSeconds:
    """CPU-seconds spent in a block, for bounding work where wall time would measure the machine's
    load instead: `with cpu_seconds() as cpu: work()` then `assert cpu.seconds < 2`.

    Counts the calling thread by default (other threads of the test process, a server fixture's,
    do not count); `process=True` counts every thread of the process (work that fans out)."""

    def __init__(self, process: bool = False) -> None:
        self._clock = time.process_time if process else time.thread_time
        self._start = 0.0
        self.seconds = 0.0

    def __enter__(self) -> CpuSeconds:
        self._start = self._clock()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = self._clock() - self._start


def cpu_seconds(process: bool = False) -> CpuSeconds:
    return CpuSeconds(process)


# What `yardstick()`'s workload costs, in CPU-seconds, on the machine the suite's bounds in CPU-seconds were
# written on (a 2-core VM that ran `make test` in 644 s). Derived, not measured there: a slower VM of the same
# kind ran the same commit's suite in 1178 s with a yardstick of 0.19-0.21 s. A bound is `cpu_budget(seconds)`.
YARDSTICK_REFERENCE_S = 0.11
_YARDSTICK_LINE = re.compile(r"^\[rank(\d+)\]:\s+iteration\s+(\d+)/\s*(\d+) \| loss ([\d.]+)")


def yardstick() -> float:
    """CPU-seconds this machine takes, now, for a fixed piece of work of the kind a server does (regex,
    JSON, dicts, strings): how much slower or faster than the reference it runs. CPU-seconds are not
    the same everywhere: a slow or throttled virtual CPU spends more of them on the same work. The best of
    three runs, so that a burst of another process does not count."""
    lines = [f"[rank{i % 64}]: iteration {i}/ 100000 | loss {2 + (i % 997) / 1000:.3f} | {'x' * (i % 40)}"
             for i in range(12_000)]
    best = float("inf")
    for _ in range(3):
        t0 = time.thread_time()
        seen: dict[str, int] = {}
        for line in lines:
            m = _YARDSTICK_LINE.match(line)
            doc = json.loads(json.dumps({"log": line, "rank": m.group(1) if m else None}))
            key = doc["log"].split("|", 1)[0]
            seen[key] = seen.get(key, 0) + len(doc["log"])
        best = min(best, time.thread_time() - t0)
    return best


def cpu_budget(reference_s: float) -> float:
    """A bound of `reference_s` CPU-seconds, as written on the reference machine, scaled to this one when
    it is slower (never tightened on a faster one): what a test that bounds CPU asserts against."""
    return reference_s * max(1.0, yardstick() / YARDSTICK_REFERENCE_S)


def wait_until(condition: Callable[[], T], what: str, timeout: float = 120.0, interval: float = 0.02) -> T:
    """Poll `condition` until it returns something truthy, and return that. The deadline is there
    only to fail a test that hangs: make it generous, never a measure of speed."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


# --- throwaway servers: a NATS JetStream and a PostgreSQL of a test's own --------------------------
# For tests that restart or kill the servers a cluster of logdx replicas runs on (never the machine's
# own): each runs from a temporary directory on a free loopback port, and `restart` keeps its data.


def free_port() -> int:
    """A TCP port nothing listens on now (loopback)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout_s:g} s: {what}")
        time.sleep(0.02)


class TempNats:
    """`nats-server -js` on a free loopback port, its store in `workdir` (kept across restarts).

    `max_store_bytes` caps the server's JetStream file store (its `max_file_store`), to see what a
    full store does. `stop()` is SIGTERM (NATS's clean shutdown), `kill()` SIGKILL."""

    def __init__(self, workdir: Path, max_store_bytes: int | None = None, binary: str | None = None) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.binary = binary or shutil.which("nats-server") or "/usr/sbin/nats-server"
        store = f", max_file_store: {max_store_bytes}" if max_store_bytes else ""
        self.config = self.workdir / "nats.conf"
        self.config.write_text(f'listen: 127.0.0.1:{self.port}\n'
                               f'jetstream {{ store_dir: "{self.workdir / "store"}"{store} }}\n')
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> TempNats:
        log = open(self.workdir / "nats.log", "ab")  # noqa: SIM115 - owned by the subprocess
        self.proc = subprocess.Popen([self.binary, "-c", str(self.config)], stdout=log, stderr=subprocess.STDOUT)
        _wait_for(lambda: _listening(self.port) or self.proc is None or self.proc.poll() is not None, timeout_s,
                  "nats-server listens")
        if self.proc.poll() is not None:
            raise RuntimeError(f"nats-server exited with {self.proc.returncode}: see {self.workdir / 'nats.log'}")
        return self

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def __enter__(self) -> TempNats:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class TempPostgres:
    """A PostgreSQL cluster of its own (`initdb` in `workdir`, trust authentication, loopback only, on a
    free port) from the server binaries of the machine (`bindir`, default: the newest of
    /usr/lib/postgresql/*/bin, else PATH). PostgreSQL refuses to run as root: when this process is
    root, the server runs as the `postgres` user (`runuser`), which owns `workdir`.

    `stop(mode)` is `pg_ctl stop -m smart|fast|immediate`: fast ends the sessions and shuts down
    cleanly; immediate is a crash (recovery at the next start)."""

    def __init__(self, workdir: Path | None = None, bindir: str | Path | None = None) -> None:
        """`workdir`: where the cluster lives (default: a new directory under the system's temp dir,
        removed by `cleanup()`); as root, the `postgres` user must be able to reach it."""
        self._own_dir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="logdx-pg-"))
        self.data = self.workdir / "data"
        self.port = free_port()
        self.bindir = Path(bindir) if bindir else _postgres_bindir()
        self._as: list[str] = []
        if os.geteuid() == 0:
            self._as = ["runuser", "-u", "postgres", "--"]

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> None:
        done = subprocess.run([*self._as, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              cwd=self.workdir, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{Path(args[0]).name} exited with {done.returncode}: "
                               f"{done.stderr.decode(errors='replace').strip()[-800:]}")

    def init(self) -> TempPostgres:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self._as:
            shutil.chown(self.workdir, "postgres", "postgres")
        self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
                  "--no-sync", "-E", "UTF8", "--locale=C")
        return self

    def start(self, timeout_s: float = 60.0) -> TempPostgres:
        if not self.data.exists():
            self.init()
        options = (f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.workdir} -c fsync=off"
                   " -c full_page_writes=off -c max_connections=200")
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.workdir / "postgres.log"),
                  "-o", options, "-w", "-t", str(int(timeout_s)), "start")
        return self

    @property
    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists() and _listening(self.port)

    def stop(self, mode: str = "fast") -> None:
        if mode not in ("smart", "fast", "immediate"):
            raise ValueError(f"pg_ctl stop mode {mode!r}: smart, fast or immediate")
        if (self.data / "postmaster.pid").exists():
            self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def __enter__(self) -> TempPostgres:
        return self.start()

    def cleanup(self) -> None:
        """Stop the server (immediate) and, when this object made its directory, remove it."""
        try:
            self.stop("immediate")
        finally:
            if self._own_dir:
                shutil.rmtree(self.workdir, ignore_errors=True)

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def _postgres_bindir() -> Path:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"),
                   key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0)
    if found:
        return found[-1].parent
    pg_ctl = shutil.which("pg_ctl")
    if pg_ctl is None:
        raise FileNotFoundError("no PostgreSQL server binaries (pg_ctl) under /usr/lib/postgresql/*/bin or on PATH")
    return Path(pg_ctl).parent


# --- a fleet of log shippers, to see what clients see while a deployment is under faults ------------


def shipper_logs(lines: list[str], hosts: list[str], shippers: int, gpus_per_host: int = 8) -> dict[int, list[str]]:
    """A job's log split the way its log shippers send it, in order: a rank's lines to shipper
    `rank % shippers`, a node's own lines (kernel, agent) to the shipper of the node's first rank,
    anything else to shipper 0. `hosts`: the job's hosts, in rank order."""
    from logdx.normalize import Normalizer

    normalizer = Normalizer()
    out: dict[int, list[str]] = {s: [] for s in range(shippers)}
    for line in lines:
        rec = normalizer.normalize(line)
        if rec.rank is not None:
            out[rec.rank % shippers].append(line)
        elif rec.host in hosts:
            out[(hosts.index(rec.host) * gpus_per_host) % shippers].append(line)
        else:
            out[0].append(line)
    return out


@dataclass
class Outcome:
    """What the shippers saw: every answer by status (and error code), the 5xx answers that lacked a
    Retry-After, connection failures, and the slowest answer."""

    statuses: Counter[str] = field(default_factory=Counter)
    without_retry_after: Counter[str] = field(default_factory=Counter)
    slowest_s: float = 0.0
    answers: list[tuple[float, float, str]] = field(default_factory=list)  # (sent, answered: monotonic, what)

    def saw(self, what: str, sent: float, retry_after: bool = True) -> None:
        now = time.monotonic()
        self.statuses[what] += 1
        self.slowest_s = max(self.slowest_s, now - sent)
        self.answers.append((sent, now, what))
        if not retry_after:
            self.without_retry_after[what] += 1

    def first_ok_sent_after(self, t: float) -> float | None:
        """When the first request sent after `t` was answered with a 2xx (None: none was)."""
        return min((done for sent, done, what in self.answers if sent >= t and what.startswith("2")), default=None)

    def errors(self) -> dict[str, int]:
        """Everything but the 2xx answers."""
        return {k: v for k, v in self.statuses.items() if not k.startswith("2")}


class Fleet:
    """One shipper per source (a rank's log), each sending its lines to a job in batches of `batch`
    lines with an Idempotency-Key, spread over `urls`; a batch that fails (an error status, a refused
    connection, a timeout) is sent again, with the same key, to the next URL after the Retry-After it
    got (at most `max_wait_s`). `lines_per_s` paces the whole fleet (None: as fast as answered).

    `acked` counts the lines acknowledged, once per key: what the job must hold, no more, no less.
    Shippers stop sending to a URL in `dead` (a replica the test killed)."""

    def __init__(self, urls: list[str], job_id: str, per_source: dict[int, list[str]],
                 headers: dict[str, str] | None = None, batch: int = 40, lines_per_s: float | None = None,
                 timeout_s: float = 60.0, max_wait_s: float = 2.0) -> None:
        self.urls = urls
        self.job_id = job_id
        self.per_source = per_source
        self.headers = headers or {"x-requested-with": "logdx-fleet"}
        self.batch = batch
        self.lines_per_s = lines_per_s
        self.timeout_s = timeout_s
        self.max_wait_s = max_wait_s
        self.dead: set[int] = set()
        self.acked: dict[str, int] = {}
        self.outcome = Outcome()
        self.lock = threading.Lock()
        self.started_at = 0.0
        self.stopped = threading.Event()  # set: shippers give up what they could not send, and stop
        self.sent_lines = 0
        self._next: dict[int, int] = {}

    def batches(self, source: int) -> list[tuple[str, str]]:
        lines = self.per_source[source]
        return [(f"{self.job_id}/{source}-{i}", "\n".join(lines[i:i + self.batch]) + "\n")
                for i in range(0, len(lines), self.batch)]

    @property
    def lines(self) -> int:
        with self.lock:
            return sum(self.acked.values())

    @property
    def total(self) -> int:
        return sum(len(v) for v in self.per_source.values())

    def run(self, upto: float = 1.0) -> None:
        """Every source ships (the first `upto` share of) its batches, all at once; returns when done."""
        import concurrent.futures

        if not self.started_at:
            self.started_at = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(len(self.per_source)) as pool:
            for f in [pool.submit(self.ship, s, upto) for s in self.per_source]:
                f.result()

    def ship(self, source: int, upto: float = 1.0) -> None:
        import httpx

        todo = self.batches(source)
        start = self._next.get(source, 0)
        stop = len(todo) if upto >= 1 else int(len(todo) * upto)
        with httpx.Client(timeout=self.timeout_s) as client:
            for n in range(start, stop):
                if self.stopped.is_set():
                    return
                key, body = todo[n]
                self._pace(body.count("\n"))
                self._send(client, source + n, key, body)
                self._next[source] = n + 1

    def _pace(self, lines: int) -> None:
        if not self.lines_per_s:
            return
        with self.lock:
            self.sent_lines += lines
            due = self.started_at + self.sent_lines / self.lines_per_s
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def _send(self, client: Any, turn: int, key: str, body: str) -> None:
        import httpx

        order = [(turn + k) % len(self.urls) for k in range(len(self.urls))]
        attempt = 0
        while True:
            live = [i for i in order if i not in self.dead] or order
            url = self.urls[live[attempt % len(live)]]
            attempt += 1
            t0 = time.monotonic()
            try:
                r = client.post(f"{url}/v1/jobs/{self.job_id}/logs", content=body,
                                headers={**self.headers, "idempotency-key": key})
            except httpx.TimeoutException:
                self.outcome.saw("timeout", t0)
                if self.stopped.is_set():
                    return
                continue
            except httpx.TransportError as e:
                self.outcome.saw(f"connection_{type(e).__name__}", t0)
                if self.stopped.is_set():
                    return
                time.sleep(0.2)
                continue
            if r.status_code < 300:
                self.outcome.saw(str(r.status_code), t0)
                with self.lock:
                    self.acked[key] = int(r.json()["accepted_lines"])
                return
            code = _error_code(r)
            wait = r.headers.get("retry-after")
            self.outcome.saw(f"{r.status_code} {code}", t0, retry_after=wait is not None or r.status_code < 500)
            if r.status_code < 500 and code not in _RETRIED:
                raise AssertionError(f"batch {key} refused: {r.status_code} {r.text[:300]}")
            if self.stopped.is_set():
                return
            time.sleep(min(self.max_wait_s, float(wait) if wait and wait.isdigit() else 0.5))


_RETRIED = {"request_in_progress", "rate_limited", "cpu_limit"}  # a 4xx that a shipper sends again


def _error_code(r: Any) -> str:
    try:
        return str(r.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "?"
