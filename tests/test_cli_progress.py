"""How far `diagnose` has read, on stderr (cli/progress.py): a real subprocess reading real files."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from logdx.cli.progress import Progress

pytestmark = pytest.mark.integration  # subprocesses

ENV = {**os.environ, "LOGDX_LLM__ENABLED": "false", "LOGDX_RETRIEVAL__ENABLED": "false", "NO_COLOR": "1"}
LINES = 20_000


def job_log(path: Path) -> Path:
    rows = [f"[rank{r % 8}]: iteration {i // 8:>6}/ 100000 | lm loss: {3 - i * 1e-5:.6f} | grad norm: 1.2{i % 10}"
            for i, r in enumerate(range(LINES - 1))]
    rows.append("[rank5]: RuntimeError: CUDA error: an illegal memory access was encountered")
    data = ("\n".join(rows) + "\n").encode()
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)
    return path


def diagnose(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "logdx", "diagnose", "--no-store", "--json", *args],
                          capture_output=True, env=ENV, timeout=300)


@pytest.mark.parametrize("name", ["job.log", "job.log.gz"])
def test_always_ends_with_how_much_was_read_and_leaves_the_report_alone(tmp_path: Path, name: str) -> None:
    log = job_log(tmp_path / name)
    out = diagnose("--progress", "always", str(log))
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)  # stdout is the report only
    assert report["failure_type"] == "cuda_error"
    last = out.stderr.decode().strip().splitlines()[-1]
    size = log.stat().st_size
    unit, scale = ("MB", 1e6) if size >= 1e6 else ("KB", 1e3)
    assert re.fullmatch(rf"read {re.escape(str(log))}: 100% of {size / scale:.1f} {unit}, {LINES:,} lines, \d+ s",
                        last), last


def test_a_folder_counts_its_lines(tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
    job_log(job / "node-1.log")
    job_log(job / "node-2.log")
    out = diagnose("--progress", "always", str(job))
    assert out.returncode == 0, out.stderr
    assert out.stderr.decode().strip().splitlines()[-1].startswith(f"read 2 files: {2 * LINES:,} lines")


@pytest.mark.parametrize("mode", ["never", "auto"])
def test_never_and_auto_off_a_terminal_print_nothing(tmp_path: Path, mode: str) -> None:
    out = diagnose("--progress", mode, str(job_log(tmp_path / "job.log")))
    assert out.returncode == 0 and out.stderr == b""


def test_a_terminal_sees_nothing_for_an_input_read_at_once(tmp_path: Path) -> None:
    class Tty:
        def __init__(self) -> None:
            self.text = ""

        def isatty(self) -> bool:
            return True

        def write(self, s: str) -> int:
            self.text += s
            return len(s)

        def flush(self) -> None:
            pass

    tty = Tty()
    with Progress("job.log", lambda: 3, mode="auto", stream=tty):  # type: ignore[arg-type]
        pass
    assert tty.text == ""
