#!/usr/bin/env python3
"""The timeline's hot path (one progress line of one rank) against an earlier commit, in the same process:
the same 192,000 Megatron progress lines of 64 ranks (a checkpoint every 500 steps, one restart from a
checkpoint half way) fed to this checkout's `Timeline.note` and to the baseline's, alternately; the minimum
CPU seconds of `--runs` each and their ratio (minima, since the machine is shared: load only adds time).

    python bench/bench_timeline.py [--baseline main] [--runs 7]

The baseline's timeline.py is read with `git show` and loaded beside this checkout's model (a timeline
only reads `logdx.model`'s records and writes its summaries, a superset here).
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "service"))

from logdx.model import Record


def load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def lines() -> list[tuple[Record, str, bytes, bool]]:
    out: list[tuple[Record, str, bytes, bool]] = []
    steps = list(range(1, 1501)) + list(range(1001, 2001))  # a restart from the checkpoint at step 10000
    for i, step in enumerate(steps):
        for rank in range(64):
            text = (f" iteration {step * 10:8d}/  500000 | consumed samples: {step * 5120:12d} | elapsed time per "
                    f"iteration (ms): 1234.5 | lm loss: {2 + 1 / (1 + step):.6E} |")
            rec = Record(line_no=len(out) + 1, raw=text, text=text, rank=rank, ts=1000.0 + 2 * i)
            out.append((rec, f"r{rank}", text.encode(), step % 50 == 0 and rank == 0))
    return out


def run(mod: ModuleType, feed: list[tuple[Record, str, bytes, bool]]) -> float:
    shape = mod.progress_shape_of(feed[0][0].text)
    tl = mod.Timeline()
    t = time.process_time()
    for rec, key, encoded, saves in feed:
        tl.note(rec, key, shape, 7, encoded)
        if saves:
            tl.note_checkpoint(int(rec.text.split()[1].rstrip("/")), rec.line_no)
    tl.summary()
    return time.process_time() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="main")
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    this = load(REPO / "service" / "logdx" / "timeline.py", "timeline_this")
    feed = lines()
    a, b = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("timeline.py", "timeline.yaml"):  # the module reads its forms beside itself
            (Path(tmp) / name).write_text(subprocess.run(
                ["git", "show", f"{args.baseline}:service/logdx/{name}"], cwd=REPO, check=True, capture_output=True,
                text=True).stdout)
        base = load(Path(tmp) / "timeline.py", "timeline_baseline")
        for _ in range(args.runs):
            a.append(run(this, feed))
            b.append(run(base, feed))
    print(f"timeline.note on {len(feed):,} progress lines, {args.runs} runs each, alternated")
    print(f"  this checkout  CPU {min(a):.3f} s (min)")
    print(f"  {args.baseline:<14} CPU {min(b):.3f} s (min)")
    print(f"  this / baseline: {min(a) / min(b):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
