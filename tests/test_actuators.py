"""Actions: cordon through a (fake, real-HTTP) Kubernetes API server, drain through a stand-in
`scontrol` on PATH, restart hooks; dry-run by default; a safety limit; everything audited."""

from __future__ import annotations

import json
import os
import stat
import sys

import pytest

from logdx.act.actuators import TAINT_KEY, Actions, fill_command
from logdx.act.report import CompressionFigures, Culprits, Report, RootCause
from logdx.config import ActionsSettings
from logdx.store import open_db
from support import Clock, load_receiver


receiver = load_receiver()


def make_report(hosts=("node-17",), **kw) -> Report:
    base = dict(
        status="failed", category="infrastructure", failure_type="gpu_fell_off_bus", action="cordon_and_restart",
        confidence=0.97, culprits=Culprits(hosts=list(hosts), ranks=[3]),
        root_cause=RootCause(line_no=33, text="NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",
                             rank=3, host=hosts[0] if hosts else None),
        evidence=[], explanation="GPU fell off the bus.", hint="Drain the node.",
        compression=CompressionFigures(lines_in=40, templates=8, lines_kept=40), timings_ms={},
    )
    base.update(kw)
    return Report(**base)


@pytest.fixture
def db(tmp_path):
    d = open_db(tmp_path / "logdx.db")
    yield d
    d.close()


@pytest.fixture
def kube():
    with receiver.FakeKube(nodes=["node-17", "node-18", "node-19", "node-20"]) as k:
        yield k


