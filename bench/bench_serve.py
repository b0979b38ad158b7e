#!/usr/bin/env python3
"""Benchmark the HTTP service: sustained ingest rate, and root-cause-to-alert latency.

Starts the real server (`python -m logdx.api`, uvicorn) on a free loopback port with a fresh
database, and a small webhook receiver. Then:

1. throughput: a `logdx.synth` 64-rank log (``--lines``) is split the way one shipper per rank
   would send it and streamed over ``--streams`` concurrent chunked uploads into one job; the rate
   is lines accepted (2xx, spooled and fsync'd) per second of wall time, first byte to last answer;
2. latency: ``--jobs`` failing jobs (different seeds) are streamed the same way, one after the
   other; for each, the time from the moment the chunk holding the root-cause line is handed to
   the connection to the moment the signed webhook alert reaches the receiver. That includes the
   debounce (``server.early_diagnosis_delay_s``, 2 s by default), the diagnosis and the delivery.

The client runs on the same machine and takes CPU from the server: on a small machine the rate
is a lower bound. Usage::

    python bench/bench_serve.py --lines 1000000 --streams 64 --jobs 10 [--json bench-results/serve.json]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "service"))

from logdx.normalize import Normalizer
from logdx.synth import generate


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the alert receiver ----------------------------------------------------------------------------


class Receiver:
    """Records the arrival time of each webhook alert, by job id."""

    def __init__(self) -> None:
        self.arrivals: dict[str, float] = {}
        self.cond = threading.Condition()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                now = time.monotonic()
                try:
                    job_id = json.loads(body)["data"]["job_id"]
                except (ValueError, KeyError, TypeError):
                    job_id = None
                if job_id:
                    with outer.cond:
                        outer.arrivals.setdefault(job_id, now)
                        outer.cond.notify_all()
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def wait(self, job_id: str, timeout: float) -> float | None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while job_id not in self.arrivals:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(left)
            return self.arrivals[job_id]


# --- the server ------------------------------------------------------------------------------------

# No token on loopback: a POST must say it is not a web page's (an X- header, or a JSON body).
SHIPPER = {"x-requested-with": "logdx-bench"}


def start_server(workdir: Path, port: int, receiver: Receiver, debounce: float, models: bool) -> subprocess.Popen:
    config = {
        "store": {"path": str(workdir / "logdx.db")},
        "llm": {"enabled": models},
        "retrieval": {"enabled": models},
        "server": {"rate_limit_lines_per_s": 0, "early_diagnosis_delay_s": debounce},
        "alerts": {"webhooks": [{"url": receiver.url, "secret": "whsec_YmVuY2gtc2VjcmV0LWZvci1sb2dkeC13ZWJob29rcyE="}]},
    }
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOGDX_")}
    env.update({"LOGDX_CONFIG": str(workdir / "config.yaml"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "PYTHONPATH": str(REPO / "service")})
    log = open(workdir / "server.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "logdx.api", "--port", str(port), "--log-level", "warning"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited ({proc.returncode}); see {workdir / 'server.log'}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("server not ready after 300 s")


# --- jobs ------------------------------------------------------------------------------------------


@dataclass
class Job:
    streams: list[list[bytes]]  # per stream: its chunks
    lines: int
    root_stream: int | None
    root_chunk: int | None


def make_job(scenario: str, seed: int, lines: int, streams: int, chunk_lines: int) -> Job:
    """A 64-rank synth log, split per rank (node lines to the node's first rank), rank r's lines
    going to stream r % streams, cut into chunks of `chunk_lines` lines."""
    buf = io.StringIO()
    truth = generate(buf, scenario=scenario, seed=seed, ranks=64, lines=lines, style="torchrun")
    normalizer = Normalizer()
    per_stream: list[list[str]] = [[] for _ in range(streams)]
    for line in buf.getvalue().splitlines():
        rec = normalizer.normalize(line)
        if rec.rank is not None and rec.rank < 64:
            owner = rec.rank
        elif rec.host in truth.hosts:
            owner = truth.hosts.index(rec.host) * 8
        else:
            owner = 0
        per_stream[owner % streams].append(line)
    chunked: list[list[bytes]] = []
    root_stream = root_chunk = None
    for s, lines_of in enumerate(per_stream):
        chunks = []
        for i in range(0, len(lines_of), chunk_lines):
            part = lines_of[i:i + chunk_lines]
            if truth.root_line is not None and root_stream is None and truth.root_line in part:
                root_stream, root_chunk = s, len(chunks)
            chunks.append(("\n".join(part) + "\n").encode())
        chunked.append(chunks)
    return Job(chunked, truth.lines_written, root_stream, root_chunk)


async def stream_job(url: str, job_id: str, job: Job, marks: dict[str, float], spread_to: list[str] | None = None) -> int:
    """Upload every stream concurrently; returns the lines the server accepted. With `spread_to`
    (several replicas), stream s goes to spread_to[s % len(spread_to)]."""

    async def body(s: int) -> AsyncIterator[bytes]:
        for i, chunk in enumerate(job.streams[s]):
            if s == job.root_stream and i == job.root_chunk:
                marks["root_sent"] = time.monotonic()
            yield chunk
            await asyncio.sleep(0)

    async def one(client: httpx.AsyncClient, s: int) -> int:
        base = spread_to[s % len(spread_to)] if spread_to else ""
        r = await client.post(f"{base}/v1/jobs/{job_id}/logs", content=body(s), headers={"content-type": "text/plain"})
        r.raise_for_status()
        return r.json()["accepted_lines"]

    limits = httpx.Limits(max_connections=len(job.streams))
    async with httpx.AsyncClient(base_url=url, headers=SHIPPER, timeout=600, limits=limits) as client:
        return sum(await asyncio.gather(*(one(client, s) for s in range(len(job.streams)))))


def percentile(values: list[float], p: float) -> float:
    values = sorted(values)
    k = (len(values) - 1) * p
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=1_000_000, help="throughput job: synth --lines (default 1M)")
    ap.add_argument("--streams", type=int, default=64, help="concurrent uploads per job (default 64)")
    ap.add_argument("--chunk-lines", type=int, default=200, help="lines per body chunk (default 200)")
    ap.add_argument("--jobs", type=int, default=10, help="latency: failing jobs to time (default 10)")
    ap.add_argument("--job-lines", type=int, default=20_000, help="latency: synth --lines per job (default 20k)")
    ap.add_argument("--scenario", default="xid79", help="synth scenario (default xid79)")
    ap.add_argument("--debounce", type=float, default=2.0, help="server.early_diagnosis_delay_s (default 2)")
    ap.add_argument("--models", action="store_true", help="enable retrieval and the LLM (default: rules only)")
    ap.add_argument("--json", type=Path, help="also write the results as JSON here")
    args = ap.parse_args()

    receiver = Receiver()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="logdx-bench-") as tmp:
        print(f"generating a {args.lines}-line 64-rank log ({args.scenario}) ...", flush=True)
        big = make_job(args.scenario, 1, args.lines, args.streams, args.chunk_lines)
        small = [make_job(args.scenario, 100 + i, args.job_lines, args.streams, args.chunk_lines)
                 for i in range(args.jobs)]
        proc = start_server(Path(tmp), port, receiver, args.debounce, args.models)
        try:
            print(f"throughput: {big.lines} lines over {args.streams} chunked streams ...", flush=True)
            t0 = time.monotonic()
            accepted = asyncio.run(stream_job(url, "bench-throughput", big, {}))
            elapsed = time.monotonic() - t0
            rate = accepted / elapsed
            mb = sum(len(c) for s in big.streams for c in s) / 1e6
            print(f"  {accepted} lines, {mb:.1f} MB in {elapsed:.2f} s: {rate:,.0f} lines/s ({mb / elapsed:.1f} MB/s)")
            t_end = time.monotonic()
            final = httpx.post(f"{url}/v1/jobs/bench-throughput/end", json={}, timeout=600).json()
            print(f"  final diagnosis in {time.monotonic() - t_end:.2f} s: {final['category']}/{final['failure_type']}")

            latencies: list[float] = []
            print(f"latency: {args.jobs} jobs of ~{args.job_lines} lines, debounce {args.debounce:g} s ...", flush=True)
            for i, job in enumerate(small):
                job_id = f"bench-latency-{i}"
                marks: dict[str, float] = {}
                asyncio.run(stream_job(url, job_id, job, marks))
                arrived = receiver.wait(job_id, timeout=60)
                if arrived is None or "root_sent" not in marks:
                    print(f"  {job_id}: no alert within 60 s")
                    continue
                latencies.append(arrived - marks["root_sent"])
                httpx.post(f"{url}/v1/jobs/{job_id}/end", json={}, timeout=60)
            metrics = httpx.get(f"{url}/metrics", timeout=10).text
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    results: dict[str, Any] = {
        "lines": accepted, "seconds": round(elapsed, 3), "lines_per_s": round(rate), "streams": args.streams,
        "chunk_lines": args.chunk_lines, "cpus": os.cpu_count(), "debounce_s": args.debounce,
        "alert_latency_s": [round(x, 3) for x in latencies],
    }
    if latencies:
        results["alert_p50_s"] = round(percentile(latencies, 0.5), 3)
        results["alert_p95_s"] = round(percentile(latencies, 0.95), 3)
        print(f"  root-cause line sent -> alert received: p50 {results['alert_p50_s']:.3f} s, "
              f"p95 {results['alert_p95_s']:.3f} s (n={len(latencies)}, min {min(latencies):.3f}, "
              f"max {max(latencies):.3f}; includes the {args.debounce:g} s debounce)")
        print(f"  without the debounce: p50 {results['alert_p50_s'] - args.debounce:.3f} s, "
              f"p95 {results['alert_p95_s'] - args.debounce:.3f} s")
    for line in metrics.splitlines():
        if line.startswith("logdx_stage_duration_seconds_sum") or line.startswith("logdx_stage_duration_seconds_count"):
            results.setdefault("stages", {})[line.split()[0]] = float(line.split()[1])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
