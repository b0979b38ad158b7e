"""Actions you can trust, through the service: a real `logdx serve` (subprocess uvicorn on loopback),
the fake Kubernetes API server and a stand-in `scontrol`, a real alert receiver.

- A kernel Xid line that arrives without a host (files, NDJSON, text uploads) cordons nothing; sent
  with the host that printed it, it cordons that node only.
- `srun: error: Node failure on gpu[001-512]` drains nothing.
- The circuit breaker opens at its threshold, stays open, and a person closes it (API and CLI).
- Nodes blamed by several jobs are reported as such; uncordon sends "resolved".
- A job that shows only watchdog timeouts, or falls silent, is diagnosed without `/end`.
- The restart hook learns from the job's attempts; a time limit resubmits and cordons nothing.
- SIGKILL during long uploads: one alert and one action per diagnosis.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api_server import Receiver, Server, make_job, rank_host, start_receiver

pytestmark = pytest.mark.integration
PY = sys.executable
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def rx() -> Iterator[Receiver]:
    r = start_receiver()
    yield r
    r.close()


@pytest.fixture
def kube(receiver: Any) -> Iterator[Any]:
    with receiver.FakeKube(nodes=[f"gpu-node-{i:02d}" for i in range(8)]) as k:
        yield k


@pytest.fixture
def scontrol(tmp_path: Path) -> tuple[Path, Callable[[], list[list[str]]]]:
    """A stand-in `scontrol` (by absolute path): records its argv, one JSON list a line."""
    calls = tmp_path / "scontrol-calls.jsonl"
    script = tmp_path / "scontrol"
    script.write_text(f"#!{PY}\nimport json, sys\nopen({str(calls)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script, lambda: [json.loads(x) for x in calls.read_text().splitlines()] if calls.exists() else []


def _server(tmp_path: Path, rx: Receiver | None = None, *, actions: dict[str, Any] | None = None,
            hangs: dict[str, Any] | None = None, alerts: dict[str, Any] | None = None) -> Server:
    extra: dict[str, Any] = {"actions": {"dry_run": False, **(actions or {})}}
    if hangs:
        extra["hangs"] = hangs
    if alerts:
        extra["alerts"] = alerts
    return Server(tmp_path / "srv", receiver=rx, extra=extra).start()


def _post(c: httpx.Client, job: str, lines: list[str], host: str | None = None) -> None:
    headers = {"x-logdx-host": host} if host else {"x-logdx-stream": "stderr"}  # a custom header: not "simple"
    r = c.post(f"/v1/jobs/{job}/logs", content=("\n".join(lines) + "\n").encode(), headers=headers)
    assert r.status_code == 200, r.text


def _end(c: httpx.Client, job: str, exit_code: int = 1) -> dict[str, Any]:
    r = c.post(f"/v1/jobs/{job}/end", json={"exit_code": exit_code})
    assert r.status_code == 200, r.text
    return r.json()


def _audit(c: httpx.Client) -> list[dict[str, Any]]:
    """The audit, once no action is still in progress (pending)."""
    def settled() -> tuple[list[dict[str, Any]]] | None:
        rows = c.get("/v1/actions", params={"limit": 1000}).json()["audit"]
        return None if any(a["outcome"] == "pending" for a in rows) else (rows,)

    return _wait(settled)[0]


def _wait(what: Callable[[], Any], timeout: float = 120.0, every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"not within {timeout}s")


def _patches(kube: Any) -> list[str]:
    return [r.path.split("?")[0].rsplit("/", 1)[-1] for r in kube.requests if r.method == "PATCH"]


# -- the Xid that arrives without a host ------------------------------------------------------------

XID = "NVRM: Xid (PCI:0000:3b:00): 79, pid=2001, name=python, GPU has fallen off the bus."


def _two_host_job() -> dict[str, list[str]]:
    """A 2-host job: node-01 (ranks 0-1) and node-02 (ranks 2-3). The GPU falls off the bus on
    node-02, but the kernel line names no host; node-01's launcher then aborts (a victim)."""
    per_host: dict[str, list[str]] = {"gpu-node-01": [], "gpu-node-02": []}
    for r in range(4):
        host = f"gpu-node-0{r // 2 + 1}"
        per_host[host].append(f"[rank{r}]: {host}:{1000 * (r // 2 + 1) + r}:{1000 * (r // 2 + 1) + r} [{r % 2}] "
                              f"NCCL INFO Bootstrap : Using eth0:10.0.0.{r // 2 + 1}<0>")
    for i in range(1, 30):
        per_host["gpu-node-01"].append(f"[rank0]:  iteration {i:8d}/     100 | consumed samples: {i * 32:10d} | "
                                       f"lm loss: {6.5 - 0.01 * i:.6E} |")
    per_host["gpu-node-01"] += [
        "[rank1]:[E603 10:10:00.000000000 ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective operation "
        "timeout: WorkNCCL(SeqNum=42, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600094 "
        "milliseconds before timing out.",
        "E0603 10:10:01.000000 1000 torch/distributed/elastic/multiprocessing/api.py:826] failed (exitcode: -6) "
        "local_rank: 0 (pid: 1000) of binary: /usr/bin/python",
    ]
    return per_host


