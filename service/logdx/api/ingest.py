"""Request bodies to lines, incrementally: whatever arrives is turned into lines at once.

A body is decoded (``Content-Encoding: gzip``/``deflate``, or gzip recognised by its magic bytes)
and parsed by format:

- ``text``: lines (``text/plain``, and what curl sends by default); ``X-Logdx-Rank`` /
  ``X-Logdx-Host`` / ``X-Logdx-Stream`` headers describe every line;
- ``json``: JSON records, either one top-level array (Fluent Bit ``format json``, Vector's
  ``encoding.codec = "json"``), concatenated objects (Fluent Bit ``json_stream``) or one object
  per line (NDJSON: Fluent Bit ``json_lines``, Vector with ``framing.method =
  "newline_delimited"``). The message is the first of ``line``/``log``/``message``/``msg``;
  ``rank``, ``host``/``hostname``, ``ts``/``timestamp``/``date``/``time``, ``stream`` describe it.

Parsers keep their state between chunks (a line or a record split across chunks is reassembled)
and bound their memory: a line longer than the line limit is cut (the normaliser marks it), a
JSON record larger than the record limit is refused.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import Enum
from typing import Any

from logdx.api.errors import ApiError
from logdx.normalize import Source

MAX_RANK = 1 << 24
_MESSAGE_KEYS = ("line", "log", "message", "msg")
_TS_KEYS = ("ts", "timestamp", "date", "time", "@timestamp")
_HOST_KEYS = ("host", "hostname")


class Format(str, Enum):
    TEXT = "text"
    JSON = "json"


_TEXT_TYPES = {"text/plain", "application/octet-stream", "application/x-www-form-urlencoded", "text/x-log"}
_JSON_TYPES = {
    "application/json", "application/x-ndjson", "application/ndjson", "application/jsonl",
    "application/x-jsonl", "application/jsonlines", "application/x-jsonlines", "application/json-lines",
    "application/stream+json", "application/jsonstream",
}


def pick_format(content_type: str | None, override: str | None = None) -> Format:
    if override:
        try:
            return Format(override)
        except ValueError:
            raise ApiError(400, "bad_format", "format must be 'text' or 'json'") from None
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if not media or media in _TEXT_TYPES or media.startswith("text/"):
        return Format.TEXT
    if media in _JSON_TYPES or media.endswith("+json"):
        return Format.JSON
    raise ApiError(415, "unsupported_media_type",
                   f"unsupported Content-Type {media!r}: send text/plain lines, application/x-ndjson or "
                   "application/json records")


# --- sources -------------------------------------------------------------------------------------


def parse_rank(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if 0 <= value < MAX_RANK else None
    if isinstance(value, float) and value.is_integer():
        return parse_rank(int(value))
    if isinstance(value, str) and value.strip().isdigit():
        return parse_rank(int(value.strip()))
    return None


def _clean_host(value: Any) -> str | None:
    if isinstance(value, str):
        value = value.strip()
        if 0 < len(value) <= 255 and value.isprintable():
            return value
    return None


def source_from_headers(headers: Any) -> Source:
    """`X-Logdx-Rank`, `X-Logdx-Host`, `X-Logdx-Stream`: what every line of the request shares."""
    source = Source()
    rank = headers.get("x-logdx-rank")
    if rank is not None:
        source.rank = parse_rank(rank)
        if source.rank is None:
            raise ApiError(400, "bad_header", f"X-Logdx-Rank must be an integer in 0..{MAX_RANK - 1}")
    host = headers.get("x-logdx-host")
    if host is not None:
        source.host = _clean_host(host)
        if source.host is None:
            raise ApiError(400, "bad_header", "X-Logdx-Host must be 1..255 printable characters")
    stream = headers.get("x-logdx-stream")
    if stream is not None:
        if stream not in ("stdout", "stderr"):
            raise ApiError(400, "bad_header", "X-Logdx-Stream must be stdout or stderr")
        source.stream = stream
    return source


def parse_ts(value: Any) -> float | None:
    """Epoch seconds (or ms/us/ns, told apart by size), or ISO 8601 / RFC 3339 text."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        ts = float(value)
        if not math.isfinite(ts) or ts <= 0:
            return None
        while ts > 1e11:  # ms, us, ns since the epoch
            ts /= 1000.0
        return ts
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return None
        try:
            return parse_ts(float(text))
        except ValueError:
            pass
        try:
            dt = datetime.fromisoformat(text)
        except ValueError:
            return None
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=timezone.utc)
        return dt.timestamp()
    return None


def _nested_host(rec: dict[str, Any]) -> str | None:
    k8s = rec.get("kubernetes")
    if isinstance(k8s, dict):
        return _clean_host(k8s.get("host")) or _clean_host(k8s.get("pod_node_name"))
    return None


