"""Repeat offenders, conservatively (`actions.grades`, `NodeBook.grade`): a node blamed once is suspect, twice
for one family of failure within the window avoided (Kubernetes: the taint logdx.io/avoid PreferNoSchedule;
Slurm: a high Weight, the old one restored after), three times excluded (cordoned through the same path, budget
and breaker as any cordon); healthy runtime on the node decays the grade a step at a time; a false alarm takes
its blame out. End to end through the fake Kubernetes API server and a stand-in `scontrol` that answers
`show node` and records every call, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Callable

import pytest

from logdx.act.actions import Actions
from logdx.act.actuators import NodeName
from logdx.act.nodes import Credit, GradeBlame, grade_of
from logdx.act.report import Culprits, Report, RootCause
from logdx.config import ActionsSettings, GradeSettings
from logdx.testing import Clock, failed_report

HOUR = 3600.0
AVOID = {"key": "logdx.io/avoid", "value": "network", "effect": "PreferNoSchedule"}


@pytest.fixture
def db(backend_db):
    return backend_db


@pytest.fixture
def kube(receiver):
    with receiver.FakeKube(nodes=["node-17", "node-18", "node-19", "node-20"]) as k:
        yield k


@pytest.fixture
def scontrol(tmp_path, monkeypatch) -> Callable[[], list[list[str]]]:
    """A stand-in `scontrol` first on PATH: records its argv (one JSON list a line); `show node -o N` answers as
    Slurm does, with the node's Weight (7 until an update sets another)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    calls, weights = tmp_path / "scontrol-calls.jsonl", tmp_path / "weights.json"
    script = bindir / "scontrol"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        f"calls, weights = {str(calls)!r}, {str(weights)!r}\n"
        "args = sys.argv[1:]\n"
        "with open(calls, 'a') as f:\n"
        "    f.write(json.dumps(args) + '\\n')\n"
        "w = json.load(open(weights)) if os.path.exists(weights) else {}\n"
        "if args[:3] == ['show', 'node', '-o']:\n"
        "    n = args[3]\n"
        "    print(f'NodeName={n} Arch=x86_64 CoresPerSocket=32 CPUAlloc=0 Gres=gpu:8 State=IDLE '\n"
        "          f'Weight={w.get(n, 7)} Owner=N/A Partitions=gpu')\n"
        "elif args[:1] == ['update']:\n"
        "    kv = dict(a.split('=', 1) for a in args[1:])\n"
        "    if 'Weight' in kv:\n"
        "        w[kv['NodeName']] = int(kv['Weight'])\n"
        "        json.dump(w, open(weights, 'w'))\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return lambda: [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []


def network(host: str, job: str, **kw) -> Report:
    """A sure, corroborated NCCL failure (infrastructure, family network) the log pins on `host`: a restart,
    no cordon asked."""
    text = f"{host}:2231:2290 [3] NCCL WARN NET/IB : Got completion from peer 10.0.0.7 with error 12 ({job})"
    fields = dict(failure_type="nccl_error", action="restart", confidence=0.95,
                  culprits=Culprits(hosts=[host], ranks=[3], corroborated=True, basis="the root line's own host"),
                  root_cause=RootCause(line_no=40, text=text, rank=3, host=host))
    fields.update(kw)
    return failed_report(hosts=(host,), **fields)


def healthy() -> Report:
    return failed_report(status="healthy", category=None, failure_type=None, action="none", root_cause=None,
                         culprits=Culprits())


def kube_actions(db, kube, clock, **kw) -> Actions:
    settings = dict(actuator="kubernetes", kubernetes={"api": kube.url}, dry_run=False, cluster_size=20)
    settings.update(kw)
    return Actions(db, ActionsSettings(**settings), clock=clock)


def patched(kube, node: str) -> int:
    return len([r for r in kube.requests if r.method == "PATCH" and r.path.split("?")[0].endswith("/" + node)])


def rows(actions: Actions, node: str) -> list[tuple[str, str, str]]:
    return [(r.job_id, r.action, r.outcome) for r in actions.audit() if r.node == node]


# -- the grade itself -------------------------------------------------------------------------------


