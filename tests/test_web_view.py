"""The job page's view and rendering (issue 22), without a server or a browser: what the view holds
for a diagnosed multi-rank job, its bounds, the single file `diagnose --html` writes, the session
cookie, and the page's link in alerts. Browser and HTTP tests: test_web_pages.py, test_web_browser.py."""

from __future__ import annotations

import io
import json
import re

import pytest

from logdx.access.auth import Authenticator, token_digest
from logdx.act.alerts.base import Alert, job_page_url
from logdx.act.alerts.slack import slack_payload
from logdx.act.alerts.webhook import webhook_payload
from logdx.api.cookies import SessionCookies
from logdx.config import Settings
from logdx.pipeline import Engine, Session
from logdx.store import Database
from logdx.synth import generate
from logdx.synth.generate import Truth
from logdx.web import view as view_module
from logdx.web.render import Done, render_job_page
from logdx.web.store import JobViews
from logdx.web.view import JobView, build_view, view_from_report
from logdx.wire.errors import ApiError

RANKS, GPUS_PER_HOST = 16, 8


@pytest.fixture(scope="module")
def job(engine: Engine) -> tuple[Session, Truth, JobView]:
    buf = io.StringIO()
    truth = generate(buf, scenario="xid79", seed=3, ranks=RANKS, gpus_per_host=GPUS_PER_HOST, lines=12000)
    session = engine.new_session()
    session.feed_lines(buf.getvalue().splitlines())
    report = session.report()
    return session, truth, build_view("job-1", report, session)


def test_one_lane_per_host_with_its_ranks_and_the_root_on_the_culprits_lane(job) -> None:
    _, truth, view = job
    named = [lane for lane in view.lanes if lane.host]
    assert len(named) == RANKS // GPUS_PER_HOST
    ranks = sorted(r.rank for lane in view.lanes for r in lane.ranks if r.rank is not None)
    assert ranks == list(range(RANKS))
    assert view.lanes[0].culprit and view.lanes[0].host == truth.culprit_hosts[0]
    roots = [e for e in view.events if e.role == "root"]
    assert [e.line_no for e in roots] == [truth.root_line_no]
    assert roots[0].host == truth.culprit_hosts[0]


def test_what_followed_the_root_is_its_cascade_and_each_rank_says_where_it_stopped(job) -> None:
    _, truth, view = job
    cascade = [e for e in view.events if e.role == "cascade"]
    assert cascade and all(e.line_no > truth.root_line_no for e in cascade)
    assert not [e for e in view.events if e.role == "event" and e.line_no > truth.root_line_no]
    rows = [r for lane in view.lanes for r in lane.ranks]
    assert all(r.last_line is not None and r.last_line < truth.root_line_no + 50 for r in rows)


def test_the_root_in_context_is_its_own_hosts_lines_around_it(job) -> None:
    _, truth, view = job
    root = [c for c in view.context if c.root]
    assert len(root) == 1 and root[0].line_no == truth.root_line_no and root[0].text == truth.root_line
    assert all(c.host in (truth.culprit_hosts[0], None) for c in view.context)
    assert any(c.line_no > truth.root_line_no for c in view.context)


def test_the_view_is_bounded_however_many_events(job, monkeypatch: pytest.MonkeyPatch) -> None:
    session, _, view = job
    assert view.events_total == len(session.events) > 20
    monkeypatch.setattr(view_module, "MAX_EVENTS", 10)
    small = build_view("job-1", view.report, session)
    assert len(small.events) == 10
    assert [e.role for e in small.events].count("root") == 1  # the root is always kept


def test_the_single_file_carries_everything_and_shows_the_verdict_without_scripts(job) -> None:
    _, truth, view = job
    html = render_job_page(view, Done(served=False), inline=True)
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)  # nothing to fetch, from anywhere
    assert "<script src" not in html and 'rel="stylesheet"' not in html
    assert "uPlot" in html  # the charting library, inlined
    no_scripts = re.sub(r"<script\b.*?</script>", "", html, flags=re.S)
    for text in (truth.failure_type, truth.culprit_hosts[0], f"Root line {truth.root_line_no}"):
        assert text in no_scripts
    assert f'id="line-{truth.root_line_no}" class="ctx root"' in no_scripts


