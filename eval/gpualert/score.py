#!/usr/bin/env python3
"""Score logdx on the public GPUAlert corpus (Parv-01/gpualert-eval, MIT licence), beside the baselines it ships.

    python eval/gpualert/score.py CORPUS [--json OUT] [--misses N] [--stages]

CORPUS is a clone of https://github.com/Parv-01/gpualert-eval (a work tree, or a bare mirror: its HEAD is read with
`git archive`). Nothing of it is committed here. Each of its 474 logs is diagnosed whole, in-process, rules only
(what `diagnose --no-llm --no-retrieval` gives; `--stages` adds the default cascade), twice: without an exit code and
with the corpus's own `true_exit_code` (what `diagnose --exit-code N` and `logdx run` see). The first line of an
injected log, `[inject] mode=<class> host=... pid=...`, names the label: it is removed before anyone reads the log,
logdx and the baselines alike.

Scored per log: `typed` the report's failure type is one of the class's `same` types in mapping.yaml (`refined`: or
one of its `refined` ones); `called healthy` the report said healthy (every log of the corpus is a failure);
`unknown` it said neither. The corpus's own baselines (baselines/grep_baseline.py, exitcode_baseline.py) are run
from the clone on the same stripped logs, and GPUAlert's published figures are read from its results/ folder.
"""
from __future__ import annotations

import argparse
import csv
import importlib.util
import io
import json
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from logdx.config import load_settings
from logdx.pipeline import Engine
from logdx.taxonomy import taxonomy

HERE = Path(__file__).resolve().parent
INJECT_PREFIX = "[inject] "
SOURCES = ("injected", "synthetic", "wild")


@dataclass(frozen=True, slots=True)
class ClassMap:
    same: frozenset[str]
    refined: frozenset[str]


def load_mapping(path: Path = HERE / "mapping.yaml") -> dict[str, ClassMap]:
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    types = taxonomy().types
    by_category = taxonomy().by_category()
    out: dict[str, ClassMap] = {}
    for cls, spec in raw.items():
        same = set(spec.get("same", []))
        if "category" in spec:
            same |= {t for c, names in by_category.items() if c.value == spec["category"] for t in names}
        refined = set(spec.get("refined", []))
        unknown = sorted((same | refined) - set(types))
        if unknown:
            raise SystemExit(f"{path}: {cls}: not logdx failure types: {', '.join(unknown)}")
        out[cls] = ClassMap(frozenset(same), frozenset(same | refined))
    return out


def corpus_root(given: Path, tmp: Path) -> Path:
    """A work tree as it is; a bare mirror's HEAD unpacked into tmp."""
    if (given / "corpus" / "labels.jsonl").is_file():
        return given
    try:
        blob = subprocess.run(["git", f"--git-dir={given}", "archive", "HEAD", "corpus", "baselines", "results",
                               "LICENSE"], check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"{given}: neither a gpualert-eval work tree nor a git mirror of it ({e})") from None
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(tmp, filter="data")
    return tmp


def stripped(text: str) -> str:
    return "".join(line for line in text.splitlines(keepends=True) if not line.startswith(INJECT_PREFIX))


@dataclass(slots=True)
class Tally:
    n: int = 0
    typed: int = 0
    refined: int = 0
    healthy: int = 0
    unknown: int = 0
    misses: list[str] = field(default_factory=list)
    refinements: Counter[str] = field(default_factory=Counter)

    def row(self) -> dict[str, Any]:
        return {"n": self.n, "typed": round(self.typed / self.n, 3) if self.n else None,
                "typed_refined": round(self.refined / self.n, 3) if self.n else None,
                "called_healthy": self.healthy, "unknown": self.unknown}


def _baseline(root: Path, name: str) -> ModuleType | None:
    path = root / "baselines" / f"{name}_baseline.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location(f"gpualert_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def published(root: Path) -> dict[str, dict[str, str]]:
    """GPUAlert's own figures (results/exp1_summary.csv, exp1_by_source.csv) as its repository states them."""
    out: dict[str, dict[str, str]] = {}
    summary = root / "results" / "exp1_summary.csv"
    if summary.is_file():
        for r in csv.DictReader(summary.open()):
            out.setdefault(r["classifier"], {})["all"] = f"macro-F1 {r['macro_f1']}, accuracy {r['accuracy']}"
    by_source = root / "results" / "exp1_by_source.csv"
    if by_source.is_file():
        for r in csv.DictReader(by_source.open()):
            out.setdefault(r["classifier"], {})[r["source"]] = f"accuracy {r['accuracy']}"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("corpus", type=Path, help="a clone of github.com/Parv-01/gpualert-eval (work tree or mirror)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--misses", type=int, default=10, help="list this many misses per column (default 10)")
    ap.add_argument("--stages", action="store_true", help="also the default cascade (retrieval, LLM)")
    args = ap.parse_args(argv)
    mapping = load_mapping()
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        root = corpus_root(args.corpus, tmp / "corpus")
        labels = [json.loads(x) for x in (root / "corpus" / "labels.jsonl").read_text().splitlines() if x.strip()]
        missing = sorted({d["mode"] for d in labels} - set(mapping))
        if missing:
            raise SystemExit(f"mapping.yaml has no entry for {', '.join(missing)}")
        figures = score(root, labels, mapping, tmp, stages=args.stages)
        figures["baselines"] = baselines(root, labels)
        figures["published"] = published(root)
    print_figures(figures, args.misses)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    typed_all = [t for k, t in figures["cascades"].items()]
    worst = min(r["all"]["typed_refined"] for c in typed_all for r in c.values())
    healthy = sum(r["all"]["called_healthy"] for c in typed_all for r in c.values())
    return 0 if worst >= 0.99 and healthy == 0 else 1


