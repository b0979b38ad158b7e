"""Roles (issue 20 point 7): separate credentials for shippers, readers and operators, named, stored as
SHA-256 and compared in constant time; the audit records the token's name; without tokens the
operator endpoints need an explicit opt-in; a tenant's shipper cannot touch another tenant's jobs.
And `LOGDX_TOKEN`, the shippers' variable, no longer stops logdx from starting (issue 21)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api_server import LoopbackApp
from logdx.access.auth import token_digest
from logdx.config import ConfigError, Settings, load_settings
from logdx.pipeline import Engine

pytestmark = pytest.mark.integration

TOKENS = {"fluentbit-a": ("shipper", "team-a"), "fluentbit-b": ("shipper", "team-b"), "daemonset": ("shipper", ""),
          "grafana": ("reader", ""), "oncall-alice": ("operator", "")}
SECRET = {name: f"secret-of-{name}-0123456789abcdef" for name in TOKENS}
XID = b"[rank3]:node-07 kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.\n"


def _settings(tmp: Path, **server: Any) -> Settings:
    return Settings.model_validate({
        "data_dir": str(tmp), "llm": {"enabled": False}, "retrieval": {"enabled": False},
        "server": {"early_diagnosis_delay_s": 0.1, **server}})


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return Engine.create(_settings(tmp_path_factory.mktemp("engine")))


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory, engine: Engine) -> Iterator[LoopbackApp]:
    # The cluster's own node shipper may speak for every host (server.tokens[].hosts: '*'); the others for none.
    tokens = [{"name": n, "role": r, "tenant": t, "sha256": token_digest(SECRET[n]), "hosts": ["*"] if n == "daemonset" else []}
              for n, (r, t) in TOKENS.items()]
    with LoopbackApp(_settings(tmp_path_factory.mktemp("roles"), tokens=tokens), engine) as app:
        yield app


def _as(app: LoopbackApp, name: str | None) -> httpx.Client:
    headers = {"authorization": f"Bearer {SECRET[name]}"} if name else {"x-requested-with": "t"}
    return httpx.Client(base_url=app.url, headers=headers, timeout=60)


def _code(r: httpx.Response) -> tuple[int, str]:
    return r.status_code, (r.json().get("error") or {}).get("code", "") if r.status_code >= 400 else ""


def test_tokens_are_stored_as_digests_only(app: LoopbackApp) -> None:
    dumped = app.services.settings.model_dump_json()
    assert not any(secret in dumped for secret in SECRET.values())
    with _as(app, None) as c:
        assert _code(c.get("/v1/jobs")) == (401, "unauthorized")
    with httpx.Client(base_url=app.url, headers={"authorization": "Bearer secret-of-grafana-0123456789abcdeX"}) as c:
        assert _code(c.get("/v1/jobs")) == (401, "unauthorized")


def test_a_shipper_writes_and_reads_its_jobs_and_nothing_else(app: LoopbackApp) -> None:
    with _as(app, "fluentbit-a") as c:
        assert c.post("/v1/jobs/a-run-1/logs", content=XID, headers={"x-logdx-host": "node-07"}).status_code == 200
        assert c.get("/v1/jobs/a-run-1").status_code == 200
        assert c.get("/v1/jobs/a-run-1/templates").status_code == 200
        for r in (c.post("/v1/actions/reset", json={"by": "alice"}),
                  c.post("/v1/nodes/node-07/uncordon", json={"by": "alice"}),
                  c.delete("/v1/incidents/seed-xid-79"),
                  c.post("/v1/incidents", json={"root_line": "x", "category": "script", "failure_type": "key_error"}),
                  c.get("/v1/jobs"), c.get("/metrics"), c.get("/v1/nodes"), c.get("/v1/actions")):
            assert _code(r) == (403, "forbidden"), (r.request.url, r.text)
        assert c.get("/v1/incidents/seed-xid-79").status_code == 403


def test_a_reader_reads_and_writes_nothing(app: LoopbackApp) -> None:
    with _as(app, "grafana") as c:
        for path in ("/v1/jobs", "/v1/nodes", "/v1/actions", "/metrics", "/v1/incidents", "/v1/cluster", "/openapi.json"):
            assert c.get(path).status_code == 200, path
        assert _code(c.post("/v1/jobs/r-1/logs", content=XID, headers={"x-a": "1"})) == (403, "forbidden")
        assert _code(c.post("/v1/actions/reset", json={})) == (403, "forbidden")
        assert _code(c.post("/v1/jobs/a-run-1/end", json={"exit_code": 1})) == (403, "forbidden")


def test_the_audit_names_the_operators_token_never_the_stated_name(app: LoopbackApp) -> None:
    with _as(app, "oncall-alice") as c:
        r = c.post("/v1/actions/reset", json={"by": "mallory", "note": "GPU swapped"})
        assert r.status_code == 200, r.text
        assert r.json()["job_id"] == "oncall-alice"  # the audit's who
        assert "closed by oncall-alice" in r.json()["detail"] and "on behalf of 'mallory', as stated" in r.json()["detail"]
        audit = c.get("/v1/actions").json()["audit"]
        assert audit[-1]["action"] == "breaker" and audit[-1]["job_id"] == "oncall-alice"


def test_job_ids_are_namespaced_so_one_tenant_can_neither_squat_nor_see_anothers(app: LoopbackApp) -> None:
    """Issue 29: the same job name used by two tenants is two jobs; another tenant's job is as missing
    as a job that never was; a cluster-wide token names a tenant's job by its qualified id."""
    with _as(app, "fluentbit-a") as a, _as(app, "fluentbit-b") as b, _as(app, "daemonset") as d:
        r = a.post("/v1/jobs/train-42/logs", content=XID, headers={"x-a": "1"})
        assert r.status_code == 200 and r.json()["job_id"] == "team-a:train-42", r.text
        r = b.post("/v1/jobs/train-42/logs", content=b"b's own line\n", headers={"x-a": "1"})  # the name is free
        assert r.status_code == 200 and r.json()["job_id"] == "team-b:train-42", r.text
        assert a.get("/v1/jobs/train-42").json()["lines"] == 1 and b.get("/v1/jobs/train-42").json()["lines"] == 1
        assert a.get("/v1/jobs/team-a:train-42").json()["job_id"] == "team-a:train-42"
        missing, foreign = b.get("/v1/jobs/team-a:never-was"), b.get("/v1/jobs/team-a:train-42")
        assert _code(missing) == _code(foreign) == (404, "job_not_found")
        assert missing.json()["error"]["message"] == "no job 'team-a:never-was'"  # the same words, ids aside
        assert _code(b.get("/v1/jobs/team-a:train-42/templates")) == (404, "job_not_found")
        # writing under another tenant's name is refused by the name alone (existing or not)
        for path in ("/v1/jobs/team-a:train-42/logs", "/v1/jobs/team-a:never-was/logs"):
            assert _code(b.post(path, content=XID, headers={"x-a": "1"})) == (403, "tenant_mismatch")
        assert _code(b.post("/v1/jobs/team-a:train-42/end", json={"exit_code": 1})) == (403, "tenant_mismatch")
        # routed: the record naming the other tenant's job refuses the request, which applies nothing
        body = b'{"log": "x", "job_id": "tenant-b-job"}\n{"log": "y", "job_id": "team-a:train-42"}\n'
        r = b.post("/v1/logs", content=body, headers={"content-type": "application/x-ndjson"})
        assert _code(r) == (403, "tenant_mismatch"), r.text
        assert _code(b.get("/v1/jobs/tenant-b-job"))[0] == 404  # the job the refused request created is gone
        # a cluster-wide shipper (the nodes' DaemonSet) writes into a tenant's job by its qualified id; its
        # plain name is a job without a tenant, which no tenant's token reaches
        assert d.post("/v1/jobs/team-a:train-42/logs", content=b"kernel line\n", headers={"x-a": "1"}).status_code == 200
        r = d.post("/v1/jobs/train-42/logs", content=b"x\n", headers={"x-a": "1"})
        assert r.status_code == 200 and r.json()["job_id"] == "train-42", r.text
        assert a.get("/v1/jobs/train-42").json()["lines"] == 2
        assert _code(a.get("/v1/jobs/team-b:train-42")) == (404, "job_not_found")


