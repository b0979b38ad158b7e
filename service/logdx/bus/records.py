"""What travels on the line bus, and where: records, their encoding, partitions and names.

A job's records all go to one partition (a stable hash of the job id), so one worker sees them in
the order the stream accepted them. Three kinds, the spool's model carried over (`jobs/spool.py`):

- DATA: a piece of one upload request's lines for one job (with their sources), published as the
  body arrives;
- END: that request completed (`st` ok) or failed (`st` aborted); an ok END commits the first `n`
  lines of the request's DATA, once per Idempotency-Key `k` (its result `res` is what the client got);
- FIN: `POST /end`: the final diagnosis, after every line accepted before it.

Encoding: `LDX1`, the JSON meta's length (u32 LE), the meta, the payload (DATA: lines joined by LF).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DATA", "END", "FIN", "BusRecord", "Names", "decode", "encode", "partition_of"]

DATA, END, FIN = "data", "end", "fin"
_MAGIC = b"LDX1"
_LEN = struct.Struct("<I")


@dataclass(slots=True)
class BusRecord:
    kind: str  # DATA | END | FIN
    job_id: str
    meta: dict[str, Any] = field(default_factory=dict)
    payload: bytes = b""


def encode(rec: BusRecord) -> bytes:
    meta = json.dumps({"t": rec.kind, "j": rec.job_id, **rec.meta}, separators=(",", ":"),
                      ensure_ascii=False).encode()
    return _MAGIC + _LEN.pack(len(meta)) + meta + rec.payload


def decode(data: bytes) -> BusRecord:
    """A record from its bytes; ValueError for anything that is not one (never applied)."""
    if data[:4] != _MAGIC or len(data) < 8:
        raise ValueError("not a logdx bus record")
    (n,) = _LEN.unpack_from(data, 4)
    meta = json.loads(data[8:8 + n])
    kind, job_id = meta.pop("t"), meta.pop("j")
    if kind not in (DATA, END, FIN) or not isinstance(job_id, str):
        raise ValueError(f"bad bus record kind {kind!r}")
    return BusRecord(kind, job_id, meta, bytes(data[8 + n:]))


def partition_of(job_id: str, partitions: int) -> int:
    """The partition of a job: stable across processes, machines and versions. BLAKE2b, not crc32:
    a CRC is linear, and ids that differ only in their last characters (run-1, run-2...) land on
    a few partitions of an even count."""
    digest = hashlib.blake2b(job_id.encode("utf-8", "surrogateescape"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % partitions


@dataclass(frozen=True, slots=True)
class Names:
    """Stream, subject and consumer names under `bus.prefix` (deployments sharing one NATS differ by it)."""

    prefix: str

    @property
    def stream(self) -> str:
        return f"{self.prefix}-lines"

    @property
    def subjects(self) -> str:
        return f"{self.prefix}.lines.*"

    def subject(self, partition: int) -> str:
        return f"{self.prefix}.lines.{partition}"

    def consumer(self, partition: int) -> str:
        return f"{self.prefix}-p{partition}"
