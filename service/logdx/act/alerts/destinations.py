"""The kinds of alert destination (`DESTINATIONS`: one line per kind, nothing else lists them) and the
destinations the settings configure, whatever their kind.

`logdx.config` builds the lists `alerts.<config_key>` from `DESTINATIONS`, so this module never imports
the configuration at run time (it would be an import cycle).
"""

from __future__ import annotations

from typing import Protocol

from logdx.act.alerts.base import Destination, DestinationClass
from logdx.act.alerts.slack import SlackDestination
from logdx.act.alerts.webhook import WebhookDestination
from logdx.settings_base import Section

DESTINATIONS: tuple[DestinationClass, ...] = (SlackDestination, WebhookDestination)


class ConfiguredDestinations(Protocol):
    """What `destinations` reads of the settings (`logdx.config.AlertsSettings`, which imports this registry)."""

    def destination_settings(self, kind: DestinationClass) -> list[Section]: ...


def destinations(settings: ConfiguredDestinations) -> list[Destination]:
    """Every configured destination, kind by kind, each list in its configured order."""
    return [kind(item, i) for kind in DESTINATIONS for i, item in enumerate(settings.destination_settings(kind))]
