"""The kinds of alert destination (`DESTINATIONS`: one line per kind, nothing else lists them) and the
destinations the settings configure, whatever their kind.

`logdx.config` builds the lists `alerts.<config_key>` from `DESTINATIONS`, so this module never imports
the configuration at run time (it would be an import cycle).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from logdx.act.alerts.base import Destination, DestinationClass
from logdx.act.alerts.slack import SlackDestination
from logdx.act.alerts.webhook import WebhookDestination

if TYPE_CHECKING:
    from logdx.config import AlertsSettings

DESTINATIONS: tuple[DestinationClass, ...] = (SlackDestination, WebhookDestination)


def destinations(settings: AlertsSettings) -> list[Destination]:
    """Every configured destination, kind by kind, each list in its configured order."""
    return [kind(item, i) for kind in DESTINATIONS for i, item in enumerate(settings.destination_settings(kind))]
