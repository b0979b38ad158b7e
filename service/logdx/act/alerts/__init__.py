"""Alerts: tell people (Slack) and systems (signed JSON webhooks) that a job failed, and why.

Alerts leave through a persisted outbox (`outbox.py`), so that a diagnosis made just before a crash
or a restart is still delivered, and delivered once. Each kind of destination is one module behind
the `Destination` protocol (`base.py`); `destinations.py` lists the configured ones. Destinations
come only from the settings (`alerts.slack`, `alerts.webhooks`), never from a request.
"""

from __future__ import annotations

from logdx.act.alerts.base import Alert, Destination, report_url
from logdx.act.alerts.destinations import destinations
from logdx.act.alerts.outbox import Outbox, OutboxWorker, dedupe_key
from logdx.act.alerts.slack import SlackDestination, slack_payload
from logdx.act.alerts.webhook import WebhookDestination, sign, verify, webhook_payload

__all__ = [
    "Alert",
    "Destination",
    "Outbox",
    "OutboxWorker",
    "SlackDestination",
    "WebhookDestination",
    "dedupe_key",
    "destinations",
    "report_url",
    "sign",
    "slack_payload",
    "verify",
    "webhook_payload",
]
