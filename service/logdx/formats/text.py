"""Plain log lines (`text/plain`, what curl sends by default, a file): split on LF; a line cut by a
piece boundary is completed by the next piece; a line longer than the limit is cut (one byte past
it, so the normaliser marks it) and the rest dropped without being held. Lines in CRI form
(containerd / CRI-O files) are unwrapped: their time and stream describe the line."""

from __future__ import annotations

from logdx.formats import cri
from logdx.formats.base import Batch, Format, FormatError, Meta
from logdx.normalize import Source

SNIFF_BYTES = 1024


def looks_binary(head: bytes) -> bool:
    """Random bytes, an image, an archive: not log text (a few odd bytes are fine)."""
    if not head:
        return False
    text = head.decode("utf-8", errors="replace")
    bad = text.count("\ufffd")
    bad += sum(1 for ch in text if ch < " " and ch not in "\t\n\r\x1b\x08\x0c")
    return bad > max(4, len(text) // 10)


class TextParser:
    def __init__(self, meta: Meta) -> None:
        self.meta = meta
        self.job = meta.job
        self.cap = meta.cap
        self._pending = b""
        self._skipping = False  # inside an over-long line: drop bytes until its end
        self._sniffed = False
        self._sniff_buf = b""
        self._cri: cri.PartialJoiner | None = None

    def feed(self, data: bytes) -> Batch:
        if not self._sniffed:
            self._sniff_buf += data
            if len(self._sniff_buf) < SNIFF_BYTES:
                return Batch()
            data, self._sniff_buf = self._sniff_buf, b""
            self._check_text(data)
        return self._split(data)

    def finish(self) -> Batch:
        batch = Batch()
        if not self._sniffed:
            data, self._sniff_buf = self._sniff_buf, b""
            self._check_text(data)
            batch = self._split(data)
        if self._pending:
            self._emit(batch, [self._pending])
            self._pending = b""
        if self._cri is not None and (rest := self._cri.flush()) is not None:
            batch.add(self.job, self.meta.source, rest)
        return batch

    def _check_text(self, head: bytes) -> None:
        self._sniffed = True
        if looks_binary(head[:SNIFF_BYTES]):
            raise FormatError("bad", "binary_content",
                              "the body does not look like log text (binary data?); send UTF-8 lines, "
                              "and set Content-Encoding: gzip for compressed bodies")
        if cri.looks_cri(head):
            self._cri = cri.PartialJoiner(self.cap)

    def _emit(self, batch: Batch, lines: list[bytes]) -> None:
        if self._cri is None:
            batch.extend(self.job, self.meta.source, lines)
            return
        d = self.meta.source
        for line in lines:
            part = cri.unwrap(line)
            if part is None:
                batch.add(self.job, d, line)
                continue
            whole = self._cri.push(part)
            if whole is not None:
                source = Source(rank=d.rank, host=d.host, ts=part.ts if part.ts is not None else d.ts,
                                stream=part.stream)
                batch.add(self.job, source, whole)

    def _split(self, data: bytes) -> Batch:
        batch = Batch()
        if not data:
            return batch
        if self._skipping:
            nl = data.find(b"\n")
            if nl < 0:
                return batch
            self._emit(batch, [self._pending])
            self._pending, self._skipping = b"", False
            data = data[nl + 1:]
        elif self._pending:
            data = self._pending + data
            self._pending = b""
        parts = data.split(b"\n")
        tail = parts.pop()
        cap = self.cap
        if parts and len(data) > cap and max(map(len, parts)) > cap:  # map in C: a flood of short lines stays cheap
            parts = [p if len(p) <= cap else p[:cap] for p in parts]
        self._emit(batch, parts)
        if len(tail) > cap:
            self._pending, self._skipping = tail[:cap], True
        else:
            self._pending = tail
        return batch


TEXT = Format(
    name="text",
    media_types=frozenset({"text/plain", "application/octet-stream", "application/x-www-form-urlencoded",
                           "text/x-log"}),
    parser=TextParser,
    description="log lines (CRI container log lines are unwrapped)",
)
