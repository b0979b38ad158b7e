"""The learning loop as an on-call engineer lives it, through the real CLI and the real models:
diagnose a failure no rule knows, correct the report with `diagnose feedback`, and the next
similar failure (other host, other numbers) is diagnosed right."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _log(host: str, rank: int, port: int, step: int) -> str:
    lines = [f"[rank{r}]: iteration {step}/90000 | loss 2.{r} | lr 3e-4" for r in range(8)]
    lines += [
        f"[rank{rank}]: Traceback (most recent call last):",
        f'[rank{rank}]:   File "/workspace/train.py", line 212, in <module>',
        f"[rank{rank}]:     batch = next(stream)",
        f'[rank{rank}]:   File "/opt/conda/lib/python3.10/site-packages/weka_io/reader.py", line 88, in __next__',
        f"[rank{rank}]:     raise WekaStaleMountError(self.mount)",
        f"[rank{rank}]: weka_io.errors.WekaStaleMountError: mount /mnt/weka/{host}:{port} went stale: "
        f"backend {host} lost quorum after {step} ms",
    ]
    return "\n".join(lines) + "\n"


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "LOGDX_STORE__PATH": str(tmp_path / "logdx.db"), "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}


def diagnose(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    code = "import sys; from logdx.cli import diagnose_main; sys.exit(diagnose_main())"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, env=env, timeout=600, text=True)


def test_a_corrected_report_changes_the_next_diagnosis_of_a_similar_log(tmp_path, env):
    first = tmp_path / "job-1.log"
    first.write_text(_log("weka-07", 3, 14000, 51234))
    before = json.loads(diagnose(env, str(first), "--json", "--no-llm").stdout)
    assert before["failure_type"] != "storage_error"  # no rule knows this vendor's error

    fb = diagnose(env, "feedback", before["id"], "--category", "infrastructure", "--failure-type", "storage_error",
                  "--note", "Weka backend lost quorum: storage team restarts the backend, then restart the job")
    assert fb.returncode == 0, fb.stderr
    assert "storage_error" in fb.stdout

    second = tmp_path / "job-2.log"
    second.write_text(_log("weka-12", 5, 14020, 77310))
    after = json.loads(diagnose(env, str(second), "--json", "--no-llm").stdout)
    assert (after["category"], after["failure_type"], after["action"]) == ("infrastructure", "storage_error", "restart")
    assert any(e["source"].startswith("retrieval:") for e in after["evidence"])
    assert after["root_cause"]["text"].endswith("lost quorum after 77310 ms")


def test_incidents_cli_round_trip(tmp_path, env):
    out = diagnose(env, "incidents", "add", "--root-line", "FooFS: volume /mnt/foo is read-only (quota)",
                   "--category", "infrastructure", "--failure-type", "storage_error", "--note", "ask storage")
    assert out.returncode == 0, out.stderr
    inc_id = out.stdout.strip()
    assert inc_id in diagnose(env, "incidents", "list", "--failure-type", "storage_error").stdout
    shown = json.loads(diagnose(env, "incidents", "show", inc_id).stdout)
    assert shown["root_line"].startswith("FooFS")
    exported = tmp_path / "kb.jsonl"
    assert diagnose(env, "incidents", "export", str(exported)).returncode == 0
    assert diagnose(env, "incidents", "remove", inc_id).returncode == 0
    assert diagnose(env, "incidents", "show", inc_id).returncode == 2
    imported = diagnose(env, "incidents", "import", str(exported))
    assert imported.returncode == 0 and "1 added" in imported.stdout


def test_feedback_on_an_unknown_report_is_a_usage_error(env):
    out = diagnose(env, "feedback", "rep-nope", "--category", "script", "--failure-type", "key_error")
    assert out.returncode == 2 and "no report" in out.stderr
