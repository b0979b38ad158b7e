"""A false alarm silences its root line (act/silences.py): the same line again, from another node at another time,
is diagnosed as ever but pages nobody and touches no node; another line is not held; a tenant's silence holds only
that tenant's jobs; a silence ends. On SQLite and PostgreSQL, through the real Responder and a real webhook
receiver."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest

from logdx.act.feedback import record_false_alarm
from logdx.act.report import Report
from logdx.act.respond import Responder
from logdx.config import Settings, load_settings
from logdx.incidents import IncidentStore
from logdx.pipeline import Engine

SECRET = "whsec_" + base64.b64encode(b"0123456789abcdef01234567").decode()


@pytest.fixture
def db(backend_db: Any) -> Any:
    return backend_db


@pytest.fixture(scope="module")
def engine() -> Engine:
    settings = load_settings()
    settings.llm.enabled = False
    settings.retrieval.enabled = False
    return Engine.create(settings)


def _report(engine: Engine, tmp: Path, host: str, rank: int, extra: str = "") -> Report:
    lines = [f"[rank{rank}]:step {s} loss {2.0 - s / 100:.3f}" for s in range(1, 30)]
    lines.append(f"{host}: [rank{rank}]: RuntimeError: NCCL error in: ../torch/csrc/distributed/c10d/"
                 f"ProcessGroupNCCL.cpp:1970, unhandled system error (run with NCCL_DEBUG=INFO for details), "
                 f"NCCL version 2.19.3{extra}")
    path = tmp / f"{host}-{rank}.log"
    path.write_text("\n".join(lines) + "\n")
    return engine.diagnose_path(path)[0]


def _responder(db: Any, rx: Any, days: float = 30.0) -> Responder:
    return Responder(db, Settings(alerts={"webhooks": [{"url": rx.url + "/hook", "secret": SECRET}], "node_dedup_s": 0},
                                  actions={"false_alarm_silence_days": days}))


def test_a_false_alarm_holds_the_same_line_and_nothing_else(db: Any, engine: Engine, tmp_path: Path,
                                                            receiver: Any) -> None:
    store = IncidentStore(db, seed_path=None)
    first = _report(engine, tmp_path, "node-07", 3)
    assert first.status == "failed" and first.failure_type == "nccl_error", first.failure_type
    store.save_report(first.model_dump(mode="json"))
    with receiver.Receiver() as rx:
        responder = _responder(db, rx)
        assert responder.respond("job-1", first).alert_queued
        done = record_false_alarm(store, Settings(actions={"false_alarm_silence_days": 30}).actions, first.id,
                                  "the NCCL test suite's own probe")
        assert done.silence is not None and "silenced" in done.describe()

        again = _report(engine, tmp_path, "node-12", 5)  # the same line from another node and rank
        assert again.status == "failed" and again.failure_type == first.failure_type  # the verdict is the log's
        held = responder.respond("job-2", again)
        assert held.silenced_by is not None and held.silenced_by.report_id == first.id
        assert not held.alert_queued and held.actions == []

        other = _report(engine, tmp_path, "node-12", 5, extra=" while bootstrapping the communicator: Connection "
                        "reset by peer, ncclRemoteError")
        other_line = other.root_cause.text if other.root_cause else ""
        assert "Connection reset" in other_line
        assert responder.respond("job-3", other).silenced_by is None
        assert responder.outbox.deliver_due() == 2  # job-1's and job-3's, never job-2's
        assert sorted(b.json()["data"]["job_id"] for b in rx.wait_for(2)) == ["job-1", "job-3"]


def test_a_tenants_silence_holds_its_own_jobs_only_and_ends(db: Any, engine: Engine, tmp_path: Path,
                                                            receiver: Any) -> None:
    store = IncidentStore(db, seed_path=None)
    first = _report(engine, tmp_path, "node-07", 3)
    store.save_report(first.model_dump(mode="json"), tenant="team-a")
    with receiver.Receiver() as rx:
        responder = _responder(db, rx)
        record_false_alarm(store, Settings(actions={"false_alarm_silence_days": 30}).actions, first.id,
                           by_tenant="team-a")
        again = _report(engine, tmp_path, "node-12", 5)
        assert responder.respond("team-a:train-9", again).silenced_by is not None
        assert responder.respond("team-b:train-9", again).silenced_by is None  # another tenant's job pages
        later = Responder(db, Settings(actions={"false_alarm_silence_days": 30}), clock=lambda: 10 ** 10)
        assert later.silences.matching("team-a:train-9", again) is None  # ended


def test_no_silence_when_they_last_zero_days(db: Any, engine: Engine, tmp_path: Path) -> None:
    store = IncidentStore(db, seed_path=None)
    first = _report(engine, tmp_path, "node-07", 3)
    store.save_report(first.model_dump(mode="json"))
    done = record_false_alarm(store, Settings(actions={"false_alarm_silence_days": 0}).actions, first.id)
    assert done.silence is None
