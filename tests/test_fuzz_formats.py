"""Every input format's parser, and every Content-Encoding's inflater, fuzzed (hypothesis): random
bytes and mutations of real bodies (bytes flipped, inserted, cut, repeated). Whatever comes in, a
parser gives lines or a `FormatError` (an inflater a `CodecError`, the decoder an `ApiError`), never
another exception; and each input costs bounded memory and CPU, measured by the test itself
(tracemalloc's peak of the allocations it made, the thread's CPU time), not by wall time.

The run is bounded by example counts (`FUZZ_EXAMPLES`, more with LOGDX_FUZZ_EXAMPLES in a long run).
"""

from __future__ import annotations

import gzip
import json
import os
import time
import tracemalloc
import zlib

import cramjam
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

from logdx.api.ingest import Decoder
from logdx.formats import FORMATS, FormatError, Meta
from logdx.formats.codecs import CodecError, inflater, zstd
from logdx.formats.loki import PushRequest
from logdx.wire.errors import ApiError

pytestmark = pytest.mark.slow  # bounded by example counts; in `make test`, not `make test-fast`
FUZZ_EXAMPLES = int(os.environ.get("LOGDX_FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
MAX_RECORDS = 5000
# What one input may cost: a fixed allowance plus a multiple of its size.
CPU_S_BASE, CPU_S_PER_MB = 0.5, 4.0
MEM_BASE, MEM_PER_BYTE = 4 << 20, 40


def _otlp() -> bytes:
    req = ExportLogsServiceRequest()
    rl = req.resource_logs.add()
    kv = rl.resource.attributes.add()
    kv.key, kv.value.string_value = "job.id", "fuzz-1"
    for i in range(3):
        rec = rl.scope_logs.add().log_records.add()
        rec.time_unix_nano = 1_700_000_000_000_000_000 + i
        rec.body.string_value = f"[rank{i}]: step {i}\nsecond line"
        a = rec.attributes.add()
        a.key, a.value.int_value = "rank", i
    return req.SerializeToString()


def _loki() -> bytes:
    req = PushRequest()
    stream = req.streams.add()
    stream.labels = '{job_id="fuzz-2", host="node-1"}'
    for i in range(3):
        e = stream.entries.add()
        e.timestamp.seconds, e.line = 1_700_000_000 + i, f"line {i}"
        md = e.structuredMetadata.add()
        md.name, md.value = "rank", str(i)
    return bytes(cramjam.snappy.compress_raw(req.SerializeToString()))


SAMPLES: dict[str, bytes] = {
    "text": b"[rank0]: hello\n2024-01-01T00:00:00.000Z stdout F cri line\nplain \xff\xfe line\n",
    "ndjson": b'{"log": "a", "job_id": "j", "rank": 1}\n[{"message": "b", "host": "n-1"}, {"MESSAGE": "c"}]\n',
    "msgpack": msgpack.packb([1700000000, {"log": "x", "job_id": "j"}])
    + msgpack.packb([[msgpack.ExtType(0, b"\0\0\0\1\0\0\0\2"), {}], {"message": "y", "job_id": "j"}]),
    "otlp": _otlp(),
    "otlp-json": json.dumps({"resourceLogs": [{"resource": {"attributes": [
        {"key": "job.id", "value": {"stringValue": "j"}}]}, "scopeLogs": [{"logRecords": [
            {"timeUnixNano": "1700000000000000000", "body": {"stringValue": "hi"}},
            {"body": {"kvlistValue": {"values": [{"key": "k", "value": {"intValue": "3"}}]}}}]}]}]}).encode(),
    "loki": _loki(),
    "loki-json": json.dumps({"streams": [{"stream": {"job_id": "j"}, "values": [
        ["1700000000000000000", "a line"], ["1", "b", {"rank": "2"}]]}]}).encode(),
}
assert set(SAMPLES) == set(FORMATS)


@st.composite
def mutated(draw: st.DrawFn, sample: bytes) -> bytes:
    """A real body, changed a few times: bytes flipped, inserted or deleted, cut, a span repeated."""
    data = bytearray(sample)
    for _ in range(draw(st.integers(0, 6))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "cut", "repeat"]))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[pos] = draw(st.integers(0, 255))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and data:
            del data[pos:pos + draw(st.integers(1, 8))]
        elif op == "cut":
            del data[pos:]
        elif op == "repeat" and data:
            end = min(len(data), pos + draw(st.integers(1, 16)))
            data[pos:pos] = bytes(data[pos:end]) * draw(st.integers(1, 2000))
    return bytes(data)


