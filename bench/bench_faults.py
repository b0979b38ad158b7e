#!/usr/bin/env python3
"""Replicas under faults of the bus and the store: the table of issue 24, re-run.

Three replicas (`--role all`, 16 partitions, `bus.lease_s` 6, snapshots every 5 s) on a NATS
JetStream and a PostgreSQL of the benchmark's own (`logdx.testing.TempNats` / `TempPostgres`:
temporary directories, free loopback ports, never the machine's servers), 48 shippers
(`logdx.testing.Fleet`) streaming a 64-rank `logdx.synth` job (``--lines``) in batches with
Idempotency-Keys, a failed batch sent again to another replica, paced over ``--seconds``. Each
fault ``--at`` seconds into the stream. Per row:

- lost / doubled: the lines the job counted (`GET /v1/jobs/{id}` after `/end`) against the lines
  the shippers had acknowledged (once per key);
- alerts: diagnosis webhooks for the job; whether the final diagnosis is the job's truth;
- what the shippers saw (every answer by status and code; a 5xx without Retry-After is counted
  apart), and what `/end` answered before its report;
- recovery: from the dependency's return to the first 2xx of a request sent after it; for the
  kills, the take-over (from the first kill to the partition's last new owner).

Then ``--reclaim-jobs`` jobs of ``--lines`` lines, one after another, each ended: the bus storage
(`logdx_bus_stored_bytes`) at its peak and once they have all ended.

Usage::

    nice python bench/bench_faults.py [--rows none,nats-term,...] [--json bench-results/faults.json]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "service"))
sys.path.insert(0, str(REPO / "bench"))

import bench_cluster
from logdx.bus.records import partition_of
from logdx.synth import generate
from logdx.testing import Fleet, TempNats, TempPostgres, shipper_logs

SHIPPER = {"x-requested-with": "logdx-bench"}
PARTITIONS = 16


class Hooks:
    """A webhook receiver that counts the diagnosis alerts per job."""

    def __init__(self) -> None:
        self.alerts: Counter[str] = Counter()
        self.said: dict[str, list[str]] = {}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
                if body.get("type") == "logdx.diagnosis":
                    job, report = body["data"]["job_id"], body["data"]["report"]
                    outer.alerts[job] += 1
                    outer.said.setdefault(job, []).append(
                        f"{report['failure_type']} on {report['culprits']['hosts']}, root line "
                        f"{(report['root_cause'] or {}).get('line_no')}: {(report['root_cause'] or {}).get('text')}")
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


class Replica(bench_cluster.Replica):
    """A replica of bench_cluster's, that the benchmark may also kill."""

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


@dataclass
class Run:
    """One row's world: its servers, its replicas, its job, and what the fault noted."""

    nats: TempNats
    pg: TempPostgres
    replicas: list[Replica]
    job_id: str
    fleet: Fleet
    marks: dict[str, Any] = field(default_factory=dict)

    def live(self) -> Replica:
        return next(r for r in self.replicas if r.alive)

    def owner(self) -> str | None:
        parts = httpx.get(self.live().url + "/v1/cluster", headers=SHIPPER, timeout=10).json()["partitions"]
        return parts[partition_of(self.job_id, PARTITIONS)]["owner"]

    def replica(self, name: str) -> Replica:
        return next(r for r in self.replicas if r.name == name)


@dataclass
class Row:
    name: str
    what: str
    fault: Callable[[Run, float], None] | None = None
    nats_store: int | None = None
    bus: dict[str, Any] = field(default_factory=dict)
    before: Callable[[TempNats], None] | None = None


def _nats_down(kill: bool) -> Callable[[Run, float], None]:
    def fault(run: Run, down_s: float) -> None:
        run.nats.kill() if kill else run.nats.stop()
        time.sleep(down_s)
        run.nats.start()
        run.marks["back_at"] = time.monotonic()
    return fault


def _pg_down(mode: str) -> Callable[[Run, float], None]:
    def fault(run: Run, down_s: float) -> None:
        run.pg.stop(mode)
        time.sleep(down_s)
        run.pg.start()
        run.marks["back_at"] = time.monotonic()
    return fault


def _kill_owner(then_taker: bool) -> Callable[[Run, float], None]:
    def fault(run: Run, _down_s: float) -> None:
        first = run.owner()
        assert first is not None
        t0 = time.monotonic()
        run.replica(first).kill()
        run.fleet.dead.add(run.replicas.index(run.replica(first)))
        killed = {first}
        if then_taker:
            second = _wait_owner(run, killed)
            run.marks["second_kill_s"] = round(time.monotonic() - t0, 2)
            run.replica(second).kill()
            run.fleet.dead.add(run.replicas.index(run.replica(second)))
            killed.add(second)
        _wait_owner(run, killed)
        run.marks["takeover_s"] = round(time.monotonic() - t0, 2)
        run.marks["back_at"] = time.monotonic()
    return fault


