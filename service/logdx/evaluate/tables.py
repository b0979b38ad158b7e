"""The figures of a set, per cascade, and the one-screen summary of all sets."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

from logdx.evaluate.corpus import FIELDS, JOB_FIELDS, CaseResult, calibration, confusion, summarize
from logdx.evaluate.runner import Cascade, JobResult, by_cascade

COLUMNS = ("status", "category", "action", "failure_type", "root_line", "culprit")
_HEAD = {"status": "status", "category": "category", "action": "action", "failure_type": "failure type",
         "root_line": "root line", "culprit": "culprit", "culprit_rank": "culprit rank", "culprit_host": "culprit host",
         "step": "div. step", "timeout_class": "timeout class",
         "degradation": "degradation"}


def set_figures(results: list[JobResult], cascades: list[Cascade]) -> dict[str, dict[str, Any]]:
    """Per cascade: accuracy per field, confusion (without and with the exit code), calibration."""
    out: dict[str, dict[str, Any]] = {}
    for c in cascades:
        views = by_cascade(results, c.name)
        if not views:
            continue
        exit_views = by_cascade(results, c.name, exit_known=True)
        out[c.name] = {"accuracy": summarize(views, FIELDS + JOB_FIELDS), "confusion": confusion(views),
                       "confusion_exit_known": confusion(exit_views) if exit_views else None,
                       "calibration": calibration(views)}
    return out


def regressions(all_figures: dict[str, dict[str, dict[str, Any]]], base: str = "rules",
                against: str = "default") -> list[str]:
    """Where the `against` cascade got fewer right than `base` (the same logs): "set column: 180/195 < 184/195".
    The learned stages must earn their place: the default cascade is never worse than rules alone."""
    out = []
    for set_name, figures in all_figures.items():
        if base not in figures or against not in figures:
            continue
        for col in COLUMNS:
            a, b = figures[base]["accuracy"][col], figures[against]["accuracy"][col]
            if b["n"] and b["correct"] < a["correct"]:
                out.append(f"{set_name} {col}: {against} {b['correct']}/{b['n']} < {base} {a['correct']}/{a['n']}")
    return out


def _cell(row: dict[str, float | int]) -> str:
    if not row["n"]:
        return "-"
    if row["n"] < 20:
        return f"{row['correct']}/{row['n']}"
    return f"{row['accuracy']:.3f}"


def table_lines(title: str, figures: dict[str, dict[str, Any]], extra: tuple[str, ...] = ()) -> list[str]:
    """A markdown table: one row per cascade, the same columns for every set (plus ``extra`` fields)."""
    cols = COLUMNS + extra
    head = (["cascade"] + [_HEAD[c] for c in cols] + ["crashes called healthy", "healthy called failed", "unknown",
                                                     "with exit code: crashes called healthy / healthy called failed"])
    out = [title, "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, fig in figures.items():
        acc, conf, ex = fig["accuracy"], fig["confusion"], fig["confusion_exit_known"]
        cells = [name] + [_cell(acc[c]) for c in cols] + _confusion_cells(conf, ex)
        out.append("| " + " | ".join(cells) + " |")
    return out


def _confusion_cells(conf: dict[str, int], ex: dict[str, int] | None) -> list[str]:
    """Crashes called healthy, healthy runs called failed, reports that said ``unknown`` (neither, and a
    status miss), and the first two again when the exit code is known."""
    return [f"{conf['crashes_called_healthy']}/{conf['crashes']}", f"{conf['healthy_called_failed']}/{conf['healthy']}",
            _unknown_cell(conf),
            f"{ex['crashes_called_healthy']}/{ex['crashes']} / {ex['healthy_called_failed']}/{ex['healthy']}" if ex else "-"]


def _unknown_cell(conf: dict[str, int]) -> str:
    if not conf["unknown"]:
        return f"0/{conf['runs']}"
    parts = [f"{conf[k]} {what}" for k, what in (("crashes_unknown", "crashes"), ("healthy_unknown", "healthy")) if conf[k]]
    return f"{conf['unknown']}/{conf['runs']} ({', '.join(parts)})"


def breakdown_lines(results: list[JobResult], cascade: str, key: Callable[[JobResult], str],
                    fields: tuple[str, ...]) -> list[str]:
    """One line per group (``key``): the fields that were scored in it."""
    groups: dict[str, list[CaseResult]] = defaultdict(list)
    for r in results:
        if cascade in r.reports:
            groups[key(r)].append(r.view(cascade))
    out = []
    for name, views in sorted(groups.items()):
        acc = summarize(views, fields)
        conf = confusion(views)
        parts = [f"{_HEAD[f]} {acc[f]['correct']}/{acc[f]['n']}" for f in fields if acc[f]["n"]]
        if conf["crashes"]:
            parts.append(f"called healthy {conf['crashes_called_healthy']}/{conf['crashes']}")
        if conf["healthy"]:
            parts.append(f"called failed {conf['healthy_called_failed']}/{conf['healthy']}")
        if conf["unknown"]:
            parts.append(f"unknown {conf['unknown']}/{conf['runs']}")
        out.append(f"    {name} ({len(views)}): " + ", ".join(parts))
    return out


def calibration_lines(figures: dict[str, dict[str, Any]], cascade: str) -> list[str]:
    rows = figures.get(cascade, {}).get("calibration") or []
    return ["  calibration of " + cascade + " (right = status, category, failure type, action): " + ", ".join(
        f"{r['band']} {r['right']}/{r['n']}" for r in rows if r["n"])]


def summary_lines(all_figures: dict[str, dict[str, dict[str, Any]]], sizes: dict[str, str]) -> list[str]:
    """Every set and cascade in one table, the hang and divergence figures after it."""
    head = ["set", "cascade", *[_HEAD[c] for c in COLUMNS], "crashes → healthy", "healthy → failed", "unknown",
            "exit known: crash→healthy / healthy→failed"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for set_name, figures in all_figures.items():
        for cascade, fig in figures.items():
            acc, conf, ex = fig["accuracy"], fig["confusion"], fig["confusion_exit_known"]
            cells = [f"{set_name} ({sizes.get(set_name, '')})", cascade, *[_cell(acc[c]) for c in COLUMNS],
                     *_confusion_cells(conf, ex)]
            out.append("| " + " | ".join(cells) + " |")
    for set_name, fields in (("hangs", ("culprit_rank", "culprit_host")), ("divergence", ("step",))):
        for cascade, fig in all_figures.get(set_name, {}).items():
            acc = fig["accuracy"]
            parts = [f"{_HEAD[f]} {acc[f]['correct']}/{acc[f]['n']}" for f in fields if acc[f]["n"]]
            if set_name == "divergence":
                conf = fig["confusion"]
                parts.append(f"recovering spikes called failed {conf['healthy_called_failed']}/{conf['healthy']}")
            out.append(f"{set_name} ({cascade}): " + ", ".join(parts))
    if "excerpts" in all_figures and "buried" in all_figures:
        for cascade in all_figures["buried"]:
            if cascade not in all_figures["excerpts"]:
                continue
            a, b = all_figures["excerpts"][cascade]["accuracy"], all_figures["buried"][cascade]["accuracy"]
            deltas = ", ".join(f"{_HEAD[f]} {b[f]['accuracy'] - a[f]['accuracy']:+.3f}"
                               for f in ("category", "action", "failure_type", "root_line"))
            out.append(f"buried minus excerpts ({cascade}): {deltas}")
    return out
