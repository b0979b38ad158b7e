"""`logdx mcp` through the official MCP SDK's own client: over stdio (the way an agent launches it) and
over streamable HTTP, on a 64-rank job made by `logdx synth`, a folder of per-node files, and a job of a
real `logdx serve`. Read-only unless --allow-actions; actions go through the action policy (dry run)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from api_server import Server, free_port
from logdx.act.nodes import NodeBook
from logdx.agent.tools import Toolbox, ToolFailure
from logdx.config import ActionsSettings, load_settings
from logdx.incidents import IncidentStore
from logdx.store import open_db

READ_TOOLS = {"diagnose", "report", "evidence", "templates", "nodes", "search_incidents", "jobs"}
ACTION_TOOLS = {"feedback", "false_alarm", "act", "uncordon"}


def env_for(data_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOGDX_")}
    env.update({"LOGDX_DATA_DIR": str(data_dir), "HF_HUB_OFFLINE": "1", **extra})
    return env


def stdio(data_dir: Path, *args: str, **extra_env: str) -> Client:
    params = StdioServerParameters(command=sys.executable, args=["-m", "logdx", "mcp", "--no-llm", *args],
                                   env=env_for(data_dir, **extra_env))
    return Client(params, read_timeout_seconds=600)


@pytest.fixture(scope="module")
def job64(tmp_path_factory) -> tuple[Path, dict]:
    """A 64-rank job whose GPU falls off the bus on one node, as `logdx synth` writes it."""
    folder = tmp_path_factory.mktemp("job64")
    log, truth = folder / "job.log", folder / "truth.json"
    out = subprocess.run([sys.executable, "-m", "logdx", "synth", "--scenario", "xid79", "--ranks", "64",
                          "--lines", "100000", "--seed", "5", "-o", str(log), "--truth", str(truth)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return log, json.loads(truth.read_text())


def run(coro):
    return asyncio.run(coro)


def tokens(text: str) -> int:
    """Tokens of `text` by the packaged Gemma 3 tokenizer (the converted model's, a 262k-word vocabulary)."""
    from tokenizers import Tokenizer

    path = Path(os.environ["LOGDX_LLM__CACHE_DIR"]) / "gemma3-270m" / "tokenizer.json"
    return len(Tokenizer.from_file(str(path)).encode(text).ids)


# --- stdio ---------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_an_agent_diagnoses_a_64_rank_job_over_stdio(tmp_path, job64) -> None:
    log, truth = job64
    data = tmp_path / "data"

    async def session() -> dict:
        async with stdio(data) as client:
            tools = {t.name: t for t in (await client.list_tools()).tools}
            assert set(tools) == READ_TOOLS  # read-only by default
            assert all(t.annotations.read_only_hint for t in tools.values())
            assert tools["diagnose"].output_schema["properties"]["failure_type"]
            result = await client.call_tool("diagnose", {"paths": [str(log)]})
            assert not result.is_error, result.content
            report = result.structured_content
            ev = (await client.call_tool("evidence", {"report_id": report["id"]})).structured_content
            tpl = (await client.call_tool("templates", {"report_id": report["id"], "limit": 5})).structured_content
            again = (await client.call_tool("report", {"report_id": report["id"]})).structured_content
            whole = (await client.call_tool("report", {"report_id": report["id"], "full": True})).structured_content
            missing = await client.call_tool("diagnose", {"paths": [str(tmp_path / "nope.log")]})
            both = await client.call_tool("diagnose", {"paths": [str(log)], "job_id": "j"})
            no_feedback = await client.call_tool("feedback", {"report_id": report["id"], "category": "script",
                                                              "failure_type": "name_error"})
            return {"report": report, "evidence": ev, "templates": tpl, "again": again, "missing": missing,
                    "both": both, "no_feedback": no_feedback, "whole": whole}

    got = run(session())
    report = got["report"]
    assert (report["status"], report["category"], report["failure_type"], report["action"]) == (
        truth["status"], truth["category"], truth["failure_type"], truth["action"])
    assert report["culprits"]["hosts"] == truth["culprit_hosts"]
    assert report["root_cause"]["line_no"] == truth["root_line_no"]
    assert report["compression"]["lines_in"] == truth["lines_written"]
    assert got["again"] == report
    # Compact by default: what an agent acts on fits its context; the curves come only when asked for.
    whole = got["whole"]
    assert whole["omitted"] == [] and report["omitted"] and len(whole["progress"]["loss"]) > 12
    assert {k: whole[k] for k in ("status", "failure_type", "action", "culprits", "root_cause")} == \
        {k: report[k] for k in ("status", "failure_type", "action", "culprits", "root_cause")}
    assert report["progress"]["stopped"] == whole["progress"]["stopped"]
    compact_tokens, whole_tokens = tokens(json.dumps(report)), tokens(json.dumps(whole))
    print(f"\ndiagnose over MCP, 100k-line 64-rank job: {compact_tokens} tokens compact, {whole_tokens} in full")
    assert compact_tokens < 4000 and compact_tokens * 3 < whole_tokens
    ev = got["evidence"]
    assert ev["label"] == f"{truth['category']}/{truth['failure_type']}" and ev["root_cause"]["text"] == truth["root_line"]
    assert truth["root_line"] in ev["excerpt"] and ev["evidence"][0]["source"].startswith("rule:")
    tpl = got["templates"]
    assert tpl["total"] == report["compression"]["templates"] and len(tpl["templates"]) == 5
    assert all(t["error_bearing"] for t in tpl["templates"])
    assert [t["count"] for t in tpl["templates"]] == sorted((t["count"] for t in tpl["templates"]), reverse=True)
    for failed in (got["missing"], got["both"], got["no_feedback"]):
        assert failed.is_error and len(failed.content[0].text.splitlines()) == 1
    assert "no such file" in got["missing"].content[0].text
    # Read-only: the report was not stored, no node recorded (the database holds only the seed incidents).
    db = open_db(data / "logdx.db")
    try:
        assert IncidentStore(db).get_report(report["id"]) is None
        assert NodeBook(db, ActionsSettings()).list() == []
    finally:
        db.close()


# --- streamable HTTP -----------------------------------------------------------------------------------


def wait_listening(port: int, proc: subprocess.Popen, deadline_s: float = 120.0) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else proc.returncode
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"logdx mcp did not listen on {port}")


