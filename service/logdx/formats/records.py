"""JSON log records, as the shippers send them: one top-level array (Fluent Bit `format json`,
Vector's `encoding.codec = "json"`), concatenated objects (Fluent Bit `json_stream`) or one object per
line (NDJSON: Fluent Bit `json_lines`, Vector `newline_delimited`, journald `-o json`, GELF, ECS,
Docker's json-file). Fields are read by `fields` (which is the line, the host, the rank, the job).

A scanner finds where each record ends (tracking strings and nesting with C-speed regexes), then
`json.loads` decodes it; the scanner's state survives piece boundaries, so nothing is scanned twice
and a record larger than `Meta.max_record_bytes` is refused before it is held whole.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, cast

from logdx.formats import cri
from logdx.formats.base import Batch, Format, FormatError, Meta
from logdx.formats.fields import message_of, routed_job, source_of, split_message
from logdx.normalize import Source

_STRUCT = re.compile(rb'[\[\]{}"]')
_STR_BODY = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*', re.DOTALL)
_WS = re.compile(rb"[ \t\r\n]*")


def add_record(rec: Mapping[str, Any], meta: Meta, batch: Batch, ts: float | None = None) -> None:
    """One record's line(s) into `batch`, or its refusal counted (no message, no job)."""
    message = message_of(rec)
    job = routed_job(message, rec, meta, batch)
    if job is None:
        return
    assert message is not None  # routed_job gives a job only for a string
    source = source_of(rec, meta, ts)
    lines = split_message(message, meta.cap)
    if len(lines) == 1 and (part := cri.unwrap(lines[0])) is not None and not part.partial:
        # a runtime's wrapper read raw (Fluent Bit `tail` without its cri parser)
        source = Source(rank=source.rank, host=source.host, ts=part.ts or source.ts, stream=part.stream)
        lines = [part.message]
    batch.extend(job, source, lines)


class RecordsParser:
    def __init__(self, meta: Meta) -> None:
        self.meta = meta
        self.records = 0
        self._buf = b""
        self._pos = 0
        self._mode: str | None = None  # None (start) | "array" | "stream" | "done"
        self._need_comma = False
        self._start: int | None = None  # offset of the record being scanned
        self._depth = 0
        self._in_str = False

    def feed(self, data: bytes) -> Batch:
        batch = Batch()
        if data:
            keep = self._start if self._start is not None else self._pos
            self._buf = self._buf[keep:] + data
            self._pos -= keep
            if self._start is not None:
                self._start = 0
            self._scan(batch)
        return batch

    def finish(self) -> Batch:
        batch = Batch()
        self._scan(batch)
        if self._start is not None:
            raise FormatError("bad", "malformed_json", f"the body ends inside JSON record {self.records + 1}")
        if self._mode == "array":
            raise FormatError("bad", "malformed_json", "the body ends before the JSON array is closed")
        return batch

    def _fail(self, message: str) -> FormatError:
        return FormatError("bad", "malformed_json", f"{message} (after {self.records} record(s))")

    def _too_large(self) -> FormatError:
        return FormatError("too_large", "record_too_large",
                           f"a JSON record is larger than {self.meta.max_record_bytes} bytes")

    def _scan(self, batch: Batch) -> None:
        buf, n = self._buf, len(self._buf)
        while True:
            if self._start is None:
                self._pos = cast("re.Match[bytes]", _WS.match(buf, self._pos)).end()  # `*`: always matches
                if self._pos >= n:
                    return
                c = buf[self._pos]
                if self._mode is None:
                    if c == 0x5B:  # [
                        self._mode = "array"
                        self._pos += 1
                        continue
                    self._mode = "stream"
                if self._mode == "done":
                    raise self._fail("unexpected data after the end of the JSON array")
                if self._mode == "array":
                    if c == 0x2C and self._need_comma:  # ,
                        self._need_comma = False
                        self._pos += 1
                        continue
                    if c == 0x5D and (self._need_comma or self.records == 0):  # ]
                        self._mode = "done"
                        self._pos += 1
                        continue
                    if self._need_comma:
                        raise self._fail("expected ',' or ']' between JSON records")
                if c != 0x7B:  # {
                    raise self._fail("expected a JSON object (a log record)")
                self._start, self._depth, self._in_str = self._pos, 0, False
            if not self._scan_record(buf, n):
                if n - self._start > self.meta.max_record_bytes:
                    raise self._too_large()
                return
            raw = buf[self._start:self._pos]
            self._start = None
            self._need_comma = self._mode == "array"
            if len(raw) > self.meta.max_record_bytes:
                raise self._too_large()
            self.meta.count()
            try:
                rec = json.loads(raw)
            except (ValueError, RecursionError) as e:
                raise self._fail(f"JSON record {self.records + 1} is not valid JSON: {e}") from None
            self.records += 1
            if not isinstance(rec, dict):
                raise self._fail(f"JSON record {self.records} is not an object")
            add_record(rec, self.meta, batch)

    def _scan_record(self, buf: bytes, n: int) -> bool:
        """Advance to the end of the current record; False when more data is needed."""
        pos = self._pos
        while pos < n:
            if self._in_str:
                pos = cast("re.Match[bytes]", _STR_BODY.match(buf, pos)).end()  # `*`: always matches
                if pos >= n or buf[pos] != 0x22:  # ends inside the string (or on a lone backslash)
                    self._pos = pos
                    return False
                self._in_str = False
                pos += 1
                continue
            m = _STRUCT.search(buf, pos)
            if m is None:
                self._pos = n
                return False
            c = buf[m.start()]
            pos = m.end()
            if c == 0x22:
                self._in_str = True
            elif c in (0x7B, 0x5B):
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth == 0:
                    self._pos = pos
                    return True
        self._pos = pos
        return False


JSON_MEDIA = frozenset({
    "application/json", "application/x-ndjson", "application/ndjson", "application/jsonl",
    "application/x-jsonl", "application/jsonlines", "application/x-jsonlines", "application/json-lines",
    "application/stream+json", "application/jsonstream",
})

RECORDS = Format(
    name="ndjson",
    media_types=JSON_MEDIA,
    parser=RecordsParser,
    sniff=lambda head: head.lstrip()[:1] in (b"{", b"["),
    description="JSON records: NDJSON, concatenated or one array (Fluent Bit, Vector, journald, GELF, ECS, Docker)",
)
