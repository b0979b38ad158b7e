"""Actions: cordon through a (fake, real-HTTP) Kubernetes API server, drain through a stand-in
`scontrol` on PATH, restart hooks; dry-run by default; the per-window budget (nodes, not strings;
dry runs use none) and the circuit breaker; exactly once by content; per-node history, escalation,
uncordon; everything audited."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import sys

import pytest

from logdx.act.actions import Actions
from logdx.act.actuators import TAINT_KEY, NodeName, SlurmActuator, node_names
from logdx.act.actuators.restart import TemplateError, fill_command
from logdx.act.policy import AttemptOutcome, restart_verdict
from logdx.act.report import Culprits, Report, RootCause
from logdx.config import ActionsSettings
from logdx.store import open_db
from logdx.testing import Clock, failed_report


def make_report(hosts=("node-17",), **kw) -> Report:
    return failed_report(hosts=tuple(hosts), **kw)


@pytest.fixture
def db(backend_db):
    """Every test here runs on SQLite and on PostgreSQL."""
    return backend_db


@pytest.fixture
def kube(receiver):
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


def kube_settings(kube, taint: bool = False, **kw) -> ActionsSettings:
    base = dict(actuator="kubernetes", kubernetes={"api": kube.url, "token": "t0ken", "taint": taint}, dry_run=False)
    base.update(kw)
    return ActionsSettings(**base)


# -- Kubernetes -------------------------------------------------------------------------------------


def test_kubernetes_cordon_patches_the_node(kube, db):
    actions = Actions(db, kube_settings(kube, taint=True))
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
    s = ActionsSettings(actuator="kubernetes", kubernetes={"api": kube.url})
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
    s = ActionsSettings(actuator="slurm", dry_run=False, slurm={"scontrol": "/nonexistent/scontrol"})
    [rec] = Actions(db, s).apply("1", make_report())
    assert rec.outcome == "failed" and "FileNotFoundError" in rec.detail


# -- when to act ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, outcome, why",
    [
        (dict(category="framework", failure_type="cuda_oom", action="no_restart"), None, None),
        (dict(category="script", failure_type="syntax_error", action="no_restart"), None, None),
        (dict(category="framework", failure_type="cuda_oom"), "skipped", "category framework"),  # contradictory
        (dict(action="restart"), None, None),  # a restart, no cordon wanted
        (dict(confidence=0.5), "skipped", "below actions.min_confidence"),
        (dict(hosts=()), "refused", "node name unknown"),
        (dict(hosts=("gpu[001-512]",)), "skipped", "not a single plain host name"),
        (dict(hosts=("node-17,node-18",)), "skipped", "not a single plain host name"),
        (dict(hosts=("ALL",)), "skipped", "not a single plain host name"),
        (dict(not_corroborated=True), "skipped", "not corroborated"),
        (dict(failure_type="time_limit"), "skipped", "never cordon"),
    ],
)
def test_only_sure_corroborated_infrastructure_diagnoses_with_valid_names_act(kube, db, scontrol, kw, outcome, why):
    kw = dict(kw)  # the parameter is shared by both backends' runs
    hosts = kw.pop("hosts", ("node-17",))
    report = make_report(hosts=hosts, **{k: v for k, v in kw.items() if k != "not_corroborated"})
    if kw.get("not_corroborated"):
        report.culprits.corroborated = False
    # Grades off: the same failure of two jobs on one node is a repeat offender's (tests/test_grades.py).
    off = {"avoid_after": 0, "exclude_after": 0}
    out = Actions(db, kube_settings(kube, grades=off)).apply("job-1", report)
    out += Actions(db, ActionsSettings(actuator="slurm", dry_run=False, grades=off)).apply("job-2", report)
    assert [r for r in kube.requests if r.method == "PATCH"] == []
    assert scontrol() == []
    cordons = [r for r in out if r.action == "cordon"]
    if outcome is None:
        assert cordons == []
    else:
        assert {r.outcome for r in cordons} == {outcome} and all(why in r.detail for r in cordons), cordons
        assert all(r.node is None for r in cordons)


@pytest.mark.parametrize("stage", ["llm", "retrieval", "fusion"])
def test_a_verdict_no_rule_or_catalog_entry_chose_never_cordons_whatever_the_settings(kube, db, scontrol, stage):
    """The hard floor: min_confidence 0 and a sure, corroborated, verified culprit, yet a learned stage's verdict."""
    report = make_report(decided_by=stage)
    out = Actions(db, kube_settings(kube, min_confidence=0.0)).apply("job-1", report)
    out += Actions(db, ActionsSettings(actuator="slurm", dry_run=False, min_confidence=0.0)).apply("job-2", report)
    assert [r for r in kube.requests if r.method == "PATCH"] == [] and scontrol() == []
    cordons = [r for r in out if r.action == "cordon"]
    assert len(cordons) == 2 and all(r.outcome == "skipped" and "learned verdict" in r.detail for r in cordons), cordons
    # the same report, chosen by an entry of the error catalog, is acted on: the floor is the stage, nothing else
    assert [r.outcome for r in Actions(db, ActionsSettings(actuator="slurm", dry_run=False)).apply(
        "job-3", make_report(decided_by="catalog")) if r.action == "cordon"] == ["ok"]


