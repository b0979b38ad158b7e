#!/usr/bin/env python3
"""Fixed costs of a rules-only `diagnose` (issue 35 item 1) against a baseline commit, in the same run:
CPU seconds (user + sys of the finished child, from the OS) and peak RSS, medians of interleaved
runs A B A B, each a fresh process, on

- `short-rule`: a 20-line log whose error a rule names (start-up: the goal is <= 0.25 CPU-s);
- `short-catalog`: a 20-line log whose error only the error catalog names;
- `long-rule` / `long-catalog`: a 1M-line 64-rank job ending in an error a rule names / only the
  catalog names (the goal: the second costs <= 1.2x the first).

    python bench/bench_startup.py [--baseline main] [--runs 5] [--long-runs 2] [--lines 1000000] [--json out.json]

The baseline is a `git worktree add --detach` of that commit in a temporary directory, run by the same
interpreter with its own `service/` first on the path (as bench/bench_core.py). Each side keeps one data
dir for all its runs, as a user's does (caches and store warm after a first, unmeasured run), and its
catalog index is wherever that side's code looks for it (the baseline has none). The command is the
one a user types: `diagnose LOG --no-llm --no-retrieval --json` (the report stored, as by default).
PYTHONDONTWRITEBYTECODE is unset in the children: with it set, every start-up recompiles every
module (~+0.3 CPU-s), which is not what an installed logdx pays.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache" / "bench"

_HEAD = [f"[2026-03-01 10:00:{s:02d}] [rank{r}]: step {s} loss {2.4 - s / 50:.3f} lr 3.0e-4"
         for s in range(1, 9) for r in (0, 1)][:15]
_RULE_ERROR = [
    "[2026-03-01 10:00:11] [rank0]: Traceback (most recent call last):",
    '[2026-03-01 10:00:11] [rank0]:   File "train.py", line 88, in <module>',
    "[2026-03-01 10:00:11] [rank0]:     loss = model(batch)",
    "[2026-03-01 10:00:11] [rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
]
# DeepSpeed's own message: no rule names it, the catalog does (framework / config_error).
_CATALOG_ERROR = [
    "[2026-03-01 10:00:11] [rank0]: deepspeed.runtime.zero.utils.ZeRORuntimeException: You are using ZeRO-Offload "
    "with a client provided optimizer (<class 'torch.optim.adamw.AdamW'>) which in most cases will yield poor "
    "performance. Please either use deepspeed.ops.adam.DeepSpeedCPUAdam or set an optimizer in your ds-config",
]
_TAIL = ["[2026-03-01 10:00:12] [rank1]: waiting for rank 0"]


def make_logs(lines: int) -> dict[str, Path]:
    CACHE.mkdir(parents=True, exist_ok=True)
    out = {"short-rule": CACHE / "startup-short-rule.log", "short-catalog": CACHE / "startup-short-catalog.log"}
    out["short-rule"].write_text("\n".join(_HEAD + _RULE_ERROR + _TAIL) + "\n")
    out["short-catalog"].write_text("\n".join(_HEAD + _CATALOG_ERROR + _TAIL * 4) + "\n")
    if lines:
        healthy = CACHE / f"startup-healthy-{lines}.log"
        if not healthy.exists():
            subprocess.run([sys.executable, "-m", "logdx.synth", "--scenario", "healthy", "--ranks", "64", "--lines",
                            str(lines), "--seed", "35", "-o", str(healthy)], check=True, cwd=REPO,
                           env={**os.environ, "PYTHONPATH": str(REPO / "service")})
        # The run's last lines, then its error: the same job but for what ends it. Copied, never read
        # whole: a child inherits this process's peak RSS over fork, and would report it as its own.
        for name, error in (("long-rule", _RULE_ERROR), ("long-catalog", _CATALOG_ERROR)):
            path = CACHE / f"startup-{name}-{lines}.log"
            if not path.exists():
                with healthy.open("rb") as src, path.open("wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                    dst.write(("\n".join(error) + "\n").encode())
            out[name] = path
    return out


def run_once(service: Path, data_dir: Path, log: Path) -> tuple[float, float]:
    """(CPU seconds, peak RSS MiB) of one `diagnose` process with `service` first on the path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(PYTHONPATH=str(service), LOGDX_DATA_DIR=str(data_dir))
    code = "import sys; from logdx.cli.app import diagnose_main; sys.exit(diagnose_main())"
    cmd = [sys.executable, "-c", code, str(log), "--no-llm", "--no-retrieval", "--json"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{service}: diagnose {log.name} failed: {proc.stderr.read().decode()[-400:] if proc.stderr else ''}")
    return usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def python_floor() -> float:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    _, _, usage = os.wait4(proc.pid, 0)
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="main")
    ap.add_argument("--runs", type=int, default=5, help="runs per side of each 20-line log")
    ap.add_argument("--long-runs", type=int, default=2, help="runs per side of each 1M-line job (0: skip them)")
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    logs = make_logs(args.lines if args.long_runs else 0)
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="logdx-startup-") as tmp:
        base = Path(tmp) / "baseline"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base), args.baseline], check=True, cwd=REPO)
        sides = {"this": (REPO / "service", Path(tmp) / "data-this"), "baseline": (base / "service", Path(tmp) / "data-base")}
        try:
            for service, data in sides.values():  # warm-up: bytecode, page cache, the data dir's caches
                run_once(service, data, logs["short-catalog"])
            for name, log in logs.items():
                runs = args.long_runs if name.startswith("long") else args.runs
                got: dict[str, list[tuple[float, float]]] = {"this": [], "baseline": []}
                for _ in range(runs):
                    for side, (service, data) in sides.items():
                        got[side].append(run_once(service, data, log))
                results[name] = {
                    "cpu_s_this": statistics.median(c for c, _ in got["this"]),
                    "cpu_s_baseline": statistics.median(c for c, _ in got["baseline"]),
                    "rss_mib_this": max(m for _, m in got["this"]),
                    "rss_mib_baseline": max(m for _, m in got["baseline"]),
                    "cpu_ratio": statistics.median(a[0] / b[0] for a, b in zip(got["this"], got["baseline"])),
                    "runs": runs,
                }
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], check=False, cwd=REPO)
    floor = statistics.median(python_floor() for _ in range(5))
    print(f"rules-only diagnose, this checkout vs {args.baseline}, CPU seconds (medians, interleaved runs); "
          f"python -c pass: {floor:.3f} s")
    print(f"  {'log':<14} {'this':>8} {args.baseline[:10]:>10} {'this/base':>10} {'RSS this':>9} {'RSS base':>9}  runs")
    for name, r in results.items():
        print(f"  {name:<14} {r['cpu_s_this']:8.3f} {r['cpu_s_baseline']:10.3f} {r['cpu_ratio']:10.3f} "
              f"{r['rss_mib_this']:8.0f}M {r['rss_mib_baseline']:8.0f}M  {r['runs']}")
    summary: dict[str, object] = {"baseline": args.baseline, "python_floor_cpu_s": floor, "logs": results}
    if "long-rule" in results:
        for side, key in (("this", "cpu_s_this"), ("baseline", "cpu_s_baseline")):
            ratio = results["long-catalog"][key] / results["long-rule"][key]
            summary[f"long_catalog_over_rule_{side}"] = ratio
            print(f"  {side}: a 1M-line job whose error only the catalog names / one a rule names: {ratio:.3f} "
                  "(goal <= 1.2)")
    print(f"  start-up goal: <= 0.25 CPU-s for a 20-line log; this checkout: {results['short-rule']['cpu_s_this']:.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
