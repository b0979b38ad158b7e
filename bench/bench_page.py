#!/usr/bin/env python3
"""Benchmark the job page (issue 22): how long the page of a big job takes once it is diagnosed, and
how much it weighs.

1. A `logdx.synth` job (default: 256 ranks, ~2,000,000 lines, Xid 79 near the end) is streamed into the real
   server (`python -m logdx.api`, uvicorn, fresh database, rules only) and ended (`/end`: the final
   diagnosis, which stores the page's view with the report).
2. `GET /jobs/{id}` is then timed ``--gets`` times, wall clock from request to the last byte; the
   page's bytes and those of the scripts and styles it loads are counted (the page is drawn from the
   stored view: templates, per-rank progress, events; the log is not read again).
3. In process, on the same log: what building the view adds to a diagnosis, and the size of the
   single-file page `diagnose --html` writes (scripts and styles inlined).

Usage::

    python bench/bench_page.py [--lines 2000000] [--ranks 256] [--gets 5] [--json bench-results/page.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import Receiver, free_port, start_server
from logdx.config import load_settings
from logdx.pipeline import Engine
from logdx.synth import generate
from logdx.web.render import STATIC_DIR, Done, render_job_body, render_job_page
from logdx.web.view import build_view

_CHUNK = 1 << 20


def write_job(path: Path, lines: int, ranks: int, seed: int) -> None:
    with path.open("w", encoding="utf-8") as f:
        generate(f, scenario="xid79", seed=seed, ranks=ranks, lines=lines, style="torchrun", fail_at=0.99)


def chunks(path: Path) -> Iterator[bytes]:
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            yield block


def served(log: Path, workdir: Path, gets: int) -> dict[str, float]:
    receiver = Receiver()
    port = free_port()
    proc = start_server(workdir, port, receiver, debounce=3600.0, models=False)
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=3600) as client:
            t0 = time.perf_counter()
            r = client.post("/v1/jobs/big/logs", content=chunks(log),
                            headers={"content-type": "text/plain", "x-logdx-bench": "page"})
            r.raise_for_status()
            ingest_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            client.post("/v1/jobs/big/end", json={}).raise_for_status()
            end_s = time.perf_counter() - t0
            times, size = [], 0
            for _ in range(gets):
                t0 = time.perf_counter()
                page = client.get("/jobs/big")
                times.append(time.perf_counter() - t0)
                page.raise_for_status()
                size = len(page.content)
            assets = sum(len(client.get(f"/static/{name}").content)
                         for name in ("vendor/uplot/uPlot.iife.min.js", "vendor/uplot/uPlot.min.css", "page.css",
                                      "job.js"))
    finally:
        proc.terminate()
        proc.wait(30)
        receiver.server.shutdown()
    return {"ingest_s": ingest_s, "end_s": end_s, "page_s_median": statistics.median(times),
            "page_s_max": max(times), "page_bytes": size, "assets_bytes": assets}


def in_process(log: Path) -> dict[str, float]:
    settings = load_settings(env={})
    settings = settings.model_copy(update={"llm": settings.llm.model_copy(update={"enabled": False}),
                                           "retrieval": settings.retrieval.model_copy(update={"enabled": False})})
    engine = Engine.create(settings)
    session = engine.new_session()
    with log.open("rb") as f:
        session.feed_lines(f)
    report = session.report()
    t0 = time.perf_counter()
    view = build_view("big", report, session)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    render_job_body(view)
    body_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    html = render_job_page(view, Done(served=False), inline=True)
    render_s = time.perf_counter() - t0
    return {"view_build_s": build_s, "body_render_s": body_s, "view_json_bytes": len(view.model_dump_json()),
            "file_render_s": render_s, "file_bytes": len(html.encode()), "lines": report.compression.lines_in, "lanes": len(view.lanes),
            "ranks": sum(len(lane.ranks) for lane in view.lanes), "events": len(view.events),
            "diagnosis": f"{report.failure_type} on {','.join(report.culprits.hosts)}", "log_bytes": log.stat().st_size}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=2_000_000)
    ap.add_argument("--ranks", type=int, default=256)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--gets", type=int, default=5)
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="logdx-bench-page-") as tmp:
        work = Path(tmp)
        log = work / "job.log"
        write_job(log, args.lines, args.ranks, args.seed)
        local = in_process(log)
        remote = served(log, work, args.gets)
    static_bytes = sum(p.stat().st_size for p in STATIC_DIR.rglob("*") if p.is_file())
    figures = {**local, **remote, "static_dir_bytes": static_bytes}
    print(f"job: {local['lines']:,} lines, {args.ranks} ranks -> {local['lanes']} host lanes, {local['ranks']} "
          f"rank rows, {local['events']} events; {local['diagnosis']}")
    print(f"served: ingest {remote['ingest_s']:.1f} s, /end {remote['end_s']:.2f} s; GET /jobs/big median "
          f"{remote['page_s_median'] * 1000:.0f} ms (max {remote['page_s_max'] * 1000:.0f} ms), "
          f"{remote['page_bytes'] / 1e3:.0f} kB + {remote['assets_bytes'] / 1e3:.0f} kB of scripts and styles "
          f"= {(remote['page_bytes'] + remote['assets_bytes']) / 1e6:.2f} MB")
    print(f"in process: the view adds {local['view_build_s'] * 1000:.0f} ms to the diagnosis, rendering its log "
          f"part {local['body_render_s'] * 1000:.0f} ms ({local['view_json_bytes'] / 1e3:.0f} kB stored); "
          f"diagnose --html writes {local['file_bytes'] / 1e3:.0f} kB in {local['file_render_s'] * 1000:.0f} ms "
          f"(the log is {local['log_bytes'] / local['file_bytes']:.0f}x larger)")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