def _ship_per_host(c: httpx.Client, job_id: str, xid_host: str | None) -> None:
    """Each node's log with its X-Logdx-Host, then the kernel Xid line: from `dmesg | curl` without a
    host (`xid_host` None), or shipped with the host that printed it."""
    for host, lines in _two_host_job().items():
        _post(c, job_id, lines, host)
    _post(c, job_id, [XID], xid_host)


def _kube_server(tmp_path: Path, rx: Receiver, kube: Any) -> Server:
    return _server(tmp_path, rx, actions={"actuator": "kubernetes", "kubernetes": {"api": kube.url}, "cluster_size": 20})


def test_an_xid_without_a_host_cordons_nothing_through_files_ndjson_and_text(tmp_path, rx, kube):
    srv = _kube_server(tmp_path, rx, kube)
    job = _two_host_job()
    try:
        with srv.client() as c:
            _ship_per_host(c, "text-1", None)  # text uploads
            # NDJSON records: the Xid record has no host field.
            records = [{"log": line, "host": host} for host, lines in job.items() for line in lines]
            records.insert(31, {"log": XID})
            r = c.post("/v1/jobs/ndjson-1/logs", content="\n".join(json.dumps(x) for x in records).encode(),
                       headers={"content-type": "application/x-ndjson"})
            assert r.status_code == 200, r.text
            # One file: the whole log as one upload.
            whole = [*job["gpu-node-02"], *job["gpu-node-01"][:30], XID, *job["gpu-node-01"][30:]]
            _post(c, "file-1", whole, None)
            reports = {j: _end(c, j) for j in ("text-1", "ndjson-1", "file-1")}
            time.sleep(1.0)  # the actor acts off the request path: give a wrong cordon every chance
            audit = _audit(c)
        for j, rep in reports.items():
            assert rep["failure_type"] == "gpu_fell_off_bus", (j, rep)
            assert rep["culprits"]["hosts"] == [] and rep["action"] != "cordon_and_restart", (j, rep)
        assert _patches(kube) == []
        assert [a for a in audit if a["action"] == "cordon" and a["node"]] == []
    finally:
        srv.stop()
    # The same file through the CLI: no cordon asked of an empty culprit list either.
    path = tmp_path / "job.log"
    path.write_text("\n".join(whole) + "\n")
    out = subprocess.run([PY, "-m", "logdx", "diagnose", str(path), "--json", "--no-llm", "--no-retrieval"],
                         capture_output=True, timeout=120, env={**os.environ, "LOGDX_DATA_DIR": str(tmp_path / "d")})
    report = json.loads(out.stdout)
    assert report["culprits"]["hosts"] == [] and report["action"] != "cordon_and_restart"


def test_the_host_that_printed_the_hardware_line_is_the_only_one_cordoned(tmp_path, rx, kube):
    srv = _kube_server(tmp_path, rx, kube)
    try:
        with srv.client() as c:
            _ship_per_host(c, "shipped-1", "gpu-node-02")  # the kernel log of node-02, shipped with its host
            rep = _end(c, "shipped-1")
            _wait(lambda: _patches(kube))
        assert rep["culprits"]["hosts"] == ["gpu-node-02"] and rep["culprits"]["corroborated"]
        assert _patches(kube) == ["gpu-node-02"]
        assert kube.nodes["gpu-node-02"]["spec"]["unschedulable"] is True
        assert "unschedulable" not in kube.nodes["gpu-node-01"]["spec"]
    finally:
        srv.stop()


