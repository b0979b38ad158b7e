"""`make eval`: measure the pipeline against a labelled set of real failure logs.

    python -m logdx.evaluate ../shared/data/failures-dev [--json out.json] [--no-llm] [--no-retrieval]
    python -m logdx.evaluate ../shared/data/failures-dev --bury 3 [--bury-lines 30000] [--bury-ranks 64]
                             [--bury-dir DIR] [--bury-seed 0]

Prints accuracy of category, action, failure_type, root line and culprit, then every miss. The
labelled logs are for measuring; nothing in logdx may be keyed to them.

With ``--bury N`` each case is also buried N times (``logdx.synth.bury``) in a long, healthy multi-rank
job followed by its cascade, each time with another seed, prefix style and prefix choice, and the
same fields are scored on the buried logs:

* root_line is correct when the report's root line *is* the buried copy of the labelled root line:
  its line number is where ``bury`` wrote (one of) the real line(s) the label names, and its text,
  once the prefix ``bury`` added is stripped, matches the label as in the plain run;
* culprit (when labelled) is correct when the plain check passes, or when the report names the rank
  or the host the real lines were buried under (their prefix says so; that is the culprit of the
  buried job). A label "rank N" makes rank N the culprit of the burial, so both agree.

Buried variants are deterministic in (case id, variant number, --bury-seed).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from logdx.act.report import Report
from logdx.config import load_settings
from logdx.pipeline import Engine
from logdx.synth.bury import BuriedTruth, bury, read_real_lines
from logdx.synth.styles import STYLES

# Labels name "what the owner must do"; the report's action set folds both into no_restart.
_ACTION_ALIASES = {"fix_script": "no_restart", "fix_config": "no_restart"}
_FIELDS = ("status", "category", "action", "failure_type", "root_line", "culprit")


@dataclass
class CaseResult:
    case_id: str
    label: dict
    report: Report
    correct: dict[str, bool | None] = field(default_factory=dict)
    seconds: float = 0.0
    variant: dict | None = None  # buried runs: how the case was buried (seed, style, prefix_real, path)
    truth: BuriedTruth | None = None  # buried runs: where the real lines landed


def load_labels(folder: Path) -> list[dict]:
    """The labelled cases of a folder (its labels.jsonl), or of every sub-folder that has one (a
    corpus kept in shards). Each label gets `_log`, the path of its log."""
    files = [folder / "labels.jsonl"] if (folder / "labels.jsonl").is_file() else sorted(folder.glob("*/labels.jsonl"))
    out = []
    for labels in files:
        with open(labels, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    label = json.loads(line)
                    label["_log"] = str(labels.parent / f"{label['id']}.log")
                    out.append(label)
    return out


def load_cases(folders: list[Path]) -> list[dict]:
    """Every case of the folders, each source URL once (the first folder that has it wins)."""
    seen: set[str] = set()
    out = []
    for folder in folders:
        for label in load_labels(folder):
            src = label.get("source") or label["_log"]
            if src not in seen:
                seen.add(src)
                out.append(label)
    return out


def is_healthy_label(label: dict) -> bool:
    return label.get("status") == "healthy"


def _squash(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def root_line_correct(label_line: str, report: Report) -> bool:
    if report.root_cause is None:
        return False
    got, want = _squash(report.root_cause.text), _squash(label_line)
    return bool(want) and (got == want or want in got or (len(got) > 20 and got in want))


def culprit_correct(label: str | None, report: Report) -> bool | None:
    """None when the label names no culprit (nothing to check)."""
    if not label:
        return None
    c = report.culprits
    low = label.lower()
    if any(h.lower() in low for h in c.hosts):
        return True
    if any(re.search(rf"\brank\s*{r}\b", low) for r in c.ranks):
        return True
    return any(g.lower().lstrip("0:") in low for g in c.gpus if g)


def score_case(label: dict, report: Report) -> dict[str, bool | None]:
    if is_healthy_label(label):
        # A healthy run: only whether logdx left it alone counts.
        return {"status": report.status == "healthy", **{f: None for f in _FIELDS if f != "status"}}
    want_action = _ACTION_ALIASES.get(label["action"], label["action"])
    return {
        "status": report.status == "failed",
        "category": report.category == label["category"],
        "action": report.action == want_action,
        "failure_type": report.failure_type == label["failure_type"],
        "root_line": root_line_correct(label.get("root_line", ""), report),
        "culprit": culprit_correct(label.get("culprit"), report),
    }


def evaluate(cases: list[dict], engine: Engine, *, leave_one_out: bool = True) -> list[CaseResult]:
    results = []
    for label in cases:
        if leave_one_out:
            engine.diagnoser.exclude_incidents = tuple(same_incidents(engine, label))
        t0 = time.perf_counter()
        report, _ = engine.diagnose_path(label["_log"])
        result = CaseResult(label["id"], label, report, seconds=time.perf_counter() - t0)
        result.correct = score_case(label, report)
        results.append(result)
    return results


def same_incidents(engine: Engine, label: dict) -> list[str]:
    """Incidents that are this very case (fed back earlier): left out while it is diagnosed, so
    that the knowledge base cannot answer by remembering the test."""
    if engine.incidents is None or not label.get("root_line"):
        return []
    from logdx.incidents import mask_text

    want_line, want_template = _squash(label["root_line"]), mask_text(label["root_line"])
    return [inc.id for inc in engine.incidents.list()
            if _squash(inc.root_line) == want_line or inc.root_template == want_template]


# -- stages: what retrieval and the LLM add to the rules ------------------------------------------------

# (row, catalog, retrieval, llm): each row adds one stage to the one above it.
_STAGES = (
    ("rules", False, False, False),
    ("rules + catalog", True, False, False),
    ("rules + catalog + retrieval", True, True, False),
    ("rules + catalog + retrieval + LLM", True, True, True),
)


def evaluate_stages(cases: list[dict], engine: Engine) -> list[dict[str, object]]:
    """The same cases through each cascade, each row one stage more; the models stay loaded between
    rows. A row also says which cases the added stage fixed and which it broke."""
    d = engine.diagnoser
    catalog, retrieval, llm = d.catalog, d.retrieval, d.llm
    rows: list[dict[str, object]] = []
    previous: dict[str, bool] | None = None
    for name, use_catalog, use_retrieval, use_llm in _STAGES:
        if (use_catalog and catalog is None) or (use_retrieval and retrieval is None) or (use_llm and llm is None):
            continue
        d.catalog = catalog if use_catalog else None
        d.retrieval = retrieval if use_retrieval else None
        d.llm = llm if use_llm else None
        if retrieval is not None and hasattr(retrieval, "_query_cache"):
            retrieval._query_cache.clear()  # time real embeddings, not the previous row's cache
        results = evaluate(cases, engine)
        right = {r.case_id: is_right(r) for r in results}
        gained = sorted(k for k, v in right.items() if previous is not None and v and not previous[k])
        lost = sorted(k for k, v in right.items() if previous is not None and not v and previous[k])
        rows.append({"stages": name, "accuracy": summarize(results), "latency_ms": stage_latencies(results),
                     "calibration": calibration(results), "fixed": gained, "broke": lost})
        previous = right
    d.catalog, d.retrieval, d.llm = catalog, retrieval, llm
    return rows


def stage_latencies(results: list[CaseResult]) -> dict[str, dict[str, float]]:
    per_stage: dict[str, list[float]] = {}
    for r in results:
        for key, ms in r.report.timings_ms.items():
            if key.startswith("diagnose."):
                per_stage.setdefault(key.split(".", 1)[1], []).append(ms)
    return {stage: {"median": round(statistics.median(v), 1), "p95": round(_p95(v), 1), "n": len(v)}
            for stage, v in per_stage.items()}


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))]


def print_stages(rows: list[dict[str, object]], load_s: dict[str, float]) -> None:
    fields = ("category", "action", "failure_type", "root_line")
    print("\n| stages | " + " | ".join(fields) + " | latency per stage, median / p95 (ms) |")
    print("|---|" + "---|" * len(fields) + "---|")
    for row in rows:
        acc = row["accuracy"]
        lat = ", ".join(f"{k} {v['median']:.1f}/{v['p95']:.1f} (n={v['n']})" for k, v in row["latency_ms"].items())
        print(f"| {row['stages']} | " + " | ".join(f"{acc[f]['accuracy']:.3f}" for f in fields) + f" | {lat} |")
    print("model load (s): " + ", ".join(f"{k} {v:.1f}" for k, v in load_s.items()))
    for row in rows[1:]:
        print(f"{row['stages']}: fixed {len(row['fixed'])} {row['fixed']}, broke {len(row['broke'])} {row['broke']}")


# -- buried runs -------------------------------------------------------------------------------------

_BURY_STYLES = tuple(STYLES)


def buried_root_line_correct(label_line: str, report: Report, truth: BuriedTruth) -> bool:
    """The report's root line is the buried copy of the labelled line: same place, same text."""
    if report.root_cause is None:
        return False
    line_no = report.root_cause.line_no
    if line_no not in truth.root_line_nos_for(label_line):
        return False
    got = truth.strip_prefix(line_no, report.root_cause.text)
    return root_line_correct(label_line, report.model_copy(update={
        "root_cause": report.root_cause.model_copy(update={"text": got})}))


