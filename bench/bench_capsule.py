#!/usr/bin/env python3
"""What keeping the evidence capsule's lines costs per line: one job's session fed the same 64-rank log with
and without the recorder (`Session.record_evidence`, what `logdx run` turns on when an actuator is
configured), interleaved A B A B in one process; CPU seconds (`time.process_time`) of feeding and diagnosing,
medians, and the ratio pair by pair. Then the capsule of the last run is written and its size printed.

    python bench/bench_capsule.py [--lines 200000] [--runs 3]

Ratios, not seconds, are what to quote: the machine is shared.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_core import make_log
from logdx.act.capsule import CapsuleWriter, Evidence
from logdx.config import Settings
from logdx.normalize import Source
from logdx.pipeline import Engine, Session


def run_once(engine: Engine, lines: list[bytes], record: bool) -> tuple[float, Session]:
    capsule = engine.settings.actions.capsule
    t0 = time.process_time()
    session = engine.new_session(live=True)
    if record:
        session.record_evidence(capsule.context_lines, capsule.max_sources, capsule.near_s)
    source = Source(stream="stdout")
    for line in lines:
        session.feed(line, source)
    session.report(exit_code=1)
    return time.process_time() - t0, session


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=200_000)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    log = make_log(args.lines)
    lines = log.read_bytes().splitlines()
    settings = Settings(data_dir=Path(tempfile.mkdtemp(prefix="logdx-bench-capsule-")))
    settings.llm.enabled = settings.retrieval.enabled = False
    engine = Engine.create(settings)
    run_once(engine, lines[:20000], True)  # warm up: rules compiled, caches filled
    with_rec, without, ratios = [], [], []
    session = None
    for _ in range(args.runs):
        b, _ = run_once(engine, lines, False)
        a, session = run_once(engine, lines, True)
        with_rec.append(a)
        without.append(b)
        ratios.append(a / b)
    print(f"feed + diagnose of {len(lines):,} lines, {args.runs} runs each, interleaved")
    print(f"  with the recorder     CPU {statistics.median(with_rec):.2f} s (median)")
    print(f"  without               CPU {statistics.median(without):.2f} s (median)")
    print(f"  with / without CPU: median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")
    assert session is not None and session.recorder is not None
    report = session.report(exit_code=1)
    capsule = CapsuleWriter(settings.actions.capsule).write("bench", report, {"action": "cordon"},
                                                            report.culprits.hosts, Evidence(recorder=session.recorder))
    print(f"  capsule: {capsule.size:,} bytes (cap {settings.actions.capsule.max_bytes:,}), "
          f"{len(capsule.left_out)} parts left out")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