def test_a_learned_stage_that_chose_a_cordon_leaves_a_restart() -> None:
    from logdx.diagnose.cascade import settle_action
    from logdx.model import FT, Action, Attribution, Category, Diagnosis, Label

    def diagnosis(decided_by: str) -> Diagnosis:
        return settle_action(Diagnosis(
            status="failed", label=Label(Category.INFRASTRUCTURE, FT.GPU_FELL_OFF_BUS, Action.CORDON_AND_RESTART),
            confidence=0.99, root=None, decided_by=decided_by,
            attribution=Attribution(hosts=["node-17"], ranks=[3], corroborated=True, basis="the root line's own host")))

    learned = diagnosis("llm")
    assert learned.label is not None and learned.label.action is Action.RESTART
    assert any("llm chose this verdict" in n for n in learned.notes), learned.notes
    ruled = diagnosis("rules")
    assert ruled.label is not None and ruled.label.action is Action.CORDON_AND_RESTART


@pytest.mark.parametrize("status", ["healthy", "unknown"])
def test_healthy_or_unknown_reports_do_nothing_and_audit_nothing(kube, db, status):
    report = make_report(status=status, category=None, failure_type=None, action="none", root_cause=None)
    actions = Actions(db, kube_settings(kube))
    assert actions.apply("job-1", report) == []
    assert actions.audit() == []


def test_node_names_are_validated_and_actuators_refuse_plain_strings(db, scontrol):
    assert node_names(["gpu-001", "GPU-001", "gpu[001-512]", "a,b", "ALL", "x y", "$(touch pwned)", "n1.dc"]) == \
        (["gpu-001", "n1.dc"], ["gpu[001-512]", "a,b", "ALL", "x y", "$(touch pwned)"])
    with pytest.raises(ValueError):
        NodeName("gpu[001-512]")
    slurm = SlurmActuator(SlurmActuator.Settings())
    with pytest.raises(TypeError):
        slurm.cordon("gpu[001-512]", "job", make_report())  # type: ignore[arg-type]
    assert scontrol() == []


# -- the budget counts nodes, dry runs use none -------------------------------------------------------


def test_safety_limit_refuses_the_third_cordon_in_the_window_and_survives_restarts(kube, tmp_path):
    clock = Clock()
    path = tmp_path / "logdx.db"
    d = open_db(path)
    s = kube_settings(kube, max_cordons=2, window_s=3600, cluster_size=20)
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
    # A node cordoned already is not cordoned again (another job blaming it: deduplicated).
    [again] = actions.apply("job-4", make_report(hosts=("NODE-17",)))
    assert again.outcome == "skipped" and "already cordoned" in again.detail
    # Once the window has passed, cordons are allowed again.
    clock.t += 3600
    assert actions.apply("job-5", make_report(hosts=("node-19",)))[0].outcome == "ok"
    outcomes = [(r.job_id, r.node, r.outcome) for r in actions.audit()]
    assert ("job-3", "node-19", "refused") in outcomes
    d.close()


