"""Node names: what may be blamed, cordoned or excluded.

A host name reaches logdx from log text (a prefix, a Slurm message), from a shipper's metadata or an
HTTP header. Any of those can be written by a training script, so a name is only ever a plain host
name (RFC 1123 labels, bounded length): never a Slurm range (`gpu[001-512]`), a list, a glob, `ALL`
or anything with spaces or shell characters, which an actuator might expand into many nodes.
"""

from __future__ import annotations

import re

__all__ = ["MAX_HOSTNAME", "clean_hostname", "is_valid_hostname"]

MAX_HOSTNAME = 253
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
# Words a scheduler or a cluster tool reads as "many nodes" (scontrol's ALL), never a node.
_RESERVED = frozenset({"all", "none", "localhost"})


def is_valid_hostname(name: str) -> bool:
    """A single plain host name: letters, digits, hyphens and dots, each label 1-63 characters."""
    return (
        0 < len(name) <= MAX_HOSTNAME
        and _HOSTNAME.fullmatch(name) is not None
        and name.lower() not in _RESERVED
        and not name.replace(".", "").isdigit()  # a bare number is a rank or an id, not a host
    )


def clean_hostname(value: object) -> str | None:
    """The host name in `value` when it is one valid name (surrounding blanks and a trailing dot
    of a fully-qualified name are dropped), else None."""
    if not isinstance(value, str):
        return None
    name = value.strip().rstrip(".")
    return name if is_valid_hostname(name) else None