def score(root: Path, labels: list[dict], mapping: dict[str, ClassMap], tmp: Path, *,
          stages: bool) -> dict[str, Any]:
    settings = load_settings()
    cascades = {"rules": (False, False)}
    if stages:
        cascades["default"] = (settings.retrieval.enabled, settings.llm.enabled)
    out: dict[str, Any] = {"size": len(labels), "cascades": {}}
    for name, (retrieval, llm) in cascades.items():
        settings.retrieval.enabled, settings.llm.enabled = retrieval, llm
        engine = Engine.create(settings)
        t0 = time.process_time()
        per: dict[str, dict[str, Tally]] = {"no exit code": {}, "with exit code": {}}
        for d in labels:
            log = tmp / "log.txt"
            log.write_text(stripped((root / d["log_path"]).read_text(encoding="utf-8", errors="replace")))
            cls = mapping[d["mode"]]
            for column, exit_code in (("no exit code", None), ("with exit code", d.get("true_exit_code"))):
                report, _ = engine.diagnose_path(log, exit_code=exit_code)
                for key in ("all", d["source"]):
                    t = per[column].setdefault(key, Tally())
                    t.n += 1
                    t.typed += report.failure_type in cls.same
                    t.refined += report.failure_type in cls.refined
                    t.healthy += report.status == "healthy"
                    t.unknown += report.status == "unknown"
                    if key == "all" and report.failure_type not in cls.refined:
                        t.misses.append(f"{d['id']}: {d['mode']} -> {report.status} {report.failure_type}")
                    elif key == "all" and report.failure_type not in cls.same:
                        t.refinements[f"{d['mode']} -> {report.failure_type}"] += 1
        out["cascades"][name] = {col: {k: {**t.row(), "misses": t.misses, "refinements": dict(t.refinements)}
                                       for k, t in rows.items()}
                                 for col, rows in per.items()}
        out.setdefault("cpu_s", {})[name] = round(time.process_time() - t0, 2)
    return out


def baselines(root: Path, labels: list[dict]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name in ("grep", "exitcode"):
        module = _baseline(root, name)
        if module is None:
            continue
        right: Counter[str] = Counter()
        n: Counter[str] = Counter()
        for d in labels:
            sample = {**d, "log": stripped((root / d["log_path"]).read_text(encoding="utf-8", errors="replace"))}
            ok = module.classify(sample) == d["mode"]
            for key in ("all", d["source"]):
                n[key] += 1
                right[key] += ok
        out[name] = {k: round(right[k] / n[k], 3) for k in n}
    return out


def print_figures(f: dict[str, Any], misses: int) -> None:
    print(f"GPUAlert corpus: {f['size']} logs (injected, synthetic, wild); the [inject] line removed")
    for cascade, cols in f["cascades"].items():
        print(f"\nlogdx ({cascade}, {f['cpu_s'][cascade]} CPU-s)")
        print(f"  {'':16} {'source':10} {'n':>4} {'typed':>6} {'refined':>8} {'healthy':>8} {'unknown':>8}")
        for col, rows in cols.items():
            for key in ("all", *SOURCES):
                if key in rows:
                    r = rows[key]
                    print(f"  {col:16} {key:10} {r['n']:>4} {r['typed']:>6} {r['typed_refined']:>8} "
                          f"{r['called_healthy']:>8} {r['unknown']:>8}")
            for m in rows["all"]["misses"][:misses]:
                print(f"    miss: {m}")
            refined = ", ".join(f"{k} ({n})" for k, n in sorted(rows["all"]["refinements"].items()))
            print(f"    right only as refined: {refined or 'none'}")
    print("\nthe corpus's own baselines, same stripped logs (accuracy on GPUAlert's classes)")
    for name, rows in f["baselines"].items():
        print(f"  {name:10} " + "  ".join(f"{k} {v}" for k, v in rows.items()))
    print("\nGPUAlert's published figures (its results/ folder)")
    for name, rows in f["published"].items():
        print(f"  {name:10} " + "; ".join(f"{k}: {v}" for k, v in rows.items()))


if __name__ == "__main__":
    sys.exit(main())
