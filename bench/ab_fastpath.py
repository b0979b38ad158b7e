#!/usr/bin/env python3
"""Before/after of the hot path: normalize and compress of a git revision against the working tree.

The revision's `normalize.py`, `compress.py` and `patterns.py` are loaded from git into a private
package next to the working tree's, and both run interleaved in this one process on the same lines
(best of --repeats), so machine noise hits both alike. Compression runs at the revision's Drain
settings (depth 4, sim_th 0.4) on both sides unless --new-defaults, so the figures compare code, not
parameters. Usage::

    python bench/ab_fastpath.py [--rev a6d94ff] [--lines 300000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import gc
import glob
import importlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "service"))
sys.path.insert(0, str(REPO / "bench"))

import logdx.compress as new_compress
import logdx.normalize as new_normalize
from logdx.diagnose.rules import default_rules_dir, load_rules
from logdx.patterns import mask

FILES = ("normalize", "compress", "patterns")
# The compressor's parts since it was split (issue 34): loaded from the revision when it has them.
PARTS = ("compress_config", "mining", "keep_policy", "topology")


def load_revision(rev: str) -> tuple:
    """The revision's hot-path modules as package `logdx_rev` (imports between them rewired)."""
    root = Path(tempfile.mkdtemp(prefix="logdx-rev-"))
    pkg = root / "logdx_rev"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    sources = {}
    for name in FILES + PARTS:
        got = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:service/logdx/{name}.py"],
                             capture_output=True, text=True)
        if got.returncode == 0:
            sources[name] = got.stdout
        elif name in FILES:
            raise SystemExit(f"{rev} has no service/logdx/{name}.py: {got.stderr.strip()}")
    for name, src in sources.items():
        for other in sources:
            src = src.replace(f"from logdx.{other} import", f"from logdx_rev.{other} import")
        (pkg / f"{name}.py").write_text(src)
    sys.path.insert(0, str(root))
    return importlib.import_module("logdx_rev.normalize"), importlib.import_module("logdx_rev.compress")


def best_of(repeats: int, runs: dict) -> dict[str, float]:
    """Run each callable `repeats` times, in alternating order; the best time of each."""
    best = {k: float("inf") for k in runs}
    names = list(runs)
    for r in range(repeats):
        for name in names if r % 2 == 0 else reversed(names):
            gc.collect()
            t0 = time.perf_counter()
            runs[name]()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rev", default="HEAD", help="git revision to compare with (default HEAD)")
    ap.add_argument("--log", type=Path, default=REPO / ".cache" / "bench" / "xid79-64r-2000000-s1.log")
    ap.add_argument("--lines", type=int, default=300_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new-defaults", action="store_true", help="compress with the working tree's default settings")
    args = ap.parse_args()
    old_normalize, old_compress = load_revision(args.rev)
    rules = load_rules([default_rules_dir()])
    with new_normalize.open_input(args.log) as f:
        lines = [line for _, line in zip(range(args.lines), new_normalize.iter_lines(f))]
    loghub_raw = [line for p in sorted(glob.glob(str(REPO.parent / "shared/data/loghub-2k/*/*_2k.log")))
                  for line in open(p, "rb")]

    def normalize_all(module, raw, no_cache=False, keep=False):
        n = module.Normalizer()
        if no_cache:
            n._cache_limit = -1  # every line planned afresh: the regex work without the shape cache
        norm = n.normalize

        def run():
            if keep:
                return [norm(x) for x in raw]
            for x in raw:
                norm(x)
        return run

    print(f"{args.rev} vs working tree; {len(lines):,} lines of {args.log.name}; best of {args.repeats}\n")
    runs = {"old normalize": normalize_all(old_normalize, lines), "new normalize": normalize_all(new_normalize, lines),
            "new normalize, no shape cache": normalize_all(new_normalize, lines, no_cache=True)}
    _report(best_of(args.repeats, runs), len(lines), "old normalize")

    recs_old = normalize_all(old_normalize, lines, keep=True)()
    recs_new = normalize_all(new_normalize, lines, keep=True)()
    lh_old = normalize_all(old_normalize, loghub_raw, keep=True)()
    lh_new = normalize_all(new_normalize, loghub_raw, keep=True)()
    same = {} if args.new_defaults else {"drain_depth": 4, "drain_sim_th": 0.4, "drain_match_params": False}

    def compress_all(module, recs, config):
        def run() -> None:
            c = module.Compressor(config, also_error=rules.could_match)
            add = c.add
            for r in recs:
                add(r)
        return run

    for title, ro, rn in (("training log", recs_old, recs_new), ("loghub-2k (mostly new shapes)", lh_old, lh_new)):
        print(f"compress, {title}:")
        runs = {"old compress": compress_all(old_compress, ro, old_compress.CompressConfig()),
                "new compress": compress_all(new_compress, rn, new_compress.CompressConfig(**same))}
        _report(best_of(args.repeats, runs), len(ro), "old compress")

    masked = [mask(r.text) for r in lh_new]
    print("error-word check on masked loghub lines (once per new shape):")
    runs = {"old _ERROR_WORDS.search": lambda: [bool(old_compress._ERROR_WORDS.search(m)) for m in masked],
            "new has_error_word": lambda: [new_compress.has_error_word(m) for m in masked]}
    _report(best_of(args.repeats, runs), len(masked), "old _ERROR_WORDS.search")
    return 0


def _report(best: dict[str, float], n: int, base: str) -> None:
    for name, t in best.items():
        print(f"  {name:<34} {t / n * 1e6:7.2f} µs/line   {best[base] / t:5.2f}x")
    print()


if __name__ == "__main__":
    sys.exit(main())
