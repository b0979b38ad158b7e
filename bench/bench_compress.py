#!/usr/bin/env python3
"""`make bench`: how fast logdx compresses, how well it groups, and what diagnosing costs.

Every figure in the table comes from this one run on the same inputs:

1. throughput on a generated 64-rank training log (2M lines by default) and on the 16 loghub-2k
   logs concatenated: logdx's miner (`Compressor.add` on normalized records; and normalize +
   compress together) against stock `drain3.TemplateMiner` given the same masks (each alternative
   of `logdx.patterns.MASK` as one `MaskingInstruction`, behind the same guard) and the same Drain
   parameters, both fed the same message text (`Record.text`). The two run interleaved, batch by
   batch, in fresh instances per repeat; the best repeat of each side counts.
2. grouping accuracy (GA) of both on each loghub-2k data set, and their average; on the training log
   (no ground truth) the template counts, and how each groups the error-bearing lines.
3. peak RSS of `diagnose FILE --json --no-llm --no-retrieval` on 1M, 2M and 5M-line logs (one fresh
   process each; `ru_maxrss` of its children, read by a small intermediate process), and its wall time
   on the 2M-line log.

Generated logs are cached in .cache/bench/ and reused. Usage::

    python bench/bench_compress.py [--json bench-results/compress.json] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "service"))
sys.path.insert(0, str(REPO / "bench"))

from drain3 import TemplateMiner
from drain3.masking import MaskingInstruction
from drain3.template_miner_config import TemplateMinerConfig

import loghub
from logdx.compress import CompressConfig, Compressor
from logdx.config import load_settings
from logdx.diagnose.rules import default_rules_dir, load_rules
from logdx.model import Record
from logdx.normalize import Normalizer, iter_lines, open_input
from logdx.patterns import MASK_ALTERNATIVES, MASK_AT_START, MASK_DATE_WORDS, MASK_GUARD

CACHE = REPO / ".cache" / "bench"
LOGHUB = Path(os.environ.get("LOGHUB_DIR", REPO.parent / "shared" / "data" / "loghub-2k"))


# -- inputs ---------------------------------------------------------------------------------------


def training_log(lines: int, seed: int = 1) -> Path:
    """A 64-rank xid79 job log of `lines` lines (generated once, then reused)."""
    path = CACHE / f"xid79-64r-{lines}-s{seed}.log"
    if not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "logdx.synth", "--scenario", "xid79", "--ranks", "64", "--lines", str(lines),
                        "--fail-at", "1.0", "--seed", str(seed), "-o", str(tmp)],
                       check=True, env=_env(), stderr=subprocess.DEVNULL)
        tmp.rename(path)
        print(f"  generated {path.relative_to(REPO)} in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    return path


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO / "service"), "HF_HUB_OFFLINE": "1",
            "LOGDX_LLM__ENABLED": "false", "LOGDX_RETRIEVAL__ENABLED": "false"}


# -- the two miners ----------------------------------------------------------------------------------


def stock_drain3(config: CompressConfig) -> TemplateMiner:
    """drain3's TemplateMiner with logdx's masks and Drain parameters (no persistence, no profiling)."""
    c = TemplateMinerConfig()
    c.drain_depth = config.drain_depth
    c.drain_sim_th = config.drain_sim_th
    c.drain_max_children = config.drain_max_children
    # drain3 applies its masks one after another: a date with words goes first, before its numbers are masked.
    c.masking_instructions = [MaskingInstruction(MASK_DATE_WORDS, "*")]
    c.masking_instructions += [MaskingInstruction(f"{MASK_GUARD}(?:{p})", "*") for _, p in MASK_ALTERNATIVES]
    c.masking_instructions.append(MaskingInstruction(MASK_AT_START, "*"))
    c.mask_prefix, c.mask_suffix = "<", ">"  # masks read "<*>", as logdx's do
    return TemplateMiner(config=c)


def logdx_compressor(also_error=None) -> Compressor:
    return Compressor(CompressConfig(), also_error=also_error)


# drain3's own defaults (TemplateMinerConfig: depth 4, sim_th 0.4), for reference next to "same parameters"
DRAIN3_DEFAULTS = CompressConfig(drain_depth=4, drain_sim_th=0.4, drain_max_children=100)


# -- 1. throughput --------------------------------------------------------------------------------


@dataclass
class Pass:
    read_s: float = 0.0
    normalize_s: float = 0.0
    logdx_s: float = 0.0
    drain3_s: float = 0.0
    normalize_compress_s: float = 0.0


def _time_batch(compressor: Compressor, miner: TemplateMiner, recs: list[Record], texts: list[str],
                logdx_first: bool, drain_ids: array | None) -> tuple[float, float]:
    add, add_stock = compressor.add, miner.add_log_message

    def run_logdx() -> float:
        t0 = time.perf_counter()
        for rec in recs:
            add(rec)
        return time.perf_counter() - t0

    def run_drain3() -> float:
        t0 = time.perf_counter()
        if drain_ids is None:
            for text in texts:
                add_stock(text)
        else:
            ids = [add_stock(text)["cluster_id"] for text in texts]
            t = time.perf_counter() - t0
            drain_ids.extend(ids)
            return t
        return time.perf_counter() - t0

    if logdx_first:
        a = run_logdx()
        return a, run_drain3()
    b = run_drain3()
    return run_logdx(), b


def _time_streaming(normalizer: Normalizer, compressor: Compressor | None, raw: list[bytes]) -> float:
    """Lines through normalize (and compress) one at a time, nothing kept: as in the pipeline."""
    norm = normalizer.normalize
    t0 = time.perf_counter()
    if compressor is None:
        for line in raw:
            norm(line)
    else:
        add = compressor.add
        for line in raw:
            add(norm(line))
    return time.perf_counter() - t0


def bench_training(path: Path, repeats: int, batch: int, also_error) -> dict:
    """Read the training log in batches. Each batch is normalized once (untimed) for the two miners,
    which then take the same records/texts in turn (timed: compress alone); normalize alone and
    normalize + compress are timed streaming, line by line, on separate instances."""
    size = path.stat().st_size
    best = Pass(*(float("inf"),) * 5)
    grouping: dict | None = None
    for rep in range(repeats):
        gc.collect()
        p = Pass()
        feeder, normalizer, streaming = Normalizer(), Normalizer(), Normalizer()
        compressor, miner = logdx_compressor(also_error), stock_drain3(CompressConfig())
        streaming_compressor = logdx_compressor(also_error)
        keep_ids = rep == 0  # the grouping comparison needs every line's template, once
        logdx_ids, drain_ids, classic_ids = array("q"), array("q"), array("q")
        classic = stock_drain3(DRAIN3_DEFAULTS) if keep_ids else None  # drain3 at its own defaults, for reference
        n_lines = 0
        with open_input(path) as f:
            lines = iter_lines(f)
            while True:
                t0 = time.perf_counter()
                raw = [line for _, line in zip(range(batch), lines)]
                p.read_s += time.perf_counter() - t0
                if not raw:
                    break
                recs = [feeder.normalize(line) for line in raw]
                texts = [r.text for r in recs]
                p.normalize_s += _time_streaming(normalizer, None, raw)
                p.normalize_compress_s += _time_streaming(streaming, streaming_compressor, raw)
                a, b = _time_batch(compressor, miner, recs, texts, logdx_first=(n_lines // batch + rep) % 2 == 0,
                                   drain_ids=drain_ids if keep_ids else None)
                p.logdx_s += a
                p.drain3_s += b
                if keep_ids:
                    tid = compressor.template_id_of
                    logdx_ids.extend(tid(t) for t in texts)
                    add_classic = classic.add_log_message
                    classic_ids.extend(add_classic(t)["cluster_id"] for t in texts)
                n_lines += len(raw)
                del raw, recs, texts
        for k in ("read_s", "normalize_s", "logdx_s", "drain3_s", "normalize_compress_s"):
            setattr(best, k, min(getattr(best, k), getattr(p, k)))
        if keep_ids:
            grouping = {"same_params": _grouping_on_errors(compressor, miner, logdx_ids, drain_ids),
                        "drain3_defaults": _grouping_on_errors(compressor, classic, logdx_ids, classic_ids)}
        print(f"  training log pass {rep + 1}/{repeats}: logdx {p.logdx_s:.1f}s, drain3 {p.drain3_s:.1f}s, "
              f"normalize {p.normalize_s:.1f}s, normalize+compress {p.normalize_compress_s:.1f}s, read {p.read_s:.1f}s",
              file=sys.stderr)
    return _throughput("training", n_lines, size, best) | {"grouping": grouping, "repeats": repeats}


def _grouping_on_errors(compressor: Compressor, miner: TemplateMiner, logdx_ids: array, drain_ids: array) -> dict:
    """No ground truth here: compare the two partitions of the error-bearing lines (those whose
    logdx template is error-bearing). "Coarser" = one group holding lines the other keeps apart."""
    templates = compressor.templates()
    error_templates = {t.template_id for t in templates if t.error_bearing}
    lx_members: dict[int, set[int]] = defaultdict(set)  # logdx group -> drain3 groups it spans
    dr_members: dict[int, set[int]] = defaultdict(set)
    lx_size: dict[int, int] = defaultdict(int)
    dr_size: dict[int, int] = defaultdict(int)
    n_error = 0
    for lx, dr in zip(logdx_ids, drain_ids):
        if lx in error_templates:
            n_error += 1
            lx_members[lx].add(dr)
            dr_members[dr].add(lx)
            lx_size[lx] += 1
            dr_size[dr] += 1
    return {
        "templates": {"logdx": len(templates), "drain3": len(miner.drain.clusters)},
        "error_lines": n_error,
        "error_groups": {"logdx": len(lx_members), "drain3": len(dr_members)},
        # groups of one side that merge lines the other side separates, and the lines in them
        "logdx_merges": {"groups": sum(len(v) > 1 for v in lx_members.values()),
                         "lines": sum(lx_size[k] for k, v in lx_members.items() if len(v) > 1)},
        "drain3_merges": {"groups": sum(len(v) > 1 for v in dr_members.values()),
                          "lines": sum(dr_size[k] for k, v in dr_members.items() if len(v) > 1)},
    }


def bench_loghub_throughput(datasets: list[loghub.Dataset], repeats: int, also_error) -> dict:
    raw = [line.encode() for d in datasets for line in d.raw]
    size = sum(len(r) + 1 for r in raw)
    best = Pass(0.0, *(float("inf"),) * 4)
    for rep in range(repeats):
        gc.collect()
        recs = [r for r in map(Normalizer().normalize, raw)]
        texts = [r.text for r in recs]
        a, b = _time_batch(logdx_compressor(also_error), stock_drain3(CompressConfig()), recs, texts,
                           logdx_first=rep % 2 == 0, drain_ids=None)
        best.logdx_s, best.drain3_s = min(best.logdx_s, a), min(best.drain3_s, b)
        best.normalize_s = min(best.normalize_s, _time_streaming(Normalizer(), None, raw))
        best.normalize_compress_s = min(best.normalize_compress_s,
                                        _time_streaming(Normalizer(), logdx_compressor(also_error), raw))
    return _throughput("loghub", len(raw), size, best) | {"repeats": repeats}


def _throughput(name: str, n: int, size: int, p: Pass) -> dict:
    def rate(seconds: float) -> dict:
        return {"seconds": seconds, "lines_per_s": n / seconds, "mb_per_s": size / seconds / 1e6,
                "us_per_line": seconds / n * 1e6}

    out = {"input": name, "lines": n, "bytes": size,
           "logdx_compress": rate(p.logdx_s), "drain3": rate(p.drain3_s),
           "normalize": rate(p.normalize_s), "logdx_normalize_compress": rate(p.normalize_compress_s)}
    if p.read_s:
        out["read"] = rate(p.read_s)
        out["logdx_read_normalize_compress"] = rate(p.read_s + p.normalize_compress_s)
    out["ratio_compress"] = p.drain3_s / p.logdx_s
    out["ratio_normalize_compress"] = p.drain3_s / p.normalize_compress_s
    return out


# -- 2. grouping accuracy -------------------------------------------------------------------------


def bench_ga(datasets: list[loghub.Dataset]) -> dict:
    config = CompressConfig()
    rows = {}
    for d in datasets:
        compressor, miner, classic = logdx_compressor(), stock_drain3(config), stock_drain3(DRAIN3_DEFAULTS)
        for i, text in enumerate(d.content, 1):
            compressor.add(Record(line_no=i, raw=text, text=text))
        # Each line's group once all lines are in (`template_id_of` reports the merged template groups).
        ours = [compressor.template_id_of(text) for text in d.content]
        theirs = [miner.add_log_message(text)["cluster_id"] for text in d.content]
        theirs_classic = [classic.add_log_message(text)["cluster_id"] for text in d.content]
        rows[d.name] = {"logdx": loghub.grouping_accuracy(d.truth, ours),
                        "drain3": loghub.grouping_accuracy(d.truth, theirs),
                        "drain3_defaults": loghub.grouping_accuracy(d.truth, theirs_classic),
                        "templates_truth": len(set(d.truth)),
                        "templates_logdx": len(compressor.templates()), "templates_drain3": len(miner.drain.clusters)}
    avg = {k: statistics.mean(r[k] for r in rows.values()) for k in ("logdx", "drain3", "drain3_defaults")}
    return {"datasets": rows, "average": avg}


# -- 3. memory and end-to-end time ----------------------------------------------------------------


# A fresh, small process runs `diagnose` and reports its children's peak RSS. (wait4 on a child of
# this process would not do: Linux counts the parent's resident pages at fork/exec into the child's
# ru_maxrss, and this process is large.)
_RUNNER = """
import json, resource, subprocess, sys, time
t0 = time.perf_counter()
with open(sys.argv[1], "wb") as out:
    rc = subprocess.call(sys.argv[2:], stdout=out)