def _b(ts: float, job: str, family: str = "network") -> GradeBlame:
    return GradeBlame(ts, job, "nccl_error" if family == "network" else "ecc_error", family)


def test_a_grade_counts_one_family_within_the_window_and_decays_one_step_per_span_of_healthy_runtime():
    s = GradeSettings(window_s=24 * HOUR, decay_s=10 * HOUR)
    assert grade_of([], [], s).grade == "ok"
    assert grade_of([_b(0, "a")], [], s).grade == "suspect"
    assert grade_of([_b(0, "a"), _b(HOUR, "b")], [], s).grade == "avoid"
    # Other families, or the same one further apart than the window, do not add up.
    assert grade_of([_b(0, "a"), _b(HOUR, "b", "gpu"), _b(2 * HOUR, "c", "storage")], [], s).grade == "suspect"
    assert grade_of([_b(0, "a"), _b(25 * HOUR, "b"), _b(50 * HOUR, "c")], [], s).grade == "suspect"
    three = [_b(0, "a"), _b(HOUR, "b"), _b(2 * HOUR, "c")]
    g = grade_of(three, [], s)
    assert (g.grade, g.family, [b.job_id for b in g.counted]) == ("exclude", "network", ["a", "b", "c"])
    assert "blamed 3 times for network" in g.reason and "nccl_error in job a" in g.reason
    assert g.decay_due_s == 10 * HOUR and "drops to avoid after 10.0 h more healthy runtime" in g.reason
    # Healthy runtime after the last blame: each 10 h drops one step, forgiving the oldest blames.
    g = grade_of(three, [Credit(3 * HOUR, "ok-1", 6 * HOUR)], s)
    assert (g.grade, g.healthy_jobs, g.decay_due_s) == ("exclude", 1, 4 * HOUR)
    g = grade_of(three, [Credit(3 * HOUR, "ok-1", 6 * HOUR), Credit(9 * HOUR, "ok-2", 5 * HOUR)], s)
    assert (g.grade, [b.job_id for b in g.forgiven], g.credit_s) == ("avoid", ["a"], HOUR)
    g = grade_of(three, [Credit(3 * HOUR, "ok-1", 31 * HOUR)], s)
    assert (g.grade, [b.job_id for b in g.forgiven]) == ("ok", ["a", "b", "c"])
    # Runtime before a blame does not count toward its decay; a forgiven blame never counts again.
    g = grade_of([*three, _b(40 * HOUR, "d")], [Credit(3 * HOUR, "ok-1", 31 * HOUR)], s)
    assert (g.grade, g.credit_s) == ("suspect", 0.0)
    before = grade_of(three, [Credit(-HOUR, "early", 100 * HOUR)], s)
    assert before.grade == "exclude" and before.forgiven == []
    # The same history in any order gives the same grade.
    shuffled = grade_of(list(reversed(three)), [Credit(9 * HOUR, "ok-2", 5 * HOUR), Credit(3 * HOUR, "ok-1", 6 * HOUR)],
                        s)
    assert shuffled.to_dict() == grade_of(three, [Credit(3 * HOUR, "ok-1", 6 * HOUR),
                                                  Credit(9 * HOUR, "ok-2", 5 * HOUR)], s).to_dict()


def test_grade_settings_fail_loudly():
    for bad in ({"avoid_after": 1}, {"exclude_after": 2}, {"exclude_after": 1, "avoid_after": 0},
                {"window": 3600}, {"decay_s": 0}):
        with pytest.raises(ValueError):
            ActionsSettings(grades=bad)
    assert ActionsSettings(grades={"avoid_after": 0, "exclude_after": 0}).grades.exclude_after == 0


# -- Kubernetes ------------------------------------------------------------------------------------


