"""How fast the shipped catalog matches log lines, and what it matches (a benchmark, not a test).

    python tools/catalog/bench_match.py LOG [LOG ...] [--show N]

Every line of the given logs goes through `Catalog.match` (what `logdx.diagnose.catalog_stage.match` asks); prints the load time,
the mean / p50 / p99 / max time per line, how many lines matched, and the first N matches.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from logdx.diagnose.catalog import Catalog


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--show", type=int, default=0, help="print this many matched lines")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    catalog = Catalog.load()
    load_s = time.perf_counter() - t0
    lines = [line for path in args.logs for line in path.read_text(encoding="utf-8", errors="replace").splitlines()]
    for line in lines[:200]:  # compile the regexes the first lines need: steady state is what is measured
        catalog.match(line)
    times, matched, shown = [], 0, 0
    for line in lines:
        t = time.perf_counter()
        hits = catalog.match(line)
        times.append((time.perf_counter() - t) * 1000)
        if hits:
            matched += 1
            if shown < args.show:
                shown += 1
                h = hits[0]
                print(f"{h.how:8} {h.score:.2f} {h.entry.failure_type:22} {h.entry.module or '-':40.40} | {line[:90]}")
    times.sort()
    print(f"catalog: {len(catalog)} entries, loaded in {load_s:.2f}s")
    print(f"{len(lines)} lines, {matched} matched; per line: mean {statistics.fmean(times):.3f} ms, "
          f"p50 {times[len(times) // 2]:.3f} ms, p99 {times[int(len(times) * 0.99)]:.3f} ms, max {times[-1]:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
