"""Who is calling, and what they may do: named tokens with roles, and jobs bound to tenants.

Roles (`server.tokens`, each `{name, role, sha256, tenant}`; the token itself is never stored, only
its SHA-256, and a presented token is hashed and compared with every configured digest in constant
time):

| role       | may                                                                                   |
|------------|---------------------------------------------------------------------------------------|
| `shipper`  | upload logs (every upload endpoint, `/end`, the one-shot diagnosis); read its jobs     |
| `reader`   | read: jobs, templates, reports, incidents, nodes, actions, metrics, the API docs       |
| `operator` | everything: also reset the breaker, uncordon, add or delete incidents, give feedback   |

`server.token` (one shared token, the older setting) is an operator named `server.token`. Without
any token (loopback only), callers may upload and read, and the operator endpoints need an explicit
`server.local_operator: true`.

Audits record who acted as the token's name, never a name the caller supplies.

Tenants: a shipper token with a `tenant` writes only into jobs of that tenant. A job it creates is
bound to its tenant; a job bound to another tenant, or created without one, is refused (403
`tenant_mismatch`), as is reading such a job. Tokens without a tenant are cluster-wide.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass

from logdx.api.errors import ApiError
from logdx.config import ServerSettings
from logdx.store import Store, migrate

SHIPPER, READER, OPERATOR, LOCAL = "shipper", "reader", "operator", "local"
INGEST = frozenset({SHIPPER, OPERATOR, LOCAL})
READ = frozenset({READER, OPERATOR, LOCAL})
JOB_READ = READ | {SHIPPER}  # a shipper reads its own jobs (tenant-checked)
OPERATE = frozenset({OPERATOR})  # LOCAL too, with server.local_operator
ANY = frozenset({SHIPPER, READER, OPERATOR, LOCAL})

MIGRATIONS = [
    """
    CREATE TABLE job_tenants (
        job_id     TEXT PRIMARY KEY,
        tenant     TEXT NOT NULL,
        created_at REAL NOT NULL
    );
    """,
]
PG_MIGRATIONS = [
    """
    CREATE TABLE job_tenants (
        job_id     TEXT PRIMARY KEY,
        tenant     TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL
    );
    """,
]


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller: a configured token's name, role and tenant; or the unauthenticated local caller."""

    name: str
    role: str
    tenant: str = ""

    @property
    def authenticated(self) -> bool:
        return self.role != LOCAL


def token_digest(token: str) -> str:
    """What `server.tokens[].sha256` holds: `printf %s "$TOKEN" | sha256sum`."""
    return hashlib.sha256(token.encode()).hexdigest()


class Authenticator:
    def __init__(self, server: ServerSettings) -> None:
        self.local_operator = server.local_operator
        self._known: list[tuple[bytes, Principal]] = [
            (bytes.fromhex(t.sha256), Principal(t.name, t.role, t.tenant)) for t in server.tokens]
        if server.token:
            self._known.append((hashlib.sha256(server.token.encode()).digest(), Principal("server.token", OPERATOR)))

    @property
    def required(self) -> bool:
        """Whether callers must present a token (any is configured)."""
        return bool(self._known)

    def identify(self, authorization: str | None) -> Principal:
        """The caller behind an `Authorization` header; 401 when a token is required and this one is
        missing or unknown."""
        if not self._known:
            return Principal("local", LOCAL)
        token = _bearer(authorization)
        if token is None:
            raise _unauthorized("missing bearer token" if not authorization else "invalid bearer token")
        digest = hashlib.sha256(token.encode()).digest()
        found: Principal | None = None
        for known, principal in self._known:  # every digest compared, whichever matches: constant time
            if hmac.compare_digest(digest, known) and found is None:
                found = principal
        if found is None:
            raise _unauthorized("invalid bearer token")
        return found

    def named(self, name: str) -> tuple[bytes, Principal] | None:
        """The configured token called `name`: its digest and principal (what a session cookie names)."""
        return next(((digest, p) for digest, p in self._known if p.name == name), None)

    def check(self, principal: Principal, allowed: frozenset[str], what: str) -> None:
        """403 unless the principal's role may do `what`."""
        if principal.role in allowed:
            return
        if principal.role == LOCAL and allowed is OPERATE:
            if self.local_operator:
                return
            raise ApiError(403, "operator_disabled",
                           f"{what} is an operator's action: configure server.tokens (role operator) and send that "
                           "token, or, on a loopback-only server without tokens, set server.local_operator: true")
        raise ApiError(403, "forbidden", f"token {principal.name!r} (role {principal.role}) may not {what}")


def _bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, credentials = header.partition(" ")
    if scheme.lower() != "bearer" or not credentials.strip():
        return None
    return credentials.strip()


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, "unauthorized", message, headers={"WWW-Authenticate": 'Bearer realm="logdx"'})


def audit_name(principal: Principal, stated: str) -> tuple[str, str]:
    """(who, note) for an audit row: the token's name is who acted; a name the caller states is kept
    as a note, marked as stated. Without tokens the caller is only `local`, with what it states."""
    stated = stated.strip()
    if principal.authenticated:
        return principal.name, (f"on behalf of {stated!r}, as stated" if stated and stated != principal.name else "")
    return f"local:{stated or 'anonymous'}", "unauthenticated (no tokens configured)"


class Tenants:
    """Which tenant each job belongs to (only jobs created by a tenant's shipper have one)."""

    def __init__(self, db: Store) -> None:
        self.db = db
        migrate(db, "tenants", MIGRATIONS, postgres=PG_MIGRATIONS)

    def of(self, job_id: str) -> str | None:
        value = self.db.query_value("SELECT tenant FROM job_tenants WHERE job_id = ?", (job_id,))
        return None if value is None else str(value)

    def bind(self, job_id: str, tenant: str) -> None:
        """A job just created by `tenant`'s shipper (a row left by a deleted job of that name goes)."""
        self.db.execute("INSERT INTO job_tenants(job_id, tenant, created_at) VALUES (?,?,?) ON CONFLICT(job_id)"
                        " DO UPDATE SET tenant = excluded.tenant, created_at = excluded.created_at",
                        (job_id, tenant, time.time()))

    def check(self, principal: Principal, job_id: str, *, created: bool = False) -> None:
        """403 when a tenant's token touches a job that is not its tenant's; a job it just created is
        bound to its tenant here. Tokens without a tenant may touch every job."""
        if not principal.tenant:
            return
        if created:
            self.bind(job_id, principal.tenant)
            return
        if self.of(job_id) != principal.tenant:
            raise ApiError(403, "tenant_mismatch",
                           f"job {job_id} does not belong to tenant {principal.tenant!r} (token {principal.name!r})")
