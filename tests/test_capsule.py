"""The evidence capsule written before a node is touched (issue 32 item 4): the real `logdx run` on a
generated Xid 79 job with a stand-in `scontrol` on PATH (recording its calls), the fake Kubernetes API
server, a real collector script; `diagnose CAPSULE/` is the real CLI in a subprocess."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from logdx.act.actions import Actions
from logdx.act.capsule import MANIFEST, CapsuleWriter, run_bounded, verify
from logdx.config import ActionsSettings, CapsuleSettings
from logdx.store import open_db
from logdx.testing import failed_report

PY = sys.executable


def _synth(path: Path, ranks: int, lines: int, seed: int = 7) -> dict:
    truth = path.with_suffix(".truth.json")
    subprocess.run([PY, "-m", "logdx.synth", "--scenario", "xid79", "--ranks", str(ranks), "--lines", str(lines),
                    "--seed", str(seed), "-o", str(path), "--truth", str(truth)], check=True, capture_output=True)
    return json.loads(truth.read_text())


@pytest.fixture
def scontrol(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    calls = tmp_path / "scontrol-calls.jsonl"
    script = bindir / "scontrol"
    script.write_text(f"#!{PY}\nimport json, sys\nopen({str(calls)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)

    def read():
        return [json.loads(x) for x in calls.read_text().splitlines()] if calls.exists() else []

    return bindir, read


def _collector(tmp_path: Path) -> Path:
    """A stand-in for `ssh {host} nvidia-bug-report.sh`: says which host it ran against, and when."""
    script = tmp_path / "bug-report"
    script.write_text(f"#!{PY}\nimport sys\nprint('nvidia-bug-report for', sys.argv[1])\nprint('GPU 0: fallen off the bus')\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def _logdx_run(tmp_path: Path, log: Path, bindir: Path, config: str, *opts: str) -> tuple[dict, str]:
    cfg = tmp_path / "logdx.yaml"
    cfg.write_text(f"store: {{path: {tmp_path / 'logdx.db'}}}\n{config}")
    history = tmp_path / "history.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOGDX_")}
    env.update({"LOGDX_DATA_DIR": str(tmp_path / "data"), "NO_COLOR": "1",
                "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"})
    p = subprocess.run([PY, "-m", "logdx", "run", "--no-llm", "--no-retrieval", "--config", str(cfg),
                        "--json-history", str(history), "--max-restarts", "0", "--root-cause-grace", "1",
                        "--kill-grace", "2", "--job-id", "xid-demo", *opts, "--",
                        PY, "-c", f"import shutil, sys; shutil.copyfileobj(open({str(log)!r}), sys.stdout); sys.exit(1)"],
                       capture_output=True, timeout=300, env=env)
    err = p.stderr.decode("utf-8", "replace")
    assert history.exists(), err
    return json.loads(history.read_text()), err


def _diagnose(folder: Path) -> dict:
    p = subprocess.run([PY, "-m", "logdx", "diagnose", str(folder), "--no-llm", "--no-retrieval", "--json", "--no-store"],
                       capture_output=True, timeout=300, env={**os.environ, "NO_COLOR": "1"})
    return json.loads(p.stdout)


def _capsule_of(record: dict) -> Path:
    detail = record["detail"]
    assert detail.startswith("sha256:"), detail
    return Path(detail.split(" at ", 1)[1].split(" (", 1)[0])


SLURM = "actions: {actuator: slurm, slurm: {scontrol: scontrol}, capsule: {collector: ['%s', '{host}']}}\n"


@pytest.mark.integration
def test_logdx_run_writes_the_capsule_before_the_drain_and_the_capsule_diagnoses_the_same(tmp_path, scontrol):
    bindir, calls = scontrol
    log = tmp_path / "job.log"
    truth = _synth(log, ranks=8, lines=20000)
    history, err = _logdx_run(tmp_path, log, bindir, SLURM % _collector(tmp_path), "--no-dry-run")
    [attempt] = history["attempts"]
    report = attempt["report"]
    culprit = report["culprits"]["hosts"]
    assert report["failure_type"] == "gpu_fell_off_bus" and culprit == truth["culprit_hosts"], err
    # The audit: the capsule's row, then the drain's.
    db = open_db(tmp_path / "logdx.db")
    audit = Actions(db, ActionsSettings(dry_run=False)).audit("xid-demo/attempt-1")
    db.close()
    assert [(a.action, a.node, a.outcome) for a in audit] == [("capsule", culprit[0], "ok"), ("cordon", culprit[0], "ok")]
    assert audit[0].id < audit[1].id and audit[0].ts <= audit[1].ts
    capsule = _capsule_of(audit[0].to_dict())
    digest = capsule.name
    # The drain's reason names the capsule; so does the alert's "what was done" (via the attempt's actions).
    assert calls() == [["update", f"NodeName={culprit[0]}", "State=DRAIN",
                        f"Reason=logdx: gpu_fell_off_bus xid-demo/attempt-1 capsule={digest[:16]}"]]
    assert f"evidence capsule sha256:{digest}" in audit[1].detail
    # Content-addressed and read-only.
    assert capsule.parent == tmp_path / "data" / "capsules"
    assert hashlib.sha256((capsule / MANIFEST).read_bytes()).hexdigest() == digest and verify(capsule) == []
    files = [p for p in capsule.rglob("*") if p.is_file()]
    assert files and all(not (p.stat().st_mode & 0o222) for p in files)
    assert not (capsule.stat().st_mode & 0o222)
    # What it holds: the report, the decision, every rank's lines around the root line, the kernel lines, the collector.
    kept = json.loads((capsule / ".capsule" / "report.json").read_text())
    assert kept["id"] == report["id"] and kept["root_cause"] == report["root_cause"]
    decision = json.loads((capsule / ".capsule" / "decision.json").read_text())
    assert decision["action"] == "cordon" and decision["nodes"] == culprit and decision["dry_run"] is False
    assert decision["actuator"] == "slurm" and decision["job_id"] == "xid-demo/attempt-1"
    kernel = (capsule / f"host={culprit[0]}.kernel.log").read_text()
    assert report["root_cause"]["text"] in kernel.splitlines()
    ranks = sorted(p.name for p in capsule.glob("rank-*.log"))
    assert ranks == sorted(f"rank-{r}.log" for r in range(8))
    for name in ranks:  # ±200 lines each: some before the root line, some after (every rank reported the failure)
        assert 1 < len((capsule / name).read_text().splitlines()) <= 400
    out = (capsule / ".capsule" / "collector" / f"{culprit[0]}.out").read_text()
    assert out.startswith(f"nvidia-bug-report for {culprit[0]}\n")
    assert json.loads((capsule / ".capsule" / "collector" / f"{culprit[0]}.json").read_text())["exit_code"] == 0
    # The capsule alone gives the verdict again.
    again = _diagnose(capsule)
    assert (again["category"], again["failure_type"], again["culprits"]["hosts"], again["action"]) == \
        (report["category"], report["failure_type"], culprit, report["action"])


@pytest.mark.integration
def test_the_capsule_stays_under_its_size_cap_on_a_long_wide_job(tmp_path, scontrol):
    bindir, calls = scontrol
    log = tmp_path / "job.log"
    truth = _synth(log, ranks=64, lines=120000, seed=3)
    cap = 256 * 1024
    history, err = _logdx_run(tmp_path, log, bindir, "actions: {actuator: slurm, slurm: {scontrol: scontrol}, "
                              f"capsule: {{max_bytes: {cap}, collector: ['{_collector(tmp_path)}', '{{host}}']}}}}\n")
    [attempt] = history["attempts"]
    capsule_row, cordon_row = attempt["actions"]
    assert capsule_row["action"] == "capsule" and capsule_row["outcome"] == "ok", err
    assert cordon_row["outcome"] == "dry_run" and calls() == []  # a dry run keeps the evidence too
    capsule = _capsule_of(capsule_row)
    size = sum(p.stat().st_size for p in capsule.rglob("*") if p.is_file())
    assert size <= cap
    manifest = json.loads((capsule / MANIFEST).read_text())
    assert manifest["left_out"], "64 ranks × 400 lines do not fit in 256 KiB: the manifest says what was left out"
    assert sum(f["bytes"] for f in manifest["files"].values()) + len((capsule / MANIFEST).read_bytes()) == size
    # What is nearest the root line stays: the culprit's kernel lines, the root line itself.
    [host] = truth["culprit_hosts"]
    # A dry run touches no node: the collector is not run, and the capsule says so.
    assert (capsule / ".capsule" / "collector" / f"{host}.out").read_bytes() == b""
    assert json.loads((capsule / ".capsule" / "collector" / f"{host}.json").read_text())["error"].startswith("dry run")
    assert attempt["report"]["root_cause"]["text"] in (capsule / f"host={host}.kernel.log").read_text()
    again = _diagnose(capsule)
    assert (again["failure_type"], again["culprits"]["hosts"]) == ("gpu_fell_off_bus", [host])


@pytest.mark.integration
def test_a_cordon_whose_capsule_cannot_be_written_is_refused_unless_the_operator_allows_it(tmp_path, scontrol):
    bindir, calls = scontrol
    log = tmp_path / "job.log"
    _synth(log, ranks=4, lines=4000)
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the capsules should go\n")
    config = f"actions: {{actuator: slurm, slurm: {{scontrol: scontrol}}, capsule: {{dir: {blocked}%s}}}}\n"
    history, err = _logdx_run(tmp_path, log, bindir, config % "", "--no-dry-run")
    [attempt] = history["attempts"]
    capsule_row, cordon_row = attempt["actions"]
    assert (capsule_row["action"], capsule_row["outcome"]) == ("capsule", "failed"), err
    assert capsule_row["detail"].startswith("evidence capsule not written:")
    assert cordon_row["outcome"] == "refused" and "actions.capsule.act_without is false" in cordon_row["detail"]
    assert calls() == []
    assert any(n.startswith("evidence capsule not written") and "no cordon without it" in n
               for n in attempt["report"]["notes"])
    # The operator allows it: drained, and the audit and the notes say the evidence is missing.
    (tmp_path / "logdx.db").unlink()
    history, err = _logdx_run(tmp_path, log, bindir, config % ", act_without: true", "--no-dry-run")
    capsule_row, cordon_row = history["attempts"][0]["actions"]
    assert capsule_row["outcome"] == "failed" and cordon_row["outcome"] == "ok", err
    assert "without an evidence capsule" in cordon_row["detail"]
    [call] = calls()
    assert "capsule=" not in call[3]
    assert any("cordoned without it" in n for n in history["attempts"][0]["report"]["notes"])


def test_the_kubernetes_cordon_annotates_the_node_with_the_capsule_and_uncordon_removes_it(tmp_path, receiver):
    settings = ActionsSettings(dry_run=False, actuator="kubernetes",
                               capsule=CapsuleSettings(dir=tmp_path / "capsules"))
    with receiver.FakeKube(nodes=["node-17", "node-18"]) as kube:
        settings.kubernetes.api = kube.url
        db = open_db(tmp_path / "logdx.db")
        actions = Actions(db, settings, capsules=CapsuleWriter(settings.capsule))
        capsule_row, cordon_row = actions.apply("job-1", failed_report(hosts=("node-17",)))
        assert (capsule_row.action, capsule_row.outcome, cordon_row.outcome) == ("capsule", "ok", "ok")
        digest = _capsule_of(capsule_row.to_dict()).name
        annotations = kube.nodes["node-17"]["metadata"]["annotations"]
        assert annotations["logdx.io/capsule"] == f"sha256:{digest}"
        # Without the job's lines (the report alone), the capsule still holds the root line and the report.
        capsule = tmp_path / "capsules" / digest
        assert verify(capsule) == [] and (capsule / ".capsule" / "report.json").is_file()
        assert actions.uncordon("node-17", "carol").outcome == "ok"
        assert "logdx.io/capsule" not in kube.nodes["node-17"]["metadata"]["annotations"]
        # The same diagnosis again: the same rows, nothing written or patched twice.
        assert [r.id for r in actions.apply("job-1", failed_report(hosts=("node-17",)))] == \
            [capsule_row.id, cordon_row.id]
        db.close()


@pytest.mark.integration
def test_the_collector_is_bounded_in_time_and_output(tmp_path):
    chatty = [PY, "-c", "import sys, time\nsys.stdout.write('x' * 100000)\nsys.stdout.flush()\ntime.sleep(30)"]
    out, note = run_bounded(chatty, timeout_s=1.0, max_bytes=1000)
    assert out == b"x" * 1000 and note["bytes_dropped"] == 99000 and "truncated" in note
    assert note["exit_code"] is None and "timed out" in note["error"] and note["seconds"] < 10
    out, note = run_bounded([str(tmp_path / "no-such-collector")], timeout_s=1.0, max_bytes=1000)
    assert out == b"" and note["error"].startswith("cannot run")


def test_capsule_settings_refuse_a_collector_that_a_shell_would_parse():
    with pytest.raises(ValueError, match="placeholder"):
        CapsuleSettings(collector=["sh", "-c", "ssh {host} nvidia-bug-report.sh"])
    assert CapsuleSettings(collector=["ssh", "{host}", "nvidia-bug-report.sh"]).collector[1] == "{host}"


@pytest.mark.integration
def test_logdx_serve_writes_the_capsule_with_the_jobs_lines_before_the_kubernetes_cordon(tmp_path, receiver):
    from api_server import Server

    log = tmp_path / "job.log"
    truth = _synth(log, ranks=4, lines=6000)
    [host] = truth["culprit_hosts"]
    with receiver.FakeKube(nodes=[host, "node-99"]) as kube:
        srv = Server(tmp_path / "srv", extra={"actions": {"dry_run": False, "actuator": "kubernetes",
                                                          "kubernetes": {"api": kube.url}, "cluster_size": 20}}).start()
        try:
            with srv.client() as c:
                r = c.post("/v1/jobs/serve-1/logs", content=log.read_bytes(), headers={"x-logdx-stream": "stdout"})
                assert r.status_code == 200, r.text
                r = c.post("/v1/jobs/serve-1/end", json={"exit_code": 1})
                assert r.status_code == 200, r.text
                assert r.json()["culprits"]["hosts"] == [host]

                def rows() -> list[dict] | None:
                    audit = c.get("/v1/actions", params={"limit": 100}).json()["audit"]
                    done = [a for a in audit if a["job_id"] == "serve-1"]
                    return done if any(a["action"] == "cordon" and a["outcome"] != "pending" for a in done) else None

                deadline = time.monotonic() + 120
                while (audit := rows()) is None and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert audit is not None
                page = c.get("/jobs/serve-1")
        finally:
            srv.stop()
        assert [(a["action"], a["node"], a["outcome"]) for a in audit] == [("capsule", host, "ok"), ("cordon", host, "ok")]
        capsule = _capsule_of(audit[0])
        assert kube.nodes[host]["metadata"]["annotations"]["logdx.io/capsule"] == f"sha256:{capsule.name}"
    assert verify(capsule) == [] and sorted(p.name for p in capsule.glob("rank-*.log")) == [f"rank-{i}.log" for i in range(4)]
    assert page.status_code == 200 and capsule.name in page.text  # the job page lists it with the actions
    again = _diagnose(capsule)
    assert (again["failure_type"], again["culprits"]["hosts"]) == ("gpu_fell_off_bus", [host])


def test_a_process_stopped_between_the_capsule_and_the_cordon_cordons_on_the_next_try(tmp_path, receiver):
    from logdx.act.actions import action_key
    from logdx.act.actuators import NodeName

    settings = ActionsSettings(dry_run=False, actuator="kubernetes", capsule=CapsuleSettings(dir=tmp_path / "capsules"))
    report = failed_report(hosts=("node-17",))
    with receiver.FakeKube(nodes=["node-17"]) as kube:
        settings.kubernetes.api = kube.url
        db = open_db(tmp_path / "logdx.db")
        first = Actions(db, settings, capsules=CapsuleWriter(settings.capsule))
        # What a process that stopped right after auditing the capsule left behind: its row, no cordon.
        key = action_key("job-1", report, dry_run=False)
        written, _, _ = first._capsule(key, "job-1", [NodeName("node-17")], report, "", None)
        assert kube.nodes["node-17"]["spec"].get("unschedulable") is not True
        again = Actions(db, settings, capsules=CapsuleWriter(settings.capsule)).apply("job-1", report)
        assert [(r.action, r.outcome) for r in again] == [("capsule", "ok"), ("cordon", "ok")]
        assert again[0].id == written.id  # the same capsule stands: written once
        digest = _capsule_of(written.to_dict()).name
        assert kube.nodes["node-17"]["metadata"]["annotations"]["logdx.io/capsule"] == f"sha256:{digest}"
        db.close()


def test_capsules_older_than_their_retention_go(tmp_path):
    from logdx.act.capsule import expire_capsules

    writer = CapsuleWriter(CapsuleSettings(dir=tmp_path / "capsules"))
    old = writer.write("job-1", failed_report(hosts=("node-17",)), {"action": "cordon"}, ["node-17"], None)
    new = writer.write("job-2", failed_report(hosts=("node-18",)), {"action": "cordon"}, ["node-18"], None)
    assert old.digest != new.digest
    os.utime(old.path / MANIFEST, (1_000_000.0, 1_000_000.0))
    stale = tmp_path / "capsules" / ".tmp-crashed"  # a write a crash left unfinished
    stale.mkdir()
    os.utime(stale, (1_000_000.0, 1_000_000.0))
    assert expire_capsules(tmp_path / "capsules", cutoff=2_000_000.0) == 1
    assert not old.path.exists() and not stale.exists() and verify(new.path) == []


def test_each_stream_file_is_named_so_the_folder_reader_gives_it_its_rank_or_host(tmp_path, engine):
    from logdx.act.capsule import Evidence
    from logdx.config import InputSettings
    from logdx.jobinput import collect
    from logdx.normalize import Source

    session = engine.new_session()
    recorder = session.record_evidence(context_lines=50, max_sources=64, near_s=600)
    lines = [
        (Source(host="gpu-node-03", rank=None), "[rank5]: step 10 loss 2.1"),
        (Source(host="gpu-node-03", rank=None), "Jun 30 14:14:40 gpu-node-03 kernel: NVRM: Xid (PCI:0000:87:00): 79, "
                                                "pid=11, name=python, GPU has fallen off the bus."),
        (Source(host="gpu-node-03", rank=None), "kubelet: container restarted"),
        (None, "srun: error: task 3 launch failed"),
    ]
    for source, line in lines:
        session.feed(line, source)
    report = session.report(exit_code=1)
    capsule = CapsuleWriter(CapsuleSettings(dir=tmp_path / "capsules")).write(
        "job-1", report, {"action": "cordon"}, ["gpu-node-03"], Evidence(recorder=recorder))
    found = collect([str(capsule.path)], InputSettings())
    files = {f.shown.removeprefix(str(capsule.path) + "/"): (f.host, f.rank) for f in found}
    assert files == {"rank-5.log": (None, 5), "host=gpu-node-03.kernel.log": ("gpu-node-03", None),
                     "host=gpu-node-03.log": ("gpu-node-03", None), "job.log": (None, None)}
    assert "Xid" in (capsule.path / "host=gpu-node-03.kernel.log").read_text()
    assert "Xid" not in (capsule.path / "host=gpu-node-03.log").read_text()  # each line once


def test_a_session_snapshot_leaves_the_rings_behind_and_the_restored_session_records_again(engine):
    from logdx.pipeline import Session

    session = engine.new_session()
    session.record_evidence(context_lines=50, max_sources=64, near_s=600)
    for i in range(5000):
        session.feed(f"[rank{i % 8}]: iteration {i} | lm loss: 2.{i % 10} | padding {'x' * 100}")
    restored = Session.restore(engine, session.snapshot())
    assert restored.recorder is not None and restored.recorder.tails == {} and restored.recorder.context_lines == 50
    restored.feed("[rank3]: iteration 5000 | lm loss: 2.0")
    assert [r.text for r in restored.recorder.tails["r3"]] == ["iteration 5000 | lm loss: 2.0"]


def test_the_avoid_taint_of_a_repeat_offender_comes_after_its_capsule_too(tmp_path, receiver):
    from logdx.act.report import Culprits, RootCause

    def network(job: str):
        text = f"node-17:2231:2290 [3] NCCL WARN NET/IB : Got completion from peer 10.0.0.7 with error 12 ({job})"
        return failed_report(hosts=("node-17",), failure_type="nccl_error", action="restart", confidence=0.95,
                             culprits=Culprits(hosts=["node-17"], ranks=[3], corroborated=True, basis="its own line"),
                             root_cause=RootCause(line_no=40, text=text, rank=3, host="node-17"))

    settings = ActionsSettings(dry_run=False, actuator="kubernetes", cluster_size=20,
                               capsule=CapsuleSettings(dir=tmp_path / "capsules"))
    with receiver.FakeKube(nodes=["node-17"]) as kube:
        settings.kubernetes.api = kube.url
        db = open_db(tmp_path / "logdx.db")
        actions = Actions(db, settings, capsules=CapsuleWriter(settings.capsule))
        assert actions.apply("job-1", network("job-1")) == []  # suspect: nothing touched, nothing kept
        capsule_row, avoid_row = actions.apply("job-2", network("job-2"))
        assert (capsule_row.action, capsule_row.outcome, avoid_row.action, avoid_row.outcome) == \
            ("capsule", "ok", "avoid", "ok")
        capsule = _capsule_of(capsule_row.to_dict())
        decision = json.loads((capsule / ".capsule" / "decision.json").read_text())
        assert decision["action"] == "avoid" and "PreferNoSchedule" in decision["would"][0]
        assert any(t["key"] == "logdx.io/avoid" for t in kube.nodes["node-17"]["spec"]["taints"])
        db.close()
