#!/usr/bin/env python3
"""Benchmark one replica against a cluster: the embedded default (SQLite, spool files) as the
baseline, one replica on PostgreSQL + NATS JetStream, and three replicas, all measured in the same
run on this machine.

For each setup:

1. ingest: a `logdx.synth` 64-rank log (``--lines``) streamed over ``--streams`` concurrent chunked
   uploads into one job (with three replicas, stream s goes to replica s % 3); lines accepted
   (2xx: fsync'd in the spool, or acknowledged by JetStream) per second of wall time;
2. the bus's cost per line: the time spent publishing (or spooling and fsyncing) divided by the lines;
3. latency: ``--jobs`` failing jobs streamed one after the other; from the moment the chunk holding
   the root-cause line is sent to the moment the webhook alert arrives (includes the 2 s debounce);
4. balance (three replicas): ``--spread`` jobs at once over all replicas; each replica's CPU time and
   the lines it ingested and applied (its partitions). On a 2-core machine three replicas cannot be
   faster than one: what scales is how evenly the work spreads, so that more machines would help.

Needs PostgreSQL and NATS (JetStream) on loopback (``--pg``, ``--nats``). Usage::

    python bench/bench_cluster.py [--lines 300000] [--jobs 4] [--json bench-results/cluster.json]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "service"))
sys.path.insert(0, str(REPO / "bench"))

from bench_serve import SHIPPER, Job, Receiver, free_port, make_job, percentile, stream_job

CLK = os.sysconf("SC_CLK_TCK")


class Replica:
    def __init__(self, workdir: Path, name: str, receiver: Receiver, debounce: float,
                 cluster: dict[str, Any] | None) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.name = name
        self.port = free_port()
        config: dict[str, Any] = {
            "store": {"path": str(workdir / "logdx.db")},
            "llm": {"enabled": False}, "retrieval": {"enabled": False},
            "server": {"rate_limit_lines_per_s": 0, "early_diagnosis_delay_s": debounce, "replica_id": name},
            "alerts": {"webhooks": [{"url": receiver.url, "secret": "whsec_YmVuY2gtc2VjcmV0LWZvci1sb2dkeA=="}]},
        }
        for section, values in (cluster or {}).items():
            config.setdefault(section, {}).update(values)
        (workdir / "config.yaml").write_text(yaml.safe_dump(config))
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOGDX_")}
        env.update({"LOGDX_CONFIG": str(workdir / "config.yaml"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO / "service")})
        self.proc = subprocess.Popen([sys.executable, "-m", "logdx.api", "--port", str(self.port), "--log-level",
                                      "warning"], env=env, stdout=open(workdir / "server.log", "ab"),
                                     stderr=subprocess.STDOUT, cwd=REPO)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ready(self) -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = (self.workdir / "server.log").read_text(errors="replace")[-3000:]
                raise SystemExit(f"replica {self.name} exited ({self.proc.returncode}):\n{log}")
            try:
                if httpx.get(self.url + "/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise SystemExit(f"replica {self.name} not ready")

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK

    def metric(self, name: str, **labels: str) -> float:
        total = 0.0
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            named = line.startswith(name + "{") or line.startswith(name + " ")
            if named and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def spread_job(urls: list[str], job_id: str, job: Job, marks: dict[str, float]) -> int:
    """bench_serve.stream_job, stream s going to urls[s % len(urls)]."""
    return await stream_job(urls[0], job_id, job, marks, spread_to=urls if len(urls) > 1 else None)


def run_setup(name: str, n: int, cluster: dict[str, Any] | None, args: argparse.Namespace, big: Job,
              small: list[Job], spread: list[Job], tmp: Path) -> dict[str, Any]:
    print(f"\n== {name} ==", flush=True)
    receiver = Receiver()
    replicas = [Replica(tmp / f"{name}-{i}", f"{name}-{i}", receiver, args.debounce, cluster) for i in range(n)]
    try:
        for r in replicas:
            r.ready()
        if cluster:
            time.sleep(cluster["bus"]["lease_s"])  # the partitions spread over the replicas
        urls = [r.url for r in replicas]
        cpu0 = [r.cpu_s() for r in replicas]
        t0 = time.monotonic()
        accepted = asyncio.run(spread_job(urls, f"{name}-ingest", big, {}))
        elapsed = time.monotonic() - t0
        httpx.post(f"{urls[0]}/v1/jobs/{name}-ingest/end", json={}, headers=SHIPPER, timeout=600)
        stage = {s: sum(r.metric("logdx_stage_duration_seconds_sum", stage=s) for r in replicas)
                 for s in ("publish", "spool", "fsync")}
        bus_s = stage["publish"] if cluster else stage["spool"] + stage["fsync"]
        out: dict[str, Any] = {"replicas": n, "lines": accepted, "seconds": round(elapsed, 2),
                               "lines_per_s": round(accepted / elapsed),
                               "durable_log_us_per_line": round(bus_s / accepted * 1e6, 2),
                               "cpu_s_ingest": round(sum(r.cpu_s() for r in replicas) - sum(cpu0), 1)}
        print(f"  ingest: {accepted:,} lines in {elapsed:.1f} s = {out['lines_per_s']:,} lines/s; "
              f"{'publishing' if cluster else 'spool + fsync'} {out['durable_log_us_per_line']} us/line", flush=True)
        latencies = []
        for i, job in enumerate(small):
            job_id, marks = f"{name}-latency-{i}", {}
            asyncio.run(spread_job(urls, job_id, job, marks))
            arrived = receiver.wait(job_id, timeout=60)
            if arrived is not None and "root_sent" in marks:
                latencies.append(arrived - marks["root_sent"])
            httpx.post(f"{urls[i % n]}/v1/jobs/{job_id}/end", json={}, headers=SHIPPER, timeout=60)
        if latencies:
            out["alert_p50_s"] = round(percentile(latencies, 0.5), 3)
            out["alert_max_s"] = round(max(latencies), 3)
            print(f"  root line -> alert: p50 {out['alert_p50_s']} s, max {out['alert_max_s']} s (n={len(latencies)}, "
                  f"debounce {args.debounce:g} s)", flush=True)
        if n > 1:
            cpu1 = [r.cpu_s() for r in replicas]
            ing0 = [r.metric("logdx_ingest_lines_total") for r in replicas]
            app0 = [r.metric("logdx_bus_applied_lines") for r in replicas]
            with concurrent.futures.ThreadPoolExecutor(len(spread)) as pool:
                list(pool.map(lambda ij: asyncio.run(spread_job(urls, f"{name}-spread-{ij[0]}", ij[1], {})),
                              enumerate(spread)))
            for i in range(len(spread)):
                httpx.post(f"{urls[i % n]}/v1/jobs/{name}-spread-{i}/end", json={}, headers=SHIPPER, timeout=120)
            cpu = [round(r.cpu_s() - c, 1) for r, c in zip(replicas, cpu1)]
            ingested = [round(r.metric("logdx_ingest_lines_total") - c) for r, c in zip(replicas, ing0)]
            applied = [round(r.metric("logdx_bus_applied_lines") - c) for r, c in zip(replicas, app0)]
            owned = [int(r.metric("logdx_partition_owned")) for r in replicas]
            out["balance"] = {"cpu_s": cpu, "lines_ingested": ingested, "lines_applied": applied,
                              "partitions_owned": owned,
                              "cpu_max_over_mean": round(max(cpu) / (sum(cpu) / len(cpu)), 2)}
            print(f"  balance over {len(spread)} jobs: CPU s per replica {cpu}, lines ingested {ingested}, "
                  f"lines applied {applied}, partitions {owned}; busiest/mean CPU "
                  f"{out['balance']['cpu_max_over_mean']}", flush=True)
        return out
    finally:
        for r in replicas:
            r.stop()
        receiver.server.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=300_000)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--chunk-lines", type=int, default=200)
    ap.add_argument("--jobs", type=int, default=4, help="latency: failing jobs per setup")
    ap.add_argument("--spread", type=int, default=12, help="balance: jobs streamed at once over three replicas")
    ap.add_argument("--debounce", type=float, default=2.0)
    ap.add_argument("--pg", default="postgresql://127.0.0.1:5432/test")
    ap.add_argument("--nats", default="nats://127.0.0.1:4222")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import psycopg

    schema = "bench_" + uuid.uuid4().hex[:8]
    with psycopg.connect(args.pg, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    print(f"generating logs: {args.lines:,} lines, {args.jobs} + {args.spread} failing jobs ...", flush=True)
    big = make_job("xid79", 1, args.lines, args.streams, args.chunk_lines)
    small = [make_job("xid79", 100 + i, 20_000, args.streams, args.chunk_lines) for i in range(args.jobs)]
    spread = [make_job("xid79", 200 + i, 20_000, 16, args.chunk_lines) for i in range(args.spread)]
    results: dict[str, Any] = {"cpus": os.cpu_count(), "lines": args.lines}
    try:
        with tempfile.TemporaryDirectory(prefix="logdx-bench-cluster-") as tmp:
            results["embedded"] = run_setup("embedded", 1, None, args, big, small, spread, Path(tmp))
            for name, n in (("pg-js-1", 1), ("pg-js-3", 3)):
                prefix = "b" + uuid.uuid4().hex[:8]
                cluster = {"store": {"url": f"{args.pg}?options=-csearch_path%3D{schema}_{n}"},
                           "bus": {"url": args.nats, "prefix": prefix, "partitions": 12, "lease_s": 3.0}}
                with psycopg.connect(args.pg, autocommit=True) as conn:
                    conn.execute(f"CREATE SCHEMA {schema}_{n}")
                results[name] = run_setup(name, n, cluster, args, big, small, spread, Path(tmp))
                asyncio.run(_delete_stream(args.nats, f"{prefix}-lines"))
    finally:
        with psycopg.connect(args.pg, autocommit=True) as conn:
            for s in (schema, f"{schema}_1", f"{schema}_3"):
                conn.execute(f"DROP SCHEMA IF EXISTS {s} CASCADE")
    base = results["embedded"]
    print("\nagainst the embedded baseline (same run, same machine):")
    for name in ("pg-js-1", "pg-js-3"):
        r = results[name]
        ratio = r["lines_per_s"] / base["lines_per_s"]
        lat = (r.get("alert_p50_s") or 0) / (base.get("alert_p50_s") or 1)
        print(f"  {name}: ingest {ratio:.2f}x ({r['lines_per_s']:,} vs {base['lines_per_s']:,} lines/s), "
              f"root line -> alert p50 {lat:.2f}x ({r.get('alert_p50_s')} vs {base.get('alert_p50_s')} s), "
              f"durable log {r['durable_log_us_per_line']} vs {base['durable_log_us_per_line']} us/line")
        r["vs_embedded"] = {"ingest": round(ratio, 2), "alert_p50": round(lat, 2)}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")
    return 0


async def _delete_stream(url: str, name: str) -> None:
    import nats

    nc = await nats.connect(url)
    try:
        await nc.jetstream().delete_stream(name)
    finally:
        await nc.close()


if __name__ == "__main__":
    sys.exit(main())
