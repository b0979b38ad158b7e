"""The cascade: a precise rule decides and no later stage overturns it; where the rules do not
decide, the catalog and the LLM fill in; a stage that fails is a note, never a lost report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llm_server import ChatServer
from logdx.config import load_settings
from logdx.diagnose.llm import make_llm
from logdx.incidents import Incident
from logdx.model import Action, Category
from logdx.pipeline import Engine

SCRIPT_BUG = [
    *[f"[rank{r}]: iteration {i} | loss 2.{i} | lr 1e-4" for i in range(3) for r in range(4)],
    "[rank2]: Traceback (most recent call last):",
    '[rank2]:   File "/workspace/train.py", line 146, in <module>',
    "[rank2]:     log_metrics(args.run_name)",
    "[rank2]: NameError: name 'args' is not defined",
]

VENDOR_ERROR = [
    "[rank0]: Traceback (most recent call last):",
    '[rank0]:   File "/workspace/train.py", line 212, in <module>',
    "[rank0]:     batch = next(stream)",
    '[rank0]:   File "/opt/conda/lib/python3.10/site-packages/weka_io/reader.py", line 88, in __next__',
    "[rank0]:     raise WekaStaleMountError(self.mount)",
    "[rank0]: weka_io.errors.WekaStaleMountError: mount /mnt/weka went stale: backend lost quorum",
]


# A past incident near the vendor error (retrieval off: handed to the LLM as its few-shot example, the near
# miss that proposes its label).
STALE_MOUNT = Incident("inc-stale", "OSError: [Errno 116] Stale file handle: '/mnt/lustre/data/shard-0007'",
                       "OSError: [Errno <*>] Stale file handle: <*>", [], Category.INFRASTRUCTURE, "storage_error",
                       Action.RESTART)


def engine_with(server: ChatServer | None = None, *, always: bool = False,
                near: tuple[Incident, ...] = ()) -> Engine:
    s = load_settings(env={})
    s.retrieval.enabled = False
    s.llm.enabled = False
    s.llm.always = always
    engine = Engine.create(s)
    if server is not None:
        llm_settings = s.llm.model_copy(update={"enabled": True, "backend": "openai", "base_url": server.base_url,
                                                "model": "test", "timeout_s": 5.0})
        engine.diagnoser.llm = make_llm(llm_settings, examples=lambda ctx, exclude: list(near))
    return engine


def diagnose(engine: Engine, lines: list[str]):
    session = engine.new_session()
    session.feed_lines(lines)
    return session.report(exit_code=1)


@pytest.fixture(scope="module")
def server():
    with ChatServer() as s:
        yield s


def answer(category: str, failure_type: str, action: str) -> str:
    return json.dumps({"category": category, "failure_type": failure_type, "action": action, "confidence": 0.99,
                       "root_line_no": 1, "explanation": "The node is broken, cordon it."})


def test_an_llm_that_says_anything_cannot_overturn_a_precise_rule(server):
    server.script[:] = [("reply", answer("infrastructure", "gpu_hardware_error", "cordon_and_restart"))]
    report = diagnose(engine_with(server, always=True), SCRIPT_BUG)
    assert (report.category, report.failure_type, report.action) == ("script", "name_error", "no_restart")
    assert report.culprits.hosts == []
    # Its label is one no evidence proposed: it abstains (and had it not, the precise rule would stand).
    assert any("llm abstains" in n or "the precise rule stands" in n for n in report.notes)


def test_where_the_rules_do_not_decide_the_llm_fills_in(server):
    server.script[:] = [("reply", answer("infrastructure", "storage_error", "restart"))]
    report = diagnose(engine_with(server, near=(STALE_MOUNT,)), VENDOR_ERROR)
    # The label is the model's; the action it implies is not: no rule or past incident says restart.
    assert (report.category, report.failure_type, report.action) == ("infrastructure", "storage_error", "no_restart")
    assert report.decided_by == "llm"
    assert any("llm proposed restart" in n and "no rule, catalog entry or past incident" in n for n in report.notes)
    assert report.root_cause.text.endswith("backend lost quorum")
    # Decided by a model against a generic fallback: not sure enough for any automatic action.
    assert report.confidence < 0.8


def test_the_catalog_names_the_library_of_an_error_printed_without_its_traceback():
    # No frame says where it was raised; the catalog knows the message: DeepSpeed's, a config problem.
    lines = ["deepspeed.runtime.zero.utils.ZeRORuntimeException: You are using ZeRO-Offload with a client provided "
             "optimizer (<class 'torch.optim.adamw.AdamW'>) which in most cases will yield poor performance. Please "
             "either use deepspeed.ops.adam.DeepSpeedCPUAdam or set an optimizer in your ds-config"]
    report = diagnose(engine_with(), lines)
    assert (report.category, report.failure_type) == ("framework", "config_error")
    assert any(e.source.startswith("catalog:") for e in report.evidence)


@pytest.mark.integration
def test_a_failing_stage_is_a_note_and_the_report_still_comes(tmp_path: Path):
    # faiss missing from the environment: retrieval cannot run; the rules' report must still come.
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "faiss.py").write_text("raise ImportError('faiss is not installed here')\n")
    log = tmp_path / "job.log"
    log.write_text("\n".join(VENDOR_ERROR) + "\n")
    env = {**os.environ, "PYTHONPATH": f"{shadow}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "LOGDX_DATA_DIR": str(tmp_path / "data"), "HF_HUB_OFFLINE": "1"}
    code = "import sys; from logdx.cli import diagnose_main; sys.exit(diagnose_main())"
    out = subprocess.run([sys.executable, "-c", code, str(log), "--json", "--no-llm"], capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["status"] == "failed" and report["root_cause"]["text"].endswith("backend lost quorum")
    assert any(n.startswith("retrieval unavailable") for n in report["notes"])


def test_a_time_limit_stays_a_time_limit_whatever_a_model_says(server):
    server.script[:] = [("reply", answer("infrastructure", "node_failure", "cordon_and_restart"))]
    lines = [*[f"[rank{r}]: iteration {i} | loss 2.{i}" for i in range(3) for r in range(4)],
             "slurmstepd: error: *** JOB 4242 ON node-3 CANCELLED AT 2024-05-01T03:12:44 DUE TO TIME LIMIT ***"]
    report = diagnose(engine_with(server, always=True), lines)
    assert (report.category, report.failure_type, report.action) == ("infrastructure", "time_limit", "restart")
    assert report.culprits.hosts == []
