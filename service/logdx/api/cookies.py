"""Session cookies for the job pages: a browser cannot send a bearer token by itself, so a person
exchanges theirs once (`/login`) for a cookie that names a session, for a few hours.

A session is a row of the shared database (`web_sessions`: a random id, the token's name, a check tied
to the token's digest, an expiry), so that signing out ends it on every worker and replica at once:
`/logout` deletes the row, and a cookie whose row is gone is refused. The cookie holds only the
session's id and an HMAC over it, keyed by a random secret kept in the database (a forged id is
refused before any lookup); the token itself is never in the cookie, a URL or a log. A changed or
removed token ends its sessions. The cookie is `HttpOnly` and `SameSite=Strict`, and the request guard
refuses other origins: a foreign page can neither read it nor ride on it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

from logdx.access.auth import Authenticator, Principal
from logdx.store import Store, migrate
from logdx.wire.errors import ApiError

COOKIE = "logdx_session"
LIFETIME_S = 12 * 3600
_VERSION = "v2"


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, "unauthorized", message, headers={"WWW-Authenticate": 'Bearer realm="logdx"'})


_SECRET = "CREATE TABLE web_secret (id INTEGER PRIMARY KEY, secret TEXT NOT NULL);"
MIGRATIONS = [_SECRET, """
    CREATE TABLE web_sessions (
        id          TEXT PRIMARY KEY,
        token_name  TEXT NOT NULL,
        token_check TEXT NOT NULL,
        expires_at  REAL NOT NULL
    );
    CREATE INDEX web_sessions_expiry ON web_sessions(expires_at);
"""]
PG_MIGRATIONS = [_SECRET, MIGRATIONS[1].replace("REAL", "DOUBLE PRECISION")]


class SessionCookies:
    def __init__(self, db: Store, auth: Authenticator) -> None:
        migrate(db, "web_secret", MIGRATIONS, postgres=PG_MIGRATIONS)
        db.execute("INSERT INTO web_secret(id, secret) VALUES (1, ?) ON CONFLICT DO NOTHING", (secrets.token_hex(32),))
        self._key = bytes.fromhex(str(db.query_value("SELECT secret FROM web_secret WHERE id = 1")))
        self.db = db
        self.auth = auth

    def issue(self, principal: Principal, now: float | None = None) -> str:
        """A new session for a caller who just presented their token: the cookie's value."""
        known = self.auth.named(principal.name)
        assert known is not None, "only a configured token's caller gets a cookie"
        now = time.time() if now is None else now
        session = secrets.token_hex(16)
        with self.db.transaction() as tx:
            tx.execute("DELETE FROM web_sessions WHERE expires_at < ?", (now,))  # ended ones go as new ones come
            tx.execute("INSERT INTO web_sessions(id, token_name, token_check, expires_at) VALUES (?,?,?,?)",
                       (session, principal.name, self._mac(known[0].hex()), now + LIFETIME_S))
        return f"{_VERSION}.{session}.{self._mac(session)}"

    def principal(self, value: str, now: float | None = None) -> Principal:
        """The caller a cookie's session stands for; 401 when it is malformed, forged, signed out,
        expired or its token changed or gone."""
        session = self._session(value)
        rows = self.db.query("SELECT token_name, token_check, expires_at FROM web_sessions WHERE id = ?", (session,))
        if not rows:
            raise _unauthorized("the session ended (signed out, or unknown): sign in again")
        row = rows[0]
        if row["expires_at"] < (time.time() if now is None else now):
            raise _unauthorized("the session expired: sign in again")
        known = self.auth.named(row["token_name"])
        if known is None or not hmac.compare_digest(self._mac(known[0].hex()), row["token_check"]):
            raise _unauthorized("the session's token changed: sign in again")
        return known[1]

    def revoke(self, value: str) -> bool:
        """Sign out: the cookie's session ends, for every worker and replica. False when there was none."""
        try:
            session = self._session(value)
        except ApiError:
            return False
        return self.db.execute("DELETE FROM web_sessions WHERE id = ?", (session,)).rowcount > 0

    def _session(self, value: str) -> str:
        parts = value.split(".")
        if len(parts) != 3 or parts[0] != _VERSION or not hmac.compare_digest(self._mac(parts[1]), parts[2]):
            raise _unauthorized("invalid session cookie: sign in again")
        return parts[1]

    def _mac(self, text: str) -> str:
        return hmac.new(self._key, text.encode(), hashlib.sha256).hexdigest()


def identify(auth: Authenticator, cookies: SessionCookies | None, authorization: str | None,
             cookie: str | None) -> Principal:
    """The caller: by its bearer token, else by its session cookie (when tokens are configured)."""
    if authorization or not auth.required or not cookie or cookies is None:
        return auth.identify(authorization)
    return cookies.principal(cookie)