def _wait_owner(run: Run, not_these: set[str]) -> str:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            owner = run.owner()
        except httpx.HTTPError:
            owner = None
        if owner is not None and owner not in not_these:
            return owner
        time.sleep(0.05)
    raise SystemExit("no replica took the partition over within 120 s")


def _operator_stream(max_bytes: int) -> Callable[[TempNats], None]:
    """The stream made beforehand by an operator, as older logdx made it: small, `discard: old`."""
    def make(nats: TempNats) -> None:
        async def add() -> None:
            import nats as nats_client
            from nats.js import api

            nc = await nats_client.connect(nats.url)
            await nc.jetstream().add_stream(api.StreamConfig(
                name="logdx-lines", subjects=["logdx.lines.*"], storage=api.StorageType.FILE, max_bytes=max_bytes,
                discard=api.DiscardPolicy.OLD, duplicate_window=120))
            await nc.close()
        asyncio.run(add())
    return make


ROWS = [
    Row("none", "none"),
    Row("nats-term", "NATS SIGTERM, down {down:g} s", _nats_down(kill=False)),
    Row("nats-kill", "NATS SIGKILL, down {down:g} s", _nats_down(kill=True)),
    Row("pg-fast", "PostgreSQL fast shutdown, down {down:g} s", _pg_down("fast")),
    Row("pg-immediate", "PostgreSQL immediate shutdown, down {down:g} s", _pg_down("immediate")),
    Row("owner-then-taker", "SIGKILL the job's owner; then the replica taking over", _kill_owner(then_taker=True)),
    Row("operator-1mib", "an operator's 1 MiB `max_bytes` (and `discard: old`) on the stream, then the owner "
        "SIGKILLed", _kill_owner(then_taker=False), before=_operator_stream(1 << 20)),
    Row("store-16mb", "JetStream store 16 MB (`bus.max_bytes` 12 MiB)", None, nats_store=16 << 20,
        bus={"max_bytes": 12 << 20}),
]


def _cluster(pg_url: str, nats: TempNats, bus: dict[str, Any]) -> dict[str, Any]:
    """What the replicas share (bench_cluster.Replica writes the rest: no models, alerts to the hooks)."""
    return {
        "server": {"role": "all"},
        "store": {"url": pg_url},
        "bus": {"url": nats.url, "partitions": PARTITIONS, "lease_s": 6.0, "snapshot_interval_s": 5.0, **bus},
    }


