"""The protobuf wire format, walked without building the message: a document's outer levels (OTLP's
resource and scope logs, Loki's streams) are read field by field here, and each record is parsed on
its own (`Message.FromString`) as it is reached. Memory is then one record at a time, whatever the
document holds, and the parser can count records, skip empty ones and stop at a bound before any of
them costs anything (a 2-byte empty record would otherwise become a Python object of ~100 bytes).

Wire types: 0 varint, 1 fixed64, 2 length-delimited, 5 fixed32; groups (3, 4) are refused, as
proto3 messages never hold them.
"""

from __future__ import annotations

from collections.abc import Iterator

from logdx.formats.base import FormatError

VARINT, I64, LEN, I32 = 0, 1, 2, 5


def _malformed(what: str, pos: int) -> FormatError:
    return FormatError("bad", "malformed_protobuf", f"not a valid {what}: broken field at byte {pos}")


def varint(buf: bytes | bytearray, pos: int, end: int) -> tuple[int, int]:
    """The varint at `pos` and the position after it."""
    if pos >= end:
        raise IndexError
    b = buf[pos]
    if b < 0x80:
        return b, pos + 1
    result, shift = b & 0x7F, 7
    pos += 1
    while pos < end:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            break
    raise IndexError


def fields(buf: bytes | bytearray, start: int, end: int, what: str) -> Iterator[tuple[int, int, int, int]]:
    """The fields of the message in `buf[start:end]`: (number, wire type, a, b). For a
    length-delimited field `buf[a:b]` is its value; for a varint `a` is the value; fixed-width
    values are skipped (a, b = their span)."""
    pos = start
    try:
        while pos < end:
            at = pos
            key, pos = varint(buf, pos, end)
            number, wire = key >> 3, key & 7
            if number == 0:
                raise _malformed(what, at)
            if wire == LEN:
                size, pos = varint(buf, pos, end)
                if pos + size > end:
                    raise _malformed(what, at)
                yield number, wire, pos, pos + size
                pos += size
            elif wire == VARINT:
                value, pos = varint(buf, pos, end)
                yield number, wire, value, 0
            elif wire in (I64, I32):
                width = 8 if wire == I64 else 4
                if pos + width > end:
                    raise _malformed(what, at)
                yield number, wire, pos, pos + width
                pos += width
            else:
                raise _malformed(what, at)
    except IndexError:
        raise _malformed(what, pos) from None


def spans(buf: bytes | bytearray, start: int, end: int, number: int, what: str) -> Iterator[tuple[int, int]]:
    """The values of the length-delimited field `number` (a repeated message), in order."""
    for n, wire, a, b in fields(buf, start, end, what):
        if n == number:
            if wire != LEN:
                raise FormatError("bad", "malformed_protobuf", f"not a valid {what}: field {n} is not a message")
            yield a, b
