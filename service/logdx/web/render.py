"""HTML from a `JobView`: the job page (served, or one self-contained file), the job list, the login.

Everything the page needs is in this package (`templates/`, `static/`): nothing is fetched from
anywhere but the server that sent the page, and the single file (`inline=True`) carries its scripts
and styles inside, so that it opens from disk. The verdict, the timeline and the root line are
server-rendered HTML: they read without JavaScript; the curves (uPlot) and the search need it.
"""

from __future__ import annotations

import json
import math
import re
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup
from pydantic import BaseModel, Field

from logdx.act.render import cost_sentence, recommended_action
from logdx.act.report import Report
from logdx.model import Action, Category
from logdx.taxonomy import taxonomy
from logdx.web.view import JobView, RankRow, ViewEvent

STATIC_DIR = Path(__file__).with_name("static")
TEMPLATES_DIR = Path(__file__).with_name("templates")
STATIC_PREFIX = "/static"
# What the job page loads, in order; inlined as is into the single file.
PAGE_STYLES = ("vendor/uplot/uPlot.min.css", "page.css")
PAGE_SCRIPTS = ("vendor/uplot/uPlot.iife.min.js", "job.js")


class AlertRow(BaseModel):
    kind: str
    destination: str
    status: str
    attempts: int = 0
    last_error: str | None = None


class ActionRow(BaseModel):
    ts: float
    node: str | None = None
    action: str
    actuator: str
    dry_run: bool
    outcome: str
    detail: str = ""


class NodeHistory(BaseModel):
    node: str
    state: str
    events: int
    jobs: list[str] = Field(default_factory=list)
    failure_types: dict[str, int] = Field(default_factory=dict)


class Done(BaseModel):
    """What logdx did about the job: known to the service only (a file report says so)."""

    served: bool = Field(description="False in a report written by the CLI: nothing was sent or done")
    dry_run: bool | None = None
    alerts: list[AlertRow] = Field(default_factory=list)
    actions: list[ActionRow] = Field(default_factory=list)
    breaker: dict[str, Any] | None = None
    nodes: list[NodeHistory] = Field(default_factory=list)


class Viewer(BaseModel):
    """Who looks at a served page, for what it offers them (never a credential)."""

    name: str = ""
    can_feedback: bool = False
    signed_in: bool = False  # by the session cookie: offer to sign out


@cache
def _env() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES_DIR), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["when"] = _when
    env.filters["num"] = _num
    return env


@cache
def _static_text(name: str) -> str:
    return (STATIC_DIR / name).read_text(encoding="utf-8")


def render_job_body(view: JobView) -> str:
    """The part of the page drawn from the log (verdict, timeline, curves, root in context, evidence,
    templates): the same for every reader, so the service renders it once per diagnosis."""
    report = view.report
    return _env().get_template("job_body.html.j2").render(
        view=view, report=report, recommended=recommended_action(report), cost=cost_sentence(report),
        stood=_duration_words,
        corroboration=corroboration_words(view),
        lanes=_lane_rows(view), axis=_axis(view), cascade=_cascade_summary(view.events), zoom=_zoom(view),
        sources=sorted({e.source.split(":", 1)[0] for e in report.evidence}),
        data=Markup(_json_for_script(_curves(view))),
    )


def render_job_page(view: JobView, done: Done, viewer: Viewer | None = None, *, inline: bool = False) -> str:
    """The job page; `inline`: one file with every script and style inside (the CLI's `--html`)."""
    return render_page(view.job_id, view.report, render_job_body(view), done, viewer, inline=inline)


def render_page(job_id: str, report: Report, body: str, done: Done, viewer: Viewer | None = None, *,
                inline: bool = False) -> str:
    """The job page around its log part (`body`, from `render_job_body`): what was done, feedback."""
    return _env().get_template("job.html.j2").render(
        job_id=job_id, report=report, done=done, viewer=viewer or Viewer(), inline=inline,
        assets=_assets(inline), title=f"logdx: {job_id}", recommended=recommended_action(report),
        body=Markup(body), failure_types={c.value: list(ts) for c, ts in taxonomy().by_category().items()},
    )