def buried_culprit_correct(label: str | None, report: Report, truth: BuriedTruth) -> bool | None:
    ok = culprit_correct(label, report)
    if ok is None or ok:
        return ok
    c = report.culprits
    return truth.culprit_rank in c.ranks or truth.culprit_host in c.hosts


def burial_culprit_named(report: Report, truth: BuriedTruth) -> bool:
    """Informational: the report names the rank or host the real lines were buried under. Every
    burial has one (its launcher reports the death; prefixed lines name it), labelled or not."""
    return truth.culprit_rank in report.culprits.ranks or truth.culprit_host in report.culprits.hosts


def format_culprit_disagreements(results: list[CaseResult]) -> list[str]:
    out = []
    for r in results:
        if r.truth is None or r.variant is None or burial_culprit_named(r.report, r.truth):
            continue
        rc = r.report.root_cause
        out.append(f"{r.case_id}: {r.variant['style']} prefix_real={r.variant['prefix_real']} burial=rank "
                   f"{r.truth.culprit_rank}/{r.truth.culprit_host} got ranks={r.report.culprits.ranks[:4]} "
                   f"hosts={r.report.culprits.hosts[:3]} label={r.label.get('culprit')!r} "
                   f"root@{rc.line_no if rc else None}: {(rc.text if rc else '')[:90]}")
    return out


