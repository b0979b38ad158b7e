"""Replicas under faults of what they stand on: NATS restarted, PostgreSQL restarted, the replica
taking over killed in turn, an operator's small stream, records removed from the bus behind the
owner's back.

Every test runs its own NATS JetStream and PostgreSQL (`logdx.testing.TempNats`/`TempPostgres`:
temporary directories, free loopback ports, never the machine's servers) and real `logdx serve`
replicas, with 64 shippers (`logdx.testing.Fleet`) streaming a 64-rank job in batches with
Idempotency-Keys, sending a failed batch again to the next replica. Each asserts what the issue asks:
the lines the job counted are the lines acknowledged (none lost, none twice), one alert, the right
diagnosis, and what the shippers saw (503 with Retry-After while a dependency is down, never a 500).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api_server import Server, ShippedJob, shipped_job, start_receiver
from logdx.bus.records import decode, partition_of
from logdx.testing import Fleet, TempNats, TempPostgres

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PARTITIONS = 4
JOB_LINES = 12_000


def _no_servers() -> str | None:
    from shutil import which

    if not (which("nats-server") or Path("/usr/sbin/nats-server").exists()):
        return "nats-server is not installed"
    if not list(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl")) and not which("pg_ctl"):
        return "the PostgreSQL server binaries (pg_ctl, initdb) are not installed"
    return None


@pytest.fixture(scope="module")
def own_pg() -> Iterator[TempPostgres]:
    why = _no_servers()
    if why:
        pytest.skip(why)
    pg = TempPostgres().start()
    yield pg
    pg.cleanup()


@pytest.fixture
def pg_url(own_pg: TempPostgres) -> str:
    """A database of this test's own on the module's PostgreSQL (started again if a test left it down)."""
    import psycopg

    if not own_pg.running:
        own_pg.start()
    name = "t_" + uuid.uuid4().hex[:12]
    with psycopg.connect(own_pg.url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return own_pg.url.rsplit("/", 1)[0] + f"/{name}"


@pytest.fixture
def own_nats(tmp_path: Path) -> Iterator[TempNats]:
    why = _no_servers()
    if why:
        pytest.skip(why)
    nats = TempNats(tmp_path / "nats").start()
    yield nats
    nats.stop()


@pytest.fixture
def receiver():
    rx = start_receiver()
    yield rx
    rx.close()


def _replicas(tmp_path: Path, pg_url: str, nats: TempNats, receiver, n: int = 3, roles: list[str] | None = None,
              bus: dict | None = None) -> list[Server]:
    extra = {
        "store": {"url": pg_url, "timeout_s": 2.0},
        "bus": {"url": nats.url, "partitions": PARTITIONS, "lease_s": 3.0, "snapshot_interval_s": 1.0,
                "timeout_s": 3.0, "store_grace_s": 3.0, "end_timeout_s": 5.0, **(bus or {})},
    }
    roles = roles or ["all"] * n
    return [Server(tmp_path / f"replica-{i}", receiver=receiver, extra=extra,
                   server={"replica_id": f"replica-{i}", "rate_limit_lines_per_s": 0, "role": roles[i]})
            for i in range(n)]


def _start(servers: list[Server]) -> None:
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(len(servers)) as pool:
        list(pool.map(lambda s: s.start(timeout=180), servers))


def _stop(servers: list[Server]) -> None:
    for s in servers:
        if s.proc is not None and s.proc.poll() is None:
            os.kill(s.proc.pid, signal.SIGCONT)  # a test may have paused it
        s.stop()


def _wait(predicate: Callable[[], object], timeout: float, what: str, step: float = 0.1) -> object:
    """Wait for a condition; the deadline only fails a test that hangs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except httpx.HTTPError:
            value = None
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"not within {timeout} s: {what}")


def _cluster(server: Server) -> dict:
    return httpx.get(server.url + "/v1/cluster", headers=server.headers, timeout=10).json()