def render_jobs_page(jobs: list[dict[str, Any]], filters: dict[str, str], options: dict[str, list[str]],
                     viewer: Viewer) -> str:
    return _env().get_template("jobs.html.j2").render(
        jobs=jobs, filters=filters, options=options, viewer=viewer, inline=False, assets=_assets(False),
        title="logdx: jobs")


def render_login_page(next_path: str, error: str = "") -> str:
    return _env().get_template("login.html.j2").render(
        next_path=next_path, error=error, inline=False, assets=_assets(False), title="logdx: sign in",
        viewer=Viewer())


def _assets(inline: bool) -> dict[str, Any]:
    if inline:
        return {"styles": [Markup(_static_text(n).replace("</style", "<\\/style")) for n in PAGE_STYLES],
                "scripts": [Markup(_static_text(n).replace("</script", "<\\/script")) for n in PAGE_SCRIPTS]}
    return {"style_urls": [f"{STATIC_PREFIX}/{n}" for n in PAGE_STYLES],
            "script_urls": [f"{STATIC_PREFIX}/{n}" for n in PAGE_SCRIPTS]}


def _json_for_script(data: Any) -> str:
    """JSON safe inside a <script type="application/json"> element (no `</`, no `<!--`)."""
    return json.dumps(data, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c")


# -- words ----------------------------------------------------------------------------------------


def corroboration_words(view: JobView) -> str:
    """What a cordon of the blamed node would rest on, in plain words; "" where no node is blamed (a
    script's error, an unnamed host, nothing failed): the culprit list says the rest."""
    report = view.report
    c = report.culprits
    blames_a_node = report.status == "failed" and bool(c.hosts) and (
        report.category == Category.INFRASTRUCTURE or report.action == Action.CORDON_AND_RESTART)
    if not blames_a_node:
        return ""
    hosts = ", ".join(c.hosts)
    rests = f"the blame on {hosts} rests on {_plain(c.basis)}" if c.basis else f"{hosts} is blamed"
    if c.corroborated:
        return f"Corroborated: {rests}, and a second signal agrees: the host printed the fault itself, or its rank " \
               "stopped."
    rests = f"the blame on {hosts} rests on one signal only, {_plain(c.basis)}" if c.basis else \
        f"one signal only blames {hosts}"
    return f"Not corroborated: {rests}. logdx will not cordon on one signal alone."


def _plain(basis: str) -> str:
    """A culprit basis without its asides in brackets ("its own host (prefix or stream)" reads
    "its own host, prefix or stream"), for a sentence that has none."""
    return re.sub(r"\s*\(([^()]*)\)", r", \1", basis).strip()


def _cascade_summary(events: list[ViewEvent]) -> dict[str, int]:
    cascade = [e for e in events if e.role == "cascade"]
    return {"events": len(cascade), "ranks": len({e.rank for e in cascade if e.rank is not None}),
            "hosts": len({e.host for e in cascade if e.host})}


# -- the timeline -----------------------------------------------------------------------------------


def _pos(view: JobView, line_no: int | None) -> float:
    """Where a line sits across the job, in percent of its lines."""
    if line_no is None:
        return 0.0
    return round(min(100.0, max(0.0, 100.0 * (line_no - 1) / max(1, view.lines - 1))), 3)


def _lane_rows(view: JobView) -> list[dict[str, Any]]:
    """Each host's lane: a row per rank (its progress, where it stopped, its events), and a row for
    the lines of the host that named no rank."""
    by_rank: dict[int, list[ViewEvent]] = {}
    by_host: dict[str, list[ViewEvent]] = {}
    for ev in view.events:
        if ev.rank is not None:
            by_rank.setdefault(ev.rank, []).append(ev)
        else:
            by_host.setdefault(ev.host or "", []).append(ev)
    lanes = []
    for lane in view.lanes:
        rows = [_rank_row(r, by_rank.get(r.rank, []) if r.rank is not None else [], view) for r in lane.ranks]
        host_events = by_host.get(lane.host, [])
        host_row = _rank_row(lane.progress or RankRow(rank=None), host_events, view) \
            if host_events or lane.progress else None
        lanes.append({"host": lane.host, "culprit": lane.culprit, "rows": rows, "host_row": host_row,
                      "root": any(r["root"] for r in [*rows, *([host_row] if host_row else [])])})
    return lanes


def _rank_row(row: RankRow, events: list[ViewEvent], view: JobView) -> dict[str, Any]:
    stopped_early = row.last_line is not None and view.report.status == "failed"
    bar = None
    if row.first_line is not None and row.last_line is not None:
        left = _pos(view, row.first_line)
        bar = {"left": left, "width": max(0.3, _pos(view, row.last_line) - left), "first": row.first_line,
               "last": row.last_line,
               "title": f"progress: step {_num(row.first_step)} → {_num(row.last_step)}, lines {row.first_line}–"
                        f"{row.last_line}" + (f", last at {_when(row.last_ts)}" if row.last_ts else "")}
    return {"rank": row.rank, "culprit": row.culprit, "stopped_first": row.stopped_first, "bar": bar,
            "stop": {"left": _pos(view, row.last_line), "step": _num(row.last_step), "line": row.last_line}
            if stopped_early else None,
            "events": [_marker(e, view) for e in events], "root": any(e.role == "root" for e in events)}


def _marker(ev: ViewEvent, view: JobView) -> dict[str, Any]:
    return {"left": _pos(view, ev.line_no), "role": ev.role, "line_no": ev.line_no, "kind": ev.kind,
            "title": f"line {ev.line_no} · {ev.role} · {ev.kind}{' · ' + ev.rule if ev.rule else ''}: {ev.text[:200]}"}


def _axis(view: JobView) -> list[dict[str, Any]]:
    return [{"left": p, "label": f"line {max(1, round(1 + (view.lines - 1) * p / 100))}"} for p in (0, 25, 50, 75, 100)]


def _zoom(view: JobView) -> dict[str, int] | None:
    """The lines where the job died (from a little before the first rank stopped, or the root, to the
    end), when they are a small part of the job: the timeline's "zoom to the failure"."""
    rc = view.report.root_cause
    if view.report.status != "failed" or rc is None:
        return None
    stops = [r.last_line for lane in view.lanes for r in lane.ranks if r.last_line is not None]
    start = min([rc.line_no, *stops]) if stops and min(stops) > view.lines // 2 else rc.line_no
    start = max(1, start - max(50, (view.lines - start) // 2))
    return {"start": start, "end": view.lines} if start > view.lines // 10 else None


def _curves(view: JobView) -> dict[str, Any]:
    """What the curves draw (uPlot), read from the page's JSON block."""
    p = view.report.progress
    if p is None:
        return {"loss": [], "step_time": [], "marks": []}
    marks = [{"step": d.step, "kind": d.kind, "recovered": False} for d in [p.divergence]
             if d and d.step is not None and math.isfinite(d.step)]
    marks += [{"step": d.step, "kind": d.kind, "recovered": True} for d in p.recovered_spikes
              if d.step is not None and math.isfinite(d.step)]
    return {"loss": _finite(p.loss), "step_time": _finite(p.step_time_s), "marks": marks}


def _finite(points: list[tuple[float, float]]) -> list[list[float]]:
    """The points a chart can draw: a NaN or infinite loss is the divergence, marked, not a point."""
    return [[x, y] for x, y in points if math.isfinite(x) and math.isfinite(y)]


# -- filters ----------------------------------------------------------------------------------------


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _duration_words(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.0f} min" if s >= 60 else f"{s:.0f} s"


def _num(x: float | int | None) -> str:
    if x is None:
        return "-"
    return f"{x:g}" if isinstance(x, float) else str(x)
