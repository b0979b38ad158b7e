"""Whose word may blame a node (issue 29): a host is only as trusted as its source. Against the real app on
loopback with Slurm actions on (`dry_run: false`, a stand-in `scontrol` that records every call and answers
`scontrol show job` for the jobs it runs), on SQLite and PostgreSQL:

- a tenant's shipper that names a foreign host for its own Xid line drains nothing (reported, marked
  unverified, audited `refused`); the host's own node credential, or a collector the operator runs, drains it;
- a token bound to host Y may not post node lines for host X, nor may a token bound to no host;
- with the scheduler asked (`actions.ask_scheduler`), a tenant's job's own lines still cordon the right host:
  the one Slurm ran the job on, and no other.
"""

from __future__ import annotations

import json
import stat
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api_server import LoopbackApp
from logdx.access.auth import token_digest
from logdx.config import Settings
from logdx.pipeline import Engine
from logdx.testing import wait_until

pytestmark = pytest.mark.integration

TOKENS = {
    "tenant-a": ("shipper", "ta", []),  # a tenant's shipper: speaks for no host
    "daemonset-old": ("shipper", "", []),  # the old cluster-wide recipe: one token, bound to no host
    "node-22": ("shipper", "", ["gpu-node-22"]),  # a node's own credential
    "node-07": ("shipper", "", ["gpu-node-07"]),
    "collector": ("shipper", "", ["*"]),  # a collector the operator runs, for every host
    "oncall": ("operator", "", []),
}
SECRET = {name: f"secret-of-{name}-0123456789abcdef" for name in TOKENS}


# The job ran an hour ago: a live stream's stamps without a year are this year's.
T0 = time.time() - 3600


def _at(s: float, fmt: str) -> str:
    return time.strftime(fmt, time.gmtime(T0 + s))


def _xid(host: str) -> str:
    return f"{_at(600, '%b %e %H:%M:%S')} {host} kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid=14487, name=python, " \
           "GPU has fallen off the bus."


def _training(ranks: int = 16, steps: int = 30) -> list[str]:
    return [f"[{_at(s * 10, '%Y-%m-%d %H:%M:%S')},000] [rank{r}]: iteration {s:6d}/ 100000 | lm loss: 2.5 |"
            for s in range(1, steps + 1) for r in range(ranks)]


def _timeouts(ranks: int = 16, dead: int = 3) -> list[str]:
    return [f"[rank{r}]:[E{_at(1210, '%m%d %H:%M:%S')}.000 ProcessGroupNCCL.cpp:632] [Rank {r}] Watchdog caught "
            "collective operation timeout: WorkNCCL(SeqNum=31, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, "
            "Timeout(ms)=600000) ran for 600042 milliseconds before timing out." for r in range(ranks) if r != dead]


