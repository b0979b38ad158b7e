"""The collective-timeout generator (logdx.synth.timeouts) and the `timeouts` eval set: deterministic jobs whose
labels follow their class, read back by logdx with the class right and no restart for code or config."""

from __future__ import annotations

import io

import pytest

from logdx.pipeline import Engine
from logdx.synth.timeouts import CLASSES, VARIANTS, timeout_job, timeout_set
from logdx.testing import diagnose_lines


def _write(**kw: object) -> tuple[str, object]:
    buf = io.StringIO()
    truth = timeout_job(buf, **kw)  # type: ignore[arg-type]
    return buf.getvalue(), truth


def test_the_set_covers_every_class_and_variant_and_is_deterministic() -> None:
    cases = timeout_set(6, seed=3)
    assert {c.kwargs["cause"] for c in cases} == set(CLASSES)
    assert {(c.kwargs["cause"], c.kwargs["variant"]) for c in cases} == {(k, v) for k, vs in VARIANTS.items() for v in vs}
    assert all(8 <= c.kwargs["ranks"] <= 64 for c in cases)
    a, _ = _write(**cases[0].kwargs)
    b, _ = _write(**cases[0].kwargs)
    assert a == b


@pytest.mark.parametrize(("cause", "variant"), [("cpu_side", "recompile"), ("misconfig", "sizes"),
                                                ("gpu_hang", "desync"), ("network", "link_down")])
def test_a_generated_timeout_is_read_with_its_class(engine: Engine, cause: str, variant: str) -> None:
    text, truth = _write(seed=11, flavour="plain", style="torchrun", ranks=16, lines=2500, cause=cause, variant=variant)
    lines = text.splitlines()
    assert truth.variant["timeout_class"] == cause  # type: ignore[attr-defined]
    assert any("Watchdog caught collective operation timeout" in line for line in lines)
    assert all(1 <= n <= len(lines) for n in truth.root_line_nos)  # type: ignore[attr-defined]
    report = diagnose_lines(engine, lines, None)
    assert report.timeout is not None and report.timeout.cause == cause, report.timeout
    if cause in ("cpu_side", "misconfig"):
        assert report.action == "no_restart"


def test_rules_explain_says_which_signal_decided_the_class(engine: Engine) -> None:
    from logdx.explain import explain_lines, render_explanation

    text, _ = _write(seed=3, flavour="plain", style="torchrun", ranks=16, lines=2500, cause="misconfig", variant="sizes")
    out = render_explanation(explain_lines(engine, text.splitlines()))
    head = next(line for line in out.splitlines() if line.startswith("timeout: "))
    assert "class misconfig" in head and "it set the verdict" in head, head
    signal = out.split(head, 1)[1].splitlines()[1]
    assert signal.strip().startswith("signal") and "SeqNum" in signal and "NumelIn" in signal, signal
