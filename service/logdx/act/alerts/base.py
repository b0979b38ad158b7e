"""What an alert destination is. A new kind (PagerDuty, Teams...) is one module beside `slack.py` that
implements `Destination` and declares its `kind`, its `config_key` (the list `alerts.<config_key>`) and its
`Settings` (one item of that list), and one line in `DESTINATIONS` (`destinations.py`): `logdx.config`
builds the `alerts` section from there. The outbox (`outbox.py`) queues, retries and dedupes for every
kind alike."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote, urlsplit

from logdx.act.report import Report
from logdx.settings_base import Section


@dataclass(frozen=True, slots=True)
class Alert:
    """What one message says: a job's diagnosis, what logdx recommends and what it actually did
    (executed, dry run, refused by which limit); or, with `resolved`, that the failure is over."""

    job_id: str
    report: Report
    done: tuple[str, ...] = ()  # what logdx did about it, one sentence each
    resolved: str = ""  # a follow-up: why the failure is over (the job succeeded, the node is back)
    page_url: str = ""  # the job's page (`GET /jobs/{id}`), with server.public_url set
    advice: bool = False  # advice, no action: what the running job's start-up says will slow it (report.degradations)

    @property
    def kind(self) -> str:
        return "resolved" if self.resolved else "advice" if self.advice else "diagnosis"


class Destination(Protocol):
    """Where alerts about one diagnosis go. Only the settings name destinations, never a request."""

    kind: str  # "slack", "webhook"...: the outbox's `kind` column and the metrics label
    url: str  # a credential for some kinds (Slack): never stored, looked up in the settings at send time
    key: str  # a stable fingerprint of kind and URL (see `dest_key`): what the outbox stores
    label: str  # recognisable and redacted, for humans

    def body(self, alert: Alert, report_url: str | None, now: float) -> bytes:
        """The request body, built once when the alert is queued."""
        ...

    def headers(self, msg_id: str, body: bytes) -> dict[str, str]:
        """Headers of one delivery attempt (`msg_id` is stable across retries)."""
        ...


class DestinationClass(Protocol):
    """What `DESTINATIONS` holds: a kind of destination, which names itself and its settings."""

    kind: str  # the outbox's `kind` column and the metrics label
    config_key: str  # the list `alerts.<config_key>` that configures destinations of this kind

    @property
    def Settings(self) -> type[Section]:  # a class: the fields of one item of that list
        ...

    def __call__(self, settings: Any, index: int) -> Destination:
        """The destination one item (an instance of `Settings`, the `index`-th of its list) configures."""
        ...


def dest_key(kind: str, url: str) -> str:
    return hashlib.sha256(f"{kind}\n{url}".encode()).hexdigest()[:16]


def redact_origin(url: str) -> str:
    """Enough of a URL to recognise it, without its credentials (path tokens, query, user info)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or ''}{':' + str(parts.port) if parts.port else ''}"


def report_url(public_url: str, report: Report) -> str | None:
    return f"{public_url.rstrip('/')}/v1/reports/{report.id}" if public_url else None


def job_page_url(public_url: str, job_id: str) -> str:
    return f"{public_url.rstrip('/')}/jobs/{quote(job_id, safe='')}" if public_url else ""


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
