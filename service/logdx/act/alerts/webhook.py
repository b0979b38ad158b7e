"""Generic JSON webhooks signed per the Standard Webhooks specification
(https://www.standardwebhooks.com): headers `webhook-id` (stable across retries: the receiver's
idempotency key), `webhook-timestamp` (the attempt's time, unix seconds) and
`webhook-signature: v1,<base64 HMAC-SHA256>` of `"{webhook-id}.{webhook-timestamp}.{body}"`, keyed
by the secret `whsec_<base64 key>` (checked when the settings load: `WebhookSettings`).

Signatures are made by the specification's own library (`standardwebhooks`), so they are what every
official verifier computes. `verify()` is the receiver's side, for tests and for users' own
receivers, with a tolerance of its own."""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from urllib.parse import urlsplit

from pydantic import Field, field_validator
from standardwebhooks import Webhook
from standardwebhooks.webhooks import EmptyWebhookSecretError

from logdx.act.alerts.base import Alert, dest_key, redact_origin
from logdx.act.render import cost_sentence, recommended_action
from logdx.settings_base import Section

EVENT_TYPE = "logdx.diagnosis"
RESOLVED_TYPE = "logdx.resolved"
ADVICE_TYPE = "logdx.advice"
SECRET_PREFIX = "whsec_"
SECRET_MIN_BYTES = 24  # the Standard Webhooks specification's minimum key size


class WebhookSettings(Section):
    """Generic JSON webhooks signed per Standard Webhooks: `[{url: "https://...", secret: "whsec_..."}]`."""

    url: str = Field(description="where the JSON is POSTed")
    secret: str = Field(
        "", description="Standard Webhooks signing secret: whsec_ and the base64 of 24 to 64 random bytes "
        "(whsec_$(openssl rand -base64 32)); empty: deliveries are not signed")

    @field_validator("secret")
    @classmethod
    def _standard_webhooks_secret(cls, v: str) -> str:
        """Refused at load: a secret every official verifier would read differently from us (they
        all take `whsec_<base64>`) means every delivery is rejected, silently, at 3 a.m."""
        v = v.strip()
        if not v:
            return v
        how = "write it as whsec_ followed by base64, e.g. whsec_$(openssl rand -base64 32)"
        if not v.startswith(SECRET_PREFIX):
            raise ValueError(f"a Standard Webhooks secret starts with {SECRET_PREFIX}: {how}")
        raw = v[len(SECRET_PREFIX):]
        try:
            key = base64.b64decode(raw + "=" * (-len(raw) % 4), validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"the part after {SECRET_PREFIX} is not base64: {how}") from None
        if len(key) < SECRET_MIN_BYTES:
            raise ValueError(f"the key is {len(key)} bytes; Standard Webhooks keys are at least "
                             f"{SECRET_MIN_BYTES} random bytes: {how}")
        return v


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` header value: `v1,<base64 HMAC-SHA256 of "{id}.{ts}.{body}">`.
    `body` is UTF-8 (the JSON logdx sends)."""
    when = datetime.fromtimestamp(int(timestamp), tz=UTC)
    return Webhook(secret).sign(msg_id, when, body.decode("utf-8"))


def verify(secret: str, headers: Mapping[str, str], body: bytes, tolerance_s: int = 300) -> bool:
    """True when `headers` carry a valid, fresh Standard Webhooks signature of `body`.

    Headers are matched case-insensitively; the signature header may list several space-separated
    signatures (key rotation): one valid `v1` signature is enough. Stale or future timestamps
    (beyond `tolerance_s`) are rejected, which is what stops replays."""
    h = {k.lower(): v for k, v in headers.items()}
    msg_id, ts, sigs = h.get("webhook-id"), h.get("webhook-timestamp"), h.get("webhook-signature")
    if not (msg_id and ts and sigs):
        return False
    try:
        timestamp = int(ts)
    except ValueError:
        return False
    if abs(time.time() - timestamp) > tolerance_s:
        return False
    try:
        expected = sign(secret, msg_id, timestamp, body).split(",", 1)[1].encode()
    except (ValueError, UnicodeDecodeError, EmptyWebhookSecretError):
        return False
    for versioned in sigs.split(" "):
        version, _, sig = versioned.partition(",")
        if version == "v1" and hmac.compare_digest(sig.encode(), expected):
            return True
    return False


def webhook_payload(alert: Alert, report_url: str | None, now: float | None = None) -> dict:
    """The generic webhook body (Standard Webhooks' `type`/`timestamp`/`data` shape): the report, the
    recommended action and what was done; or (`logdx.resolved`) why the failure is over; or (`logdx.advice`) the
    degradations a running job's start-up shows."""
    ts = datetime.fromtimestamp(time.time() if now is None else now, tz=UTC)
    if alert.advice:  # what a running job's start-up says will slow it: advice, no action
        advice = {"job_id": alert.job_id, "page_url": alert.page_url or None, "recommended": "none (advice)",
                  "degradations": [g.model_dump(mode="json") for g in alert.report.degradations]}
        return {"type": ADVICE_TYPE, "timestamp": ts.isoformat().replace("+00:00", "Z"), "data": advice}
    data = {"job_id": alert.job_id, "report_url": report_url, "page_url": alert.page_url or None, "recommended": recommended_action(alert.report),
            "cost": cost_sentence(alert.report) or None, "done": list(alert.done), "report": alert.report.model_dump(mode="json")}
    if alert.resolved:
        data["resolved"] = alert.resolved
    return {
        "type": RESOLVED_TYPE if alert.resolved else EVENT_TYPE,
        "timestamp": ts.isoformat().replace("+00:00", "Z"),
        "data": data,
    }


class WebhookDestination:
    kind = "webhook"
    config_key = "webhooks"
    Settings = WebhookSettings

    def __init__(self, settings: WebhookSettings, index: int = 0) -> None:
        self.url = settings.url
        self.secret = settings.secret
        self.key = dest_key(self.kind, self.url)
        self.label = f"webhook[{index}] {redact_origin(self.url)}{urlsplit(self.url).path}"

    def body(self, alert: Alert, report_url: str | None, now: float) -> bytes:
        payload = webhook_payload(alert, report_url, now)
        return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()

    def headers(self, msg_id: str, body: bytes) -> dict[str, str]:
        ts = int(time.time())  # the attempt's time, for the receiver's replay check
        headers = {"content-type": "application/json", "webhook-id": msg_id, "webhook-timestamp": str(ts)}
        if self.secret:
            headers["webhook-signature"] = sign(self.secret, msg_id, ts, body)
        return headers
