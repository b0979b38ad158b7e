"""An honest shortlist when unsure (issue 31 item 5): below the cordon threshold the report names what else the
evidence holds possible, each with the one check that would confirm it; a sure report and a healthy one name none."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from logdx.act.render import render_text
from logdx.act.report import Report
from logdx.config import load_settings
from logdx.diagnose.shortlist import SHORTLIST_BELOW
from logdx.pipeline import Engine
from logdx.synth import generate
from logdx.taxonomy import taxonomy


@pytest.fixture(scope="module")
def engine() -> Engine:
    settings = load_settings()
    settings.llm.enabled = False
    settings.retrieval.enabled = False
    return Engine.create(settings)


def _job(engine: Engine, tmp: Path, scenario: str, seed: int = 3) -> Report:
    buf = io.StringIO()
    generate(buf, scenario=scenario, seed=seed, ranks=16, lines=12000, style="torchrun")
    path = tmp / f"{scenario}.log"
    path.write_text(buf.getvalue())
    return engine.diagnose_path(path)[0]


def test_a_timeout_the_log_cannot_explain_lists_its_causes_and_how_to_tell_them_apart(engine: Engine,
                                                                                      tmp_path: Path) -> None:
    report = _job(engine, tmp_path, "nccl_hang")
    assert report.confidence < SHORTLIST_BELOW and report.timeout is not None and report.timeout.cause == "unknown"
    hyps = report.hypotheses
    assert [h.failure_type for h in hyps][0] == report.failure_type and hyps[0].p == report.confidence
    assert {h.failure_type for h in hyps} == {"hang", "network_error", "script_hang"}, hyps
    assert sum(h.p for h in hyps) <= 1.0 + 1e-6
    host = report.culprits.hosts[0]
    assert all(host in h.check for h in hyps), hyps  # each check says where to look
    assert any(h.action == "no_restart" for h in hyps)  # the code-side cause would not be fixed by a restart
    text = render_text(report)
    assert "unsure" in text and "ibstat" in text


@pytest.mark.parametrize("scenario", ["xid79", "healthy", "key_error"])
def test_a_sure_or_healthy_report_lists_no_hypotheses(engine: Engine, tmp_path: Path, scenario: str) -> None:
    report = _job(engine, tmp_path, scenario)
    assert report.hypotheses == [], (report.confidence, report.hypotheses)
    assert "unsure" not in render_text(report)


def test_every_check_the_taxonomy_holds_fills_its_places() -> None:
    for name, ft in taxonomy().types.items():
        leftover = ft.check.replace("{host}", "").replace("{rank}", "")
        assert "{" not in leftover, (name, ft.check)


def _section(html: str, section_id: str) -> str:
    part = html[html.index(f'<section id="{section_id}"'):]
    return part[:part.index("</section>")]


def test_the_job_page_shows_the_timeout_cause_and_the_shortlist(engine: Engine, tmp_path: Path) -> None:
    from logdx.web.render import Done, render_job_page
    from logdx.web.view import build_view

    buf = io.StringIO()
    generate(buf, scenario="nccl_hang", seed=3, ranks=16, lines=12000, style="torchrun")
    session = engine.new_session()
    session.feed_lines(buf.getvalue().splitlines())
    report = session.report()
    html = render_job_page(build_view("hang-1", report, session), Done(served=False), inline=True)
    timeout = _section(html, "timeout")
    assert "unknown" in timeout and "flight recorder" in timeout  # what would tell the causes apart
    shortlist = _section(html, "hypotheses")
    assert all(ft in shortlist for ft in ("hang", "network_error", "script_hang")) and "ibstat" in shortlist
    healthy = io.StringIO()
    generate(healthy, scenario="healthy", seed=3, ranks=16, lines=8000, style="torchrun")
    quiet = engine.new_session()
    quiet.feed_lines(healthy.getvalue().splitlines())
    page = render_job_page(build_view("ok-1", quiet.report(exit_code=0), quiet), Done(served=False), inline=True)
    assert '<section id="timeout"' not in page and '<section id="hypotheses"' not in page
