"""Alerts: Slack Block Kit and Standard Webhooks signed JSON, from a persisted outbox, once per
diagnosis, with retries. Delivered over real HTTP to a receiver on 127.0.0.1."""

from __future__ import annotations

import base64
import json
import os
import threading
import time

import pytest
from pydantic import ValidationError
from standardwebhooks import Webhook

from logdx.act.alerts import Alert, sign, slack_payload, verify
from logdx.act.alerts.outbox import Outbox, OutboxWorker
from logdx.act.report import CompressionFigures, Culprits, Report, RootCause
from logdx.config import AlertsSettings, ConfigError, load_settings
from logdx.store import open_db
from logdx.testing import Clock

SECRET = "whsec_" + base64.b64encode(b"0123456789abcdef01234567").decode()


def make_report(line_no: int = 18233, root: str = "[rank42]: NVRM: Xid (PCI:0000:8a:00): 48, <DBE> & more",
                **kw) -> Report:
    base = dict(
        status="failed", category="infrastructure", failure_type="ecc_error", action="cordon_and_restart",
        confidence=0.97, culprits=Culprits(hosts=["node-17"], ranks=[42], gpus=["0000:8a:00.0"]),
        root_cause=RootCause(line_no=line_no, text=root, rank=42, host="node-17"),
        evidence=[], explanation="Double-bit ECC error on GPU 0000:8a:00.0 of node-17 (rank 42).",
        hint="Drain node-17, reset the GPU, restart from the last checkpoint.",
        compression=CompressionFigures(lines_in=100, templates=10, lines_kept=5), timings_ms={},
    )
    base.update(kw)
    return Report(**base)


@pytest.fixture
def db(backend_db):
    """Every test here runs on SQLite and on PostgreSQL."""
    return backend_db


@pytest.fixture
def rx(receiver):
    with receiver.Receiver() as r:
        yield r


def settings(rx, **kw) -> AlertsSettings:
    base = {"webhooks": [{"url": rx.url + "/hook?token=abc", "secret": SECRET}], "backoff_initial_s": 2.0,
            "backoff_max_s": 60.0, "max_attempts": 4, "timeout_s": 5.0, "node_dedup_s": 0}
    base.update(kw)
    return AlertsSettings(**base)


# -- signatures -------------------------------------------------------------------------------------


def test_sign_matches_the_standard_webhooks_test_vector():
    # The specification's reference libraries' vector.
    sig = sign("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330,
               b'{"test": 2432232314}')
    assert sig == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def test_verify_accepts_valid_and_rejects_tampered_stale_or_foreign():
    body = b'{"a":1}'
    now = int(time.time())
    headers = {"Webhook-Id": "msg_1", "Webhook-Timestamp": str(now),
               "Webhook-Signature": sign(SECRET, "msg_1", now, body)}
    assert verify(SECRET, headers, body)
    assert not verify(SECRET, headers, b'{"a":2}')
    other = "whsec_" + base64.b64encode(b"another secret, 24 bytes").decode()
    assert not verify(other, headers, body)
    old = now - 301
    stale = {**headers, "Webhook-Timestamp": str(old), "Webhook-Signature": sign(SECRET, "msg_1", old, body)}
    assert not verify(SECRET, stale, body)
    assert verify(SECRET, stale, body, tolerance_s=600)
    assert not verify(SECRET, {k: v for k, v in headers.items() if k != "Webhook-Id"}, body)
    # Key rotation: several signatures, one of them valid.
    rotated = {**headers, "Webhook-Signature": "v1,AAAA v1a,BBBB " + headers["Webhook-Signature"]}
    assert verify(SECRET, rotated, body)


@pytest.mark.parametrize("secret, says", [
    ("my-shared-secret", "starts with whsec_"),
    ("whsec_not base64!", "not base64"),
    ("whsec_" + base64.b64encode(b"short key").decode(), "at least 24"),
    (base64.b64encode(b"0123456789abcdef01234567").decode(), "starts with whsec_"),  # the prefix forgotten
])
def test_a_secret_official_verifiers_would_misread_is_refused_at_load(tmp_path, secret, says):
    """The standardwebhooks library itself accepts these (it drops what is not base64), then signs
    with a key no receiver shares: every delivery rejected. logdx refuses them when it loads."""
    path = tmp_path / "logdx.yaml"
    path.write_text(f'alerts:\n  webhooks: [{{url: "https://hooks.example.com/x", secret: "{secret}"}}]\n')
    with pytest.raises(ConfigError) as e:
        load_settings(path)
    assert "alerts.webhooks.0.secret" in str(e.value) and says in str(e.value)
    for ok in (SECRET, SECRET.rstrip("="), "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", ""):
        path.write_text(f'alerts:\n  webhooks: [{{url: "https://hooks.example.com/x", secret: "{ok}"}}]\n')
        assert load_settings(path).alerts.webhooks[0].secret == ok


