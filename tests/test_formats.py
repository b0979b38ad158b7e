"""The input formats (logdx.formats) on samples shaped as the real shippers send them, fed in pieces
cut anywhere; and the compressor's bounds on text that never repeats."""

from __future__ import annotations

import io
import json
import random
import struct
import subprocess
import sys
import time

import cramjam
import msgpack
import pytest
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord, ResourceLogs, ScopeLogs
from opentelemetry.proto.resource.v1.resource_pb2 import Resource

from logdx import formats
from logdx.formats import Batch, FormatError, Meta
from logdx.formats.fields import NO_JOB
from logdx.formats.loki import PushRequest, parse_labels
from logdx.formats.otlp import response

XID = "NVRM: Xid (PCI:0000:3b:00): 79, pid=14487, name=python, GPU has fallen off the bus."


def read(body: bytes, name: str = "auto", meta: Meta | None = None, step: int = 7) -> Batch:
    """The whole body through the format's parser, `step` bytes at a time."""
    _, parser = formats.choose(meta or Meta(), name=name, http=False)
    out = Batch()
    for i in range(0, len(body), step):
        out.merge(parser.feed(body[i:i + step]))
    return out.merge(parser.finish())


def lines(batch: Batch) -> list[tuple[str | None, str | None, int | None, str]]:
    return [(job, s.host, s.rank, line.decode()) for job, s, ls in batch.runs for line in ls]


# --- OTLP ------------------------------------------------------------------------------------------


def _kv(key: str, value: str | int) -> KeyValue:
    v = AnyValue(int_value=value) if isinstance(value, int) else AnyValue(string_value=value)
    return KeyValue(key=key, value=v)


def test_otlp_protobuf_resource_attributes_route_and_describe() -> None:
    req = ExportLogsServiceRequest(resource_logs=[
        ResourceLogs(resource=Resource(attributes=[_kv("host.name", "gpu-node-01"), _kv("slurm.job.id", "4242")]),
                     scope_logs=[ScopeLogs(log_records=[
                         LogRecord(time_unix_nano=1714564800_000000000, body=AnyValue(string_value=XID),
                                   attributes=[_kv("rank", 5), _kv("log.iostream", "stderr")]),
                         LogRecord(observed_time_unix_nano=1714564801_000000000,
                                   body=AnyValue(kvlist_value={"values": [_kv("event", "ckpt")]})),
                         LogRecord(body=AnyValue()),  # no body: refused, counted
                     ])]),
        ResourceLogs(resource=Resource(attributes=[_kv("k8s.node.name", "gpu-node-02")]),
                     scope_logs=[ScopeLogs(log_records=[LogRecord(body=AnyValue(string_value="no job here"))])]),
    ])
    batch = read(req.SerializeToString(), "otlp")
    # A record naming no job is a node's line (NO_JOB): the service keeps it by its host, or refuses it.
    assert lines(batch) == [("4242", "gpu-node-01", 5, XID), ("4242", "gpu-node-01", None, '{"event": "ckpt"}'),
                            (NO_JOB, "gpu-node-02", None, "no job here")]
    sources = [s for _, s, _ in batch.runs]
    assert sources[0].ts == 1714564800.0 and sources[0].stream == "stderr" and sources[1].ts == 1714564801.0
    assert batch.refused == {"no_message": 1}
    # The request's own job (X-Logdx-Job, a URL) wins for every record.
    assert {job for job, *_ in lines(read(req.SerializeToString(), "otlp", Meta(job="run-7")))} == {"run-7"}
    with pytest.raises(FormatError):
        read(b"\xff\xff\xff\xff garbage", "otlp")


