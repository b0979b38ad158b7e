"""The HTTP service against a real server (subprocess uvicorn) and a real alert receiver."""

from __future__ import annotations

import asyncio
import gzip
import json
import random
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from api_server import (
    WEBHOOK_SECRET,
    Receiver,
    Server,
    chunks,
    make_job,
    rank_host,
    shipped_job,
    start_receiver,
)
from logdx.act.alerts import verify

EXPECTED = {"status": "failed", "category": "infrastructure", "failure_type": "gpu_fell_off_bus",
            "action": "cordon_and_restart"}


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = start_receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, receiver: Receiver) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("api"), receiver=receiver).start()
    yield srv
    srv.stop()


def _alerts_for(receiver: Receiver, path: str, job_id: str) -> list:
    out = []
    for item in receiver.of(path):
        body = item.json()
        text = json.dumps(body)
        if job_id in text:
            out.append(item)
    return out


def _wait_alerts(receiver: Receiver, job_id: str, timeout: float = 120.0) -> tuple[list, list]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        slack, hook = _alerts_for(receiver, "/slack", job_id), _alerts_for(receiver, "/hook", job_id)
        if slack and hook:
            return slack, hook
        time.sleep(0.02)
    raise AssertionError(f"no alert for {job_id} within {timeout}s")


# --- the main scenario: 64 ranks, 64 concurrent chunked streams ------------------------------------