# -- delivery ---------------------------------------------------------------------------------------


def test_webhook_is_delivered_signed_with_the_report(rx, db):
    out = Outbox(db, settings(rx), public_url="https://logdx.example.com/")
    report = make_report()
    assert out.enqueue("job-1", report) is True
    assert out.deliver_due() == 1
    (req,) = rx.wait_for(1)
    assert req.method == "POST" and req.path == "/hook?token=abc"
    assert req.headers["content-type"] == "application/json"
    assert req.headers["webhook-id"].startswith("msg_")
    assert verify(SECRET, req.headers, req.body)
    # The specification's own verifier (what a receiver written from its docs runs) accepts it.
    assert Webhook(SECRET).verify(req.body, req.headers)["data"]["job_id"] == "job-1"
    payload = req.json()
    assert payload["type"] == "logdx.diagnosis"
    assert payload["data"]["job_id"] == "job-1"
    assert payload["data"]["report"]["id"] == report.id
    assert payload["data"]["report"]["failure_type"] == "ecc_error"
    assert payload["data"]["report_url"] == f"https://logdx.example.com/v1/reports/{report.id}"
    [row] = out.history("job-1")
    assert row["status"] == "delivered" and row["attempts"] == 1 and row["last_status"] == 200
    assert out.pending() == []
    assert out.counters[("webhook", "ok")] == 1


def test_slack_message_says_what_failed_where_what_is_recommended_and_what_was_done():
    report = make_report()
    done = ("cordon node-17: refused (safety limit: 2 node(s) already cordoned in the last 3600 s)",)
    msg = slack_payload(Alert("job-1", report, done), "https://logdx.example.com/v1/reports/abc")
    text = json.dumps(msg)
    assert "job-1" in msg["text"] and "ecc_error" in msg["text"]
    header = msg["blocks"][0]
    assert header["type"] == "header" and "infrastructure / ecc_error" in header["text"]["text"]
    fields = {f["text"].split("\n")[0].strip("*"): f["text"].split("\n", 1)[1] for f in msg["blocks"][1]["fields"]}
    assert fields["Job"] == "`job-1`"
    assert fields["Category"] == "infrastructure"
    assert "ecc_error" in fields["Failure type"]
    assert "node-17" in fields["Culprit"] and "rank 42" in fields["Culprit"]
    assert "Cordon the node, then restart" in fields["Recommended"]
    assert fields["Confidence"] == "0.97"
    assert "*Done*\ncordon node-17: refused (safety limit" in text.replace("\\n", "\n")
    assert "refused" in msg["text"]
    assert "line 18233" in text
    # Slack's three escapes, in the root line too.
    assert "&lt;DBE&gt; &amp; more" in text and "<DBE>" not in text
    assert "Drain node-17" in text
    assert "<https://logdx.example.com/v1/reports/abc|" in text
    # No link without a public URL.
    assert "/v1/reports/" not in json.dumps(slack_payload(Alert("job-1", report), None))
    # A time limit is resubmitted, never called "do not restart".
    limit = make_report(failure_type="time_limit", action="restart", hint="Resubmit from the last checkpoint.")
    assert "Resubmit from the last checkpoint" in json.dumps(slack_payload(Alert("job-1", limit), None))


def test_slack_delivery_over_http(rx, db):
    s = AlertsSettings(slack=[{"webhook_url": rx.url + "/services/T000/B000/XXXX"}])
    out = Outbox(db, s, public_url="http://logdx:8077")
    report = make_report()
    assert out.enqueue("job-2", report)
    assert out.deliver_due() == 1
    (req,) = rx.wait_for(1)
    assert req.path == "/services/T000/B000/XXXX"
    body = req.json()
    assert body["blocks"][0]["type"] == "header"
    assert f"http://logdx:8077/v1/reports/{report.id}" in json.dumps(body)
    assert "webhook-signature" not in req.headers  # Slack is not signed


