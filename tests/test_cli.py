"""The CLI as a user runs it: a real subprocess, real files, real exit codes."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # subprocesses

ENV = {**os.environ, "LOGDX_LLM__ENABLED": "false", "LOGDX_RETRIEVAL__ENABLED": "false", "NO_COLOR": "1"}
REPORT_KEYS = {"status", "category", "failure_type", "action", "confidence", "culprits", "root_cause", "evidence",
               "explanation", "hint", "compression", "timings_ms"}


def run(*args: str, stdin: bytes | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "logdx", *args], input=stdin, capture_output=True,
                          env=env or ENV, timeout=300)


def diagnose(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    code = "import sys; from logdx.cli import diagnose_main; sys.exit(diagnose_main())"
    return subprocess.run([sys.executable, "-c", code, *args], input=stdin, capture_output=True, env=ENV, timeout=300)


ECC_LOG = "\n".join(
    [f"[default{r % 8}]:[rank{r}]: iteration 100/1000 | loss 2.31 | lr 1.0E-04" for r in range(16)]
    + ["[default3]:[rank11]: RuntimeError: CUDA error: uncorrectable ECC error encountered"]
    + [f"[default{r % 8}]:[rank{r}]: [E501 12:00:00.1 ProcessGroupNCCL.cpp:1515] [PG 0 Rank {r}] Watchdog caught "
       f"collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE) ran for 600012 milliseconds before timing out."
       for r in range(16) if r != 11]
) + "\n"


@pytest.fixture
def ecc_log(tmp_path: Path) -> Path:
    p = tmp_path / "job.log"
    p.write_text(ECC_LOG)
    return p


def test_json_report_has_the_design_shape(ecc_log):
    out = diagnose(str(ecc_log), "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert set(report) >= REPORT_KEYS
    assert (report["status"], report["category"], report["failure_type"]) == ("failed", "infrastructure", "ecc_error")
    assert report["action"] == "cordon_and_restart"
    assert report["culprits"]["ranks"] == [11]
    assert report["root_cause"]["line_no"] == 17 and report["root_cause"]["rank"] == 11
    assert report["compression"]["lines_in"] == 32


def test_human_report_names_root_line_action_and_culprit(ecc_log):
    out = diagnose(str(ecc_log))
    assert out.returncode == 0
    text = out.stdout.decode()
    assert "ecc_error" in text and "CORDON" in text and "rank 11" in text and "17:" in text
    assert "\x1b[" not in text  # no colour when not a TTY


def test_html_writes_the_job_page_as_one_file(ecc_log, tmp_path):
    page = tmp_path / "report.html"
    out = diagnose(str(ecc_log), "--no-store", "--html", str(page))
    assert out.returncode == 0, out.stderr
    assert "ecc_error" in out.stdout.decode()  # the terminal report as without --html
    html = page.read_text()
    assert "uncorrectable ECC error encountered" in html and 'id="root-line"' in html
    assert "<script src" not in html  # one file: its scripts inside
    bad = diagnose(str(ecc_log), "--no-store", "--html", str(tmp_path / "no-such-dir" / "r.html"))
    assert bad.returncode == 2 and bad.stderr.decode().count("\n") == 1 and "--html" in bad.stderr.decode()


def test_color_can_be_forced(ecc_log):
    assert "\x1b[" in diagnose(str(ecc_log), "--color").stdout.decode()


def test_stdin_and_gzip_inputs(ecc_log, tmp_path):
    from_stdin = json.loads(diagnose("-", "--json", stdin=ECC_LOG.encode()).stdout)
    gz = tmp_path / "job.log.gz"
    gz.write_bytes(gzip.compress(ECC_LOG.encode()))
    from_gz = json.loads(diagnose(str(gz), "--json").stdout)
    assert from_stdin["failure_type"] == from_gz["failure_type"] == "ecc_error"
    assert from_stdin["root_cause"] == from_gz["root_cause"]


def test_umbrella_command_and_subcommand_help():
    assert run("diagnose", "--help").returncode == 0
    assert run("--version").stdout.decode().startswith("logdx ")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["/nonexistent/job.log"], "no such file"),
        (["--bogus-flag", "x.log"], "unrecognized arguments"),
        ([], "required"),
        (["--rules", "/nonexistent-dir", "x.log"], "not a directory"),
        (["feedback", "r1", "--category", "script", "--failure-type", "key_errorr"],
         "unknown failure type 'key_errorr'; did you mean 'key_error'?"),
        (["feedback", "r1", "--category", "scrpt", "--failure-type", "key_error"],
         "invalid choice: 'scrpt'; did you mean 'script'?"),
        (["incidents", "list", "--failure-type", "nccl_timout"], "did you mean 'nccl_timeout'?"),
    ],
)
def test_bad_usage_exits_2_with_one_line(args, message):
    out = diagnose(*args)
    assert out.returncode == 2
    err = out.stderr.decode().strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert "Traceback" not in err


def test_a_folder_without_log_files_is_a_usage_error(tmp_path):
    (tmp_path / "logs" / ".cache").mkdir(parents=True)  # hidden folders are not read
    (tmp_path / "logs" / ".cache" / "node-01.log").write_text("x\n")
    out = diagnose(str(tmp_path / "logs"))
    assert out.returncode == 2 and "no log files in this folder" in out.stderr.decode()
    assert len(out.stderr.strip().splitlines()) == 1


def test_binary_garbage_is_refused_not_crashed(tmp_path):
    p = tmp_path / "garbage.log"
    p.write_bytes(os.urandom(200_000) + b"\x00\x00\r\r\n" * 100)
    out = diagnose(str(p), "--json")
    assert out.returncode == 2 and out.stdout == b""
    assert len(out.stderr.strip().splitlines()) == 1 and b"Traceback" not in out.stderr


def test_bad_rule_pack_is_reported_with_file_and_line(tmp_path, ecc_log):
    pack = tmp_path / "rules"
    pack.mkdir()
    (pack / "mine.yaml").write_text(
        "pack: mine\nrules:\n  - id: my-rule\n    title: t\n    role: root_cause\n    category: infrastructure\n"
        "    failure_type: gpu_lost\n    confidence: 0.9\n    match:\n      patterns: ['x']\n"
    )
    out = diagnose(str(ecc_log), "--rules", str(pack))
    err = out.stderr.decode()
    assert out.returncode == 2
    assert "mine.yaml:" in err and "my-rule" in err and "gpu_lost" in err


def test_extra_rule_pack_is_used(tmp_path):
    pack = tmp_path / "rules"
    pack.mkdir()
    (pack / "site.yaml").write_text(
        "pack: site\nrules:\n  - id: site-fabric-manager-down\n    title: Fabric manager down\n    role: root_cause\n"
        "    category: infrastructure\n    failure_type: nvlink_error\n"
        "    severity: critical\n    confidence: 0.9\n    match:\n      patterns: ['fabricmanager.*(?:exited|failed)']\n"
        "    hint: restart nvidia-fabricmanager\n    examples: ['nvidia-fabricmanager.service failed with result exit-code']\n"
    )
    log = tmp_path / "job.log"
    log.write_text("node-1: iteration 1 | loss 2.0\nnode-1: nvidia-fabricmanager.service: Main process exited, code=exited\n")
    report = json.loads(diagnose(str(log), "--json", "--rules", str(pack)).stdout)
    assert report["failure_type"] == "nvlink_error"
    assert report["evidence"][0]["source"] == "rule:site-fabric-manager-down"


def test_rules_test_command_checks_every_example():
    out = run("rules", "test")
    assert out.returncode == 0, out.stdout.decode() + out.stderr.decode()
    assert "rules in" in out.stdout.decode()


# -- papercuts a user hits at once ---------------------------------------------------------------


def test_diagnose_help_names_the_program_once():
    out = diagnose("--help")
    assert out.returncode == 0
    assert out.stdout.decode().startswith("usage: diagnose [-h]"), out.stdout.decode()[:200]


def test_synth_help_and_the_readme_invocation(tmp_path):
    helped = run("synth", "--help")
    assert helped.returncode == 0 and helped.stdout.decode().startswith("usage: logdx synth"), helped.stderr
    log = tmp_path / "job.log"
    made = run("synth", "--scenario", "xid79", "--ranks", "8", "--lines", "2000", "-o", str(log))
    assert made.returncode == 0, made.stderr
    assert "GPU has fallen off the bus" in log.read_text()


def test_truncated_gzip_is_one_line_and_exit_2(tmp_path):
    gz = tmp_path / "job.log.gz"
    gz.write_bytes(gzip.compress((ECC_LOG * 200).encode())[:-200])
    out = diagnose(str(gz))
    err = out.stderr.decode().strip()
    assert out.returncode == 2, err
    assert len(err.splitlines()) == 1 and "gzip" in err and "Traceback" not in err, err


def _wait_reading_stdin(pid: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if Path(f"/proc/{pid}/syscall").read_text().startswith("0 0x0 "):  # read(0, ...)
            return
        time.sleep(0.05)
    raise AssertionError("the CLI never got to read its standard input")


def _pipe_holds(fd: int) -> int:
    """Bytes written to a pipe and not read yet."""
    import array
    import fcntl
    import termios

    n = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, n, True)
    return n[0]


def _live_diagnose(*args: str) -> subprocess.Popen:
    code = "import sys; from logdx.cli import diagnose_main; sys.exit(diagnose_main())"
    # a shell's background job inherits SIGINT ignored (POSIX), and Python then keeps it ignored: give
    # the child the terminal's default so the test means the same however the suite was started
    return subprocess.Popen([sys.executable, "-c", code, "-", *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=ENV,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def test_ctrl_c_on_a_live_stream_prints_the_report_of_what_was_read_and_exits_130():
    proc = _live_diagnose("--json", "--no-store")
    assert proc.stdin is not None
    proc.stdin.write(ECC_LOG.encode())
    proc.stdin.flush()  # like `kubectl logs -f trainer-0 | diagnose -`: lines came, the stream stays open
    deadline = time.monotonic() + 120
    while _pipe_holds(proc.stdin.fileno()) and time.monotonic() < deadline:
        time.sleep(0.05)  # the CLI has read every line written...
    _wait_reading_stdin(proc.pid)  # ...and waits for more (however slow the machine)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    report = json.loads(out)
    assert (report["failure_type"], report["culprits"]["ranks"]) == ("ecc_error", [11])
    assert any(n.startswith(f"partial: interrupted (Ctrl-C) after {ECC_LOG.count(chr(10))} lines") for n in report["notes"])


def test_ctrl_c_before_any_line_is_one_line_and_exit_130():
    proc = _live_diagnose()
    _wait_reading_stdin(proc.pid)  # imports done, blocked reading fd 0, nothing written
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.decode().strip() == "diagnose: interrupted" and out == b""


def test_prompts_check_renders_every_template():
    out = run("prompts", "check")
    assert out.returncode == 0, out.stdout.decode() + out.stderr.decode()
    assert "prompts: ok" in out.stdout.decode()


def test_a_misspelt_setting_is_a_usage_error_naming_the_right_one(tmp_path, ecc_log):
    env = {**ENV, "LOGDX_RETRIEVAL__MIN_SIMILARTY": "0.5"}
    out = subprocess.run([sys.executable, "-m", "logdx", "diagnose", str(ecc_log)], capture_output=True, env=env,
                         timeout=300)
    err = out.stderr.decode().strip()
    assert out.returncode == 2 and "LOGDX_RETRIEVAL__MIN_SIMILARITY" in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize(("content", "says"), [
    (b"", "no log lines to diagnose"),
    (b"\n   \n\t\n", "no log lines to diagnose"),
    (bytes(range(256)) * 40, "binary data, not a text log"),
])
def test_empty_or_binary_input_is_not_called_healthy(tmp_path, content, says):
    log = tmp_path / "job.log"
    log.write_bytes(content)
    out = diagnose(str(log), "--no-llm", "--no-retrieval")
    assert out.returncode == 2
    err = out.stderr.decode()
    assert says in err and len(err.strip().splitlines()) == 1
