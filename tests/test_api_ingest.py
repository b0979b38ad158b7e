"""Body parsing, decoding, the spool and the limits, without a server."""

from __future__ import annotations

import gzip
import json
import os
import zlib
from pathlib import Path

import pytest

from logdx.access.auth import Authenticator
from logdx.api.ingest import Decoder
from logdx.config import ServerSettings
from logdx.formats import Batch, FormatError, Meta, choose
from logdx.formats.fields import parse_ts
from logdx.formats.records import RecordsParser
from logdx.formats.text import TextParser
from logdx.jobs.limits import TokenBucket, check_job_id, is_loopback
from logdx.jobs.spool import DATA, END, InstanceLock, Spool, decode_runs, encode_runs
from logdx.normalize import Source
from logdx.wire.errors import ApiError


def _lines(batches: list[Batch]) -> list[tuple[Source, bytes]]:
    return [(s, line) for b in batches for _, s, lines in b.runs for line in lines]


def JsonParser(source: Source, max_line: int, max_record: int) -> RecordsParser:
    return RecordsParser(Meta(source=source, job="j", max_line_bytes=max_line, max_record_bytes=max_record))


def _text(source: Source, max_line: int) -> TextParser:
    return TextParser(Meta(source=source, job="j", max_line_bytes=max_line))


def _feed_all(parser, data: bytes, step: int) -> list[tuple[Source, bytes]]:
    batches = [parser.feed(data[i:i + step]) for i in range(0, len(data), step)]
    batches.append(parser.finish())
    return _lines(batches)


def test_text_lines_reassembled_across_any_split() -> None:
    data = b"first line\r\nsecond \xff\xfe line\n\nfourth\nno newline at the end"
    expected = [b"first line\r", b"second \xff\xfe line", b"", b"fourth", b"no newline at the end"]
    for step in (1, 2, 3, 7, 64, len(data)):
        got = _feed_all(_text(Source(rank=3), 1024), data, step)
        assert [line for _, line in got] == expected, step
        assert all(s.rank == 3 for s, _ in got)


def test_text_long_line_is_cut_in_bounded_memory() -> None:
    parser = _text(Source(), 300)
    data = b"short\n" + b"x" * 10_000 + b"\nafter\n"
    got = [line for _, line in _feed_all(parser, data, 1000)]
    assert got == [b"short", b"x" * 301, b"after"]  # one byte over the limit: the normaliser marks it
    assert len(parser._pending) <= 301


def test_binary_text_refused() -> None:
    with pytest.raises(FormatError) as e:
        _feed_all(_text(Source(), 1024), os.urandom(5000), 512)
    assert e.value.code == "binary_content"
    ansi = b"\x1b[32mINFO\x1b[0m colourful but fine\n" * 100
    assert len(_feed_all(_text(Source(), 1024), ansi, 100)) == 100


RECORDS = [
    {"log": "plain\n", "date": 1714564800.5, "stream": "stdout"},
    {"message": 'quotes " and \\ backslash } ] { [', "host": "gpu-node-01",
     "timestamp": "2024-05-01T12:00:00.123456789Z"},
    {"line": "unicode: déjà vu ✓ 😀", "rank": "7", "ts": 1714564800123},
    {"msg": "two\nlines", "rank": 2, "kubernetes": {"host": "gpu-node-02", "labels": {"a": [1, {"b": "}"}]}}},
    {"no_message_here": True},
    {"log": {"structured": 1}},
]


@pytest.mark.parametrize("shape", ["array", "ndjson", "concatenated", "pretty"])
def test_json_records_any_shape_any_split(shape: str) -> None:
    if shape == "array":
        data = json.dumps(RECORDS).encode()
    elif shape == "ndjson":
        data = "\n".join(json.dumps(r) for r in RECORDS).encode() + b"\n"
    elif shape == "concatenated":
        data = "".join(json.dumps(r, ensure_ascii=False) for r in RECORDS).encode()
    else:
        data = json.dumps(RECORDS, indent=2, ensure_ascii=False).encode()
    for step in (1, 5, 17, len(data)):
        parser = JsonParser(Source(host="default-host"), 1024, 1 << 20)
        got = _feed_all(parser, data, step)
        assert [line.decode() for _, line in got] == [
            "plain", 'quotes " and \\ backslash } ] { [', "unicode: déjà vu ✓ 😀", "two", "lines",
            '{"structured": 1}'], (shape, step)
        sources = [s for s, _ in got]
        assert sources[0].ts == 1714564800.5 and sources[0].stream == "stdout" and sources[0].host == "default-host"
        assert sources[1].host == "gpu-node-01" and abs(sources[1].ts - 1714564800.123456) < 1e-3
        assert sources[2].rank == 7 and sources[2].ts == pytest.approx(1714564800.123)
        assert sources[3].rank == 2 and sources[3].host == "gpu-node-02"
        assert parser.records == 6


