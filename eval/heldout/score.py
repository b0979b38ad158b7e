#!/usr/bin/env python3
"""Score a log-diagnosis CLI against held-out labelled cases, from the outside.

    python eval/heldout/score.py --diagnose .venv/bin/diagnose [--args="--no-llm --no-retrieval"] SET_DIR [SET_DIR ...]

Each SET_DIR holds NNN.log files and a labels.jsonl (one object per case: id, status, category, failure_type,
action, culprit_hosts, culprit_ranks, root_line, root_line_alt, ...). The CLI runs once per case as
`DIAGNOSE CASE.log --json ARGS`; its report is compared with the label. Standalone: no import of the tool under test.

Rules (also in eval/heldout/README.md):
  status        failed / healthy ("empty" counts as healthy: no failure reported) / unknown (the tool says the log
                shows neither a failure nor health): unknown is a status miss on a failed and on a healthy label alike,
                but neither a crash called healthy nor a healthy run called failed; it is counted on its own line
  category      equal; a healthy label expects no category
  failure_type  equal to failure_type or one of failure_type_alt
  action        equal; label actions fix_script / fix_config (older label sets) mean no_restart
  root line     scored where the label has one: after stripping launcher prefixes ([rankN]:, [defaultN]:, "N: ",
                "host: "), the reported root line contains the labelled line (or one of root_line_alt), or the other
                way round (at least 12 characters)
  culprit       scored where the label names one: a reported host equals (or contains) a labelled host, or a
                reported rank equals a labelled rank
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

HANGS = {"hang", "framework_hang", "script_hang"}
DIVERGENCE = {"nan_loss"}
ACTION_ALIASES = {"fix_script": "no_restart", "fix_config": "no_restart"}
PREFIX = re.compile(r"^(?:\[(?:rank|default)\d+\]:\s?|\d{1,4}:\s|[a-z][a-z0-9.-]*\d[a-z0-9.-]*:\s)")
MIN_OVERLAP = 12


def strip_prefixes(line: str) -> str:
    s = line.strip().strip("\r").rstrip("…").rstrip()
    while True:
        m = PREFIX.match(s)
        if not m or m.end() == 0:
            return s.strip()
        s = s[m.end():].lstrip()


def root_matches(reported: str | None, labelled: list[str]) -> bool:
    if not reported:
        return False
    got = strip_prefixes(reported)
    for want in (strip_prefixes(x) for x in labelled if x):
        if want and want in got:
            return True
        if len(got) >= MIN_OVERLAP and got in want:
            return True
    return False


def culprit_matches(report: dict, hosts: list[str], ranks: list[int]) -> bool:
    c = report.get("culprits") or {}
    got_hosts = [str(h).lower() for h in c.get("hosts") or []]
    root = report.get("root_cause") or {}
    if root.get("host"):
        got_hosts.append(str(root["host"]).lower())
    got_ranks = set(c.get("ranks") or [])
    if root.get("rank") is not None:
        got_ranks.add(root["rank"])
    for h in (x.lower() for x in hosts):
        if any(g == h or (len(g) >= 2 and (g in h or h in g)) for g in got_hosts):
            return True
    return bool(got_ranks & set(ranks))


def run_case(diagnose: list[str], log: Path, extra: list[str], timeout: float) -> dict:
    t0 = time.monotonic()
    try:
        proc = subprocess.run(diagnose + [str(log), "--json"] + extra, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f}s", "seconds": timeout}
    secs = time.monotonic() - t0
    try:
        rep = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}", "seconds": secs}
    keep = {k: rep.get(k) for k in ("id", "status", "category", "failure_type", "action", "confidence", "culprits",
                                    "root_cause", "notes")}
    keep["seconds"] = round(secs, 2)
    keep["exit"] = proc.returncode
    return keep


def load_labels(d: Path) -> list[dict]:
    with (d / "labels.jsonl").open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def norm_status(rep: dict) -> str:
    if "error" in rep:
        return "error"
    status = rep.get("status")
    return status if status in ("failed", "unknown") else "healthy"


def score_set(name: str, labels: list[dict], reports: dict[str, dict]) -> dict:
    metrics = {k: [0, 0] for k in ("status", "category", "failure_type", "action", "root_line", "culprit")}
    misses: dict[str, list[tuple[str, str, str]]] = {k: [] for k in metrics}
    crash_healthy: list[str] = []
    healthy_failed: list[str] = []
    unknown: list[str] = []
    subsets = {"hang": [0, 0, 0, 0], "divergence": [0, 0, 0, 0]}   # n, status ok, type ok, culprit ok (of scored)

    def tally(metric: str, ok: bool, cid: str, want: object, got: object) -> None:
        metrics[metric][1] += 1
        if ok:
            metrics[metric][0] += 1
        else:
            misses[metric].append((cid, str(want), str(got)))

    for lab in labels:
        cid = lab["id"]
        rep = reports.get(cid, {"error": "not run"})
        st = norm_status(rep)
        want_status = lab["status"]
        tally("status", st == want_status, cid, want_status, rep.get("error") or st)
        if want_status == "failed" and st == "healthy":
            crash_healthy.append(cid)
        if want_status == "healthy" and st == "failed":
            healthy_failed.append(cid)
        if st == "unknown":
            unknown.append(cid)
        got_cat = rep.get("category") if st == "failed" else None
        tally("category", got_cat == lab.get("category"), cid, lab.get("category"), got_cat)
        want_types = {lab.get("failure_type")} | set(lab.get("failure_type_alt") or [])
        got_type = rep.get("failure_type") if st == "failed" else None
        type_ok = got_type in want_types
        tally("failure_type", type_ok, cid, "|".join(str(t) for t in want_types), got_type)
        want_action = ACTION_ALIASES.get(lab.get("action"), lab.get("action"))
        got_action = rep.get("action") if st == "failed" else "none"
        tally("action", got_action == want_action, cid, want_action, got_action)
        if lab.get("root_line"):
            got_root = (rep.get("root_cause") or {}).get("text")
            ok = st == "failed" and root_matches(got_root, [lab["root_line"]] + list(lab.get("root_line_alt") or []))
            tally("root_line", ok, cid, f"{lab.get('root_line_no')}: {lab['root_line'][:110]}",
                  f"{(rep.get('root_cause') or {}).get('line_no')}: {(got_root or '')[:110]}")
        hosts, ranks = lab.get("culprit_hosts") or [], lab.get("culprit_ranks") or []
        culprit_ok = None
        if hosts or ranks:
            culprit_ok = st == "failed" and culprit_matches(rep, hosts, ranks)
            c = rep.get("culprits") or {}
            tally("culprit", culprit_ok, cid, lab.get("culprit") or f"{hosts} {ranks}",
                  f"hosts={c.get('hosts')} ranks={c.get('ranks')}")
        kind = "hang" if lab.get("failure_type") in HANGS else "divergence" if lab.get("failure_type") in DIVERGENCE else None
        if kind:
            s = subsets[kind]
            s[0] += 1
            s[1] += st == "failed"
            s[2] += type_ok
            s[3] += bool(culprit_ok)
    return {"set": name, "n": len(labels), "metrics": metrics, "misses": misses, "crash_called_healthy": crash_healthy,
            "healthy_called_failed": healthy_failed, "unknown": unknown, "subsets": subsets,
            "n_healthy": sum(1 for x in labels if x["status"] == "healthy"),
            "n_culprit": sum(1 for x in labels if x.get("culprit_hosts") or x.get("culprit_ranks"))}


def pct(ok: int, n: int) -> str:
    return f"{ok / n:.2f} ({ok}/{n})" if n else "  -  "


def print_report(res: dict, show_misses: bool) -> None:
    m = res["metrics"]
    print(f"\n== {res['set']}: {res['n']} cases ({res['n_healthy']} healthy)")
    for k in ("status", "category", "failure_type", "action", "root_line", "culprit"):
        print(f"  {k:<13} {pct(*m[k])}")
    print(f"  crashes called healthy: {len(res['crash_called_healthy'])} {res['crash_called_healthy']}")
    print(f"  healthy called failed:  {len(res['healthy_called_failed'])} {res['healthy_called_failed']}")
    print(f"  unknown:                {len(res.get('unknown', []))} {res.get('unknown', [])}")
    for kind, (n, st, ty, cu) in res["subsets"].items():
        if n:
            print(f"  {kind:<11} n={n}: reported failed {st}/{n}, type right {ty}/{n}, culprit right {cu}")
    if show_misses:
        for k in ("status", "category", "failure_type", "action", "root_line", "culprit"):
            if res["misses"][k]:
                print(f"  misses {k}:")
                for cid, want, got in res["misses"][k]:
                    print(f"    {cid}  expected {want}")
                    print(f"         got      {got}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sets", nargs="+", type=Path, help="directories with NNN.log + labels.jsonl")
    ap.add_argument("--diagnose", required=False, help="path of the CLI (e.g. .venv/bin/diagnose)")
    ap.add_argument("--args", default="", help='extra CLI arguments, e.g. --args="--no-llm --no-retrieval"')
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per case")
    ap.add_argument("--save", type=Path, help="write the raw per-case reports here (JSON)")
    ap.add_argument("--load", type=Path, help="score reports saved by --save instead of running the CLI")
    ap.add_argument("--json", type=Path, help="write the scores here")
    ap.add_argument("--quiet", action="store_true", help="figures only, no list of misses")
    args = ap.parse_args(argv)
    if not args.load and not args.diagnose:
        ap.error("--diagnose is required unless --load is given")
    saved = json.loads(args.load.read_text()) if args.load else {}
    extra = shlex.split(args.args)
    results, raw = [], {}
    for d in args.sets:
        labels = load_labels(d)
        name = d.name if d.name not in ("", ".") else str(d)
        reports = saved.get(name, {})
        if not args.load:
            for lab in labels:
                log = d / f"{lab['id']}.log"
                reports[lab["id"]] = run_case(shlex.split(args.diagnose), log, extra, args.timeout)
                print(f"  {name}/{lab['id']}: {norm_status(reports[lab['id']])} "
                      f"{reports[lab['id']].get('category')}/{reports[lab['id']].get('failure_type')} "
                      f"({reports[lab['id']].get('seconds')} s)", file=sys.stderr, flush=True)
        raw[name] = reports
        results.append(score_set(name, labels, reports))
    if args.save:
        args.save.write_text(json.dumps(raw, indent=1))
    for res in results:
        print_report(res, not args.quiet)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