def test_budget_counts_nodes_not_strings(db, scontrol):
    s = ActionsSettings(actuator="slurm", dry_run=False, max_cordons=2, cluster_size=50)
    recs = Actions(db, s).apply("job-1", make_report(hosts=("a-1", "A-1", "a-2", "a-3", "gpu[001-512]")))
    # The range is refused as a whole report (no cordon at all), never expanded.
    assert [(r.node, r.outcome) for r in recs] == [(None, "skipped")] and "gpu[001-512]" in recs[0].detail
    recs = Actions(db, s).apply("job-2", make_report(hosts=("a-1", "A-1", "a-2", "a-3")))
    assert [(r.node, r.outcome) for r in recs] == [("a-1", "ok"), ("a-2", "ok"), ("a-3", "refused")]
    assert [c[1] for c in scontrol()] == ["NodeName=a-1", "NodeName=a-2"]


def test_dry_runs_are_audited_as_such_and_use_no_budget(db, scontrol):
    clock = Clock()
    dry = ActionsSettings(actuator="slurm", max_cordons=2, cluster_size=50)  # dry run: the default
    for i in range(5):
        [rec] = Actions(db, dry, clock=clock).apply(f"dry-{i}", make_report(hosts=(f"n-{i}",)))
        assert (rec.outcome, rec.dry_run) == ("dry_run", True) and "would run: scontrol" in rec.detail
    assert scontrol() == []
    real = Actions(db, ActionsSettings(actuator="slurm", dry_run=False, max_cordons=2, cluster_size=50), clock=clock)
    assert real.cordoned_recently() == []
    assert [real.apply(f"real-{i}", make_report(hosts=(f"n-{i}",)))[0].outcome for i in range(3)] == \
        ["ok", "ok", "refused"]
    # A dry run judged against the real budget says it would be refused, and still counts nothing.
    [rec] = Actions(db, dry, clock=clock).apply("dry-9", make_report(hosts=("n-9",)))
    assert rec.outcome == "refused" and rec.dry_run and "safety limit" in rec.detail
    assert real.cordoned_recently() == ["n-0", "n-1"]


def test_max_cordons_zero_never_cordons(kube, db):
    [rec] = Actions(db, kube_settings(kube, max_cordons=0)).apply("job-1", make_report())
    assert rec.outcome == "refused"
    assert kube.requests == []


# -- the circuit breaker ----------------------------------------------------------------------------


def test_breaker_opens_at_its_threshold_and_stays_open_until_a_person_resets_it(db, scontrol):
    clock = Clock()
    # 10 known nodes, at most 20% under cordon per hour; a generous budget so the breaker is what binds.
    s = ActionsSettings(actuator="slurm", dry_run=False, max_cordons=100, cluster_size=10, breaker_max_share=0.2,
                        breaker_window_s=3600)
    actions = Actions(db, s, clock=clock)
    assert [actions.apply(f"job-{i}", make_report(hosts=(f"n-{i}",)))[0].outcome for i in range(2)] == ["ok", "ok"]
    [third] = actions.apply("job-2", make_report(hosts=("n-2",)))
    assert third.outcome == "refused" and "circuit breaker" in third.detail and "3 of 10" in third.detail
    assert actions.status().breaker.open
    # Open: a fourth job is refused, and so is anything after the window has passed.
    clock.t += 7200
    [fourth] = actions.apply("job-3", make_report(hosts=("n-3",)))
    assert fourth.outcome == "refused" and "circuit breaker open" in fourth.detail
    assert len(scontrol()) == 2
    # A person resets it (audited); cordons resume.
    reset = actions.reset_breaker("alice", "n-0..n-2 were bad GPUs, replaced")
    assert (reset.action, reset.outcome, reset.job_id) == ("breaker", "reset", "alice") and "was open" in reset.detail
    assert not actions.status().breaker.open
    assert actions.apply("job-4", make_report(hosts=("n-4",)))[0].outcome == "ok"
    breaker_rows = [(r.action, r.outcome) for r in actions.audit() if r.action == "breaker"]
    assert breaker_rows == [("breaker", "open"), ("breaker", "reset")]


def test_breaker_denominator_is_the_nodes_seen_in_job_logs(db, scontrol):
    s = ActionsSettings(actuator="slurm", dry_run=False, max_cordons=100, breaker_max_share=0.5)
    actions = Actions(db, s)
    hosts = [f"h-{i}" for i in range(4)]
    assert actions.apply("j1", make_report(hosts=("h-0",)), seen_hosts=hosts)[0].outcome == "ok"
    assert actions.apply("j2", make_report(hosts=("h-1",)), seen_hosts=hosts)[0].outcome == "ok"  # 2/4
    [rec] = actions.apply("j3", make_report(hosts=("h-2",)), seen_hosts=hosts)  # 3/4 > 50%
    assert rec.outcome == "refused" and "3 of 4 known nodes" in rec.detail


