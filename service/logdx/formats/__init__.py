"""Input formats: bytes and what the transport says about them in, log lines out.

One module per format, each a `Format` (name, media types, how its first bytes look, its parser):

| name        | what                                                                | module            |
|-------------|---------------------------------------------------------------------|-------------------|
| `text`      | log lines; CRI container log lines unwrapped                        | `text`            |
| `ndjson`    | JSON records: NDJSON, concatenated, one array (Fluent Bit, Vector)   | `records`         |
| `msgpack`   | Fluent Bit's default HTTP body                                      | `fluent_msgpack`  |
| `otlp`      | OpenTelemetry logs, protobuf                                        | `otlp`            |
| `otlp-json` | OpenTelemetry logs, OTLP JSON                                       | `otlp`            |
| `loki`      | Loki push, snappy protobuf                                          | `loki`            |
| `loki-json` | Loki push, JSON                                                     | `loki`            |

A new shipper format is one module with one `Format`, added to `FORMATS` below. `choose()` picks a
format from a name, the media types the formats declare, or, where that is unambiguous, the input's first
bytes. No format has settings of its own: the bounds in `input` (`max_record_bytes`, `max_document_bytes`,
`max_records`) are shared by several formats, so they stay there.
Used by the HTTP service (`logdx.api.ingest`), the CLI (`diagnose --format`) and `read_file`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import BinaryIO

from logdx.formats import wire
from logdx.formats.base import DEFAULT_JOB_KEYS, Batch, Format, FormatError, Meta, Parser, Run
from logdx.formats.fluent_msgpack import FLUENT_MSGPACK
from logdx.formats.loki import LOKI_JSON, LOKI_PROTOBUF
from logdx.formats.otlp import OTLP_JSON, OTLP_PROTOBUF
from logdx.formats.records import RECORDS
from logdx.formats.text import TEXT

__all__ = [
    "DEFAULT_JOB_KEYS", "FORMATS", "SNIFF_BYTES", "TEXT", "Batch", "Format", "FormatError", "Meta", "Parser", "Run",
    "accepted_names", "by_name", "choose", "declaring", "media_type", "media_types", "names", "read_stream",
    "sniff_file",
]

FORMATS: dict[str, Format] = {f.name: f for f in (TEXT, RECORDS, FLUENT_MSGPACK, OTLP_PROTOBUF, OTLP_JSON,
                                                  LOKI_PROTOBUF, LOKI_JSON)}
_ALIASES = {"json": "ndjson", "jsonl": "ndjson", "fluentbit": "msgpack"}
SNIFF_BYTES = 256
# Recognised by their first bytes alone, in this order (a JSON document's key, msgpack's event head).
_DOCUMENT_SNIFFS = (OTLP_JSON, LOKI_JSON)
# Binary bodies a file may hold (a saved request): recognised by their structure, never read as text.
# (Protobuf has no magic bytes, so which message it is cannot be told over HTTP: the endpoint says.)
_BINARY_SNIFFS: tuple[tuple[Format, Callable[[bytes], bool]], ...] = (
    (OTLP_PROTOBUF, wire.looks_otlp_protobuf), (LOKI_PROTOBUF, wire.looks_loki_protobuf))


def names() -> list[str]:
    return [*FORMATS, "auto"]


def accepted_names() -> list[str]:
    """Every name `by_name` takes: the formats, `auto`, and their aliases (what the CLI and the API offer)."""
    return [*names(), *_ALIASES]


def media_type(content_type: str | None) -> str:
    return (content_type or "").split(";", 1)[0].strip().lower()


def by_name(name: str) -> Format:
    fmt = FORMATS.get(_ALIASES.get(name, name))
    if fmt is None:
        raise FormatError("unsupported", "bad_format", f"unknown format {name!r}: one of {', '.join(names())}")
    return fmt


_JSON_KEY_START = re.compile(rb'\{\s*"[^"\n\\]{1,200}"\s*:')


def _looks_ndjson(head: bytes) -> bool:
    """The first line is one whole JSON object (a text log line rarely is), or, when the first record
    is longer than the head, starts like one (`{"key":`)."""
    first = head.lstrip().split(b"\n", 1)
    if first[0].startswith(b"{") and len(first) < 2 and len(head) >= SNIFF_BYTES:
        return _JSON_KEY_START.match(first[0]) is not None
    if not first[0].startswith(b"{") or len(first) < 2:
        return head.lstrip().startswith(b"[{") or head.lstrip().startswith(b"[\n")
    try:
        return isinstance(json.loads(first[0]), dict)
    except ValueError:
        return False


def sniff_file(head: bytes) -> Format:
    """The format of an input nothing describes, from its first bytes."""
    return _sniff_any(head)


def _sniff_any(head: bytes) -> Format:
    """An input nothing describes (a file, an octet stream): its first bytes decide; text otherwise."""
    if FLUENT_MSGPACK.sniff is not None and FLUENT_MSGPACK.sniff(head):
        return FLUENT_MSGPACK
    for fmt, looks_like in _BINARY_SNIFFS:
        if looks_like(head):
            return fmt
    for fmt in _DOCUMENT_SNIFFS:
        if fmt.sniff is not None and fmt.sniff(head):
            return fmt
    return RECORDS if _looks_ndjson(head) else TEXT


class Sniffing:
    """Holds the first bytes until they tell which format this is, then hands everything to it."""

    def __init__(self, pick: Callable[[bytes], Format], meta: Meta) -> None:
        self.pick = pick
        self.meta = meta
        self.format: Format | None = None
        self._parser: Parser | None = None
        self._head = b""

    def feed(self, data: bytes) -> Batch:
        if self._parser is not None:
            return self._parser.feed(data)
        self._head += data
        if len(self._head) < SNIFF_BYTES:
            return Batch()
        return self._start().feed(self._take())

    def finish(self) -> Batch:
        if self._parser is None:
            parser = self._start()
            batch = parser.feed(self._take())
            return batch.merge(parser.finish())
        return self._parser.finish()

    def _take(self) -> bytes:
        head, self._head = self._head, b""
        return head

    def _start(self) -> Parser:
        self.format = self.pick(self._head)
        self._parser = self.format.parser(self.meta)
        return self._parser


def choose(meta: Meta, *, name: str | None = None, content_type: str | None = None,
           protobuf: Format = OTLP_PROTOBUF, http: bool = True) -> tuple[str, Parser]:
    """The parser for an input: by `name` (a format name or "auto"), else by the media type the formats
    declare (`Format.media_types`, nothing else lists them), else by its first bytes. Protobuf bodies cannot
    be told apart by their bytes: the endpoint says which (`protobuf`). A media type several formats declare
    (`application/json`: records, an OTLP or a Loki document) is decided by the first bytes among those, and
    so is any media type of a JSON format (`application/x-ndjson`) or with the structured-syntax suffix
    `+json` (`application/vnd.vector+json`). Over HTTP no media type means
    text; a file (`http=False`) with none (or an octet stream) is sniffed. A media type no format declares is
    refused (`unsupported_media_type`): `text/csv` is not log lines. Returns (the format's name, or "auto"
    until the bytes decide; the parser)."""
    if name and name != "auto":
        fmt = by_name(name)
        return fmt.name, fmt.parser(meta)
    media = media_type(content_type)
    if not http and media in ("", _OCTET_STREAM):
        return "auto", Sniffing(_sniff_any, meta)
    if not media:
        return TEXT.name, TEXT.parser(meta)
    if media in protobuf.media_types:
        return protobuf.name, protobuf.parser(meta)
    candidates = declaring(media if not media.endswith("+json") else _JSON)
    if any(_JSON in f.media_types for f in candidates):
        # a JSON media type (application/x-ndjson too): whichever JSON document follows, its bytes say
        candidates = declaring(_JSON)
    if len(candidates) == 1:
        return candidates[0].name, candidates[0].parser(meta)
    if candidates:
        return "auto", Sniffing(_sniff_among(candidates), meta)
    raise FormatError("unsupported", "unsupported_media_type",
                      f"unsupported Content-Type {media!r}: one of {', '.join(sorted(media_types()))} "
                      "(or any +json type)")


_OCTET_STREAM = "application/octet-stream"
_JSON = "application/json"


def declaring(media: str) -> list[Format]:
    """The formats that declare this media type, in `FORMATS` order (a format whose bytes say nothing of it
    other than it being one, like the JSON records, first)."""
    return [f for f in FORMATS.values() if media in f.media_types]


def media_types() -> frozenset[str]:
    """Every media type some format declares (what the service accepts, and its error says)."""
    return frozenset(m for f in FORMATS.values() for m in f.media_types)


def _sniff_among(candidates: list[Format]) -> Callable[[bytes], Format]:
    """The first bytes decide among formats sharing a media type: a document's own shape first (an OTLP or
    Loki JSON document), else the first candidate that sniffs nothing narrower (JSON records)."""
    narrow = [f for f in _DOCUMENT_SNIFFS if f in candidates]
    rest = next((f for f in candidates if f not in narrow), candidates[0])

    def pick(head: bytes) -> Format:
        return next((f for f in narrow if f.sniff is not None and f.sniff(head)), rest)

    return pick


def read_stream(f: BinaryIO, meta: Meta, name: str | None = None, piece: int = 1 << 20) -> Iterator[Batch]:
    """A whole input (a file, stdin), piece by piece, as batches. A piece is what the input has ready (up to
    `piece` bytes): lines piped in from a live job are read as they come, not once a megabyte has gathered."""
    _, parser = choose(meta, name=name, http=False)
    read = getattr(f, "read1", f.read)
    while True:
        data = read(piece)
        if not data:
            break
        batch = parser.feed(data)
        if batch.lines or batch.refused:
            yield batch
    yield parser.finish()
