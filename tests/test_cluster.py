"""More than one replica: real `logdx serve` processes on loopback sharing PostgreSQL (a schema of the
test's own) and NATS JetStream (a bus prefix of the test's own), a real webhook receiver, real
uploads from many concurrent clients, a real SIGKILL. Skipped, saying why, only when PostgreSQL or
NATS cannot be reached."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from api_server import Server, shipped_job, start_receiver
from conftest import NATS_URL, nats_unreachable
from logdx.act.actions import Actions
from logdx.bus.ownership import Ownership, SavedJob
from logdx.bus.records import partition_of
from logdx.config import ActionsSettings
from logdx.store import open_db
from logdx.testing import Fleet, failed_report

pytestmark = pytest.mark.integration


@pytest.fixture
def nats_prefix():
    why = nats_unreachable()
    if why:
        pytest.skip(why)
    prefix = "t" + uuid.uuid4().hex[:10]
    yield prefix
    asyncio.run(_delete_stream(f"{prefix}-lines"))


async def _delete_stream(name: str) -> None:
    import nats

    nc = await nats.connect(NATS_URL)
    try:
        await nc.jetstream().delete_stream(name)
    except Exception:
        pass
    await nc.close()


# --- leases, without servers ------------------------------------------------------------------------


def test_a_partition_has_one_owner_and_a_dead_owners_partition_moves(pg_url):
    db_a, db_b = open_db(pg_url), open_db(pg_url)
    try:
        a = Ownership(db_a, "replica-a", "worker", 4, lease_s=1.0)
        b = Ownership(db_b, "replica-b", "worker", 4, lease_s=1.0)
        a.heartbeat()
        b.heartbeat()
        assert a.fair_share() == (2, 2)
        claim = a.claim(2)
        assert claim is not None and claim.epoch == 1
        assert b.claim(2) is None  # a live lease: nobody else gets it
        assert a.renew({2: claim.epoch}) == set()
        assert a.save_snapshot(2, claim.epoch, 10, [SavedJob("job-1", 10, b"state", {"pending": {}})])
        time.sleep(1.2)  # replica-a stops renewing: its lease runs out
        taken = b.claim(2)
        assert taken is not None and taken.epoch == 2 and taken.snapshot_seq == 10
        assert a.renew({2: claim.epoch}) == {2}  # the old owner learns it lost the partition...
        assert not a.save_snapshot(2, claim.epoch, 99, [])  # ...and cannot overwrite the new owner's state
        assert b.job_state("job-1").seq == 10
        with pytest.raises(Exception, match="bus.partitions is 8"):
            Ownership(db_a, "replica-c", "worker", 8, lease_s=1.0)
    finally:
        db_a.close()
        db_b.close()


def test_the_stream_may_drop_only_what_every_partition_saved(pg_url):
    """`keep_from` per partition: the record after its snapshot, or the first DATA of a request that
    has not ended; the stream is purged below the least of all (a partition never saved: nothing)."""
    db = open_db(pg_url)
    try:
        own = Ownership(db, "replica-a", "worker", 2, lease_s=5.0)
        own.heartbeat()
        one, two = own.claim(0), own.claim(1)
        assert own.purge_floor() == 0  # partition 1 saved nothing yet
        assert own.save_snapshot(0, one.epoch, 40, [SavedJob("job-a", 40, b"s", {}, pending_seq=None)])
        assert own.save_snapshot(1, two.epoch, 55, [SavedJob("job-b", 55, b"s", {}, pending_seq=31)])
        assert own.purge_floor() == 31  # job-b's request that began at record 31 has not ended
        assert own.save_snapshot(1, two.epoch, 60, [SavedJob("job-b", 60, b"s", {}, pending_seq=None)])
        assert own.purge_floor() == 41
        assert own.claimable(held=False) == [] and own.claimable() == []
        own.release(0, one.epoch)
        assert own.claimable(held=False) == [0]
    finally:
        db.close()


def test_acknowledged_lines_count_once_per_key_and_a_reset_forgets_positions(pg_url):
    db = open_db(pg_url)
    try:
        own = Ownership(db, "replica-a", "worker", 1, lease_s=5.0)
        assert own.acked_lines("job-a") is None
        own.acknowledged("job-a", 40, "key-1", {"accepted_lines": 40})
        own.acknowledged("job-a", 40, "key-1", {"accepted_lines": 40})  # a retry whose first try got in
        own.acknowledged("job-a", 7, None, {"accepted_lines": 7})
        assert own.acked_lines("job-a") == 47 and own.committed_upload("job-a", "key-1") == {"accepted_lines": 40}
        from logdx.jobs.manager import COMPONENT, MIGRATIONS, PG_MIGRATIONS
        from logdx.store import migrate

        migrate(db, COMPONENT, MIGRATIONS, postgres=PG_MIGRATIONS)  # the jobs' own table, as the service has it
        db.execute("INSERT INTO api_jobs(job_id, created_at, updated_at) VALUES ('job-a', 0, 0)")
        own.heartbeat()
        claim = own.claim(0)
        own.save_snapshot(0, claim.epoch, 90, [SavedJob("job-a", 90, b"s", {"pending": {"r1": {"seqs": [88]}},
                                                                          "committed": [["key-1", {}]]}, 88)],
                          stream_created="2026-01-01T00:00:00Z")
        assert own.reset_partition(0, claim.epoch) == ["job-a"]
        state = own.job_state("job-a")
        assert (state.seq, state.bus_state["pending"], state.bus_state["committed"]) == (0, {}, [["key-1", {}]])
        row = own.partitions_table()[0]
        assert (row["snapshot_seq"], row["keep_from"]) == (0, 0)
        own.record_gap("job-a", 0, "stream_reset", None, "the stream was replaced")
        assert [g["kind"] for g in own.gaps("job-a")] == ["stream_reset"]
        own.forget_job_entirely("job-a")
        assert (own.gaps("job-a"), own.acked_lines("job-a"), own.job_state("job-a")) == ([], None, None)
    finally:
        db.close()


def test_two_replicas_racing_to_cordon_stay_within_the_cluster_wide_budget(pg_url, tmp_path, monkeypatch):
    """Two replicas (two connection pools) decide cordons for eight jobs blaming eight nodes at once;
    the budget allows two nodes per window: exactly two are cordoned, the others are refused."""
    import os
    import stat
    import sys

    bindir = tmp_path / "bin"
    bindir.mkdir()
    calls = tmp_path / "calls.txt"
    script = bindir / "scontrol"
    script.write_text(f"#!{sys.executable}\nimport sys, time\ntime.sleep(0.05)\n"
                      f"open({str(calls)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    settings = ActionsSettings(actuator="slurm", dry_run=False, max_cordons=2, cluster_size=100)
    replicas = [open_db(pg_url), open_db(pg_url)]
    try:
        actions = [Actions(db, settings) for db in replicas]
        barrier = threading.Barrier(8)

        def decide(i: int) -> list:
            report = failed_report(hosts=(f"gpu-node-{i:02d}",))
            barrier.wait()
            return actions[i % 2].apply(f"job-{i}", report)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            records = [r for out in pool.map(decide, range(8)) for r in out if r.action == "cordon"]
        done = [r for r in records if r.outcome == "ok"]
        assert len(done) == 2, [(r.node, r.outcome, r.detail) for r in records]
        assert sorted(r.outcome for r in records) == ["ok", "ok"] + ["refused"] * 6
        assert all("safety limit" in r.detail or "budget" in r.detail for r in records if r.outcome == "refused")
        assert len(calls.read_text().splitlines()) == 2  # scontrol ran twice, cluster-wide
    finally:
        for db in replicas:
            db.close()


# --- three replicas -----------------------------------------------------------------------------------


def _replicas(tmp_path: Path, pg_url: str, prefix: str, receiver, n: int = 3) -> list[Server]:
    extra = {
        "store": {"url": pg_url},
        "bus": {"url": NATS_URL, "prefix": prefix, "partitions": 4, "lease_s": 3.0, "snapshot_interval_s": 1.0},
    }
    return [Server(tmp_path / f"replica-{i}", receiver=receiver, extra=extra,
                   server={"replica_id": f"replica-{i}", "rate_limit_lines_per_s": 0}) for i in range(n)]


def _cluster(server: Server) -> dict:
    return httpx.get(server.url + "/v1/cluster", headers=server.headers, timeout=10).json()


def _wait(predicate, timeout: float, what: str, step: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"not within {timeout} s: {what}")


def test_three_replicas_survive_the_sigkill_of_the_jobs_owner(tmp_path, pg_url, nats_prefix):
    receiver = start_receiver()
    servers = _replicas(tmp_path, pg_url, nats_prefix, receiver)
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda s: s.start(timeout=120), servers))
        # Every replica owns a share of the four partitions.
        _wait(lambda: len({p["owner"] for p in _cluster(servers[0])["partitions"]} - {None}) == 3, 120,
              "the partitions spread over the three replicas")
        job_id = "llama-64-ranks"
        partition = partition_of(job_id, 4)
        owner = next(p["owner"] for p in _cluster(servers[0])["partitions"] if p["partition"] == partition)
        victim = int(owner.rsplit("-", 1)[1])
        job = shipped_job(lines=20_000)
        # 64 shippers, one per rank, in batches with an Idempotency-Key; a failed batch goes to the next replica
        up = Fleet([s.url for s in servers], job_id, job.per_client, headers=servers[0].headers)

        # First half of every rank's log, from 64 concurrent shippers...
        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            list(pool.map(lambda r: up.ship(r, 0.5), range(64)))
        before = _cluster(servers[(victim + 1) % 3])
        assert before["partitions"][partition]["owner"] == owner

        # ...then the owner is killed mid-stream while the shippers go on.
        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            futures = [pool.submit(up.ship, r) for r in range(64)]
            time.sleep(0.3)
            servers[victim].kill()
            killed_at = time.monotonic()
            up.dead.add(victim)
            survivor = servers[(victim + 1) % 3]
            new_owner = _wait(lambda: next((p["owner"] for p in _cluster(survivor)["partitions"]
                                            if p["partition"] == partition and p["owner"] not in (None, owner)), None),
                              120, "another replica takes the partition over")
            takeover_s = time.monotonic() - killed_at
            for f in futures:
                f.result()
        print(f"\ntakeover of partition {partition} ({owner} SIGKILLed -> {new_owner}): {takeover_s:.1f} s; "
              f"the shippers saw {dict(up.outcome.statuses)}")
        metrics = httpx.get(f"{servers[int(new_owner.rsplit('-', 1)[1])].url}/metrics").text
        assert f'logdx_partition_owned{{partition="{partition}",replica="{new_owner}"}} 1.0' in metrics
        assert f'logdx_ingest_lines_total{{format="text",replica="{new_owner}"}}' in metrics

        # The early diagnosis happens after the takeover (the root line came after the kill).
        detail = _wait(lambda: (d := httpx.get(f"{survivor.url}/v1/jobs/{job_id}", headers=survivor.headers)
                                .json()).get("report") and d, 120, "an early diagnosis")
        assert detail["report"]["failure_type"] == job.expected["failure_type"]

        # A retried batch counts once, whichever replica gets it.
        key, body = up.batches(0)[0]
        again = httpx.post(f"{survivor.url}/v1/jobs/{job_id}/logs", content=body,
                           headers={**survivor.headers, "idempotency-key": key}, timeout=30)
        assert again.status_code == 200 and again.json()["duplicate"] is True

        final = httpx.post(f"{survivor.url}/v1/jobs/{job_id}/end", json={"exit_code": 1},
                           headers=survivor.headers, timeout=60)
        assert final.status_code == 200, final.text
        report = final.json()
        assert {k: report[k] for k in job.expected} == job.expected
        assert report["culprits"]["hosts"] == job.culprit_hosts
        assert report["root_cause"]["text"] == job.root_line

        # No accepted line lost, none applied twice: the job holds exactly the acknowledged lines.
        assert up.lines == job.total
        for s in servers:
            if s is not servers[victim]:
                d = httpx.get(f"{s.url}/v1/jobs/{job_id}", headers=s.headers).json()
                assert (d["state"], d["lines"], d["compression"]["lines_in"]) == ("ended", up.lines, up.lines)

        # Exactly one alert per destination, whichever replica delivered it.
        receiver.wait_for("/hook", 1)
        time.sleep(3)
        hooks = [r.json() for r in receiver.of("/hook") if r.json()["type"] == "logdx.diagnosis"]
        assert len(hooks) == 1 and hooks[0]["data"]["job_id"] == job_id
        assert len(receiver.of("/slack")) == 1
    finally:
        for s in servers:
            s.stop()
        receiver.close()


def test_ingest_and_worker_replicas_split_the_work_and_a_stopped_worker_hands_back(tmp_path, pg_url, nats_prefix):
    from api_server import make_job, root_line_of

    extra = {"store": {"url": pg_url},
             "bus": {"url": NATS_URL, "prefix": nats_prefix, "partitions": 2, "lease_s": 3.0}}
    ingest = Server(tmp_path / "ingest", extra=extra, server={"replica_id": "ingest-0", "role": "ingest"})
    # One session in memory: the worker saves a job's session to PostgreSQL to make room for another's.
    worker = Server(tmp_path / "worker", extra=extra, server={"replica_id": "worker-0", "role": "worker",
                                                              "max_sessions": 1})
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda s: s.start(timeout=120), (ingest, worker)))
        _wait(lambda: {p["owner"] for p in _cluster(ingest)["partitions"]} == {"worker-0"}, 120,
              "the worker owns every partition, the ingest replica none")
        job = make_job(ranks=8, steps=5, culprit=3)
        lines = [line for rank_lines in job.values() for line in rank_lines]
        body = "\n".join(lines) + "\n"
        refused = httpx.post(f"{worker.url}/v1/jobs/j-1/logs", content=body, headers=worker.headers)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "not_ingest"
        lines.reverse()  # the culprit's Xid comes in the second half
        half = len(lines) // 2
        for n, part in enumerate((lines[:half], lines[half:])):  # j-1 and j-2 take turns: each evicts the other
            for job_id in ("j-1", "j-2"):
                ok = httpx.post(f"{ingest.url}/v1/jobs/{job_id}/logs", content="\n".join(part) + "\n",
                                headers=ingest.headers)
                assert ok.status_code == 200 and ok.json()["accepted_lines"] == len(part)
            if n == 0:
                applied = f'logdx_bus_applied_lines{{replica="worker-0"}} {2 * half}.0'
                # Two open jobs, one in memory (a job whose early diagnosis is pending stays until it is made).
                one = 'logdx_sessions_loaded{replica="worker-0"} 1.0'

                def scraped_when_applied(applied: str = applied, one: str = one) -> str | None:
                    text = httpx.get(f"{worker.url}/metrics").text
                    return text if applied in text and one in text.splitlines() else None

                _wait(scraped_when_applied, 120, "the worker applied both jobs' first halves, one left in memory")
        other = httpx.post(f"{ingest.url}/v1/jobs/j-2/end", json={"exit_code": 1}, headers=ingest.headers,
                           timeout=60).json()
        assert other["failure_type"] == "gpu_fell_off_bus" and other["compression"]["lines_in"] == len(lines)
        report = httpx.post(f"{ingest.url}/v1/jobs/j-1/end", json={"exit_code": 1}, headers=ingest.headers,
                            timeout=60).json()
        assert report["failure_type"] == "gpu_fell_off_bus" and report["root_cause"]["text"] == root_line_of(job, 3)
        seen = httpx.get(f"{worker.url}/v1/jobs/j-1", headers=worker.headers).json()
        assert (seen["state"], seen["lines"]) == ("ended", body.count("\n"))
        worker.stop()  # SIGTERM: save and hand back at once, without waiting for the lease
        parts = _cluster(ingest)["partitions"]
        assert all(p["owner"] is None for p in parts), parts
        replicas = {r["replica"]: r for r in _cluster(ingest)["replicas"]}
        assert replicas["worker-0"]["alive"] is False and replicas["ingest-0"]["alive"] is True
    finally:
        ingest.stop()
        worker.stop()
