"""How much the default cascade costs over rules alone, as a whole `diagnose` process.

    python bench/bench_cascade.py [--runs 5] [--lines 10000] [--only unknown]
    python bench/bench_cascade.py --runs 1 --lines 1000000 --only unknown     # issue 30's budget: < 2x CPU, < 800 MB

Two failed 64-rank logs of `--lines` lines: one a precise rule recognises (an Xid 79: the models are
never loaded), one whose error no rule names (a vendor exception: catalog, retrieval and the LLM are
consulted). Each is diagnosed with the defaults and with `--no-llm --no-retrieval`, alternately, after
one warm-up run that converts and indexes what needs it; the figure is the median ratio of wall times
(default / rules only), measured pair by pair in the same run so that a noisy machine cancels out. Each run's
CPU seconds (user + system) and peak RSS are the child process's own (`os.wait4`), so other work on the machine
does not count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from logdx.synth.generate import generate

UNKNOWN_TAIL = [
    "[rank5]: Traceback (most recent call last):",
    '[rank5]:   File "/workspace/train.py", line 212, in <module>',
    "[rank5]:     batch = next(stream)",
    '[rank5]:   File "/opt/conda/lib/python3.10/site-packages/weka_io/reader.py", line 88, in __next__',
    "[rank5]:     raise WekaStaleMountError(self.mount)",
    "[rank5]: weka_io.errors.WekaStaleMountError: mount /mnt/weka/data went stale: backend lost quorum",
]


def write_logs(folder: Path, lines: int, only: str | None = None) -> dict[str, Path]:
    out_logs: dict[str, Path] = {}
    if only != "unknown":
        known = folder / "xid79.log"
        with open(known, "w", encoding="utf-8") as out:
            generate(out, scenario="xid79", seed=3, ranks=64, lines=lines)
        out_logs["a precise rule decides"] = known
    if only == "known":
        return out_logs
    # Written straight to the file: a log held in this process would count in every child's peak RSS
    # (ru_maxrss counts the pages a forked child shares with its parent before it execs).
    unknown = folder / "unknown.log"
    with open(unknown, "w", encoding="utf-8") as out:
        generate(out, scenario="healthy", seed=3, ranks=64, lines=lines - len(UNKNOWN_TAIL))
        out.write("\n".join(UNKNOWN_TAIL) + "\n")
    out_logs["no rule names the error"] = unknown
    return out_logs


@dataclass(frozen=True, slots=True)
class Run:
    wall_s: float
    cpu_s: float  # user + system of the diagnose process
    rss_mb: float  # its peak resident set


def run(log: Path, *flags: str) -> tuple[Run, dict]:
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen([sys.executable, "-m", "logdx", "diagnose", str(log), "--json", *flags],
                                stdout=out, stderr=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        out.seek(0)
        report = json.loads(out.read())
    rss_kb = usage.ru_maxrss  # kilobytes on Linux
    return Run(wall, usage.ru_utime + usage.ru_stime, rss_kb / 1024), report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--lines", type=int, default=10_000)
    p.add_argument("--only", choices=("known", "unknown"), help="only the log a rule recognises, or the other")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="logdx-bench-cascade-") as tmp:
        os.environ.setdefault("LOGDX_DATA_DIR", str(Path(tmp) / "data"))
        for what, log in write_logs(Path(tmp), args.lines, args.only).items():
            _, report = run(log)  # warm-up: converts the model and indexes the incidents when needed
            full: list[Run] = []
            rules: list[Run] = []
            for _ in range(args.runs):
                full.append(run(log)[0])
                rules.append(run(log, "--no-llm", "--no-retrieval")[0])
            stages = sorted(k.split(".", 1)[1] for k in report["timings_ms"] if k.startswith("diagnose."))
            print(f"{what} ({args.lines:,} lines): {report['category']}/{report['failure_type']} "
                  f"(stages run: {', '.join(stages)}; decided by {report.get('decided_by')})")
            for name, pick in (("wall", lambda r: r.wall_s), ("CPU", lambda r: r.cpu_s)):
                a, b = [pick(r) for r in full], [pick(r) for r in rules]
                ratios = [x / y for x, y in zip(a, b)]
                print(f"  {name}: default {statistics.median(a):.2f} s, rules only {statistics.median(b):.2f} s, ratio "
                      f"median {statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})")
            print(f"  peak RSS: default {max(r.rss_mb for r in full):.0f} MB, rules only {max(r.rss_mb for r in rules):.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