def test_without_tokens_operator_endpoints_need_an_explicit_opt_in(tmp_path: Path, engine: Engine) -> None:
    with LoopbackApp(_settings(tmp_path / "closed"), engine) as app, _as(app, None) as c:
        assert c.post("/v1/jobs/local-1/logs", content=XID, headers={"x-a": "1"}).status_code == 200
        assert c.get("/v1/jobs").status_code == 200
        for r in (c.post("/v1/actions/reset", json={"by": "alice"}), c.delete("/v1/incidents/seed-xid-79"),
                  c.post("/v1/nodes/node-07/uncordon", json={"by": "alice"})):
            assert _code(r) == (403, "operator_disabled"), r.text
    with LoopbackApp(_settings(tmp_path / "opted", local_operator=True), engine) as app, _as(app, None) as c:
        r = c.post("/v1/actions/reset", json={"by": "alice"})
        assert r.status_code == 200 and r.json()["job_id"] == "local:alice", r.text
        assert "unauthenticated" in r.json()["detail"]


def test_logdx_token_in_the_environment_is_the_shippers_and_is_accepted(tmp_path: Path) -> None:
    """Issue 21: one `.env` shared by the shippers and the server; LOGDX_TOKEN is read by neither logdx
    command, and the strict check of LOGDX_* names still holds for everything else."""
    settings = load_settings(env={"LOGDX_TOKEN": "shared-secret"})
    assert "shared-secret" not in settings.model_dump_json()
    with pytest.raises(ConfigError, match="LOGDX_TOKN: unknown logdx environment variable"):
        load_settings(env={"LOGDX_TOKN": "x"})
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("LOGDX_")}, "LOGDX_TOKEN": "shared-secret"}
    env["LOGDX_DATA_DIR"] = str(tmp_path)
    log = b"[rank0]: Traceback (most recent call last):\n[rank0]: KeyError: 'labels'\n"
    diagnose = subprocess.run([sys.executable, "-c", "from logdx.cli.app import diagnose_main; diagnose_main()",
                               "-", "--no-llm", "--no-retrieval", "--json"],
                              input=log, capture_output=True, env=env, timeout=300, check=False)
    assert diagnose.returncode == 0, diagnose.stderr.decode()[-2000:]
    # `logdx serve` reads its settings first: it gets as far as its own argument checks
    serve = subprocess.run([sys.executable, "-m", "logdx", "serve", "--port", "0"], capture_output=True, env=env,
                           timeout=300, check=False)
    assert serve.returncode == 2 and "--port must be in 1..65535" in serve.stderr.decode(), serve.stderr.decode()


def test_node_lines_come_only_from_cluster_wide_shippers(app: LoopbackApp) -> None:
    """Node lines (a host, no job) join every job on their host, whoever's: a tenant's token may not send
    them (its no-job records stay refused), the nodes' DaemonSet token may."""
    record = b'{"log": "kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.", "host": "node-09"}\n'
    ndjson = {"content-type": "application/x-ndjson"}
    with _as(app, "fluentbit-a") as a, _as(app, "daemonset") as d:
        assert _code(a.post("/v1/nodes/node-09/logs", content=b"kernel: x\n", headers={"x-a": "1"})) == (
            403, "tenant_mismatch")
        r = a.post("/v1/logs", content=record, headers=ndjson)
        assert _code(r) == (422, "nothing_usable") and r.json()["error"]["refused"] == {"no_job": 1}, r.text
        r = d.post("/v1/logs", content=record, headers=ndjson)
        assert r.status_code == 200 and r.json()["node_lines"] == 1, r.text
        r = d.post("/v1/nodes/node-09/logs", content=b"kernel: y\n", headers={"x-a": "1"})
        assert r.status_code == 200 and r.json()["node_lines"] == 1, r.text
