"""Slow first-time steps: what the command lines print (a redrawn line on a terminal, one line per
stage elsewhere), what the server logs, and the readiness checks that /readyz is made of."""

from __future__ import annotations

import io
import logging
import re

import pytest

from logdx import progress
from logdx.jobs.readiness import Check, Readiness


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _convert(total: int = 100) -> None:
    with progress.step("converting the packaged LLM once", part="llm", total=total) as stage:
        for done in range(0, total + 1, 10):
            stage.advance(done)


def test_a_pipe_gets_one_line_per_stage_and_no_bar() -> None:
    out = io.StringIO()
    listener = progress.to_stderr(out)
    try:
        _convert()
        with progress.step("indexing 120 past incidents", part="retrieval"):
            pass
    finally:
        progress.remove_listener(listener)
    assert out.getvalue().splitlines() == ["logdx: converting the packaged LLM once ...",
                                           "logdx: indexing 120 past incidents ..."]
    assert "\r" not in out.getvalue()


def test_a_terminal_gets_one_redrawn_line_that_ends_with_the_time() -> None:
    out = Terminal()
    listener = progress.to_stderr(out)
    try:
        _convert()
    finally:
        progress.remove_listener(listener)
    text = out.getvalue()
    assert text.startswith("logdx: converting the packaged LLM once ...") and text.count("\n") == 1
    assert re.fullmatch(r"\x1b\[Klogdx: converting the packaged LLM once \.\.\. done in \d+ s",
                        text.rstrip("\n").rsplit("\r", 1)[-1])
    assert "... 0%\r" in text  # redrawn in place (at most 5 times a second)


def test_the_log_gets_start_quarters_and_end(caplog: pytest.LogCaptureFixture) -> None:
    listener = progress.to_log(logging.getLogger("logdx.test"))
    try:
        with caplog.at_level(logging.INFO, logger="logdx.test"):
            _convert()
            with pytest.raises(OSError), progress.step("indexing", part="retrieval"):
                raise OSError("disk full")
    finally:
        progress.remove_listener(listener)
    said = [r.getMessage() for r in caplog.records]
    assert said[:4] == ["converting the packaged LLM once ...", "converting the packaged LLM once: 25%",
                        "converting the packaged LLM once: 50%", "converting the packaged LLM once: 75%"]
    assert said[4].startswith("converting the packaged LLM once: done in ")
    assert said[5] == "indexing ..." and re.fullmatch(r"indexing: failed after [\d.]+s: OSError: disk full", said[6])


def test_a_broken_listener_never_fails_the_work() -> None:
    def broken(event: str, stage: progress.Stage) -> None:
        raise RuntimeError("display gone")

    progress.add_listener(broken)
    try:
        _convert()
    finally:
        progress.remove_listener(broken)


def test_readiness_is_every_check_with_a_reason_for_each_pending_one() -> None:
    readiness = Readiness()
    rules = readiness.component("rules")
    llm = readiness.component("llm")
    readiness.add("store", lambda: Check(False, "PostgreSQL at 127.0.0.1:5432 refuses connections"))

    def broken() -> Check:
        raise ConnectionError("no route")

    readiness.add("bus", broken)
    rules.done("223 rules")
    llm.loading("converting the packaged LLM once", 0.4)
    checks = readiness.checks()
    assert list(checks) == ["rules", "llm", "store", "bus"]
    assert checks["rules"].ready and checks["rules"].reason == "223 rules"
    assert Readiness.waiting_for(checks) == {
        "llm": "converting the packaged LLM once (40%)",
        "store": "PostgreSQL at 127.0.0.1:5432 refuses connections",
        "bus": "check failed: ConnectionError: no route",
    }
    assert checks["llm"].to_json()["progress"] == 0.4
    readiness.add("store", lambda: Check(True, "PostgreSQL 15"))
    readiness.add("bus", lambda: Check(True, "NATS"))
    llm.done("numpy runtime")
    assert Readiness.waiting_for(readiness.checks()) == {}
