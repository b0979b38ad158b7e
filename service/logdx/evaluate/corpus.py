"""The labelled real excerpts (``eval/corpus``, the shared development sample): loading, scoring,
the comparison of cascade stages, calibration and the printed tables every set shares.

A case is a label (``labels.jsonl``: status, category, failure_type, action, culprit, root_line, source)
and its log. Nothing in logdx may be keyed to them.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from logdx.act.report import Report
from logdx.jobinput.read import diagnose_paths
from logdx.model import Action
from logdx.pipeline import Engine

# Labels name "what the owner must do"; the report's action set folds both into no_restart.
_ACTION_ALIASES = {"fix_script": Action.NO_RESTART.value, "fix_config": Action.NO_RESTART.value}
FIELDS = ("status", "category", "action", "failure_type", "root_line", "culprit")
# Whole-job sets score more: the culprit's rank and host apart (hangs), the step a divergence began.
JOB_FIELDS = ("culprit_rank", "culprit_host", "step", "timeout_class", "degradation")


@dataclass
class CaseResult:
    case_id: str
    label: dict
    report: Report
    correct: dict[str, bool | None] = field(default_factory=dict)
    seconds: float = 0.0
    variant: dict | None = None  # buried / generated runs: how the log was made (seed, style, path...)
    truth: Any = None  # buried runs: a BuriedTruth; generated jobs: a JobTruth


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
        return {"status": report.status == "healthy", **{f: None for f in FIELDS if f != "status"}}
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
        # As `diagnose FILE` reads it (its format sniffed, the year of stamps without one from its first full
        # stamp or its file's time), not a bare line feed: measured as users send logs.
        report = diagnose_paths(engine, [str(label["_log"])]).report
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

# (row, catalog, retrieval, arbiter, llm): each row adds one stage to the one above it.
_STAGES = (
    ("rules", False, False, False, False),
    ("rules + catalog", True, False, False, False),
    ("rules + catalog + retrieval", True, True, False, False),
    ("rules + catalog + retrieval + arbiter", True, True, True, False),
    ("rules + catalog + retrieval + arbiter + LLM", True, True, True, True),
)


def evaluate_stages(cases: list[dict], engine: Engine) -> list[dict[str, object]]:
    """The same cases through each cascade, each row one stage more; the models stay loaded between
    rows. A row also says which cases the added stage fixed and which it broke."""
    d = engine.diagnoser
    catalog, retrieval, arbiter, llm = d.catalog, d.retrieval, d.arbiter, d.llm
    rows: list[dict[str, object]] = []
    previous: dict[str, bool] | None = None
    for name, use_catalog, use_retrieval, use_arbiter, use_llm in _STAGES:
        if (use_catalog and catalog is None) or (use_retrieval and retrieval is None) or (use_llm and llm is None) \
                or (use_arbiter and arbiter is None):
            continue
        if arbiter is None and llm is not None:
            name = name.replace(" + arbiter", "")
        d.catalog = catalog if use_catalog else None
        d.retrieval = retrieval if use_retrieval else None
        d.arbiter = arbiter if use_arbiter else None
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
    d.catalog, d.retrieval, d.arbiter, d.llm = catalog, retrieval, arbiter, llm
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


def print_stages(rows: list[dict[str, Any]], load_s: dict[str, float]) -> None:
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


def is_right(r: CaseResult) -> bool:
    """What a calibrated confidence promises: the report is right on status, category, failure
    type and action (a healthy case: on status)."""
    c = r.correct
    return all(c.get(f) is not False for f in ("status", "category", "failure_type", "action"))


_CALIBRATION_BINS = (0.0, 0.5, 0.7, 0.8, 0.9, 1.01)


def calibration(results: list[CaseResult]) -> list[dict[str, float | int | str]]:
    """Per band of confidence: how many reports, and how many of them were right. An ``unknown`` report
    claims neither a failure nor health: it is no point of the calibration (the confusion counts it)."""
    rows: list[dict[str, float | int | str]] = []
    claims = [r for r in results if r.report.status != "unknown"]
    for lo, hi in zip(_CALIBRATION_BINS, _CALIBRATION_BINS[1:]):
        band = [r for r in claims if lo <= r.report.confidence < hi]
        right = sum(is_right(r) for r in band)
        rows.append({"band": f"{lo:.1f}-{min(hi, 1.0):.1f}", "n": len(band), "right": right,
                     "accuracy": round(right / len(band), 3) if band else 0.0})
    return rows


def confusion(results: list[CaseResult]) -> dict[str, int]:
    """The two costly mistakes, and the reports that said neither: ``unknown`` (the log showed no failure
    and no health) is no crash called healthy and no healthy run called failed, but a status miss on both."""
    crashes = [r for r in results if not is_healthy_label(r.label)]
    healthy = [r for r in results if is_healthy_label(r.label)]
    return {"crashes": len(crashes), "crashes_called_healthy": sum(r.report.status == "healthy" for r in crashes),
            "healthy": len(healthy), "healthy_called_failed": sum(r.report.status == "failed" for r in healthy),
            "unknown": sum(r.report.status == "unknown" for r in results), "runs": len(results),
            "crashes_unknown": sum(r.report.status == "unknown" for r in crashes),
            "healthy_unknown": sum(r.report.status == "unknown" for r in healthy)}


def summarize(results: list[CaseResult], fields: tuple[str, ...] = FIELDS) -> dict[str, dict[str, float | int]]:
    """Per field: how many runs it was scored on and how many were right (a field not scored on a run,
    None, does not count)."""
    table: dict[str, dict[str, float | int]] = {}
    for name in fields:
        marks = [r.correct.get(name) for r in results if r.correct.get(name) is not None]
        table[name] = {"correct": sum(bool(m) for m in marks), "n": len(marks),
                       "accuracy": round(sum(bool(m) for m in marks) / len(marks), 3) if marks else 0.0}
    return table


# How a set tells about the log of a missed run (how it was made, where the right root lines are):
# (result, wrong fields) -> lines to print under the miss.
Describe = Callable[[CaseResult, list[str]], list[str]]


def format_misses(results: list[CaseResult], describe: Describe | None = None) -> list[str]:
    out = []
    for r in results:
        wrong = [k for k, v in r.correct.items() if v is False]
        if not wrong:
            continue
        rep, lab = r.report, r.label
        out.append(f"{r.case_id}: wrong {', '.join(wrong)}")
        out.append(f"    want {lab.get('status')} {lab.get('category')}/{lab.get('failure_type')}/{lab.get('action')} "
                   f"culprit={lab.get('culprit')}")
        out.append(f"    got  {rep.status} {rep.category}/{rep.failure_type}/{rep.action} "
                   f"culprit={rep.culprits.model_dump()} conf={rep.confidence}")
        if describe is not None:
            out.extend(describe(r, wrong))
        elif "root_line" in wrong:
            out.append(f"    want line: {lab.get('root_line', '')[:150]}")
            out.append(f"    got  line: {(rep.root_cause.text if rep.root_cause else None)!s:.150}")
    return out


def result_record(r: CaseResult) -> dict[str, object]:
    """One run for ``--json``: what was wanted and what the report said (a set adds how its log was made)."""
    rep = r.report
    return {
        "id": r.case_id, "correct": r.correct, "seconds": round(r.seconds, 3),
        "got": {"status": rep.status, "category": rep.category, "failure_type": rep.failure_type,
                "action": rep.action, "culprits": rep.culprits.model_dump(),
                "root_line_no": rep.root_cause.line_no if rep.root_cause else None,
                "root_text": rep.root_cause.text if rep.root_cause else None,
                "decided_by": rep.decided_by, "confidence": rep.confidence,
                "learned_notes": [n for n in rep.notes if n.startswith(_LEARNED_NOTES)]},
    }


# The notes of the stages after the rules (what they said, abstentions included): kept in --json.
_LEARNED_NOTES = ("arbiter", "llm", "retrieval", "catalog", "fusion")