@pytest.mark.parametrize("body", [b'[{"log": "a"} {"log": "b"}]', b'[{"log": "a"},]', b'[{"log": "a"}] x',
                                  b'{"log": "a"', b"[1, 2]", b'{"log": "a\\', b'[{"log": tru}]'])
def test_json_malformed(body: bytes) -> None:
    parser = JsonParser(Source(), 1024, 1 << 20)
    with pytest.raises(FormatError) as e:
        parser.feed(body)
        parser.finish()
    assert e.value.kind == "bad" and e.value.code == "malformed_json"


def test_json_record_size_bounded() -> None:
    parser = JsonParser(Source(), 1024, 10_000)
    with pytest.raises(FormatError) as e:
        for _ in range(10):
            parser.feed(b'[{"log": "' + b"x" * 2000)
    assert e.value.kind == "too_large" and e.value.code == "record_too_large"


def test_formats_by_content_type() -> None:
    def name(content_type: str | None, fmt: str | None = None) -> str:
        return choose(Meta(job="j"), name=fmt, content_type=content_type)[0]

    assert name(None) == "text"
    assert name("text/plain; charset=utf-8") == "text"
    assert name("application/x-www-form-urlencoded") == "text"  # curl's default
    assert name("application/json") == "auto"  # JSON records, or an OTLP / Loki document: its first bytes say
    assert name("application/x-ndjson") == "auto"
    assert name("application/vnd.vector+json") == "auto"
    assert name("application/msgpack") == "msgpack"
    assert name("application/x-protobuf") == "otlp"
    assert name("application/xml", "text") == "text"
    assert name(None, "json") == "ndjson"
    with pytest.raises(FormatError) as e:
        name("image/png")
    assert e.value.kind == "unsupported"


def test_timestamps() -> None:
    assert parse_ts(1714564800) == 1714564800.0
    assert parse_ts(1714564800123) == pytest.approx(1714564800.123)  # ms
    assert parse_ts(1714564800123456789) == pytest.approx(1714564800.123456)  # ns
    assert parse_ts("2024-05-01T12:00:00Z") == 1714564800.0
    assert parse_ts("2024-05-01 12:00:00.5") == 1714564800.5  # Fluent Bit java_sql_timestamp, no zone: UTC
    assert parse_ts("2024-05-01T14:00:00+02:00") == 1714564800.0
    assert parse_ts("yesterday") is None and parse_ts(True) is None and parse_ts(float("nan")) is None


def _decode(d: Decoder, blob: bytes, step: int) -> bytes:
    out = [piece for i in range(0, len(blob), step) for piece in d.feed(blob[i:i + step])]
    return b"".join(out) + b"".join(d.finish())


def test_decoder_gzip_members_deflate_sniff_and_bomb() -> None:
    text = b"line one\nline two\n" * 100
    for blob, enc in ((gzip.compress(text[:900]) + gzip.compress(text[900:]), "gzip"),
                      (zlib.compress(text), "deflate"), (gzip.compress(text), None), (text, None)):
        assert _decode(Decoder(enc, 1 << 20, 1 << 20, 200), blob, 7) == text, enc
    with pytest.raises(ApiError) as e:
        _decode(Decoder("gzip", 10_000, 1 << 20, 200), gzip.compress(b"\0" * 1_000_000), 1 << 20)
    assert e.value.status == 413 and e.value.code == "request_too_large"
    with pytest.raises(ApiError) as e:
        _decode(Decoder("gzip", 1 << 20, 1 << 20, 200), gzip.compress(text)[:-10], 1 << 20)
    assert e.value.code == "bad_encoding"


