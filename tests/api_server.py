"""Helpers for the API tests: a real server in a subprocess, a real alert receiver, job logs.

No mocks: the server is `python -m logdx.api` on a free loopback port with its own database;
alerts go over HTTP to a `ThreadingHTTPServer` that records what it receives.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
WEBHOOK_SECRET = "whsec_" + "dGVzdC1zZWNyZXQtZm9yLWxvZ2R4LWFwaS10ZXN0cw=="


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the alert receiver ----------------------------------------------------------------------------


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Receiver:
    """Records every POST; answers 200 (or `status` for the next `fail_next` requests)."""

    server: ThreadingHTTPServer
    items: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def of(self, path: str) -> list[Received]:
        with self.lock:
            return [r for r in self.items if r.path == path]

    def wait_for(self, path: str, n: int = 1, timeout: float = 120.0) -> list[Received]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.of(path)
            if len(got) >= n:
                return got
            time.sleep(0.02)
        raise AssertionError(f"expected {n} POST(s) to {path} within {timeout}s, got {len(self.of(path))}")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_receiver() -> Receiver:
    holder: dict[str, Receiver] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length)
            rec = holder["r"]
            with rec.lock:
                rec.items.append(Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body,
                                          time.time()))
            self.send_response(200)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    holder["r"] = Receiver(server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return holder["r"]


# --- the server ------------------------------------------------------------------------------------


class Server:
    """`python -m logdx.api` in a subprocess, on a free loopback port, with its own database."""

    def __init__(self, workdir: Path, *, receiver: Receiver | None = None, token: str = "",
                 server: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
                 port: int | None = None) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.token = token
        self.proc: subprocess.Popen[bytes] | None = None
        config: dict[str, Any] = {
            "data_dir": str(workdir),
            "llm": {"enabled": False},
            "retrieval": {"enabled": False},
            # Without a token the tests act as the local operator too (an explicit opt-in, as a user's would be).
            "server": {"token": token, "early_diagnosis_delay_s": 0.3, "local_operator": not token, **(server or {})},
            "alerts": {"backoff_initial_s": 0.2, "backoff_max_s": 1.0, "timeout_s": 5.0},
        }
        if receiver is not None:
            config["alerts"]["slack"] = [{"webhook_url": receiver.url + "/slack"}]
            config["alerts"]["webhooks"] = [{"url": receiver.url + "/hook", "secret": WEBHOOK_SECRET}]
        for section, values in (extra or {}).items():
            config.setdefault(section, {}).update(values)
        self.config_path = workdir / "config.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / "server.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        """What a shipper sends: the token, or without one an X- header (a POST with neither could
        come from any web page, and is refused)."""
        return {"authorization": f"Bearer {self.token}"} if self.token else {"x-requested-with": "logdx-tests"}

    def start(self, timeout: float = 180.0, *, ready: bool = True, log_level: str = "warning") -> Server:
        """Start the server and wait until it is ready (`ready`), or only until it answers at all
        (its engine may still be loading: uploads are accepted then)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOGDX_")}
        env.update({"LOGDX_CONFIG": str(self.config_path), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "PYTHONUNBUFFERED": "1"})
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the subprocess
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "logdx.api", "--port", str(self.port), "--log-level", log_level],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO),
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                r = httpx.get(self.url + ("/readyz" if ready else "/healthz"), timeout=5.0)
                if r.status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"server not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:] if self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL: no shutdown hooks, no flush; what was fsync'd is all that survives."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=kw.pop("timeout", 30.0), **kw)


# --- job logs --------------------------------------------------------------------------------------


def rank_host(rank: int) -> str:
    return f"gpu-node-{rank // 8:02d}"


def make_job(ranks: int = 64, steps: int = 60, culprit: int = 42, seed: int = 7) -> dict[int, list[str]]:
    """A 64-rank Megatron-style job whose GPU falls off the bus on `culprit`'s node, after which
    every other rank times out in NCCL. Lines carry torchrun's `[rankN]:` prefix; the kernel line
    names its node. Returns each rank's lines, in order (what one log shipper per rank sends)."""
    rng = random.Random(seed)
    t0 = 1714564800.0
    out: dict[int, list[str]] = {}
    for r in range(ranks):
        host = rank_host(r)
        lines = [
            f"[rank{r}]:{host}:{3000 + r}:{3000 + r} [{r % 8}] NCCL INFO Bootstrap : "
            f"Using eth0:10.1.{r // 8}.{r % 8}<0>",
            f"[rank{r}]:{host}:{3000 + r}:{3000 + r} [{r % 8}] NCCL INFO comm 0x{0x55d0 + r:x} rank {r} nranks {ranks}",
        ]
        for s in range(steps):
            ts = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t0 + 10 * s))
            lines.append(
                f"[rank{r}]:[{ts}] iteration {s + 1:6d}/  100000 | consumed samples: {(s + 1) * 512:9d} | "
                f"elapsed time per iteration (ms): {rng.uniform(900, 1100):.1f} | lm loss: {rng.uniform(2.0, 3.0):.6E} "
                f"| grad norm: {rng.uniform(0.5, 1.5):.3f}")
        t_fail = t0 + 10 * steps + 5
        if r == culprit:
            stamp = time.strftime("%b %d %H:%M:%S", time.gmtime(t_fail))
            lines.append(f"{stamp} {host} kernel: NVRM: Xid (PCI:0000:4e:00): 79, pid=4711, "
                         "GPU has fallen off the bus.")
            lines.append(f"[rank{r}]:RuntimeError: CUDA error: unspecified launch failure")
        else:
            lines.append(
                f"[rank{r}]:[E501 12:10:00.000000000 ProcessGroupNCCL.cpp:616] [Rank {r}] Watchdog caught collective "
                "operation timeout: WorkNCCL(SeqNum=4242, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, "
                "Timeout(ms)=600000) "
                "ran for 600094 milliseconds before timing out.")
        out[r] = lines
    return out


