"""Kill the server (SIGKILL) while 16 ranks stream into a job, restart it, and check that
every 2xx'd line is there exactly once and that the early alert is not sent again."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from api_server import WEBHOOK_SECRET, Server, make_job, root_line_of, start_receiver
from logdx.act.alerts import verify
from logdx.testing import wait_until

JOB = "durable-job-1"


@dataclass
class Shipper:
    """One rank's log shipper: small requests, each with an Idempotency-Key; on a failure it waits
    for the server to come back and sends the same request again (what Fluent Bit does)."""

    rank: int
    requests: list[tuple[str, bytes, int]]  # (key, body, lines)
    pause_s: float
    acked: int = 0  # lines of requests that got a 2xx
    duplicates: int = 0  # lines of retried requests the server had already committed
    failures: int = 0
    done: bool = False
    waiting: bool = False
    error: str | None = None
    thread: threading.Thread | None = field(default=None, repr=False)

    def run(self, url_of: callable, up: threading.Event) -> None:  # type: ignore[valid-type]
        client = httpx.Client(timeout=10)
        try:
            i = 0
            while i < len(self.requests):
                key, body, n = self.requests[i]
                try:
                    r = client.post(f"{url_of()}/v1/jobs/{JOB}/logs",
                                    content=iter([body[: len(body) // 2], body[len(body) // 2:]]),  # chunked
                                    headers={"idempotency-key": key})
                except httpx.HTTPError:
                    r = None
                if r is None or r.status_code >= 500:
                    self.failures += 1
                    self.waiting = True
                    up.wait(60)
                    self.waiting = False
                    continue
                if r.status_code != 200:
                    self.error = f"{r.status_code} {r.text}"
                    return
                self.acked += n
                if r.json()["duplicate"]:
                    self.duplicates += n
                i += 1
                time.sleep(self.pause_s)
        finally:
            client.close()
            self.done = True


def _requests(rank: int, lines: list[str], per_request: int) -> list[tuple[str, bytes, int]]:
    out = []
    for i in range(0, len(lines), per_request):
        part = lines[i:i + per_request]
        out.append((f"rank{rank}-req{i // per_request}", ("\n".join(part) + "\n").encode(), len(part)))
    return out


def test_sigkill_mid_stream_loses_no_acked_line_and_sends_no_alert_twice(tmp_path: Path) -> None:
    receiver = start_receiver()
    job = make_job(ranks=16, steps=150, culprit=5)
    total = sum(len(v) for v in job.values())
    srv = Server(tmp_path / "srv", receiver=receiver).start()
    up = threading.Event()
    up.set()
    # The culprit's shipper sends fast (its root line arrives early); the others trickle.
    shippers = [Shipper(r, _requests(r, job[r], 8), pause_s=0.0 if r == 5 else 0.08) for r in range(16)]
    try:
        for s in shippers:
            s.thread = threading.Thread(target=s.run, args=(lambda: srv.url, up), daemon=True)
            s.thread.start()

        # The early diagnosis is delivered while the other ranks are still streaming.
        hook = receiver.wait_for("/hook", 1)
        slack = receiver.wait_for("/slack", 1)
        assert verify(WEBHOOK_SECRET, hook[0].headers, hook[0].body)
        assert hook[0].json()["data"]["report"]["failure_type"] == "gpu_fell_off_bus"
        # The kill comes once the outbox has recorded both deliveries (else a resend would be right).
        with srv.client() as c:
            wait_until(lambda: {(a["kind"], a["status"]) for a in c.get(f"/v1/jobs/{JOB}").json()["alerts"]}
                       == {("slack", "delivered"), ("webhook", "delivered")}, "both alerts recorded as delivered")
        assert not all(s.done for s in shippers), "streams finished before the kill: make them longer"

        up.clear()
        srv.kill()
        deadline = time.monotonic() + 120
        while not all(s.done or s.waiting for s in shippers) and time.monotonic() < deadline:
            time.sleep(0.01)
        acked_at_kill = sum(s.acked for s in shippers)
        assert 0 < acked_at_kill < total

        srv.start()  # same port, same database, same spools
        with srv.client() as c:
            after_restart = c.get(f"/v1/jobs/{JOB}").json()
            metrics = c.get("/metrics").text
        assert after_restart["state"] == "open"
        replayed = after_restart["lines"]
        assert replayed >= acked_at_kill, (replayed, acked_at_kill)

        up.set()  # shippers resend what was not acknowledged, with the same Idempotency-Keys
        for s in shippers:
            assert s.thread is not None
            s.thread.join(60)
        assert all(s.error is None for s in shippers), [s.error for s in shippers if s.error]
        assert sum(s.acked for s in shippers) == total
        assert any(s.failures for s in shippers)
        # Requests committed just before the kill whose answer was lost came back as duplicates:
        # those, and only those, are the lines the restarted server had beyond what was acked.
        assert replayed == acked_at_kill + sum(s.duplicates for s in shippers)

        with srv.client() as c:
            report = c.post(f"/v1/jobs/{JOB}/end", json={"exit_code": 1}).json()
            detail = c.get(f"/v1/jobs/{JOB}").json()
        assert report["failure_type"] == "gpu_fell_off_bus" and report["culprits"]["hosts"] == ["gpu-node-00"]
        assert report["root_cause"]["text"] == root_line_of(job, 5)
        assert report["compression"]["lines_in"] == total
        assert detail["lines"] == total
        replay_metric = next(line for line in metrics.splitlines()
                             if line.startswith("logdx_spool_replayed_lines_total"))
        assert float(replay_metric.split()[-1]) == replayed  # rebuilt from the spool, not from thin air

        time.sleep(1.5)  # give a (wrong) second alert every chance to arrive
        assert len(receiver.of("/hook")) == 1, [r.json() for r in receiver.of("/hook")]
        assert len(receiver.of("/slack")) == 1
        assert slack[0].json()["text"]
    finally:
        up.set()
        srv.stop()
        receiver.close()


def _site_rules(folder: Path, n: int = 3000) -> Path:
    """A site's own rule pack of `n` rules: a real reason for an engine to take a few seconds to load
    (the window in which uploads arrive before it is ready)."""
    import yaml

    folder.mkdir(parents=True, exist_ok=True)
    rules = [{"id": f"site-fs-{i}", "title": f"site filesystem {i} lost quorum", "role": "root_cause",
              "category": "infrastructure", "failure_type": "storage_error", "severity": "low", "confidence": 0.5,
              "match": {"patterns": [f"sitefs-{i:05d} backend (?:lost|dropped) quorum"]},
              "examples": [f"sitefs-{i:05d} backend lost quorum"]} for i in range(n)]
    (folder / "site.yaml").write_text(yaml.safe_dump({"pack": "site", "description": "site storage", "rules": rules}))
    return folder


def _ready(url: str) -> bool | None:
    """Whether the server's engine is loaded (None: the server does not answer)."""
    try:
        return httpx.get(url + "/readyz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return None


def test_retries_during_start_up_count_once_across_sigkills(tmp_path: Path) -> None:
    """Issue 20 point 2: a retry with the same Idempotency-Key that reaches a restarted server while it
    is still loading is answered as the first request was (the ledger of committed requests is read
    from the spool, whatever the engine's state), and a replay applies each key once. Two SIGKILLs
    while 16 shippers stream; every acknowledged line counts once."""
    job = make_job(ranks=16, steps=120, culprit=5)
    total = sum(len(v) for v in job.values())
    srv = Server(tmp_path / "srv", extra={"rules": {"dirs": [str(_site_rules(tmp_path / "rules"))]}}).start()
    up = threading.Event()
    up.set()
    shippers = [Shipper(r, _requests(r, job[r], 6), pause_s=0.03) for r in range(16)]
    answered_loading = 0
    try:
        for s in shippers:
            s.thread = threading.Thread(target=s.run, args=(lambda: srv.url, up), daemon=True)
            s.thread.start()
        for kill in range(2):
            deadline = time.monotonic() + 60
            while sum(s.acked for s in shippers) < total * (kill + 1) // 4:
                assert time.monotonic() < deadline, "the shippers made no progress"
                time.sleep(0.01)
            srv.kill()
            # The server comes back where nothing is cached (a new pod on another node): it compiles its 3,000
            # site rules again, and takes uploads before its engine is loaded; the shippers retry at once.
            (srv.workdir / "cache" / "rules.pickle").unlink(missing_ok=True)
            srv.start(ready=False)
            # an answer lost in the crash: the same request sent again while the engine loads
            key, body, n = shippers[0].requests[0]
            while _ready(srv.url) is False:
                r = httpx.post(f"{srv.url}/v1/jobs/{JOB}/logs", content=body, headers={"idempotency-key": key},
                               timeout=30)
                assert r.status_code == 200, r.text
                assert r.json()["duplicate"] is True and r.json()["accepted_lines"] == n, r.text
                if _ready(srv.url) is False:
                    answered_loading += 1
        for s in shippers:
            assert s.thread is not None
            s.thread.join(120)
        assert all(s.error is None for s in shippers), [s.error for s in shippers if s.error]
        assert sum(s.acked for s in shippers) == total
        assert answered_loading > 0, "no retry reached the server while it was loading: nothing was tested"
        with srv.client() as c:
            detail = c.get(f"/v1/jobs/{JOB}").json()
            report = c.post(f"/v1/jobs/{JOB}/end", json={"exit_code": 1}).json()
        assert detail["lines"] == total, (detail["lines"], total)
        assert report["compression"]["lines_in"] == total
    finally:
        up.set()
        srv.stop()
