"""The report for people: what an on-call engineer reads at 3 a.m., most important first."""

from __future__ import annotations

from collections.abc import Callable

from logdx.act.report import Report
from logdx.diagnose.culprit import UNVERIFIED
from logdx.model import FT, Action, Category
from logdx.taxonomy import advice_of

_RESET = "\x1b[0m"
_STYLES = {
    "bold": "\x1b[1m",
    "dim": "\x1b[2m",
    "red": "\x1b[31m",
    "green": "\x1b[32m",
    "yellow": "\x1b[33m",
    "cyan": "\x1b[36m",
}
_ACTION_TONES = {
    Action.CORDON_AND_RESTART: "red",
    Action.RESTART: "yellow",
    Action.NO_RESTART: "yellow",
    Action.NONE: "green",
}
_MAX_TEXT = 240


def action_words(report: Report) -> tuple[str, str]:
    """What the report recommends, its verb in capitals for the terminal, and its colour."""
    advice = _advice(report)
    # Capitals for what to do: up to a colon, else the first word ("RESUBMIT from ...").
    head, sep, rest = advice.partition(":") if ":" in advice else advice.partition(" ")
    return head.upper() + sep + rest, _ACTION_TONES[report.action]


def recommended_action(report: Report) -> str:
    """What the report recommends, as a sentence (alerts); says the same as `action_words`."""
    advice = _advice(report)
    return advice[:1].upper() + advice[1:]


def cost_sentence(report: Report) -> str:
    """What the failure cost, as a sentence (alerts, the terminal); '' when the report has no cost."""
    c = report.cost
    if report.status != "failed" or c is None:
        return ""
    if c.lost_gpu_hours is None:
        why = c.notes[0] if c.notes else "the log does not say"
        return f"what this failure cost is unknown: {why}"
    since = {"checkpoint": f"since the checkpoint at step {c.checkpoint_step}",
             "attempt_start": "since this attempt began" + (f" (from the checkpoint at step {c.checkpoint_step})"
                                                            if c.checkpoint_step is not None else ""),
             "job_start": "since the job's first line (no checkpoint line before the failure)"}.get(c.since, "")
    gpus = f" on {c.gpus} GPUs" if c.gpus else ""
    out = f"this failure cost ~{_hours(c.lost_gpu_hours)} GPU-hours{gpus} {since}".rstrip()
    if c.stood_still_s is not None:
        out += f"; the job stood still {_duration(c.stood_still_s)} before its next attempt"
    if c.back_after_s is not None and c.failure_step is not None:
        out += f", back at step {c.failure_step:g} after {_duration(c.back_after_s)}"
    earlier = sum(w.lost_gpu_hours or 0.0 for w in c.earlier_attempts)
    if earlier:
        n = len(c.earlier_attempts)
        out += f" (the {n} earlier attempt{'s' if n != 1 else ''} in this log lost ~{_hours(earlier)} more)"
    return out


def _hours(h: float) -> str:
    return f"{h:,.0f}" if h >= 10 else f"{h:.1f}" if h >= 0.1 else f"{h:.2f}"


