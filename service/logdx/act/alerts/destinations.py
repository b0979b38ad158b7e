"""The destinations the settings configure, whatever their kind: add a new kind here."""

from __future__ import annotations

from logdx.act.alerts.base import Destination
from logdx.act.alerts.slack import SlackDestination
from logdx.act.alerts.webhook import WebhookDestination
from logdx.config import AlertsSettings


def destinations(settings: AlertsSettings) -> list[Destination]:
    out: list[Destination] = [SlackDestination(s.webhook_url, i) for i, s in enumerate(settings.slack)]
    out += [WebhookDestination(w.url, w.secret, i) for i, w in enumerate(settings.webhooks)]
    return out
