"""Restart hooks: a command (`actions.restart_command`) or a webhook POST (`actions.restart_webhook`).

The command is an argv template run without a shell. A string is split into words the way a shell
would (quotes group words) once, when the template is read; then each placeholder `{job_id}`,
`{tenant}`, `{report_id}`, `{category}`, `{failure_type}`, `{action}`, `{hosts}`, `{node}`, `{confidence}` is
filled inside its word. Whatever a value holds (spaces, quotes, `$(...)`) it stays inside that one
argument: nothing is ever parsed again. A list is taken word for word. To use shell features, call
a script with the values as its arguments (`/usr/local/bin/requeue.sh {job_id} {hosts}`); a
placeholder inside a shell's `-c` script text is refused, since the shell would parse the value.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

import httpx

from logdx import __version__, tenancy
from logdx.act.actuators.base import ActionFailed, RestartHook, node_names
from logdx.act.argv import RESTART_PLACEHOLDERS, TemplateError, fill_argv, parse_template
from logdx.act.report import Report
from logdx.config import ActionsSettings

COMMAND_TIMEOUT_S = 60.0
WEBHOOK_TIMEOUT_S = 30.0

PLACEHOLDERS = RESTART_PLACEHOLDERS
__all__ = ["PLACEHOLDERS", "CommandRestart", "TemplateError", "WebhookRestart", "fill_argv", "fill_command",
           "hook_values", "make_restart_hook", "parse_template", "redact"]


def fill_command(template: str | Sequence[str], values: Mapping[str, str]) -> list[str]:
    """`parse_template` then `fill_argv`: the argv a restart template runs with these values."""
    return fill_argv(parse_template(template, PLACEHOLDERS), values)


def hook_values(job_id: str, report: Report) -> dict[str, str]:
    """What the placeholders stand for; `{hosts}` and `{node}` only ever hold valid node names. A
    tenant's job is given as its shipper named it, `{job_id}`, and its tenant, `{tenant}` (the
    scheduler knows it by that name; `logdx.tenancy`)."""
    hosts = node_names(report.culprits.hosts)[0]
    tenant, name = tenancy.split(job_id) if tenancy.is_job_id(job_id) else ("", job_id)
    return {
        "job_id": name, "tenant": tenant, "report_id": report.id, "category": report.category or "",
        "failure_type": report.failure_type or "", "action": report.action, "hosts": ",".join(hosts),
        "node": hosts[0] if hosts else "", "confidence": f"{report.confidence:.2f}",
    }


class CommandRestart:
    name = "command"

    def __init__(self, template: str | Sequence[str]) -> None:
        self.words = parse_template(template, PLACEHOLDERS)

    def describe(self, values: dict[str, str]) -> str:
        return f"run: {shlex.join(fill_argv(self.words, values))}"

    def trigger(self, job_id: str, values: dict[str, str], report: Report) -> str:
        argv = fill_argv(self.words, values)
        shown = shlex.join(argv)
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False)
        except Exception as e:
            raise ActionFailed(f"{shown}: {type(e).__name__}: {e}") from e
        if proc.returncode != 0:
            raise ActionFailed(f"{shown}: exit {proc.returncode}: {proc.stderr.strip()[:500]}")
        return f"ran: {shown}"


class WebhookRestart:
    name = "webhook"

    def __init__(self, url: str) -> None:
        self.url = url

    def describe(self, values: dict[str, str]) -> str:
        return f"POST {redact(self.url)}"

    def trigger(self, job_id: str, values: dict[str, str], report: Report) -> str:
        body = json.dumps({"type": "logdx.restart", **values,
                           "report": report.model_dump(mode="json")}, separators=(",", ":")).encode()
        where = redact(self.url)
        try:
            resp = httpx.post(self.url, content=body, timeout=WEBHOOK_TIMEOUT_S, follow_redirects=False,
                              headers={"content-type": "application/json", "user-agent": f"logdx/{__version__}"})
        except httpx.HTTPError as e:
            raise ActionFailed(f"POST {where}: {e}") from e
        if not 200 <= resp.status_code < 300:
            raise ActionFailed(f"POST {where}: HTTP {resp.status_code}")
        return f"POST {where}: HTTP {resp.status_code}"


def make_restart_hook(settings: ActionsSettings) -> RestartHook | None:
    """The configured hook (a command wins over a webhook), or None. A template that cannot be
    used safely raises `TemplateError`."""
    if settings.restart_command:
        return CommandRestart(settings.restart_command)
    if settings.restart_webhook:
        return WebhookRestart(settings.restart_webhook)
    return None


def redact(url: str) -> str:
    """A URL without its credentials (user info, query) for the audit."""
    p = urlsplit(url)
    return f"{p.scheme}://{p.hostname or ''}{':' + str(p.port) if p.port else ''}{p.path}"