@pytest.mark.parametrize("scenario", ["healthy", "nan_loss", "nccl_hang", "stall", "import_error"])
def test_every_kind_of_job_has_a_page_with_one_root_at_most(engine: Engine, scenario: str) -> None:
    buf = io.StringIO()
    truth = generate(buf, scenario=scenario, seed=2, ranks=16, lines=6000, style="srun")
    session = engine.new_session()
    session.feed_lines(buf.getvalue().splitlines())
    view = build_view(scenario, session.report(), session)
    html = render_job_page(view, Done(served=False), inline=True)
    assert html.count('id="root-marker"') == (0 if truth.status == "healthy" else 1)
    data = re.search(r'<script type="application/json" id="job-data">(.*?)</script>', html, re.S)
    assert data is not None and json.loads(data.group(1))  # a NaN loss is no point of the curve: valid JSON


def test_a_log_that_shows_neither_failure_nor_health_has_an_unknown_page(engine: Engine) -> None:
    session = engine.new_session()
    session.feed_lines(["Loading config from /etc/train.yaml", "Building model: 7B parameters"])
    report = session.report()
    html = render_job_page(build_view("u", report, session), Done(served=False), inline=True)
    assert report.status == "unknown"
    assert 'class="verdict unknown none"' in html and '<span class="pill unknown">unknown</span>' in html
    assert "nothing shows the job went well" in html and 'id="root-marker"' not in html


def test_text_from_the_log_is_escaped(engine: Engine) -> None:
    session = engine.new_session()
    session.feed_lines(["step 1 loss 2.0", "<script>alert(1)</script> Traceback (most recent call last):",
                        '  File "train.py", line 3, in <module>', "KeyError: '<img src=x onerror=alert(1)>'"])
    report = session.report()
    html = render_job_page(build_view("x", report, session), Done(served=False), inline=True)
    assert "<img src=x" not in html and "<script>alert(1)" not in html
    assert "&lt;img src=x onerror=alert(1)&gt;" in html


def test_a_view_from_the_report_alone_still_places_root_and_ranks(job) -> None:
    _, truth, view = job
    poor = view_from_report("job-1", view.report, {"total": 1, "templates": [
        {"id": 1, "template": "step <*>", "count": 5, "rank_count": 2, "host_count": 1, "first_line": 1,
         "last_line": 9, "error_bearing": False}]})
    assert [e.line_no for e in poor.events if e.role == "root"] == [truth.root_line_no]
    assert {lane.host for lane in poor.lanes if lane.host} == {lane.host for lane in view.lanes if lane.host}
    assert poor.templates[0].template == "step <*>"


def test_views_are_stored_and_read_back(job, backend_db: Database) -> None:
    _, truth, view = job
    views = JobViews(backend_db)
    views.save(view)
    assert views.get("job-1") == view
    assert views.get("other") is None
    body = views.body("job-1", view.report.id)
    assert body is not None and truth.root_line.replace("'", "&#39;") in body
    assert views.body("job-1", "another-report") is None


def test_alerts_link_the_job_page_when_the_public_url_is_set(job) -> None:
    _, _, view = job
    assert job_page_url("", "j") == ""
    url = job_page_url("https://logdx.example/", "run 7/a")
    assert url == "https://logdx.example/jobs/run%207%2Fa"
    alert = Alert(job_id="run 7/a", report=view.report, page_url=url)
    assert url in str(slack_payload(alert, None))
    assert webhook_payload(alert, None)["data"]["page_url"] == url
    assert webhook_payload(Alert(job_id="j", report=view.report), None)["data"]["page_url"] is None