# -- a node range in the log ----------------------------------------------------------------------


def test_a_node_range_line_shipped_with_a_host_drains_not_that_host(tmp_path, rx, scontrol):
    """Issue 20 point 5: `Node failure on gpu[001-512]` sent with `X-Logdx-Host: n`: the range is
    refused and the host that printed the line is not blamed, nor drained, instead."""
    script, calls = scontrol
    srv = _server(tmp_path, rx, actions={"actuator": "slurm", "slurm": {"scontrol": str(script)}})
    try:
        with srv.client() as c:
            _post(c, "range-2", ["[rank0]:  iteration        1/     100 | lm loss: 6.45E+00 |"], "n")
            _post(c, "range-2", ["srun: error: Node failure on gpu[001-512]"], "n")
            rep = _end(c, "range-2")
            _wait(lambda: rx.of("/hook"))
            audit = [a for a in _audit(c) if a["job_id"] == "range-2"]
        assert rep["failure_type"] == "node_failure" and rep["culprits"]["hosts"] == [], rep["culprits"]
        assert not [a for a in audit if a["node"]]
        assert calls() == []
    finally:
        srv.stop()


def test_a_node_range_line_drains_nothing_through_the_service(tmp_path, rx, scontrol):
    script, calls = scontrol
    srv = _server(tmp_path, rx, actions={"actuator": "slurm", "slurm": {"scontrol": str(script)}})
    try:
        with srv.client() as c:
            _post(c, "range-1", ["[rank0]:  iteration        1/     100 | lm loss: 6.45E+00 |",
                                 "srun: error: Node failure on gpu[001-512]",
                                 "srun: Job step aborted: Waiting up to 32 seconds for job step to finish."], None)
            rep = _end(c, "range-1")
            alert = _wait(lambda: rx.of("/hook"))[0].json()["data"]
            audit = [a for a in _audit(c) if a["job_id"] == "range-1"]
        # The line names no one node: no culprit at all (issue 20 point 5), so nothing to cordon.
        assert rep["failure_type"] == "node_failure" and rep["culprits"]["hosts"] == []
        assert rep["culprits"]["ranks"] == [] and rep["action"] == "restart", rep
        assert not [a for a in audit if a["action"] == "cordon" and a["node"]]
        assert calls() == []
        assert alert["recommended"] != "Cordon the node, then restart"
    finally:
        srv.stop()


# -- the breaker, node history, uncordon ----------------------------------------------------------------


def _xid_job(culprit_rank: int, ranks: int = 16, steps: int = 20) -> list[str]:
    job = make_job(ranks=ranks, steps=steps, culprit=culprit_rank)
    return [line for r in range(ranks) for line in job[r]]