def test_kubernetes_suspect_avoid_exclude_then_healthy_runtime_lifts_the_avoid_taint(db, kube):
    clock = Clock()
    actions = kube_actions(db, kube, clock)
    # Once: suspect, nothing touched.
    assert actions.apply("job-1", network("node-17", "job-1")) == []
    assert patched(kube, "node-17") == 0
    info = actions.nodes.get("node-17")
    assert info is not None and info.grade is not None and info.grade.grade == "suspect" and not info.avoided
    # Twice within the window: avoid, a PreferNoSchedule taint; the node stays schedulable.
    clock.t += 2 * HOUR
    [rec] = actions.apply("job-2", network("node-17", "job-2"))
    assert (rec.action, rec.node, rec.outcome) == ("avoid", "node-17", "ok")
    assert "graded avoid" in rec.detail and "this job and 1 before it" in rec.detail
    assert "job-1" not in rec.detail  # the audit is on the job's page: another job is counted, not named
    node = kube.nodes["node-17"]
    assert AVOID in node["spec"]["taints"] and any(t["key"] == "nvidia.com/gpu" for t in node["spec"]["taints"])
    assert not node["spec"].get("unschedulable") and "network" in node["metadata"]["annotations"]["logdx.io/avoid-reason"]
    # Three times: exclude, a cordon through the usual path (budget, breaker), the avoid taint kept.
    clock.t += 2 * HOUR
    [rec] = actions.apply("job-3", network("node-17", "job-3"))
    assert (rec.action, rec.outcome) == ("cordon", "ok") and "graded exclude" in rec.detail
    assert "exclude_after: 3" in rec.detail
    assert node["spec"]["unschedulable"] is True and AVOID in node["spec"]["taints"]
    assert actions.cordoned_recently() == ["node-17"]
    info = actions.nodes.get("node-17")
    assert info is not None and info.grade is not None and info.state == "cordoned" and info.avoided
    assert info.grade.grade == "exclude" and [b.job_id for b in info.grade.counted] == ["job-1", "job-2", "job-3"]
    # A person's all-clear lifts the cordon, not the grade: the avoid taint stays.
    assert actions.uncordon("node-17", "alice", "reseated the HCA").outcome == "ok"
    assert not node["spec"]["unschedulable"] and AVOID in node["spec"]["taints"]
    # Healthy jobs on the node: 20 h, then 5 h more (decay_s 24 h): exclude -> avoid, the taint stays.
    clock.t += HOUR
    assert actions.credit("ok-1", healthy(), ["node-17", "node-18"], 20 * HOUR) == []
    assert actions.nodes.grade("node-17").grade == "exclude"
    assert actions.credit("ok-2", healthy(), ["node-17"], 5 * HOUR) == []
    g = actions.nodes.grade("node-17")
    assert g.grade == "avoid" and [b.job_id for b in g.forgiven] == ["job-1"]
    assert AVOID in node["spec"]["taints"]
    # Once per job: the same healthy job again is no more evidence.
    assert actions.credit("ok-2", healthy(), ["node-17"], 5 * HOUR) == []
    assert actions.nodes.grade("node-17").credit_s == HOUR
    # A failed or unknown report is no evidence of health.
    assert actions.credit("bad", network("node-17", "bad"), ["node-17"], 48 * HOUR) == []
    # avoid -> suspect: the taint is lifted (audited), the node's own taints kept.
    [lift] = actions.credit("ok-3", healthy(), ["node-17"], 23 * HOUR)
    assert (lift.action, lift.node, lift.outcome, lift.job_id) == ("unavoid", "node-17", "ok", "ok-3")
    assert "grade now suspect" in lift.detail
    assert AVOID not in node["spec"]["taints"] and any(t["key"] == "nvidia.com/gpu" for t in node["spec"]["taints"])
    assert "logdx.io/avoid-reason" not in node["metadata"]["annotations"]
    assert rows(actions, "node-17") == [("job-2", "avoid", "ok"), ("job-3", "cordon", "ok"),
                                        ("alice", "uncordon", "ok"), ("ok-3", "unavoid", "ok")]


