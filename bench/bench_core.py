#!/usr/bin/env python3
"""The streaming core's speed against fixed yardsticks, in the same run: rules-only end-to-end
`diagnose` of a 1M-line 64-rank log by this checkout, by the pinned reference commit, by any other
baseline asked for (the commit a round started from), by stock drain3 (`--drain3`), and a bare Python
`for line in f` loop over the same file, interleaved, each a fresh process; CPU seconds (user + sys, from
the OS's accounting of the finished child) and peak RSS per run, medians, and the ratios pair by pair.

    python bench/bench_core.py [--baseline COMMIT ...] [--drain3] [--lines 1000000] [--runs 5] [--json out.json]

Every round compares itself with the same pinned reference (`REFERENCE`) and with the bare loop, so a
cost that grows by a few percent a round shows in the figure the day it lands instead of hiding behind
a comparison with the round's own start. A baseline is checked out with `git worktree add --detach` into a
temporary directory and run by the same interpreter with its own `service/` first on the path, so every
side reads the same file with the same libraries. Each side keeps one data directory for the run (the
warm-up fills its rule cache, as a user's first run does). The log comes from `logdx synth` (cached in
.cache/bench/). Ratios, not seconds, are what to quote: the machine is shared.
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
# The commit BENCHMARKS.md's end-to-end table was made at (3.7 s, 42 MB for 1M lines): the fixed yardstick
# every round is measured against (issue 35), whatever else it compares with.
REFERENCE = "a21207e"
BARE_LOOP = "import sys\nfor line in open(sys.argv[1], encoding='utf-8', errors='surrogateescape'):\n    pass\n"
# Stock drain3 mining the same file's lines with logdx's masks and Drain parameters (bench_compress's
# configuration: the same templates to find), and at drain3's own defaults (no masks) for reference.
# The goal: the whole diagnose >= 10x faster than the first.
# drain3 is slow (tens of µs to ms a line): it mines DRAIN3_LINES lines taken evenly across the file (one in
# `step`: the same mix of start-up, training and failure), and its CPU per line, scaled to the whole
# file's lines, is what is compared.
DRAIN3_LINES = 20_000
_MINE = ("import itertools\n"
         "f = open(sys.argv[1], encoding='utf-8', errors='surrogateescape')\n"
         "for line in itertools.islice(f, 0, None, int(sys.argv[3])):\n"
         "    m.add_log_message(line.rstrip('\\n'))\n")
DRAIN3 = ("import sys\nsys.path.insert(0, sys.argv[2])\nfrom bench_compress import stock_drain3\n"
          "from logdx.compress import CompressConfig\nm = stock_drain3(CompressConfig())\n" + _MINE)
DRAIN3_DEFAULTS = "import sys\nfrom drain3 import TemplateMiner\nm = TemplateMiner()\n" + _MINE


def make_log(lines: int) -> Path:
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / f"core-{lines}.log"
    if not path.exists():
        subprocess.run([sys.executable, "-m", "logdx.synth", "--scenario", "xid79", "--ranks", "64", "--lines",
                        str(lines), "--seed", "11", "-o", str(path)], check=True, cwd=REPO)
    return path


def _measure(cmd: list[str], env: dict[str, str]) -> tuple[float, float, int]:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    return usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, os.waitstatus_to_exitcode(status)


def run_once(service: Path, log: Path, data_dir: str) -> tuple[float, float]:
    """(CPU seconds, peak RSS MiB) of one `diagnose` process reading `log` with `service` first on the path."""
    env = {**os.environ, "PYTHONPATH": str(service), "LOGDX_DATA_DIR": data_dir}
    cmd = [sys.executable, "-m", "logdx", "diagnose", str(log), "--no-llm", "--no-retrieval", "--json", "--no-store"]
    cpu, rss, code = _measure(cmd, env)
    if code != 0:
        # An older logdx has no --no-store: run it without.
        cmd.remove("--no-store")
        cpu, rss, code = _measure(cmd, env)
    return cpu, rss


def count_lines(log: Path) -> int:
    with log.open("rb") as f:
        return sum(1 for _ in f)


def run_script(script: str, log: Path, step: int = 1) -> tuple[float, float]:
    """(CPU seconds, peak RSS MiB) of a bare interpreter running `script` over `log` (this checkout's logdx
    importable; bench/ and the sampling step as the script's next arguments)."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "service")}
    cpu, rss, code = _measure([sys.executable, "-c", script, str(log), str(REPO / "bench"), str(step)], env)
    if code != 0:
        raise SystemExit(f"bench_core: a yardstick script failed (exit {code})")
    return cpu, rss


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", action="append", default=[],
                    help=f"another commit to compare with (repeatable); the reference {REFERENCE} always runs")
    ap.add_argument("--drain3", action="store_true", help="also stock drain3 over the same lines (one run: slow)")
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    log = make_log(args.lines)
    commits = [REFERENCE] + [c for c in args.baseline if c != REFERENCE]
    with tempfile.TemporaryDirectory(prefix="logdx-baseline-") as tmp:
        sides = {"this checkout": REPO / "service"}
        try:
            for commit in commits:
                tree = Path(tmp) / commit
                subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), commit], check=True, cwd=REPO)
                sides[commit] = tree / "service"
            data = {name: tempfile.mkdtemp(prefix="logdx-bench-", dir=tmp) for name in sides}
            for name, service in sides.items():  # warm-up: page cache, compiled bytecode, the rule cache
                run_once(service, log, data[name])
            runs: dict[str, list[tuple[float, float]]] = {name: [] for name in [*sides, "bare loop"]}
            for _ in range(args.runs):
                for name, service in sides.items():
                    runs[name].append(run_once(service, log, data[name]))
                runs["bare loop"].append(run_script(BARE_LOOP, log))
            if args.drain3:
                lines = count_lines(log)
                step = max(1, lines // DRAIN3_LINES)
                for name, script in (("drain3, masks", DRAIN3), ("drain3, bare", DRAIN3_DEFAULTS)):
                    cpu, rss = run_script(script, log, step)
                    runs[name] = [(cpu * step, rss)]  # its CPU per line, scaled to the whole file
        finally:
            for commit in commits:
                subprocess.run(["git", "worktree", "remove", "--force", str(Path(tmp) / commit)], check=False, cwd=REPO)
    result = summarise(runs, count_lines(log), args.runs, str(log))  # the lines synth wrote, not those asked for
    print_result(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


def summarise(runs: dict[str, list[tuple[float, float]]], lines: int, n: int, log: str) -> dict:
    """Medians per side, and this checkout's CPU over each other side's, pair by pair (run i with run i)."""
    this = runs["this checkout"]
    sides = {}
    for name, measured in runs.items():
        cpu = statistics.median(m[0] for m in measured)
        ratios = [a[0] / b[0] for a, b in zip(this, measured)] if len(measured) == len(this) else [this[0][0] / cpu]
        sides[name] = {"cpu_s": cpu, "rss_mib": max(m[1] for m in measured), "lines_per_cpu_s": lines / cpu,
                       "this_over_it": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    return {"log": log, "lines": lines, "runs": n, "reference": REFERENCE, "sides": sides}


def print_result(result: dict) -> None:
    print(f"rules-only diagnose of {result['lines']:,} lines, {result['runs']} runs each, interleaved")
    for name, side in result["sides"].items():
        line = (f"  {name:<14} CPU {side['cpu_s']:6.2f} s (median)  {side['lines_per_cpu_s'] / 1000:7.0f}k lines/CPU-s"
                f"  peak RSS {side['rss_mib']:4.0f} MiB")
        if name != "this checkout":
            line += f"   this / it: {side['this_over_it']:.3f} (min {side['min']:.3f}, max {side['max']:.3f})"
        print(line)


if __name__ == "__main__":
    sys.exit(main())
