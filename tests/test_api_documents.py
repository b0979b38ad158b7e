"""Bounded documents against a real server (issue 20, point 1): protobuf and snappy bombs, record
caps, empty records, every Content-Encoding judged on what it produces, and work that stops when
the client is gone. Memory and CPU are the server process's own, read from /proc by the test."""

from __future__ import annotations

import gzip
import json
import socket
import time
from collections.abc import Iterator

import cramjam
import pytest

from api_server import Server
from logdx.formats.codecs import zstd
from logdx.formats.loki import PushRequest
from logdx.testing import cpu_budget
from test_api_bounds import _cpu_s, _status

pytestmark = pytest.mark.integration
MB = 1 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("documents"), server={"max_request_cpu_s": 60.0},
                 # The record cap at a fifth of its default: the bombs hit it as they would the default, at a fifth
                 # of the parsing (an NDJSON record costs the server ~5-16 us of CPU, by the machine).
                 extra={"input": {"max_records": 200_000}}).start()
    yield srv
    srv.stop()


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _otlp_empty_records(n: int) -> bytes:
    """ExportLogsServiceRequest{resource_logs{scope_logs{log_records: n empty records}}}: 2 bytes each."""
    return _field(1, _field(2, b"\x12\x00" * n))


def _loki_empty_entries(n: int) -> bytes:
    stream = _field(1, b'{job_id="bomb"}') + b"\x12\x00" * n
    return bytes(cramjam.snappy.compress_raw(_field(1, stream)))


def _measured(server: Server, send) -> tuple:  # type: ignore[no-untyped-def]
    before, cpu0 = _status(server, "VmHWM"), _cpu_s(server)
    answer = send()
    return answer, (_status(server, "VmHWM") - before) / 1024, _cpu_s(server) - cpu0


def test_otlp_bomb_of_empty_records_is_refused_in_bounded_memory_and_cpu(server: Server) -> None:
    """30 MB of OTLP protobuf holding 15 M empty log records (it took 18.8 CPU-s and 1.8 GB)."""
    body = _otlp_empty_records(15_000_000)
    assert len(body) > 28 * MB
    with server.client(timeout=120) as c:
        r, grew_mb, cpu = _measured(server, lambda: c.post(
            "/v1/logs", content=body, headers={"content-type": "application/x-protobuf", "x-logdx-job": "otlp-bomb"}))
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_records", r.text
    assert grew_mb < 150, f"peak RSS grew {grew_mb:.0f} MB"
    assert cpu < cpu_budget(6), f"{cpu:.1f} CPU-s"
    with server.client() as c:
        assert c.get("/v1/jobs/otlp-bomb").status_code == 404 or c.get("/v1/jobs/otlp-bomb").json()["lines"] == 0


@pytest.mark.parametrize("entries", [10_000_000, 20_000_000])
def test_loki_snappy_bomb_is_refused_in_bounded_memory_and_cpu(server: Server, entries: int) -> None:
    """A ~1 MB snappy body of millions of empty entries (20 M once took 1.9 GB and minutes): 10 M fit the
    document bound and hit the record cap; 20 M declare more than the document bound and are refused
    before anything is inflated."""
    body = _loki_empty_entries(entries)
    with server.client(timeout=120) as c:
        r, grew_mb, cpu = _measured(server, lambda: c.post(
            "/loki/api/v1/push", content=body, headers={"content-type": "application/x-protobuf"}))
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] in ("too_many_records", "document_too_large"), r.text
    assert grew_mb < 150, f"peak RSS grew {grew_mb:.0f} MB"
    assert cpu < cpu_budget(6), f"{cpu:.1f} CPU-s"


def test_empty_records_make_no_lines_and_are_counted(server: Server) -> None:
    records = [{"log": "", "job_id": "empties"}, {"log": "   ", "job_id": "empties"},
               {"log": "real line", "job_id": "empties"}, {"log": "\n", "job_id": "empties"}]
    body = "\n".join(json.dumps(r) for r in records).encode()
    with server.client() as c:
        r = c.post("/v1/logs", content=body, headers={"content-type": "application/x-ndjson"})
        assert r.status_code == 200, r.text
        assert r.json()["accepted_lines"] == 1 and r.json()["refused"] == {"empty": 3}, r.text
        otlp = {"resourceLogs": [{"resource": {"attributes": [{"key": "job.id", "value": {"stringValue": "empties"}}]},
                                  "scopeLogs": [{"logRecords": [{"body": {"stringValue": ""}},
                                                                {"body": {"stringValue": "second"}}]}]}]}
        r = c.post("/v1/logs", json=otlp)
        assert r.status_code == 200 and r.json()["partialSuccess"]["rejectedLogRecords"] == "1", r.text
        assert c.get("/v1/jobs/empties").json()["lines"] == 2
        # only empty records: nothing usable, said with the counts
        r = c.post("/v1/logs", content=b'{"log": "", "job_id": "empties"}\n', headers={"content-type": "application/x-ndjson"})
        assert r.status_code == 422 and r.json()["error"]["refused"] == {"empty": 1}, r.text