def _bodies(name: str) -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=4096), mutated(SAMPLES[name]))


def _costs(fn) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    """(CPU seconds of this thread, peak bytes allocated) of `fn()`."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    t0 = time.thread_time()
    try:
        fn()
    finally:
        cpu = time.thread_time() - t0
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return cpu, peak


def _check_costs(size: int, cpu: float, peak: int) -> None:
    assert cpu < CPU_S_BASE + CPU_S_PER_MB * size / (1 << 20), f"{cpu:.2f} CPU-s for {size} bytes"
    assert peak < MEM_BASE + MEM_PER_BYTE * size, f"{peak} bytes allocated for {size} bytes"


def _parse(name: str, body: bytes, step: int) -> int:
    """Lines the format's parser makes of `body` fed in pieces of `step` bytes; FormatError passes."""
    meta = Meta(job=None, max_records=MAX_RECORDS, max_document_bytes=1 << 20)
    parser = FORMATS[name].parser(meta)
    lines = 0
    try:
        for i in range(0, len(body), step):
            lines += parser.feed(body[i:i + step]).lines
        lines += parser.finish().lines
    except FormatError as e:
        assert e.kind in ("bad", "too_large", "unsupported") and e.code and e.message
    assert meta.records <= MAX_RECORDS + 1
    return lines


@pytest.mark.parametrize("name", sorted(FORMATS))
@FUZZ
@given(data=st.data())
def test_every_parser_survives_any_body_in_bounded_memory_and_cpu(name: str, data: st.DataObject) -> None:
    body = data.draw(_bodies(name), label="body")
    step = data.draw(st.integers(1, max(1, len(body))), label="step")
    out: list[int] = []
    cpu, peak = _costs(lambda: out.append(_parse(name, body, step)))
    _check_costs(len(body), cpu, peak)
    # a line costs at least its newline (or, in a record, a few bytes of framing): never more lines than bytes
    assert out[0] <= len(body) + 1


def _encoders() -> dict[str, callable]:  # type: ignore[valid-type]
    return {"gzip": gzip.compress, "deflate": zlib.compress, "zstd": zstd.compress,
            "snappy": lambda b: bytes(cramjam.snappy.compress_raw(b)),
            "x-snappy-framed": lambda b: b"\xff\x06\x00\x00sNaPpY\x00" + (len(c := bytes(
                cramjam.snappy.compress_raw(b))) + 4).to_bytes(3, "little") + b"\0\0\0\0" + c}


@pytest.mark.parametrize("encoding", sorted(_encoders()))
@FUZZ
@given(data=st.data())
def test_every_inflater_survives_any_body_in_bounded_memory_and_cpu(encoding: str, data: st.DataObject) -> None:
    plain = data.draw(st.binary(max_size=2048) | st.just(b"\n" * 50_000), label="plain")
    body = data.draw(st.binary(max_size=2048) | mutated(_encoders()[encoding](plain)), label="body")
    step = data.draw(st.integers(1, max(1, len(body))), label="step")
    piece = 1 << 16

    def run() -> None:
        codec = inflater(encoding, piece, 1 << 20, 4 << 20)
        try:
            for i in range(0, len(body), step):
                for out in codec.feed(body[i:i + step]):
                    assert len(out) <= piece
            for out in codec.finish():
                assert len(out) <= piece
        except CodecError as e:
            assert e.kind in ("bad", "too_large")

    cpu, peak = _costs(run)
    _check_costs(len(body), cpu, peak)
    # the decoder, with the HTTP bounds: an ApiError (4xx) or pieces, never anything else
    decoder = Decoder(encoding, 2 << 20, 1 << 20, 50, 1 << 20)
    try:
        for i in range(0, len(body), step):
            for _ in decoder.feed(body[i:i + step]):
                pass
        for _ in decoder.finish():
            pass
    except ApiError as e:
        assert 400 <= e.status < 500
    assert decoder.decoded <= (2 << 20) + (1 << 20)  # the piece that crossed the bound, no more


def test_the_seven_byte_msgpack_body_is_malformed() -> None:
    """`92 01 81 91 01 a1 78`: [1, {[1]: "x"}], a map keyed by a list (an HTTP 500 before)."""
    with pytest.raises(FormatError) as e:
        _parse_strict("msgpack", bytes.fromhex("92018191 01a178"))
    assert e.value.code == "malformed_msgpack"


def _parse_strict(name: str, body: bytes) -> None:
    parser = FORMATS[name].parser(Meta(job="j"))
    parser.feed(body)
    parser.finish()
