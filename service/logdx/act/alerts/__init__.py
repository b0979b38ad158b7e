"""Alerts: tell people (Slack) and systems (signed JSON webhooks) that a job failed, and why.

Alerts leave through a persisted outbox (`outbox.py`), so that a diagnosis made just before a crash
or a restart is still delivered, and delivered once. Each kind of destination is one module behind
the `Destination` protocol (`base.py`), registered in `DESTINATIONS` (`destinations.py`), which the
settings' lists (`alerts.slack`, `alerts.webhooks`) are built from. Destinations come only from the
settings, never from a request.

This package is imported by `logdx.config` (through `DESTINATIONS`): it stays light, and the outbox
(HTTP client, store) is imported from `logdx.act.alerts.outbox` by those who deliver.
"""

from __future__ import annotations

from logdx.act.alerts.base import Alert, Destination, DestinationClass, report_url
from logdx.act.alerts.destinations import DESTINATIONS, destinations
from logdx.act.alerts.slack import SlackDestination, SlackSettings, slack_payload
from logdx.act.alerts.webhook import WebhookDestination, WebhookSettings, sign, verify, webhook_payload

__all__ = [
    "DESTINATIONS",
    "Alert",
    "Destination",
    "DestinationClass",
    "SlackDestination",
    "SlackSettings",
    "WebhookDestination",
    "WebhookSettings",
    "destinations",
    "report_url",
    "sign",
    "slack_payload",
    "verify",
    "webhook_payload",
]
