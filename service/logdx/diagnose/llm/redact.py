"""What leaves the machine for a hosted model: the log with its names masked, and the answer read back.

A prompt sent to an OpenAI-compatible endpoint off this host carries a job's log lines, and those name
the cluster's machines, its addresses, its users' home directories, e-mail addresses, and now and then
a token someone printed. `Redactor.mask` replaces each with a placeholder, the same name with the same
placeholder every time (`<host-1>` stays one machine, so "rank 3 on <host-1> lost <host-2>" still reads),
and keeps the mapping here; `unmask` puts the names back into the model's explanation. Secrets get no
mapping back: they never return.

`llm.redact`: `auto` (default) masks for any endpoint that is not on loopback; `always`; `never`.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from urllib.parse import urlsplit

__all__ = ["Redactor", "is_loopback_url", "redacts"]

# Keys and tokens by their own shape, and the value after a word that says it is one.
_SECRETS = re.compile(
    r"\b(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{30,}\b|\bgithub_pat_[A-Za-z0-9_]{30,}\b|\bhf_[A-Za-z0-9]{30,}\b"
    r"|\bsk-[A-Za-z0-9_-]{20,}\b|\bAKIA[0-9A-Z]{16}\b|\bxox[abprs]-[A-Za-z0-9-]{10,}\b"
    r"|\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\b"
    r"|(?i:\b(?:api[_-]?key|access[_-]?key|secret|token|password|passwd|bearer|authorization)\b[\"']?\s*[:=]?\s*"
    r"(?:bearer\s+)?)[\"']?[^\s\"',;]{8,}")
_EMAIL = re.compile(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}\b")
_IPV4 = re.compile(r"(?<![\d.])(?:25[0-5]|2[0-4]\d|1?\d?\d)(?:\.(?:25[0-5]|2[0-4]\d|1?\d?\d)){3}(?![\d.])")
_IPV6 = re.compile(r"(?<![\w:])(?:[0-9a-fA-F]{1,4}:){2,7}[0-9a-fA-F]{1,4}(?![\w:])|(?<![\w:])(?:[0-9a-fA-F]{1,4}:){1,6}:"
                   r"(?:[0-9a-fA-F]{1,4}:?){0,6}[0-9a-fA-F]{0,4}(?![\w:])")
# A user's directory: /home/jdoe/..., /Users/jdoe/..., C:\Users\jdoe\...
_HOME = re.compile(r"(?P<root>/home/|/Users/|[A-Za-z]:\\Users\\)(?P<user>[A-Za-z0-9._-]+)")
# A fully qualified name of a machine (not a Python module: those end in no such suffix).
_FQDN = re.compile(r"\b[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9-]+)+\.(?:com|net|org|edu|gov|io|ai|cloud|"
                   r"internal|local|lan|corp|cluster|svc|intra|priv)\b")
# Stock users of CI images and clouds: masked in their home directory, but their bare word (a common one)
# elsewhere in a line is left alone.
_NOT_USERS = frozenset({"runner", "ubuntu", "user", "admin"})


class Redactor:
    """Masks one prompt's names consistently; `unmask` reads them back into the model's answer."""

    def __init__(self, hosts: Iterable[str] = ()) -> None:
        self._names: dict[str, str] = {}  # original -> placeholder
        self._counts: dict[str, int] = {}
        known = sorted({h for h in hosts if h and len(h) >= 3}, key=len, reverse=True)
        self._hosts = re.compile(r"(?<![\w.-])(?:" + "|".join(map(re.escape, known)) + r")(?![\w-])") if known else None

    def mask(self, text: str) -> str:
        text = _SECRETS.sub("<secret>", text)
        text = _EMAIL.sub(lambda m: self._placeholder("email", m.group(0)), text)
        text = _HOME.sub(lambda m: m.group("root") + self._placeholder("user", m.group("user")), text)
        text = _FQDN.sub(lambda m: self._placeholder("host", m.group(0)), text)
        if self._hosts is not None:
            text = self._hosts.sub(lambda m: self._placeholder("host", m.group(0)), text)
        text = _IPV4.sub(lambda m: self._placeholder("ip", m.group(0)), text)
        text = _IPV6.sub(lambda m: self._placeholder("ip", m.group(0)) if _is_ip(m.group(0)) else m.group(0), text)
        for user in [u for u, p in self._names.items() if p.startswith("<user-")]:
            # The user's name elsewhere in the line (a process owner, "user=jdoe"), once its home named it.
            if len(user) >= 3 and user not in _NOT_USERS:
                text = re.sub(rf"(?<![\w.-]){re.escape(user)}(?![\w.-])", self._names[user], text)
        return text

    def unmask(self, text: str) -> str:
        back = {p: original for original, p in self._names.items()}
        return re.sub(r"<(?:host|ip|user|email)-\d+>", lambda m: back.get(m.group(0), m.group(0)), text)

    @property
    def masked(self) -> dict[str, str]:
        """Placeholder -> the name it stands for (kept here, never sent)."""
        return {p: original for original, p in self._names.items()}

    def _placeholder(self, kind: str, original: str) -> str:
        if original.startswith("<") and original.endswith(">"):
            return original
        found = self._names.get(original)
        if found is None:
            self._counts[kind] = self._counts.get(kind, 0) + 1
            found = self._names[original] = f"<{kind}-{self._counts[kind]}>"
        return found


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def is_loopback_url(url: str) -> bool:
    host = (urlsplit(url).hostname or "").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def redacts(mode: str, base_url: str) -> bool:
    """Whether a prompt for `base_url` is masked under `llm.redact`."""
    return mode == "always" or (mode == "auto" and not is_loopback_url(base_url))