@pytest.fixture
def scontrol(tmp_path, monkeypatch):
    """A stand-in `scontrol` first on PATH: records its argv (one JSON list a line), exits
    with $FAKE_SCONTROL_RC."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    calls = tmp_path / "scontrol-calls.jsonl"
    script = bindir / "scontrol"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        f"with open({str(calls)!r}, 'a') as f:\n"
        "    f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
        "rc = int(os.environ.get('FAKE_SCONTROL_RC', '0'))\n"
        "if rc:\n"
        "    sys.stderr.write('scontrol: error: Invalid node name specified\\n')\n"
        "sys.exit(rc)\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")

    def read() -> list[list[str]]:
        return [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []

    return read


def kube_settings(kube, **kw) -> ActionsSettings:
    base = dict(actuator="kubernetes", kube_api=kube.url, kube_token="t0ken", dry_run=False)
    base.update(kw)
    return ActionsSettings(**base)


# -- Kubernetes -------------------------------------------------------------------------------------


def test_kubernetes_cordon_patches_the_node(kube, db):
    actions = Actions(db, kube_settings(kube, kube_taint=True))
    [rec] = actions.apply("job-1", make_report())
    assert (rec.action, rec.actuator, rec.node, rec.outcome, rec.dry_run) == \
        ("cordon", "kubernetes", "node-17", "ok", False)
    patches = [r for r in kube.requests if r.method == "PATCH"]
    assert len(patches) == 1
    p = patches[0]
    assert p.path.startswith("/api/v1/nodes/node-17")
    assert p.headers["content-type"] == "application/merge-patch+json"
    assert p.headers["authorization"] == "Bearer t0ken"
    body = p.json()
    assert body["spec"]["unschedulable"] is True
    node = kube.nodes["node-17"]
    assert node["spec"]["unschedulable"] is True
    # Our taint added, the node's own taints kept.
    assert {"key": TAINT_KEY, "value": "gpu_fell_off_bus", "effect": "NoSchedule"} in node["spec"]["taints"]
    assert any(t["key"] == "nvidia.com/gpu" for t in node["spec"]["taints"])
    assert "gpu_fell_off_bus" in node["metadata"]["annotations"]["logdx.io/cordon-reason"]
    assert actions.audit("job-1")[0].outcome == "ok"


def test_kubernetes_without_taint_only_cordons(kube, db):
    Actions(db, kube_settings(kube)).apply("job-1", make_report())
    assert kube.nodes["node-17"]["spec"]["unschedulable"] is True
    assert not any(t["key"] == TAINT_KEY for t in kube.nodes["node-17"]["spec"]["taints"])


def test_kubernetes_unknown_node_is_a_failure_in_the_audit(kube, db):
    [rec] = Actions(db, kube_settings(kube)).apply("job-1", make_report(hosts=("node-99",)))
    assert rec.outcome == "failed" and "404" in rec.detail
    assert not [r for r in kube.requests if r.method == "PATCH"]


def test_dry_run_is_the_default_and_only_audits(kube, db, scontrol):
    s = ActionsSettings(actuator="kubernetes", kube_api=kube.url)
    assert s.dry_run is True
    [rec] = Actions(db, s).apply("job-1", make_report())
    assert rec.outcome == "dry_run" and rec.dry_run is True
    assert "would PATCH node node-17" in rec.detail
    assert kube.requests == []
    [rec] = Actions(db, ActionsSettings(actuator="slurm")).apply("job-2", make_report())
    assert rec.outcome == "dry_run" and "scontrol update NodeName=node-17 State=DRAIN" in rec.detail
    assert scontrol() == []


# -- Slurm ------------------------------------------------------------------------------------------


def test_slurm_drain_runs_scontrol(db, scontrol):
    [rec] = Actions(db, ActionsSettings(actuator="slurm", dry_run=False)).apply("4242", make_report())
    assert rec.outcome == "ok"
    assert scontrol() == [["update", "NodeName=node-17", "State=DRAIN", "Reason=logdx: gpu_fell_off_bus 4242"]]


def test_slurm_failure_is_audited_with_its_message(db, scontrol, monkeypatch):
    monkeypatch.setenv("FAKE_SCONTROL_RC", "1")
    [rec] = Actions(db, ActionsSettings(actuator="slurm", dry_run=False)).apply("4242", make_report())
    assert rec.outcome == "failed" and "Invalid node name" in rec.detail
    # A failed cordon is not counted against the safety limit.
    assert Actions(db, ActionsSettings(actuator="slurm", dry_run=False)).cordoned_recently() == []


def test_missing_scontrol_is_a_failure_not_a_crash(db):
    s = ActionsSettings(actuator="slurm", dry_run=False, scontrol="/nonexistent/scontrol")
    [rec] = Actions(db, s).apply("1", make_report())
    assert rec.outcome == "failed" and "FileNotFoundError" in rec.detail


# -- when to act ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, why",
    [
        (dict(category="framework", failure_type="cuda_oom", action="no_restart"), None),
        (dict(category="script", failure_type="syntax_error", action="no_restart"), None),
        (dict(category="framework", failure_type="cuda_oom"), "category framework"),  # contradictory, still no
        (dict(action="restart"), None),  # a restart, no cordon wanted
        (dict(confidence=0.5), "below actions.min_confidence"),
        (dict(hosts=()), "culprit host unknown"),
    ],
)
def test_only_sure_infrastructure_diagnoses_with_known_hosts_act(kube, db, kw, why):
    hosts = kw.pop("hosts", ("node-17",))
    report = make_report(hosts=hosts, **kw)
    out = Actions(db, kube_settings(kube)).apply("job-1", report)
    assert [r for r in kube.requests if r.method == "PATCH"] == []
    cordons = [r for r in out if r.action == "cordon"]
    if why is None:
        assert cordons == []
    else:
        assert [r.outcome for r in cordons] == ["skipped"] and why in cordons[0].detail
    assert all(r.outcome == "skipped" for r in out)


def test_healthy_reports_do_nothing_and_audit_nothing(kube, db):
    healthy = make_report(status="healthy", category=None, failure_type=None, action="none", root_cause=None)
    actions = Actions(db, kube_settings(kube))
    assert actions.apply("job-1", healthy) == []
    assert actions.audit() == []


# -- the safety limit -------------------------------------------------------------------------------


def test_safety_limit_refuses_the_third_cordon_in_the_window_and_survives_restarts(kube, tmp_path):
    clock = Clock()
    path = tmp_path / "logdx.db"
    d = open_db(path)
    s = kube_settings(kube, max_cordons=2, window_s=3600)
    actions = Actions(d, s, clock=clock)
    assert actions.apply("job-1", make_report(hosts=("node-17",)))[0].outcome == "ok"
    clock.t += 60
    assert actions.apply("job-2", make_report(hosts=("node-18",)))[0].outcome == "ok"
    clock.t += 60
    d.close()
    # A restarted server: the limit is counted from the audit table.
    d = open_db(path)
    actions = Actions(d, s, clock=clock)
    [third] = actions.apply("job-3", make_report(hosts=("node-19",)))
    assert third.outcome == "refused" and "safety limit" in third.detail
    assert "node-19" not in {r.path.split("/")[-1].split("?")[0] for r in kube.requests if r.method == "PATCH"}
    assert kube.nodes["node-19"]["spec"].get("unschedulable") is None
    # Re-cordoning a node already cordoned in the window is no new cordon.
    assert actions.apply("job-4", make_report(hosts=("node-17",)))[0].outcome == "ok"
    # Once the window has passed, cordons are allowed again.
    clock.t += 3600
    assert actions.apply("job-5", make_report(hosts=("node-19",)))[0].outcome == "ok"
    outcomes = [(r.job_id, r.node, r.outcome) for r in actions.audit()]
    assert ("job-3", "node-19", "refused") in outcomes
    d.close()


def test_safety_limit_applies_to_a_multi_host_report_and_to_dry_runs(db):
    clock = Clock()
    s = ActionsSettings(actuator="slurm", max_cordons=2)  # dry run
    recs = Actions(db, s, clock=clock).apply("job-1", make_report(hosts=("a-1", "a-2", "a-3")))
    assert [r.outcome for r in recs] == ["dry_run", "dry_run", "refused"]


def test_max_cordons_zero_never_cordons(kube, db):
    [rec] = Actions(db, kube_settings(kube, max_cordons=0)).apply("job-1", make_report())
    assert rec.outcome == "refused"
    assert kube.requests == []


# -- restart hooks ----------------------------------------------------------------------------------


def test_restart_command_gets_shell_quoted_placeholders(kube, db, tmp_path):
    out_file = tmp_path / "restarted.txt"
    cmd = f"printf '%s|%s|%s' {{job_id}} {{failure_type}} {{hosts}} > {out_file}"
    s = kube_settings(kube, restart_command=cmd)
    job = "job 1'; touch " + str(tmp_path / "pwned") + "; echo '"
    recs = Actions(db, s).apply(job, make_report())
    assert [(r.action, r.outcome) for r in recs] == [("cordon", "ok"), ("restart", "ok")]
    assert out_file.read_text() == f"{job}|gpu_fell_off_bus|node-17"
    assert not (tmp_path / "pwned").exists()


def test_restart_hook_dry_run_and_failure(kube, db, tmp_path):
    s = ActionsSettings(actuator="kubernetes", kube_api=kube.url, restart_command=f"touch {tmp_path}/x")
    recs = Actions(db, s).apply("job-1", make_report())
    assert recs[-1].action == "restart" and recs[-1].outcome == "dry_run" and "would run" in recs[-1].detail
    assert not (tmp_path / "x").exists()
    s = kube_settings(kube, restart_command="echo boom >&2; exit 3")
    recs = Actions(db, s).apply("job-2", make_report(hosts=("node-18",)))
    assert recs[-1].outcome == "failed" and "exit 3" in recs[-1].detail and "boom" in recs[-1].detail


def test_restart_webhook_is_posted_for_infrastructure_only(kube, db):
    with receiver.Receiver() as rx:
        s = kube_settings(kube, restart_webhook=rx.url + "/restart")
        recs = Actions(db, s).apply("job-1", make_report(action="restart"))  # restart, no cordon
        assert [(r.action, r.actuator, r.outcome) for r in recs] == [("restart", "webhook", "ok")]
        [req] = rx.wait_for(1)
        body = req.json()
        assert body["job_id"] == "job-1" and body["failure_type"] == "gpu_fell_off_bus"
        assert body["report"]["category"] == "infrastructure"
        recs = Actions(db, s).apply("job-2", make_report(category="framework", failure_type="cuda_oom",
                                                          action="no_restart"))
        assert [(r.action, r.outcome) for r in recs] == [("restart", "skipped")]
        assert len(rx.requests) == 1


def test_no_restart_onto_a_node_whose_cordon_was_refused(kube, db, tmp_path):
    s = kube_settings(kube, max_cordons=0, restart_command=f"touch {tmp_path}/x")
    recs = Actions(db, s).apply("job-1", make_report())
    assert [(r.action, r.outcome) for r in recs] == [("cordon", "refused"), ("restart", "skipped")]
    assert not (tmp_path / "x").exists()


def test_apply_without_restart_only_cordons(kube, db, tmp_path):
    s = kube_settings(kube, restart_command=f"touch {tmp_path}/x")
    recs = Actions(db, s).apply("job-1", make_report(), restart=False)
    assert [r.action for r in recs] == ["cordon"]
    assert not (tmp_path / "x").exists()


def test_fill_command_leaves_other_braces_alone():
    assert fill_command("awk '{print $1}' {job_id}", {"job_id": "a b"}) == "awk '{print $1}' 'a b'"
