"""What failures cost, rolled up across jobs: `job_costs` (SQLite and PostgreSQL), `logdx costs`,
`logdx nodes --by lost-gpu-hours`, the alert's cost line; a fleet of generated jobs with one lemon node."""

from __future__ import annotations

import io
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from logdx.act.alerts.slack import slack_payload
from logdx.act.alerts.webhook import webhook_payload
from logdx.act.costs import CostBook
from logdx.act.render import cost_sentence, render_text
from logdx.act.report import CostBlock, Report
from logdx.cli.app import main
from logdx.model import Category
from logdx.pipeline import Engine
from logdx.store import Database, open_db
from logdx.synth.attempts import AttemptPlan, write_attempts_job
from logdx.testing import Clock, diagnose_lines, failed_report

LEMON = "gpu-node-07"
FLAKY = "gpu-node-03"  # blamed more often than the lemon, but early in small jobs


@pytest.fixture
def db(backend_db: Database) -> Database:
    return backend_db


def _costed(hours: float | None, hosts: tuple[str, ...] = ("node-17",), **kw: object) -> Report:
    cost = CostBlock(gpus=64, lost_gpu_hours=hours, checkpoint_step=4000 if hours is not None else None,
                     since="checkpoint" if hours is not None else "",
                     notes=[] if hours is not None else ["failure time unknown: the log's lines carry no timestamps"])
    return failed_report(hosts=hosts, cost=cost, **kw)


def test_a_job_is_counted_once_and_its_rediagnosis_replaces_it(db: Database, clock: Clock) -> None:
    book = CostBook(db, clock=clock)
    first = book.record("job-1", _costed(100.0))
    assert first is not None and first.added_gpu_hours == 100.0
    again = book.record("job-1", _costed(130.0))  # more of the log read: the counter adds only the difference
    assert again is not None and again.added_gpu_hours == pytest.approx(30.0)
    assert book.record("job-1", _costed(120.0)).added_gpu_hours == 0  # type: ignore[union-attr]
    assert book.total() == (1, 120.0, 0)
    assert book.record("job-h", failed_report(status="healthy")) is None  # no cost: nothing recorded
    assert book.total()[0] == 1


def test_rollup_by_cause_category_node_and_since(db: Database, clock: Clock) -> None:
    book = CostBook(db, clock=clock)
    book.record("a", _costed(300.0, hosts=("node-1",)))
    book.record("b", _costed(100.0, hosts=("node-1", "node-2")))  # shared: 50 each
    book.record("c", _costed(None, hosts=("node-2",)))  # no timestamps: a job with no cost
    clock.t += 10 * 86400
    book.record("d", _costed(40.0, hosts=("node-9",), category=Category.SCRIPT, failure_type="key_error"))
    by_cause = {r.key: r for r in book.rollup("cause")}
    assert by_cause["gpu_fell_off_bus"].lost_gpu_hours == 400.0 and by_cause["gpu_fell_off_bus"].jobs == 3
    assert by_cause["gpu_fell_off_bus"].unknown == 1 and by_cause["key_error"].lost_gpu_hours == 40.0
    assert [(r.key, r.lost_gpu_hours) for r in book.rollup("category")] == [("infrastructure", 400.0), ("script", 40.0)]
    nodes = book.rollup("node")
    assert [(r.key, r.lost_gpu_hours) for r in nodes] == [("node-1", 350.0), ("node-2", 50.0)]  # no script's node
    assert [r.key for r in book.rollup("cause", since=clock() - 86400)] == ["key_error"]
    with pytest.raises(ValueError):
        book.rollup("colour")


def test_the_alert_and_the_terminal_say_what_it_cost() -> None:
    report = _costed(412.4)
    assert cost_sentence(report) == "this failure cost ~412 GPU-hours on 64 GPUs since the checkpoint at step 4000"
    assert "this failure cost ~412 GPU-hours" in render_text(report)
    slack = json.dumps(slack_payload_of(report))
    assert "This failure cost ~412 GPU-hours on 64 GPUs since the checkpoint at step 4000" in slack
    from logdx.act.alerts.base import Alert
    hook = webhook_payload(Alert(job_id="j", report=report, done=()), None, 0.0)
    assert hook["data"]["cost"].startswith("this failure cost ~412")
    unknown = cost_sentence(_costed(None))
    assert unknown.startswith("what this failure cost is unknown: failure time unknown")


