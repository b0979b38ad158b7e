"""Every limit and every kind of bad input gets a clear 4xx JSON body, and the server stays healthy."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from api_server import REPO, Server, free_port

TOKEN = "s3cret-token-for-tests"
MAX_BODY = 256 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(
        tmp_path_factory.mktemp("limits"), token=TOKEN,
        server={"max_request_bytes": MAX_BODY, "rate_limit_lines_per_s": 500, "rate_limit_burst_lines": 3000},
        extra={"input": {"max_line_bytes": 1024}},
    ).start()
    yield srv
    srv.stop()


def _error(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and body["error"]["code"] == code, body
    assert body["error"]["message"] and "Traceback" not in r.text
    return body["error"]


def test_token_required_and_compared(server: Server) -> None:
    with httpx.Client(base_url=server.url) as anon:
        assert anon.get("/healthz").status_code == 200  # probes need no token
        assert anon.get("/readyz").status_code == 200
        r = anon.get("/v1/jobs")
        _error(r, 401, "unauthorized")
        assert r.headers["www-authenticate"].startswith("Bearer")
        _error(anon.post("/v1/jobs/j/logs", content=b"x\n"), 401, "unauthorized")
        _error(anon.get("/metrics"), 401, "unauthorized")
        _error(anon.get("/v1/jobs", headers={"authorization": "Bearer wrong"}), 401, "unauthorized")
        _error(anon.get("/v1/jobs", headers={"authorization": f"Basic {TOKEN}"}), 401, "unauthorized")
        _error(anon.get("/v1/jobs", headers={"authorization": f"Bearer {TOKEN}x"}), 401, "unauthorized")
    with server.client() as c:
        assert c.get("/v1/jobs").status_code == 200
        assert c.get("/metrics").status_code == 200


@pytest.mark.parametrize("job_id", ["-leading-dash", ".hidden", "a" * 129, "has space", "semi;colon", "dollar$"])
def test_bad_job_ids(server: Server, job_id: str) -> None:
    with server.client() as c:
        _error(c.post(f"/v1/jobs/{job_id}/logs", content=b"x\n"), 400, "invalid_job_id")
        _error(c.get(f"/v1/jobs/{job_id}"), 400, "invalid_job_id")


def test_path_tricks_do_not_reach_a_job(server: Server) -> None:
    with server.client() as c:
        for path in ("/v1/jobs/..%2F..%2Fetc%2Fpasswd/logs", "/v1/jobs/a%2F..%2Fb/logs", "/v1/jobs/%2e%2e/logs"):
            r = c.post(path, content=b"x\n")
            assert r.status_code in (400, 404), (path, r.status_code)
            assert "error" in r.json()
        assert not any(j["job_id"].startswith(".") for j in c.get("/v1/jobs").json()["jobs"])


def test_unknown_things_are_404(server: Server) -> None:
    with server.client() as c:
        _error(c.get("/v1/jobs/never-seen"), 404, "job_not_found")
        _error(c.get("/v1/jobs/never-seen/templates"), 404, "job_not_found")
        _error(c.post("/v1/jobs/never-seen/end"), 404, "job_not_found")
        _error(c.get("/v1/reports/nope"), 404, "report_not_found")
        _error(c.post("/v1/reports/nope/feedback", json={"category": "script", "failure_type": "key_error"}),
               404, "report_not_found")
        _error(c.get("/v1/incidents/nope"), 404, "incident_not_found")
        _error(c.get("/v1/nothing-here"), 404, "not_found")
        _error(c.put("/v1/jobs/j/logs", content=b"x"), 405, "method_not_allowed")


def test_malformed_and_binary_bodies(server: Server) -> None:
    with server.client() as c:
        _error(c.post("/v1/jobs/bad-json/logs", content=b'[{"log": "a"}, {"log": nope}]',
                      headers={"content-type": "application/json"}), 400, "malformed_json")
        err = _error(c.post("/v1/jobs/bad-json/logs", content=b'{"log": "a"}\n{"log": "b"}\n{"log": \n',
                            headers={"content-type": "application/x-ndjson"}), 400, "malformed_json")
        assert err["accepted_lines"] == 0  # a failed request applies nothing (its retry counts once), and says so
        _error(c.post("/v1/jobs/bad-json/logs", content=b'[{"log": "a"}', headers={"content-type": "application/json"}),
               400, "malformed_json")
        _error(c.post("/v1/jobs/bad-json/logs", content=b'["just a string"]',
                      headers={"content-type": "application/json"}), 400, "malformed_json")
        garbage = os.urandom(4096)
        _error(c.post("/v1/jobs/garbage/logs", content=garbage), 400, "binary_content")
        _error(c.post("/v1/jobs/garbage/logs", content=garbage, headers={"content-encoding": "gzip"}),
               400, "bad_encoding")
        _error(c.post("/v1/jobs/garbage/logs", content=gzip.compress(b"line\n" * 1000)[:-12],
                      headers={"content-encoding": "gzip"}), 400, "bad_encoding")
        _error(c.post("/v1/jobs/j/logs", content=b"x", headers={"content-type": "application/xml"}),
               415, "unsupported_media_type")
        _error(c.post("/v1/jobs/j/logs", content=b"x", headers={"content-encoding": "br"}), 415, "unsupported_encoding")
        _error(c.post("/v1/jobs/j/logs", content=b"x\n", headers={"x-logdx-rank": "-3"}), 400, "bad_header")
        _error(c.post("/v1/jobs/j/logs", content=b"x\n", headers={"idempotency-key": "k" * 300}), 400, "bad_header")
        _error(c.post("/v1/jobs/j/logs", content=b"x\n", params={"format": "xml"}), 422, "invalid_request")
        assert c.post("/v1/jobs/end-bad/logs", content=b"hello\n").status_code == 200
        _error(c.post("/v1/jobs/end-bad/end", content=b"{oops", headers={"content-type": "application/json"}),
               400, "malformed_json")
        _error(c.post("/v1/jobs/end-bad/end", json={"exit_code": "one"}), 422, "invalid_request")
        _error(c.post("/v1/jobs/end-bad/end", json={"exit_code": 1, "surprise": True}), 422, "invalid_request")
        _error(c.post("/v1/diagnose", content=garbage), 400, "binary_content")


def test_size_limits(server: Server) -> None:
    with server.client() as c:
        # Declared too large: refused before reading.
        _error(c.post("/v1/jobs/big/logs", content=b"x" * (MAX_BODY + 1)), 413, "request_too_large")

        # Streamed (chunked, no length): refused once the limit is crossed; nothing of it is applied.
        def body() -> Iterator[bytes]:
            for _ in range(MAX_BODY // 4096 + 32):
                yield b"a line of a log that goes on and on and on\n" * 93  # ~4 KiB

        err = _error(c.post("/v1/jobs/big-stream/logs", content=body()), 413, "request_too_large")
        assert err["accepted_lines"] == 0
        assert c.get("/v1/jobs/big-stream").status_code == 404  # the job it created is dropped again

        # A gzip bomb: tiny on the wire, refused by its decoded size.
        bomb = gzip.compress(b"\n" * (MAX_BODY * 4))
        assert len(bomb) < MAX_BODY // 20
        _error(c.post("/v1/jobs/bomb/logs", content=bomb, headers={"content-encoding": "gzip"}), 413,
               "request_too_large")
        _error(c.post("/v1/diagnose", content=b"y" * (MAX_BODY + 1)), 413, "request_too_large")

        # Long lines are not refused: cut at input.max_line_bytes, marked, counted.
        r = c.post("/v1/jobs/long-lines/logs", content=b"short\n" + b"z" * 5000 + b"\nshort again\n")
        assert r.status_code == 200 and r.json()["truncated_lines"] == 1 and r.json()["accepted_lines"] == 3
        r = c.post("/v1/jobs/long-lines/logs", content=json.dumps([{"log": "q" * 3000}]).encode(),
                   headers={"content-type": "application/json"})
        assert r.status_code == 200 and r.json()["truncated_lines"] == 1


def test_rate_limit_per_job(server: Server) -> None:
    with server.client() as c:
        lines = b"iteration 1 | lm loss: 2.0\n" * 4000  # more than the burst (3000)
        assert c.post("/v1/jobs/noisy/logs", content=lines).status_code == 200
        r = c.post("/v1/jobs/noisy/logs", content=b"one more\n")
        err = _error(r, 429, "rate_limited")
        assert int(r.headers["retry-after"]) >= 1 and err["retry_after_s"] > 0
        assert c.post("/v1/jobs/quiet/logs", content=b"another job is not limited\n").status_code == 200


def test_still_healthy_after_all_that(server: Server) -> None:
    with server.client() as c:
        assert c.get("/healthz").json() == {"status": "ok"}
        assert c.get("/readyz").status_code == 200
        r = c.post("/v1/jobs/after/logs", content=b"[rank0]: all good\n")
        assert r.status_code == 200 and r.json()["accepted_lines"] == 1
        metrics = c.get("/metrics").text
        assert 'logdx_ingest_rejected_total{reason="request_too_large"}' in metrics
        assert 'logdx_ingest_rejected_total{reason="rate_limited"}' in metrics
    assert server.proc is not None and server.proc.poll() is None
    assert "Traceback" not in server.log()


def test_refuses_public_address_without_token(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOGDX_")}
    env["LOGDX_STORE__PATH"] = str(tmp_path / "x.db")
    r = subprocess.run([sys.executable, "-m", "logdx.api", "--host", "0.0.0.0", "--port", str(free_port())],
                       env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "without a token" in r.stderr
