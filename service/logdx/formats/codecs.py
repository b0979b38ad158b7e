"""Decompression in bounded pieces: gzip and deflate (zlib), zstd, and snappy (framed or block).

Each inflater takes the input as it arrives (`feed`) and yields its output in pieces of at most
`piece` bytes, never more: what a piece of input inflates to is produced (and so judged by the
caller) a piece at a time, however small the input and however large the output it asks for.
`unread` is the input taken but not yet inflated (the caller judges the ratio on what was used).
Bad data raises `CodecError`; data that ends before its end marker raises it from `finish`.

Snappy's block format (`Content-Encoding: snappy` from Prometheus-style senders) has no framing: the
whole compressed body is needed, so it is held (at most `max_held` bytes) and inflated at the end
into a buffer of the size its header declares, once that size is known to be within `max_output`.
The framed format (`x-snappy-framed`, and what some senders call `snappy`) is read chunk by chunk;
`snappy` is told apart by the framed format's stream identifier, as the OpenTelemetry Collector does.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Protocol

import cramjam

try:  # Python 3.14's compression.zstd, or its backport
    from compression import zstd  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - depends on the Python version
    from backports import zstd

ENCODINGS = ("gzip", "deflate", "zstd", "snappy", "x-snappy-framed")
_ALIASES = {"x-gzip": "gzip", "zlib": "deflate", "x-zstd": "zstd"}
SNAPPY_STREAM_ID = b"\xff\x06\x00\x00sNaPpY"
_SNAPPY_MAX_CHUNK = 65536  # what one framed chunk may inflate to (the format's own limit)
_SNAPPY_MAX_FRAME = 1 << 17  # a compressed chunk of 64 KiB is at most ~76 KiB; padding is refused beyond this


class CodecError(Exception):
    """The data is not valid for its encoding (`kind` "bad"), or a bound was hit (`kind` "too_large")."""

    def __init__(self, message: str, kind: str = "bad") -> None:
        super().__init__(message)
        self.kind = kind


def canonical(encoding: str) -> str | None:
    """The encoding's name among `ENCODINGS`, "identity", or None when it is not supported."""
    enc = encoding.strip().lower()
    if enc in ("", "identity"):
        return "identity"
    enc = _ALIASES.get(enc, enc)
    return enc if enc in ENCODINGS else None


class Inflater(Protocol):
    unread: int

    def feed(self, data: bytes) -> Iterator[bytes]: ...

    def finish(self) -> Iterator[bytes]: ...


class ZlibInflater:
    """gzip (several members too) or deflate (zlib-wrapped)."""

    def __init__(self, gzip: bool, piece: int) -> None:
        self.wbits = 16 + zlib.MAX_WBITS if gzip else zlib.MAX_WBITS
        self.name = "gzip" if gzip else "deflate"
        self.piece = piece
        self.unread = 0
        self._z = zlib.decompressobj(self.wbits)
        self._started = False

    def feed(self, data: bytes) -> Iterator[bytes]:
        try:
            while data:
                self._started = True
                out = self._z.decompress(data, self.piece)
                self.unread = len(self._z.unconsumed_tail) + len(self._z.unused_data)
                if out:
                    yield out
                if self._z.unconsumed_tail:
                    data = self._z.unconsumed_tail
                elif self._z.eof and self._z.unused_data:
                    data = self._z.unused_data  # the next gzip member
                    self._z = zlib.decompressobj(self.wbits)
                else:
                    data = b""
        except zlib.error as e:
            raise CodecError(f"the body is not valid {self.name} data ({e})") from None

    def finish(self) -> Iterator[bytes]:
        if not self._started:
            return
        try:
            tail = self._z.flush()
        except zlib.error as e:
            raise CodecError(f"the body is not valid {self.name} data ({e})") from None
        if tail:
            yield tail
        if not self._z.eof:
            raise CodecError(f"the {self.name} body ends before its end marker (truncated?)")


class ZstdInflater:
    """Zstandard frames, one after another."""

    def __init__(self, piece: int) -> None:
        self.piece = piece
        self.unread = 0
        self._d = zstd.ZstdDecompressor()
        self._mid_frame = False

    def feed(self, data: bytes) -> Iterator[bytes]:
        try:
            while True:
                if data:
                    self._mid_frame = True
                out = self._d.decompress(data, self.piece)
                data = b""
                if out:
                    yield out
                if self._d.eof:
                    self._mid_frame = False
                    data = self._d.unused_data
                    self._d = zstd.ZstdDecompressor()
                    if not data:
                        return
                elif self._d.needs_input:
                    return
        except zstd.ZstdError as e:
            raise CodecError(f"the body is not valid zstd data ({e})") from None

    def finish(self) -> Iterator[bytes]:
        if self._mid_frame:
            raise CodecError("the zstd body ends inside a frame (truncated?)")
        return iter(())