# --- batches -------------------------------------------------------------------------------------


@dataclass(slots=True)
class Batch:
    """Lines parsed from one piece of a body, in runs that share a Source."""

    runs: list[tuple[Source, list[bytes]]] = field(default_factory=list)
    lines: int = 0
    skipped: int = 0  # JSON records without a message

    def add(self, source: Source, line: bytes) -> None:
        if self.runs and self.runs[-1][0] == source:
            self.runs[-1][1].append(line)
        else:
            self.runs.append((source, [line]))
        self.lines += 1

    def extend(self, source: Source, lines: list[bytes]) -> None:
        if not lines:
            return
        if self.runs and self.runs[-1][0] == source:
            self.runs[-1][1].extend(lines)
        else:
            self.runs.append((source, lines))
        self.lines += len(lines)


# --- decoding ------------------------------------------------------------------------------------


class Decoder:
    """Content-Encoding, streamed: gzip (several members too), deflate, or gzip found by magic.

    The decoded size counts against `max_bytes` as well, so a small compressed bomb is refused
    (413) long before it costs anything.
    """

    def __init__(self, content_encoding: str | None, max_bytes: int) -> None:
        enc = (content_encoding or "identity").strip().lower()
        if enc not in ("identity", "gzip", "x-gzip", "deflate", ""):
            raise ApiError(415, "unsupported_encoding", f"unsupported Content-Encoding {enc!r}: use gzip or none")
        self.mode = {"x-gzip": "gzip", "": "identity"}.get(enc, enc)
        self.sniff = self.mode == "identity"  # a gzip body sent without the header is still gzip
        self.max_bytes = max_bytes
        self.decoded = 0
        self._z: Any = None
        self._head = b""

    def _new_z(self) -> Any:
        return zlib.decompressobj(16 + zlib.MAX_WBITS if self.mode == "gzip" else zlib.MAX_WBITS)

    def feed(self, data: bytes) -> bytes:
        if self.sniff:
            self._head += data
            if len(self._head) < 2:
                return b""
            data, self._head, self.sniff = self._head, b"", False
            if data[:2] == b"\x1f\x8b":
                self.mode = "gzip"
        if self.mode == "identity":
            return self._count(data)
        if self._z is None:
            self._z = self._new_z()
        out = []
        try:
            while data:
                room = self.max_bytes - self.decoded + 1
                chunk = self._z.decompress(data, room)
                out.append(self._count(chunk))
                if self._z.unconsumed_tail:
                    data = self._z.unconsumed_tail
                elif self._z.eof and self._z.unused_data:
                    data = self._z.unused_data  # the next gzip member
                    self._z = self._new_z()
                else:
                    data = b""
        except zlib.error as e:
            raise ApiError(400, "bad_encoding", f"the body is not valid {self.mode} data ({e})") from None
        return b"".join(out)

    def finish(self) -> bytes:
        if self.sniff and self._head:
            self.sniff = False
            head, self._head = self._head, b""
            return self._count(head)
        if self._z is not None:
            tail = self._count(self._z.flush())
            if not self._z.eof:
                raise ApiError(400, "bad_encoding", f"the {self.mode} body ends before its end marker (truncated?)")
            return tail
        return b""

    def _count(self, data: bytes) -> bytes:
        self.decoded += len(data)
        if self.decoded > self.max_bytes:
            raise ApiError(413, "request_too_large",
                           f"the body is larger than {self.max_bytes} bytes once decompressed")
        return data


# --- text ----------------------------------------------------------------------------------------