def _owners(server: Server) -> dict[int, tuple[str, int]]:
    return {p["partition"]: (p["owner"], p["epoch"]) for p in _cluster(server)["partitions"]}


def _metric(server: Server, name: str) -> float | None:
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def _spread(servers: list[Server]) -> None:
    """Every replica owns partitions and the first balancing is over: the owners table stays the same
    for two balancing rounds (`lease_s / 3` each). Two replicas may each hand a partition back for one
    that looked starved a moment before, which shows only after every replica owns one."""
    seen: dict[str, Any] = {}

    def settled() -> bool:
        table, now = _owners(servers[0]), time.monotonic()
        owners = {owner for owner, _ in table.values()}
        if None in owners or len(owners) != len(servers) or table != seen.get("table"):
            seen.update(table=table, since=now)
            return False
        return now - seen["since"] >= 2.0

    _wait(settled, 120, "the partitions spread over the replicas")


def _fleet(servers: list[Server], job_id: str, job: ShippedJob, lines_per_s: float | None = 1500.0) -> Fleet:
    return Fleet([s.url for s in servers], job_id, job.per_client, headers=servers[0].headers,
                 lines_per_s=lines_per_s, timeout_s=60.0)


def _stream_with_fault(fleet: Fleet, fault: Callable[[], None], at_share: float = 0.25) -> None:
    _stream_with_faults(fleet, [(at_share, fault)])


