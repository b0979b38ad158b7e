"""Slack incoming webhooks: a Block Kit message (job, category, failure type, culprit, the recommended
action and what logdx actually did, root line, link to the report), or a short "resolved" follow-up."""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field

from logdx.act.alerts.base import Alert, clip, dest_key, redact_origin
from logdx.act.render import cost_sentence, recommended_action, unverified_mark
from logdx.act.report import Report
from logdx.model import FT, Category
from logdx.settings_base import Section


def _esc(text: str) -> str:
    """Slack mrkdwn escaping (the only three characters Slack wants escaped)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def culprit_text(report: Report) -> str:
    c = report.culprits
    parts = []
    if c.hosts:
        parts.append(", ".join(c.hosts[:8]) + (f" (+{len(c.hosts) - 8})" if len(c.hosts) > 8 else "")
                     + unverified_mark(report))
    if c.ranks:
        parts.append("rank " + ", ".join(str(r) for r in c.ranks[:8]) + (" …" if len(c.ranks) > 8 else ""))
    if c.gpus:
        parts.append("GPU " + ", ".join(c.gpus[:4]))
    return "; ".join(parts)


def slack_payload(alert: Alert, report_url: str | None) -> dict:
    """A Block Kit message: what failed, where, what is recommended and what was done, the root line."""
    if alert.resolved:
        return _resolved_payload(alert, report_url)
    if alert.advice:
        return _advice_payload(alert)
    job_id, report = alert.job_id, alert.report
    if report.status == "healthy":
        headline = f"logdx: job {job_id}: no failure found"
    elif report.status == "unknown":
        headline = f"logdx: job {job_id}: no failure found, and nothing shows it went well"
    else:
        headline = f"logdx: job {job_id} failed: {report.category or Category.UNKNOWN} / {report.failure_type or FT.UNKNOWN}"
    culprit = culprit_text(report) or "unknown"
    action = recommended_action(report)
    done = "; ".join(alert.done) or "nothing"
    fields = [
        ("Job", f"`{_esc(clip(job_id, 200))}`"),
        ("Category", _esc(report.category or "-")),
        ("Failure type", f"`{_esc(report.failure_type or '-')}`"),
        ("Culprit", _esc(clip(culprit, 500))),
        ("Recommended", f"*{_esc(action)}*"),
        ("Confidence", f"{report.confidence:.2f}"),
    ]
    blocks: list[dict[str, Any]] = [
        {"type": "header", "text": {"type": "plain_text", "text": clip(headline, 150), "emoji": False}},
        {"type": "section", "fields": [{"type": "mrkdwn", "text": f"*{k}*\n{v}"} for k, v in fields]},
        {"type": "section", "text": {"type": "mrkdwn", "text": f"*Done*\n{_esc(clip(done, 2000))}"}},
    ]
    if report.root_cause is not None:
        rc = report.root_cause
        code = clip(rc.text, 1500).replace("```", "'''")
        blocks.append({
            "type": "section",
            "text": {"type": "mrkdwn", "text": f"*Root line* (line {rc.line_no})\n```{_esc(code)}```"},
        })
    if report.explanation:
        blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": _esc(clip(report.explanation, 2000))}})
    cost = cost_sentence(report)
    if cost:
        blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": "*Cost* " + _esc(clip(cost[:1].upper() + cost[1:], 1000))}})
    context = []
    if report.hint:
        context.append({"type": "mrkdwn", "text": f"*Next:* {_esc(clip(report.hint, 1500))}"})
    if alert.page_url:
        context.append({"type": "mrkdwn", "text": f"<{alert.page_url}|Open the job page>"})
    if report_url:
        context.append({"type": "mrkdwn", "text": f"<{report_url}|Open the full report>"})
    if context:
        blocks.append({"type": "context", "elements": context})
    fallback = f"{headline} on {culprit}: {action}; done: {done}" if report.status == "failed" else headline
    return {"text": clip(fallback, 300), "blocks": blocks}


def _resolved_payload(alert: Alert, report_url: str | None) -> dict:
    report = alert.report
    headline = f"logdx: resolved: job {alert.job_id} ({report.category or Category.UNKNOWN} / {report.failure_type or FT.UNKNOWN})"
    blocks: list[dict[str, Any]] = [
        {"type": "header", "text": {"type": "plain_text", "text": clip(headline, 150), "emoji": False}},
        {"type": "section", "text": {"type": "mrkdwn", "text": _esc(clip(alert.resolved, 2000))}},
    ]
    links = [f"<{url}|{name}>" for url, name in ((alert.page_url, "The job page"), (report_url, "The report")) if url]
    if links:
        blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": " · ".join(links)}]})
    return {"text": clip(f"{headline}: {alert.resolved}", 300), "blocks": blocks}


def _advice_payload(alert: Alert) -> dict:
    """What a running job's start-up says will slow it: one line per degradation, no action."""
    headline = f"logdx: advice for job {alert.job_id}: its start-up shows what will slow it (no action taken)"
    lines = [f"*{_esc(g.kind)}* on `{_esc(g.host)}` (line {g.line_no}): {_esc(clip(g.effect, 400))}"
             for g in alert.report.degradations]
    blocks: list[dict[str, Any]] = [
        {"type": "header", "text": {"type": "plain_text", "text": clip(headline, 150), "emoji": False}},
        {"type": "section", "text": {"type": "mrkdwn", "text": clip("\n".join(lines), 2900)}},
    ]
    if alert.page_url:
        blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": f"<{alert.page_url}|The job page>"}]})
    return {"text": clip(f"{headline}: " + "; ".join(f"{g.kind} on {g.host}" for g in alert.report.degradations), 300),
            "blocks": blocks}


class SlackSettings(Section):
    """Slack incoming webhooks, one item per channel: `[{webhook_url: "https://hooks.slack.com/services/..."}]`."""

    webhook_url: str = Field(description="the incoming webhook's URL (a credential: never stored, never logged)")


class SlackDestination:
    kind = "slack"
    config_key = "slack"
    Settings = SlackSettings

    def __init__(self, settings: SlackSettings, index: int = 0) -> None:
        self.url = settings.webhook_url
        self.key = dest_key(self.kind, self.url)
        self.label = f"slack[{index}] {redact_origin(self.url)}"

    def body(self, alert: Alert, report_url: str | None, now: float) -> bytes:
        return json.dumps(slack_payload(alert, report_url), separators=(",", ":"), ensure_ascii=False).encode()

    def headers(self, msg_id: str, body: bytes) -> dict[str, str]:
        return {"content-type": "application/json"}