def _logdx(tmp_path: Path, config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOGDX_")}
    return subprocess.run([PY, "-m", "logdx", *args, "--config", str(config)], capture_output=True, text=True,
                          timeout=60, env=env)


def test_breaker_opens_at_its_threshold_stays_open_and_a_person_resets_it(tmp_path, rx, kube):
    # 4 known nodes, at most 25% under cordon: the second node trips the breaker.
    srv = _server(tmp_path, rx, actions={"actuator": "kubernetes", "kubernetes": {"api": kube.url}, "cluster_size": 4,
                                         "breaker_max_share": 0.25, "max_cordons": 10},
                  alerts={"node_dedup_s": 0})
    try:
        with srv.client() as c:
            def cordon_rows(job: str) -> list[dict[str, Any]]:
                return [a for a in _audit(c) if a["job_id"] == job and a["action"] == "cordon"]

            for i, culprit in enumerate((5, 13, 21)):  # gpu-node-00, -01, -02
                _post(c, f"job-{i}", _xid_job(culprit, ranks=24))
                _end(c, f"job-{i}")
                _wait(lambda i=i: cordon_rows(f"job-{i}"))
            outcomes = [cordon_rows(f"job-{i}")[0]["outcome"] for i in range(3)]
            assert outcomes == ["ok", "refused", "refused"]
            status = c.get("/v1/actions").json()
            assert status["breaker"]["state"] == "open" and "circuit breaker" in status["breaker"]["reason"]
            assert "circuit breaker open since" in cordon_rows("job-2")[0]["detail"]
            assert _patches(kube) == ["gpu-node-00"]
            # The CLI sees the same state, and a person resets it there...
            text = _logdx(tmp_path, srv.config_path, "actions").stdout
            assert "breaker      OPEN since" in text
            done = _logdx(tmp_path, srv.config_path, "actions", "reset", "--by", "alice", "--note", "checked")
            assert done.returncode == 0 and "closed by alice (checked)" in done.stdout
            assert c.get("/v1/actions").json()["breaker"]["state"] == "closed"
            # ... or through the API (audited as well).
            r = c.post("/v1/actions/reset", json={"by": "bob"})
            assert r.status_code == 200 and r.json()["outcome"] == "reset"
            assert c.post("/v1/actions/reset", content=b"by=bob").status_code in (400, 403, 415, 422)
            _post(c, "job-3", _xid_job(29, ranks=32))  # gpu-node-03
            _end(c, "job-3")
            assert _wait(lambda: cordon_rows("job-3"))[0]["outcome"] == "ok"
            resets = [(a["job_id"], a["outcome"]) for a in _audit(c) if a["action"] == "breaker"]
            # the API caller has no token here: audited as the local caller, marked unauthenticated
            assert resets == [("-", "open"), ("alice", "reset"), ("local:bob", "reset")]
    finally:
        srv.stop()


def test_nodes_blamed_by_several_jobs_and_uncordon_with_resolved(tmp_path, rx, kube):
    srv = _server(tmp_path, rx, actions={"actuator": "kubernetes", "kubernetes": {"api": kube.url}, "cluster_size": 20},
                  alerts={"node_dedup_s": 3600})
    try:
        with srv.client() as c:
            for job in ("a-1", "b-1"):
                _post(c, job, _xid_job(5))  # both blame gpu-node-00
                _end(c, job)
            _wait(lambda: len([a for a in _audit(c) if a["action"] == "cordon"]) == 2)
            audit = [(a["job_id"], a["outcome"], a["detail"][:16]) for a in _audit(c) if a["action"] == "cordon"]
            assert audit == [("a-1", "ok", "patched node gpu"), ("b-1", "skipped", "already cordoned")]
            nodes = c.get("/v1/nodes", params={"blamed_only": True}).json()["nodes"]
            [node] = nodes
            assert node["node"] == "gpu-node-00" and node["state"] == "cordoned"
            assert node["jobs"] == ["b-1", "a-1"] and node["blamed_by_several_jobs"] is True
            assert c.get("/v1/nodes", params={"limit": 100}).json()["count"] == 2  # gpu-node-00 and -01 seen
            # An alert for each of the two jobs that share the bad node: each owner hears of it.
            hooks = _wait(lambda: rx.of("/hook") if len(rx.of("/hook")) >= 2 else None)
            assert sorted(h.json()["data"]["job_id"] for h in hooks) == ["a-1", "b-1"]
            first = next(h for h in hooks if h.json()["data"]["job_id"] == "a-1")
            done = first.json()["data"]["done"]  # the evidence capsule kept before the cordon (tests/test_capsule.py)
            assert done[0].startswith("evidence capsule sha256:") and done[1].startswith("cordon gpu-node-00: done (patched node")
            assert c.get("/v1/nodes/gpu[0-9]").status_code == 400
            assert c.get("/v1/nodes/gpu-node-77").status_code == 404
            r = c.post("/v1/nodes/gpu-node-00/uncordon", json={"by": "carol", "reason": "GPU replaced"})
            assert r.status_code == 200 and r.json()["outcome"] == "ok", r.text
            assert kube.nodes["gpu-node-00"]["spec"]["unschedulable"] is False
            resolved = _wait(lambda: [h for h in rx.of("/hook") if h.json()["type"] == "logdx.resolved"])
            assert "gpu-node-00 is back in service" in resolved[0].json()["data"]["resolved"]
            assert c.get("/v1/nodes/gpu-node-00").json()["state"] == "ok"
        listing = _logdx(tmp_path, srv.config_path, "nodes")
        assert "gpu-node-00" in listing.stdout and "(several jobs)" in listing.stdout
    finally:
        srv.stop()


# -- hangs -----------------------------------------------------------------------------------------


def test_a_silent_hang_is_diagnosed_without_waiting_for_end(tmp_path, rx):
    srv = _server(tmp_path, rx, hangs={"symptom_settle_s": 0.5, "silence_s": 1.5, "check_interval_s": 0.2})
    try:
        with srv.client() as c:
            # 8 ranks train; then 7 of them time out in a collective: rank 5 fell silent.
            progress = [f"[rank{r}]: gpu-node-0{r // 2}:{100 + r}:{100 + r} [{r % 2}] NCCL INFO Bootstrap : "
                        f"Using eth0:10.0.0.{r}<0>" for r in range(8)]
            progress += [f"[rank0]:  iteration {i:8d}/     100 | consumed samples: {i * 32:10d} | lm loss: 6.4E+00 |"
                         for i in range(1, 20)]
            _post(c, "hang-1", progress)
            _post(c, "hang-1", [
                f"[rank{r}]:[E603 10:10:00.000000000 ProcessGroupNCCL.cpp:616] [Rank {r}] Watchdog caught collective "
                "operation timeout: WorkNCCL(SeqNum=42, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) "
                "ran for 600094 milliseconds before timing out." for r in range(8) if r != 5])
            got = _wait(lambda: (c.get("/v1/jobs/hang-1").json().get("report") or {}).get("status") == "failed"
                        and c.get("/v1/jobs/hang-1").json())
            assert got["state"] == "open"  # no /end
            rep = got["report"]
            # A hang, with the rank that fell silent (and its host, which its own NCCL line names).
            assert rep["failure_type"] == "hang" and rep["culprits"]["ranks"] == [5]
            assert rep["culprits"]["hosts"] == ["gpu-node-02"] and "silent" in rep["culprits"]["basis"]
            assert _wait(lambda: [h for h in rx.of("/hook") if h.json()["data"]["job_id"] == "hang-1"])
            # Every stream silent (no error at all): a stall, diagnosed after hangs.silence_s.
            _post(c, "quiet-1", progress)
            got = _wait(lambda: (c.get("/v1/jobs/quiet-1").json().get("report") or {}).get("status") == "failed"
                        and c.get("/v1/jobs/quiet-1").json())
            assert got["state"] == "open" and "stalled" in got["report"]["root_cause"]["text"]
            assert [r["kind"] for r in got["reports"]] == ["early"]
    finally:
        srv.stop()


# -- restarts that learn from history -----------------------------------------------------------------


def test_the_restart_hook_learns_from_the_attempts_and_a_time_limit_resubmits(tmp_path, rx, kube):
    restarts = tmp_path / "restarts.jsonl"
    hook = [PY, "-c", "import json, sys; open(sys.argv[1], 'a').write(json.dumps(sys.argv[2:]) + '\\n')",
            str(restarts), "{job_id}", "{failure_type}", "{hosts}"]
    srv = _server(tmp_path, rx, actions={"actuator": "kubernetes", "kubernetes": {"api": kube.url}, "cluster_size": 20,
                                         "restart_command": hook}, alerts={"node_dedup_s": 0})

    def restarted() -> list[list[str]]:
        return [json.loads(x) for x in restarts.read_text().splitlines()] if restarts.exists() else []

    try:
        with srv.client() as c:
            def rows(job: str) -> list[tuple[str, str]] | None:
                """The job's audit once its restart is decided (its evidence capsule and cordon come before)."""
                out = [(a["action"], a["outcome"]) for a in _audit(c) if a["job_id"] == job]
                return out if any(action == "restart" for action, _ in out) else None

            _post(c, "train.attempt-1", _xid_job(5))  # gpu-node-00
            _end(c, "train.attempt-1")
            assert _wait(lambda: rows("train.attempt-1")) == [("capsule", "ok"), ("cordon", "ok"), ("restart", "ok")]
            # The restarted job fails the same way on another node: the job, not the nodes.
            _post(c, "train.attempt-2", _xid_job(13))  # gpu-node-01
            _end(c, "train.attempt-2")
            assert _wait(lambda: rows("train.attempt-2")) == [("capsule", "ok"), ("cordon", "ok"), ("restart", "skipped")]
            skipped = [a for a in _audit(c) if a["job_id"] == "train.attempt-2" and a["action"] == "restart"][0]
            assert "follows the job" in skipped["detail"]
            # A time limit: resubmitted, nothing cordoned.
            _post(c, "tl-1", [f"[rank0]:  iteration {i:8d}/     100 | lm loss: 6.4E+00 |" for i in range(1, 9)]
                  + ["slurmstepd: error: *** JOB 4242 ON gpu-node-05 CANCELLED AT 2024-06-03T10:05:00 DUE TO "
                     "TIME LIMIT ***"], None)
            _end(c, "tl-1", exit_code=143)
            assert _wait(lambda: rows("tl-1")) == [("restart", "ok")]
            assert _patches(kube) == ["gpu-node-00", "gpu-node-01"]
            assert [r[:2] for r in restarted()] == [["train.attempt-1", "gpu_fell_off_bus"], ["tl-1", "time_limit"]]
            # The third attempt succeeds: the alerts of the first two get "resolved".
            _post(c, "train.attempt-3", [f"[rank0]:  iteration {i:8d}/     100 | lm loss: 6.4E+00 |" for i in range(9)])
            _end(c, "train.attempt-3", exit_code=0)
            resolved = _wait(lambda: len([h for h in rx.of("/hook") if h.json()["type"] == "logdx.resolved"]) >= 2
                             and [h.json()["data"] for h in rx.of("/hook") if h.json()["type"] == "logdx.resolved"])
            assert sorted(d["job_id"] for d in resolved) == ["train.attempt-1", "train.attempt-2"]
            assert all("train.attempt-3 succeeded" in d["resolved"] for d in resolved)
    finally:
        srv.stop()


# -- exactly once across a SIGKILL -------------------------------------------------------------------


def test_sigkill_during_long_uploads_yields_one_alert_and_one_action_per_diagnosis(tmp_path, rx, scontrol):
    script, calls = scontrol
    restarts = tmp_path / "restarts.txt"
    hook = [PY, "-c", "import sys; open(sys.argv[1], 'a').write(sys.argv[2] + '\\n')", str(restarts), "{job_id}"]
    srv = _server(tmp_path, rx, actions={"actuator": "slurm", "slurm": {"scontrol": str(script)}, "restart_command": hook,
                                         "cluster_size": 20})
    job = make_job(ranks=16, steps=150, culprit=5)
    total = sum(len(v) for v in job.values())
    up = threading.Event()
    up.set()
    acked = [0] * 16
    errors: list[str] = []

    def ship(rank: int) -> None:
        lines = job[rank]
        with httpx.Client(timeout=10) as client:
            for i in range(0, len(lines), 8):
                body = ("\n".join(lines[i:i + 8]) + "\n").encode()
                while True:
                    try:
                        r = client.post(f"{srv.url}/v1/jobs/long-1/logs", content=body,
                                        headers={"idempotency-key": f"r{rank}-{i}"})
                    except httpx.HTTPError:
                        r = None
                    if r is not None and r.status_code == 200:
                        break
                    if r is not None and r.status_code < 500:
                        errors.append(r.text)
                        return
                    up.wait(60)
                    time.sleep(0.05)
                acked[rank] += len(lines[i:i + 8])
                time.sleep(0.0 if rank == 5 else 0.06)

    threads = [threading.Thread(target=ship, args=(r,), daemon=True) for r in range(16)]
    try:
        for t in threads:
            t.start()
        _wait(lambda: rx.of("/hook") and calls() and restarts.exists())
        assert not all(not t.is_alive() for t in threads), "uploads finished before the kill: make them longer"
        up.clear()
        srv.kill()
        time.sleep(0.5)
        srv.start()  # same database, same spools: replays, recovers, acts on nothing twice
        up.set()
        for t in threads:
            t.join(90)
        assert errors == [] and sum(acked) == total
        with srv.client() as c:
            rep = _end(c, "long-1")
        assert rep["culprits"]["hosts"] == [rank_host(5)] and rep["compression"]["lines_in"] == total
        time.sleep(1.5)  # give a (wrong) second alert or action every chance
        assert len(rx.of("/hook")) == 1 and len(rx.of("/slack")) == 1
        [call] = calls()  # once, its reason naming the evidence capsule written before it
        assert call[:3] == ["update", f"NodeName={rank_host(5)}", "State=DRAIN"]
        assert re.fullmatch(r"Reason=logdx: gpu_fell_off_bus long-1 capsule=[0-9a-f]{16}", call[3])
        assert restarts.read_text().splitlines() == ["long-1"]
    finally:
        up.set()
        srv.stop()