@pytest.fixture
def scontrol(tmp_path: Path) -> tuple[Path, Callable[[], list[list[str]]]]:
    """A stand-in `scontrol`: records its argv; `show job -o 4711` answers that job ran on gpu-node-[20-23]."""
    calls = tmp_path / "scontrol-calls.jsonl"
    script = tmp_path / "scontrol"
    script.write_text(
        f"#!{sys.executable}\nimport json, sys\nopen({str(calls)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
        "if sys.argv[1:3] == ['show', 'job']:\n"
        "    if sys.argv[-1] == '4711':\n"
        "        print('JobId=4711 JobName=train JobState=RUNNING NumNodes=4 NodeList=gpu-node-[20-23] BatchHost=gpu-node-20')\n"
        "    else:\n"
        "        sys.stderr.write('slurm_load_jobs error: Invalid job id specified\\n'); sys.exit(1)\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script, lambda: [json.loads(x) for x in calls.read_text().splitlines()] if calls.exists() else []


def _settings(tmp: Path, scontrol: Path, db: str, **actions: Any) -> Settings:
    tokens = [{"name": n, "role": r, "tenant": t, "hosts": h, "sha256": token_digest(SECRET[n])}
              for n, (r, t, h) in TOKENS.items()]
    return Settings.model_validate({
        "data_dir": str(tmp), "llm": {"enabled": False}, "retrieval": {"enabled": False},
        "store": {"url": db} if db else {},
        "server": {"early_diagnosis_delay_s": 3600, "tokens": tokens},
        "actions": {"dry_run": False, "actuator": "slurm", "slurm": {"scontrol": str(scontrol)}, "cluster_size": 64,
                    **actions}})


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield ""
        return
    yield request.getfixturevalue("pg_url")  # conftest: a schema of the test's own on the machine's PostgreSQL


def _app(tmp: Path, scontrol: Path, store: str, **actions: Any) -> LoopbackApp:
    settings = _settings(tmp, scontrol, store, **actions)
    return LoopbackApp(settings, Engine.create(settings))


def _as(app: LoopbackApp, name: str) -> httpx.Client:
    return httpx.Client(base_url=app.url, headers={"authorization": f"Bearer {SECRET[name]}"}, timeout=60)


def _post(c: httpx.Client, job: str, lines: list[str], host: str | None = None) -> httpx.Response:
    headers = {"content-type": "text/plain", **({"x-logdx-host": host} if host else {})}
    return c.post(f"/v1/jobs/{job}/logs", content=("\n".join(lines) + "\n").encode(), headers=headers)


def _audit(app: LoopbackApp) -> list[dict[str, Any]]:
    with _as(app, "oncall") as c:
        r = c.get("/v1/actions")
        assert r.status_code == 200, r.text
        return r.json()["audit"]


def _drains(calls: list[list[str]]) -> list[str]:
    return [c[1] for c in calls if c[:1] == ["update"] and "State=DRAIN" in c]


def _cordon_of(app: LoopbackApp, job: str) -> dict[str, Any]:
    """The audited cordon decision of a job (actions run after the diagnosis, in the background)."""
    def found() -> dict[str, Any] | None:
        return next((a for a in _audit(app) if a["action"] == "cordon" and a["job_id"].split(":")[-1] == job
                     and a["outcome"] != "pending"), None)
    return wait_until(found, f"the cordon decision of {job}")


def test_a_tenants_shipper_naming_a_foreign_host_drains_nothing(tmp_path: Path, scontrol: Any, store_url: str) -> None:
    script, calls = scontrol
    with _app(tmp_path, script, store_url) as app, _as(app, "tenant-a") as c:
        assert _post(c, "train-9", _training(), host="gpu-node-22").status_code == 200
        assert _post(c, "train-9", [_xid("gpu-node-22")], host="gpu-node-22").status_code == 200
        report = c.post("/v1/jobs/train-9/end", json={"exit_code": 1}).json()
        assert report["failure_type"] == "gpu_fell_off_bus" and report["culprits"]["hosts"] == ["gpu-node-22"]
        assert report["culprits"]["verified"] is False
        assert any(n.startswith("unverified host gpu-node-22") for n in report["notes"]), report["notes"]
        decision = _cordon_of(app, "train-9")
        assert decision["outcome"] == "refused" and decision["detail"].startswith("unverified host"), decision
        assert _drains(calls()) == []


def test_the_nodes_own_credential_or_the_operators_collector_drains_it(tmp_path: Path, scontrol: Any,
                                                                       store_url: str) -> None:
    script, calls = scontrol
    with _app(tmp_path, script, store_url) as app:
        with _as(app, "collector") as c:  # a collector the operator runs ('*'): its hosts are the job's
            assert _post(c, "j-collected", _training(), host="gpu-node-05").status_code == 200
            assert _post(c, "j-collected", [_xid("gpu-node-05")], host="gpu-node-05").status_code == 200
            report = c.post("/v1/jobs/j-collected/end", json={"exit_code": 1}).json()
        assert report["culprits"]["hosts"] == ["gpu-node-05"] and report["culprits"]["verified"] is True
        assert _cordon_of(app, "j-collected")["outcome"] == "ok"
        assert _drains(calls()) == ["NodeName=gpu-node-05"]
        # A job on gpu-node-22 (a shipper bound to no host says so) shows only timeouts; the node's own
        # credential posts its kernel line, which joins the job: the node itself said it.
        with _as(app, "daemonset-old") as c:
            lines = _training() + _timeouts()
            assert _post(c, "train-10", lines, host="gpu-node-22").status_code == 200
        with _as(app, "node-22") as c:
            r = c.post("/v1/nodes/gpu-node-22/logs", content=(_xid("gpu-node-22") + "\n").encode(),
                       headers={"content-type": "text/plain"})
            assert r.status_code == 200 and r.json()["node_lines"] == 1, r.text
        with _as(app, "daemonset-old") as c:
            report = c.post("/v1/jobs/train-10/end", json={"exit_code": 1}).json()
        assert report["failure_type"] == "gpu_fell_off_bus" and report["culprits"]["hosts"] == ["gpu-node-22"], report
        assert report["culprits"]["verified"] is True
        assert _cordon_of(app, "train-10")["outcome"] == "ok", _cordon_of(app, "train-10")["detail"]
        assert _drains(calls()) == ["NodeName=gpu-node-05", "NodeName=gpu-node-22"]


def test_a_token_may_post_node_lines_only_for_its_own_hosts(tmp_path: Path, scontrol: Any, store_url: str) -> None:
    script, calls = scontrol
    with _app(tmp_path, script, store_url) as app:
        for token in ("node-07", "daemonset-old"):
            with _as(app, token) as c:
                r = c.post("/v1/nodes/gpu-node-21/logs", content=(_xid("gpu-node-21") + "\n").encode(),
                           headers={"content-type": "text/plain"})
                assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", r.text
                record = json.dumps({"host": "gpu-node-21", "message": _xid("gpu-node-21")})
                r = c.post("/v1/logs", content=record.encode(), headers={"content-type": "application/x-ndjson"})
                assert r.status_code == 422 and r.json()["error"]["refused"] == {"host_not_allowed": 1}, r.text
        with _as(app, "node-07") as c:  # its own host: kept
            mixed = "\n".join(json.dumps({"host": h, "message": _xid(h)}) for h in ("gpu-node-07", "gpu-node-21"))
            r = c.post("/v1/logs", content=mixed.encode(), headers={"content-type": "application/x-ndjson"})
            assert r.status_code == 200 and r.json()["partial"] and r.json()["refused"] == {"host_not_allowed": 1}, r.text
        with _as(app, "oncall") as c:
            nodes = {n["node"] for n in c.get("/v1/nodes").json()["nodes"]}
        assert "gpu-node-21" not in nodes
        assert _drains(calls()) == []


def test_with_the_scheduler_asked_a_tenants_job_cordons_where_slurm_ran_it(tmp_path: Path, scontrol: Any,
                                                                           store_url: str) -> None:
    script, calls = scontrol
    with _app(tmp_path, script, store_url, ask_scheduler=True) as app, _as(app, "tenant-a") as c:
        # Slurm ran job 4711 on gpu-node-[20-23]: the job's own line for gpu-node-22 is believed.
        assert _post(c, "4711", _training() + [_xid("gpu-node-22")], host="gpu-node-22").status_code == 200
        report = c.post("/v1/jobs/4711/end", json={"exit_code": 1}).json()
        assert report["culprits"]["hosts"] == ["gpu-node-22"] and report["culprits"]["verified"] is False
        assert _cordon_of(app, "4711")["outcome"] == "ok"
        # A host the job did not run on stays a claim, whatever the job's lines say.
        assert _post(c, "retry-4711", _training() + [_xid("gpu-node-09")], host="gpu-node-09").status_code == 200
        c.post("/v1/jobs/retry-4711/end", json={"exit_code": 1})
        assert _cordon_of(app, "retry-4711")["outcome"] == "refused"
        # A job Slurm does not know: nothing confirms the claim.
        assert _post(c, "train-x", _training() + [_xid("gpu-node-21")], host="gpu-node-21").status_code == 200
        c.post("/v1/jobs/train-x/end", json={"exit_code": 1})
        assert _cordon_of(app, "train-x")["outcome"] == "refused"
    assert _drains(calls()) == ["NodeName=gpu-node-22"]
    # Slurm was asked for the two jobs whose names carry a Slurm id; nothing was asked for the third.
    assert [c[-1] for c in calls() if c[:2] == ["show", "job"]] == ["4711", "4711"]


# -- node credentials: derived tokens, Kubernetes service-account tokens ---------------------------------------


def _kube_settings(tmp: Path, kube: Any, **server: Any) -> Settings:
    return Settings.model_validate({
        "data_dir": str(tmp), "llm": {"enabled": False}, "retrieval": {"enabled": False},
        "server": {"early_diagnosis_delay_s": 3600, "local_operator": False, **server,
                   "tokens": [{"name": "oncall", "role": "operator", "sha256": token_digest(SECRET["oncall"])},
                              {"name": "tenant-a", "role": "shipper", "tenant": "ta",
                               "sha256": token_digest(SECRET["tenant-a"])}]},
        "actions": {"dry_run": False, "actuator": "kubernetes", "cluster_size": 64,
                    "kubernetes": {"api": kube.url, "token": "t0ken", "namespace": "train"}}})


def _node_xid(c: httpx.Client, host: str) -> httpx.Response:
    return c.post(f"/v1/nodes/{host}/logs", content=(_xid(host) + "\n").encode(), headers={"content-type": "text/plain"})


def _cordoned(kube: Any) -> list[str]:
    return sorted(n for n, node in kube.nodes.items() if node["spec"].get("unschedulable"))


def test_a_derived_node_token_speaks_for_its_node_only(tmp_path: Path, receiver: Any) -> None:
    from logdx.credentials import derive

    key = "the-operators-node-key-0123456789"
    with receiver.FakeKube(nodes=[f"gpu-node-{i:02d}" for i in range(30)]) as kube:
        settings = _kube_settings(tmp_path, kube, node_key=key)
        with LoopbackApp(settings, Engine.create(settings)) as app:
            token = derive(key, "gpu-node-21")
            with httpx.Client(base_url=app.url, headers={"authorization": f"Bearer {token}"}, timeout=60) as c:
                r = _node_xid(c, "gpu-node-22")  # another node's line: refused
                assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", r.text
                assert _node_xid(c, "gpu-node-21").status_code == 200
                # its own job's lines, with its own host: believed
                assert _post(c, "on-21", _training() + [_xid("gpu-node-21")], host="gpu-node-21").status_code == 200
                report = c.post("/v1/jobs/on-21/end", json={"exit_code": 1}).json()
            assert report["culprits"] == {**report["culprits"], "hosts": ["gpu-node-21"], "verified": True}
            assert _cordon_of(app, "on-21")["outcome"] == "ok"
            forged = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
            for bad in (forged, token.replace("gpu-node-21", "gpu-node-22")):
                r = httpx.post(f"{app.url}/v1/nodes/gpu-node-22/logs", content=b"x\n",
                               headers={"authorization": f"Bearer {bad}"})
                assert r.status_code == 401, r.text
        assert _cordoned(kube) == ["gpu-node-21"]


@pytest.mark.parametrize("node_info", [True, False], ids=["node-name-extra", "pod-lookup"])
def test_a_pods_service_account_token_speaks_for_its_node(tmp_path: Path, receiver: Any, node_info: bool) -> None:
    with receiver.FakeKube(nodes=[f"gpu-node-{i:02d}" for i in range(30)]) as kube:
        kube.node_info = node_info
        kube.pods = [{"name": "logdx-shipper-x7k2p", "namespace": "logdx", "node": "gpu-node-12"},
                     *({"name": f"train-4711-{i}", "namespace": "train", "labels": {"job-name": "train-4711"},
                        "node": f"gpu-node-{20 + i:02d}"} for i in range(4))]
        kube.tokens = {"sa-token-of-the-pod": {"pod": "logdx-shipper-x7k2p", "namespace": "logdx",
                                               "account": "logdx-shipper", "audiences": ["logdx"]},
                       "sa-token-for-the-api": {"pod": "logdx-shipper-x7k2p", "namespace": "logdx",
                                                "account": "logdx-shipper", "audiences": ["https://kubernetes.default"]}}
        settings = _kube_settings(tmp_path, kube, kubernetes_node_tokens=True)
        settings.actions.ask_scheduler = True
        with LoopbackApp(settings, Engine.create(settings)) as app:
            shipper = httpx.Client(base_url=app.url, headers={"authorization": "Bearer sa-token-of-the-pod"}, timeout=60)
            with shipper as c:
                assert _node_xid(c, "gpu-node-12").status_code == 200
                r = _node_xid(c, "gpu-node-13")
                assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", r.text
            # A token for another audience, or none the API server knows: not a node's.
            for other in ("sa-token-for-the-api", "made-up"):
                r = httpx.post(f"{app.url}/v1/nodes/gpu-node-12/logs", content=b"x\n",
                               headers={"authorization": f"Bearer {other}"})
                assert r.status_code == 401, r.text
            # A tenant's job: its lines claim gpu-node-22, which its pods run on (the scheduler's word), and
            # gpu-node-09, which they do not.
            with _as(app, "tenant-a") as c:
                assert _post(c, "train-4711", _training() + [_xid("gpu-node-22")], host="gpu-node-22").status_code == 200
                c.post("/v1/jobs/train-4711/end", json={"exit_code": 1})
                assert _cordon_of(app, "train-4711")["outcome"] == "ok"
                assert _post(c, "train-4712", _training() + [_xid("gpu-node-09")], host="gpu-node-09").status_code == 200
                c.post("/v1/jobs/train-4712/end", json={"exit_code": 1})
                assert _cordon_of(app, "train-4712")["outcome"] == "refused"
        assert _cordoned(kube) == ["gpu-node-22"]
        reviews = [r for r in kube.requests if r.path.startswith("/apis/authentication.k8s.io")]
        assert len(reviews) == 3  # one per token: the pod's was reviewed once, then remembered
