"""`make eval`: measure the pipeline against a labelled set of real failure logs.

    python -m logdx.evaluate ../shared/data/failures-dev [--json out.json] [--no-llm] [--no-retrieval]

Prints accuracy of category, action, failure_type, root line and culprit, then every miss. The
labelled logs are for measuring; nothing in logdx may be keyed to them.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from logdx.act.report import Report
from logdx.config import load_settings
from logdx.pipeline import Engine

# Labels name "what the owner must do"; the report's action set folds both into no_restart.
_ACTION_ALIASES = {"fix_script": "no_restart", "fix_config": "no_restart"}
_FIELDS = ("category", "action", "failure_type", "root_line", "culprit")


@dataclass
class CaseResult:
    case_id: str
    label: dict
    report: Report
    correct: dict[str, bool | None] = field(default_factory=dict)
    seconds: float = 0.0


def load_labels(folder: Path) -> list[dict]:
    with open(folder / "labels.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


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
    want_action = _ACTION_ALIASES.get(label["action"], label["action"])
    return {
        "category": report.category == label["category"],
        "action": report.action == want_action,
        "failure_type": report.failure_type == label["failure_type"],
        "root_line": root_line_correct(label.get("root_line", ""), report),
        "culprit": culprit_correct(label.get("culprit"), report),
    }


def evaluate(folder: Path, engine: Engine) -> list[CaseResult]:
    results = []
    for label in load_labels(folder):
        t0 = time.perf_counter()
        report = engine.diagnose_path(folder / f"{label['id']}.log")
        result = CaseResult(label["id"], label, report, seconds=time.perf_counter() - t0)
        result.correct = score_case(label, report)
        results.append(result)
    return results


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
        if "root_line" in wrong:
            out.append(f"    want line: {lab.get('root_line', '')[:150]}")
            out.append(f"    got  line: {(rep.root_cause.text if rep.root_cause else None)!s:.150}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m logdx.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--json", type=Path, help="also write the figures as JSON here")
    p.add_argument("--no-llm", action="store_true")
    p.add_argument("--no-retrieval", action="store_true")
    args = p.parse_args(argv)
    if not (args.folder / "labels.jsonl").is_file():
        print(f"evaluate: error: {args.folder}/labels.jsonl not found", file=sys.stderr)
        return 2
    settings = load_settings()
    settings.llm.enabled = settings.llm.enabled and not args.no_llm
    settings.retrieval.enabled = settings.retrieval.enabled and not args.no_retrieval
    engine = Engine.create(settings)
    results = evaluate(args.folder, engine)
    table = summarize(results)
    print(f"{len(results)} cases from {args.folder}")
    for name, row in table.items():
        print(f"  {name:<13} {row['accuracy']:.3f}  ({row['correct']}/{row['n']})")
    misses = format_misses(results)
    if misses:
        print("\nmisses:")
        print("\n".join(misses))
    if args.json:
        args.json.write_text(json.dumps({"cases": len(results), "accuracy": table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
