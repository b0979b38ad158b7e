"""More than one replica: real `logdx serve` processes on loopback sharing PostgreSQL (a schema of the
test's own) and NATS JetStream (a bus prefix of the test's own), a real webhook receiver, real
uploads from many concurrent clients, a real SIGKILL. Skipped, saying why, only when PostgreSQL or
NATS cannot be reached."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from api_server import Server, ShippedJob, shipped_job, start_receiver
from conftest import NATS_URL, nats_unreachable
from logdx.act.actions import Actions
from logdx.bus.ownership import Ownership, SavedJob
from logdx.bus.records import partition_of
from logdx.config import ActionsSettings
from logdx.store import open_db
from logdx.testing import failed_report

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


class Uploads:
    """64 shippers, one per rank, each sending its lines in small batches with an Idempotency-Key,
    spread over the replicas; a batch whose replica fails or vanishes is sent again, same key, to the
    next one. Counts what was acknowledged, once per key."""

    def __init__(self, servers: list[Server], job_id: str, job: ShippedJob, batch: int = 40) -> None:
        self.servers = servers
        self.job_id = job_id
        self.job = job
        self.batch = batch
        self.dead: set[int] = set()
        self.acked: dict[str, int] = {}
        self.sent = 0
        self.retried = 0
        self.lock = threading.Lock()
        self.pause = threading.Event()
        self.pause.set()
        self.done_upto: dict[int, int] = {}

    def batches(self, rank: int) -> list[tuple[str, str]]:
        lines = self.job.per_client[rank]
        return [(f"{rank}-{i}", "\n".join(lines[i:i + self.batch]) + "\n") for i in range(0, len(lines), self.batch)]

    def ship(self, rank: int, upto: float = 1.0) -> None:
        """Send this rank's batches (the first `upto` share of them)."""
        todo = self.batches(rank)
        start = self.done_upto.get(rank, 0)
        stop = len(todo) if upto >= 1 else int(len(todo) * upto)
        with httpx.Client(timeout=30) as client:
            for n, (key, body) in enumerate(todo[start:stop], start=start):
                self.pause.wait()
                self._send(client, rank + n, key, body)
        self.done_upto[rank] = stop

    def _send(self, client: httpx.Client, turn: int, key: str, body: str) -> None:
        order = [(turn + k) % len(self.servers) for k in range(len(self.servers))]
        for attempt in itertools.count():
            i = order[attempt % len(order)]
            if i in self.dead:
                continue
            server = self.servers[i]
            try:
                r = client.post(f"{server.url}/v1/jobs/{self.job_id}/logs", content=body,
                                headers={**server.headers, "idempotency-key": key})
            except httpx.HTTPError:
                r = None
            if r is not None and r.status_code == 200:
                with self.lock:
                    self.acked[key] = r.json()["accepted_lines"]
                    self.sent += 1
                return
            with self.lock:
                self.retried += 1
            assert attempt < 50, f"batch {key} never accepted: {None if r is None else (r.status_code, r.text)}"
            time.sleep(0.2)

    @property
    def lines(self) -> int:
        return sum(self.acked.values())


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
        up = Uploads(servers, job_id, job)

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
              f"{up.sent} batches acknowledged, {up.retried} sent again after a failure")
        metrics = httpx.get(f"{servers[int(new_owner.rsplit('-', 1)[1])].url}/metrics").text
        assert f'logdx_partition_owned{{partition="{partition}",replica="{new_owner}"}} 1.0' in metrics
        assert f'logdx_ingest_lines_total{{format="text",replica="{new_owner}"}}' in metrics

        # The early diagnosis happens after the takeover (the root line came after the kill).
        detail = _wait(lambda: (d := httpx.get(f"{survivor.url}/v1/jobs/{job_id}", headers=survivor.headers)
                                .json()).get("report") and d, 30, "an early diagnosis")
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