def score_buried(label: dict, report: Report, truth: BuriedTruth) -> dict[str, bool | None]:
    marks = score_case(label, report)
    marks["root_line"] = buried_root_line_correct(label.get("root_line", ""), report, truth)
    marks["culprit"] = buried_culprit_correct(label.get("culprit"), report, truth)
    return marks


def label_culprit_rank(label: dict, ranks: int) -> int | None:
    """A label naming one rank ("rank 12") fixes the rank the real lines are buried under."""
    m = re.search(r"\brank\s*(\d+)\b", label.get("culprit") or "", re.IGNORECASE)
    return int(m.group(1)) if m and int(m.group(1)) < ranks else None


def bury_variants(case_id: str, case_index: int, n: int, base_seed: int = 0) -> list[dict]:
    """N different buryings of one case: seed, prefix style and whether the real lines get a prefix."""
    out = []
    for k in range(n):
        out.append({
            "seed": zlib.crc32(f"logdx-eval-bury:{base_seed}:{case_id}:{k}".encode()) & 0x7FFFFFFF,
            "style": _BURY_STYLES[(case_index + k) % len(_BURY_STYLES)],
            "prefix_real": (case_index + 3 * k) % 4 != 3,  # one burial in four leaves them bare
        })
    return out


def evaluate_buried(cases: list[dict], engine: Engine, n: int, workdir: Path, *, lines: int = 30000,
                    ranks: int = 64, base_seed: int = 0) -> list[CaseResult]:
    results = []
    for ci, label in enumerate(c for c in cases if not is_healthy_label(c)):
        real = read_real_lines(label["_log"])
        for k, variant in enumerate(bury_variants(label["id"], ci, n, base_seed)):
            path = workdir / f"{label['id']}-b{k}-{variant['style']}.log"
            with open(path, "w", encoding="utf-8", errors="surrogateescape", newline="") as out:
                truth = bury(real, out, lines=lines, ranks=ranks, culprit_rank=label_culprit_rank(label, ranks),
                             **variant)
            t0 = time.perf_counter()
            report, _ = engine.diagnose_path(path)
            result = CaseResult(f"{label['id']}#b{k}", label, report, seconds=time.perf_counter() - t0,
                                variant={**variant, "path": str(path)}, truth=truth)
            result.correct = score_buried(label, report, truth)
            results.append(result)
    return results


def is_right(r: CaseResult) -> bool:
    """What a calibrated confidence promises: the report is right on status, category, failure
    type and action (a healthy case: on status)."""
    c = r.correct
    return all(c.get(f) is not False for f in ("status", "category", "failure_type", "action"))


_CALIBRATION_BINS = (0.0, 0.5, 0.7, 0.8, 0.9, 1.01)


def calibration(results: list[CaseResult]) -> list[dict[str, float | int | str]]:
    """Per band of confidence: how many reports, and how many of them were right."""
    rows = []
    for lo, hi in zip(_CALIBRATION_BINS, _CALIBRATION_BINS[1:]):
        band = [r for r in results if lo <= r.report.confidence < hi]
        right = sum(is_right(r) for r in band)
        rows.append({"band": f"{lo:.1f}-{min(hi, 1.0):.1f}", "n": len(band), "right": right,
                     "accuracy": round(right / len(band), 3) if band else 0.0})
    return rows