def test_credentials_are_not_stored_in_the_database(rx, tmp_path):
    path = tmp_path / "a.db"
    d = open_db(path)
    s = AlertsSettings(slack=[{"webhook_url": rx.url + "/services/T000/B000/SECRETPART"}],
                       webhooks=[{"url": rx.url + "/hook?token=QUERYSECRET", "secret": SECRET}])
    out = Outbox(d, s)
    assert out.enqueue("job-1", make_report())
    d.close()
    wal = tmp_path / "a.db-wal"
    raw = path.read_bytes() + (wal.read_bytes() if wal.exists() else b"")
    for secret in (b"SECRETPART", b"QUERYSECRET", SECRET.encode()):
        assert secret not in raw
    d = open_db(path)
    labels = [r["destination"] for r in Outbox(d, s).history()]
    d.close()
    assert labels == [f"slack[0] {rx.url}", f"webhook[0] {rx.url}/hook"]


# -- once per diagnosis -----------------------------------------------------------------------------


def test_one_alert_per_job_and_diagnosis_even_across_restarts(rx, tmp_path):
    path = tmp_path / "logdx.db"
    d = open_db(path)
    out = Outbox(d, settings(rx))
    report = make_report()
    assert out.enqueue("job-1", report) is True
    assert out.enqueue("job-1", report.model_copy(update={"id": "another"})) is False  # same diagnosis
    assert out.deliver_due() == 1
    d.close()
    # A restarted server, same database: still a duplicate.
    d = open_db(path)
    out = Outbox(d, settings(rx))
    assert out.enqueue("job-1", report) is False
    assert out.deliver_due() == 0
    # The same diagnosis seen at another line (a replay after a crash shifts line numbers) is no new alert.
    assert out.enqueue("job-1", make_report(line_no=99)) is False
    # A changed diagnosis (another root line, another type) or another job is new.
    assert out.enqueue("job-1", make_report(root="[rank42]: NVRM: Xid (PCI:0000:8a:00): 48, again")) is True
    assert out.enqueue("job-1", make_report(failure_type="nvlink_error")) is True
    assert out.enqueue("job-2", report) is True
    assert out.deliver_due() == 3
    assert len(rx.wait_for(4)) == 4
    d.close()


def test_nothing_is_queued_for_healthy_or_unsure_reports_or_without_destinations(rx, db):
    out = Outbox(db, settings(rx, min_confidence=0.9))
    healthy = make_report(status="healthy", category=None, failure_type=None, action="none", root_cause=None)
    assert out.enqueue("job-1", healthy) is False
    unknown = healthy.model_copy(update={"status": "unknown", "confidence": 0.95})  # neither shown: nothing to page for
    assert out.enqueue("job-1", unknown) is False
    assert out.enqueue("job-1", make_report(confidence=0.5)) is False
    assert Outbox(db, AlertsSettings()).enqueue("job-1", make_report()) is False
    assert out.pending() == []


def test_a_job_somebody_cancelled_alerts_nobody_unless_asked(rx, db):
    cancelled = make_report(failure_type="cancelled", action="no_restart", confidence=0.2,
                            culprits=Culprits(), hint="The job was cancelled (scancel).")
    assert Outbox(db, settings(rx)).enqueue("job-1", cancelled) is False
    assert Outbox(db, settings(rx, quiet_types=[])).enqueue("job-2", cancelled) is True
    with pytest.raises(ValidationError, match="not failure types of the taxonomy: canceled"):
        settings(rx, quiet_types=["canceled"])


# -- retries ----------------------------------------------------------------------------------------


def test_retries_with_capped_exponential_backoff_then_delivers(rx, db):
    rx.statuses = [500, 503, 200]
    clock = Clock()
    out = Outbox(db, settings(rx, backoff_initial_s=2.0, backoff_max_s=3.0), clock=clock)
    assert out.enqueue("job-1", make_report())
    t0 = clock.t
    assert out.deliver_due() == 0
    [row] = out.pending()
    assert row["attempts"] == 1 and row["last_status"] == 500
    assert t0 + 1.0 <= row["next_at"] <= t0 + 2.0  # 2 s with jitter in [1, 2]
    assert out.deliver_due() == 0  # not due yet
    assert len(rx.requests) == 1
    clock.t = row["next_at"]
    assert out.deliver_due() == 0
    [row] = out.pending()
    assert row["attempts"] == 2 and "HTTP 503" in row["last_error"]
    assert clock.t + 1.5 <= row["next_at"] <= clock.t + 3.0  # 4 s capped at 3, jittered
    clock.t = row["next_at"]
    assert out.deliver_due() == 1
    reqs = rx.wait_for(3)
    # The same message each time (the receiver's idempotency key), signed afresh.
    assert len({r.headers["webhook-id"] for r in reqs}) == 1
    assert all(verify(SECRET, r.headers, r.body) for r in reqs)
    [row] = out.history()
    assert row["status"] == "delivered" and row["attempts"] == 3
    assert out.counters[("webhook", "retry")] == 2 and out.counters[("webhook", "ok")] == 1