def _stream_with_faults(fleet: Fleet, faults: list[tuple[float, Callable[[], None]]]) -> None:
    """The fleet streams the whole job; each fault runs, in turn, once its share of the job was
    acknowledged."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fleet.run()
        except BaseException as e:  # re-raised in the test's thread
            errors.append(e)

    shipping = threading.Thread(target=run)
    shipping.start()
    for share, fault in faults:
        _wait(lambda share=share: fleet.lines >= share * fleet.total or not shipping.is_alive(), 120,
              "the stream under way")
        assert shipping.is_alive(), "the job was shipped before the fault"
        fault()
    shipping.join()
    if errors:
        raise errors[0]


def _end(servers: list[Server], job_id: str) -> dict:
    """POST /end to a live replica until the final report comes (a 503 says when to try again)."""
    def ask() -> dict | None:
        for s in servers:
            if s.proc is None or s.proc.poll() is not None:
                continue
            r = httpx.post(f"{s.url}/v1/jobs/{job_id}/end", json={"exit_code": 1}, headers=s.headers, timeout=60)
            assert r.status_code in (200, 503), r.text
            if r.status_code == 200:
                return r.json()
            assert r.headers.get("retry-after"), r.text
        return None

    return _wait(ask, 120, "the final diagnosis", step=1.0)  # type: ignore[return-value]


def _assert_counted_once(servers: list[Server], job_id: str, fleet: Fleet, job: ShippedJob, report: dict,
                         receiver) -> None:
    assert {k: report[k] for k in job.expected} == job.expected
    assert report["culprits"]["hosts"] == job.culprit_hosts
    assert report["root_cause"]["text"] == job.root_line
    assert not [n for n in report["notes"] if n.startswith("incomplete")], report["notes"]
    assert fleet.lines == job.total  # every batch was acknowledged in the end...
    for s in servers:
        if s.proc is not None and s.proc.poll() is None:
            d = httpx.get(f"{s.url}/v1/jobs/{job_id}", headers=s.headers, timeout=10).json()
            # ...and the job holds exactly those lines: none lost, none twice
            assert (d["state"], d["lines"], d["compression"]["lines_in"]) == ("ended", fleet.lines, fleet.lines)
            assert d["bus_gaps"] == []
    receiver.wait_for("/hook", 1, timeout=30)
    time.sleep(3)  # an alert still to come would come within this
    # One alert per diagnosis: never the same diagnosis twice (an early one that the rest of the lines
    # changed is a second diagnosis: shippers held back by a fault deliver their ranks late), the
    # last one the final report's.
    said = [(h["data"]["report"]["failure_type"], tuple(h["data"]["report"]["culprits"]["hosts"]),
             (h["data"]["report"]["root_cause"] or {}).get("text"))
            for h in sorted((r.json() for r in receiver.of("/hook")), key=lambda h: h["timestamp"])
            if h["type"] == "logdx.diagnosis" and h["data"]["job_id"] == job_id]
    print(f"alerts: {len(said)} ({said[0][0]} on {list(said[0][1])})")
    assert len(said) == len(set(said)), said
    assert said[-1] == (report["failure_type"], tuple(report["culprits"]["hosts"]), report["root_cause"]["text"])
    assert len(receiver.of("/slack")) == len(said)
    # The action budget held: one cordon decision per diagnosis, whichever replica acted, whatever failed.
    live = next(s for s in servers if s.proc is not None and s.proc.poll() is None)
    actions = httpx.get(f"{live.url}/v1/jobs/{job_id}", headers=live.headers, timeout=10).json()["actions"]
    cordons = [a["node"] for a in actions if a["action"] == "cordon"]
    # An early diagnosis from a victim's line (a CUDA error, before the Xid's shipper caught up) may
    # recommend a plain restart: only the diagnoses that said cordon may have cordoned.
    said_cordon = [h["data"]["report"]["action"] == "cordon_and_restart"
                   for h in (r.json() for r in receiver.of("/hook"))
                   if h["type"] == "logdx.diagnosis" and h["data"]["job_id"] == job_id]
    assert len(cordons) == sum(said_cordon) and cordons[-1] in report["culprits"]["hosts"], actions


def _assert_honest(fleet: Fleet, expect: set[str]) -> None:
    """What the shippers saw: the expected refusals, each with a Retry-After; never a 500 or a hang."""
    errors = fleet.outcome.errors()
    print(f"\nshippers saw: {dict(fleet.outcome.statuses)}; slowest answer {fleet.outcome.slowest_s:.2f} s")
    assert not [k for k in errors if k.startswith("500")], errors
    assert "timeout" not in errors, errors
    assert not fleet.outcome.without_retry_after, fleet.outcome.without_retry_after
    assert expect <= set(errors), (expect, errors)


def _assert_bus_emptied(servers: list[Server]) -> None:
    """Once every job ended and was saved, the stream holds (almost) nothing."""
    live = next(s for s in servers if s.proc is not None and s.proc.poll() is None)
    stored = _wait(lambda: (b := _metric(live, "logdx_bus_stored_bytes")) is not None and b <= 2048 and b + 1, 120,
                   "the bus purged after the job ended")
    print(f"bus storage after the job ended: {stored - 1:.0f} bytes")


# --- the tests -----------------------------------------------------------------------------------------


def _outage(servers: list[Server], fleet: Fleet, down: Callable[[], None], up: Callable[[], None], refused: str,
            hold_s: float) -> Callable[[], None]:
    """A fault: a dependency goes `down` until /readyz says so and an upload was `refused` (503 and
    that code), stays down `hold_s` more, then comes `up`. The not-ready answer is kept in `.seen`."""
    def fault() -> None:
        down()
        ready = _wait(lambda: (r := httpx.get(servers[1].url + "/readyz", timeout=10)).status_code == 503 and r,
                      30, "/readyz says not ready while the dependency is down")
        fault.seen = ready.json()  # type: ignore[attr-defined]
        _wait(lambda: fleet.outcome.statuses[f"503 {refused}"] > 0, 120, "an upload refused meanwhile")
        time.sleep(hold_s)
        up()

    return fault


def test_nats_then_postgresql_down_under_64_shippers(tmp_path, pg_url, own_pg, own_nats, receiver):
    """One stream, two outages: NATS killed (SIGKILL) and restarted a fifth into the job, PostgreSQL
    shut down (immediate) for longer than a lease past half of it. Every acknowledged line counted
    once, one alert per diagnosis, the shippers told 503 with Retry-After (never a 500, never a hang),
    /readyz not ready with the reason meanwhile, no partition moved (by the database's clock every
    lease ran out), every upload's clean-up done, the bus emptied once the job ended."""
    servers = _replicas(tmp_path, pg_url, own_nats, receiver)
    try:
        _start(servers)
        _spread(servers)
        owners = _owners(servers[0])
        job, job_id = shipped_job(lines=JOB_LINES), "run-outages"
        fleet = _fleet(servers, job_id, job, lines_per_s=1000.0)
        nats_out = _outage(servers, fleet, own_nats.kill, own_nats.start, "bus_unavailable", hold_s=2.0)
        pg_out = _outage(servers, fleet, lambda: own_pg.stop("immediate"), own_pg.start, "store_unavailable",
                         hold_s=4.0)
        _stream_with_faults(fleet, [(0.2, nats_out), (0.55, pg_out)])
        assert "bus" in nats_out.seen["error"]["checks"], nats_out.seen  # type: ignore[attr-defined]
        assert "store" in pg_out.seen["error"]["checks"], pg_out.seen  # type: ignore[attr-defined]
        _wait(lambda: all(httpx.get(s.url + "/readyz", timeout=10).status_code == 200 for s in servers), 120,
              "ready again")
        report = _end(servers, job_id)
        _assert_counted_once(servers, job_id, fleet, job, report, receiver)
        _assert_honest(fleet, {"503 bus_unavailable", "503 store_unavailable"})
        assert _owners(servers[0]) == owners  # nobody lost or took a partition: no reshuffle
        for s in servers:  # every upload's clean-up ran, whichever way it failed
            assert _metric(s, "logdx_uploads_in_progress") == 0
        _assert_bus_emptied(servers)
    finally:
        _stop(servers)