def test_64_ranks_streamed_concurrently_early_alert_then_final_diagnosis(server: Server, receiver: Receiver) -> None:
    """A 64-rank job (logdx.synth, Xid 79) from 64 concurrent chunked uploads, one per rank."""
    job_id = "llm-70b.run-0042"
    job = shipped_job("xid79", ranks=64, lines=20_000)
    total = job.total
    rng = random.Random(1)

    async def body(rank: int) -> AsyncIterator[bytes]:
        for piece in chunks(job.per_client[rank], per_chunk=40):  # cut mid-line at times
            yield piece
            await asyncio.sleep(rng.random() * 0.002)

    async def stream(client: httpx.AsyncClient, rank: int) -> httpx.Response:
        headers = {"content-type": "text/plain"}
        if rank % 2 == 1:  # these shippers carry only their rank's lines: they may say so in headers
            headers.update({"x-logdx-rank": str(rank), "x-logdx-host": job.hosts[rank // 8]})
        return await client.post(f"/v1/jobs/{job_id}/logs", content=body(rank), headers=headers)

    async def run() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=60, limits=limits) as client:
            return await asyncio.gather(*(stream(client, r) for r in range(64)))

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * 64, [r.text for r in responses if r.status_code != 200]
    assert sum(r.json()["accepted_lines"] for r in responses) == total

    # The early diagnosis reaches both destinations before the job ends.
    slack, hook = _wait_alerts(receiver, job_id)
    assert len(slack) == 1 and len(hook) == 1
    assert verify(WEBHOOK_SECRET, hook[0].headers, hook[0].body)
    assert not verify("whsec_" + "d3Jvbmcta2V5", hook[0].headers, hook[0].body)
    event = hook[0].json()
    assert event["type"] == "logdx.diagnosis" and event["data"]["job_id"] == job_id
    assert {k: event["data"]["report"][k] for k in job.expected} == job.expected
    slack_text = json.dumps(slack[0].json())
    assert job.expected["failure_type"] in slack_text and job.culprit_hosts[0] in slack_text

    with server.client() as c:
        detail = c.get(f"/v1/jobs/{job_id}").json()
        assert detail["state"] == "open" and detail["lines"] == total
        assert detail["compression"]["lines_in"] == total
        assert detail["compression"]["world_size"] == 64 and detail["compression"]["hosts"] == 8
        assert detail["root_cause_seen"] is True
        assert {k: detail["report"][k] for k in job.expected} == job.expected
        assert [r["kind"] for r in detail["reports"]] == ["early"]
        early_id = detail["report"]["id"]

        final = c.post(f"/v1/jobs/{job_id}/end", json={"exit_code": 1})
        assert final.status_code == 200, final.text
        report = final.json()
        assert {k: report[k] for k in job.expected} == job.expected
        assert report["culprits"]["hosts"] == job.culprit_hosts
        assert report["root_cause"]["text"] == job.root_line
        assert report["compression"]["lines_in"] == total
        assert report["id"] != early_id

        again = c.post(f"/v1/jobs/{job_id}/end")  # idempotent
        assert again.status_code == 200 and again.json()["id"] == report["id"]
        late = c.post(f"/v1/jobs/{job_id}/logs", content=b"one more line\n")
        assert late.status_code == 409 and late.json()["error"]["code"] == "job_ended"

        assert c.get(f"/v1/reports/{report['id']}").json() == report
        ended = c.get(f"/v1/jobs/{job_id}").json()
        assert ended["state"] == "ended" and ended["exit_code"] == 1 and ended["lines"] == total
        assert [r["kind"] for r in ended["reports"]] == ["early", "final"]
        assert {a["kind"] for a in ended["alerts"]} == {"slack", "webhook"}
        assert all(a["status"] == "delivered" for a in ended["alerts"])
        assert any(a["action"] == "cordon" for a in ended["actions"])  # dry run, no actuator: audited
        templates = c.get(f"/v1/jobs/{job_id}/templates", params={"limit": 5}).json()
        assert templates["state"] == "ended" and templates["total"] > 5 and len(templates["templates"]) == 5
        counts = [t["count"] for t in templates["templates"]]
        assert counts == sorted(counts, reverse=True)
        listed = {j["job_id"]: j for j in c.get("/v1/jobs").json()["jobs"]}
        assert listed[job_id]["diagnosis"]["failure_type"] == job.expected["failure_type"]

    # Same diagnosis at the end: no second alert.
    time.sleep(1.0)
    assert len(_alerts_for(receiver, "/slack", job_id)) == 1
    assert len(_alerts_for(receiver, "/hook", job_id)) == 1


# --- formats -------------------------------------------------------------------------------------


def _small_job() -> tuple[dict[int, list[str]], int]:
    job = make_job(ranks=16, steps=20, culprit=5)
    return job, sum(len(v) for v in job.values())


def _end_and_check(c: httpx.Client, job_id: str, total: int, hosts: int = 2) -> dict:
    detail = c.get(f"/v1/jobs/{job_id}").json()
    assert detail["lines"] == total, detail
    assert detail["compression"]["hosts"] == hosts
    report = c.post(f"/v1/jobs/{job_id}/end").json()
    assert {k: report[k] for k in EXPECTED} == EXPECTED, report
    assert report["culprits"]["hosts"] == ["gpu-node-00"]
    return report


def _records(job: dict[int, list[str]], steps: int = 20) -> Iterator[tuple[int, str, float]]:
    """(rank, line, time the line was written), ranks one after the other (each shipper's order)."""
    t0 = 1714564800.0
    for rank in sorted(job):
        for i, line in enumerate(job[rank]):
            if i < 2:
                ts = t0
            elif i < 2 + steps:
                ts = t0 + 10 * (i - 2)
            else:
                ts = t0 + 10 * steps + 5  # the failure
            yield rank, line, ts


def test_gzip_streamed_and_multi_member(server: Server) -> None:
    job, total = _small_job()
    text = "".join(line + "\n" for _, line, _ in _records(job)).encode()
    blob = gzip.compress(text)
    pieces = [blob[i:i + 997] for i in range(0, len(blob), 997)]  # cut anywhere in the deflate stream
    with server.client() as c:
        r = c.post("/v1/jobs/fmt-gzip/logs", content=iter(pieces),
                   headers={"content-encoding": "gzip", "content-type": "text/plain"})
        assert r.status_code == 200, r.text
        assert r.json()["accepted_lines"] == total and r.json()["accepted_bytes"] == len(blob)
        _end_and_check(c, "fmt-gzip", total)
        # `cat a.gz b.gz`: several gzip members in one body, no Content-Encoding (found by magic).
        half = len(text) // 2
        cut = text.rfind(b"\n", 0, half) + 1
        members = gzip.compress(text[:cut]) + gzip.compress(text[cut:])
        r = c.post("/v1/jobs/fmt-gzip2/logs", content=members)
        assert r.status_code == 200 and r.json()["accepted_lines"] == total, r.text


def test_ndjson_records(server: Server) -> None:
    job, total = _small_job()
    body = "".join(json.dumps({"line": line, "rank": rank, "host": rank_host(rank), "ts": ts}) + "\n"
                   for rank, line, ts in _records(job)).encode()
    with server.client() as c:
        r = c.post("/v1/jobs/fmt-ndjson/logs", content=iter([body[i:i + 4096] for i in range(0, len(body), 4096)]),
                   headers={"content-type": "application/x-ndjson"})
        assert r.status_code == 200 and r.json()["accepted_lines"] == total, r.text
        _end_and_check(c, "fmt-ndjson", total)


def test_fluent_bit_json_array_and_json_lines(server: Server) -> None:
    """Fluent Bit's http output: `format json` posts one array of records with `date` (a double,
    by default) and `log`; `format json_lines` posts NDJSON. Kubernetes metadata names the node."""
    job, total = _small_job()
    records = [{"date": ts, "log": line + "\n", "stream": "stderr",
                "kubernetes": {"pod_name": f"trainer-{rank // 8}", "host": rank_host(rank)}}
               for rank, line, ts in _records(job)]
    array = json.dumps(records).encode()
    with server.client() as c:
        r = c.post("/v1/jobs/fmt-fluentbit/logs", content=iter([array[i:i + 3001] for i in range(0, len(array), 3001)]),
                   headers={"content-type": "application/json", "user-agent": "Fluent-Bit"})
        assert r.status_code == 200 and r.json()["accepted_lines"] == total, r.text
        _end_and_check(c, "fmt-fluentbit", total)

        iso = [{**rec, "date": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(rec["date"])) + ".000681Z"}
               for rec in records]  # json_date_format iso8601
        lines = "\n".join(json.dumps(rec) for rec in iso).encode()
        r = c.post("/v1/jobs/fmt-fluentbit-lines/logs", content=gzip.compress(lines),
                   headers={"content-type": "application/x-ndjson", "content-encoding": "gzip"})
        assert r.status_code == 200 and r.json()["accepted_lines"] == total, r.text
        _end_and_check(c, "fmt-fluentbit-lines", total)


def test_vector_json_array_and_newline_delimited(server: Server) -> None:
    """Vector's http sink with `encoding.codec = "json"`: a JSON array of events (`message`,
    `host`, RFC 3339 `timestamp` with nanoseconds); with `framing.method = "newline_delimited"`:
    NDJSON. A record without a message field is skipped and counted."""
    job, total = _small_job()
    events = [{"message": line, "host": rank_host(rank), "source_type": "file", "file": "/var/log/train.log",
               "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + ".123456789Z"}
              for rank, line, ts in _records(job)]
    events.insert(3, {"host": "gpu-node-00", "timestamp": "2024-05-01T12:00:00Z", "source_type": "file"})
    body = json.dumps(events, separators=(",", ":")).encode()
    with server.client() as c:
        r = c.post("/v1/jobs/fmt-vector/logs", content=iter([body[i:i + 1500] for i in range(0, len(body), 1500)]),
                   headers={"content-type": "application/json", "user-agent": "Vector/0.40"})
        assert r.status_code == 200 and r.json()["partial"] and r.headers["x-logdx-refused"] == "1", r.text  # never a bare 200
        assert r.json()["accepted_lines"] == total and r.json()["refused"] == {"no_message": 1}
        assert r.json()["skipped_records"] == 1 and r.json()["partial"] is True
        _end_and_check(c, "fmt-vector", total)

        ndjson = "\n".join(json.dumps(e) for e in events).encode()
        r = c.post("/v1/jobs/fmt-vector-nd/logs", content=ndjson, headers={"content-type": "application/x-ndjson"})
        assert r.status_code == 200 and r.json()["partial"] and r.json()["accepted_lines"] == total, r.text
        _end_and_check(c, "fmt-vector-nd", total)


def test_one_shot_diagnose_streamed(server: Server) -> None:
    job, total = _small_job()
    text = "".join(line + "\n" for _, line, _ in _records(job)).encode()
    with server.client() as c:
        r = c.post("/v1/diagnose", content=iter([text[i:i + 777] for i in range(0, len(text), 777)]),
                   params={"exit_code": 1})
        assert r.status_code == 200, r.text
        report = r.json()
        assert {k: report[k] for k in EXPECTED} == EXPECTED
        assert report["compression"]["lines_in"] == total
        assert c.get(f"/v1/reports/{report['id']}").json()["id"] == report["id"]
        steps = "".join(f"[rank0]: iteration {i:3d}/ 100 | lm loss: 2.3\n" for i in range(1, 51)).encode()
        healthy = c.post("/v1/diagnose", content=steps).json()
        assert healthy["status"] == "healthy" and healthy["action"] == "none"
        # The same step fifty times shows no training going on: no failure, and no health either.
        same = c.post("/v1/diagnose", content=b"[rank0]: iteration 1/ 10 | lm loss: 2.3\n" * 50).json()
        assert same["status"] == "unknown" and same["action"] == "none" and same["category"] is None


def test_feedback_and_incident_crud(server: Server) -> None:
    job, _ = _small_job()
    text = "".join(line + "\n" for _, line, _ in _records(job)).encode()
    with server.client() as c:
        report = c.post("/v1/diagnose", content=text).json()
        r = c.post(f"/v1/reports/{report['id']}/feedback",
                   json={"category": "infrastructure", "failure_type": "gpu_fell_off_bus",
                         "note": "confirmed by on-call"})
        assert r.status_code == 200, r.text
        incident = r.json()
        assert incident["report_id"] == report["id"] and incident["source"] == "feedback"
        assert c.get(f"/v1/incidents/{incident['id']}").json()["failure_type"] == "gpu_fell_off_bus"
        bad = c.post(f"/v1/reports/{report['id']}/feedback",
                     json={"category": "script", "failure_type": "gpu_fell_off_bus"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_feedback"

        created = c.post("/v1/incidents", json={
            "id": "inc-test-1", "root_line": "OSError: [Errno 28] No space left on device",
            "category": "infrastructure", "failure_type": "disk_full", "note": "checkpoint volume full"})
        assert created.status_code == 201, created.text
        assert created.json()["root_template"]
        listed = c.get("/v1/incidents", params={"failure_type": "disk_full"}).json()
        assert "inc-test-1" in {i["id"] for i in listed["incidents"]}
        invalid = c.post("/v1/incidents", json={"root_line": "x", "category": "script", "failure_type": "nope"})
        assert invalid.status_code == 422 and invalid.json()["error"]["code"] == "invalid_request"
        assert c.delete("/v1/incidents/inc-test-1").status_code == 204
        gone = c.get("/v1/incidents/inc-test-1")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "incident_not_found"
        assert c.delete("/v1/incidents/inc-test-1").status_code == 404


def test_metrics_and_health(server: Server) -> None:
    with server.client() as c:
        assert c.get("/healthz").json() == {"status": "ok"}
        ready = c.get("/readyz").json()
        assert ready["status"] == "ready" and ready["rules"] > 0
        c.post("/v1/jobs/metrics-job/logs", content=b"hello\nworld\n")
        text = c.get("/metrics").text
    for name in ("logdx_ingest_lines_total", "logdx_ingest_bytes_total", "logdx_templates", "logdx_reports_total",
                 "logdx_stage_duration_seconds_bucket", "logdx_alert_deliveries_total", "logdx_jobs",
                 "logdx_http_request_duration_seconds_bucket"):
        assert name in text, name
    assert 'logdx_http_requests_total{method="POST",route="/v1/jobs/{job_id}/logs",status="200"}' in text
    assert 'logdx_alert_deliveries_total{kind="webhook",outcome="ok"}' in text


def test_openapi_describes_the_api(server: Server) -> None:
    with server.client() as c:
        spec = c.get("/openapi.json").json()
    for path in ("/v1/jobs/{job_id}/logs", "/v1/jobs/{job_id}/end", "/v1/jobs", "/v1/jobs/{job_id}",
                 "/v1/jobs/{job_id}/templates", "/v1/reports/{report_id}", "/v1/reports/{report_id}/feedback",
                 "/v1/diagnose", "/v1/incidents", "/v1/incidents/{incident_id}", "/healthz", "/readyz", "/metrics"):
        assert path in spec["paths"], path





def test_a_false_alarm_unlearns_the_reports_incident_and_is_refused_for_a_healthy_report(server: Server) -> None:
    job, _ = _small_job()
    text = "".join(line + "\n" for _, line, _ in _records(job)).encode()
    with server.client() as c:
        report = c.post("/v1/diagnose", content=text).json()
        incident = c.post(f"/v1/reports/{report['id']}/feedback",
                          json={"category": "infrastructure", "failure_type": "gpu_fell_off_bus"}).json()
        r = c.post(f"/v1/reports/{report['id']}/false-alarm", json={"note": "the job had finished; a test GPU"})
        assert r.status_code == 200, r.text
        assert r.json()["removed_incident"] == incident["id"]
        assert r.json()["was"] == f"{report['category']}/{report['failure_type']}"
        assert c.get(f"/v1/incidents/{incident['id']}").status_code == 404
        again = c.post(f"/v1/reports/{report['id']}/false-alarm", json={})
        assert again.status_code == 200 and again.json()["removed_incident"] is None
        healthy = c.post("/v1/diagnose", content="".join(
            f"[rank0]: iteration {i:3d}/ 100 | lm loss: 2.3\n" for i in range(1, 51)).encode()).json()
        refused = c.post(f"/v1/reports/{healthy['id']}/false-alarm", json={})
        assert refused.status_code == 400 and "not failed" in refused.json()["error"]["message"]
        assert c.post("/v1/reports/0123456789ab/false-alarm", json={}).status_code == 404
        assert c.post(f"/v1/reports/{report['id']}/false-alarm", json={"category": "script"}).status_code == 422
