"""Retention (issue 14, point 9): ended and idle jobs, reports, delivered alerts and audit rows go after
their configured age, by a periodic sweep counted in `logdx_retention_deleted_total{kind}`; what is
still needed stays. The service is real (uvicorn on loopback, a real webhook receiver); the sweep's
clock is moved by hand."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api_server import WEBHOOK_SECRET, LoopbackApp, Receiver, make_job, start_receiver
from logdx.config import Settings
from logdx.pipeline import Engine
from logdx.testing import Clock

DAY = 86400.0
SHIPPER = {"x-requested-with": "retention-test"}


def settings_for(tmp: Path, receiver: Receiver, **retention: Any) -> Settings:
    return Settings.model_validate({
        "data_dir": str(tmp), "llm": {"enabled": False}, "retrieval": {"enabled": False},
        "server": {"early_diagnosis_delay_s": 0.1, "local_operator": True},  # feedback is an operator's
        "alerts": {"webhooks": [{"url": receiver.url + "/hook", "secret": WEBHOOK_SECRET}],
                   "backoff_initial_s": 0.1, "backoff_max_s": 0.5},
        "actions": {"actuator": "slurm", "dry_run": True},
        "retention": retention,
    })


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    rx = start_receiver()
    yield rx
    rx.close()


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, receiver: Receiver) -> Engine:
    return Engine.create(settings_for(tmp_path_factory.mktemp("engine"), receiver))


def failing_job_body() -> bytes:
    return ("\n".join(line for lines in make_job(ranks=16, steps=10, culprit=5).values() for line in lines)
            + "\n").encode()


def count(app: LoopbackApp, table: str, where: str = "1") -> int:
    return int(app.services.db.query_value(f"SELECT COUNT(*) FROM {table} WHERE {where}"))


def wait_for(predicate: Any, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_each_kind_goes_after_its_age_and_what_is_needed_stays(tmp_path: Path, receiver: Receiver,
                                                               engine: Engine) -> None:
    settings = settings_for(tmp_path, receiver)  # the defaults: 30 / 7 / 90 / 30 / 90 days
    with LoopbackApp(settings, engine) as app, httpx.Client(base_url=app.url, headers=SHIPPER, timeout=60) as c:
        assert c.post("/v1/jobs/old-run/logs", content=failing_job_body()).status_code == 200
        final = c.post("/v1/jobs/old-run/end", json={"exit_code": 1}).json()
        assert final["status"] == "failed"
        assert c.post("/v1/jobs/idle-run/logs", content=b"step 1\nstep 2\n").status_code == 200
        oneshot = c.post("/v1/diagnose", content=failing_job_body()).json()["id"]
        confirmed = c.post("/v1/diagnose", content=failing_job_body()).json()["id"]
        assert c.post(f"/v1/reports/{confirmed}/feedback",
                      json={"category": "infrastructure", "failure_type": "gpu_fell_off_bus"}).status_code == 200
        wait_for(lambda: count(app, "alert_outbox", "status = 'delivered'") >= 1, "the alert's delivery")
        assert count(app, "action_audit", "dry_run = 1") >= 1
        spool = app.services.jobs.coord.spool_dir / "idle-run.spool"
        assert spool.exists()

        now = time.time()
        sweeper = app.services.sweeper
        sweeper.clock = clock = Clock(now + 3 * DAY)
        assert sum(sweeper.sweep().values()) == 0

        clock.t = now + 8 * DAY  # past idle_jobs_days (7)
        assert sweeper.sweep() == {"ended_jobs": 0, "idle_jobs": 1, "reports": 0, "alerts": 0, "audit": 0,
                                   "capsules": 0}
        assert c.get("/v1/jobs/idle-run").status_code == 404 and not spool.exists()
        assert c.get("/v1/jobs/old-run").json()["state"] == "ended"
        assert count(app, "web_job_views", "job_id = 'old-run'") == 1
        # the name is free again: a new upload makes a new job
        assert c.post("/v1/jobs/idle-run/logs", content=b"again\n").json()["job_lines"] == 1

        clock.t = now + 31 * DAY  # past ended_jobs_days and alerts_days (30)
        swept = sweeper.sweep()
        assert swept["ended_jobs"] == 1 and swept["alerts"] >= 1 and swept["reports"] == 0, swept
        assert c.get("/v1/jobs/old-run").status_code == 404
        assert count(app, "api_job_reports", "job_id = 'old-run'") == 0
        assert count(app, "web_job_views", "job_id = 'old-run'") == 0  # its page went with it
        assert count(app, "alert_outbox", "status != 'pending'") == 0
        assert c.get(f"/v1/reports/{oneshot}").status_code == 200  # reports keep 90 days

        clock.t = now + 91 * DAY  # past reports_days and audit_days (90)
        swept = sweeper.sweep()
        assert swept["reports"] >= 2 and swept["audit"] >= 1, swept  # old-run's, the one-shot
        assert c.get(f"/v1/reports/{oneshot}").status_code == 404
        assert c.get(f"/v1/reports/{final['id']}").status_code == 404
        assert c.get(f"/v1/reports/{confirmed}").status_code == 200  # a person's feedback: kept
        assert count(app, "action_audit", "dry_run = 1") == 0

        metrics = c.get("/metrics").text
        assert 'logdx_retention_deleted_total{kind="idle_jobs"} 2.0' in metrics  # the re-made job went at +31
        assert 'logdx_retention_deleted_total{kind="ended_jobs"} 1.0' in metrics
        assert 'logdx_retention_deleted_total{kind="audit"}' in metrics


def test_zero_keeps_forever(tmp_path: Path, receiver: Receiver, engine: Engine) -> None:
    settings = settings_for(tmp_path, receiver, ended_jobs_days=0, idle_jobs_days=0, reports_days=0,
                            alerts_days=0, audit_days=0)
    with LoopbackApp(settings, engine) as app, httpx.Client(base_url=app.url, headers=SHIPPER) as c:
        assert c.post("/v1/jobs/kept/logs", content=b"x\n").status_code == 200
        assert c.post("/v1/jobs/kept/end", json={}).status_code == 200
        app.services.sweeper.clock = Clock(time.time() + 10_000 * DAY)
        assert sum(app.services.sweeper.sweep().values()) == 0
        assert c.get("/v1/jobs/kept").status_code == 200


def test_the_periodic_sweep_runs_and_spares_the_cordon_window(tmp_path: Path, receiver: Receiver,
                                                              engine: Engine) -> None:
    # Ended jobs and audit rows older than ~0.9 s, swept every 0.2 s; the audit rows are younger than
    # actions.window_s (an hour), which the cordon budget reads: they stay.
    settings = settings_for(tmp_path, receiver, ended_jobs_days=1e-5, audit_days=1e-5, sweep_interval_s=0.2)
    with LoopbackApp(settings, engine) as app, httpx.Client(base_url=app.url, headers=SHIPPER, timeout=60) as c:
        assert c.post("/v1/jobs/short/logs", content=failing_job_body()).status_code == 200
        assert c.post("/v1/jobs/short/end", json={"exit_code": 1}).json()["status"] == "failed"
        wait_for(lambda: count(app, "action_audit") >= 1, "the audit row")
        wait_for(lambda: c.get("/v1/jobs/short").status_code == 404, "the sweep of the ended job")
        assert 'logdx_retention_deleted_total{kind="ended_jobs"} 1.0' in c.get("/metrics").text
        assert count(app, "action_audit") >= 1