def confusion(results: list[CaseResult]) -> dict[str, int]:
    crashes = [r for r in results if not is_healthy_label(r.label)]
    healthy = [r for r in results if is_healthy_label(r.label)]
    return {"crashes": len(crashes), "crashes_called_healthy": sum(r.report.status == "healthy" for r in crashes),
            "healthy": len(healthy), "healthy_called_failed": sum(r.report.status != "healthy" for r in healthy)}


def print_quality(results: list[CaseResult]) -> None:
    c = confusion(results)
    print(f"  crashes called healthy: {c['crashes_called_healthy']}/{c['crashes']}   "
          f"healthy called failed: {c['healthy_called_failed']}/{c['healthy']}")
    print("  calibration (right = status, category, failure type and action):")
    for row in calibration(results):
        print(f"    confidence {row['band']}: {row['right']}/{row['n']} right"
              + (f" ({row['accuracy']:.3f})" if row["n"] else ""))


def summarize(results: list[CaseResult]) -> dict[str, dict[str, float | int]]:
    table: dict[str, dict[str, float | int]] = {}
    for name in _FIELDS:
        marks = [r.correct[name] for r in results if r.correct[name] is not None]
        table[name] = {"correct": sum(bool(m) for m in marks), "n": len(marks),
                       "accuracy": round(sum(bool(m) for m in marks) / len(marks), 3) if marks else 0.0}
    return table


def format_misses(results: list[CaseResult]) -> list[str]:
    out = []
    for r in results:
        wrong = [k for k, v in r.correct.items() if v is False]
        if not wrong:
            continue
        rep, lab = r.report, r.label
        out.append(f"{r.case_id}: wrong {', '.join(wrong)}")
        out.append(f"    want {lab['category']}/{lab['failure_type']}/{lab['action']} culprit={lab.get('culprit')}")
        out.append(f"    got  {rep.category}/{rep.failure_type}/{rep.action} culprit={rep.culprits.model_dump()}"
                   f" conf={rep.confidence}")
        if r.variant is not None and r.truth is not None:
            v, t = r.variant, r.truth
            out.append(f"    buried: seed={v['seed']} style={v['style']} prefix_real={v['prefix_real']} "
                       f"culprit=rank {t.culprit_rank} on {t.culprit_host} flavour={t.flavour} "
                       f"lines={t.lines_written} log={v['path']}")
        if "root_line" in wrong:
            if r.truth is not None:
                want_nos = r.truth.root_line_nos_for(lab.get("root_line", ""))
                out.append(f"    want line {','.join(map(str, want_nos)) or '?'}: {lab.get('root_line', '')[:150]}")
                got_no = rep.root_cause.line_no if rep.root_cause else None
                out.append(f"    got  line {got_no}: {(rep.root_cause.text if rep.root_cause else None)!s:.150}")
            else:
                out.append(f"    want line: {lab.get('root_line', '')[:150]}")
                out.append(f"    got  line: {(rep.root_cause.text if rep.root_cause else None)!s:.150}")
    return out


def result_record(r: CaseResult) -> dict[str, object]:
    """One run for ``--json``: what was wanted, what the report said, how the case was buried."""
    rep = r.report
    rec: dict[str, object] = {
        "id": r.case_id, "correct": r.correct, "seconds": round(r.seconds, 3),
        "got": {"category": rep.category, "failure_type": rep.failure_type, "action": rep.action,
                "culprits": rep.culprits.model_dump(),
                "root_line_no": rep.root_cause.line_no if rep.root_cause else None,
                "root_text": rep.root_cause.text if rep.root_cause else None},
    }
    if r.variant is not None and r.truth is not None:
        rec["variant"] = r.variant
        rec["buried"] = {"culprit_rank": r.truth.culprit_rank, "culprit_host": r.truth.culprit_host,
                         "flavour": r.truth.flavour, "lines": r.truth.lines_written,
                         "failure_line_no": r.truth.failure_line_no,
                         "want_root_line_nos": r.truth.root_line_nos_for(r.label.get("root_line", "")),
                         "culprit_named": burial_culprit_named(rep, r.truth)}
    return rec


def breakdown(results: list[CaseResult], key: str) -> dict[str, dict[str, dict[str, float | int]]]:
    """The table per value of a variant field (style, prefix_real)."""
    groups: dict[str, list[CaseResult]] = defaultdict(list)
    for r in results:
        if r.variant is not None:
            groups[str(r.variant[key])].append(r)
    return {k: summarize(v) for k, v in sorted(groups.items())}