def slack_payload_of(report: Report) -> dict:
    from logdx.act.alerts.base import Alert
    return slack_payload(Alert(job_id="j", report=report, done=()), None)


# -- a fleet of generated jobs with one lemon node ------------------------------------------------------------


@dataclass
class FleetJob:
    job_id: str
    lines: list[str]
    lost_gpu_hours: float
    culprit: str | None


def _fleet() -> list[FleetJob]:
    """16 nodes; the lemon's GPU falls off the bus late in three big jobs; a flaky node's in four small jobs just
    after a save; others fail on script/framework errors (charged to their cause, never to a node)."""
    rng = random.Random(32)
    nodes = [f"gpu-node-{i:02d}" for i in range(16)]
    jobs = []
    specs = [(LEMON, 8, 3400 + 170 * i, "xid79") for i in range(3)] + \
            [(FLAKY, 2, 1040 + 30 * i, "xid79") for i in range(4)] + \
            [(None, 4, 2600, "oom"), (nodes[11], 4, 3140, "xid79")]
    for n, (culprit, size, fail_at, ending) in enumerate(specs):
        others = [h for h in nodes if h != culprit]
        hosts = sorted(rng.sample(others, size - (culprit is not None)) + ([culprit] if culprit else []))
        plan = AttemptPlan(fail_at, ending, culprit_host=hosts.index(culprit) if culprit else 0, culprit_rank=3)
        out = io.StringIO()
        truth = write_attempts_job(out, [plan], hosts=hosts, seed=n, save_every=500)
        lost = truth.attempts[0].lost_gpu_hours
        assert lost is not None
        jobs.append(FleetJob(f"train-{n}", out.getvalue().splitlines(), lost, culprit))
    return jobs


@pytest.fixture(scope="module")
def fleet(engine: Engine) -> list[tuple[FleetJob, Report]]:
    return [(job, diagnose_lines(engine, job.lines)) for job in _fleet()]


def test_each_generated_failure_is_costed_within_ten_percent(fleet: list[tuple[FleetJob, Report]]) -> None:
    for job, report in fleet:
        assert report.status == "failed" and report.cost is not None, job.job_id
        got = report.cost.lost_gpu_hours
        assert got is not None and abs(got - job.lost_gpu_hours) <= 0.1 * job.lost_gpu_hours, job.job_id
        if job.culprit:
            assert report.culprits.hosts == [job.culprit]


def test_the_lemon_node_ranks_first_by_gpu_hours_not_by_count(db: Database, fleet: list[tuple[FleetJob, Report]]) -> None:
    book = CostBook(db)
    for job, report in fleet:
        book.record(job.job_id, report)
    nodes = book.rollup("node")
    assert nodes[0].key == LEMON and nodes[0].jobs == 3
    flaky = next(r for r in nodes if r.key == FLAKY)
    assert flaky.jobs > nodes[0].jobs and flaky.lost_gpu_hours < nodes[0].lost_gpu_hours
    want = sum(j.lost_gpu_hours for j, _ in fleet)
    assert abs(book.total()[1] - want) <= 0.1 * want


@pytest.fixture
def store_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("LOGDX_DATA_DIR", str(tmp_path / "data"))
    cfg = tmp_path / "logdx.yaml"
    cfg.write_text(f"store:\n  path: {tmp_path / 'logdx.db'}\n")
    yield cfg


