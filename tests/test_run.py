"""`logdx run -- CMD`: real child processes (tests/fixtures/run/train.py prints torchrun-style
multi-rank logs and fails in a chosen way), real signals, a stand-in `scontrol` on PATH and a real
HTTP receiver for alerts. Category assertions stay at infrastructure-vs-not where the exact
failure type is the rule pack's business; the important ones (CUDA OOM, SyntaxError) are exact."""

from __future__ import annotations

import base64
import json
import os
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from logdx.run import CheckpointTracker, fill_template

FIXTURES = Path(__file__).parent / "fixtures" / "run"
TRAIN = FIXTURES / "train.py"
PY = sys.executable




LOGDX_RUN = [PY, "-m", "logdx", "run"]


@dataclass
class Result:
    code: int
    stdout: bytes
    stderr: bytes
    history: dict | None
    launches: list[dict]  # what each launch of the fixture saw (argv, env, start time)

    @property
    def attempts(self) -> list[dict]:
        return self.history["attempts"] if self.history else []

    @property
    def err(self) -> str:
        return self.stderr.decode("utf-8", "replace")


def _env(tmp_path: Path, extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOGDX_")}
    env.update({"LOGDX_DATA_DIR": str(tmp_path), "NO_COLOR": "1"})
    env.update(extra or {})
    return env


def _cmd(tmp_path: Path, mode: str, opts=(), fixture_args=()) -> list[str]:
    return [
        *LOGDX_RUN, "--no-llm", "--no-retrieval", "--json-history", str(tmp_path / "history.json"),
        "--kill-grace", "2", "--backoff", "0.2", *opts,
        "--", PY, str(TRAIN), "--mode", mode, "--state", str(tmp_path / "state"), *fixture_args,
    ]


def _result(tmp_path: Path, code: int, out: bytes, err: bytes) -> Result:
    hist = tmp_path / "history.json"
    launches_file = tmp_path / "state" / "attempts.jsonl"
    launches = [json.loads(x) for x in launches_file.read_text().splitlines()] if launches_file.exists() else []
    return Result(code, out, err, json.loads(hist.read_text()) if hist.exists() else None, launches)


def run(tmp_path: Path, mode: str, *opts: str, fixture_args=(), env=None, timeout: float = 90) -> Result:
    p = subprocess.run(_cmd(tmp_path, mode, opts, fixture_args), capture_output=True, timeout=timeout,
                       env=_env(tmp_path, env))
    return _result(tmp_path, p.returncode, p.stdout, p.stderr)


def category(attempt: dict) -> str | None:
    return attempt["report"]["category"] if attempt["report"] else None


# -- pass-through -----------------------------------------------------------------------------------


def test_output_passes_through_byte_for_byte(tmp_path):
    direct = subprocess.run([PY, str(TRAIN), "--mode", "binary", "--state", str(tmp_path / "direct")],
                            capture_output=True, timeout=60)
    assert direct.returncode == 0 and len(direct.stdout) > 200_000
    r = run(tmp_path, "binary")
    assert r.code == 0, r.err
    assert r.stdout == direct.stdout  # invalid UTF-8, NUL, CR, ANSI, a 200 kB line, no final newline
    assert r.stderr.startswith(direct.stderr)  # logdx's own words come after, on stderr only
    [a] = r.attempts
    assert a["trigger"] == "ok" and a["exit_code"] == 0
    assert a["report"]["compression"]["lines_in"] > 2000  # and the pipeline saw every line


def test_exit_code_is_the_childs_and_unknown_failures_are_not_restarted(tmp_path):
    r = run(tmp_path, "exit7")
    assert r.code == 7, r.err
    [a] = r.attempts
    assert a["trigger"] == "exit" and a["exit_code"] == 7
    assert len(r.launches) == 1


def test_a_command_that_cannot_start(tmp_path):
    p = subprocess.run([*LOGDX_RUN, "--no-llm", "--", str(tmp_path / "no-such-launcher")],
                       capture_output=True, timeout=60, env=_env(tmp_path))
    assert p.returncode == 127
    assert b"cannot run" in p.stderr


def test_usage_errors(tmp_path):
    for bad in (["--"], ["--restart-on", "everything", "--", "true"], ["--loss-trigger", "maybe", "--", "true"]):
        p = subprocess.run([*LOGDX_RUN, *bad], capture_output=True, timeout=60, env=_env(tmp_path))
        assert p.returncode == 2, bad
        assert b"error" in p.stderr


# -- infrastructure failures are restarted, without the node, from the checkpoint -------------------


def test_xid_then_hang_is_ended_and_restarted_without_the_node_from_the_checkpoint(tmp_path):
    r = run(
        tmp_path, "xid_hang", "--root-cause-grace", "0.5", "--backoff", "0.5",
        "--exclude-arg=--exclude={hosts}", "--resume-arg", "--load {checkpoint_dir}",
        fixture_args=["--fail-attempts", "1"],
    )
    assert r.code == 0, r.err
    first, second = r.attempts
    # The Xid rank's peers hang: the job is ended after the grace, not by itself.
    assert first["trigger"] == "root_cause" and first["exit_code"] == 128 + signal.SIGTERM
    assert category(first) == "infrastructure"
    assert first["report"]["culprits"]["hosts"] == ["gpu-node-02"]
    assert first["decision"].startswith("restart")
    assert first["checkpoint"]["checkpoint_dir"] == str(tmp_path / "state" / "ckpt")
    assert first["checkpoint"]["iteration"] == "5"
    # The second launch: node excluded (argument and env), resumed from the saved checkpoint.
    launch1, launch2 = r.launches
    assert launch1["env_exclude"] == "" and launch1["load"] is None
    assert launch2["env_exclude"] == "gpu-node-02"
    assert launch2["argv"][-3:] == ["--exclude=gpu-node-02", "--load", str(tmp_path / "state" / "ckpt")]
    assert launch2["env_attempt"] == "2"
    assert second["trigger"] == "ok" and second["excluded_hosts"] == ["gpu-node-02"]
    assert second["resumed_from"]["iteration"] == "5"
    # Backoff: the second launch started at least --backoff after the first attempt ended.
    assert launch2["start"] - first["ended_at"] >= 0.5
    # The history table at the end.
    assert "root_cause" in r.err and "gpu-node-02" in r.err and "attempt" in r.err


def test_max_restarts_and_exponential_backoff_hold(tmp_path):
    # A fabric error on rank 0 that no host printed itself: restarted (same node, progress each time),
    # never excluded (not corroborated), until --max-restarts.
    r = run(tmp_path, "ib", "--max-restarts", "2", "--backoff", "0.4")
    assert r.code == 1, r.err
    assert [a["trigger"] for a in r.attempts] == ["exit", "exit", "exit"]
    assert all(a["report"]["failure_type"] == "network_error" for a in r.attempts)
    assert len(r.launches) == 3
    assert [x["env_exclude"] for x in r.launches] == ["", "", ""]
    assert r.launches[1]["start"] - r.attempts[0]["ended_at"] >= 0.4
    assert r.launches[2]["start"] - r.attempts[1]["ended_at"] >= 0.8
    assert "max-restarts 2 reached" in r.attempts[-1]["decision"]
    assert r.history["exit_code"] == 1


def test_a_failure_that_follows_the_job_across_nodes_stops_the_restarts(tmp_path):
    # ECC on the job's second host, excluded; on the next launch ECC again, now on another host:
    # the job, not the nodes. Stop and hand it to the owner instead of draining the cluster node by node.
    r = run(tmp_path, "ecc", "--max-restarts", "5")
    assert r.code == 1, r.err
    first, second = r.attempts
    assert first["report"]["culprits"]["hosts"] == ["gpu-node-02"] and first["decision"].startswith("restart")
    assert second["report"]["culprits"]["hosts"] == ["gpu-node-03"]
    assert second["decision"].startswith("stop: ecc_error again, now on gpu-node-03 after gpu-node-02")
    assert [x["env_exclude"] for x in r.launches] == ["", "gpu-node-02"]


def test_an_attempt_without_progress_stops_the_restarts(tmp_path):
    r = run(tmp_path, "ib", "--max-restarts", "5", fixture_args=["--steps", "0"])
    assert r.code == 1, r.err
    assert len(r.attempts) == 2  # the first one may be a bad start; the second says it is no node's fault
    assert r.attempts[0]["progress_lines"] == 0
    assert r.attempts[1]["decision"] == "stop: no progress since the last attempt: handing the job to its owner"


def test_a_time_limit_is_resubmitted_from_the_checkpoint_and_excludes_nothing(tmp_path, scontrol, receiver):
    bindir, calls = scontrol
    with receiver.Receiver() as rx:
        r = run(tmp_path, "timelimit", "--config", str(_config(tmp_path, rx.url)), "--no-dry-run",
                "--exclude-arg=--exclude={hosts}", "--resume-arg", "--load {checkpoint_dir}",
                fixture_args=["--fail-attempts", "1"], env={"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"})
    assert r.code == 0, r.err
    first, second = r.attempts
    assert first["report"]["failure_type"] == "time_limit"
    assert first["decision"].startswith("restart") and "resubmit from the last checkpoint" in first["decision"]
    assert r.launches[1]["argv"][-2:] == ["--load", str(tmp_path / "state" / "ckpt")]
    assert r.launches[1]["env_exclude"] == "" and "--exclude" not in " ".join(r.launches[1]["argv"])
    assert calls() == []
    assert first["actions"] == [] and second["trigger"] == "ok"


def test_max_restarts_zero_never_restarts(tmp_path):
    r = run(tmp_path, "ecc", "--max-restarts", "0")
    assert r.code == 1 and len(r.launches) == 1, r.err


# -- framework and script failures stop with the report ---------------------------------------------


def test_cuda_oom_is_framework_and_not_restarted(tmp_path):
    r = run(tmp_path, "oom")
    assert r.code == 1, r.err
    [a] = r.attempts
    assert (a["report"]["category"], a["report"]["failure_type"]) == ("framework", "cuda_oom")
    assert a["decision"].startswith("stop")
    assert len(r.launches) == 1
    assert "cuda_oom" in r.err and "next" in r.err  # the report with its hint, on stderr


def test_syntax_error_is_script_and_not_restarted(tmp_path):
    script = tmp_path / "train_broken.py"  # written here: a syntax error in the repo would upset linters
    script.write_text('import os\n\ndef main(:\n    print("never runs")\n')
    p = subprocess.run([*LOGDX_RUN, "--no-llm", "--json-history", str(tmp_path / "h.json"), "--",
                        PY, str(script)], capture_output=True, timeout=60, env=_env(tmp_path))
    assert p.returncode == 1
    [a] = json.loads((tmp_path / "h.json").read_text())["attempts"]
    assert (a["report"]["category"], a["report"]["failure_type"]) == ("script", "syntax_error")
    assert b"SyntaxError" in p.stderr


def test_restart_on_widens_the_policy(tmp_path):
    r = run(tmp_path, "exit7", "--restart-on", "infrastructure,unknown", "--max-restarts", "1")
    assert r.code == 7 and len(r.launches) == 2, r.err


# -- hangs and divergence are ended -----------------------------------------------------------------


def test_nan_loss_ends_the_job(tmp_path):
    r = run(tmp_path, "nan")
    assert r.code == 128 + signal.SIGTERM, r.err
    [a] = r.attempts
    assert a["trigger"] == "loss_nan"
    assert category(a) == "framework"  # nan_loss: the owner's to fix, not restarted
    assert len(r.launches) == 1


def test_loss_spike_ends_the_job_unless_only_nan_is_watched(tmp_path):
    r = run(tmp_path, "spike", fixture_args=["--steps", "30"])
    assert r.code == 128 + signal.SIGTERM, r.err
    assert r.attempts[0]["trigger"] == "loss_spike"
    (tmp_path / "recovers").mkdir()
    r = run(tmp_path / "recovers", "spike_recovers", fixture_args=["--steps", "30"])
    assert r.code == 0, r.err  # a spike the loss came back from is a note, not a reason to kill a job
    assert r.attempts[0]["trigger"] == "ok"
    (tmp_path / "nan-only").mkdir()
    r = run(tmp_path / "nan-only", "spike", "--loss-trigger", "nan", fixture_args=["--steps", "30"])
    assert r.code == 0, r.err
    assert r.attempts[0]["trigger"] == "ok"


def test_silent_stall_ends_the_job(tmp_path):
    r = run(tmp_path, "stall", "--stall-timeout", "1.5")
    assert r.code == 128 + signal.SIGTERM, r.err
    a = r.attempts[0]
    assert a["trigger"] == "stall"
    assert a["duration_s"] >= 1.5
    assert "no training progress" in r.err


def test_stall_timeout_is_derived_from_the_step_time(tmp_path):
    # stall = max(stall_factor x median step interval, stall_min_s); small values for the test.
    r = run(tmp_path, "stall", fixture_args=["--step-time", "0.05"],
            env={"LOGDX_DETECT__STALL_MIN_S": "1.0", "LOGDX_DETECT__STALL_FACTOR": "5"})
    a = r.attempts[0]
    assert a["trigger"] == "stall", r.err
    assert "stall timeout 1 s" in r.err


def test_stall_in_a_timestamped_log_is_a_stall_event_for_the_pipeline(tmp_path):
    r = run(tmp_path, "stall", "--stall-timeout", "1", "--max-restarts", "0", fixture_args=["--timestamps"])
    a = r.attempts[0]
    assert a["trigger"] == "stall"
    assert a["event_counts"].get("stall") == 1


def test_a_slow_checkpoint_save_or_evaluation_does_not_kill_the_job(tmp_path):
    # Nothing is printed for 3 s while the checkpoint is written; the stall timeout is 1 s.
    r = run(tmp_path, "slow_save", "--stall-timeout", "1", fixture_args=["--pause", "3"])
    assert r.code == 0, r.err
    [a] = r.attempts
    assert a["trigger"] == "ok"
    assert [(p["what"], p["duration_s"] >= 2.5) for p in a["pauses"]] == [("checkpoint save", True)]
    (tmp_path / "eval").mkdir()
    r = run(tmp_path / "eval", "slow_eval", "--stall-timeout", "1", fixture_args=["--pause", "3"])
    assert r.code == 0, r.err
    evaluation = [p for p in r.attempts[0]["pauses"] if p["what"] == "evaluation"]
    assert len(evaluation) == 1 and evaluation[0]["duration_s"] >= 2.5


def test_a_save_longer_than_the_pause_limit_is_a_stall(tmp_path):
    r = run(tmp_path, "slow_save", "--stall-timeout", "1", "--pause-max", "1.5", fixture_args=["--pause", "30"])
    assert r.code == 128 + signal.SIGTERM, r.err
    [a] = r.attempts
    assert a["trigger"] == "stall" and "checkpoint save in progress" in a["trigger_detail"]
    assert "--pause-max 1.5" in a["trigger_detail"]


def test_a_root_cause_the_job_survives_does_not_end_it(tmp_path):
    # An application Xid while training goes on: progress after it, so no hang; the job finishes.
    # The grace (1 s) runs out while the job is still training (2 s of steps after the Xid).
    r = run(tmp_path, "xid_nonfatal", "--root-cause-grace", "1", fixture_args=["--step-time", "0.05"],
            env={"NONFATAL_STEPS": "40"})
    assert r.code == 0, r.err
    [a] = r.attempts
    assert a["trigger"] == "ok"


# -- signals ----------------------------------------------------------------------------------------


def _start(tmp_path: Path, mode: str, *opts: str) -> subprocess.Popen:
    return subprocess.Popen(_cmd(tmp_path, mode, opts), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=_env(tmp_path))


def _wait_for(path: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_ctrl_c_reaches_the_child_and_its_exit_code_is_ours(tmp_path):
    p = _start(tmp_path, "sigint")
    _wait_for(tmp_path / "state" / "ready")
    time.sleep(0.3)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert (tmp_path / "state" / "sigint-received").read_text() == str(int(signal.SIGINT))
    assert p.returncode == 42  # what the child's handler exited with
    r = _result(tmp_path, p.returncode, out, err)
    [a] = r.attempts
    assert a["trigger"] == "interrupted" and a["decision"].startswith("stop: interrupted: you stopped it")
    # The user's own Ctrl-C is no failure: said so, and not as a failed job's report ("ask who before resubmitting").
    assert "stopped by you (logdx received SIGINT, passed on to the job)" in err.decode()
    assert "ask who" not in err.decode() and "FAILED" not in err.decode()


def test_sigterm_is_forwarded_and_never_restarted(tmp_path):
    p = _start(tmp_path, "stall", "--restart-on", "infrastructure,framework,script,unknown")
    _wait_for(tmp_path / "state" / "attempts.jsonl")
    time.sleep(0.8)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM
    r = _result(tmp_path, p.returncode, out, err)
    assert len(r.launches) == 1
    assert r.attempts[0]["trigger"] == "interrupted"


def test_sigkill_of_logdx_run_leaves_no_process_of_the_job_behind(tmp_path):
    p = _start(tmp_path, "grandchild", "--kill-grace", "1")
    pids_file = tmp_path / "state" / "pids"
    _wait_for(pids_file)  # written whole, then renamed into place (fixtures/run/train.py)
    pids = [int(x) for x in pids_file.read_text().split()]
    assert len(pids) == 3 and all(_alive(pid) for pid in pids)
    p.kill()  # SIGKILL: no handler, no cleanup of its own
    p.communicate(timeout=30)
    deadline = time.monotonic() + 120
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [pid for pid in pids if _alive(pid)] == [], "the job outlived logdx run"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"  # a zombie has exited
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


# -- actions and alerts around a restart ------------------------------------------------------------


SECRET = "whsec_" + base64.b64encode(b"logdx-run-test-secret-24").decode()


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


def _config(tmp_path: Path, rx_url: str) -> Path:
    cfg = tmp_path / "logdx.yaml"
    cfg.write_text(
        f"store: {{path: {tmp_path / 'logdx.db'}}}\n"
        "actions: {actuator: slurm, slurm: {scontrol: scontrol}}\n"
        f"alerts: {{webhooks: [{{url: '{rx_url}/hook', secret: '{SECRET}'}}], backoff_initial_s: 0.1}}\n"
    )
    return cfg


def test_restart_drains_the_node_through_scontrol_and_alerts_once_per_failed_attempt(tmp_path, scontrol, receiver):
    from logdx.act.actions import Actions
    from logdx.act.alerts import verify
    from logdx.config import ActionsSettings
    from logdx.store import open_db

    bindir, calls = scontrol
    with receiver.Receiver() as rx:
        r = run(tmp_path, "ecc", "--config", str(_config(tmp_path, rx.url)), "--no-dry-run", "--job-id", "job-7",
                fixture_args=["--fail-attempts", "1"], env={"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"})
        assert r.code == 0, r.err
        reqs = rx.wait_for(2)
    first = r.attempts[0]
    # The evidence capsule first (tests/test_capsule.py), then the drain whose reason names it.
    assert [(x["action"], x["node"], x["outcome"]) for x in first["actions"]] == \
        [("capsule", "gpu-node-02", "ok"), ("cordon", "gpu-node-02", "ok")]
    digest = first["actions"][0]["detail"].removeprefix("sha256:")[:16]
    assert calls() == [["update", "NodeName=gpu-node-02", "State=DRAIN",
                        f"Reason=logdx: ecc_error job-7/attempt-1 capsule={digest}"]]
    # One alert about the failed attempt, saying what was done, then "resolved" when the job succeeded.
    assert len(reqs) == 2
    assert all(verify(SECRET, q.headers, q.body) for q in reqs)
    data = reqs[0].json()["data"]
    assert data["job_id"] == "job-7/attempt-1" and data["report"]["category"] == "infrastructure"
    assert data["done"][0].startswith(f"evidence capsule sha256:{digest}")
    assert data["done"][1].startswith("cordon gpu-node-02: done (ran: scontrol update NodeName=gpu-node-02")
    assert data["done"][2:] == ["excluded gpu-node-02 from the next launch",
                                "logdx run: restart in 0.2 s: infrastructure failure (ecc_error)"]
    resolved = reqs[1].json()
    assert resolved["type"] == "logdx.resolved" and resolved["data"]["job_id"] == "job-7/attempt-1"
    assert "succeeded on attempt 2" in resolved["data"]["resolved"]
    # The audit is in the store.
    db = open_db(tmp_path / "logdx.db")
    audit = Actions(db, ActionsSettings(dry_run=False)).audit("job-7/attempt-1")
    db.close()
    assert [(a.action, a.node, a.outcome, a.dry_run) for a in audit] == \
        [("capsule", "gpu-node-02", "ok", False), ("cordon", "gpu-node-02", "ok", False)]


def test_a_node_range_in_the_log_drains_nothing(tmp_path, scontrol, receiver):
    bindir, calls = scontrol
    with receiver.Receiver() as rx:
        r = run(tmp_path, "noderange", "--config", str(_config(tmp_path, rx.url)), "--no-dry-run",
                "--exclude-arg=--exclude={hosts}", "--max-restarts", "1",
                env={"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"})
        reqs = rx.wait_for(1)
    assert calls() == []  # no scontrol update NodeName=gpu[001-512]
    first = r.attempts[0]
    # The range is no host: a multi-host job whose node is unknown is restarted, nothing cordoned.
    assert first["report"]["failure_type"] == "node_failure" and first["report"]["culprits"]["hosts"] == []
    assert first["report"]["action"] == "restart" and first["actions"] == []
    assert all(x["env_exclude"] == "" and not any("gpu[" in w for w in x["argv"]) for x in r.launches)
    assert reqs[0].json()["data"]["done"] == [f"logdx run: {first['decision']}"]
    # A one-machine log: the line names 512 nodes, so the machine that printed it is not blamed either
    # (issue 20 point 5): no culprit, a restart, nothing cordoned.
    line = "srun: error: Node failure on gpu[001-512]"
    p = subprocess.run([*LOGDX_RUN, "--no-llm", "--no-retrieval", "--config", str(tmp_path / "logdx.yaml"),
                        "--no-dry-run", "--json-history", str(tmp_path / "one.json"), "--max-restarts", "0", "--",
                        PY, "-c", f"import sys; sys.stderr.write({line!r} + '\\n'); sys.exit(1)"],
                       capture_output=True, timeout=60,
                       env=_env(tmp_path, {"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}))
    [a] = json.loads((tmp_path / "one.json").read_text())["attempts"]
    assert a["report"]["action"] == "restart" and a["report"]["culprits"]["hosts"] == [], p.stderr
    assert not a["report"]["culprits"]["ranks"] and any("range, list or pattern" in n for n in a["report"]["notes"])
    assert not [x for x in a["actions"] if x["action"] == "cordon"]
    assert calls() == []


def test_actions_are_dry_run_by_default(tmp_path, scontrol, receiver):
    bindir, calls = scontrol
    with receiver.Receiver() as rx:
        r = run(tmp_path, "ecc", "--config", str(_config(tmp_path, rx.url)), fixture_args=["--fail-attempts", "1"],
                env={"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"})
    assert r.code == 0, r.err
    assert calls() == []
    capsule, rec = r.attempts[0]["actions"]
    assert capsule["action"] == "capsule" and capsule["outcome"] == "ok"  # evidence is kept in a dry run too
    assert rec["outcome"] == "dry_run" and rec["dry_run"] is True
    assert "scontrol update NodeName=gpu-node-02 State=DRAIN" in rec["detail"]
    # Excluded from the next launch all the same.
    assert r.launches[1]["env_exclude"] == "gpu-node-02"


# -- checkpoint lines -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lines, expected",
    [
        (["[rank0]:   successfully saved checkpoint at iteration    2000 to /ckpt/gpt-7b"],
         ("/ckpt/gpt-7b", "/ckpt/gpt-7b", 2000, "megatron")),
        (["  successfully saved checkpoint from iteration     100 to /data/ckpts [ t 1/2, p 1/1 ]"],
         ("/data/ckpts", "/data/ckpts", 100, "megatron")),
        (["[2024-05-01 10:00:00,000] [INFO] [logging.py:96:log_dist] [Rank 0] Saving model checkpoint: "
          "/out/ds/global_step300/mp_rank_00_model_states.pt",
          "[2024-05-01 10:00:02,000] [INFO] [torch_checkpoint_engine.py:33:commit] "
          "[Torch] Checkpoint global_step300 is ready now!"],
         ("/out/ds/global_step300", "/out/ds", 300, "deepspeed")),
        (["Epoch 0, global step 500: 'val_loss' reached 1.23400 (best 1.23400), saving model to "
          "'/lightning/ckpts/epoch=0-step=500.ckpt' as top 1"],
         ("/lightning/ckpts/epoch=0-step=500.ckpt", "/lightning/ckpts", 500, "lightning")),
        (["[INFO|trainer.py:3410] 2024-05-01 10:00:00,000 >> Saving model checkpoint to /out/hf/checkpoint-1500"],
         ("/out/hf/checkpoint-1500", "/out/hf/checkpoint-1500", 1500, "hf")),
    ],
)
def test_checkpoint_lines_of_common_frameworks(lines, expected):
    t = CheckpointTracker()
    for line in lines:
        assert CheckpointTracker.interesting(line.encode())
        t.feed(line)
    ck = t.last
    assert ck is not None
    assert (ck.checkpoint, ck.checkpoint_dir, ck.iteration, ck.framework) == expected


def test_a_save_that_did_not_finish_is_not_a_checkpoint():
    t = CheckpointTracker()
    t.feed("[Rank 0] Saving model checkpoint: /out/ds/global_step400/mp_rank_00_model_states.pt")
    assert t.last is None  # DeepSpeed has not said it is ready
    t.feed("saving checkpoint at iteration     100 to /ckpt")  # Megatron, before it succeeded
    assert t.last is None
    assert not CheckpointTracker.interesting(b"[rank0]: iteration 10 | lm loss: 2.3")


def test_templates_are_filled_word_by_word():
    assert fill_template("--exclude={hosts}", {"hosts": "a-1,b 2"}) == ["--exclude=a-1,b 2"]
    assert fill_template("--load {checkpoint_dir} --ckpt-step {iteration}",
                         {"checkpoint_dir": "/c d", "iteration": "5", "checkpoint": "/c d"}) == \
        ["--load", "/c d", "--ckpt-step", "5"]
    assert fill_template("--step {iteration}", {"iteration": ""}) is None