def _database(pg: TempPostgres) -> str:
    import psycopg

    name = "bench_" + uuid.uuid4().hex[:8]
    with psycopg.connect(pg.url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return pg.url.rsplit("/", 1)[0] + f"/{name}"


def _start_replicas(tmp: Path, row: str, pg_url: str, nats: TempNats, hooks: Hooks, bus: dict[str, Any]) -> list[Replica]:
    replicas = [Replica(tmp / row / f"r{i}", f"{row}-{i}", hooks, 2.0, _cluster(pg_url, nats, bus))  # type: ignore[arg-type]
                for i in range(3)]
    for r in replicas:
        r.ready()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the partitions spread over the three
        parts = httpx.get(replicas[0].url + "/v1/cluster", headers=SHIPPER, timeout=10).json()["partitions"]
        if len({p["owner"] for p in parts} - {None}) == 3 and all(p["owner"] for p in parts):
            break
        time.sleep(0.5)
    return replicas


def _end(run: Run) -> tuple[dict[str, Any], Counter[str]]:
    """/end, to live replicas in turn until the report comes; what it answered meanwhile."""
    seen: Counter[str] = Counter()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        for r in run.replicas:
            if not r.alive:
                continue
            try:
                a = httpx.post(f"{r.url}/v1/jobs/{run.job_id}/end", json={"exit_code": 1}, headers=SHIPPER, timeout=120)
            except httpx.HTTPError as e:
                seen[type(e).__name__] += 1
                continue
            if a.status_code == 200:
                return a.json(), seen
            seen[f"{a.status_code} {a.json()['error']['code']}"] += 1
            time.sleep(float(a.headers.get("retry-after", "1")))
    raise SystemExit(f"{run.job_id}: no final report within 300 s: {seen}")


def _statuses(fleet: Fleet) -> str:
    s = fleet.outcome.statuses
    ok = sum(v for k, v in s.items() if k.startswith("2"))
    errors = [f"{v}× {k}" for k, v in sorted(s.items(), key=lambda kv: -kv[1]) if not k.startswith("2")]
    bare = sum(fleet.outcome.without_retry_after.values())
    tail = f"; {bare} without Retry-After" if bare else ""
    return f"{ok}× 2xx" + (", " + ", ".join(errors) if errors else "") + tail + \
        f"; slowest {fleet.outcome.slowest_s:.1f} s"


def run_row(row: Row, args: argparse.Namespace, pg: TempPostgres, tmp: Path, lines: list[str],
            hosts: list[str], truth: Any) -> dict[str, Any]:
    what = row.what.format(down=args.down)
    print(f"\n== {row.name}: {what}", flush=True)
    nats = TempNats(tmp / row.name / "nats", max_store_bytes=row.nats_store).start()
    hooks = Hooks()
    pg_url = _database(pg)
    if row.before:
        row.before(nats)
    replicas = _start_replicas(tmp, row.name, pg_url, nats, hooks, row.bus)
    job_id = f"bench-{row.name}"
    per_shipper = shipper_logs(lines, hosts, args.shippers)
    fleet = Fleet([r.url for r in replicas], job_id, per_shipper, headers=SHIPPER, batch=args.batch,
                  lines_per_s=len(lines) / args.seconds, timeout_s=120.0)
    run = Run(nats, pg, replicas, job_id, fleet)
    try:
        faulted = threading.Thread(target=lambda: (time.sleep(args.at), row.fault(run, args.down))
                                   if row.fault else None)
        fleet.started_at = time.monotonic()
        faulted.start()
        fleet.run()
        faulted.join()
        stream_s = time.monotonic() - fleet.started_at
        report, end_seen = _end(run)
        live = run.live()
        detail = httpx.get(f"{live.url}/v1/jobs/{job_id}", headers=SHIPPER, timeout=10).json()
        time.sleep(args.settle)  # alerts still under way arrive; the owners save and purge
        counted, acked = int(detail["lines"]), fleet.lines
        right = (report["failure_type"], report["culprits"]["hosts"]) == (truth.failure_type,
                                                                          list(truth.culprit_hosts))
        back = run.marks.get("back_at")
        first_ok = fleet.outcome.first_ok_sent_after(back) if back else None
        out = {
            "fault": what, "lines": len(lines), "acknowledged": acked, "counted": counted,
            "lost": max(0, acked - counted), "doubled": max(0, counted - acked),
            "alerts": hooks.alerts[job_id], "alerts_said": hooks.said.get(job_id, []), "diagnosis_right": right, "failure_type": report["failure_type"],
            "gaps": detail.get("bus_gaps", []), "shippers_saw": dict(fleet.outcome.statuses),
            "without_retry_after": dict(fleet.outcome.without_retry_after),
            "slowest_answer_s": round(fleet.outcome.slowest_s, 2), "end_saw": dict(end_seen),
            "stream_s": round(stream_s, 1),
            "recovery_s": round(first_ok - back, 2) if back and first_ok else None,
            "bus_bytes_after": live.metric("logdx_bus_stored_bytes"),
            **{k: v for k, v in run.marks.items() if k != "back_at"},
        }
        print(f"  acknowledged {acked:,}, counted {counted:,}: lost {out['lost']}, doubled {out['doubled']}; "
              f"alerts {out['alerts']} ({'right' if right else 'WRONG'}: {report['failure_type']})", flush=True)
        if out["alerts"] != 1:
            for said in out["alerts_said"]:
                print(f"    alert: {said[:160]}", flush=True)
        print(f"  shippers saw: {_statuses(fleet)}; /end saw {dict(end_seen) or 'its report at once'}", flush=True)
        print(f"  recovery {out['recovery_s']} s; {run.marks}; bus {out['bus_bytes_after']} bytes after the end",
              flush=True)
        return out
    finally:
        for r in replicas:
            r.stop()
        nats.stop()
        hooks.server.shutdown()


def run_reclaim(args: argparse.Namespace, pg: TempPostgres, tmp: Path, jobs: list[tuple[list[str], list[str]]]) -> dict:
    """Jobs one after another, each ended: what the bus holds at its fullest and at the end."""
    print(f"\n== reclaim: {len(jobs)} jobs of {len(jobs[0][0]):,} lines, each ended", flush=True)
    nats = TempNats(tmp / "reclaim" / "nats").start()
    hooks = Hooks()
    replicas = _start_replicas(tmp, "reclaim", _database(pg), nats, hooks, {})
    peak = 0.0
    stop = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not stop.wait(1.0):
            try:
                peak = max(peak, replicas[0].metric("logdx_bus_stored_bytes") or 0.0)
            except httpx.HTTPError:
                pass

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        t0 = time.monotonic()
        total = 0
        for i, (lines, hosts) in enumerate(jobs):
            job_id = f"reclaim-{i}"
            fleet = Fleet([r.url for r in replicas], job_id, shipper_logs(lines, hosts, args.shippers),
                          headers=SHIPPER, batch=1000, timeout_s=120.0)
            fleet.run()
            total += fleet.lines
            run = Run(nats, pg, replicas, job_id, fleet)
            _end(run)
            print(f"  job {i}: {fleet.lines:,} lines acknowledged and ended; bus now "
                  f"{replicas[0].metric('logdx_bus_stored_bytes'):,.0f} bytes", flush=True)
        time.sleep(args.settle)
        after = replicas[0].metric("logdx_bus_stored_bytes")
        records = replicas[0].metric("logdx_bus_stored_records")
        out = {"jobs": len(jobs), "lines": total, "seconds": round(time.monotonic() - t0, 1),
               "peak_bus_bytes": peak, "bus_bytes_after": after, "bus_records_after": records}
        print(f"  bus storage: peak {peak / 1e6:.1f} MB while streaming; {after:,.0f} bytes ({records:.0f} records) "
              f"once all {len(jobs)} jobs ended", flush=True)
        return out
    finally:
        stop.set()
        for r in replicas:
            r.stop()
        nats.stop()
        hooks.server.shutdown()


def _job(lines: int, seed: int) -> tuple[list[str], list[str], Any]:
    buf = io.StringIO()
    truth = generate(buf, scenario="xid79", seed=seed, ranks=64, lines=lines, style="torchrun", gpus_per_host=8)
    return buf.getvalue().splitlines(), list(truth.hosts), truth


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=300_000, help="lines asked of logdx.synth (300,000 give 242,087)")
    ap.add_argument("--seconds", type=float, default=52.0, help="the stream is paced over this long")
    ap.add_argument("--at", type=float, default=10.0, help="the fault, this long into the stream")
    ap.add_argument("--down", type=float, default=7.0, help="how long NATS or PostgreSQL stays down")
    ap.add_argument("--shippers", type=int, default=48)
    ap.add_argument("--batch", type=int, default=100, help="lines per upload")
    ap.add_argument("--settle", type=float, default=12.0, help="after /end: wait for late alerts and the purge")
    ap.add_argument("--rows", default=",".join(r.name for r in ROWS))
    ap.add_argument("--reclaim-jobs", type=int, default=10)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    lines, hosts, truth = _job(args.lines, seed=7)
    print(f"job: {len(lines):,} lines, 64 ranks, {truth.failure_type} on {list(truth.culprit_hosts)}; "
          f"{args.shippers} shippers, batches of {args.batch}, over {args.seconds:g} s", flush=True)
    results: dict[str, Any] = {"cpus": os.cpu_count(), "lines": len(lines), "rows": {}}
    with tempfile.TemporaryDirectory(prefix="logdx-bench-faults-") as tmp, TempPostgres() as pg:
        for row in ROWS:
            if row.name in args.rows.split(","):
                results["rows"][row.name] = run_row(row, args, pg, Path(tmp), lines, hosts, truth)
        if args.reclaim_jobs:
            jobs = [(lines, hosts)] + [_job(args.lines, seed=100 + i)[:2] for i in range(args.reclaim_jobs - 1)]
            results["reclaim"] = run_reclaim(args, pg, Path(tmp), jobs)
    print("\n| fault | lost | doubled | alerts | what shippers saw | recovery |\n|---|---|---|---|---|---|")
    for r in results["rows"].values():
        recovery = (f"takeover {r['takeover_s']} s" if "takeover_s" in r else
                    f"{r['recovery_s']} s after it returns" if r.get("recovery_s") is not None else "—")
        saw = {k: v for k, v in r["shippers_saw"].items() if not k.startswith("2")}
        seen = ", ".join(f"{v}× {k}" for k, v in sorted(saw.items(), key=lambda kv: -kv[1])) or "2xx only"
        print(f"| {r['fault']} | {r['lost']} | {r['doubled']} | {r['alerts']} | {seen}; /end: "
              f"{r['end_saw'] or 'at once'} | {recovery} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=str))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