def test_different_families_or_blames_far_apart_stay_suspect_and_touch_nothing(db, kube):
    clock = Clock()
    actions = kube_actions(db, kube, clock)
    storage = dict(failure_type="storage_error")
    assert actions.apply("job-1", network("node-18", "job-1")) == []
    clock.t += HOUR
    assert actions.apply("job-2", network("node-18", "job-2", **storage)) == []
    clock.t += 8 * 24 * HOUR  # beyond the default window (7 d) of the first network blame
    assert actions.apply("job-3", network("node-18", "job-3")) == []
    assert patched(kube, "node-18") == 0 and actions.audit() == []
    g = actions.nodes.grade("node-18")
    assert g.grade == "suspect" and len(g.live) == 3
    # A time limit blames no node, whatever it says.
    assert actions.apply("job-4", network("node-18", "job-4", failure_type="time_limit")) == []
    # One report acted on under two job ids (`diagnose` stored it, an agent acts on it) is one blame.
    once = network("node-17", "job-5")
    assert actions.apply("job-5", once) == [] and actions.apply("agent:job-5", once) == []
    assert actions.nodes.grade("node-17").grade == "suspect" and patched(kube, "node-17") == 0


def test_a_grade_never_stands_in_for_confidence_evidence_or_trust(db, kube):
    clock = Clock()
    actions = kube_actions(db, kube, clock)
    for i in range(2):
        actions.apply(f"job-{i}", network("node-19", f"job-{i}", confidence=0.5))
        clock.t += HOUR
    # The second blame would avoid, the third exclude: too unsure, both skipped and audited.
    out = actions.apply("job-2", network("node-19", "job-2", confidence=0.5))
    assert [(r.action, r.outcome) for r in out] == [("cordon", "skipped"), ("avoid", "skipped")]
    assert [(r.job_id, r.action) for r in actions.audit()] == [("job-1", "avoid"), ("job-2", "cordon"), ("job-2", "avoid")]
    assert all("below actions.min_confidence" in r.detail for r in actions.audit())
    assert actions.nodes.grade("node-19").grade == "exclude"  # the grade says so; the evidence does not suffice
    # A verdict no rule or catalog entry chose: counted, never acted on.
    for j in range(3):
        actions.apply(f"llm-{j}", network("node-20", f"llm-{j}", decided_by="llm"))
    assert actions.nodes.grade("node-20").grade == "exclude"
    avoids = [r for r in actions.audit() if r.node == "node-20"]
    assert [r.outcome for r in avoids] == ["skipped", "skipped"] and all("learned verdict" in r.detail for r in avoids)
    # A host only a claim named: its history is not even written.
    claim = Culprits(hosts=["node-18"], ranks=[3], corroborated=True, verified=False, basis="the root line's own host")
    for j in range(3):
        actions.apply(f"claim-{j}", network("node-18", f"claim-{j}", culprits=claim))
    assert actions.nodes.grade("node-18").grade == "ok"
    assert patched(kube, "node-18") == patched(kube, "node-19") == patched(kube, "node-20") == 0


def test_an_exclude_refused_by_the_open_breaker_or_the_spent_budget_is_audited_refused_and_not_done(db, kube):
    clock = Clock()
    actions = kube_actions(db, kube, clock, max_cordons=1)
    # The budget: one cordon per hour, spent on node-20 (a GPU off the bus).
    assert [r.outcome for r in actions.apply("gpu-1", failed_report(hosts=("node-20",)))] == ["ok"]
    for i in range(2):
        actions.apply(f"job-{i}", network("node-17", f"job-{i}"))
    [cordon] = actions.apply("job-2", network("node-17", "job-2"))
    assert (cordon.action, cordon.node, cordon.outcome) == ("cordon", "node-17", "refused")
    assert "safety limit" in cordon.detail and "max_cordons=1" in cordon.detail
    node = kube.nodes["node-17"]
    assert not node["spec"].get("unschedulable") and AVOID in node["spec"]["taints"]  # avoided since job-1
    # The breaker, opened by a person's decision or by a trip: an exclude is refused, and so is an avoid.
    actions.nodes.set_breaker("open", "too many cordons", "logdx")
    clock.t += 2 * HOUR  # the budget's window is over: only the breaker binds now
    for i in range(2):
        actions.apply(f"k-{i}", network("node-18", f"k-{i}"))
    [avoid] = [r for r in actions.audit() if r.node == "node-18"]
    assert (avoid.job_id, avoid.action, avoid.outcome) == ("k-1", "avoid", "refused")
    assert "circuit breaker open" in avoid.detail
    cordons = actions.apply("k-2", network("node-18", "k-2"))
    assert [(r.action, r.outcome) for r in cordons] == [("cordon", "refused"), ("avoid", "refused")]
    assert all("circuit breaker open" in r.detail for r in cordons)
    assert patched(kube, "node-18") == 0
    # A person resets the breaker: the next exclude-grade blame is cordoned.
    actions.reset_breaker("alice", "checked the fabric")
    [ok] = actions.apply("k-3", network("node-18", "k-3"))
    assert (ok.action, ok.outcome) == ("cordon", "ok") and "blamed 4 times" in ok.detail
    assert kube.nodes["node-18"]["spec"]["unschedulable"] is True


