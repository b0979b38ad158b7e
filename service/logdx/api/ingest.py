"""The HTTP side of ingestion: headers to a parser, bodies decoded in bounded pieces, a request's CPU
budget, and format errors as 4xx answers. The formats themselves are `logdx.formats`.

Bounds (issue: a 1 MB gzip body of newlines once inflated to 9.8 GB of RSS):

- a body is inflated `PIECE_BYTES` at a time, each piece parsed and spooled before the next is made,
  so memory does not grow with the body;
- what one received chunk inflates to, and what the whole request inflates to, are capped
  (`input.max_inflated_chunk_bytes`, `server.max_request_bytes`), and past 4 MB a body that inflates
  more than `input.max_inflate_ratio` times is refused: 413 in each case;
- the CPU time a request costs (decoding, parsing, spooling, applying) is capped
  (`server.max_request_cpu_s`): 429 with the lines applied so far.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

from starlette.requests import ClientDisconnect

from logdx.config import Settings
from logdx.formats import Batch, FormatError, Meta, Parser, choose, codecs
from logdx.formats.base import Format
from logdx.formats.fields import MAX_RANK, parse_rank
from logdx.hosts import clean_hostname
from logdx.jobs.budget import CpuBudget
from logdx.jobs.limits import JOB_ID_RULE
from logdx.normalize import Source
from logdx.tenancy import is_job_id
from logdx.wire.errors import ApiError

PIECE_BYTES = 1 << 20  # inflate this much at a time
_RATIO_AFTER = 4 << 20  # the inflate ratio is judged past this many inflated bytes: a bomb is refused early
_STATUS = {"bad": 400, "too_large": 413, "unsupported": 415}


def api_error(e: FormatError) -> ApiError:
    return ApiError(_STATUS.get(e.kind, 400), e.code, e.message)


# --- what the headers say ------------------------------------------------------------------------


def source_from_headers(headers: Mapping[str, str]) -> Source:
    """`X-Logdx-Rank`, `X-Logdx-Host`, `X-Logdx-Stream`: what every line of the request shares."""
    source = Source()
    rank = headers.get("x-logdx-rank")
    if rank is not None:
        source.rank = parse_rank(rank)
        if source.rank is None:
            raise ApiError(400, "bad_header", f"X-Logdx-Rank must be an integer in 0..{MAX_RANK - 1}")
    host = headers.get("x-logdx-host")
    if host is not None:
        source.host = clean_hostname(host)
        if source.host is None:
            raise ApiError(400, "bad_header", "X-Logdx-Host must be one plain host name (no range, list or spaces)")
    stream = headers.get("x-logdx-stream")
    if stream is not None:
        if stream not in ("stdout", "stderr"):
            raise ApiError(400, "bad_header", "X-Logdx-Stream must be stdout or stderr")
        source.stream = stream
    return source


def job_from_header(headers: Mapping[str, str]) -> str | None:
    job = headers.get("x-logdx-job")
    if job is None:
        return None
    if not is_job_id(job):
        raise ApiError(400, "bad_header", f"X-Logdx-Job {JOB_ID_RULE}")
    return job


def request_meta(settings: Settings, headers: Mapping[str, str], job: str | None) -> Meta:
    s = settings.input
    return Meta(
        source=source_from_headers(headers),
        job=job if job is not None else job_from_header(headers),
        job_keys=tuple(s.job_keys),
        max_line_bytes=s.max_line_bytes,
        max_record_bytes=s.max_record_bytes,
        max_document_bytes=s.max_document_bytes,
        rank_from_pod_ordinal=s.rank_from_pod_ordinal,
        max_records=s.max_records,
    )


def open_parser(meta: Meta, content_type: str | None, name: str | None, protobuf: Format | None = None) -> tuple[str, Parser]:
    try:
        if protobuf is None:
            return choose(meta, name=name, content_type=content_type)
        return choose(meta, name=name, content_type=content_type, protobuf=protobuf)
    except FormatError as e:
        raise api_error(e) from None


# --- decoding ------------------------------------------------------------------------------------


class Decoder:
    """Content-Encoding, streamed in bounded pieces: gzip (several members too), deflate, zstd,
    snappy (framed or block), or gzip found by its magic bytes (`logdx.formats.codecs`)."""

    def __init__(self, content_encoding: str | None, max_bytes: int, max_chunk_bytes: int,
                 max_ratio: float, max_held: int = 32 << 20) -> None:
        enc = codecs.canonical(content_encoding or "identity")
        if enc is None:
            raise ApiError(415, "unsupported_encoding",
                           f"unsupported Content-Encoding {(content_encoding or '')[:64]!r}: use gzip, deflate, zstd, "
                           "snappy or none")
        self.mode = enc
        self.sniff = self.mode == "identity"  # a gzip body sent without the header is still gzip
        self.max_bytes = max_bytes
        self.max_chunk_bytes = max_chunk_bytes
        self.max_ratio = max_ratio
        self.max_held = max_held
        self.received = 0
        self.decoded = 0
        self._inflater: codecs.Inflater | None = None
        self._head = b""

    @property
    def unread(self) -> int:
        """Received bytes the inflater has not used yet."""
        return self._inflater.unread if self._inflater is not None else 0

    def _codec(self) -> codecs.Inflater:
        if self._inflater is None:
            self._inflater = codecs.inflater(self.mode, PIECE_BYTES, self.max_held, self.max_bytes)
        return self._inflater

    def feed(self, data: bytes) -> Iterator[bytes]:
        """The decoded pieces of one received chunk, each at most PIECE_BYTES."""
        self.received += len(data)
        if self.sniff:
            self._head += data
            if len(self._head) < 2:
                return
            data, self._head, self.sniff = self._head, b"", False
            if data[:2] == b"\x1f\x8b":
                self.mode = "gzip"
        if self.mode == "identity":
            for i in range(0, len(data), PIECE_BYTES):
                yield self._count(data[i:i + PIECE_BYTES], 0)
            return
        from_chunk = 0
        with _codec_errors():
            for piece in self._codec().feed(data):
                from_chunk += len(piece)
                yield self._count(piece, from_chunk)

    def finish(self) -> Iterator[bytes]:
        if self.sniff and self._head:
            self.sniff = False
            head, self._head = self._head, b""
            yield self._count(head, 0)
            return
        if self.mode == "identity" or self._inflater is None:
            return
        from_chunk = 0
        with _codec_errors():
            for piece in self._inflater.finish():
                from_chunk += len(piece)
                yield self._count(piece, from_chunk)

    def _count(self, data: bytes, from_chunk: int) -> bytes:
        self.decoded += len(data)
        if self.decoded > self.max_bytes:
            raise ApiError(413, "request_too_large",
                           f"the body is larger than {self.max_bytes} bytes once decompressed "
                           "(server.max_request_bytes)")
        if from_chunk > self.max_chunk_bytes:
            raise ApiError(413, "inflate_limit",
                           f"a piece of the body inflates to more than {self.max_chunk_bytes} bytes "
                           "(input.max_inflated_chunk_bytes): a compression bomb?")
        # judged on the input consumed, not received: however the transport chunks the body, a bomb
        # is refused after the same few MB
        if self.decoded > _RATIO_AFTER and self.decoded > self.max_ratio * max(1, self.received - self.unread):
            raise ApiError(413, "inflate_limit",
                           f"the body inflates more than {self.max_ratio:g} times (input.max_inflate_ratio): "
                           "a compression bomb?")
        return data


@contextmanager
def _codec_errors() -> Iterator[None]:
    try:
        yield
    except codecs.CodecError as e:
        if e.kind == "too_large":
            raise ApiError(413, "inflate_limit", str(e)) from None
        raise ApiError(400, "bad_encoding", str(e)) from None


def make_decoder(settings: Settings, content_encoding: str | None) -> Decoder:
    s = settings.input
    return Decoder(content_encoding, settings.server.max_request_bytes, s.max_inflated_chunk_bytes,
                   s.max_inflate_ratio, s.max_document_bytes)


# --- one upload ----------------------------------------------------------------------------------


@dataclass
class Upload:
    """A request body being read: decoded, parsed, its CPU charged; batches out (worker threads)."""

    fmt: str
    decoder: Decoder
    parser: Parser
    budget: CpuBudget
    refused: dict[str, int] = field(default_factory=dict)
    gone: threading.Event = field(default_factory=threading.Event)  # the client went away: stop working

    def check(self) -> None:
        """Called while a piece or a document is parsed (`Meta.tick`): past the CPU budget, or once the
        client is gone, the work stops here rather than when the piece is done."""
        self.budget.charge()
        if self.budget.exceeded():
            raise self.budget.error(0)
        if self.gone.is_set():
            raise ClientDisconnect()

    @property
    def format_name(self) -> str:
        chosen = getattr(self.parser, "format", None)
        return chosen.name if chosen is not None else self.fmt

    _pieces: Iterator[bytes] | None = field(default=None, repr=False)

    def begin(self, chunk: bytes | None) -> None:
        """A received chunk (None: the body ended), to be decoded piece by piece with `step`."""
        self._pieces = self.decoder.feed(chunk) if chunk is not None else self._last()

    def step(self) -> Batch | None:
        """The lines of the next decoded piece of the chunk (at most PIECE_BYTES), None when it is used up:
        a chunk that inflates a thousandfold is never held, nor its lines, more than a piece at a time."""
        assert self._pieces is not None
        self.budget.start()
        try:
            piece = next(self._pieces, None)
            if piece is None:
                return None
            return self.parser.feed(piece) if piece else Batch()
        except FormatError as e:
            raise api_error(e) from None
        finally:
            self.budget.charge()
            if self.budget.exceeded():
                raise self.budget.error(0)

    def _last(self) -> Iterator[bytes]:
        yield from self.decoder.finish()

    def finish(self) -> Batch:
        self.budget.start()
        try:
            return self.parser.finish()
        except FormatError as e:
            raise api_error(e) from None
        finally:
            self.budget.charge()

    def pieces(self, chunk: bytes | None) -> Iterator[Batch]:
        """All of a chunk's batches in this thread (the one-shot diagnosis: nothing to spool in between)."""
        self.begin(chunk)
        while (batch := self.step()) is not None:
            yield batch
        if chunk is None:
            yield self.finish()


def runs_by_job(batch: Batch, refused: dict[str, int],
                node_runs: list[tuple[Source, list[bytes]]] | None = None) -> dict[str, list[tuple[Source, list[bytes]]]]:
    """The batch's lines by job; lines without a (valid) job id are counted in `refused`, except, when
    `node_runs` is given, lines that name no job but a host: those go there (a node's own lines)."""
    out: dict[str, list[tuple[Source, list[bytes]]]] = {}
    for job, runs in batch.by_job().items():
        if not job and node_runs is not None:
            for source, lines in runs:
                if source.host:
                    node_runs.append((source, lines))
                else:
                    refused["no_job"] = refused.get("no_job", 0) + len(lines)
            continue
        if not job or not is_job_id(job):
            reason = "no_job" if not job else "bad_job_id"
            refused[reason] = refused.get(reason, 0) + sum(len(lines) for _, lines in runs)
            continue
        out[job] = runs
    for reason, n in batch.refused.items():
        refused[reason] = refused.get(reason, 0) + n
    return out
