"""What every input format shares: the request's metadata in, batches of lines out.

A format turns bytes (a request body, a file) into lines, each with what the transport knew about it
(`Source`: rank, host, time, stream) and the job it belongs to. Parsers are incremental: `feed` takes
any piece of the input (a record may be cut anywhere) and returns the lines it completed; `finish`
says the input ended. They never hold more than one record (text, NDJSON, msgpack) or, for formats
that are one document (OTLP, Loki push), more than `Meta.max_document_bytes`.

Errors are `FormatError` (a status-like `kind`, a stable code, a message): the HTTP service turns
them into 4xx answers, the CLI into one line and exit 2. Nothing here knows about HTTP.

Bounds every parser keeps (a hostile body costs little whatever it holds): each record is counted
(`Meta.count`) against `Meta.max_records`, and every `TICK_RECORDS` records `Meta.tick` is called,
which is where the caller checks its CPU budget and whether its client is still there (it raises to
stop the work). A record whose message is empty gives no line: it is counted as refused (`empty`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from logdx.normalize import Source

DEFAULT_JOB_KEYS: tuple[str, ...] = (
    # plain names
    "job_id", "job.id", "jobid",
    # Slurm: a shipper started inside the job sees SLURM_JOB_ID; OpenTelemetry's convention
    "SLURM_JOB_ID", "slurm.job.id", "slurm_job_id",
    # Kubernetes: the resource attribute, the Job controller's pod labels (as Fluent Bit and the
    # OpenTelemetry k8sattributes processor name them)
    "k8s.job.name", "kubernetes.labels.job-name", "kubernetes.labels.batch.kubernetes.io/job-name",
    "k8s.pod.label.job-name", "k8s.pod.labels.job-name", "job_name",
)


class FormatError(Exception):
    """Input the format cannot use. `kind` is "bad" (malformed), "too_large" (a bound was hit) or
    "unsupported" (not this format at all)."""

    def __init__(self, kind: str, code: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.code = code
        self.message = message


@dataclass(slots=True)
class Meta:
    """What the transport says about the input as a whole."""

    source: Source = field(default_factory=Source)  # what every line shares (headers)
    job: str | None = None  # the request's job (URL path, X-Logdx-Job): every record's, when set
    job_keys: tuple[str, ...] = DEFAULT_JOB_KEYS  # where a record names its job otherwise
    max_line_bytes: int = 64 * 1024
    max_record_bytes: int = 1 << 20  # one JSON / msgpack record
    max_document_bytes: int = 32 << 20  # a format read whole (OTLP, Loki push)
    rank_from_pod_ordinal: bool = False  # "trainer-3" is rank 3 (only when a pod per rank is the rule)
    max_records: int = 0  # records (JSON, msgpack, OTLP, Loki) per input; 0: no limit (a local file)
    tick: Callable[[], None] | None = None  # called every TICK_RECORDS records; raises to stop the work
    records: int = 0  # records read so far

    def count(self, n: int = 1) -> None:
        """`n` more records read: past `max_records` the input is refused; every `TICK_RECORDS`, `tick`."""
        before = self.records
        self.records += n
        if self.max_records and self.records > self.max_records:
            raise FormatError("too_large", "too_many_records",
                              f"the body holds more than {self.max_records} records (input.max_records); "
                              "send smaller batches")
        if self.tick is not None and (before // TICK_RECORDS) != (self.records // TICK_RECORDS):
            self.tick()

    @property
    def cap(self) -> int:
        """Lines are cut one byte past the limit: the normaliser then marks them truncated."""
        return self.max_line_bytes + 1


TICK_RECORDS = 2048
Run = tuple[str | None, Source, list[bytes]]  # (job, source, lines)


@dataclass(slots=True)
class Batch:
    """Lines from one piece of input, in runs that share a job and a source; records that gave no
    line are counted by reason (`no_message`, `no_job`, ...), never silently dropped."""

    runs: list[Run] = field(default_factory=list)
    lines: int = 0
    refused: dict[str, int] = field(default_factory=dict)

    def add(self, job: str | None, source: Source, line: bytes) -> None:
        last = self.runs[-1] if self.runs else None
        if last is not None and last[0] == job and last[1] == source:
            last[2].append(line)
        else:
            self.runs.append((job, source, [line]))
        self.lines += 1

    def extend(self, job: str | None, source: Source, lines: list[bytes]) -> None:
        if not lines:
            return
        last = self.runs[-1] if self.runs else None
        if last is not None and last[0] == job and last[1] == source:
            last[2].extend(lines)
        else:
            self.runs.append((job, source, lines))
        self.lines += len(lines)

    def refuse(self, reason: str, n: int = 1) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + n

    def merge(self, other: Batch) -> Batch:
        for job, source, lines in other.runs:
            self.extend(job, source, lines)
        for reason, n in other.refused.items():
            self.refuse(reason, n)
        return self

    def by_job(self) -> dict[str | None, list[tuple[Source, list[bytes]]]]:
        out: dict[str | None, list[tuple[Source, list[bytes]]]] = {}
        for job, source, lines in self.runs:
            out.setdefault(job, []).append((source, lines))
        return out


class Document:
    """A parser for a format that is one document (OTLP, Loki push): the pieces are kept (up to
    `Meta.max_document_bytes`) and the document is read when the input ends."""

    def __init__(self, meta: Meta) -> None:
        self.meta = meta
        self._pieces: list[bytes] = []
        self._size = 0

    def feed(self, data: bytes) -> Batch:
        self._size += len(data)
        if self._size > self.meta.max_document_bytes:
            raise FormatError("too_large", "document_too_large",
                              f"a {type(self).__name__} body is read whole and may be at most "
                              f"{self.meta.max_document_bytes} bytes (decompressed); send smaller batches")
        self._pieces.append(data)
        return Batch()

    def finish(self) -> Batch:
        body, self._pieces = b"".join(self._pieces), []
        return self.read(body) if body.strip() else Batch()

    def read(self, body: bytes) -> Batch:
        raise NotImplementedError


# A JSON document holds at most one object or array per this many bytes: real OTLP and Loki JSON
# spend 25 bytes or more on each, while `[{},{},...]` spends 3 (and costs ~80 bytes of memory each).
JSON_BYTES_PER_CONTAINER = 16


def load_json_document(body: bytes, what: str, meta: Meta) -> Any:
    """A JSON document read whole, once it is known not to be a bomb of tiny objects or arrays."""
    containers = body.count(b"{") + body.count(b"[")
    if containers > 1024 + len(body) // JSON_BYTES_PER_CONTAINER:
        raise FormatError("too_large", "too_many_records",
                          f"the {what} body holds {containers} objects and arrays in {len(body)} bytes: "
                          "far denser than any log record; refused")
    if meta.tick is not None:
        meta.tick()
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:
        raise FormatError("bad", "malformed_json", f"the {what} body is not valid JSON: {e}") from None


class Parser(Protocol):
    """One input being read: pieces in, lines out."""

    def feed(self, data: bytes) -> Batch: ...

    def finish(self) -> Batch: ...


@dataclass(frozen=True, slots=True)
class Format:
    """An input format: its name, the media types that announce it, how to recognise its first
    bytes when nothing announces it, and its parser."""

    name: str
    media_types: frozenset[str]
    parser: Callable[[Meta], Parser]
    sniff: Callable[[bytes], bool] | None = None  # on the first bytes of the input (decoded)
    description: str = ""
