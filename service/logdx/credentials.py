"""Derived node tokens: one secret on the logdx server (`server.node_key`) and, for each node, a token that
speaks for that node only: `logdx-node.<host>.<HMAC-SHA256(node_key, host)>` (`logdx token node HOST`). The
server recomputes the MAC, so it stores nothing per node, and no node's token says anything of another's."""

from __future__ import annotations

import base64
import hashlib
import hmac

from logdx.hosts import clean_hostname

__all__ = ["PREFIX", "derive", "host_of_derived"]

PREFIX = "logdx-node."


def _mac(key: str, host: str) -> str:
    digest = hmac.new(key.encode(), f"logdx-node:{host}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def derive(key: str, host: str) -> str:
    """The token of node `host` under `key` (`server.node_key`)."""
    name = clean_hostname(host)
    if name is None:
        raise ValueError(f"{host!r} is not one plain host name")
    return f"{PREFIX}{name}.{_mac(key, name)}"


def host_of_derived(key: str, token: str) -> str | None:
    """The node a derived token speaks for, when its MAC is right (compared in constant time)."""
    if not key or not token.startswith(PREFIX):
        return None
    host, _, mac = token[len(PREFIX):].rpartition(".")
    name = clean_hostname(host)
    if name is None or not hmac.compare_digest(_mac(key, name), mac):
        return None
    return name