def test_dry_run_grades_audit_what_would_be_done_and_change_nothing(db, kube):
    clock = Clock()
    actions = kube_actions(db, kube, clock, dry_run=True)
    out = [actions.apply(f"job-{i}", network("node-17", f"job-{i}")) for i in range(3)]
    assert out[0] == []
    assert [(r.action, r.outcome) for r in out[1]] == [("avoid", "dry_run")]
    assert "would PATCH node node-17: taint logdx.io/avoid=network:PreferNoSchedule" in out[1][0].detail
    assert [(r.action, r.outcome) for r in out[2]] == [("cordon", "dry_run")]
    assert patched(kube, "node-17") == 0 and not actions.nodes.get("node-17").avoided  # type: ignore[union-attr]


def test_a_false_alarm_takes_its_blame_out_of_the_grade_and_lifts_the_avoid_mark(db, kube):
    clock = Clock()
    actions = kube_actions(db, kube, clock)
    first, second = network("node-17", "job-1"), network("node-17", "job-2")
    actions.apply("job-1", first)
    [avoid] = actions.apply("job-2", second)
    assert avoid.outcome == "ok" and AVOID in kube.nodes["node-17"]["spec"]["taints"]
    nodes, [lift] = actions.withdraw(second.id)
    assert nodes == ["node-17"] and (lift.action, lift.outcome, lift.job_id) == ("unavoid", "ok", f"false-alarm:{second.id}")
    assert AVOID not in kube.nodes["node-17"]["spec"]["taints"]
    g = actions.nodes.grade("node-17")
    assert g.grade == "suspect" and [b.job_id for b in g.live] == ["job-1"]
    # The withdrawn blame no longer counts: one more is an avoid again, not an exclude.
    clock.t += HOUR
    [again] = actions.apply("job-3", network("node-17", "job-3"))
    assert (again.action, again.outcome) == ("avoid", "ok") and "blamed 2 times" in again.detail


# -- Slurm -----------------------------------------------------------------------------------------


def test_slurm_avoid_raises_the_weight_exclude_drains_and_decay_restores_the_weight(db, scontrol):
    clock = Clock()
    s = ActionsSettings(actuator="slurm", dry_run=False, cluster_size=20, grades={"decay_s": 10 * HOUR})
    actions = Actions(db, s, clock=clock)
    assert actions.apply("101", network("gpu-07", "101")) == [] and scontrol() == []
    clock.t += HOUR
    [avoid] = actions.apply("102", network("gpu-07", "102"))
    assert (avoid.action, avoid.outcome) == ("avoid", "ok") and "(was Weight=7)" in avoid.detail
    assert scontrol() == [["show", "node", "-o", "gpu-07"], ["update", "NodeName=gpu-07", "Weight=1000000"]]
    clock.t += HOUR
    [drain] = actions.apply("103", network("gpu-07", "103"))
    assert (drain.action, drain.outcome) == ("cordon", "ok")
    assert scontrol()[-1] == ["update", "NodeName=gpu-07", "State=DRAIN", "Reason=logdx: nccl_error 103"]
    actions.uncordon("gpu-07", "bob")
    assert scontrol()[-1] == ["update", "NodeName=gpu-07", "State=RESUME"]
    # 20 h of healthy jobs: exclude -> avoid -> suspect; the weight it had comes back.
    [lift] = actions.credit("201", healthy(), ["gpu-07"], 20 * HOUR)
    assert (lift.action, lift.outcome) == ("unavoid", "ok")
    assert scontrol()[-1] == ["update", "NodeName=gpu-07", "Weight=7"]
    assert actions.nodes.grade("gpu-07").grade == "suspect" and not actions.nodes.get("gpu-07").avoided  # type: ignore[union-attr]


