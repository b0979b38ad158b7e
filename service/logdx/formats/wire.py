"""Recognising a protobuf body by its first bytes (a saved OTLP or Loki body nothing describes).

Protobuf has no magic number, and an OTLP body is mostly the text of its log lines, so "does it look
binary" misses it. What it does have is structure: every field starts with a tag (field number and
wire type) and a length-delimited field's length fits inside its parent. `matches` walks the first
bytes of an input along a schema (which fields each message has, which of them are messages) and
says whether they read as that message. Text that happens to start with a newline (tag 1, length
10) fails at once: the nested lengths do not fit."""

from __future__ import annotations

from collections.abc import Mapping

VARINT, I64, LEN, I32 = 0, 1, 2, 5
_WIRE_TYPES = frozenset({VARINT, I64, LEN, I32})

# message name -> {field number: (wire type, the nested message's name, or None for scalars/strings)}
Schema = Mapping[str, Mapping[int, tuple[int, str | None]]]


class _Truncated(Exception):
    """The head ended inside a field: what was read so far matched."""


def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end:
            raise _Truncated
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _walk(buf: bytes, pos: int, end: int, limit: int, schema: Schema, message: str, depth: int = 0) -> None:
    """Read the fields of `message` from `pos` to `end` (its declared end, which may lie past
    `limit`, the bytes we have). Raises ValueError when the bytes cannot be that message."""
    fields = schema[message]
    strict = depth < 2  # deeper messages may carry fields newer than the schema
    if depth > 8:
        return
    while pos < min(end, limit):
        key, pos = _varint(buf, pos, limit)
        number, wire = key >> 3, key & 7
        if number == 0 or wire not in _WIRE_TYPES:
            raise ValueError("not a protobuf tag")
        expected = fields.get(number)
        if expected is None and strict:
            raise ValueError(f"field {number} is not in {message}")
        if expected is not None and expected[0] != wire:
            raise ValueError(f"field {number} of {message} has the wrong wire type")
        if wire == VARINT:
            _, pos = _varint(buf, pos, limit)
        elif wire == I64:
            pos += 8
        elif wire == I32:
            pos += 4
        else:
            length, pos = _varint(buf, pos, limit)
            if pos + length > end:
                raise ValueError("a field longer than its message")
            child = expected[1] if expected is not None else None
            if child is not None:
                _walk(buf, pos, pos + length, limit, schema, child, depth + 1)
            pos += length
        if pos > end:
            raise ValueError("a field longer than its message")


def matches(head: bytes, schema: Schema, root: str, *, total: int | None = None, min_bytes: int = 8) -> bool:
    """Whether `head` (the first bytes of an input of `total` bytes, when known) reads as a `root`
    message: at least `min_bytes` of tags and lengths consistent with the schema. The root and its
    direct children must use known fields only; deeper messages may carry fields newer than the schema."""
    if len(head) < min_bytes:
        return False
    end = total if total is not None else 1 << 62
    try:
        _walk(head, 0, end, len(head), schema, root)
    except _Truncated:
        return True
    except (ValueError, IndexError):
        return False
    return True


def read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    """The varint at `pos` and the position after it; ValueError when `buf` ends inside it."""
    try:
        return _varint(buf, pos, len(buf))
    except _Truncated:
        raise ValueError("truncated varint") from None


# -- the bodies logdx reads -------------------------------------------------------------------------

# OTLP's ExportLogsServiceRequest down to the log records (opentelemetry-proto's logs.proto, common.proto).
OTLP_SCHEMA: Schema = {
    "Request": {1: (LEN, "ResourceLogs")},
    "ResourceLogs": {1: (LEN, "Resource"), 2: (LEN, "ScopeLogs"), 3: (LEN, None)},
    "Resource": {1: (LEN, "KeyValue"), 2: (VARINT, None), 3: (LEN, None)},
    "ScopeLogs": {1: (LEN, "Scope"), 2: (LEN, "LogRecord"), 3: (LEN, None)},
    "Scope": {1: (LEN, None), 2: (LEN, None), 3: (LEN, "KeyValue"), 4: (VARINT, None)},
    "KeyValue": {1: (LEN, None), 2: (LEN, "AnyValue")},
    "AnyValue": {1: (LEN, None), 2: (VARINT, None), 3: (VARINT, None), 4: (I64, None), 5: (LEN, None),
                 6: (LEN, None), 7: (LEN, None)},
    "LogRecord": {1: (I64, None), 11: (I64, None), 2: (VARINT, None), 3: (LEN, None), 5: (LEN, "AnyValue"),
                  6: (LEN, "KeyValue"), 7: (VARINT, None), 8: (I32, None), 9: (LEN, None), 10: (LEN, None),
                  12: (LEN, None)},
}
# Loki's logproto.PushRequest (the message inside the snappy block).
LOKI_SCHEMA: Schema = {
    "PushRequest": {1: (LEN, "Stream")},
    "Stream": {1: (LEN, None), 2: (LEN, "Entry"), 3: (VARINT, None)},
    "Entry": {1: (LEN, "Timestamp"), 2: (LEN, None), 3: (LEN, "LabelPair")},
    "Timestamp": {1: (VARINT, None), 2: (VARINT, None)},
    "LabelPair": {1: (LEN, None), 2: (LEN, None)},
}


def looks_otlp_protobuf(head: bytes) -> bool:
    """The first bytes read as an ExportLogsServiceRequest (a saved `application/x-protobuf` body)."""
    return head[:1] == b"\n" and matches(head, OTLP_SCHEMA, "Request", min_bytes=16)


def _snappy_literal(head: bytes) -> bytes:
    """The literal bytes a raw snappy block starts with (b"" when it does not start like one): the
    uncompressed length as a varint, then a literal element (tag's low bits 00)."""
    pos = 0
    while pos < min(len(head), 5) and head[pos] & 0x80:
        pos += 1
    pos += 1
    if pos >= len(head) or head[pos] & 3:
        return b""
    n = head[pos] >> 2
    pos += 1
    if n >= 60:  # the length-1 follows in 1-4 little-endian bytes
        extra = n - 59
        n = int.from_bytes(head[pos:pos + extra], "little")
        pos += extra
    return head[pos:pos + n + 1]


def looks_loki_protobuf(head: bytes) -> bool:
    """The first bytes are a snappy block whose first literal reads as a PushRequest whose first
    stream's labels begin (`{...}`, Prometheus' form)."""
    data = _snappy_literal(head)
    if data[:1] != b"\n" or not matches(data, LOKI_SCHEMA, "PushRequest", min_bytes=5):
        return False
    try:  # streams (1, LEN), then its labels (1, LEN)
        _, pos = read_varint(data, 1)
        if data[pos:pos + 1] != b"\n":
            return False
        _, pos = read_varint(data, pos + 1)
    except ValueError:
        return False
    return data[pos:pos + 1] in (b"{", b"")
