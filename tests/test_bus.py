"""The line bus's parts that need no server: records, partitions, pieces, session snapshots."""

from __future__ import annotations

import io

import pytest

from logdx.bus.records import DATA, END, BusRecord, Names, decode, encode, partition_of
from logdx.config import load_settings
from logdx.jobs.bus_ingest import _pieces
from logdx.normalize import Source
from logdx.pipeline import Session, SnapshotError


def test_a_record_survives_its_encoding():
    rec = BusRecord(DATA, "job-ü", {"r": "abc", "s": [[1, "node-1", None, None, 2]]}, b"line one\nline two")
    assert decode(encode(rec)) == rec
    assert decode(encode(BusRecord(END, "j", {"st": "ok", "n": 2}))).meta == {"st": "ok", "n": 2}
    with pytest.raises(ValueError):
        decode(b"not a record at all")


def test_partitions_are_stable_and_spread():
    assert partition_of("llama-7b-run42", 16) == partition_of("llama-7b-run42", 16)
    assert partition_of("llama-7b-run42", 16) == 11  # BLAKE2b: the same on every machine and version
    counts = [0] * 8
    for i in range(4000):
        counts[partition_of(f"job-{i}", 8)] += 1
    assert min(counts) > 400  # no partition is starved
    names = Names("team-a")
    assert (names.stream, names.subject(3), names.consumer(3)) == ("team-a-lines", "team-a.lines.3", "team-a-p3")


def test_a_request_is_published_in_pieces_of_bounded_size_with_every_line_once():
    src_a, src_b = Source(rank=1), Source(rank=2)
    runs = [(src_a, [b"x" * 100] * 50), (src_b, [b"y" * 10] * 7), (src_a, [b"z" * 5000])]
    pieces = list(_pieces(runs, 1000))
    assert all(sum(len(line) + 1 for _, lines in p for line in lines) <= 1000 + 5001 for p in pieces)
    assert len(pieces) > 5
    flat = [(s.rank, line) for p in pieces for s, lines in p for line in lines]
    assert flat == [(s.rank, line) for s, lines in runs for line in lines]


@pytest.mark.slow
def test_a_restored_session_goes_on_to_the_same_diagnosis(engine):
    from logdx.synth import generate

    buf = io.StringIO()
    generate(buf, scenario="xid79", seed=3, ranks=16, lines=6000, style="torchrun")
    lines = buf.getvalue().splitlines()
    whole, half = engine.new_session(), engine.new_session()
    whole.feed_lines(lines)
    half.feed_lines(lines[:4000])
    blob = half.snapshot()
    restored = Session.restore(engine, blob)
    assert restored.engine is engine and restored.lines == 4000
    restored.feed_lines(lines[4000:])
    a, b = whole.report(), restored.report()
    assert (a.failure_type, a.culprits.hosts, a.root_cause.line_no, a.compression) == \
        (b.failure_type, b.culprits.hosts, b.root_cause.line_no, b.compression)
    assert b.failure_type == "gpu_fell_off_bus"


def test_a_damaged_snapshot_is_refused_not_half_restored(engine):
    blob = engine.new_session().snapshot()
    with pytest.raises(SnapshotError):
        Session.restore(engine, blob[:-20])
    with pytest.raises(SnapshotError):
        Session.restore(engine, b"something else")


def test_a_role_without_a_bus_is_a_usage_error(capsys, monkeypatch):
    from logdx.api.server import main

    monkeypatch.delenv("LOGDX_BUS__URL", raising=False)
    assert main(["--role", "worker"]) == 2
    assert "--role worker needs bus.url" in capsys.readouterr().err


def test_cluster_settings_are_checked_when_read():
    from logdx.config import ConfigError

    with pytest.raises(ConfigError, match="bus.url needs store.url"):
        load_settings(env={"LOGDX_BUS__URL": "nats://127.0.0.1:4222"})
    with pytest.raises(ConfigError, match="postgresql://"):
        load_settings(env={"LOGDX_STORE__URL": "mysql://x"})
    s = load_settings(env={"LOGDX_STORE__URL": "postgresql://127.0.0.1/test", "LOGDX_BUS__URL": "nats://127.0.0.1:4222",
                           "LOGDX_BUS__PREFIX": "team-a", "LOGDX_SERVER__ROLE": "ingest"})
    assert (s.store.location, s.bus.prefix, s.server.role) == ("postgresql://127.0.0.1/test", "team-a", "ingest")


def test_unreachable_postgresql_or_nats_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    import socket

    from logdx.api.server import main

    def closed_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    config = tmp_path / "logdx.yaml"
    config.write_text(f"store: {{url: 'postgresql://127.0.0.1:{closed_port()}/x'}}\n"
                      f"bus: {{url: 'nats://127.0.0.1:{closed_port()}'}}\n")
    monkeypatch.setenv("LOGDX_CONFIG", str(config))
    assert main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("logdx serve: error: store.url postgresql://127.0.0.1:")