def print_table(title: str, table: dict[str, dict[str, float | int]]) -> None:
    print(title)
    for name, row in table.items():
        print(f"  {name:<13} {row['accuracy']:.3f}  ({row['correct']}/{row['n']})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m logdx.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("folders", type=Path, nargs="+", metavar="FOLDER",
                   help="folders of labelled logs (labels.jsonl), or of shards that each have one")
    p.add_argument("--json", type=Path, help="also write the figures as JSON here")
    p.add_argument("--no-llm", action="store_true")
    p.add_argument("--no-retrieval", action="store_true")
    p.add_argument("--stages", action="store_true",
                   help="also compare rules / + retrieval / + LLM (leave-one-out), with per-stage latency")
    p.add_argument("--bury", type=int, default=0, metavar="N",
                   help="also bury each case N times in a long multi-rank job with a cascade, and score those")
    p.add_argument("--bury-lines", type=int, default=30000, help="length of each buried log (default 30000)")
    p.add_argument("--bury-ranks", type=int, default=64, help="ranks of each buried job (default 64)")
    p.add_argument("--bury-seed", type=int, default=0, help="changes every burial's seed")
    p.add_argument("--bury-dir", type=Path, help="keep the buried logs here (default: a temporary directory)")
    args = p.parse_args(argv)
    cases = load_cases(args.folders)
    if not cases:
        print(f"evaluate: error: no labels.jsonl in {', '.join(map(str, args.folders))}", file=sys.stderr)
        return 2
    settings = load_settings()
    settings.llm.enabled = settings.llm.enabled and not args.no_llm
    settings.retrieval.enabled = settings.retrieval.enabled and not args.no_retrieval
    t0 = time.perf_counter()
    engine = Engine.create(settings)
    load_s = {stage: round(sec, 2) for stage, sec in engine.warm_up().items()}
    load_s["engine_total"] = round(time.perf_counter() - t0, 2)
    results = evaluate(cases, engine)
    table = summarize(results)
    print_table(f"{len(results)} cases from {', '.join(map(str, args.folders))}", table)
    print_quality(results)
    misses = format_misses(results)
    if misses:
        print("\nmisses:")
        print("\n".join(misses))
    figures: dict[str, object] = {"cases": len(results), "accuracy": table, "model_load_s": load_s,
                                  "confusion": confusion(results), "calibration": calibration(results),
                                  "runs": [result_record(r) for r in results]}
    if args.stages:
        rows = evaluate_stages(cases, engine)
        print_stages(rows, load_s)
        figures["stages"] = rows
    if args.bury > 0:
        workdir = args.bury_dir or Path(tempfile.mkdtemp(prefix="logdx-bury-"))
        workdir.mkdir(parents=True, exist_ok=True)
        try:
            buried = evaluate_buried(cases, engine, args.bury, workdir, lines=args.bury_lines,
                                     ranks=args.bury_ranks, base_seed=args.bury_seed)
        finally:
            if args.bury_dir is None:
                shutil.rmtree(workdir, ignore_errors=True)
        btable = summarize(buried)
        print()
        print_table(f"{len(buried)} buried runs ({args.bury} per case, {args.bury_ranks} ranks, "
                    f"~{args.bury_lines} lines each)", btable)
        print("\n  field          plain   buried")
        for name in table:
            print(f"  {name:<13} {table[name]['accuracy']:.3f}   {btable[name]['accuracy']:.3f}")
        by_style, by_prefix = breakdown(buried, "style"), breakdown(buried, "prefix_real")
        print("\n  root_line by style: " + ", ".join(
            f"{k} {v['root_line']['correct']}/{v['root_line']['n']}" for k, v in by_style.items()))
        print("  root_line by prefix_real: " + ", ".join(
            f"{k} {v['root_line']['correct']}/{v['root_line']['n']}" for k, v in by_prefix.items()))
        named = sum(burial_culprit_named(r.report, r.truth) for r in buried if r.truth is not None)
        print(f"  culprit of the burial named (informational, all runs, labelled or not): {named}/{len(buried)}")
        bmisses = format_misses(buried)
        if bmisses:
            print("\nburied misses:")
            print("\n".join(bmisses))
        disagreements = format_culprit_disagreements(buried)
        if disagreements:
            print("\nculprit differs from the burial's (informational; not scored unless labelled):")
            print("\n".join(disagreements))
        figures["buried"] = {"count": len(buried), "per_case": args.bury, "accuracy": btable,
                             "by_style": by_style, "by_prefix_real": by_prefix, "burial_culprit_named": named,
                             "runs": [result_record(r) for r in buried]}
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