def test_otlp_json_mapping() -> None:
    """lowerCamelCase keys, 64-bit integers as strings, enums as integers, hex ids; snake_case accepted."""
    body = {"resourceLogs": [{
        "resource": {"attributes": [{"key": "host.name", "value": {"stringValue": "gpu-node-00"}},
                                    {"key": "job.id", "value": {"stringValue": "run-42"}}]},
        "scopeLogs": [{"scope": {"name": "trainer"}, "logRecords": [
            {"timeUnixNano": "1714564800000000000", "severityNumber": 17, "severityText": "ERROR",
             "traceId": "5b8efff798038103d269b633813fc60c", "spanId": "eee19b7ec3c1b174",
             "body": {"stringValue": XID}, "attributes": [{"key": "rank", "value": {"intValue": "3"}}]},
            {"observed_time_unix_nano": "1714564801000000000", "body": {"string_value": "second\nline"}},
        ]}]}]}
    data = json.dumps(body).encode()
    batch = read(data)  # recognised by its first key
    assert lines(batch) == [("run-42", "gpu-node-00", 3, XID), ("run-42", "gpu-node-00", None, "second"),
                            ("run-42", "gpu-node-00", None, "line")]
    assert formats.choose(Meta(), content_type="application/json")[0] == "auto"
    proto, media = response(True, 2, "2 records name no job")
    assert media == "application/x-protobuf" and b"2 records name no job" in proto
    assert json.loads(response(False, 2, "x")[0]) == {"partialSuccess": {"rejectedLogRecords": "2", "errorMessage": "x"}}
    assert json.loads(response(False)[0]) == {}


# --- Loki --------------------------------------------------------------------------------------------


def test_loki_json_and_snappy_protobuf() -> None:
    doc = {"streams": [
        {"stream": {"job_id": "run-9", "node": "gpu-node-03", "rank": "2"},
         "values": [["1714564800000000000", XID], ["1714564801000000000", "next", {"trace_id": "abc"}]]},
        {"stream": {"app": "other"}, "values": [["1714564800000000000", "no job"]]},
    ]}
    batch = read(json.dumps(doc).encode())
    assert lines(batch) == [("run-9", "gpu-node-03", 2, XID), ("run-9", "gpu-node-03", 2, "next"),
                            (NO_JOB, None, None, "no job")]
    assert batch.runs[0][1].ts == 1714564800.0 and batch.refused == {}

    push = PushRequest()
    stream = push.streams.add(labels='{job_id="run-9", host="gpu-node-04", msg="a \\"quoted\\" label"}')
    entry = stream.entries.add(line=XID)
    entry.timestamp.seconds, entry.timestamp.nanos = 1714564800, 500_000_000
    body = bytes(cramjam.snappy.compress_raw(push.SerializeToString()))
    batch = read(body, "loki")
    assert lines(batch) == [("run-9", "gpu-node-04", None, XID)] and batch.runs[0][1].ts == 1714564800.5
    assert parse_labels('{a="1", b="x\\"y", c="z\\\\"}') == {"a": "1", "b": 'x"y', "c": "z\\"}
    with pytest.raises(FormatError):
        read(b"not snappy at all", "loki")


# --- Fluent Bit msgpack --------------------------------------------------------------------------------


def _event_time(ts: float) -> msgpack.ExtType:
    return msgpack.ExtType(0, struct.pack(">II", int(ts), int((ts % 1) * 1e9)))


def test_fluent_bit_msgpack_both_event_forms() -> None:
    v1 = msgpack.packb([_event_time(1714564800.25), {"log": XID + "\n", "stream": "stderr",
                                                     "kubernetes": {"host": "gpu-node-05",
                                                                    "labels": {"job-name": "train-3"}}}])
    v2 = msgpack.packb([[_event_time(1714564801.0), {}], {"log": "v2 line", "SLURM_JOB_ID": "88",
                                                          "hostname": "gpu-node-06"}])
    legacy = msgpack.packb([1714564802, {"message": "integer time", "job_id": "88"}])
    batch = read(v1 + v2 + legacy, step=5)
    assert lines(batch) == [("train-3", "gpu-node-05", None, XID), ("88", "gpu-node-06", None, "v2 line"),
                            ("88", None, None, "integer time")]
    assert [s.ts for _, s, _ in batch.runs] == [1714564800.25, 1714564801.0, 1714564802.0]
    assert batch.runs[0][1].stream == "stderr"
    with pytest.raises(FormatError) as e:
        read(v1[:-3], "msgpack")
    assert e.value.code == "malformed_msgpack"


# --- record shapes, wrappers, hosts ---------------------------------------------------------------


