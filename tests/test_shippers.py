"""The log pipelines users already run, with their real clients, against a real `logdx serve`.

For each client, a 2-host 16-rank job dies of Xid 79 on one host: the job is routed by the client's
own metadata (an OTLP resource attribute, a Loki label, a Fluent Bit record field, a header), is
diagnosed `gpu_fell_off_bus` with that host as culprit, and every line is counted exactly once.
"""

from __future__ import annotations

import json
import logging
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgpack
import pytest

from api_server import Server, exited, make_job, needs_syslog_ng, rank_host, running_syslog_ng

RANKS, STEPS, CULPRIT = 16, 20, 5
EXPECTED = {"status": "failed", "category": "infrastructure", "failure_type": "gpu_fell_off_bus",
            "action": "cordon_and_restart"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("shippers")).start()
    yield srv
    srv.stop()


def _job() -> tuple[dict[int, list[str]], int]:
    job = make_job(ranks=RANKS, steps=STEPS, culprit=CULPRIT)
    return job, sum(len(v) for v in job.values())


def _wait_lines(c: httpx.Client, job_id: str, total: int, timeout: float = 30.0,
                alive: subprocess.Popen | None = None) -> dict:
    deadline = time.monotonic() + timeout
    detail: dict = {}
    while time.monotonic() < deadline and (alive is None or alive.poll() is None):
        r = c.get(f"/v1/jobs/{job_id}")
        if r.status_code == 200:
            detail = r.json()
            if detail["lines"] >= total:
                break
        time.sleep(0.1)
    return detail


def _check(server: Server, job_id: str, total: int) -> None:
    """Every line counted once; the final diagnosis names the culprit's host."""
    with server.client() as c:
        detail = _wait_lines(c, job_id, total)
        assert detail.get("lines") == total, detail
        assert detail["compression"]["hosts"] == 2
        report = c.post(f"/v1/jobs/{job_id}/end", json={"exit_code": 1}).json()
    assert {k: report[k] for k in EXPECTED} == EXPECTED, report
    assert report["culprits"]["hosts"] == [rank_host(CULPRIT)]
    assert report["compression"]["lines_in"] == total


# --- OpenTelemetry ---------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning")
def test_opentelemetry_sdk_otlp_http_protobuf(server: Server) -> None:
    from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
    from opentelemetry.sdk._logs import LoggerProvider, LoggingHandler
    from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
    from opentelemetry.sdk.resources import Resource

    job_id, (job, total) = "otel-proto-1", _job()
    providers = {}
    for host in sorted({rank_host(r) for r in job}):
        provider = LoggerProvider(resource=Resource.create({"service.name": "trainer", "host.name": host,
                                                            "slurm.job.id": job_id}))
        provider.add_log_record_processor(BatchLogRecordProcessor(
            OTLPLogExporter(endpoint=server.url + "/v1/logs", timeout=10), schedule_delay_millis=200))
        providers[host] = provider
    for rank in sorted(job):
        logger = logging.getLogger(f"logdx-test.otel.rank{rank}")
        logger.propagate = False
        logger.setLevel(logging.INFO)
        handler = LoggingHandler(logger_provider=providers[rank_host(rank)])
        logger.addHandler(handler)
        for line in job[rank]:
            logger.info(line, extra={"rank": rank})
        logger.removeHandler(handler)
    for provider in providers.values():
        assert provider.force_flush(20_000)
        provider.shutdown()
    _check(server, job_id, total)


