"""End to end on generated jobs: 64 ranks, thousands of noise lines, the failure and its cascade.

Every scenario of `logdx.synth` is diagnosed through the same pipeline the CLI uses, and the
report is checked against the generator's ground truth (label, the exact root line, culprits).
"""

from __future__ import annotations

import io

import pytest

from logdx.pipeline import Engine
from logdx.synth import SCENARIOS, generate

STYLES = ("torchrun_tee", "srun")


def diagnose_generated(engine: Engine, scenario: str, style: str, seed: int, lines: int = 20_000):
    buf = io.StringIO()
    truth = generate(buf, scenario=scenario, seed=seed, ranks=64, lines=lines, style=style)
    session = engine.new_session()
    session.feed_lines(buf.getvalue().splitlines())
    return truth, session.report()


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_scenario_is_diagnosed_like_the_ground_truth(engine, scenario, style):
    truth, report = diagnose_generated(engine, scenario, style, seed=11)
    assert report.status == truth.status
    if truth.status == "healthy":
        assert (report.category, report.failure_type, report.action, report.root_cause) == (None, None, "none", None)
        return
    assert (report.category, report.failure_type, report.action) == (truth.category, truth.failure_type, truth.action)
    assert report.root_cause is not None
    assert (report.root_cause.line_no, report.root_cause.text) == (truth.root_line_no, truth.root_line)
    if truth.category == "infrastructure":
        assert set(truth.culprit_hosts) <= set(report.culprits.hosts)
        assert set(truth.culprit_ranks) <= set(report.culprits.ranks)
        assert set(truth.culprit_gpus) <= set(report.culprits.gpus)


def test_symptoms_are_evidence_not_the_root(engine):
    truth, report = diagnose_generated(engine, "xid79", "torchrun_tee", seed=3)
    assert report.evidence[0].line_no == truth.root_line_no
    assert any("watchdog" in e.source or "nccl" in e.source for e in report.evidence[1:])
    assert "rank" in report.explanation and truth.culprit_hosts[0] in report.explanation


def test_compression_keeps_little_of_a_long_job(engine):
    _, report = diagnose_generated(engine, "ecc", "srun", seed=5, lines=100_000)
    c = report.compression
    assert c.lines_in > 70_000
    assert c.lines_kept < c.lines_in / 20
    assert c.templates < 2_000