def _duration(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    return f"{s / 60:.0f} min" if s >= 60 else f"{s:.0f} s"


def _advice(report: Report) -> str:
    return advice_of(report.action, report.failure_type if report.status == "failed" else None)


def render_text(report: Report, color: bool = False) -> str:
    def paint(text: str, *styles: str) -> str:
        if not color:
            return text
        return "".join(_STYLES[s] for s in styles) + text + _RESET

    lines: list[str] = []
    if report.status == "empty":
        lines.append(paint("EMPTY", "bold", "yellow") + "  no log lines to diagnose")
    elif report.status == "healthy":
        lines.append(paint("HEALTHY", "bold", "green") + f"  no failure found (confidence {report.confidence:.2f})")
    elif report.status == "unknown":
        lines.append(paint("UNKNOWN", "bold", "yellow") + "  no failure found, and nothing shows the job went well")
        if report.explanation:
            lines.append(f"{'why':>10}  {report.explanation}")
        if report.hint:
            lines.append(f"{'next':>10}  {report.hint}")
    else:
        head = f"{report.category or Category.UNKNOWN} / {report.failure_type or FT.UNKNOWN}"
        lines.append(paint("FAILED", "bold", "red") + "  " + paint(head, "bold") + f"  (confidence {report.confidence:.2f})")
        words, tone = action_words(report)
        lines.append(f"{'action':>10}  " + paint(words, "bold", tone))
        culprit = _culprit_text(report)
        if culprit:
            lines.append(f"{'culprit':>10}  " + paint(culprit, "bold"))
        if report.root_cause:
            rc = report.root_cause
            lines.append(f"{'root line':>10}  " + paint(f"{rc.line_no}:", "cyan") + " " + _clip(rc.text))
        if report.explanation:
            lines.append(f"{'why':>10}  {report.explanation}")
        if report.hint:
            lines.append(f"{'next':>10}  {report.hint}")
        cost = cost_sentence(report)
        if cost:
            lines.append(f"{'cost':>10}  {cost}")
    progress = _progress_text(report)
    if progress:
        lines.append(f"{'progress':>10}  {progress}")
    if report.recovered:
        first = report.recovered[0]
        more = f" (+{len(report.recovered) - 1} more)" if len(report.recovered) > 1 else ""
        lines.append(f"{'recovered':>10}  " + paint(f"the job went on after {first.line_no}: {_clip(first.text)}{more}", "dim"))
    lines += _hypotheses_text(report)
    if report.evidence:
        lines.append("")
        lines.append(paint("evidence", "bold"))
        for e in report.evidence:
            where = f"{e.line_no}:" if e.line_no is not None else "-"
            lines.append(f"  {paint(where, 'cyan')} {_clip(e.text)}  " + paint(f"[{e.source}]", "dim"))
    for g in report.degradations:
        lines.append(paint("slow: ", "yellow") + f"{g.host or 'line'} {'(line ' if g.host else ''}{g.line_no}"
                     f"{')' if g.host else ''}: {g.effect}")
    lines += _stragglers_text(report, paint)
    for note in report.notes:
        lines.append(paint(f"note: {note}", "dim"))
    c = report.compression
    ratio = c.lines_in / max(1, c.lines_kept)
    t = report.timings_ms
    lines.append("")
    lines.append(
        paint(
            f"{c.lines_in:,} lines -> {c.templates:,} templates, {c.lines_kept:,} kept ({ratio:,.0f}x)"
            f" | read {t.get('read', 0):,.0f} ms, compress {t.get('compress', 0):,.0f} ms,"
            f" diagnose {t.get('diagnose', 0):,.0f} ms | report {report.id}",
            "dim",
        )
    )
    return "\n".join(lines) + "\n"


def _hypotheses_text(report: Report) -> list[str]:
    if not report.hypotheses:
        return []
    head = ", ".join(f"{h.failure_type} ({h.p:.2f})" for h in report.hypotheses)
    return [f"{'unsure':>10}  {head}: to tell them apart",
            *(f"{'':>10}  - {h.failure_type}: {_clip(h.check)}" for h in report.hypotheses)]


def _progress_text(report: Report) -> str:
    p = report.progress
    if p is None:
        return ""
    parts = []
    if p.last_step is not None:
        parts.append(f"step {p.last_step:g} reached on {p.ranks} rank{'s' if p.ranks != 1 else ''}")
    if p.stopped is not None:
        parts.append(f"stopped advancing after line {p.stopped.line_no}")
    if p.first_stopped is not None:
        who = ", ".join(f"rank {r}" for r in p.first_stopped.ranks[:4])
        where = f" ({', '.join(p.first_stopped.hosts[:4])})" if p.first_stopped.hosts else ""
        at = f" at step {p.first_stopped.step:g}" if p.first_stopped.step is not None else ""
        parts.append(f"{who}{where} stopped first{at}")
    if p.divergence is not None:
        d = p.divergence
        since = f" since step {d.step:g}" if d.step is not None else ""
        back = f"; roll back to step {d.rollback_to_step}" if d.rollback_to_step is not None else ""
        parts.append(f"loss diverged ({d.kind}){since}{back}")
    return "; ".join(parts)


def unverified_mark(report: Report) -> str:
    """What follows a culprit host only a claim named: it will not be cordoned (`culprits.verified`)."""
    return "" if report.culprits.verified else f" ({UNVERIFIED}: not cordoned)"


def _culprit_text(report: Report) -> str:
    c = report.culprits
    parts = []
    if c.hosts:
        parts.append("host " + ", ".join(c.hosts[:6]) + unverified_mark(report))
    if c.ranks:
        ranks = ", ".join(map(str, c.ranks[:12])) + (f" (+{len(c.ranks) - 12})" if len(c.ranks) > 12 else "")
        parts.append("rank " + ranks)
    if c.gpus:
        parts.append("GPU " + ", ".join(c.gpus[:6]))
    return "  ".join(parts)


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_TEXT else text[: _MAX_TEXT - 1] + "…"


def _stragglers_text(report: Report, paint: Callable[..., str]) -> list[str]:
    """A `slow:` line per straggler host, with its ranks and since when, then its first kernel lines."""
    lines = []
    for s in report.stragglers:
        since = f" since step {s.since_step:.0f}" if s.since_step is not None else ""
        ranks = f" (ranks {_ranks(s.ranks)})" if s.ranks else ""
        lines.append(paint("slow: ", "yellow") + f"{s.host}{ranks}{since}: {s.effect}")
        lines += [f"  {paint(f'{e.line_no}:', 'cyan')} {_clip(e.text)}" for e in s.evidence[:3]]
    return lines


def _ranks(ranks: list[int]) -> str:
    """"0-7, 12" for a host's ranks (a host of 8 GPUs is one range)."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)
