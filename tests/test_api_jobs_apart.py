"""Jobs are apart (issue 20 point 3): job ids are free to name, so their creation is bounded per
request, per client and overall, and so are open jobs; a refused request leaves no job behind."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from api_server import Server

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("apart"), server={
        "max_new_jobs_per_request": 5, "max_new_jobs_per_client": 8, "max_open_jobs": 1000}).start()
    yield srv
    srv.stop()


def _records(jobs: list[str]) -> bytes:
    return "".join(json.dumps({"log": f"line of {j}", "job_id": j}) + "\n" for j in jobs).encode()


def _spools(server: Server) -> set[str]:
    return {p.stem for p in (server.workdir / "spool").glob("*.spool")}


def test_twenty_thousand_job_ids_in_one_request_are_refused_and_leave_nothing(server: Server) -> None:
    body = _records([f"flood-{i}" for i in range(20_000)])
    assert len(body) > 1_000_000
    with server.client() as c:
        r = c.post("/v1/logs", content=body, headers={"content-type": "application/x-ndjson"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_jobs", r.text
        assert "max_new_jobs_per_request" in r.json()["error"]["message"]
        listed = c.get("/v1/jobs", params={"limit": 1000}).json()["jobs"]
    assert not [j for j in listed if j["job_id"].startswith("flood-")], listed[:3]
    assert not {s for s in _spools(server) if s.startswith("flood-")}
    # within the cap, one request may still feed several new jobs
    with server.client() as c:
        r = c.post("/v1/logs", content=_records(["few-1", "few-2", "few-1"]), headers={"content-type": "application/x-ndjson"})
        assert r.status_code == 200 and r.json()["jobs"] == {"few-1": 2, "few-2": 1}, r.text


def test_a_client_creating_jobs_without_end_is_refused_with_retry_after(server: Server) -> None:
    with server.client() as c:
        created = 2  # few-1 and few-2 above, from the same client
        codes = []
        for i in range(10):
            r = c.post(f"/v1/jobs/mine-{i}/logs", content=b"a line\n", headers={"x-logdx-host": "node-1"})
            codes.append(r.status_code)
            if r.status_code == 429:
                assert r.json()["error"]["code"] == "job_quota" and int(r.headers["retry-after"]) >= 1, r.text
        assert codes.count(200) == 8 - created and codes.count(429) == 10 - (8 - created), codes
        # jobs it already has still take lines
        assert c.post("/v1/jobs/mine-0/logs", content=b"more\n", headers={"x-logdx-host": "node-1"}).status_code == 200


def test_open_jobs_are_capped(tmp_path: Path) -> None:
    srv = Server(tmp_path / "open", server={"max_open_jobs": 3}).start()
    try:
        with srv.client() as c:
            for i in range(3):
                assert c.post(f"/v1/jobs/open-{i}/logs", content=b"x\n", headers={"x-a": "1"}).status_code == 200
            r = c.post("/v1/jobs/open-3/logs", content=b"x\n", headers={"x-a": "1"})
            assert r.status_code == 429 and r.json()["error"]["code"] == "open_jobs_limit", r.text
            assert c.post("/v1/jobs/open-0/end", json={"exit_code": 0}).status_code == 200
            deadline = time.monotonic() + 60  # the open count is cached for a second: re-read, it fits
            while (r := c.post("/v1/jobs/open-3/logs", content=b"x\n", headers={"x-a": "1"})).status_code != 200:
                assert r.status_code == 429 and time.monotonic() < deadline, r.text
                time.sleep(0.05)
    finally:
        srv.stop()
