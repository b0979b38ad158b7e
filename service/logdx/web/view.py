"""What the job page shows, built once from a diagnosed session's compressed state.

The page of a job of millions of lines must come back in well under a second, and the log is not
kept: so the view is made of what the streaming core already holds (the report with its per-rank
progress, the detected events, the Drain templates), bounded in size, at diagnosis time. The service
stores it beside the report (`logdx.web.store`); the CLI renders it into one file.

Lanes: one per host, its ranks under it (a rank's host from its progress, its lines, or the ranks the
launcher printed per host). An event sits on its rank's row, else on its host's. Its role is one of
`root` (the root line's event), `recovered` (the job went on after it), `cascade` (what followed the
root: watchdog timeouts, aborts, launcher summaries) or `event` (anything before the root).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field

from logdx.act.report import Report

if TYPE_CHECKING:
    from logdx.model import Event, Record, TemplateStats
    from logdx.pipeline import Session

VIEW_VERSION = 1
MAX_EVENTS = 1500  # markers on the timeline: the root, the recovered, then the earliest others
MAX_TEMPLATES = 400  # error-bearing templates first, then the most frequent
MAX_CONTEXT = 40  # lines around the root on its own rank and host
MAX_TEXT = 400
_NO_HOST = ""

Role = Literal["root", "cascade", "recovered", "event"]


class RankRow(BaseModel):
    rank: int | None
    first_line: int | None = None  # its progress lines, when it printed any
    last_line: int | None = None
    first_step: float | None = None
    last_step: float | None = None
    last_ts: float | None = None
    stopped_first: bool = Field(False, description="among the ranks whose progress ended before the others'")
    culprit: bool = False


class HostLane(BaseModel):
    host: str = Field(description="'' for lines that named no host")
    culprit: bool = False
    ranks: list[RankRow] = Field(default_factory=list)
    progress: RankRow | None = Field(None, description="the progress of the host's lines that named no rank (a "
                                     "per-host file, a single process): its row has rank None")


class ViewEvent(BaseModel):
    line_no: int
    kind: str
    role: Role
    rank: int | None = None
    host: str | None = None
    text: str
    rule: str = Field("", description="the rule that names it, when one does")


class ContextLine(BaseModel):
    line_no: int
    text: str
    rank: int | None = None
    host: str | None = None
    root: bool = False


class TemplateRow(BaseModel):
    id: int
    template: str
    count: int
    rank_count: int
    host_count: int
    first_line: int
    last_line: int
    error_bearing: bool


class JobView(BaseModel):
    """Everything the page draws that comes from the log (what was done comes from the service)."""

    version: int = VIEW_VERSION
    job_id: str
    created_at: float
    report: Report
    lines: int
    lanes: list[HostLane]
    events: list[ViewEvent]
    events_total: int
    context: list[ContextLine]
    templates: list[TemplateRow]
    templates_total: int


def build_view(job_id: str, report: Report, session: Session, *, now: float | None = None) -> JobView:
    """The view of a diagnosed session (its report is `report`); cost bounded by the caps above."""
    summary = session.summary()
    events = _view_events(session, report)
    templates = session.templates()
    return JobView(
        job_id=job_id,
        created_at=time.time() if now is None else now,
        report=report,
        lines=max(1, summary.lines_in),
        lanes=_lanes(report, summary.rank_hosts, events),
        events=events[:MAX_EVENTS],
        events_total=len(session.events),
        context=_context(session.events, report),
        templates=_template_rows(templates),
        templates_total=len(templates),
    )


# -- events ---------------------------------------------------------------------------------------


def _view_events(session: Session, report: Report) -> list[ViewEvent]:
    """The events worth a marker, most telling first (root, recovered, then by line), at most
    MAX_EVENTS of them; rules are asked only about those."""
    root_line = report.root_cause.line_no if report.root_cause else None
    recovered = {r.line_no for r in report.recovered}
    ordered = sorted((ev for ev in session.events if ev.anchor.line_no > 0), key=lambda ev: ev.anchor.line_no)

    def rank_of(ev: Event) -> int:
        if _holds_line(ev, root_line):
            return 0
        return 1 if ev.anchor.line_no in recovered else 2

    chosen = sorted(ordered, key=rank_of)[:MAX_EVENTS]
    out: list[ViewEvent] = []
    for ev in sorted(chosen, key=lambda e: e.anchor.line_no):
        role = _role(ev, root_line, recovered)
        if role == "root" and any(e.role == "root" for e in out):
            continue  # two events read from the root line (a NaN's loss line and its rule's line): one marker
        hits = session.engine.rules.match(ev)
        out.append(ViewEvent(line_no=ev.anchor.line_no, kind=ev.kind, role=role, rank=ev.anchor.rank,
                             host=ev.anchor.host, text=_clip(ev.anchor.raw), rule=hits[0].rule_id if hits else ""))
    return out


def _holds_line(ev: Event, line_no: int | None) -> bool:
    if line_no is None:
        return False
    return ev.anchor.line_no == line_no or any(r.line_no == line_no for r in ev.lines)


def _role(ev: Event, root_line: int | None, recovered: set[int]) -> Role:
    if _holds_line(ev, root_line):
        return "root"
    if ev.anchor.line_no in recovered:
        return "recovered"
    if root_line is not None and ev.anchor.line_no > root_line:
        return "cascade"
    return "event"


# -- lanes ----------------------------------------------------------------------------------------


def _lanes(report: Report, rank_hosts: dict[int, str], events: list[ViewEvent]) -> list[HostLane]:
    """One lane per host, culprits first, then by name; a rank's row holds its progress."""
    rows: dict[int | None, RankRow] = {}
    host_of: dict[int, str] = dict(rank_hosts)
    stopped = report.progress.first_stopped if report.progress else None
    first = set(stopped.ranks) if stopped else set()
    first_hosts = {h.lower() for h in stopped.hosts} if stopped and not stopped.ranks else set()
    culprit_ranks = set(report.culprits.ranks)
    hosts: set[str] = set()
    host_progress: dict[str, RankRow] = {}
    for s in report.progress.per_source if report.progress else []:
        if s.rank is None:
            # A source that named no rank is its host's (a per-host file, a single process): the host's own row.
            host = s.host or _NO_HOST
            hosts.add(host)
            host_progress[host] = RankRow(rank=None, first_line=s.first_line, last_line=s.last_line,
                                          first_step=s.first_step, last_step=s.last_step, last_ts=s.last_ts,
                                          stopped_first=host.lower() in first_hosts)
            continue
        if s.host:
            host_of.setdefault(s.rank, s.host)
        rows[s.rank] = RankRow(rank=s.rank, first_line=s.first_line, last_line=s.last_line, first_step=s.first_step,
                               last_step=s.last_step, last_ts=s.last_ts, stopped_first=s.rank in first)
    for ev in events:
        if ev.rank is not None:
            if ev.host:
                host_of.setdefault(ev.rank, ev.host)
            rows.setdefault(ev.rank, RankRow(rank=ev.rank))
        else:
            hosts.add(ev.host or _NO_HOST)
    rank: int | None
    for rank in host_of:
        rows.setdefault(rank, RankRow(rank=rank))
    lanes: dict[str, HostLane] = {h: HostLane(host=h, progress=host_progress.get(h)) for h in hosts}
    for rank, row in sorted(rows.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
        row.culprit = rank in culprit_ranks
        host = host_of.get(rank, _NO_HOST) if rank is not None else _NO_HOST
        lanes.setdefault(host, HostLane(host=host)).ranks.append(row)
    culprit_hosts = {h.lower() for h in report.culprits.hosts}
    for lane in lanes.values():
        lane.culprit = lane.host.lower() in culprit_hosts or any(r.culprit for r in lane.ranks)
    return sorted(lanes.values(), key=lambda lane: (not lane.culprit, lane.host == _NO_HOST, lane.host))


# -- the root in context ----------------------------------------------------------------------------


def _context(events: Iterable[Event], report: Report) -> list[ContextLine]:
    """The kept lines nearest the root line that its own rank (else its host) wrote: the root
    event's lines, and the events before and after it there."""
    rc = report.root_cause
    if rc is None:
        return []
    # A host's own line (a kernel Xid) names no rank: the culprit rank, when one, is its process.
    ranks = report.culprits.ranks
    rank = rc.rank if rc.rank is not None else ranks[0] if len(ranks) == 1 else None
    near: dict[int, Record] = {}
    rec: Record | None
    for ev in events:
        for rec in ev.lines or [ev.anchor]:
            if rec.line_no > 0 and _same_source(rec, rank, rc.host):
                near[rec.line_no] = rec
    lines = sorted(near)
    if rc.line_no not in near:
        lines = sorted([*lines, rc.line_no])
    at = lines.index(rc.line_no)
    window = lines[max(0, at - MAX_CONTEXT // 2): at + MAX_CONTEXT // 2]
    out = []
    for n in window:
        rec = near.get(n)
        if rec is None:
            out.append(ContextLine(line_no=n, text=_clip(rc.text), rank=rc.rank, host=rc.host, root=True))
        else:
            out.append(ContextLine(line_no=n, text=_clip(rec.raw), rank=rec.rank, host=rec.host, root=n == rc.line_no))
    return out


def _same_source(rec: Record, rank: int | None, host: str | None) -> bool:
    """Written by the root's rank, or by its host outside any rank (the host's own lines)."""
    if rank is None and host is None:
        return True  # a log without ranks or hosts: every line is the root's own process
    if rank is not None and rec.rank == rank:
        return True
    return host is not None and rec.host == host and (rec.rank is None or rank is None)


# -- templates ------------------------------------------------------------------------------------


def _template_rows(templates: list[TemplateStats]) -> list[TemplateRow]:
    chosen = sorted(templates, key=lambda t: (not t.error_bearing, -t.count))[:MAX_TEMPLATES]
    return [TemplateRow(id=t.template_id, template=_clip(t.template), count=t.count, rank_count=len(t.ranks),
                        host_count=len(t.hosts), first_line=t.first_line, last_line=t.last_line,
                        error_bearing=t.error_bearing)
            for t in sorted(chosen, key=lambda t: -t.count)]


def _clip(text: str, limit: int = MAX_TEXT) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def view_from_report(job_id: str, report: Report, templates: dict[str, Any], *, now: float | None = None) -> JobView:
    """A poorer view when no session made one (a job diagnosed before its page existed): the report's
    progress, root, recovered events and evidence, and the stored templates (`templates` as
    `GET /v1/jobs/{id}/templates` answers)."""
    root = report.root_cause
    events = [ViewEvent(line_no=r.line_no, kind=r.kind, role="recovered", rank=r.rank, host=r.host, text=_clip(r.text),
                        rule=r.source) for r in report.recovered]
    if root is not None:
        events.append(ViewEvent(line_no=root.line_no, kind="root", role="root", rank=root.rank, host=root.host,
                                text=_clip(root.text)))
    events.sort(key=lambda e: e.line_no)
    last_lines = [s.last_line for s in report.progress.per_source] if report.progress else []
    lines = max([report.compression.lines_in, *last_lines, *(e.line_no for e in events), 1])
    rows = [TemplateRow(id=t["id"], template=_clip(t["template"]), count=t["count"], rank_count=t["rank_count"],
                        host_count=t["host_count"], first_line=t["first_line"], last_line=t["last_line"],
                        error_bearing=t["error_bearing"]) for t in templates.get("templates", [])[:MAX_TEMPLATES]]
    context = [ContextLine(line_no=root.line_no, text=_clip(root.text), rank=root.rank, host=root.host, root=True)] \
        if root is not None else []
    return JobView(job_id=job_id, created_at=time.time() if now is None else now, report=report, lines=lines,
                   lanes=_lanes(report, {}, events), events=events, events_total=len(events), context=context,
                   templates=rows, templates_total=int(templates.get("total", len(rows))))
