"""Node names: what may be blamed, cordoned or excluded.

A host name reaches logdx from log text (a prefix, a Slurm message), from a shipper's metadata or an
HTTP header. Any of those can be written by a training script, so a name is only ever a plain host
name (RFC 1123 labels, bounded length): never a Slurm range (`gpu[001-512]`), a list, a glob, `ALL`
or anything with spaces or shell characters, which an actuator might expand into many nodes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["MAX_HOSTNAME", "HostScope", "HostScopeError", "clean_hostname", "is_valid_hostname", "job_host_in_name",
           "without_log_kind"]

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


# What a log file's name says besides its host: the kind of log it holds (dmesg-node11, node11_kern,
# gpu-e04_dmesg, node-03.stdout, stdout-node-03).
_LOG_KINDS = ("dmesg", "kern", "kernel", "kmsg", "syslog", "messages", "journal", "journalctl", "console", "stdout",
              "stderr", "out", "err", "log", "logs", "output", "nvidia-smi", "smi", "xid", "dcgm", "ibstat")
_KIND_PREFIX = re.compile(rf"^(?:{'|'.join(map(re.escape, _LOG_KINDS))})[-_.]+", re.I)
_KIND_SUFFIX = re.compile(rf"[-_.]+(?:{'|'.join(map(re.escape, _LOG_KINDS))})$", re.I)


def without_log_kind(name: str) -> str:
    """A file name (without its extensions) with the words for the kind of log it holds taken off its ends:
    dmesg-node11 -> node11, node11_kern -> node11, gpu-e04_dmesg -> gpu-e04 (what is left may be no host)."""
    for _ in range(3):
        stripped = _KIND_SUFFIX.sub("", _KIND_PREFIX.sub("", name))
        if stripped == name or not stripped:
            break
        name = stripped
    return name


def job_host_in_name(name: str, hosts: Iterable[str]) -> str | None:
    """The one host of `hosts` that `name` (a file or folder name) holds as a whole part of it, bounded by
    the name's ends or by `-`, `_`, `.`, `/`, `=` (node11 in dmesg-node11.txt, not node1 in node11); None
    when none does, or more than one."""
    found = {h for h in hosts if re.search(rf"(?:^|[-_./=]){re.escape(h)}(?:$|[-_./=])", name)}
    return found.pop() if len(found) == 1 else None


# --- which hosts a sender may speak for ------------------------------------------------------------
MAX_SCOPE_HOSTS = 200_000  # names one scope may expand to


class HostScopeError(ValueError):
    """A `hosts` entry that is neither `*` nor a hostlist of plain host names."""


class HostScope:
    """The hosts a sender may speak for: a node-bound credential its own node, a collector the operator
    runs the hosts it collects from, everybody else none. What a sender says of any other host (a header, a
    record field, a prefix in its lines) is a claim: kept and reported, never grounds for touching a node."""

    __slots__ = ("_everywhere", "_names")

    def __init__(self, names: Iterable[str] = (), *, everywhere: bool = False) -> None:
        self._everywhere = everywhere
        self._names = frozenset(names)

    @classmethod
    def everywhere(cls) -> HostScope:
        return cls(everywhere=True)

    @classmethod
    def nowhere(cls) -> HostScope:
        return cls()

    @classmethod
    def parse(cls, entries: Iterable[str]) -> HostScope:
        """`*` (every host), or hostlists (`gpu-node-[001-128]`, `login1,login2`) of plain host names."""
        import hostlist

        names: set[str] = set()
        for entry in entries:
            entry = entry.strip()
            if entry == "*":
                return cls.everywhere()
            try:
                expanded = hostlist.expand_hostlist(entry)
            except hostlist.BadHostlist as e:
                raise HostScopeError(f"{entry!r} is not a hostlist ({e})") from None
            for name in expanded:
                host = clean_hostname(name)
                if host is None:
                    raise HostScopeError(f"{entry!r}: {name!r} is not a plain host name")
                names.add(host)
                if len(names) > MAX_SCOPE_HOSTS:
                    raise HostScopeError(f"more than {MAX_SCOPE_HOSTS} hosts: use '*' for a collector of every host")
        return cls(names)

    @property
    def is_everywhere(self) -> bool:
        return self._everywhere

    @property
    def is_nowhere(self) -> bool:
        return not self._everywhere and not self._names

    def hosts(self) -> list[str]:
        """The hosts it names, sorted (none for `everywhere`)."""
        return sorted(self._names)

    def allows(self, host: str | None) -> bool:
        return host is not None and (self._everywhere or host in self._names)

    def spec(self) -> str:
        """A compact form that `parse` reads back (what a spooled run carries)."""
        import hostlist

        if self._everywhere:
            return "*"
        return hostlist.collect_hostlist(sorted(self._names)) if self._names else ""

    def __repr__(self) -> str:
        return f"HostScope({self.spec()!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HostScope) and (self._everywhere, self._names) == (other._everywhere, other._names)

    def __hash__(self) -> int:
        return hash((self._everywhere, self._names))
