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

Hosts: each token may speak for some hosts only (`server.tokens[].hosts`: hostlists, or `*` for a collector the
operator runs; a node's own credential, `access/nodecreds.py` and `logdx.credentials`, for its node). What it says of
any other host is a claim: kept, reported as unverified, never a reason to cordon (`Principal.hosts`).

Tenants (`logdx.tenancy`): a token of any role may carry a `tenant`. It then writes and reads only its
tenant's jobs, which are stored as `<tenant>:<name>` (so the same name used by two tenants is two jobs,
and no tenant can claim another's), their reports and its tenant's incidents; another tenant's job or
report is a 404 exactly like a missing one. The cluster-wide views (nodes, actions, metrics, the
cluster) and the cluster-wide actions (uncordon, breaker reset, editing the shared incidents) need a
token without a tenant. Tokens without a tenant are cluster-wide: they name a tenant's job by its
qualified id.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from typing import Any

from logdx import tenancy
from logdx.access.nodecreds import KubernetesNodeTokens
from logdx.config import ServerSettings
from logdx.credentials import PREFIX, host_of_derived
from logdx.hosts import HostScope
from logdx.settings_base import Section
from logdx.store import Store, migrate
from logdx.wire.errors import ApiError

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
    # The hosts it may speak for (`server.tokens[].hosts`): what it says of others is an unverified claim.
    hosts: HostScope = field(default_factory=HostScope.nowhere)

    @property
    def authenticated(self) -> bool:
        return self.role != LOCAL


def token_digest(token: str) -> str:
    """What `server.tokens[].sha256` holds: `printf %s "$TOKEN" | sha256sum`."""
    return hashlib.sha256(token.encode()).hexdigest()


class Authenticator:
    def __init__(self, server: ServerSettings, kubernetes: Section | None = None) -> None:
        self.local_operator = server.local_operator
        self._known: list[tuple[bytes, Principal]] = [
            (bytes.fromhex(t.sha256), Principal(t.name, t.role, t.tenant, HostScope.parse(t.hosts)))
            for t in server.tokens]
        if server.token:
            self._known.append((hashlib.sha256(server.token.encode()).digest(),
                                Principal("server.token", OPERATOR, hosts=HostScope.everywhere())))
        self._node_key = server.node_key
        self._kube_nodes = KubernetesNodeTokens(getattr(kubernetes, "api", ""), getattr(kubernetes, "token", ""),
                                                server.kubernetes_audience) if server.kubernetes_node_tokens else None

    @property
    def required(self) -> bool:
        """Whether callers must present a token (any is configured)."""
        return bool(self._known) or bool(self._node_key) or self._kube_nodes is not None

    def _node(self, token: str) -> Principal | None:
        """A node-bound credential (`access/nodecreds.py`): a shipper that speaks for its node only."""
        host = host_of_derived(self._node_key, token)
        if host is None and self._kube_nodes is not None and not token.startswith(PREFIX):
            host = self._kube_nodes.node_of(token)
        return Principal(f"node:{host}", SHIPPER, hosts=HostScope({host})) if host else None

    def identify(self, authorization: str | None) -> Principal:
        """The caller behind an `Authorization` header; 401 when a token is required and this one is
        missing or unknown."""
        if not self.required:
            return Principal("local", LOCAL, hosts=HostScope.everywhere())  # the operator's own loopback
        token = _bearer(authorization)
        if token is None:
            raise _unauthorized("missing bearer token" if not authorization else "invalid bearer token")
        digest = hashlib.sha256(token.encode()).digest()
        found: Principal | None = None
        for known, principal in self._known:  # every digest compared, whichever matches: constant time
            if hmac.compare_digest(digest, known) and found is None:
                found = principal
        if found is None:
            found = self._node(token)
        if found is None:
            raise _unauthorized("invalid bearer token")
        return found

    def named(self, name: str) -> tuple[bytes, Principal] | None:
        """The configured token called `name`: its digest and principal (what a session cookie names)."""
        return next(((digest, p) for digest, p in self._known if p.name == name), None)

    def check(self, principal: Principal, allowed: frozenset[str], what: str, *, cluster_wide: bool = False) -> None:
        """403 unless the principal's role may do `what`; `cluster_wide`: and it has no tenant (what it
        reads or does concerns every tenant)."""
        if principal.role in allowed:
            if cluster_wide and principal.tenant:
                raise ApiError(403, "forbidden", f"token {principal.name!r} is bound to tenant {principal.tenant!r}: "
                               f"to {what}, which concerns every tenant, use a token without a tenant")
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
    """Which tenant each job and report belongs to, and which stored job a caller's id names.

    A tenant's job carries its tenant in its id (`logdx.tenancy`). Jobs that tenants' shippers created
    before ids were namespaced keep their plain names, bound to their tenant in `job_tenants`, and
    are still found by that tenant's tokens under their names."""

    def __init__(self, db: Store) -> None:
        self.db = db
        migrate(db, "tenants", MIGRATIONS, postgres=PG_MIGRATIONS)
        # No job is bound here any more: without rows now, there never will be (no lookup per request).
        self._legacy = bool(db.query_value("SELECT COUNT(*) FROM job_tenants"))

    def of(self, job_id: str) -> str:
        """The tenant of a job ("" for a cluster-wide one)."""
        tenant, _ = tenancy.split(job_id)
        if tenant or not self._legacy:
            return tenant
        return self._bound(job_id) or ""

    def _bound(self, job_id: str) -> str | None:
        value = self.db.query_value("SELECT tenant FROM job_tenants WHERE job_id = ?", (job_id,))
        return None if value is None else str(value)

    def job_id(self, principal: Principal, given: str, *, write: bool = False) -> str:
        """The stored id of the job `given` names for this caller. A token without a tenant names jobs
        as stored. A tenant's token: a plain name is its tenant's job of that name; its own qualified id
        is that job; another tenant's is refused, for reading as a missing job is (404
        `job_not_found`: which jobs exist elsewhere is no business of it), for writing 403."""
        tenant = principal.tenant
        if not tenant:
            return given
        named, name = tenancy.split(given)
        if named and named != tenant:
            if write:
                raise ApiError(403, "tenant_mismatch",
                               f"job {given} is not of tenant {tenant!r} (token {principal.name!r}): a tenant's "
                               "token names its own jobs")
            raise job_not_found(given)
        stored = tenancy.qualified(tenant, name)
        if not named and self._legacy and self._bound(name) == tenant and not self._exists(stored):
            return name  # created by this tenant before ids were namespaced
        return stored

    def _exists(self, job_id: str) -> bool:
        return self.db.query_value("SELECT 1 FROM api_jobs WHERE job_id = ?", (job_id,)) is not None

    def may_read(self, principal: Principal, job_id: str) -> bool:
        return not principal.tenant or self.of(job_id) == principal.tenant

    def of_report(self, report_id: str) -> str | None:
        """The tenant of a stored report (its job's, or the one-shot caller's); None when there is no
        such report."""
        rows = self.db.query("SELECT r.tenant, j.job_id FROM reports r LEFT JOIN api_job_reports j"
                             " ON j.report_id = r.id WHERE r.id = ?", (report_id,))
        if not rows:
            return None
        tenant, job_id = rows[0]["tenant"], rows[0]["job_id"]
        return tenant or (self.of(job_id) if job_id else "")

    def jobs_of(self, tenant: str) -> tuple[str, list[Any]]:
        """A condition on `api_jobs` (aliased `j`) that keeps the jobs of `tenant`, and its parameters."""
        prefix = tenancy.qualified(tenant, "")
        sql = "substr(j.job_id, 1, ?) = ?"
        params: list[Any] = [len(prefix), prefix]
        if self._legacy:
            sql = f"({sql} OR j.job_id IN (SELECT job_id FROM job_tenants WHERE tenant = ?))"
            params.append(tenant)
        return sql, params


def job_not_found(job_id: str) -> ApiError:
    """The answer for a job that does not exist, or that the caller may not know exists: the same."""
    return ApiError(404, "job_not_found", f"no job {job_id!r}")


def report_not_found(report_id: str) -> ApiError:
    return ApiError(404, "report_not_found", f"no report {report_id!r}")