def test_common_record_shapes() -> None:
    records = [
        # Filebeat / Elastic Agent (ECS): `log` is an object, `message` is the line
        {"@timestamp": "2024-05-01T12:00:00.000Z", "message": XID, "log": {"file": {"path": "/var/log/x"}, "offset": 7},
         "host": {"name": "gpu-node-07"}, "job": {"id": "e1"}},
        # journald -o json
        {"MESSAGE": "journald line", "_HOSTNAME": "gpu-node-08", "__REALTIME_TIMESTAMP": "1714564800123456",
         "job_id": "e1"},
        # GELF
        {"version": "1.1", "short_message": "gelf line", "host": "gpu-node-09", "timestamp": 1714564800.5,
         "job_id": "e1"},
        # Docker json-file
        {"log": "docker line\n", "stream": "stdout", "time": "2024-05-01T12:00:00.5Z", "job_id": "e1"},
        # Fluent Bit tail without its CRI parser: the runtime's wrapper is in the line
        {"log": "2024-05-01T12:00:00.123456789Z stderr F cri line", "job_id": "e1"},
        # a host that is a Slurm range is no host; a rank that is a pod ordinal only when configured
        {"message": "ranged", "host": "gpu[001-512]", "kubernetes": {"pod_name": "trainer-12"}, "job_id": "e1"},
    ]
    data = "\n".join(json.dumps(r) for r in records).encode()
    batch = read(data, step=11)
    assert lines(batch) == [("e1", "gpu-node-07", None, XID), ("e1", "gpu-node-08", None, "journald line"),
                            ("e1", "gpu-node-09", None, "gelf line"), ("e1", None, None, "docker line"),
                            ("e1", None, None, "cri line"), ("e1", None, None, "ranged")]
    sources = [s for _, s, _ in batch.runs]
    assert sources[1].ts == pytest.approx(1714564800.123456) and sources[3].stream == "stdout"
    assert sources[4].stream == "stderr" and sources[4].ts == pytest.approx(1714564800.123457, abs=1e-5)
    with_ordinal = read(data, meta=Meta(rank_from_pod_ordinal=True))
    assert lines(with_ordinal)[-1][2] == 12


def test_journald_through_fluent_bit_with_lowercase_keys_names_the_host() -> None:
    """Fluent Bit's systemd input with `Lowercase On` sends `_hostname`, `message`,
    `__realtime_timestamp`: the kernel's line must keep its node, or no cordon can follow."""
    record = {"_transport": "kernel", "priority": "3", "syslog_identifier": "kernel", "_hostname": "gpu-node-11",
              "_boot_id": "9f0c7e", "__realtime_timestamp": "1714564800250000", "message": XID}
    body = msgpack.packb([[_event_time(1714564800.3), {}], record])
    batch = read(body, "msgpack", meta=Meta(job="j-11"), step=9)
    assert lines(batch) == [("j-11", "gpu-node-11", None, XID)]
    # The event's own time wins (Fluent Bit's), as for any record; the journald stamp is a fallback.
    assert batch.runs[0][1].ts == pytest.approx(1714564800.3)
    ndjson = json.dumps(record).encode() + b"\n"
    batch = read(ndjson, meta=Meta(job="j-11"))
    assert lines(batch) == [("j-11", "gpu-node-11", None, XID)]
    assert batch.runs[0][1].ts == pytest.approx(1714564800.25)


def test_saved_protobuf_bodies_are_recognised_by_their_structure() -> None:
    """A saved OTLP or Loki protobuf body is mostly the text of its lines: recognised by its tags
    and nested lengths, never read as text; text that starts with blank lines stays text."""
    records = [LogRecord(time_unix_nano=1714564800_000000000 + i, body=AnyValue(string_value=f"[rank{i}]: step 7 " * 9))
               for i in range(40)]
    otlp = ExportLogsServiceRequest(resource_logs=[ResourceLogs(
        resource=Resource(attributes=[_kv("host.name", "gpu-node-02"), _kv("job.id", "j-2")]),
        scope_logs=[ScopeLogs(log_records=records)])]).SerializeToString()
    assert formats.sniff_file(otlp[:formats.SNIFF_BYTES]).name == "otlp"
    assert read(otlp).lines == 40
    push = PushRequest()
    stream = push.streams.add(labels='{job_id="j-3", host="gpu-node-03"}')
    for i in range(40):
        stream.entries.add(line=f"[rank{i}]: step 7 " * 9).timestamp.seconds = 1714564800 + i
    loki = bytes(cramjam.snappy.compress_raw(push.SerializeToString()))
    assert formats.sniff_file(loki[:formats.SNIFF_BYTES]).name == "loki"
    assert read(loki).lines == 40
    for text in (b"\n\n\n[rank0]: iteration 1 loss 2.0\n" * 8, b"\n[rank0]: iteration 1\n" * 20,
                 b"\nT\n\n{job}\n" * 30, b"Traceback (most recent call last):\n" * 9):
        assert formats.sniff_file(text[:formats.SNIFF_BYTES]).name == "text", text[:20]


