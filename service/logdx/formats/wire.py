"""Recognising a protobuf message by its first bytes (a saved OTLP or Loki body nothing describes).

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