@pytest.mark.slow
def test_decoder_pieces_are_bounded_and_bombs_refused_early() -> None:
    """A 1 MB body of newlines inflates to ~1 GB: never more than a piece at a time, refused by its ratio."""
    bomb = gzip.compress(b"\n" * (1 << 30), 9)
    assert len(bomb) < 1_100_000
    for chunk in (65536, len(bomb)):  # the same few MB however the transport chunks the body
        d = Decoder("gzip", 1 << 40, 1 << 40, 200)
        largest = 0
        with pytest.raises(ApiError) as e:
            for i in range(0, len(bomb), chunk):
                for piece in d.feed(bomb[i:i + chunk]):
                    largest = max(largest, len(piece))
        assert e.value.status == 413 and e.value.code == "inflate_limit"
        assert largest <= 1 << 20 and d.decoded <= 6 << 20, (chunk, d.decoded)
    # one received chunk may not inflate past its own cap either
    d = Decoder("gzip", 1 << 40, 4 << 20, 1e9)
    with pytest.raises(ApiError) as e:
        for _ in d.feed(bomb):
            pass
    assert e.value.code == "inflate_limit"


def test_spool_round_trip_and_torn_tail(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "job.spool")
    runs = [(Source(rank=1, host="h", ts=1.5, stream="stderr"), [b"a", b"", b"c"]), (Source(), [b"d"])]
    meta, payload = encode_runs(runs, "gpu-node-[01-04]")  # the hosts the sender may speak for travel with the runs
    with spool.locked():
        spool.append(DATA, {"r": "req1", "s": meta}, payload)
        spool.append(END, {"r": "req1", "st": "ok"})
        good = spool.size()
        os.write(spool.fd, b"LDXS\x01\x00\x00\x00garbage")  # a record cut short by a crash
    records = list(spool.records(0))
    assert [r.type for r in records] == [DATA, END] and records[-1].end == good
    decoded = list(decode_runs(records[0].meta["s"], records[0].payload))
    assert decoded == [((1, "h", 1.5, "stderr", "gpu-node-[01-04]"), [b"a", b"", b"c"]),
                       ((None, None, None, None, "gpu-node-[01-04]"), [b"d"])]
    # A run spooled before scopes were kept (five fields) speaks for no host.
    assert list(decode_runs([[None, "h", None, None, 1]], b"x")) == [((None, "h", None, None, ""), [b"x"])]
    with spool.locked():
        spool.truncate(good)
    assert spool.size() == good
    spool.close()


def test_instance_liveness(tmp_path: Path) -> None:
    me = InstanceLock(tmp_path)
    other = InstanceLock(tmp_path)
    assert me.is_alive(other.id) and other.is_alive(me.id)
    other.close()
    assert not me.is_alive(other.id)
    assert not me.is_alive("never-existed")
    me.close()


def test_limits() -> None:
    for ok in ("job-1", "a", "A.b_c-9", "x" * 128):
        assert check_job_id(ok) == ok
    for bad in ("", "-a", ".a", "a/b", "a\n", "x" * 129, "ä"):
        with pytest.raises(ApiError):
            check_job_id(bad)
    auth = Authenticator(ServerSettings(token="abc"))
    assert auth.identify("Bearer abc").name == "server.token" and auth.identify("bearer  abc ").role == "operator"
    for bad in ("Bearer abd", None, "abc", "Basic abc", "Bearer "):
        with pytest.raises(ApiError) as e:
            auth.identify(bad)
        assert e.value.status == 401
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.9.9.9")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1") and not is_loopback("example.com")
    now = [0.0]
    bucket = TokenBucket(rate=100, burst=200, clock=lambda: now[0])
    assert bucket.wait_s() == 0
    bucket.take(500)  # overdraw: -300
    assert bucket.wait_s() == pytest.approx(3.01)
    now[0] = 3.5
    assert bucket.wait_s() == 0
    assert TokenBucket(rate=0, burst=1).wait_s() == 0  # disabled


def test_unexpected_errors_are_a_bare_500_json_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from logdx.api.errors import CatchAllMiddleware, install_error_handlers

    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(CatchAllMiddleware)

    @app.get("/boom")
    def boom() -> None:
        raise RuntimeError("secret internal detail")

    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.get("/boom")
    assert r.status_code == 500
    body = r.json()
    assert body["error"]["code"] == "internal_error" and r.headers["x-request-id"] in body["error"]["message"]
    assert "secret" not in r.text and "Traceback" not in r.text
    assert "secret internal detail" in caplog.text  # the operator gets the details