# -- exactly once, by content -----------------------------------------------------------------------


def test_the_same_diagnosis_is_acted_on_once_whatever_its_line_number(kube, tmp_path):
    path = tmp_path / "logdx.db"
    marker = tmp_path / "restarts"
    s = kube_settings(kube, restart_command=[sys.executable, "-c", "import sys; open(sys.argv[1], 'a').write('x')",
                                             str(marker)])
    first = Actions(open_db(path), s).apply("job-1", make_report(line_no=33))
    # After a crash the spool replay shifts line numbers: the same diagnosis, another line number.
    again = Actions(open_db(path), s).apply("job-1", make_report(line_no=31))
    assert [(r.action, r.outcome) for r in first] == [("cordon", "ok"), ("restart", "ok")]
    assert [r.id for r in again] == [r.id for r in first]
    assert len([r for r in kube.requests if r.method == "PATCH"]) == 1
    assert marker.read_text() == "x"
    # The audit table itself refuses a second row for the same (key, action, node).
    db = open_db(path)
    with pytest.raises(sqlite3.IntegrityError):
        db.execute("INSERT INTO action_audit(ts, job_id, node, action, actuator, dry_run, outcome, action_key)"
                   " VALUES (0, 'job-1', 'node-17', 'cordon', 'kubernetes', 0, 'ok', ?)", (first[0].action_key,))


# -- per-node history, escalation, uncordon -----------------------------------------------------------


def _xid13(host: str, pid: int) -> Report:
    return make_report(hosts=(host,), category="framework", failure_type="framework_error", action="no_restart",
                       confidence=0.6,
                       culprits=Culprits(hosts=[host], ranks=[3], gpus=["0000:3b:00"], corroborated=True,
                                         basis="the root line's own host"),
                       root_cause=RootCause(line_no=9, host=host, text=f"{host} kernel: NVRM: Xid (PCI:0000:3b:00): "
                                            f"13, pid={pid}, Graphics SM Warp Exception"))


def test_repeated_xid13_on_one_gpu_escalates_to_a_cordon_and_nodes_show_their_history(db, scontrol):
    clock = Clock()
    s = ActionsSettings(actuator="slurm", dry_run=False, cluster_size=50)  # escalate: Xid 13 x3 in an hour
    actions = Actions(db, s, clock=clock)
    assert actions.apply("job-a", _xid13("gpu-07", 100)) == []  # a restart, no cordon asked
    assert actions.apply("job-a", _xid13("gpu-07", 100)) == []  # the same event again: deduplicated
    clock.t += 600
    assert actions.apply("job-b", _xid13("gpu-07", 200)) == []
    clock.t += 600
    [rec] = actions.apply("job-c", _xid13("gpu-07", 300))
    assert (rec.node, rec.outcome) == ("gpu-07", "ok") and "escalated: Xid 13" in rec.detail and "3 times" in rec.detail
    assert "counted from job(s) job-a, job-b, job-c" in rec.detail  # per node, and it says which jobs it counted
    info = actions.nodes.get("gpu-07")
    assert info is not None and info.state == "cordoned" and info.events == 3
    assert info.jobs == ["job-c", "job-b", "job-a"] and info.blamed_by_several_jobs
    # Spread over more than the window, they do not escalate.
    clock.t += 7200
    assert actions.apply("job-d", _xid13("gpu-08", 1)) == []
    clock.t += 4000
    assert actions.apply("job-e", _xid13("gpu-08", 2)) == []
    clock.t += 4000
    assert actions.apply("job-f", _xid13("gpu-08", 3)) == []