def test_cri_text_lines_joined_and_unwrapped() -> None:
    body = (b"2024-05-01T12:00:00.1Z stdout F [rank0]: iteration 1\n"
            b"2024-05-01T12:00:01.1Z stderr P a long line cut in \n"
            b"2024-05-01T12:00:01.2Z stderr F two parts\n")
    batch = read(body, meta=Meta(job="c"))
    assert [line for *_, line in lines(batch)] == ["[rank0]: iteration 1", "a long line cut in two parts"]
    assert batch.runs[-1][1].stream == "stderr"


def test_auto_detection_keeps_text_text() -> None:
    """A log whose lines start with brackets or braces is still text; NDJSON is one object per line."""
    text = b"[rank0]: [2024-05-01 12:00:00] iteration 1\n{not json} at all\n"
    assert formats.sniff_file(text).name == "text"
    assert formats.sniff_file(b'{"log": "a"}\n{"log": "b"}\n').name == "ndjson"
    assert formats.sniff_file(msgpack.packb([1714564800, {"log": "x"}])).name == "msgpack"
    assert formats.sniff_file(b'{"streams": [') .name == "loki-json"
    assert lines(read(text, meta=Meta(job="t")))[0][3] == "[rank0]: [2024-05-01 12:00:00] iteration 1"


# --- the compressor's bounds ---------------------------------------------------------------------------


@pytest.mark.slow
def test_lines_that_never_repeat_cost_bounded_cpu() -> None:
    """Random words (every line a new template) once made Drain quadratic: 2 MB cost 72 s of CPU."""
    from logdx.compress import Compressor
    from logdx.normalize import Normalizer

    rng = random.Random(3)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9))) for _ in range(50_000)]
    flood = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 15))) for _ in range(30_000)]
    assert sum(len(line) + 1 for line in flood) > 2_000_000
    compressor, normalizer = Compressor(), Normalizer()
    t0 = time.process_time()
    for line in flood:
        compressor.add(normalizer.normalize(line))
    cpu = time.process_time() - t0
    assert cpu < 10, cpu  # about 1 s here; 72 s before
    # An error line in the flood is still kept and found.
    kept = compressor.add(normalizer.normalize("gpu-node-3: " + XID))
    assert kept and kept[0].reason == "error"
    assert len(compressor.templates()) < 5000


@pytest.mark.integration
def test_cli_format_flag(tmp_path) -> None:
    doc = {"resourceLogs": [{"resource": {"attributes": [{"key": "host.name", "value": {"stringValue": "gpu-node-00"}}]},
                             "scopeLogs": [{"logRecords": [{"body": {"stringValue": "iteration 1 loss 2.0"}},
                                                           {"body": {"stringValue": "gpu-node-00 kernel: " + XID}}]}]}]}
    path = tmp_path / "otlp.json"
    path.write_text(json.dumps(doc))
    out = subprocess.run([sys.executable, "-m", "logdx", "diagnose", str(path), "--json", "--no-llm",
                          "--no-retrieval"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["failure_type"] == "gpu_fell_off_bus" and report["culprits"]["hosts"] == ["gpu-node-00"]
    bad = subprocess.run([sys.executable, "-m", "logdx", "diagnose", str(path), "--format", "msgpack", "--no-llm"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_read_stream_piecewise_matches_whole() -> None:
    data = "\n".join(json.dumps({"log": f"line {i}", "job_id": "j"}) for i in range(1000)).encode()
    whole = list(formats.read_stream(io.BytesIO(data), Meta()))
    assert sum(b.lines for b in whole) == 1000