print(json.dumps({"rc": rc, "wall_s": time.perf_counter() - t0,
                  "max_rss_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))
"""


def run_diagnose(path: Path) -> dict:
    """One fresh `diagnose` process: its wall time, peak RSS and report."""
    cmd = [sys.executable, "-c", "import sys; from logdx.cli import diagnose_main; sys.exit(diagnose_main())",
           str(path), "--json", "--no-llm", "--no-retrieval"]
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        proc = subprocess.run([sys.executable, "-c", _RUNNER, out.name, *cmd], capture_output=True, env=_env(),
                              check=True)
        run = json.loads(proc.stdout)
        if run["rc"] != 0:
            raise RuntimeError(f"diagnose failed ({run['rc']}): {proc.stderr.decode()[-2000:]}")
        report = json.loads(Path(out.name).read_bytes())
    return {"wall_s": run["wall_s"], "max_rss_mb": run["max_rss_kb"] / 1024, "status": report["status"],
            "failure_type": report["failure_type"], "compression": report["compression"],
            "timings_ms": report["timings_ms"]}


def bench_memory(sizes: list[int], e2e_lines: int, repeats: int) -> dict:
    runs: dict[int, dict] = {}
    for n in sizes:
        path = training_log(n)
        reps = repeats if n == e2e_lines else 1
        results = [run_diagnose(path) for _ in range(reps)]
        best = min(results, key=lambda r: r["wall_s"])
        best["max_rss_mb"] = max(r["max_rss_mb"] for r in results)
        best["lines"] = n
        best["bytes"] = path.stat().st_size
        runs[n] = best
        print(f"  diagnose {n:,} lines: {best['wall_s']:.1f}s, peak RSS {best['max_rss_mb']:.0f} MB", file=sys.stderr)
    small, large = runs[min(sizes)], runs[max(sizes)]
    return {"runs": list(runs.values()), "rss_growth": large["max_rss_mb"] / small["max_rss_mb"] - 1,
            "e2e": runs.get(e2e_lines)}


# -- the table --------------------------------------------------------------------------------------


def table(results: dict) -> str:
    out = []
    w = out.append

    def rate(r: dict) -> str:
        return f"{r['lines_per_s'] / 1e3:>8,.0f} k lines/s {r['mb_per_s']:>7.1f} MB/s {r['us_per_line']:>7.2f} µs/line"

    for key in ("training", "loghub"):
        t = results.get(key)
        if not t:
            continue
        title = "training log" if key == "training" else "loghub-2k concatenated"
        c = results["config"]
        w(f"Throughput, {title}: {t['lines']:,} lines, {t['bytes'] / 1e6:,.0f} MB (best of {t['repeats']}; "
          f"both miners at depth {c['drain_depth']}, sim_th {c['drain_sim_th']})")
        w(f"  logdx compress (Compressor.add)     {rate(t['logdx_compress'])}")
        w(f"  stock drain3, same masks            {rate(t['drain3'])}")
        w(f"  logdx normalize                     {rate(t['normalize'])}")
        w(f"  logdx normalize + compress          {rate(t['logdx_normalize_compress'])}")
        if "read" in t:
            w(f"  read lines (iter_lines)             {rate(t['read'])}")
            w(f"  logdx read + normalize + compress   {rate(t['logdx_read_normalize_compress'])}")
        w(f"  ratio logdx/drain3 lines/s: compress {t['ratio_compress']:.1f}x, "
          f"normalize+compress {t['ratio_normalize_compress']:.1f}x")
        for label, g in (t.get("grouping") or {}).items():
            other = "drain3" if label == "same_params" else "drain3 4/0.4"
            w(f"  vs {other}: templates logdx {g['templates']['logdx']}, {other} {g['templates']['drain3']}; "
              f"{g['error_lines']:,} error-bearing lines in {g['error_groups']['logdx']} logdx / "
              f"{g['error_groups']['drain3']} {other} groups;")
            w(f"    groups merging what the other separates: logdx {g['logdx_merges']['groups']} "
              f"({g['logdx_merges']['lines']:,} lines), {other} {g['drain3_merges']['groups']} "
              f"({g['drain3_merges']['lines']:,} lines)")
        w("")
    ga = results.get("ga")
    if ga:
        c = results["config"]
        w("Grouping accuracy, loghub-2k (message part per formats.json)")
        w(f"  logdx: depth {c['drain_depth']}, sim_th {c['drain_sim_th']}, match_params {c['drain_match_params']}; "
          f"drain3: same masks, same depth/sim_th; drain3 4/0.4: same masks, drain3's default depth/sim_th")
        w(f"  {'data set':<12} {'logdx':>6} {'drain3':>6} {'drain3 4/0.4':>12}   templates truth/logdx/drain3")
        for name, r in ga["datasets"].items():
            w(f"  {name:<12} {r['logdx']:>6.3f} {r['drain3']:>6.3f} {r['drain3_defaults']:>12.3f}   "
              f"{r['templates_truth']}/{r['templates_logdx']}/{r['templates_drain3']}")
        a = ga["average"]
        w(f"  {'average':<12} {a['logdx']:>6.3f} {a['drain3']:>6.3f} {a['drain3_defaults']:>12.3f}")
        w("")
    mem = results.get("memory")
    if mem:
        w(f"diagnose --json --no-llm --no-retrieval (fresh process each; pipeline settings: depth "
          f"{results['pipeline_config']['drain_depth']}, sim_th {results['pipeline_config']['drain_sim_th']})")
        for r in mem["runs"]:
            w(f"  {r['lines']:>9,} lines {r['bytes'] / 1e6:>6,.0f} MB: peak RSS {r['max_rss_mb']:>6.0f} MB, "
              f"wall {r['wall_s']:>6.1f}s ({r['lines'] / r['wall_s'] / 1e3:,.0f} k lines/s), "
              f"{r['compression']['templates']} templates, {r['compression']['lines_kept']} kept, {r['failure_type']}")
        w(f"  peak RSS growth {min(r['lines'] for r in mem['runs']):,} -> {max(r['lines'] for r in mem['runs']):,} "
          f"lines: {mem['rss_growth'] * 100:+.1f}%")
        if mem.get("e2e"):
            e = mem["e2e"]
            w(f"  end-to-end on {e['lines']:,} lines: {e['wall_s']:.1f}s wall (timings_ms {e['timings_ms']})")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lines", type=int, default=2_000_000, help="training log size for throughput and end-to-end")
    ap.add_argument("--rss-sizes", default="1000000,2000000,5000000", help="log sizes for peak RSS (comma separated)")
    ap.add_argument("--repeats", type=int, default=2, help="passes per measurement; the best counts")
    ap.add_argument("--batch", type=int, default=50_000, help="lines per interleaved batch")
    ap.add_argument("--only", default="training,loghub,ga,memory", help="which parts to run")
    ap.add_argument("--quick", action="store_true", help="200k-line log, sizes 200k/500k, one repeat: a smoke run")
    ap.add_argument("--json", type=Path, default=REPO / "bench-results" / "compress.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.lines, args.rss_sizes, args.repeats = 200_000, "200000,500000", 1
    sizes = sorted(int(s) for s in args.rss_sizes.split(","))
    parts = set(args.only.split(","))
    results: dict = {"repeats": args.repeats, "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                                                          "platform": platform.platform()},
                     "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    config = CompressConfig()
    results["config"] = {"drain_depth": config.drain_depth, "drain_sim_th": config.drain_sim_th,
                         "drain_match_params": config.match_params}
    pipeline = load_settings().compress  # what `diagnose` runs with (config.py defaults, env, LOGDX_CONFIG)
    results["pipeline_config"] = {"drain_depth": pipeline.drain_depth, "drain_sim_th": pipeline.drain_sim_th}
    t_start = time.perf_counter()
    rules = load_rules([default_rules_dir()])  # the pipeline's `also_error`: asked once per shape
    datasets = [loghub.load(LOGHUB, name) for name in loghub.DATASETS] if parts & {"loghub", "ga"} else []
    if "training" in parts:
        results["training"] = bench_training(training_log(args.lines), args.repeats, args.batch, rules.could_match)
    if "loghub" in parts:
        results["loghub"] = bench_loghub_throughput(datasets, max(3, args.repeats), rules.could_match)
    if "ga" in parts:
        results["ga"] = bench_ga(datasets)
    if "memory" in parts:
        results["memory"] = bench_memory(sizes, args.lines, args.repeats)
    results["elapsed_s"] = time.perf_counter() - t_start
    text = table(results)
    print(text)
    print(f"({results['elapsed_s']:.0f}s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