def test_uncordon_by_a_person_and_by_a_passing_health_check(kube, db, tmp_path):
    clock = Clock()
    check = tmp_path / "check.py"
    check.write_text("import sys; sys.exit(0 if sys.argv[1] == 'node-17' else 1)\n")
    s = kube_settings(kube, taint=True, health_check_command=[sys.executable, str(check), "{node}"],
                      uncordon_after_s=600, cluster_size=20)
    actions = Actions(db, s, clock=clock)
    actions.apply("job-1", make_report(hosts=("node-17",)))
    actions.apply("job-2", make_report(hosts=("node-18",)))
    assert actions.health_checks() == []  # not cordoned long enough yet
    clock.t += 601
    [rec] = actions.health_checks()  # node-18 fails its check and stays cordoned
    assert (rec.action, rec.node, rec.outcome, rec.actuator) == ("uncordon", "node-17", "ok", "kubernetes")
    assert kube.nodes["node-17"]["spec"]["unschedulable"] is False
    assert not any(t["key"] == TAINT_KEY for t in kube.nodes["node-17"]["spec"]["taints"])
    assert "logdx.io/cordon-reason" not in kube.nodes["node-17"]["metadata"]["annotations"]
    assert kube.nodes["node-18"]["spec"]["unschedulable"] is True
    rec = actions.uncordon("node-18", "bob", "GPU reseated")
    assert rec.outcome == "ok" and rec.job_id == "bob" and "GPU reseated" in rec.detail
    assert actions.nodes.cordoned() == []
    with pytest.raises(ValueError):
        actions.uncordon("gpu[001-512]", "mallory")


def test_slurm_uncordon_resumes_the_node(db, scontrol):
    actions = Actions(db, ActionsSettings(actuator="slurm", dry_run=False))
    actions.apply("4242", make_report())
    actions.uncordon("node-17", "alice")
    assert scontrol()[-1] == ["update", "NodeName=node-17", "State=RESUME"]


# -- restart hooks ----------------------------------------------------------------------------------


def test_restart_command_is_an_argv_template_without_a_shell(kube, db, tmp_path):
    out_file = tmp_path / "restarted.txt"
    writer = "import sys; open(sys.argv[1], 'w').write('|'.join(sys.argv[2:]))"
    # A placeholder inside quotes is still one argument, and no shell ever reads it.
    cmd = f"{sys.executable} -c \"{writer}\" {out_file} \"{{job_id}}\" {{failure_type}} --hosts={{hosts}}"
    s = kube_settings(kube, restart_command=cmd)
    job = f"job 1'; touch {tmp_path / 'pwned'}; echo '$(touch${{IFS}}{tmp_path / 'pwned2'})"
    recs = Actions(db, s).apply(job, make_report())
    assert [(r.action, r.outcome) for r in recs] == [("cordon", "ok"), ("restart", "ok")]
    assert out_file.read_text() == f"{job}|gpu_fell_off_bus|--hosts=node-17"
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "pwned2").exists()


def test_a_placeholder_in_a_shell_script_text_is_refused_and_positional_arguments_work(kube, db, tmp_path):
    with pytest.raises(TemplateError):
        fill_command("sh -c 'echo {job_id}'", {"job_id": "x"})
    with pytest.raises(ValueError, match="parsed by the shell"):  # refused when the settings are read
        kube_settings(kube, restart_command='bash -c "sbatch {job_id}.sbatch"')
    out_file = tmp_path / "out.txt"
    s = kube_settings(kube, restart_command=f"sh -c 'printf %s \"$1\" > {out_file}' sh {{job_id}}")
    job = "a$(touch " + str(tmp_path / "pwned") + ")"
    assert Actions(db, s).apply(job, make_report())[-1].outcome == "ok"
    assert out_file.read_text() == job and not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("template", [
    "sh -ec 'sbatch {job_id}.sbatch'",  # -c among other options
    "bash -xc 'sbatch {job_id}.sbatch'",
    "env bash -c 'sbatch {job_id}.sbatch'",  # behind env
    "/usr/bin/env LC_ALL=C /bin/sh -c 'sbatch {job_id}.sbatch'",
    "nice -n 5 timeout 60 bash -o pipefail -c 'scancel {job_id} | cat'",
    "sudo -u slurm sh -euc 'sbatch --dependency=afterany:{job_id} x'",
    ["env", "zsh", "-lc", "requeue {hosts}"],
    "busybox sh -c 'echo {node}'",
])
def test_a_placeholder_in_a_shell_script_text_is_refused_however_the_shell_is_called(template):
    """Issue 20 point 6: `sh -ec` and `env bash -c` slipped past the check."""
    with pytest.raises(TemplateError, match="parsed by the shell"):
        fill_command(template, {"job_id": "x", "hosts": "a", "node": "n"})