def test_a_dense_json_document_is_refused_before_it_is_built(server: Server) -> None:
    """`[{},{},...]` costs ~80 bytes of memory per 3 bytes of body: refused by its density."""
    doc = b'{"streams": [{"stream": {"job_id": "dense"}, "values": [' + b"[]," * 8_000_000 + b'["1", "x"]]}]}'
    with server.client(timeout=60) as c:
        r, grew_mb, cpu = _measured(server, lambda: c.post(
            "/loki/api/v1/push", content=doc, headers={"content-type": "application/json"}))
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_records", r.text
    assert grew_mb < 150, f"peak RSS grew {grew_mb:.0f} MB"


LINES = [f"[rank{i % 8}]: iteration {i} | lm loss: 2.{i:04d}" for i in range(2000)]
TEXT = ("\n".join(LINES) + "\n").encode()


def _framed(data: bytes) -> bytes:
    out = bytearray(b"\xff\x06\x00\x00sNaPpY")
    for i in range(0, len(data), 65536):
        block = bytes(cramjam.snappy.compress_raw(data[i:i + 65536]))
        chunk = b"\0\0\0\0" + block  # the checksum is not checked
        out += b"\x00" + len(chunk).to_bytes(3, "little") + chunk
    return bytes(out)


@pytest.mark.parametrize("encoding,encode", [
    ("gzip", gzip.compress),
    ("zstd", lambda b: zstd.compress(b[: len(b) // 2]) + zstd.compress(b[len(b) // 2:])),  # two frames
    ("snappy", lambda b: bytes(cramjam.snappy.compress_raw(b))),  # block format
    ("snappy", _framed),  # framed, told apart by its stream identifier
    ("x-snappy-framed", _framed),
])
def test_every_content_encoding_is_read(server: Server, encoding: str, encode) -> None:  # type: ignore[no-untyped-def]
    job = f"enc-{encoding}-{encode.__name__}".replace("<", "").replace(">", "").replace("_", "-")
    with server.client() as c:
        r = c.post(f"/v1/jobs/{job}/logs", content=encode(TEXT),
                   headers={"content-encoding": encoding, "x-logdx-host": "node-1"})
        assert r.status_code == 200 and r.json()["accepted_lines"] == len(LINES), r.text


EMPTY_RECORDS = b'{"log": "", "job_id": "snappy-bomb"}\n' * 1_200_000


@pytest.mark.parametrize("encoding,bomb,code", [
    ("zstd", lambda: zstd.compress(b"\n" * (1 << 30)), "inflate_limit"),  # 32 KB -> 1 GB
    ("snappy", lambda: bytes(cramjam.snappy.compress_raw(b"\0" * (600 << 20))), "inflate_limit"),  # declares 600 MB
    # snappy never inflates more than ~21x: what bounds it is what the output holds (1.2 M empty records)
    ("x-snappy-framed", lambda: _framed(EMPTY_RECORDS), "too_many_records"),
])
def test_compression_bombs_of_every_encoding_are_refused(server: Server, encoding: str, bomb, code: str) -> None:  # type: ignore[no-untyped-def]
    body = bomb()
    with server.client(timeout=120) as c:
        r, grew_mb, cpu = _measured(server, lambda: c.post(
            f"/v1/jobs/bomb-{encoding}/logs", content=body,
            headers={"content-encoding": encoding, "content-type": "application/x-ndjson", "x-logdx-host": "n1"}))
    assert r.status_code == 413 and r.json()["error"]["code"] == code, r.text
    assert grew_mb < 150, f"peak RSS grew {grew_mb:.0f} MB"
    assert cpu < cpu_budget(8), f"{cpu:.1f} CPU-s"


def test_truncated_or_broken_compressed_bodies_are_400(server: Server) -> None:
    with server.client() as c:
        for encoding, body in [("zstd", zstd.compress(TEXT)[:-7]), ("x-snappy-framed", _framed(TEXT)[:-9]),
                               ("snappy", b"\x20" + b"garbage" * 3), ("zstd", b"not zstd at all")]:
            r = c.post("/v1/jobs/broken/logs", content=body, headers={"content-encoding": encoding, "x-a": "1"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "bad_encoding", (encoding, r.text)
        r = c.post("/v1/jobs/broken/logs", content=TEXT, headers={"content-encoding": "br", "x-a": "1"})
        assert r.status_code == 415


def _metric(server: Server, name: str, label: str) -> float:
    with server.client() as c:
        for line in c.get("/metrics").text.splitlines():
            if line.startswith(name) and label in line:
                return float(line.split()[-1])
    return 0.0


def test_work_stops_when_the_client_is_gone(server: Server) -> None:
    """A large OTLP document whose client hangs up once it is sent: the server stops parsing it (and
    applies nothing) instead of finishing the work for nobody. Measured in the server's CPU seconds
    against what the whole document costs when the client waits."""
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

    request = ExportLogsServiceRequest()
    scope = request.resource_logs.add().scope_logs.add()
    for i in range(150_000):
        rec = scope.log_records.add()
        rec.body.string_value = f"[rank{i % 64}]: step {i} loss 2.{i % 1000:03d} tokens/s 123{i % 97}"
        kv = rec.attributes.add()
        kv.key, kv.value.string_value = "job.id", "gone-full"
    full = request.SerializeToString()
    for rec in scope.log_records:
        rec.attributes[0].value.string_value = "gone-cut"
    cut = request.SerializeToString()

    cpu0 = _cpu_s(server)
    with server.client(timeout=300) as c:
        r = c.post("/v1/logs", content=full, headers={"content-type": "application/x-protobuf"})
    assert r.status_code == 200, r.text
    whole_cpu = _cpu_s(server) - cpu0

    gone_before = _metric(server, "logdx_ingest_rejected_total", 'reason="client_disconnected"')
    head = (f"POST /v1/logs HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nContent-Type: application/x-protobuf\r\n"
            f"Content-Length: {len(cut)}\r\nX-Requested-With: t\r\n\r\n").encode()
    cpu0 = _cpu_s(server)
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(head + cut)
        s.shutdown(socket.SHUT_RDWR)  # hang up at once, as a client that timed out does
    deadline = time.monotonic() + 300  # only a hung server fails on it
    while _metric(server, "logdx_ingest_rejected_total", 'reason="client_disconnected"') <= gone_before:
        assert time.monotonic() < deadline, "the server never noticed the client was gone"
        time.sleep(0.05)
    cut_cpu = _cpu_s(server) - cpu0
    assert cut_cpu < whole_cpu / 2, (cut_cpu, whole_cpu)
    with server.client() as c:
        job = c.get("/v1/jobs/gone-cut")
        assert job.status_code == 404 or job.json()["lines"] == 0, job.text


def test_loki_snappy_push_still_works(server: Server) -> None:
    req = PushRequest()
    stream = req.streams.add()
    stream.labels = '{job_id="loki-ok", host="node-3"}'
    for i in range(100):
        e = stream.entries.add()
        e.timestamp.seconds, e.line = 1700000000 + i, f"line {i}"
    e = stream.entries.add()
    e.line = ""  # an empty entry: counted, no line
    with server.client() as c:
        r = c.post("/loki/api/v1/push", content=bytes(cramjam.snappy.compress_raw(req.SerializeToString())),
                   headers={"content-type": "application/x-protobuf"})
        assert r.status_code == 200 and r.json()["refused"] == {"empty": 1}, r.text
        assert c.get("/v1/jobs/loki-ok").json()["lines"] == 100


# -- the small ones (issue 20 point 6) ------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/jobs/mp-job/logs", "/v1/logs", "/loki/api/v1/push"])
def test_the_seven_byte_msgpack_body_is_a_4xx_on_every_upload_endpoint(server: Server, path: str) -> None:
    body = bytes.fromhex("92 01 81 91 01 a1 78")  # [1, {[1]: "x"}]: a map keyed by a list
    with server.client() as c:
        r = c.post(path, content=body, headers={"content-type": "application/msgpack", "x-logdx-job": "mp-job"})
    assert 400 <= r.status_code < 500 and r.json()["error"]["code"] == "malformed_msgpack", r.text


@pytest.mark.parametrize("exit_code", [False, True, "1", 1.5])
def test_an_exit_code_must_be_an_integer(server: Server, exit_code: object) -> None:
    with server.client() as c:
        assert c.post("/v1/jobs/exit-job/logs", content=b"a line\n", headers={"x-a": "1"}).status_code == 200
        r = c.post("/v1/jobs/exit-job/end", json={"exit_code": exit_code})
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request", r.text
        assert c.get("/v1/jobs/exit-job").json()["state"] == "open"


def test_the_otlp_json_answer_is_the_declared_one(server: Server) -> None:
    """The answer to OTLP JSON is an ExportLogsServiceResponse: the schema /v1/logs declares it."""
    with server.client() as c:
        schema = c.get("/openapi.json").json()
        answer = c.post("/v1/logs", json={"resourceLogs": [{"scopeLogs": [{"logRecords": [
            {"body": {"stringValue": "no job here"}},
            {"body": {"stringValue": "x"}, "attributes": [{"key": "job.id", "value": {"stringValue": "otlp-ans"}}]}]}]}]})
    assert answer.status_code == 200, answer.text
    declared = schema["paths"]["/v1/logs"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    names = {ref["$ref"].rsplit("/", 1)[-1] for ref in declared["anyOf"]}
    assert names == {"RoutedIngestResponse", "OtlpExportResponse"}
    otlp = schema["components"]["schemas"]["OtlpExportResponse"]
    assert set(answer.json()) <= set(otlp["properties"]) and answer.json()["partialSuccess"]["rejectedLogRecords"] == "1"
    partial = schema["components"]["schemas"]["OtlpPartialSuccess"]["properties"]
    assert set(answer.json()["partialSuccess"]) == set(partial)