@pytest.mark.slow
def test_cli_diagnose_stores_costs_and_the_commands_rank_them(
        store_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    jobs = _fleet()
    for job in jobs:
        log = tmp_path / f"{job.job_id}.log"
        log.write_text("\n".join(job.lines) + "\n")
        assert main(["diagnose", str(log), "--job-id", job.job_id, "--config", str(store_config), "--no-llm",
                     "--no-retrieval"]) in (0, 1)
    capsys.readouterr()
    assert main(["nodes", "--by", "lost-gpu-hours", "--json", "--config", str(store_config)]) == 0
    ranked = json.loads(capsys.readouterr().out)
    assert ranked[0]["node"] == LEMON
    assert main(["nodes", "--json", "--config", str(store_config)]) == 0  # the node list charges them too
    listed = {n["node"]: n for n in json.loads(capsys.readouterr().out)}
    assert listed[LEMON]["lost_gpu_hours"] == pytest.approx(ranked[0]["lost_gpu_hours"])
    assert main(["nodes", "--config", str(store_config)]) == 0
    assert "GPU-h lost" in capsys.readouterr().out
    assert main(["costs", "--by", "cause", "--since", "7d", "--json", "--config", str(store_config)]) == 0
    rolled = json.loads(capsys.readouterr().out)
    assert rolled["failed_jobs"] == len(jobs) and rolled["unknown"] == 0
    want = sum(j.lost_gpu_hours for j in jobs)
    assert abs(rolled["lost_gpu_hours"] - want) <= 0.1 * want
    assert {g["key"] for g in rolled["groups"]} == {"gpu_fell_off_bus", "cuda_oom"}
    assert main(["costs", "--by", "node", "--config", str(store_config)]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[2].startswith(LEMON)
    assert main(["costs", "--since", "7 days", "--config", str(store_config)]) == 2  # bad input: one line, exit 2
    assert "--since" in capsys.readouterr().err


def test_postgres_holds_the_same_rollup(pg_url: str, fleet: list[tuple[FleetJob, Report]]) -> None:
    pg, lite = open_db(pg_url), open_db(":memory:")
    try:
        for d in (pg, lite):
            book = CostBook(d)
            for job, report in fleet:
                book.record(job.job_id, report)
        assert CostBook(pg).rollup("node") == CostBook(lite).rollup("node")
        assert CostBook(pg).rollup("node")[0].key == LEMON
    finally:
        pg.close()
        lite.close()


# -- the service: the counter, the job page, the table ---------------------------------------------------------


@pytest.mark.slow
def test_the_service_counts_lost_gpu_hours_and_shows_them_on_the_job_page(tmp_path: Path, engine: Engine) -> None:
    import httpx

    from api_server import LoopbackApp
    from logdx.config import Settings

    out = io.StringIO()
    truth = write_attempts_job(out, [AttemptPlan(4350, "xid79", culprit_host=1)], hosts=["gpu-node-01", LEMON],
                               seed=11)
    want = truth.attempts[0].lost_gpu_hours
    assert want is not None
    settings = Settings.model_validate({"data_dir": str(tmp_path), "llm": {"enabled": False},
                                        "retrieval": {"enabled": False}, "server": {"local_operator": True}})
    with LoopbackApp(settings, engine) as app, httpx.Client(
            base_url=app.url, headers={"x-requested-with": "logdx-tests"}, timeout=30) as c:
        assert c.post("/v1/jobs/big-run.attempt-1/logs", content=out.getvalue().encode()).status_code == 200
        report = c.post("/v1/jobs/big-run.attempt-1/end", json={"exit_code": 1}).json()
        assert report["cost"]["checkpoint_step"] == 4000
        metrics = c.get("/metrics").text
        page = c.get("/jobs/big-run.attempt-1").text
        by_node = c.get("/v1/costs", params={"by": "node", "since_s": 86400}).json()
        refused = c.get("/v1/costs", params={"by": "colour"})
    assert by_node["groups"][0]["key"] == LEMON and by_node["failed_jobs"] == 1
    assert refused.status_code == 422 and refused.json()["error"]["code"]
    [sample] = [line for line in metrics.splitlines() if line.startswith("logdx_lost_gpu_hours_total{")]
    assert 'cause="gpu_fell_off_bus"' in sample and 'category="infrastructure"' in sample
    assert abs(float(sample.rsplit(" ", 1)[1]) - want) <= 0.1 * want
    assert 'id="cost"' in page and "since the checkpoint at step 4000" in page
    db = open_db(tmp_path / "logdx.db")
    try:
        assert CostBook(db).rollup("node")[0].key == LEMON
    finally:
        db.close()


def test_the_next_attempt_of_a_lineage_says_how_long_the_job_stood_still(db: Database, engine: Engine) -> None:
    # One job, two attempts submitted as NAME and NAME.attempt-2 (each its own log, as a scheduler writes them).
    out = io.StringIO()
    truth = write_attempts_job(out, [AttemptPlan(4350, "xid79", culprit_host=1, downtime_s=1200),
                                     AttemptPlan(4900, "oom", culprit_rank=2)], hosts=["gpu-node-01", LEMON], seed=21)
    lines = out.getvalue().splitlines()
    xid = next(i for i, line in enumerate(lines) if "NVRM: Xid" in line)
    cut = next(i for i, line in enumerate(lines) if i > xid and "Init COMPLETE" in line)  # attempt 2 starts
    first, second = lines[:cut], lines[cut:]
    assert any("successfully loaded checkpoint" in line for line in second[:200])
    book = CostBook(db)
    r1 = diagnose_lines(engine, first)
    book.record("pretrain-7b", r1)
    session = engine.new_session()
    session.feed_lines(second)
    r2 = session.report()
    book.record("pretrain-7b.attempt-2", r2)
    assert book.follow("pretrain-7b.attempt-2", session.summary().progress)
    row = book.row("pretrain-7b")
    t = truth.attempts[0]
    assert row is not None and t.next_first_step_ts is not None and t.passed_ts is not None and t.failure_ts
    assert abs(float(row["stood_still_s"]) - (t.next_first_step_ts - t.failure_ts)) <= 0.1 * 1200  # type: ignore[arg-type]
    back = t.passed_ts - t.failure_ts
    assert abs(float(row["back_after_s"]) - back) <= 0.1 * back  # type: ignore[arg-type]
    assert book.row("pretrain-7b.attempt-2")["attempt"] == 2  # type: ignore[index]
    book.record("pretrain-7b", r1)  # attempt 1 diagnosed again (a late node event): what attempt 2 told stays
    assert book.row("pretrain-7b") == row | {"ts": book.row("pretrain-7b")["ts"]}  # type: ignore[index]
    assert not book.follow("pretrain-7b", session.summary().progress)  # attempt 1 follows nothing


@pytest.mark.integration
def test_logdx_run_completes_the_failed_attempts_cost_from_the_next_attempt(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    out = io.StringIO()
    truth = write_attempts_job(out, [AttemptPlan(2350, "xid79", culprit_host=1, downtime_s=0),
                                     AttemptPlan(2600, "ok")], hosts=["gpu-node-01", LEMON], seed=31)
    lines = out.getvalue().splitlines()
    xid = next(i for i, line in enumerate(lines) if "NVRM: Xid" in line)
    cut = next(i for i, line in enumerate(lines) if i > xid and "Init COMPLETE" in line)
    (tmp_path / "attempt-1.log").write_text("\n".join(lines[:cut]) + "\n")
    (tmp_path / "attempt-2.log").write_text("\n".join(lines[cut:]) + "\n")
    child = tmp_path / "train.py"
    child.write_text("import os, sys\nn = os.environ['LOGDX_ATTEMPT']\n"
                     f"sys.stdout.write(open({str(tmp_path)!r} + f'/attempt-{{n}}.log').read())\n"
                     "sys.exit(1 if n == '1' else 0)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOGDX_")}
    env.update({"LOGDX_DATA_DIR": str(tmp_path / "data"), "NO_COLOR": "1"})
    config = tmp_path / "logdx.yaml"  # a dry-run actuator: logdx run then keeps a store (nothing is changed)
    config.write_text("actions:\n  actuator: slurm\n  dry_run: true\n")
    p = subprocess.run([sys.executable, "-m", "logdx", "run", "--config", str(config), "--no-llm", "--no-retrieval",
                        "--job-id", "pretrain",
                        "--backoff", "0.1", "--kill-grace", "2", "--", sys.executable, str(child)],
                       capture_output=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    db = open_db(tmp_path / "data" / "logdx.db")
    try:
        row = CostBook(db).row("pretrain/attempt-1")
    finally:
        db.close()
    t = truth.attempts[0]
    assert row is not None and t.lost_gpu_hours is not None and t.passed_ts is not None and t.failure_ts is not None
    assert abs(float(row["lost_gpu_hours"]) - t.lost_gpu_hours) <= 0.1 * t.lost_gpu_hours  # type: ignore[arg-type]
    back = t.passed_ts - t.failure_ts
    assert row["back_after_s"] is not None and abs(float(row["back_after_s"]) - back) <= 0.1 * back  # type: ignore[arg-type]