@pytest.mark.parametrize("template", [
    "env bash -c 'sbatch \"$1\".sbatch' bash {job_id}",  # the value is the script's argument
    "sh -e /opt/requeue.sh {job_id}",  # a script file, no -c
    "bash --rcfile /etc/x.rc /opt/requeue.sh {hosts}",
])
def test_shell_commands_that_pass_values_as_arguments_are_fine(template):
    assert fill_command(template, {"job_id": "x", "hosts": "a"})


def test_restart_hook_dry_run_and_failure(kube, db, tmp_path):
    s = ActionsSettings(actuator="kubernetes", kubernetes={"api": kube.url}, restart_command=f"touch {tmp_path}/x")
    recs = Actions(db, s).apply("job-1", make_report())
    assert recs[-1].action == "restart" and recs[-1].outcome == "dry_run" and "would run" in recs[-1].detail
    assert not (tmp_path / "x").exists()
    fail = [sys.executable, "-c", "import sys; sys.stderr.write('boom'); sys.exit(3)"]
    s = kube_settings(kube, restart_command=fail)
    recs = Actions(db, s).apply("job-2", make_report(hosts=("node-18",)))
    assert recs[-1].outcome == "failed" and "exit 3" in recs[-1].detail and "boom" in recs[-1].detail


def test_restart_webhook_is_posted_for_infrastructure_only(kube, db, receiver):
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


def test_no_restart_onto_a_node_whose_cordon_was_refused_or_unknown(kube, db, tmp_path):
    s = kube_settings(kube, max_cordons=0, restart_command=f"touch {tmp_path}/x")
    recs = Actions(db, s).apply("job-1", make_report())
    assert [(r.action, r.outcome) for r in recs] == [("cordon", "refused"), ("restart", "skipped")]
    recs = Actions(db, kube_settings(kube, restart_command=f"touch {tmp_path}/x")).apply("job-2", make_report(hosts=()))
    assert [(r.action, r.outcome) for r in recs] == [("cordon", "refused"), ("restart", "skipped")]
    assert "node name unknown" in recs[0].detail
    assert not (tmp_path / "x").exists()


def test_a_time_limit_resubmits_and_cordons_nothing(kube, db, tmp_path):
    s = kube_settings(kube, restart_command=f"touch {tmp_path}/x")
    report = make_report(failure_type="time_limit", action="restart")
    recs = Actions(db, s).apply("job-1", report, verdict=restart_verdict(None, AttemptOutcome.of(report, 10)))
    assert [(r.action, r.outcome) for r in recs] == [("restart", "ok")] and "resubmit" in recs[0].detail
    assert (tmp_path / "x").exists()
    assert [r for r in kube.requests if r.method == "PATCH"] == []


def test_apply_without_restart_only_cordons(kube, db, tmp_path):
    s = kube_settings(kube, restart_command=f"touch {tmp_path}/x")
    recs = Actions(db, s).apply("job-1", make_report(), restart=False)
    assert [r.action for r in recs] == ["cordon"]
    assert not (tmp_path / "x").exists()


def test_fill_command_leaves_other_braces_alone():
    assert fill_command("awk '{print $1}' {job_id}", {"job_id": "a b"}) == ["awk", "{print $1}", "a b"]


# -- the restart policy from history ----------------------------------------------------------------


def test_restart_verdict_stops_a_failure_that_follows_the_job_and_an_attempt_without_progress():
    ecc = "ecc_error"
    first = AttemptOutcome(ecc, ("gpu-02",), 120)
    assert restart_verdict(None, first).decision == "restart"
    moved = restart_verdict(first, AttemptOutcome(ecc, ("gpu-03",), 80))
    assert moved.stop and "follows the job" in moved.reason
    assert restart_verdict(first, AttemptOutcome("nvlink_error", ("gpu-03",), 80)).decision == "restart"
    assert restart_verdict(first, AttemptOutcome(ecc, ("gpu-02",), 80)).decision == "restart"  # same node
    stuck = restart_verdict(first, AttemptOutcome("nccl_timeout", (), 0))
    assert stuck.stop and "no progress" in stuck.reason
    assert restart_verdict(first, AttemptOutcome("nccl_timeout", (), None)).decision == "restart"  # unknown
    assert restart_verdict(first, AttemptOutcome("time_limit", (), 50)).decision == "resubmit"
    assert restart_verdict(AttemptOutcome(None, ok=True), AttemptOutcome(ecc, ("gpu-03",), 0)).decision == "restart"