def test_gives_up_after_max_attempts_and_records_the_failure(rx, db):
    rx.statuses = [500]
    clock = Clock()
    seen = []
    out = Outbox(db, settings(rx, max_attempts=3), clock=clock, on_delivery=lambda k, o: seen.append((k, o)))
    assert out.enqueue("job-1", make_report())
    for _ in range(10):
        out.deliver_due()
        clock.t += 1000
    assert len(rx.requests) == 3
    [row] = out.history("job-1")
    assert row["status"] == "failed" and row["attempts"] == 3 and "HTTP 500" in row["last_error"]
    assert row["done_at"] is not None
    assert seen == [("webhook", "retry"), ("webhook", "retry"), ("webhook", "failed")]


def test_gone_is_final_and_retry_after_is_honoured(rx, db):
    clock = Clock()
    rx.statuses = [429, 410]
    rx.extra_headers = {"Retry-After": "30"}
    out = Outbox(db, settings(rx, backoff_initial_s=1.0, backoff_max_s=60.0), clock=clock)
    assert out.enqueue("job-1", make_report())
    out.deliver_due()
    [row] = out.pending()
    assert row["next_at"] >= clock.t + 30
    clock.t = row["next_at"]
    out.deliver_due()
    [row] = out.history()
    assert row["status"] == "failed" and row["last_status"] == 410 and row["attempts"] == 2


def test_unreachable_destination_is_retried(db):
    clock = Clock()
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    out = Outbox(db, AlertsSettings(webhooks=[{"url": f"http://127.0.0.1:{port}/x"}], timeout_s=2.0), clock=clock)
    assert out.enqueue("job-1", make_report())
    assert out.deliver_due() == 0
    [row] = out.pending()
    assert row["attempts"] == 1 and "Connect" in row["last_error"]


def test_a_destination_removed_from_the_config_is_not_sent_to(rx, db):
    out = Outbox(db, settings(rx))
    assert out.enqueue("job-1", make_report())
    later = Outbox(db, AlertsSettings(webhooks=[{"url": rx.url + "/other"}]))
    assert later.deliver_due() == 0
    [row] = later.history()
    assert row["status"] == "failed" and "no longer configured" in row["last_error"]
    assert rx.requests == []


