"""Messages the interpreter or the OS print themselves (`generic_messages.toml`, plus os.strerror):
a template that is only one of them says nothing about where a line came from."""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

GENERIC_PATH = Path(__file__).with_name("generic_messages.toml")


class GenericMessages:
    def __init__(self, patterns: list[str]) -> None:
        self._regex = re.compile("|".join(f"(?:{p})" for p in patterns), re.IGNORECASE)

    @classmethod
    def load(cls, path: Path = GENERIC_PATH) -> GenericMessages:
        patterns = list(tomllib.loads(path.read_text(encoding="utf-8")).get("patterns", []))
        return cls(patterns + _strerror_patterns())

    def is_generic(self, template: str) -> bool:
        return bool(self._regex.fullmatch(template.strip()))


def _strerror_patterns() -> list[str]:
    """`[Errno 2] No such file or directory: '<*>'`, bare or with a path after it."""
    texts = {os.strerror(code) for code in range(1, 134)}
    texts = {t for t in texts if not t.startswith("Unknown error")}
    return [r"(?:\[Errno <\*>\] )?" + re.escape(t) + r"\.?(?:[:,] '?<\*>'?)*" for t in sorted(texts)]