def root_line_of(job: dict[int, list[str]], culprit: int = 42) -> str:
    return next(line for line in job[culprit] if "Xid" in line)


def chunks(lines: list[str], per_chunk: int, split_lines: bool = True) -> list[bytes]:
    """Bodies cut at arbitrary places: sometimes mid-line, to exercise reassembly."""
    data = ("\n".join(lines) + "\n").encode()
    pieces = []
    pos = 0
    avg = max(1, len(data) // max(1, len(lines) // per_chunk))
    rng = random.Random(len(data))
    while pos < len(data):
        step = max(1, int(avg * rng.uniform(0.5, 1.5))) if split_lines else avg
        pieces.append(data[pos:pos + step])
        pos += step
    return pieces


@dataclass
class ShippedJob:
    """A job's log as its per-rank shippers see it, and what its diagnosis must say."""

    per_client: dict[int, list[str]]
    expected: dict[str, Any]  # status, category, failure_type, action
    culprit_hosts: list[str]
    root_line: str
    hosts: list[str]

    @property
    def total(self) -> int:
        return sum(len(v) for v in self.per_client.values())


def shipped_job(scenario: str = "xid79", ranks: int = 64, lines: int = 20_000, seed: int = 7,
                gpus_per_host: int = 8) -> ShippedJob:
    """A `logdx.synth` log split the way a shipper per rank would send it: each rank's lines to its
    own client, node-level lines (kernel, agent) to the first rank of their node, the rest to rank 0.
    Falls back to `make_job` when `logdx.synth` is not available."""
    try:
        from logdx.synth import generate
    except ImportError:
        job = make_job(ranks=ranks)
        return ShippedJob(job, {"status": "failed", "category": "infrastructure", "failure_type": "gpu_fell_off_bus",
                                "action": "cordon_and_restart"}, [rank_host(42)], root_line_of(job),
                          sorted({rank_host(r) for r in range(ranks)}))
    import io

    from logdx.testing import shipper_logs

    buf = io.StringIO()
    truth = generate(buf, scenario=scenario, seed=seed, ranks=ranks, lines=lines, style="torchrun",
                     gpus_per_host=gpus_per_host)
    per_client = shipper_logs(buf.getvalue().splitlines(), list(truth.hosts), ranks, gpus_per_host)
    expected = {"status": truth.status, "category": truth.category, "failure_type": truth.failure_type,
                "action": truth.action}
    return ShippedJob(per_client, expected, list(truth.culprit_hosts), truth.root_line or "", list(truth.hosts))


# --- the app in this process -----------------------------------------------------------------------


class LoopbackApp:
    """`create_app(settings)` served by uvicorn on a free loopback port in a thread of this process,
    so a test can reach inside (`.services`) while real HTTP requests go through every middleware."""

    def __init__(self, settings: Any, engine: Any = None) -> None:
        import uvicorn

        from logdx.api.app import create_app

        self.port = free_port()
        self.app = create_app(settings, engine=engine)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    server_header=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def services(self) -> Any:
        return self.app.state.services

    def __enter__(self) -> LoopbackApp:
        self.thread.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.server.started and self.services is not None and self.services.engine is not None:
                return self
            if not self.thread.is_alive():
                raise AssertionError("the app did not start")
            time.sleep(0.02)
        raise AssertionError("the app was not ready within 60 s")

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


# --- syslog-ng, the real one (Debian's), for the shipper tests ---------------------------------------

SYSLOG_NG = shutil.which("syslog-ng") or ("/usr/sbin/syslog-ng" if Path("/usr/sbin/syslog-ng").exists() else None)
SYSLOG_NG_HTTP = any(Path("/usr/lib/syslog-ng").glob("*/libhttp.so"))
needs_syslog_ng = pytest.mark.skipif(SYSLOG_NG is None or not SYSLOG_NG_HTTP,
                                     reason="syslog-ng with its http() destination is not installed "
                                            "(apt-get install syslog-ng-core syslog-ng-mod-http)")


@contextmanager
def running_syslog_ng(tmp_path: Path, conf: str) -> Iterator[subprocess.Popen[bytes]]:
    """syslog-ng in the foreground with this configuration, its state under `tmp_path`; stopped after."""
    assert SYSLOG_NG is not None
    path = tmp_path / "syslog-ng.conf"
    path.write_text(conf)
    proc = subprocess.Popen([SYSLOG_NG, "-F", "-f", str(path), "-R", str(tmp_path / "persist"),
                             "-p", str(tmp_path / "pid"), "-c", str(tmp_path / "ctl"), "--no-caps"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def exited(proc: subprocess.Popen[bytes], what: str) -> AssertionError:
    """The failure to raise when a helper process died under a test: its last output."""
    assert proc.stdout is not None
    return AssertionError(f"{what} exited: {proc.stdout.read().decode(errors='replace')[-2000:]}")