def test_two_workers_on_one_database_send_once(rx, tmp_path):
    path = tmp_path / "logdx.db"
    a, b = open_db(path), open_db(path)
    rx.handler = lambda req: (time.sleep(0.2), (200, {}, b"ok"))[1]  # slow: both workers see it due
    out_a = Outbox(a, settings(rx))
    out_b = Outbox(b, settings(rx))
    for i in range(5):
        assert out_a.enqueue(f"job-{i}", make_report())
    results = []
    threads = [threading.Thread(target=lambda o=o: results.append(o.deliver_due())) for o in (out_a, out_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(results) == 5
    assert len(rx.requests) == 5
    assert len({r.headers["webhook-id"] for r in rx.requests}) == 5
    a.close()
    b.close()


def test_worker_delivers_in_the_background(rx, db):
    out = Outbox(db, settings(rx))
    with OutboxWorker(out, interval_s=0.1) as worker:
        assert out.enqueue("job-1", make_report())
        worker.wake()
        reqs = rx.wait_for(1)
    assert len(reqs) == 1
    assert out.history()[0]["status"] == "delivered"


def test_environment_is_not_consulted_for_destinations(rx, db, monkeypatch):
    # Destinations come from settings only; an alert never goes anywhere else.
    monkeypatch.setenv("LOGDX_ALERTS__WEBHOOKS", rx.url + "/evil")
    out = Outbox(db, AlertsSettings())
    assert out.enqueue("job-1", make_report()) is False
    assert os.environ["LOGDX_ALERTS__WEBHOOKS"]  # still there, unused


# -- what was done, dedup across jobs, resolved -----------------------------------------------------


def test_restarts_of_one_job_on_a_bad_node_alert_once_within_the_window(rx, db):
    clock = Clock()
    out = Outbox(db, settings(rx, node_dedup_s=3600), clock=clock)
    assert out.enqueue("run-7.attempt-1", make_report()) is True
    clock.t += 600
    # its restart lands on the same node and fails alike: folded into the first attempt's alert
    assert out.enqueue("run-7.attempt-2", make_report(root="node-17: NVRM: Xid (PCI:0000:8a:00): 48, later")) is False
    assert out.counters[("enqueue", "folded")] == 1
    assert out.enqueue("run-7.attempt-3", make_report(failure_type="nvlink_error")) is True  # another failure type
    other = make_report(culprits=Culprits(hosts=["node-18"], ranks=[1]))
    assert out.enqueue("run-7.attempt-4", other) is True  # another node
    clock.t += 3600
    assert out.enqueue("run-7.attempt-5", make_report()) is True  # outside the window
    assert out.deliver_due() == 4


def test_another_job_failing_alike_on_the_same_node_gets_its_own_alert(rx, db):
    """Issue 20 point 3: two unrelated KeyErrors on one node, in two jobs: two alerts, never one
    folded into the other (and a hardware fault on a shared node is news to each job's owner too)."""
    clock = Clock()
    out = Outbox(db, settings(rx, node_dedup_s=3600), clock=clock)
    key_error = dict(category="script", failure_type="key_error", action="no_restart",
                     culprits=Culprits(hosts=["node-17"], ranks=[0]))
    assert out.enqueue("train-a", make_report(root="KeyError: 'labels'", **key_error)) is True
    clock.t += 60
    assert out.enqueue("train-b", make_report(root="KeyError: 'input_ids'", **key_error)) is True
    assert out.enqueue("train-c", make_report()) is True
    assert out.enqueue("train-d", make_report(root="node-17: NVRM: Xid (PCI:0000:8a:00): 48, later")) is True
    assert out.counters[("enqueue", "folded")] == 0
    assert out.deliver_due() == 4
    assert sorted(r.json()["data"]["job_id"] for r in rx.wait_for(4)) == ["train-a", "train-b", "train-c", "train-d"]


def test_resolved_follows_an_alert_when_the_job_succeeds_or_the_node_comes_back(rx, db):
    out = Outbox(db, settings(rx))
    assert out.enqueue("job-1", make_report(), ["cordon node-17: done (ran: scontrol ...)"])
    assert out.enqueue("job-2", make_report(culprits=Culprits(hosts=["node-9"], ranks=[1])))
    assert out.resolve_job("job-1", "job-1 succeeded after a restart") == 1
    assert out.resolve_job("job-1", "again") == 0  # once
    assert out.resolve_job("job-unknown", "x") == 0  # nothing was alerted about it
    assert out.resolve_node("NODE-9", "node-9 is back in service") == 1
    assert out.deliver_due() == 4
    bodies = [r.json() for r in rx.wait_for(4)]
    assert [b["type"] for b in bodies] == ["logdx.diagnosis", "logdx.diagnosis", "logdx.resolved", "logdx.resolved"]
    assert bodies[0]["data"]["done"] == ["cordon node-17: done (ran: scontrol ...)"]
    assert bodies[0]["data"]["recommended"] == "Cordon the node, then restart"
    assert bodies[2]["data"]["resolved"] == "job-1 succeeded after a restart" and bodies[2]["data"]["job_id"] == "job-1"
    assert bodies[3]["data"]["job_id"] == "job-2"


def test_the_alert_states_the_recommendation_and_what_was_actually_done(rx, db, tmp_path):
    from logdx.act.respond import Responder
    from logdx.config import Settings
    from logdx.testing import failed_report

    alerts = {"webhooks": [{"url": rx.url + "/hook", "secret": SECRET}], "node_dedup_s": 0}
    refused = Responder(db, Settings(data_dir=tmp_path, alerts=alerts, actions={
        "actuator": "slurm", "dry_run": False, "max_cordons": 0, "slurm": {"scontrol": "/bin/false"}}))
    resp = refused.respond("job-1", failed_report())
    assert resp.alert_queued and [a.outcome for a in resp.actions] == ["refused"]  # no evidence capsule: no cordon
    dry = Responder(db, Settings(data_dir=tmp_path, alerts=alerts, actions={"actuator": "slurm"}))
    assert dry.respond("job-2", failed_report()).alert_queued
    unnamed = Responder(db, Settings(data_dir=tmp_path, alerts=alerts, actions={"actuator": "slurm", "dry_run": False}))
    assert unnamed.respond("job-3", failed_report(hosts=())).alert_queued
    refused.outbox.deliver_due()
    done = [r.json()["data"]["done"] for r in rx.wait_for(3)]
    assert done[0] == ["cordon node-17: refused (safety limit: 0 node(s) already cordoned in the last 3600 s (-); "
                       "actions.max_cordons=0)"]
    assert done[1][0].startswith("evidence capsule sha256:")  # kept in a dry run too (tests/test_capsule.py)
    assert done[1][1].startswith("cordon node-17: dry run, nothing changed (would run: scontrol update NodeName=node-17")
    assert done[2][0].startswith("cordon: refused (node name unknown")