def test_slurm_avoid_that_cannot_read_the_weight_is_a_failure_and_marks_nothing(db, tmp_path):
    broken = tmp_path / "scontrol"
    broken.write_text("#!/bin/sh\necho 'slurm_load_node error: Unable to contact slurm controller' >&2\nexit 1\n")
    broken.chmod(0o755)
    actions = Actions(db, ActionsSettings(actuator="slurm", dry_run=False, slurm={"scontrol": str(broken)}),
                      clock=Clock())
    actions.apply("1", network("gpu-07", "1"))
    [rec] = actions.apply("2", network("gpu-07", "2"))
    assert (rec.action, rec.outcome) == ("avoid", "failed") and "Unable to contact" in rec.detail
    assert actions.nodes.avoided(NodeName("gpu-07")) is None


# -- the faces: logdx run credits a healthy attempt's nodes, logdx nodes shows the grades ---------------


@pytest.mark.integration
def test_logdx_run_credits_a_healthy_attempts_nodes_and_logdx_nodes_shows_grade_and_reason(tmp_path, scontrol):
    import subprocess
    import time

    from logdx.store import open_db

    train = os.path.join(os.path.dirname(__file__), "fixtures", "run", "train.py")
    cfg = tmp_path / "logdx.yaml"
    cfg.write_text(f"store: {{path: {tmp_path / 'logdx.db'}}}\n"
                   "actions: {actuator: slurm, dry_run: false, cluster_size: 20, grades: {decay_s: 0.2}}\n")
    settings = dict(actuator="slurm", dry_run=False, cluster_size=20, grades={"decay_s": 0.2})
    db = open_db(tmp_path / "logdx.db")
    actions = Actions(db, ActionsSettings(**settings))
    actions.apply("old-1", network("gpu-node-03", "old-1"))
    [avoid] = actions.apply("old-2", network("gpu-node-03", "old-2"))
    db.close()
    assert avoid.outcome == "ok" and scontrol()[-1] == ["update", "NodeName=gpu-node-03", "Weight=1000000"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOGDX_")}
    env.update({"LOGDX_DATA_DIR": str(tmp_path), "NO_COLOR": "1"})

    def logdx(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "logdx", *args], capture_output=True, text=True, timeout=timeout,
                              env=env)

    listed = logdx("nodes", "--config", str(cfg))
    assert listed.returncode == 0, listed.stderr
    assert "avoid (avoided)" in listed.stdout
    assert "gpu-node-03: avoid: blamed 2 times for network" in listed.stdout and "nccl_error in job old-1" in listed.stdout
    assert "drops to suspect after" in listed.stdout
    time.sleep(0.1)  # the healthy attempt ends after the blames
    r = logdx("run", "--config", str(cfg), "--no-llm", "--no-retrieval", "--job-id", "good-1", "--", sys.executable,
              train, "--mode", "ok", "--steps", "30", "--state", str(tmp_path / "state"), timeout=90)
    assert r.returncode == 0, r.stderr
    assert "unavoid gpu-node-03: ok" in r.stderr
    assert scontrol()[-1] == ["update", "NodeName=gpu-node-03", "Weight=7"]
    shown = json.loads(logdx("nodes", "show", "gpu-node-03", "--config", str(cfg)).stdout)
    assert shown["avoided"] is False and shown["grade"]["grade"] == "ok"
    assert [b["job_id"] for b in shown["grade"]["forgiven"]] == ["old-1", "old-2"]
    listed = logdx("nodes", "--json", "--config", str(cfg))
    grades = {n["node"]: n["grade"]["grade"] for n in json.loads(listed.stdout)}
    assert grades["gpu-node-03"] == "ok" and grades["gpu-node-01"] == "ok"  # credited, never blamed


# -- logdx serve: GET /v1/nodes, and a healthy job's log earning its node's decay -------------------------