def test_otlp_json_hand_built(server: Server) -> None:
    job_id, (job, total) = "otel-json-1", _job()
    t0 = 1714564800
    body = {"resourceLogs": [
        {"resource": {"attributes": [{"key": "host.name", "value": {"stringValue": host}},
                                     {"key": "k8s.job.name", "value": {"stringValue": job_id}}]},
         "scopeLogs": [{"scope": {"name": "trainer"}, "logRecords": [
             {"timeUnixNano": str((t0 + i) * 10**9), "observedTimeUnixNano": str((t0 + i) * 10**9),
              "severityNumber": 9, "severityText": "INFO", "body": {"stringValue": line},
              "attributes": [{"key": "rank", "value": {"intValue": str(rank)}}],
              "traceId": "", "spanId": ""}
             for rank in sorted(job) if rank_host(rank) == host for i, line in enumerate(job[rank])]}]}
        for host in sorted({rank_host(r) for r in job})]}
    body["resourceLogs"][0]["scopeLogs"][0]["logRecords"].append({"body": {"stringValue": "x"},
                                                                  "resource": "misplaced"})
    # A record of another job in the same body goes to that job; a record naming none is refused, counted.
    body["resourceLogs"].append({"resource": {"attributes": []}, "scopeLogs": [{"logRecords": [
        {"body": {"stringValue": "nobody's line"}}]}]})
    with server.client() as c:
        r = c.post("/v1/logs", content=json.dumps(body), headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("application/json")
        assert r.json()["partialSuccess"]["rejectedLogRecords"] == "1"
        assert "no job" in r.json()["partialSuccess"]["errorMessage"]
        with_x = c.get(f"/v1/jobs/{job_id}").json()["lines"]
    _check(server, job_id, total + 1)  # the "x" record is a line of the job too
    assert with_x == total + 1


# --- Loki ------------------------------------------------------------------------------------------


def test_python_logging_loki(server: Server) -> None:
    import logging_loki

    job_id, (job, total) = "loki-1", _job()
    for rank in sorted(job):
        handler = logging_loki.LokiHandler(url=server.url + "/loki/api/v1/push", version="1",
                                           tags={"job_id": job_id, "host": rank_host(rank), "rank": str(rank)})
        logger = logging.getLogger(f"logdx-test.loki.rank{rank}")
        logger.propagate = False
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)
        for line in job[rank]:
            logger.info(line)  # a failed push raises inside the handler: logging reports it, the count misses
        logger.removeHandler(handler)
    _check(server, job_id, total)
    with httpx.Client(base_url=server.url) as c:  # nothing usable: a 4xx naming why, not a 204
        r = c.post("/loki/api/v1/push", json={"streams": [{"stream": {"app": "x"}, "values": [["1", "a"]]}]})
        assert r.status_code == 422 and r.json()["error"]["refused"] == {"no_job": 1}


# --- Fluent Bit msgpack ------------------------------------------------------------------------------


def _event_time(ts: float) -> msgpack.ExtType:
    return msgpack.ExtType(0, struct.pack(">II", int(ts), int(round((ts % 1) * 1e9))))


def test_fluent_bit_msgpack_bodies(server: Server) -> None:
    """Fluent Bit's `http` output in its default format: concatenated msgpack events per chunk, the
    older `[time, record]` form from one node and the 2.1+ `[[time, metadata], record]` from the other;
    the job from the Kubernetes Job's pod label, the host from the Kubernetes filter."""
    job_id, (job, total) = "fluentbit-1", _job()
    t0 = 1714564800.0
    bodies: list[bytes] = []
    for rank in sorted(job):
        host = rank_host(rank)
        events = []
        for i, line in enumerate(job[rank]):
            record = {"log": line + "\n", "stream": "stderr",
                      "kubernetes": {"pod_name": f"trainer-{rank}", "host": host, "labels": {"job-name": job_id}}}
            ts = _event_time(t0 + i + 0.25)
            events.append(msgpack.packb([ts, record] if host.endswith("0") else [[ts, {}], record]))
        bodies.append(b"".join(events))
    with server.client() as c:
        for body in bodies:
            r = c.post("/v1/logs", content=body, headers={"content-type": "application/msgpack",
                                                          "user-agent": "Fluent-Bit"})
            assert r.status_code == 200, r.text
            assert r.json()["refused"] == {} and r.json()["jobs"] == {job_id: r.json()["accepted_lines"]}
    _check(server, job_id, total)


# --- syslog-ng ---------------------------------------------------------------------------------------

@needs_syslog_ng
def test_syslog_ng_http_destination(server: Server, tmp_path: Path) -> None:
    """Debian's syslog-ng reading each node's log file, posting NDJSON batches with its `http()`
    destination; the job named by a header, the host by syslog-ng's own $HOST."""
    job_id, (job, total) = "syslogng-1", _job()
    sources, paths = [], []
    for n, host in enumerate(sorted({rank_host(r) for r in job})):
        path = tmp_path / f"{host}.log"
        path.write_text("".join(line + "\n" for rank in sorted(job) if rank_host(rank) == host for line in job[rank]))
        paths.append(path)
        sources.append(f'source s{n} {{ file("{path}" flags(no-parse) host-override("{host}") follow-freq(0.2)); }};')
    conf = f"""@version: current
{chr(10).join(sources)}
destination d_logdx {{
    http(url("{server.url}/v1/logs") method("POST")
         headers("Content-Type: application/x-ndjson", "X-Logdx-Job: {job_id}")
         body("$(format-json --scope none message=$MSG host=$HOST)")
         batch-lines(100) batch-timeout(200) workers(1));
}};
log {{ {" ".join(f"source(s{n});" for n in range(len(paths)))} destination(d_logdx); }};
"""
    with running_syslog_ng(tmp_path, conf) as proc:
        with server.client() as c:
            detail = _wait_lines(c, job_id, total, timeout=60, alive=proc)
        if proc.poll() is not None:
            raise exited(proc, "syslog-ng")
        assert detail.get("lines") == total, detail
        time.sleep(0.5)  # nothing more arrives: exactly once
    _check(server, job_id, total)
