"""The README's live recipe, for real: `job | curl -T - .../v1/jobs/ID/logs` (a chunked body with no length) into
a real uvicorn. What arrived is applied while the stream is still open, so a failure is diagnosed before the job's
output ends; the answer counts every line once; a stream cut off keeps what was applied; an upload with a length or
an Idempotency-Key is still applied whole or not at all."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api_server import LoopbackApp
from logdx.config import Settings

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("curl") is None, reason="the live recipe's client is curl")]

HEADERS = {"x-requested-with": "logdx-tests"}


def _settings(tmp: Path, live_commit_s: float) -> Settings:
    return Settings.model_validate({
        "data_dir": str(tmp), "llm": {"enabled": False}, "retrieval": {"enabled": False},
        "server": {"early_diagnosis_delay_s": 0.2, "local_operator": True, "live_commit_s": live_commit_s}})


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackApp]:
    with LoopbackApp(_settings(tmp_path_factory.mktemp("live"), 0.3)) as served:
        yield served


def _training(host: str, ranks: range, steps: range) -> list[str]:
    return [f"[rank{r}]:2026-12-03 04:{s // 60 % 60:02d}:{s % 60:02d},000 INFO {host} step {s} loss {2.5 - s / 1e4:.4f}"
            for s in steps for r in ranks]


XID = ("[rank5]:2026-12-03 04:10:00,000 ERROR node-02 kernel: NVRM: Xid (PCI:0000:41:00): 79, pid=2231, "
       "GPU has fallen off the bus.")


class Curl:
    """`curl -sS -X POST -T - URL` (the README's recipe): stdin is the job's output, as a pipe."""

    def __init__(self, url: str) -> None:
        self.proc = subprocess.Popen(
            ["curl", "-sS", "-X", "POST", "-T", "-", "-H", "content-type: text/plain", "-H", "x-requested-with: logdx-tests",
             "-H", "x-logdx-host: node-02", url], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE)

    def send(self, lines: list[str]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("".join(line + "\n" for line in lines).encode())
        self.proc.stdin.flush()

    def close(self) -> dict[str, Any]:
        out, err = self.proc.communicate(timeout=60)
        assert self.proc.returncode == 0, err
        return json.loads(out)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.communicate(timeout=30)


def _wait(c: httpx.Client, job: str, ok: Any, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        r = c.get(f"/v1/jobs/{job}")
        if r.status_code == 200:
            last = r.json()
            if ok(last):
                return last
        time.sleep(0.1)
    raise AssertionError(f"job {job} never got there: {json.dumps(last)[:1500]}")


def test_a_live_stream_is_diagnosed_while_it_is_still_open(app: LoopbackApp) -> None:
    curl = Curl(f"{app.url}/v1/jobs/live-1/logs")
    before = _training("node-02", range(8), range(1, 200))
    curl.send(before)
    with httpx.Client(base_url=app.url, headers=HEADERS, timeout=30) as c:
        job = _wait(c, "live-1", lambda j: j["lines"] >= len(before))  # applied, the body not ended
        assert job["state"] == "open"
        curl.send([XID])
        job = _wait(c, "live-1", lambda j: (j.get("report") or {}).get("failure_type") == "gpu_fell_off_bus")
        assert job["state"] == "open"  # diagnosed while curl still streams
        after = [f"[rank{r}]:2026-12-03 04:10:{s:02d},000 ERROR node-02 Watchdog caught collective operation "
                 f"timeout: WorkNCCL(SeqNum=4411, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000)"
                 for s in range(5, 10) for r in range(8) if r != 5]
        curl.send(after)
        answer = curl.close()
        assert answer["accepted_lines"] == len(before) + 1 + len(after), answer  # every line once
        job = _wait(c, "live-1", lambda j: j["lines"] == len(before) + 1 + len(after))


def test_a_live_stream_cut_off_keeps_what_was_applied(app: LoopbackApp) -> None:
    curl = Curl(f"{app.url}/v1/jobs/live-2/logs")
    lines = _training("node-02", range(4), range(1, 100))
    curl.send(lines)
    with httpx.Client(base_url=app.url, headers=HEADERS, timeout=30) as c:
        _wait(c, "live-2", lambda j: j["lines"] == len(lines))
        curl.send(["a line still in flight when the stream is cut"])
        curl.kill()
        time.sleep(1.0)
        job = _wait(c, "live-2", lambda j: True)
        assert job["lines"] >= len(lines), job  # applied before the cut: kept


def test_an_upload_with_a_length_or_a_key_is_applied_whole_or_not_at_all(app: LoopbackApp) -> None:
    body = "".join(line + "\n" for line in _training("node-02", range(4), range(1, 50))).encode()
    halves = [body[: len(body) // 2], body[len(body) // 2:]]

    def slow() -> Iterator[bytes]:
        yield halves[0]
        time.sleep(1.0)  # past live_commit_s: a keyed upload still waits for its end
        yield halves[1]

    with httpx.Client(base_url=app.url, headers=HEADERS, timeout=30) as c:
        r = c.post("/v1/jobs/keyed-1/logs", content=slow(), headers={"idempotency-key": "k-1"})
        assert r.status_code == 200 and r.json()["accepted_lines"] == body.count(b"\n"), r.text
        again = c.post("/v1/jobs/keyed-1/logs", content=iter(halves), headers={"idempotency-key": "k-1"})
        assert again.json()["duplicate"] is True and c.get("/v1/jobs/keyed-1").json()["lines"] == body.count(b"\n")


def test_live_commit_0_applies_a_stream_when_it_ends(tmp_path: Path) -> None:
    with LoopbackApp(_settings(tmp_path, 0.0)) as served, httpx.Client(base_url=served.url, headers=HEADERS) as c:
        curl = Curl(f"{served.url}/v1/jobs/whole-1/logs")
        lines = _training("node-02", range(4), range(1, 60))
        curl.send(lines)
        time.sleep(1.0)
        assert c.get("/v1/jobs/whole-1").status_code == 404 or c.get("/v1/jobs/whole-1").json()["lines"] == 0
        assert curl.close()["accepted_lines"] == len(lines)