def test_the_replica_taking_over_is_killed_during_its_takeover(tmp_path, pg_url, own_nats, receiver):
    servers = _replicas(tmp_path, pg_url, own_nats, receiver)
    try:
        _start(servers)
        _spread(servers)
        job, job_id = shipped_job(lines=JOB_LINES), "run-double-kill"
        partition = partition_of(job_id, PARTITIONS)
        fleet = _fleet(servers, job_id, job)
        killed: list[int] = []

        def owner_of(after: set[int]) -> int | None:
            live = next(s for i, s in enumerate(servers) if i not in after)
            owner = _owners(live)[partition][0]
            return int(owner.rsplit("-", 1)[1]) if owner and int(owner.rsplit("-", 1)[1]) not in after else None

        def kill_owner_then_its_successor() -> None:
            first = owner_of(set())
            assert first is not None
            servers[first].kill()
            fleet.dead.add(first)
            killed.append(first)
            def successor() -> tuple[int] | None:  # (replica 0 is falsy)
                owner = owner_of({first})
                return None if owner is None else (owner,)

            (second,) = _wait(successor, 120, "another replica claims the partition")
            servers[second].kill()  # while it restores the sessions and reads the partition again
            fleet.dead.add(second)
            killed.append(second)
            _wait(lambda: owner_of({first, second}) is not None, 120, "the last replica takes it over")

        _stream_with_fault(fleet, kill_owner_then_its_successor, at_share=0.4)
        print(f"\nkilled replica-{killed[0]} (owner), then replica-{killed[1]} (taking over)")
        report = _end(servers, job_id)
        _assert_counted_once(servers, job_id, fleet, job, report, receiver)
        _assert_honest(fleet, set())
        assert set(fleet.outcome.errors()) <= {"connection_ConnectError", "connection_RemoteProtocolError",
                                               "connection_ReadError", "503 owner_unavailable"}
    finally:
        _stop(servers)


