"""Container runtime log wrappers, unwrapped: CRI (`<RFC 3339 time> <stream> <F|P> <message>`, what
containerd and CRI-O write under /var/log/pods) and Docker's json-file (`{"log", "stream", "time"}`,
read as a JSON record by `records`). A `P` (partial) line is the start of a longer line whose rest
follows; the parts are joined (within the line limit)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from logdx.formats.fields import parse_ts

CRI_LINE = re.compile(rb"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:\d\d)) (stdout|stderr) ([FP])(?: |$)")


def looks_cri(head: bytes) -> bool:
    """The input's first line is a CRI log line."""
    return CRI_LINE.match(head) is not None


@dataclass(slots=True)
class Unwrapped:
    ts: float | None
    stream: str
    partial: bool
    message: bytes


def unwrap(line: bytes) -> Unwrapped | None:
    m = CRI_LINE.match(line)
    if m is None:
        return None
    return Unwrapped(parse_ts(m.group(1).decode()), m.group(2).decode(), m.group(3) == b"P", line[m.end():])


class PartialJoiner:
    """Joins CRI `P` parts with the line that completes them, bounded by `cap` bytes."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._parts: list[bytes] = []
        self._size = 0

    def push(self, part: Unwrapped) -> bytes | None:
        """The whole line once its last part arrives; None while parts are pending."""
        if self._size <= self.cap:
            self._parts.append(part.message)
            self._size += len(part.message)
        if part.partial:
            return None
        whole = b"".join(self._parts)
        self._parts, self._size = [], 0
        return whole if len(whole) <= self.cap else whole[:self.cap]

    def flush(self) -> bytes | None:
        if not self._parts:
            return None
        whole = b"".join(self._parts)
        self._parts, self._size = [], 0
        return whole[:self.cap]