def _looks_binary(head: bytes) -> bool:
    """A body of random bytes, an image, an archive: not log text (a few odd bytes are fine)."""
    if not head:
        return False
    text = head.decode("utf-8", errors="replace")
    bad = text.count("\ufffd")
    bad += sum(1 for ch in text if ch < " " and ch not in "\t\n\r\x1b\x08\x0c")
    return bad > max(4, len(text) // 10)


class TextParser:
    """Lines split on LF; a line cut by a chunk boundary is completed by the next chunk."""

    SNIFF_BYTES = 1024

    def __init__(self, source: Source, max_line_bytes: int) -> None:
        self.source = source
        self.cap = max_line_bytes + 1  # one byte more than the limit: the normaliser marks it truncated
        self._pending = b""
        self._skipping = False  # inside an over-long line: drop bytes until its end
        self._sniffed = False
        self._sniff_buf = b""

    def feed(self, data: bytes) -> Batch:
        if not self._sniffed:
            self._sniff_buf += data
            if len(self._sniff_buf) < self.SNIFF_BYTES:
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
            batch.add(self.source, self._pending)
            self._pending = b""
        return batch

    def _check_text(self, head: bytes) -> None:
        self._sniffed = True
        if _looks_binary(head[: self.SNIFF_BYTES]):
            raise ApiError(400, "binary_content",
                           "the body does not look like log text (binary data?); send UTF-8 lines, "
                           "and set Content-Encoding: gzip for compressed bodies")

    def _split(self, data: bytes) -> Batch:
        batch = Batch()
        if not data:
            return batch
        if self._skipping:
            nl = data.find(b"\n")
            if nl < 0:
                return batch
            batch.add(self.source, self._pending)
            self._pending, self._skipping = b"", False
            data = data[nl + 1:]
        elif self._pending:
            data = self._pending + data
            self._pending = b""
        parts = data.split(b"\n")
        tail = parts.pop()
        cap = self.cap
        batch.extend(self.source, [p if len(p) <= cap else p[:cap] for p in parts])
        if len(tail) > cap:
            self._pending, self._skipping = tail[:cap], True
        else:
            self._pending = tail
        return batch


# --- JSON records --------------------------------------------------------------------------------

_STRUCT = re.compile(rb'[\[\]{}"]')
_STR_BODY = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*', re.DOTALL)
_WS = re.compile(rb"[ \t\r\n]*")


class JsonParser:
    """JSON records from one top-level array, concatenated objects, or NDJSON, incrementally.

    A scanner finds where each record ends (tracking strings and nesting with C-speed regexes),
    then `json.loads` decodes it; the scanner's state survives chunk boundaries, so nothing is
    scanned twice and a record split across chunks costs no more than one that is not.
    """

    def __init__(self, source: Source, max_line_bytes: int, max_record_bytes: int) -> None:
        self.source = source
        self.cap = max_line_bytes + 1
        self.max_record_bytes = max_record_bytes
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
            raise ApiError(400, "malformed_json", f"the body ends inside JSON record {self.records + 1}")
        if self._mode == "array":
            raise ApiError(400, "malformed_json", "the body ends before the JSON array is closed")
        return batch

    def _fail(self, message: str) -> ApiError:
        return ApiError(400, "malformed_json", f"{message} (after {self.records} record(s))")

    def _scan(self, batch: Batch) -> None:
        buf, n = self._buf, len(self._buf)
        while True:
            if self._start is None:
                self._pos = _WS.match(buf, self._pos).end()
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
                if n - self._start > self.max_record_bytes:
                    raise ApiError(413, "record_too_large",
                                   f"a JSON record is larger than {self.max_record_bytes} bytes")
                return
            raw = buf[self._start:self._pos]
            self._start = None
            self._need_comma = self._mode == "array"
            if len(raw) > self.max_record_bytes:
                raise ApiError(413, "record_too_large", f"a JSON record is larger than {self.max_record_bytes} bytes")
            try:
                rec = json.loads(raw)
            except (ValueError, RecursionError) as e:
                raise self._fail(f"JSON record {self.records + 1} is not valid JSON: {e}") from None
            self.records += 1
            self._add_record(rec, batch)

    def _scan_record(self, buf: bytes, n: int) -> bool:
        """Advance to the end of the current record; False when more data is needed."""
        pos = self._pos
        while pos < n:
            if self._in_str:
                pos = _STR_BODY.match(buf, pos).end()
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

    def _add_record(self, rec: Any, batch: Batch) -> None:
        if not isinstance(rec, dict):
            raise self._fail(f"JSON record {self.records} is not an object")
        message: Any = None
        for key in _MESSAGE_KEYS:
            message = rec.get(key)
            if message is not None:
                break
        if message is None:
            batch.skipped += 1
            return
        if not isinstance(message, str):
            message = json.dumps(message, ensure_ascii=False)
        d = self.source
        rank = parse_rank(rec.get("rank"))
        host = next((h for h in (_clean_host(rec.get(k)) for k in _HOST_KEYS) if h), None) or _nested_host(rec)
        ts = next((t for t in (parse_ts(rec.get(k)) for k in _TS_KEYS if k in rec) if t is not None), None)
        stream = rec.get("stream")
        source = Source(
            rank=rank if rank is not None else d.rank,
            host=host or d.host,
            ts=ts if ts is not None else d.ts,
            stream=stream if stream in ("stdout", "stderr") else d.stream,
        )
        if message.endswith("\n"):
            message = message[:-1]
        cap = self.cap
        lines = [
            b if len(b) <= cap else b[:cap]
            for b in (part.encode("utf-8", errors="replace") for part in message.split("\n"))
        ]
        batch.extend(source, lines)


Parser = TextParser | JsonParser


def make_parser(fmt: Format, source: Source, max_line_bytes: int) -> Parser:
    if fmt is Format.TEXT:
        return TextParser(source, max_line_bytes)
    return JsonParser(source, max_line_bytes, max_record_bytes=max(1 << 20, 4 * max_line_bytes))
