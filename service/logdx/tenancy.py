"""Job ids namespaced by tenant: what a job of a tenant is called, inside logdx and out.

A job's id is what its shipper names it (`train-42`), and two tenants may name theirs alike. So a
job written by a token bound to a tenant is stored under its qualified id, `<tenant>:<name>`
(`team-a:train-42`): a name a tenant uses can never be claimed, read or locked by another, and a
name without a tenant (a cluster-wide token's job) can never look like a tenant's, since a plain
job id has no `:`. A tenant's token calls its jobs by their name or by their qualified id; a token
without a tenant calls a tenant's job by its qualified id.

The restart hook gets a job's name and its tenant apart (`{job_id}`, `{tenant}`): the scheduler knows
the job by the name its shipper gave it.
"""

from __future__ import annotations

import re

SEPARATOR = ":"
TENANT = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
JOB_ID_PATTERN = rf"^(?:{TENANT}{SEPARATOR})?{NAME}$"
MAX_JOB_ID = 64 + len(SEPARATOR) + 128

_JOB_ID = re.compile(rf"(?:(?P<tenant>{TENANT}){SEPARATOR})?(?P<name>{NAME})")


def is_job_id(job_id: str) -> bool:
    """A plain name (`train-42`) or a qualified one (`team-a:train-42`)."""
    return _JOB_ID.fullmatch(job_id) is not None


def split(job_id: str) -> tuple[str, str]:
    """(tenant, name) of a valid job id; the tenant is "" for a job without one."""
    m = _JOB_ID.fullmatch(job_id)
    if m is None:
        raise ValueError(f"not a job id: {job_id!r}")
    return m["tenant"] or "", m["name"]


def qualified(tenant: str, name: str) -> str:
    """The stored id of `tenant`'s job `name` (a job without a tenant keeps its name)."""
    return f"{tenant}{SEPARATOR}{name}" if tenant else name