def test_session_cookies_name_a_session_that_expires_and_ends_everywhere_at_sign_out(backend_db: Database) -> None:
    db = backend_db
    settings = Settings.model_validate({"server": {"tokens": [
        {"name": "alice", "role": "operator", "sha256": token_digest("a" * 32)},
        {"name": "bob", "role": "reader", "sha256": token_digest("b" * 32)}]}})
    auth = Authenticator(settings.server)
    cookies = SessionCookies(db, auth)
    alice = auth.identify("Bearer " + "a" * 32)
    value = cookies.issue(alice, now=1000.0)
    assert "a" * 32 not in value and token_digest("a" * 32) not in value
    assert cookies.principal(value, now=1001.0) == alice
    replica = SessionCookies(db, auth)  # another worker or replica on the same store: same secret, same sessions
    assert replica.principal(value, now=1001.0) == alice

    def refused(v: str, now: float = 1001.0, by: SessionCookies = cookies) -> str:
        with pytest.raises(ApiError) as e:
            by.principal(v, now=now)
        return e.value.code

    assert refused(value, now=1000.0 + 13 * 3600) == "unauthorized"  # expired
    version, session, mac = value.split(".")
    other = cookies.issue(auth.identify("Bearer " + "b" * 32), now=1000.0).split(".")[1]
    assert refused(f"{version}.{other}.{mac}") == "unauthorized"  # another session under this one's signature
    tampered = session[:-1] + ("1" if session[-1] == "0" else "0")  # one digit changed (a random id may end in 0)
    assert refused(f"{version}.{tampered}.{mac}") == "unauthorized"
    assert refused("v1.YWxpY2U.99999999999.0000") == "unauthorized"  # the earlier, stateless cookies
    assert refused("v2.garbage") == "unauthorized"
    rotated = Authenticator(Settings.model_validate({"server": {"tokens": [
        {"name": "alice", "role": "operator", "sha256": token_digest("c" * 32)}]}}).server)
    with pytest.raises(ApiError):
        SessionCookies(db, rotated).principal(value, now=1001.0)  # the token changed: its cookies go
    second = cookies.issue(alice, now=1000.0)
    assert cookies.revoke(value)  # signed out on one worker...
    assert refused(value, by=replica) == "unauthorized"  # ...refused by the others from then on
    assert replica.principal(second, now=1001.0) == alice  # alice's other session (another browser) lives on
    assert not cookies.revoke(value) and not cookies.revoke("forged")


def test_a_job_read_from_per_host_files_has_a_progress_bar_on_every_host(engine: Engine, tmp_path) -> None:
    """Issue 33: a folder of per-host files (`diagnose DIR --html`) names hosts, not ranks: each host's own
    progress is its lane's row, with its bar and where it stopped."""
    from logdx.jobinput import collect, diagnose_files
    from per_host_logs import CULPRIT, HOSTS, write_host_files

    write_host_files(tmp_path / "job")
    diagnosed = diagnose_files(engine, collect([str(tmp_path / "job")], engine.settings.input), "auto")
    assert diagnosed.session is not None and diagnosed.report.culprits.hosts == [CULPRIT]
    view = build_view("per-host", diagnosed.report, diagnosed.session)
    lanes = {lane.host: lane for lane in view.lanes}
    assert sorted(lanes) == sorted(HOSTS)
    ends = {h: lane.progress.last_step for h, lane in lanes.items() if lane.progress and lane.progress.last_line}
    assert sorted(ends) == sorted(HOSTS)
    assert ends[CULPRIT] == 90 and all(ends[h] == 120 for h in HOSTS if h != CULPRIT)
    html = render_job_page(view, Done(served=False), inline=True)
    for host in HOSTS:
        lane = re.search(rf'<details class="lane[^"]*" data-host="{host}".*?</details>', html, re.S)
        assert lane is not None and lane.group(0).count('class="bar"') == 1, host


def _corroboration(html: str) -> str | None:
    found = re.search(r'<p id="corroboration"[^>]*>(.*?)</p>', html, re.S)
    return " ".join(found.group(1).split()) if found else None


def test_the_corroboration_is_said_only_where_a_node_is_blamed_in_plain_words(job, engine: Engine) -> None:
    """Issue 33: "Corroborated (…)" with brackets in brackets, even under a script's error."""
    _, truth, view = job
    said = _corroboration(render_job_page(view, Done(served=False), inline=True))
    assert said is not None and said.startswith("Corroborated: ") and truth.culprit_hosts[0] in said
    assert "(" not in said and ")" not in said  # the basis's own aside too: "own host, prefix or stream"
    lone = view.model_copy(update={"report": view.report.model_copy(update={
        "culprits": view.report.culprits.model_copy(update={"corroborated": False})})})
    said = _corroboration(render_job_page(lone, Done(served=False), inline=True))
    assert said is not None and said.startswith("Not corroborated: ") and "will not cordon" in said and "(" not in said

    buf = io.StringIO()
    generate(buf, scenario="key_error", seed=2, ranks=16, lines=4000, style="srun")
    session = engine.new_session()
    session.feed_lines(buf.getvalue().splitlines())
    script = build_view("script", session.report(), session)
    assert script.report.category == "script"
    html = render_job_page(script, Done(served=False), inline=True)
    assert _corroboration(html) is None and "Corroborated" not in html  # no node blamed: nothing to corroborate
