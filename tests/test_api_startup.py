"""A server whose models are still loading: it says in its log what it loads, /readyz says what it
waits for, reads answer, and uploads are accepted and said to be queued, then applied once ready.

The LLM stays "loading" for as long as the test holds the conversion lock of an empty model cache
(what a second process converting at the same time does); it then finds the converted model there
(links to the one `make install` made) and loads it."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import httpx
import pytest

from api_server import Server
from logdx.diagnose.llm import ensure_converted
from logdx.testing import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = Path(os.environ["LOGDX_LLM__CACHE_DIR"]) / "gemma3-270m"
ROOT_LINE = ("[rank3]: node-07: [Tue Jun  4 10:00:00 2024] NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, "
             "name=python, GPU has fallen off the bus.")


def test_while_models_load_reads_answer_uploads_queue_and_readyz_says_why(tmp_path: Path) -> None:
    ensure_converted(MODEL)  # make install did (a no-op then)
    cache = tmp_path / "models"
    cache.mkdir()
    # The LLM as the arbiter (the default, the classifier, loads no LLM).
    srv = Server(tmp_path / "srv", extra={"llm": {"enabled": True, "cache_dir": str(cache)}, "arbiter": {"stage": "llm"}})
    with open(cache / "gemma3-270m.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as if another process were converting the model right now
        srv.start(ready=False, log_level="info")
        try:
            with srv.client() as c:
                pending = wait_until(lambda: (r := c.get("/readyz")).status_code == 503
                                     and r.json()["error"].get("waiting_for", {}).get("llm", "").startswith(
                                         f"loading the LLM from {cache / 'gemma3-270m'}") and r.json()["error"],
                                     "/readyz waiting for the LLM")
                assert pending["code"] == "not_ready" and list(pending["waiting_for"]) == ["llm"]
                assert pending["message"].startswith("waiting for llm: loading the LLM")
                assert pending["checks"]["rules"]["ready"] is True
                assert pending["checks"]["rules"]["reason"].endswith(" rules")

                body = "".join(f"[rank{r}]: iteration 10 | lm loss: 2.5\n" for r in range(8)) + ROOT_LINE + "\n"
                up = c.post("/v1/jobs/early/logs", content=body)
                assert up.status_code == 200, up.text
                assert up.json()["accepted_lines"] == 9
                assert up.json()["queued_lines"] == 9 and up.json()["job_lines"] == 9

                job = c.get("/v1/jobs/early")
                assert job.status_code == 200, job.text
                assert job.json()["state"] == "open" and job.json()["lines"] == 9
                assert job.json()["queued_lines"] == 9 and job.json()["compression"] is None
                assert c.get("/v1/jobs/early/templates").json()["queued_lines"] == 9
                assert [j["job_id"] for j in c.get("/v1/jobs").json()["jobs"]] == ["early"]

                ended = c.post("/v1/jobs/early/end", json={"exit_code": 1})  # a diagnosis needs the models
                assert ended.status_code == 503 and ended.headers["retry-after"] == "5"
                assert "llm" in ended.json()["error"]["waiting_for"]

                for f in MODEL.iterdir():  # "the other process" finishes its conversion
                    (cache / "gemma3-270m").mkdir(exist_ok=True)
                    (cache / "gemma3-270m" / f.name).symlink_to(f)
                fcntl.flock(lock, fcntl.LOCK_UN)

                ready = wait_until(lambda: (r := c.get("/readyz")).status_code == 200 and r.json(), "ready")
                assert {name: check["ready"] for name, check in ready["checks"].items()} == {
                    "rules": True, "llm": True, "store": True, "bus": True}
                applied = wait_until(lambda: (j := c.get("/v1/jobs/early").json())["compression"] and j,
                                     "the queued lines applied")
                assert applied["lines"] == 9 and applied["queued_lines"] == 0
                assert applied["compression"]["lines_in"] == 9 and applied["root_cause_seen"] is True
                report = c.post("/v1/jobs/early/end", json={"exit_code": 1}).json()
                assert report["failure_type"] == "gpu_fell_off_bus" and report["culprits"]["hosts"] == ["node-07"]
        finally:
            srv.stop()
    log = srv.log_path.read_text()
    for said in ("rules: loading the rule packs", "rules: ready (", f"llm: loading the LLM from {cache}",
                 "llm: ready (numpy runtime", "engine ready in "):
        assert said in log, said


def test_a_model_that_cannot_load_is_the_reason_readyz_gives(tmp_path: Path) -> None:
    srv = Server(tmp_path / "srv", extra={"llm": {"enabled": True, "cache_dir": str(tmp_path / "none"),
                                                  "allow_convert": False}, "arbiter": {"stage": "llm"}})
    srv.start(ready=False)
    try:
        failed = wait_until(lambda: (r := httpx.get(srv.url + "/readyz")).status_code == 503
                            and r.json()["error"]["waiting_for"].get("llm", "").startswith("failed") and r.json(),
                            "/readyz to report the failure")
        assert failed["error"]["message"].startswith("the engine failed to start: ")
        assert "no converted model in" in failed["error"]["waiting_for"]["llm"]
    finally:
        srv.stop()
