#!/usr/bin/env python3
"""The streaming core's speed against an earlier commit, in the same run: rules-only end-to-end
`diagnose` of a 1M-line 64-rank log by this checkout and by a baseline commit, interleaved A B A B,
each a fresh process; CPU seconds (user + sys, from the OS's accounting of the finished child) and
peak RSS per run, medians, and the ratio this/baseline pair by pair.

    python bench/bench_core.py [--baseline 7974a70] [--lines 1000000] [--runs 5] [--json out.json]

The baseline is checked out with `git worktree add --detach` into a temporary directory and run by the
same interpreter with its own `service/` first on the path, so both sides read the same file with the
same libraries. The log comes from `logdx synth` (cached in .cache/bench/). Ratios, not seconds, are
what to quote: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache" / "bench"
# The commit issue 19 (the per-rank timeline) started from: "today's code" of its speed goal.
DEFAULT_BASELINE = "7974a70"


def make_log(lines: int) -> Path:
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / f"core-{lines}.log"
    if not path.exists():
        subprocess.run([sys.executable, "-m", "logdx.synth", "--scenario", "xid79", "--ranks", "64", "--lines",
                        str(lines), "--seed", "11", "-o", str(path)], check=True, cwd=REPO)
    return path


def run_once(service: Path, log: Path) -> tuple[float, float]:
    """(CPU seconds, peak RSS MiB) of one `diagnose` process reading `log` with `service` first on the path."""
    env = {**os.environ, "PYTHONPATH": str(service), "LOGDX_DATA_DIR": tempfile.mkdtemp(prefix="logdx-bench-")}
    cmd = [sys.executable, "-m", "logdx", "diagnose", str(log), "--no-llm", "--no-retrieval", "--json", "--no-store"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0 and "--no-store" in cmd:
        # An older logdx has no --no-store: run it without.
        cmd.remove("--no-store")
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(proc.pid, 0)
    return usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default=DEFAULT_BASELINE)
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    log = make_log(args.lines)
    with tempfile.TemporaryDirectory(prefix="logdx-baseline-") as tmp:
        base = Path(tmp) / "baseline"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base), args.baseline], check=True, cwd=REPO)
        try:
            run_once(REPO / "service", log)  # warm-up: page cache, compiled bytecode
            run_once(base / "service", log)
            this, that = [], []
            for _ in range(args.runs):
                this.append(run_once(REPO / "service", log))
                that.append(run_once(base / "service", log))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], check=False, cwd=REPO)
    ratios = [a[0] / b[0] for a, b in zip(this, that)]
    result = {
        "log": str(log), "lines": args.lines, "baseline": args.baseline, "runs": args.runs,
        "cpu_s_this": statistics.median(a[0] for a in this), "cpu_s_baseline": statistics.median(b[0] for b in that),
        "rss_mib_this": max(a[1] for a in this), "rss_mib_baseline": max(b[1] for b in that),
        "cpu_ratio_median": statistics.median(ratios), "cpu_ratio_min": min(ratios), "cpu_ratio_max": max(ratios),
    }
    print(f"rules-only diagnose of {args.lines:,} lines, {args.runs} runs each, interleaved")
    print(f"  this checkout  CPU {result['cpu_s_this']:.2f} s (median)   peak RSS {result['rss_mib_this']:.0f} MiB")
    print(f"  {args.baseline:<14} CPU {result['cpu_s_baseline']:.2f} s (median)   peak RSS {result['rss_mib_baseline']:.0f} MiB")
    print(f"  this / baseline CPU: median {result['cpu_ratio_median']:.3f} "
          f"(min {result['cpu_ratio_min']:.3f}, max {result['cpu_ratio_max']:.3f})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
