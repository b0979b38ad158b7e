"""Session cookies for the job pages: a browser cannot send a bearer token by itself, so a person
exchanges theirs once (`/login`) for a cookie that names the token, signed, for a few hours.

The cookie holds the token's name, an expiry and an HMAC over both and the token's digest, keyed
by a random secret kept in the database (every worker and replica shares it; the token itself is
never in the cookie, a URL or a log). A changed or removed token invalidates its cookies. It is
`HttpOnly` and `SameSite=Strict`, and the request guard refuses other origins: a foreign page can
neither read it nor ride on it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import time

from logdx.api.auth import Authenticator, Principal
from logdx.api.errors import ApiError
from logdx.store import Store, migrate

COOKIE = "logdx_session"
LIFETIME_S = 12 * 3600

def _unauthorized(message: str) -> ApiError:
    return ApiError(401, "unauthorized", message, headers={"WWW-Authenticate": 'Bearer realm="logdx"'})


MIGRATIONS = ["CREATE TABLE web_secret (id INTEGER PRIMARY KEY, secret TEXT NOT NULL);"]


class SessionCookies:
    def __init__(self, db: Store, auth: Authenticator) -> None:
        migrate(db, "web_secret", MIGRATIONS, postgres=MIGRATIONS)
        db.execute("INSERT INTO web_secret(id, secret) VALUES (1, ?) ON CONFLICT DO NOTHING", (secrets.token_hex(32),))
        self._key = bytes.fromhex(str(db.query_value("SELECT secret FROM web_secret WHERE id = 1")))
        self.auth = auth

    def issue(self, principal: Principal, now: float | None = None) -> str:
        """The cookie value for a caller who just presented their token."""
        known = self.auth.named(principal.name)
        assert known is not None, "only a configured token's caller gets a cookie"
        expires = int((time.time() if now is None else now) + LIFETIME_S)
        name = base64.urlsafe_b64encode(principal.name.encode()).decode().rstrip("=")
        return f"v1.{name}.{expires}.{self._sign(name, expires, known[0])}"

    def principal(self, value: str, now: float | None = None) -> Principal:
        """The caller a cookie names; 401 when it is malformed, forged, expired or its token gone."""
        parts = value.split(".")
        if len(parts) != 4 or parts[0] != "v1" or not parts[2].isdigit():
            raise _unauthorized("invalid session cookie: sign in again")
        _, name, expires_s, mac = parts
        try:
            token_name = base64.urlsafe_b64decode(name + "=" * (-len(name) % 4)).decode()
        except (binascii.Error, UnicodeDecodeError):
            raise _unauthorized("invalid session cookie: sign in again") from None
        known = self.auth.named(token_name)
        expected = self._sign(name, int(expires_s), known[0] if known else b"")
        if known is None or not hmac.compare_digest(expected, mac):
            raise _unauthorized("invalid session cookie: sign in again")
        if int(expires_s) < (time.time() if now is None else now):
            raise _unauthorized("the session expired: sign in again")
        return known[1]

    def _sign(self, name: str, expires: int, digest: bytes) -> str:
        return hmac.new(self._key, f"{name}.{expires}.{digest.hex()}".encode(), hashlib.sha256).hexdigest()


def identify(auth: Authenticator, cookies: SessionCookies | None, authorization: str | None,
             cookie: str | None) -> Principal:
    """The caller: by its bearer token, else by its session cookie (when tokens are configured)."""
    if authorization or not auth.required or not cookie or cookies is None:
        return auth.identify(authorization)
    return cookies.principal(cookie)