class SnappyFramedInflater:
    """Snappy's framing format: a stream identifier, then chunks of at most 64 KiB each."""

    def __init__(self) -> None:
        self.unread = 0
        self._buf = b""
        self._seen_id = False

    def feed(self, data: bytes) -> Iterator[bytes]:
        self._buf += data
        self.unread = len(self._buf)
        while len(self._buf) >= 4:
            kind = self._buf[0]
            size = int.from_bytes(self._buf[1:4], "little")
            if size > _SNAPPY_MAX_FRAME:
                raise CodecError(f"a snappy frame chunk of {size} bytes: no valid stream has one")
            if len(self._buf) < 4 + size:
                return
            chunk, self._buf = self._buf[4:4 + size], self._buf[4 + size:]
            self.unread = len(self._buf)
            out = self._chunk(kind, chunk)
            if out:
                yield out

    def _chunk(self, kind: int, chunk: bytes) -> bytes:
        if kind == 0xFF:
            if chunk != SNAPPY_STREAM_ID[4:]:
                raise CodecError("not a snappy framed stream (bad stream identifier)")
            self._seen_id = True
            return b""
        if not self._seen_id:
            raise CodecError("not a snappy framed stream (no stream identifier)")
        if kind == 0x01:
            if len(chunk) - 4 > _SNAPPY_MAX_CHUNK:
                raise CodecError("a snappy frame chunk holds more than 64 KiB")
            return chunk[4:]
        if kind == 0x00:
            body = chunk[4:]
            try:
                if cramjam.snappy.decompress_raw_len(body) > _SNAPPY_MAX_CHUNK:
                    raise CodecError("a snappy frame chunk inflates to more than 64 KiB")
                return bytes(cramjam.snappy.decompress_raw(body))
            except cramjam.DecompressionError as e:
                raise CodecError(f"the body is not valid snappy data ({e})") from None
        if kind < 0x80:
            raise CodecError(f"a snappy frame chunk of reserved type 0x{kind:02x}")
        return b""  # padding and skippable chunks

    def finish(self) -> Iterator[bytes]:
        if self._buf:
            raise CodecError("the snappy framed body ends inside a chunk (truncated?)")
        return iter(())


class SnappyBlockInflater:
    """Snappy's block format: held compressed (at most `max_held` bytes), inflated at the end."""

    def __init__(self, piece: int, max_held: int, max_output: int) -> None:
        self.piece = piece
        self.max_held = max_held
        self.max_output = max_output
        self.unread = 0
        self._parts: list[bytes] = []

    def feed(self, data: bytes) -> Iterator[bytes]:
        self.unread += len(data)
        if self.unread > self.max_held:
            raise CodecError(f"a snappy (block format) body is held whole and may be at most {self.max_held} "
                             "bytes compressed (input.max_document_bytes); send smaller batches", "too_large")
        self._parts.append(data)
        return iter(())

    def finish(self) -> Iterator[bytes]:
        body, self._parts = b"".join(self._parts), []
        if not body:
            return
        try:
            size = cramjam.snappy.decompress_raw_len(body)
            if size > self.max_output:
                raise CodecError(f"the snappy body declares {size} bytes once inflated, more than the "
                                 f"{self.max_output} a request may inflate to", "too_large")
            out = bytearray(size)
            written = cramjam.snappy.decompress_raw_into(body, out)
        except cramjam.DecompressionError as e:
            raise CodecError(f"the body is not valid snappy data ({e})") from None
        self.unread = 0
        view = memoryview(out)[:written]
        for i in range(0, written, self.piece):
            yield bytes(view[i:i + self.piece])


class SnappyInflater:
    """`Content-Encoding: snappy`: framed when the body starts with the stream identifier, else block."""

    def __init__(self, piece: int, max_held: int, max_output: int) -> None:
        self._args = (piece, max_held, max_output)
        self._head = b""
        self._inner: Inflater | None = None
        self.unread = 0

    def feed(self, data: bytes) -> Iterator[bytes]:
        if self._inner is None:
            self._head += data
            self.unread = len(self._head)
            if len(self._head) < len(SNAPPY_STREAM_ID) and SNAPPY_STREAM_ID.startswith(self._head):
                return
            data, self._head = self._head, b""
            self._inner = self._pick(data)
        yield from self._inner.feed(data)
        self.unread = self._inner.unread

    def _pick(self, head: bytes) -> Inflater:
        if head.startswith(SNAPPY_STREAM_ID):
            return SnappyFramedInflater()
        return SnappyBlockInflater(*self._args)

    def finish(self) -> Iterator[bytes]:
        if self._inner is None:
            if not self._head:
                return
            data, self._head = self._head, b""
            self._inner = self._pick(data)
            yield from self._inner.feed(data)
        yield from self._inner.finish()


def inflater(encoding: str, piece: int, max_held: int, max_output: int) -> Inflater:
    """The inflater of a canonical encoding other than identity."""
    if encoding in ("gzip", "deflate"):
        return ZlibInflater(encoding == "gzip", piece)
    if encoding == "zstd":
        return ZstdInflater(piece)
    if encoding == "x-snappy-framed":
        return SnappyFramedInflater()
    if encoding == "snappy":
        return SnappyInflater(piece, max_held, max_output)
    raise ValueError(encoding)