def _stamped(t0: float, steps: int, ranks: int = 8) -> list[str]:
    import time

    return [f"[{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(t0 + s * 10))},000] [rank{r}]: iteration {s:6d}/ 100000"
            " | lm loss: 2.5 |" for s in range(1, steps + 1) for r in range(ranks)]


def _fabric_failure(t0: float, host: str) -> list[str]:
    import time

    at = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t0 + 310))
    return [*_stamped(t0, 30),
            f"[{at},000] [rank3]: {host}:2231:2290 [3] NCCL WARN NET/IB : Got completion from peer 10.0.0.7<51234> "
            "with status=12 opcode=0 len=0 vendor err 129 (Recv)",
            "[rank3]: torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/"
            "ProcessGroupNCCL.cpp:1970, unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.18.1"]


@pytest.mark.integration
def test_serve_grades_a_repeat_offender_shows_it_in_v1_nodes_and_a_healthy_log_lifts_the_avoid_taint(tmp_path, kube):
    import time

    from api_server import LoopbackApp
    from logdx.config import Settings
    from logdx.pipeline import Engine
    from logdx.testing import wait_until

    settings = Settings.model_validate({
        "data_dir": str(tmp_path), "llm": {"enabled": False}, "retrieval": {"enabled": False},
        "server": {"early_diagnosis_delay_s": 3600},
        "actions": {"dry_run": False, "actuator": "kubernetes", "kubernetes": {"api": kube.url}, "cluster_size": 20,
                    "grades": {"decay_s": 120}}})
    t0 = time.time() - 3600
    with LoopbackApp(settings, Engine.create(settings)) as app, httpx_client(app.url) as c:
        def ship(job: str, lines: list[str], exit_code: int) -> None:
            r = c.post(f"/v1/jobs/{job}/logs", content=("\n".join(lines) + "\n").encode(),
                       headers={"x-logdx-host": "node-19"})
            assert r.status_code == 200, r.text
            assert c.post(f"/v1/jobs/{job}/end", json={"exit_code": exit_code}).status_code == 200

        def audit(action: str) -> list[dict]:
            """The audit rows of `action`, once none is still in progress."""
            rows = [a for a in c.get("/v1/actions", params={"limit": 100}).json()["audit"] if a["action"] == action]
            return [] if any(a["outcome"] == "pending" for a in rows) else rows

        ship("net-1", _fabric_failure(t0, "node-19"), 1)
        ship("net-2", _fabric_failure(t0 + 600, "node-19"), 1)
        [avoid] = wait_until(lambda: audit("avoid") or None, "the avoid")
        assert (avoid["node"], avoid["outcome"], avoid["job_id"]) == ("node-19", "ok", "net-2")
        assert AVOID in kube.nodes["node-19"]["spec"]["taints"] and not kube.nodes["node-19"]["spec"].get("unschedulable")
        [node] = c.get("/v1/nodes", params={"blamed_only": True}).json()["nodes"]
        assert node["node"] == "node-19" and node["avoided"] is True
        grade = node["grade"]
        assert (grade["grade"], grade["family"], [b["job_id"] for b in grade["counted"]]) == \
            ("avoid", "network", ["net-1", "net-2"])
        assert grade["decay_due_s"] == 120 and "blamed 2 times for network" in grade["reason"]
        assert c.get("/v1/nodes/node-19").json()["grade"]["grade"] == "avoid"
        # A healthy job on the node, 290 s by its own stamps (decay_s 120: two steps): the taint goes.
        ship("good-1", [*_stamped(t0 + 1200, 30), "[rank0]: [after training is done] datetime: 2024-06-03 10:05:00"], 0)
        [lift] = wait_until(lambda: audit("unavoid") or None, "the unavoid")
        assert (lift["node"], lift["outcome"], lift["job_id"]) == ("node-19", "ok", "good-1")
        assert AVOID not in kube.nodes["node-19"]["spec"]["taints"]
        node = c.get("/v1/nodes/node-19").json()
        assert node["grade"]["grade"] == "ok" and node["avoided"] is False
        assert [b["job_id"] for b in node["grade"]["forgiven"]] == ["net-1", "net-2"]


def httpx_client(url: str):
    import httpx

    return httpx.Client(base_url=url, timeout=30)