def start_http(data: Path, *args: str, token: str = "", config: Path | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    extra = {"LOGDX_SERVER__TOKEN": token} if token else {}
    if config is not None:
        extra["LOGDX_CONFIG"] = str(config)
    proc = subprocess.Popen([sys.executable, "-m", "logdx", "mcp", "--http", "--port", str(port), "--no-llm",
                             "--no-retrieval", *args], env=env_for(data, **extra), stderr=subprocess.PIPE)
    wait_listening(port, proc)
    return proc, f"http://127.0.0.1:{port}/mcp"


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def http_client(url: str, token: str) -> Client:
    transport = streamable_http_client(url, http_client=httpx2.AsyncClient(
        headers={"Authorization": f"Bearer {token}"}, timeout=httpx2.Timeout(600.0)))
    return Client(transport, read_timeout_seconds=600)


def per_node_folder(tmp_path: Path, log: Path, hosts: list[str]) -> Path:
    """The synth job as per-node files: its pdsh `host: ` prefixes turned into file names."""
    folder = tmp_path / "nodes"
    folder.mkdir()
    files: dict[str, list[str]] = {}
    for line in log.read_text().splitlines():
        host, sep, rest = line.partition(": ")
        if sep and host in hosts:
            files.setdefault(host, []).append(rest)
    for host, lines in files.items():
        (folder / f"{host}.log").write_text("\n".join(lines) + "\n")
    return folder


@pytest.mark.integration
def test_over_http_with_the_operator_token_and_actions_behind_the_policy(tmp_path, job64) -> None:
    log, truth = job64
    data, token = tmp_path / "data", "op-" + "7" * 30
    pdsh = tmp_path / "pdsh.log"
    out = subprocess.run([sys.executable, "-m", "logdx", "synth", "--scenario", "xid79", "--ranks", "16",
                          "--lines", "20000", "--style", "pdsh", "--seed", "3", "-o", str(pdsh), "--truth",
                          str(tmp_path / "pdsh.json")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    pdsh_truth = json.loads((tmp_path / "pdsh.json").read_text())
    folder = per_node_folder(tmp_path, pdsh, pdsh_truth["hosts"])
    proc, url = start_http(data, "--allow-actions", "--path", str(tmp_path), token=token)
    try:
        assert httpx.post(url, json={}, timeout=30).status_code == 401  # no token, no tool
        assert httpx.post(url, json={}, headers={"Authorization": "Bearer wrong"}, timeout=30).status_code == 401

        async def session() -> dict:
            async with http_client(url, token) as client:
                names = {t.name for t in (await client.list_tools()).tools}
                report = (await client.call_tool("diagnose", {"paths": [str(folder)]})).structured_content
                outside = await client.call_tool("diagnose", {"paths": ["/etc/hostname"]})
                acted = (await client.call_tool("act", {"report_id": report["id"], "job_id": "pdsh-3"})).structured_content
                nodes = (await client.call_tool("nodes", {"blamed_only": True})).structured_content
                learned = (await client.call_tool("feedback", {
                    "report_id": report["id"], "category": "infrastructure", "failure_type": "gpu_fell_off_bus",
                    "note": "GPU reseated"})).structured_content
                unlearned = (await client.call_tool("false_alarm", {"report_id": report["id"]})).structured_content
                return {"names": names, "report": report, "outside": outside, "acted": acted, "nodes": nodes,
                        "learned": learned, "unlearned": unlearned}

        got = run(session())
    finally:
        stop(proc)
    assert got["names"] == READ_TOOLS | ACTION_TOOLS
    report = got["report"]
    assert report["failure_type"] == pdsh_truth["failure_type"] and report["culprits"]["hosts"] == pdsh_truth["culprit_hosts"]
    assert any("files read as one job" in n for n in report["notes"])  # hosts from the file names
    assert got["outside"].is_error and "mcp.paths" in got["outside"].content[0].text
    acted = got["acted"]
    assert acted["dry_run"] is True and acted["errors"] == []
    # No actuator configured: the policy's cordon is audited as skipped, nothing changes on the cluster.
    assert [(a["action"], a["node"], a["outcome"]) for a in acted["actions"]] == [
        ("cordon", pdsh_truth["culprit_hosts"][0], "skipped")]
    assert [n["node"] for n in got["nodes"]["nodes"]] == pdsh_truth["culprit_hosts"]
    assert got["learned"]["source"] == "feedback" and got["learned"]["report_id"] == report["id"]
    assert got["unlearned"]["removed_incident"] == got["learned"]["id"]
    assert got["unlearned"]["withdrawn_from"] == pdsh_truth["culprit_hosts"]


@pytest.mark.integration
def test_http_refuses_to_serve_unprotected(tmp_path) -> None:
    for args, says in ((["--host", "0.0.0.0"], "without server.token"), (["--allow-actions"], "needs server.token")):
        out = subprocess.run([sys.executable, "-m", "logdx", "mcp", "--http", "--port", str(free_port()), *args],
                             capture_output=True, text=True, env=env_for(tmp_path), timeout=120)
        assert out.returncode == 2 and says in out.stderr and len(out.stderr.strip().splitlines()) == 1


# --- a job of a running logdx serve ------------------------------------------------------------------------


@pytest.mark.integration
def test_a_job_of_the_running_service_by_its_id(tmp_path, job64) -> None:
    log, truth = job64
    token = "svc-" + "5" * 30
    service = Server(tmp_path / "serve", token=token).start()
    try:
        with service.client() as c:
            r = c.post("/v1/jobs/llama-64/logs", content=log.read_bytes())
            assert r.status_code == 200, r.text
            assert c.post("/v1/jobs/llama-64/end", json={"exit_code": 1}).status_code == 200
            c.post("/v1/jobs/open-one/logs", content=b"[rank0]: iteration 1/100 | loss 2.0\n")

        async def session() -> dict:
            async with stdio(tmp_path / "mcp", "--service", service.url, LOGDX_SERVER__TOKEN=token) as client:
                report = (await client.call_tool("diagnose", {"job_id": "llama-64"})).structured_content
                tpl = (await client.call_tool("templates", {"job_id": "llama-64", "limit": 3})).structured_content
                jobs = (await client.call_tool("jobs", {})).structured_content
                stored = (await client.call_tool("report", {"report_id": report["id"]})).structured_content
                waiting = await client.call_tool("diagnose", {"job_id": "open-one"})
                unknown = await client.call_tool("diagnose", {"job_id": "never-seen"})
                return {"report": report, "templates": tpl, "jobs": jobs, "stored": stored, "waiting": waiting,
                        "unknown": unknown}

        got = run(session())
    finally:
        service.stop()
    report = got["report"]
    assert report["failure_type"] == truth["failure_type"] and report["culprits"]["hosts"] == truth["culprit_hosts"]
    assert report["notes"][0].startswith("job llama-64 (ended, ") and "final diagnosis" in report["notes"][0]
    assert got["stored"]["id"] == report["id"]
    assert got["templates"]["source"] == "job" and len(got["templates"]["templates"]) == 3
    assert {j["job_id"] for j in got["jobs"]["jobs"]} == {"llama-64", "open-one"}
    assert got["waiting"].is_error and "no diagnosis yet" in got["waiting"].content[0].text
    assert got["unknown"].is_error and "has no job never-seen" in got["unknown"].content[0].text


# --- the toolbox on its own -------------------------------------------------------------------------------


def test_paths_are_confined_to_mcp_paths_and_refused_over_http_without_them(tmp_path) -> None:
    (tmp_path / "logs").mkdir()
    log = tmp_path / "logs" / "node-01.log"
    log.write_text("node-01 kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.\n")
    settings = load_settings(env={"LOGDX_DATA_DIR": str(tmp_path / "d")})
    settings.llm.enabled = settings.retrieval.enabled = False
    with pytest.raises(ToolFailure, match="needs mcp.paths"):
        Toolbox(settings, http=True).diagnose(paths=[str(log)])
    settings.mcp.paths = [tmp_path / "logs"]
    box = Toolbox(settings, http=True)
    assert box.diagnose(paths=[str(log)]).failure_type == "gpu_fell_off_bus"
    for outside in (str(tmp_path / "other.log"), str(tmp_path / "logs" / ".." / "other.log")):
        with pytest.raises(ToolFailure, match="outside the folders"):
            box.diagnose(paths=[outside])
    with pytest.raises(ToolFailure, match="read-only"):
        box.uncordon("node-01", by="alice")


def test_incident_search_by_words_when_retrieval_is_off(tmp_path) -> None:
    settings = load_settings(env={"LOGDX_DATA_DIR": str(tmp_path)})
    settings.llm.enabled = settings.retrieval.enabled = False
    hits = Toolbox(settings).search_incidents("NVRM: Xid 79 GPU has fallen off the bus", k=3)
    assert 0 < len(hits.hits) <= 3 and hits.hits[0].similarity is None
    assert any(h.incident.failure_type == "gpu_fell_off_bus" for h in hits.hits)
    with pytest.raises(ToolFailure, match="empty"):
        Toolbox(settings).search_incidents("  ")
