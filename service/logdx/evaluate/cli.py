"""``python -m logdx.evaluate``: measure logdx on the labelled excerpts and on whole jobs.

    python -m logdx.evaluate eval/corpus ../shared/data/failures-dev            # every set, both cascades
    python -m logdx.evaluate FOLDER... --quick                                  # rules only (fast iteration)
    python -m logdx.evaluate FOLDER... --sets hangs,divergence --only silent- --keep /tmp/jobs
    python -m logdx.evaluate FOLDER... --sets excerpts --stages                 # what each stage adds
    python -m logdx.evaluate FOLDER... --quick --without store_retries,hub_retries   # what a family costs
    python -m logdx.evaluate FOLDER... --sets excerpts --hold-out each --compare  # each precise pack held out

Sets: ``excerpts`` (the labelled logs of the folders), ``buried`` (each of them buried in a realistic
long multi-rank job), ``healthy`` (32 long healthy runs with scary output), ``hangs`` (silent ranks and
stack dumps), ``divergence`` (loss divergences, and spikes that recover), ``pasted`` (short pasted excerpts
that end in a fatal exception), ``teardown`` (healthy runs with teardown noise and kernel lines past their
end). Each prints one table with
the same columns, one row per cascade (``rules``: rules + error catalog; ``default``: with retrieval and
the LLM when enabled), then its misses; a one-screen summary of every set comes last.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from logdx.config import load_settings
from logdx.evaluate.buried import burial_record, buried_cases, describe_burial, score_buried
from logdx.evaluate.corpus import (
    CaseResult,
    evaluate_stages,
    format_misses,
    load_cases,
    print_stages,
    result_record,
    score_case,
)
from logdx.evaluate.holdout import held_out_lines, hold_out_groups, learned_decisions
from logdx.evaluate.jobs import GENERATED_SETS, describe_job, job_record, label_of, score_job
from logdx.evaluate.runner import Cascade, Item, JobResult, cascades_of, generated, run_set
from logdx.evaluate.tables import (
    breakdown_lines,
    calibration_lines,
    regressions,
    set_figures,
    summary_lines,
    table_lines,
)
from logdx.pipeline import Engine
from logdx.synth.noise import FAMILIES
from logdx.synth.teardown import FAMILIES as TEARDOWN_FAMILIES

ALL_SETS = ("excerpts", "buried", "healthy", "hangs", "divergence", "pasted", "teardown", "timeouts", "startup")


def _read_log(path: str) -> bytes:
    data = Path(path).read_bytes()
    return gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data


def excerpt_items(cases: list[dict]) -> list[Item]:
    return [Item(label["id"], make=lambda p=label["_log"]: (_read_log(p), None), label_of=lambda _t, lab=label: lab,  # type: ignore[misc]  # mypy#15459: lambda defaults
                 score=lambda lab, rep, _t: score_case(lab, rep), corpus_label=label) for label in cases]


def buried_items(cases: list[dict], per_case: int, seed: int, without: frozenset[str] = frozenset()) -> list[Item]:
    return [Item(b.case_id, make=lambda b=b: generated(b.generate), label_of=lambda _t, lab=b.label: lab,  # type: ignore[misc]  # mypy#15459: lambda defaults
                 score=score_buried, exit_code_of=lambda t: t.exit_code, variant=b.variant, corpus_label=b.label)
            for b in buried_cases(cases, per_case, seed, without)]


def generated_items(set_name: str, seed: int, without: frozenset[str] = frozenset()) -> list[Item]:
    cases = [replace(c, kwargs={**c.kwargs, "without": without}) if without else c
             for c in GENERATED_SETS[set_name](seed)]
    return [Item(c.case_id, make=lambda c=c: generated(c.generate), label_of=label_of,  # type: ignore[misc]  # mypy#15459: lambda defaults
                 score=lambda _lab, rep, t: score_job(t, rep), exit_code_of=lambda t: t.exit_code)
            for c in cases]


_DESCRIBE: dict[str, Callable[[CaseResult, list[str]], list[str]] | None] = {
    "excerpts": None, "buried": describe_burial, "healthy": describe_job, "hangs": describe_job, "divergence": describe_job,
    "pasted": describe_job, "teardown": describe_job, "timeouts": describe_job, "startup": describe_job}
_RECORD: dict[str, Callable[[CaseResult], dict[str, object]] | None] = {
    "excerpts": None, "buried": burial_record, "healthy": job_record, "hangs": job_record, "divergence": job_record,
    "pasted": job_record, "teardown": job_record, "timeouts": job_record, "startup": job_record}


def _title(set_name: str, results: list[JobResult]) -> tuple[str, str]:
    failed = sum(r.label.get("status") != "healthy" for r in results)
    size = f"{len(results)}: {failed} failed, {len(results) - failed} healthy"
    lines = [r.lines for r in results]
    span = f"; {min(lines):,}-{max(lines):,} lines" if set_name != "excerpts" and lines else ""
    what = {"excerpts": "labelled real excerpts", "buried": "the excerpts buried in long multi-rank jobs",
            "healthy": "long healthy runs", "hangs": "hangs (silent ranks, stack dumps)",
            "divergence": "divergences and recovering spikes",
            "pasted": "short pasted excerpts that end in a fatal exception",
            "teardown": "healthy runs with teardown noise and kernel lines past their end",
            "timeouts": "collective timeouts, one cause class each",
            "startup": "healthy runs whose NCCL start-up shows one degradation on one host, or none"}[set_name]
    return f"\n== {set_name}: {what} ({size}{span}) ==", size


def _breakdowns(set_name: str, results: list[JobResult], cascade: str) -> list[str]:
    base = ("category", "failure_type", "root_line")
    match set_name:
        case "buried":
            return (["  by launcher style:"] + breakdown_lines(results, cascade, lambda r: str((r.variant or {}).get("style")),
                                                          ("status", "category", "root_line"))
                    + ["  by ranks:"] + breakdown_lines(results, cascade, lambda r: f"{(r.variant or {}).get('ranks'):>3} ranks",
                                                        ("status", "category", "root_line")))
        case "healthy":
            return ["  by framework:"] + breakdown_lines(results, cascade, lambda r: r.truth.flavour, ("status",))
        case "hangs":
            return (["  by kind:"] + breakdown_lines(results, cascade, lambda r: r.truth.kind, base + ("culprit_rank", "culprit_host"))
                    + ["  stack dumps by where the culprit sits:"]
                    + breakdown_lines([r for r in results if r.truth.kind == "stack_hang"], cascade,
                                      lambda r: f"{r.truth.variant['where']} ({r.truth.variant['dumper']})",
                                      base + ("culprit_rank",)))
        case "divergence":
            return ["  by kind:"] + breakdown_lines(results, cascade, lambda r: str(r.truth.variant.get("kind", "recovering spike")),
                                                    ("status", "failure_type", "root_line", "step"))
        case "teardown":
            return (["  by framework:"] + breakdown_lines(results, cascade, lambda r: r.truth.flavour, ("status",))
                    + ["  by launcher style:"] + breakdown_lines(results, cascade, lambda r: r.truth.style, ("status",))
                    + ["  by teardown family:"]
                    + [line for fam in TEARDOWN_FAMILIES for line in breakdown_lines(
                        [r for r in results if fam in r.truth.variant.get("teardown", ())], cascade, lambda _r, f=fam: f,  # type: ignore[misc]
                        ("status",))]
                    + ["  a fatal Xid past the end:"]
                    + breakdown_lines([r for r in results if r.truth.variant.get("late_xid")], cascade,
                                      lambda _r: "late fatal Xid", ("status",)))
        case "timeouts":
            return ["  by class:"] + breakdown_lines(results, cascade, lambda r: str(r.truth.variant["timeout_class"]),
                                                     ("action", "timeout_class", "culprit"))
        case "startup":
            return ["  by degradation:"] + breakdown_lines(results, cascade, lambda r: str(r.truth.variant["degradation"]),
                                                           ("status", "degradation"))
        case "pasted":
            return (["  by crash:"] + breakdown_lines(results, cascade, lambda r: str(r.truth.variant["crash"]), base)
                    + ["  by order:"] + breakdown_lines(results, cascade, lambda r: str(r.truth.variant["order"]), ("status",))
                    + ["  by style:"] + breakdown_lines(results, cascade, lambda r: r.truth.style, ("status", "root_line")))
    return []


def run(args: argparse.Namespace) -> int:
    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    unknown = [s for s in sets if s not in ALL_SETS]
    if unknown:
        print(f"evaluate: error: unknown set(s) {', '.join(unknown)}; choose from {', '.join(ALL_SETS)}", file=sys.stderr)
        return 2
    cases = load_cases(args.folders) if args.folders else []
    if ({"excerpts", "buried"} & set(sets)) and not cases:
        where = ", ".join(map(str, args.folders)) or "(no folder given)"
        print(f"evaluate: error: no labels.jsonl in {where}", file=sys.stderr)
        return 2
    settings = load_settings()
    quick = args.quick
    settings.llm.enabled = settings.llm.enabled and not (args.no_llm or quick)
    settings.retrieval.enabled = settings.retrieval.enabled and not (args.no_retrieval or quick)
    default_stage = settings.arbiter.stage
    if args.compare:
        settings.arbiter.stage = "both" if settings.llm.enabled else "classifier"
    t0 = time.perf_counter()
    engine = Engine.create(settings)
    load_s = {stage: round(sec, 2) for stage, sec in engine.warm_up().items()}
    load_s["engine_total"] = round(time.perf_counter() - t0, 2)
    cascades = cascades_of(engine, quick=quick, compare=args.compare, default_stage=default_stage)
    if args.hold_out:
        return _hold_out(args, sets, cases, engine, cascades)
    shown = cascades[-1].name
    all_figures: dict[str, dict[str, dict[str, Any]]] = {}
    sizes: dict[str, str] = {}
    out_json: dict[str, Any] = {"model_load_s": load_s, "cascades": [c.name for c in cascades], "sets": {}}
    t_all = time.perf_counter()
    for set_name in sets:
        items = _items(set_name, cases, args)
        if args.only:
            items = [i for i in items if args.only in i.case_id]
        if not items:
            continue
        t_set = time.perf_counter()
        results = run_set(set_name, items, engine, cascades, keep=args.keep)
        figures = set_figures(results, cascades)
        all_figures[set_name] = figures
        title, sizes[set_name] = _title(set_name, results)
        extra = {"hangs": ("culprit_rank", "culprit_host"), "divergence": ("step",),
                 "timeouts": ("timeout_class",), "startup": ("degradation",)}.get(set_name, ())
        print("\n".join(table_lines(title, figures, extra)))
        print("\n".join(_breakdowns(set_name, results, shown)))
        print("\n".join(calibration_lines(figures, shown)))
        print(f"  {len(results)} logs, {sum(r.lines for r in results):,} lines, {time.perf_counter() - t_set:.0f} s")
        views = [r.view(shown) for r in results]
        misses = format_misses(views, _DESCRIBE[set_name])
        if misses and args.misses:
            limit = len(misses) if args.misses < 0 else _cut_at_case(misses, args.misses)
            print(f"\n  misses of {shown} ({sum(1 for m in misses if not m.startswith(' '))} runs):")
            print("\n".join("  " + m for m in misses[:limit]))
            if limit < len(misses):
                print(f"  ... {sum(1 for m in misses[limit:] if not m.startswith(' '))} more (--misses -1 shows all; "
                      "--json has every run)")
        out_json["sets"][set_name] = {"size": sizes[set_name], "figures": figures,
                                      "runs": [_record(set_name, r, cascades) for r in results]}
    if args.stages and "excerpts" in sets and cases:
        rows = evaluate_stages(cases, engine)
        print_stages(rows, load_s)
        out_json["stages"] = rows
    print(f"\n== summary ({', '.join(c.name for c in cascades)}; {time.perf_counter() - t_all:.0f} s) ==")
    print("\n".join(summary_lines(all_figures, sizes)))
    if args.json:
        args.json.write_text(json.dumps(out_json, indent=1, default=str))
    worse = regressions(all_figures)
    if worse:
        print(f"\nevaluate: the default cascade is worse than rules alone in {len(worse)} place(s):\n  "
              + "\n  ".join(worse), file=sys.stderr)
        return 1
    return 0


def _hold_out(args: argparse.Namespace, sets: list[str], cases: list[dict], engine: Engine,
              cascades: list[Cascade]) -> int:
    """Each group of packs held out in turn (holdout.py): a table per run and set, then one row per run."""
    full = engine.rules
    try:
        groups = hold_out_groups(args.hold_out, full)
    except ValueError as e:
        print(f"evaluate: error: --hold-out: {e}", file=sys.stderr)
        return 2
    all_figures: dict[str, dict[str, dict[str, Any]]] = {}
    rows: list[tuple[str, dict[str, dict]]] = []
    decisions: dict[str, Counter[str]] = {c.name: Counter() for c in cascades}
    out_json: dict[str, Any] = {"cascades": [c.name for c in cascades], "hold_out": {}}
    try:
        for group, held_out in groups:
            engine.rules = engine.diagnoser.rules = held_out
            for set_name in sets:
                items = _items(set_name, cases, args)
                if args.only:
                    items = [i for i in items if args.only in i.case_id]
                if not items:
                    continue
                results = run_set(set_name, items, engine, cascades)
                figures = set_figures(results, cascades)
                key = f"{set_name} without {group}"
                all_figures[key] = figures
                rows.append((group if len(sets) == 1 else key, figures))
                title, _ = _title(set_name, results)
                print("\n".join(table_lines(title.replace(" ==", f"; held out: {group} =="), figures)))
                for c in cascades:
                    decisions[c.name].update(learned_decisions(results, c.name))
                out_json["hold_out"][key] = {"figures": figures, "runs": [_record(set_name, r, cascades) for r in results]}
    finally:
        engine.rules = engine.diagnoser.rules = full
    print("\n".join(held_out_lines(rows, cascades, decisions)))
    if args.json:
        args.json.write_text(json.dumps(out_json, indent=1, default=str))
    worse = regressions(all_figures)
    if worse:
        print(f"\nevaluate: the default cascade is worse than rules alone in {len(worse)} place(s):\n  "
              + "\n  ".join(worse), file=sys.stderr)
        return 1
    return 0


def _items(set_name: str, cases: list[dict], args: argparse.Namespace) -> list[Item]:
    if set_name == "excerpts":
        return excerpt_items(cases)
    if set_name == "buried":
        return buried_items(cases, args.per_case, args.seed, args.without)
    return generated_items(set_name, args.seed, args.without)


def _cut_at_case(misses: list[str], n_cases: int) -> int:
    """The index after the ``n_cases``-th miss (a miss is its headline and its indented lines)."""
    heads = [i for i, m in enumerate(misses) if not m.startswith(" ")]
    return heads[n_cases] if n_cases < len(heads) else len(misses)


def _record(set_name: str, r: JobResult, cascades: list[Cascade]) -> dict[str, object]:
    rec: dict[str, object] = {"id": r.case_id, "lines": r.lines, "seconds": round(r.seconds, 3), "label": r.label}
    for c in cascades:
        view = r.view(c.name)
        rec[c.name] = result_record(view)
        if c.name in r.exit_reports:
            rec[c.name + "_exit_known"] = {"status": r.exit_reports[c.name].status, "correct": r.exit_marks[c.name]}
    recorder = _RECORD[set_name]
    if recorder is not None:
        rec["truth"] = recorder(r.view(cascades[0].name))
    if r.variant is not None:
        rec["variant"] = r.variant
    return rec


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m logdx.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("folders", type=Path, nargs="*", metavar="FOLDER",
                   help="folders of labelled logs (labels.jsonl), or of shards that each have one")
    p.add_argument("--sets", default=",".join(ALL_SETS), help=f"which sets, comma-separated (default: {','.join(ALL_SETS)})")
    p.add_argument("--quick", action="store_true", help="rules only (no retrieval, no LLM): for iterating")
    p.add_argument("--no-llm", action="store_true")
    p.add_argument("--no-retrieval", action="store_true")
    p.add_argument("--stages", action="store_true",
                   help="also compare rules / + catalog / + retrieval / + LLM on the excerpts, with per-stage latency")
    p.add_argument("--per-case", type=int, default=1, metavar="N", help="burials per excerpt (default 1)")
    p.add_argument("--bury", type=int, metavar="N",
                   help="the excerpts and their burials only, N burials each (as --sets excerpts,buried --per-case N)")
    p.add_argument("--seed", type=int, default=0, help="changes every generated job and burial")
    p.add_argument("--only", metavar="TEXT", help="only the cases whose id contains TEXT")
    p.add_argument("--without", default="", metavar="FAMILY,...",
                   help=f"leave these harmless noise families out of every generated job (what does one cost?): "
                        f"{', '.join(FAMILIES)}")
    p.add_argument("--keep", type=Path, metavar="DIR", help="write every generated log and its truth here")
    p.add_argument("--misses", type=int, default=25, metavar="N",
                   help="print the first N misses of each set (0: none, -1: all; default 25)")
    p.add_argument("--json", type=Path, help="also write every figure and run as JSON here")
    p.add_argument("--hold-out", metavar="each|precise|PACK,...",
                   help="diagnose with rule packs held out: each precise pack in turn, all of them at once, or these")
    p.add_argument("--compare", action="store_true",
                   help="also the cascades of each arbiter (arbiter.stage): retrieval alone, classifier, llm, both")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.bury is not None:
        if args.bury < 1:
            print("evaluate: error: --bury needs N >= 1", file=sys.stderr)
            return 2
        args.sets, args.per_case = "excerpts,buried", args.bury
    if args.per_case < 1:
        print("evaluate: error: --per-case needs N >= 1", file=sys.stderr)
        return 2
    without = {f.strip() for f in args.without.split(",") if f.strip()}
    if without - set(FAMILIES):
        print(f"evaluate: error: unknown noise famil(y/ies) {', '.join(sorted(without - set(FAMILIES)))}; choose from "
              f"{', '.join(FAMILIES)}", file=sys.stderr)
        return 2
    args.without = frozenset(without)
    return run(args)


__all__ = ["ALL_SETS", "build_parser", "main", "run"]
