"""How much the default cascade costs over rules alone, as a whole `diagnose` process.

    python bench/bench_cascade.py [--runs 5] [--lines 10000]

Two failed 64-rank logs of `--lines` lines: one a precise rule recognises (an Xid 79: the models are
never loaded), one whose error no rule names (a vendor exception: catalog, retrieval and the LLM are
consulted). Each is diagnosed with the defaults and with `--no-llm --no-retrieval`, alternately, after
one warm-up run that converts and indexes what needs it; the figure is the median ratio of wall times
(default / rules only), measured pair by pair in the same run so that a noisy machine cancels out.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
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


def write_logs(folder: Path, lines: int) -> dict[str, Path]:
    known = folder / "xid79.log"
    with open(known, "w", encoding="utf-8") as out:
        generate(out, scenario="xid79", seed=3, ranks=64, lines=lines)
    buf = io.StringIO()
    generate(buf, scenario="healthy", seed=3, ranks=64, lines=lines - len(UNKNOWN_TAIL))
    unknown = folder / "unknown.log"
    unknown.write_text(buf.getvalue() + "\n".join(UNKNOWN_TAIL) + "\n", encoding="utf-8")
    return {"a precise rule decides": known, "no rule names the error": unknown}


def run(log: Path, *flags: str) -> tuple[float, dict]:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "logdx", "diagnose", str(log), "--json", *flags],
                         capture_output=True, text=True, check=True)
    return time.perf_counter() - t0, json.loads(out.stdout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--lines", type=int, default=10_000)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="logdx-bench-cascade-") as tmp:
        os.environ.setdefault("LOGDX_DATA_DIR", str(Path(tmp) / "data"))
        for what, log in write_logs(Path(tmp), args.lines).items():
            _, report = run(log)  # warm-up: converts the model and indexes the incidents when needed
            ratios, full_s, rules_s = [], [], []
            for _ in range(args.runs):
                a, _ = run(log)
                b, _ = run(log, "--no-llm", "--no-retrieval")
                full_s.append(a)
                rules_s.append(b)
                ratios.append(a / b)
            stages = sorted(k.split(".", 1)[1] for k in report["timings_ms"] if k.startswith("diagnose."))
            print(f"{what}: {report['category']}/{report['failure_type']} (stages run: {', '.join(stages)})")
            print(f"  default {statistics.median(full_s):.2f} s, rules only {statistics.median(rules_s):.2f} s, "
                  f"ratio median {statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