def _stream_config(nats: TempNats, name: str) -> dict:
    async def read() -> dict:
        import nats as nats_client

        nc = await nats_client.connect(nats.url)
        try:
            info = await nc.jetstream().stream_info(name)
            return {"max_bytes": info.config.max_bytes, "discard": getattr(info.config.discard, "value", info.config.discard),
                    "bytes": info.state.bytes}
        finally:
            await nc.close()

    return asyncio.run(read())


def test_an_operators_small_stream_fills_and_still_lets_the_job_end(tmp_path, pg_url, own_nats, receiver):
    """An operator gave the stream 1 MiB and, as older logdx did, `discard: old`. The replicas keep
    the limit and make it refuse rather than discard. When the job's owner stalls (SIGSTOP) the bus
    fills: uploads get 503 bus_full, nothing acknowledged is lost; with the bus full again, /end still
    goes in, and the diagnosis comes when the owner resumes."""
    async def operator_made_stream() -> None:
        import nats as nats_client
        from nats.js import api

        nc = await nats_client.connect(own_nats.url)
        await nc.jetstream().add_stream(api.StreamConfig(
            name="logdx-lines", subjects=["logdx.lines.*"], storage=api.StorageType.FILE, max_bytes=1 << 20,
            discard=api.DiscardPolicy.OLD, duplicate_window=120))
        await nc.close()

    asyncio.run(operator_made_stream())
    # The owner stalls rather than dies: the other replica only ingests, so nobody takes over meanwhile.
    servers = _replicas(tmp_path, pg_url, own_nats, receiver, n=2, roles=["all", "ingest"])
    owner, other = servers
    try:
        _start(servers)
        _wait(lambda: {p["owner"] for p in _cluster(other)["partitions"]} == {"replica-0"}, 120, "the worker owns all")
        config = _stream_config(own_nats, "logdx-lines")
        assert (config["max_bytes"], config["discard"]) == (1 << 20, "new")  # kept, and made to refuse
        job, job_id = shipped_job(lines=JOB_LINES), "run-small-stream"
        fleet = Fleet([other.url], job_id, job.per_client, headers=other.headers, max_wait_s=0.5)

        def owner_paused() -> None:
            _pause(owner)
            _wait(lambda: fleet.outcome.statuses["503 bus_full"] > 0, 120, "uploads refused: the bus is full")
            os.kill(owner.proc.pid, signal.SIGCONT)  # it saves, the bus is purged, the shippers get through

        _stream_with_fault(fleet, owner_paused, at_share=0.1)
        assert fleet.lines == job.total

        # The bus full again (the owner paused, another job's healthy lines fill it): /end goes in.
        _pause(owner)
        filler = Fleet([other.url], "run-filler", {r: [f"[rank{r}]: iteration {i} | lm loss: 2.31 | step time 0.98"
                                                       for i in range(20_000)] for r in range(8)},
                       headers=other.headers, batch=400, max_wait_s=0.5)
        filling = threading.Thread(target=filler.run)
        filling.start()
        _wait(lambda: filler.outcome.statuses["503 bus_full"] > 0, 120, "the bus full again")
        filler.stopped.set()
        filling.join()
        r = httpx.post(f"{other.url}/v1/jobs/{job_id}/end", json={"exit_code": 1}, headers=other.headers, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "owner_unavailable", r.text  # in, waiting
        os.kill(owner.proc.pid, signal.SIGCONT)
        report = _end(servers, job_id)
        _assert_counted_once(servers, job_id, fleet, job, report, receiver)
        _assert_honest(fleet, {"503 bus_full"})
        assert _stream_config(own_nats, "logdx-lines")["max_bytes"] == 1 << 20
    finally:
        _stop(servers)


def _pause(server: Server) -> None:
    """SIGSTOP a replica, then let its pending pull request expire (records published from now on
    wait in the stream, none in the paused process's socket)."""
    os.kill(server.proc.pid, signal.SIGSTOP)
    time.sleep(1.0)


def test_records_removed_behind_the_owners_back_are_reported_never_silent(tmp_path, pg_url, own_nats, receiver):
    """While the worker is paused, an operator deletes the records of two acknowledged uploads: of
    one only its lines (its END stays), of the other everything. The owner says so: an error metric,
    the job's bus_gaps, the first note of its final report; the lost lines are counted."""
    servers = _replicas(tmp_path, pg_url, own_nats, receiver, n=2, roles=["ingest", "worker"])
    ingest, worker = servers
    try:
        _start(servers)
        _wait(lambda: {p["owner"] for p in _cluster(ingest)["partitions"]} == {"replica-1"}, 120, "the worker owns all")
        job, job_id = shipped_job(lines=4000), "run-gap"
        fleet = Fleet([ingest.url], job_id, job.per_client, headers=ingest.headers)
        fleet.run(upto=0.5)
        _wait(lambda: _metric(worker, "logdx_bus_applied_lines") == fleet.lines, 120, "the first half applied")
        _pause(worker)
        try:
            keys = [f"{job_id}/lost-lines", f"{job_id}/lost-all"]
            body = "".join(f"[rank0]: iteration {n} that the bus lost\n" for n in range(25))
            for key in keys:
                r = httpx.post(f"{ingest.url}/v1/jobs/{job_id}/logs", content=body,
                               headers={**ingest.headers, "idempotency-key": key}, timeout=30)
                assert r.status_code == 200 and r.json()["accepted_lines"] == 25
            asyncio.run(_delete_records(own_nats, job_id, only_lines_of=keys[0], all_of=keys[1]))
        finally:
            os.kill(worker.proc.pid, signal.SIGCONT)
        fleet.run()
        assert fleet.lines == job.total
        report = _end([ingest], job_id)
        assert report["notes"][0].startswith("incomplete: 50 acknowledged line(s) never reached this diagnosis")
        assert report["compression"]["lines_in"] == job.total  # the 50 acknowledged lines are not in it
        assert report["failure_type"] == job.expected["failure_type"]
        d = httpx.get(f"{ingest.url}/v1/jobs/{job_id}", headers=ingest.headers, timeout=10).json()
        kinds = sorted((g["kind"], g["lines"]) for g in d["bus_gaps"])
        # When a deleted record was the stream's oldest left (the rest purged once saved), the owner also sees the
        # stream start after its position: the same loss told a second way, no line counted twice (the metric below).
        counted = [k for k in kinds if k != ("stream_lost_records", None)]
        assert counted == [("missing_records", 25), ("unaccounted_lines", 25)], d["bus_gaps"]
        assert _metric(worker, "logdx_bus_lost_lines_total") == 50
        assert "acknowledged line(s) missing from the diagnosis" in worker.log()
    finally:
        _stop(servers)


async def _delete_records(nats: TempNats, job_id: str, only_lines_of: str, all_of: str) -> None:
    """Delete, as an operator could, the DATA records of the upload keyed `only_lines_of` and every
    record of the one keyed `all_of` (found by reading the stream)."""
    import nats as nats_client

    nc = await nats_client.connect(nats.url)
    js = nc.jetstream()
    info = await js.stream_info("logdx-lines")
    requests: dict[str, list[tuple[int, str]]] = {}
    keys: dict[str, str] = {}
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            rec = decode((await js.get_msg("logdx-lines", seq)).data)
        except Exception:  # deleted, or not a logdx record
            continue
        if rec.job_id != job_id:
            continue
        requests.setdefault(rec.meta.get("r", ""), []).append((seq, rec.kind))
        if rec.kind == "end" and rec.meta.get("k"):
            keys[rec.meta["k"]] = rec.meta["r"]
    for seq, kind in requests[keys[only_lines_of]]:
        if kind == "data":
            await js.delete_msg("logdx-lines", seq)
    for seq, _ in requests[keys[all_of]]:
        await js.delete_msg("logdx-lines", seq)
    await nc.close()
