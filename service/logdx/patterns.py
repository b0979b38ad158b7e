"""Text patterns several stages share: the mask that turns a line into its shape, and what a
Python traceback looks like. Data-free helpers only, so that sharing them couples no stages."""

from __future__ import annotations

import re

# One pass, one replacement: the alternation is ordered from the most to the least specific.
MASK = re.compile(
    r"""
    [0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}   # uuid
  | (?<![\w.])\d{1,3}(?:\.\d{1,3}){3}(?::\d+|<\d+>)?(?![\w.])                   # ipv4[:port]
  | (?<![\w.])(?:[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?|[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])(?!\w)  # PCI
  | \b0x[0-9a-fA-F]+\b                                                       # hex literal
  | (?<![\w/.~-])~?(?:/[\w.@+=,-]+){2,}/?                                     # absolute path
  | (?<![A-Za-z_])[-+]?\d+(?:[.,:]\d+)*(?:[eE][-+]?\d+)?
        (?:ms|us|ns|s|sec|min|h|GiB|MiB|KiB|GB|MB|KB|B|%)?(?![A-Za-z_])      # number, duration, size
  | \b[0-9a-fA-F]{12,}\b                                                     # long hex id
    """,
    re.VERBOSE,
)
PARAM = "<*>"

TRACEBACK_START = "Traceback (most recent call last)"
_BODY_PREFIXES = ("File ", "...", "^", "~", TRACEBACK_START, "During handling", "The above exception")


def mask(text: str) -> str:
    """The shape of a line: numbers, ids, addresses and paths replaced by a wildcard."""
    return MASK.sub(PARAM, text)


def is_traceback_body(text: str) -> bool:
    """A line inside a traceback (frame, code, caret, rich box) rather than the exception line."""
    if not text or text[0].isspace() or text[0] in "│╭╰┃┏┗|":
        return True
    return text.startswith(_BODY_PREFIXES)
