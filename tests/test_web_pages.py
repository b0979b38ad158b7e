"""The job pages over HTTP (issue 22): the real app on uvicorn, real requests. Who may see a page
(the API's roles, a session cookie from a token, never a token in a URL), the list and its filters,
the docs pages' assets from the package, feedback through the cookie into the incident store."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api_server import LoopbackApp
from logdx.access.auth import token_digest
from logdx.api.cookies import COOKIE
from logdx.config import Settings
from logdx.pipeline import Engine
from logdx.synth import generate
from logdx.synth.generate import Truth

pytestmark = pytest.mark.integration

TOKENS = {"grafana": ("reader", ""), "oncall": ("operator", ""), "fluentbit-a": ("shipper", "team-a")}
SECRET = {name: f"secret-of-{name}-0123456789abcdef" for name in TOKENS}


def _settings(tmp: Path, **server: Any) -> Settings:
    return Settings.model_validate({
        "data_dir": str(tmp), "llm": {"enabled": False}, "retrieval": {"enabled": False},
        "server": {"early_diagnosis_delay_s": 3600, **server}})


def _job_log(seed: int = 5) -> tuple[bytes, Truth]:
    buf = io.StringIO()
    truth = generate(buf, scenario="xid79", seed=seed, ranks=16, gpus_per_host=8, lines=8000)
    return buf.getvalue().encode(), truth


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackApp]:
    tokens = [{"name": n, "role": r, "tenant": t, "sha256": token_digest(SECRET[n])} for n, (r, t) in TOKENS.items()]
    settings = _settings(tmp_path_factory.mktemp("pages"), tokens=tokens)
    with LoopbackApp(settings, Engine.create(settings)) as app:
        yield app


def _as(app: LoopbackApp, name: str | None = None, **kw: Any) -> httpx.Client:
    headers = {"authorization": f"Bearer {SECRET[name]}"} if name else {}
    return httpx.Client(base_url=app.url, headers=headers, timeout=60, **kw)


@pytest.fixture(scope="module")
def ended(app: LoopbackApp) -> tuple[str, Truth]:
    log, truth = _job_log()
    with _as(app, "oncall") as c:
        assert c.post("/v1/jobs/run-1/logs", content=log, headers={"content-type": "text/plain"}).status_code == 200
        assert c.post("/v1/jobs/run-1/end", json={}).status_code == 200
    return "run-1", truth


def _sign_in(c: httpx.Client, name: str) -> None:
    r = c.post("/login", data={"token": SECRET[name], "next": "/jobs/run-1"})
    assert r.status_code == 303 and r.headers["location"] == "/jobs/run-1"
    assert SECRET[name] not in r.headers["location"] and SECRET[name] not in r.headers["set-cookie"]
    cookie = r.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie


def test_the_page_of_an_ended_job_shows_verdict_root_and_culprit(app: LoopbackApp, ended: tuple[str, Truth]) -> None:
    job_id, truth = ended
    with _as(app, "grafana") as c:
        r = c.get(f"/jobs/{job_id}")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in r.headers["content-security-policy"]
    for text in (truth.failure_type, truth.culprit_hosts[0], f"Root line {truth.root_line_no}"):
        assert text in r.text
    assert 'src="/static/vendor/uplot/uPlot.iife.min.js"' in r.text
    assert "The culprit's history" in r.text
    # a reader may look, not give feedback
    assert 'id="feedback-form"' not in r.text


def test_a_browser_without_a_session_is_sent_to_sign_in(app: LoopbackApp, ended: tuple[str, Truth]) -> None:
    with _as(app) as c:
        home = c.get("/")  # the service's address, typed into a browser: its jobs (then sign-in)
        assert home.status_code == 303 and home.headers["location"] == "/jobs"
        r = c.get("/jobs/run-1")
        assert r.status_code == 303 and r.headers["location"] == "/login?next=%2Fjobs%2Frun-1"
        assert c.get("/login?next=/jobs/run-1").status_code == 200
        bad = c.post("/login", data={"token": "not-a-token", "next": "/jobs/run-1"})
        assert bad.status_code == 401 and COOKIE not in bad.headers.get("set-cookie", "")
        away = c.post("/login", data={"token": SECRET["grafana"], "next": "//evil.example/x"})
        assert away.status_code == 303 and away.headers["location"] == "/jobs"  # no open redirect
    with _as(app, None, cookies={COOKIE: "v1.Z3JhZmFuYQ.99999999999.0000"}) as c:
        assert c.get("/jobs/run-1").status_code == 303  # a forged cookie is no session
        assert c.get("/v1/jobs").status_code == 401


def test_a_session_cookie_stands_for_its_token_and_its_role(app: LoopbackApp, ended: tuple[str, Truth]) -> None:
    with _as(app) as c:
        _sign_in(c, "grafana")
        page = c.get("/jobs/run-1")
        assert page.status_code == 200 and "sign out grafana" in page.text
        assert c.get("/v1/jobs").status_code == 200  # the API too, as the reader
        report_id = c.get("/v1/jobs/run-1").json()["report"]["id"]
        r = c.post(f"/v1/reports/{report_id}/feedback", json={"category": "infrastructure",
                                                              "failure_type": "gpu_fell_off_bus"})
        assert r.status_code == 403  # feedback is an operator's
        out = c.post("/logout")
        assert out.status_code == 303
        assert c.get("/jobs/run-1").status_code == 303


def test_sign_out_ends_the_session_on_every_replica(app: LoopbackApp, ended: tuple[str, Truth],
                                                   tmp_path: Path) -> None:
    """Issue 29: a copied cookie is refused once its session signed out, by whichever replica it reaches
    (the sessions live in the store the replicas share)."""
    settings = app.services.settings
    shared = _settings(tmp_path, tokens=[t.model_dump() for t in settings.server.tokens])
    shared.store.path = settings.store.path or settings.data_dir / "logdx.db"
    with LoopbackApp(shared, app.services.engine) as replica, _as(app) as c:
        _sign_in(c, "grafana")
        value = c.cookies[COOKIE]
        for url in (app.url, replica.url):
            with httpx.Client(base_url=url, cookies={COOKIE: value}, timeout=60) as copied:
                assert copied.get("/v1/jobs").status_code == 200 and copied.get("/jobs/run-1").status_code == 200
        assert c.post("/logout").status_code == 303
        for url in (app.url, replica.url):
            with httpx.Client(base_url=url, cookies={COOKIE: value}, timeout=60) as copied:
                assert copied.get("/v1/jobs").status_code == 401
                assert copied.get("/jobs/run-1").status_code == 303  # to the login form


def test_a_tenants_shipper_sees_only_its_tenants_pages(app: LoopbackApp, ended: tuple[str, Truth]) -> None:
    with _as(app, "fluentbit-a") as c:
        assert c.get("/jobs/run-1").status_code == 404  # another tenant's job, or none: the same answer
        assert c.get("/jobs").status_code == 403  # listing jobs is a reader's


def test_feedback_through_the_cookie_reaches_the_incident_store(app: LoopbackApp, ended: tuple[str, Truth]) -> None:
    with _as(app) as c:
        _sign_in(c, "oncall")
        page = c.get("/jobs/run-1")
        assert 'id="feedback-form"' in page.text
        report_id = c.get("/v1/jobs/run-1").json()["report"]["id"]
        foreign = c.post(f"/v1/reports/{report_id}/feedback", headers={"origin": "https://evil.example"},
                         json={"category": "infrastructure", "failure_type": "ecc_error"})
        assert foreign.status_code == 403  # the guard: a page elsewhere cannot ride on the cookie
        r = c.post(f"/v1/reports/{report_id}/feedback", headers={"origin": app.url},
                   json={"category": "infrastructure", "failure_type": "ecc_error", "note": "from the page"})
        assert r.status_code == 200, r.text
    stored = [i for i in app.services.incidents.list(source="feedback") if i.report_id == report_id]
    assert [(i.failure_type, i.note) for i in stored] == [("ecc_error", "from the page")]


def test_the_list_filters_by_status_category_and_host(app: LoopbackApp, ended: tuple[str, Truth]) -> None:
    _, truth = ended
    with _as(app, "oncall") as c:
        assert c.post("/v1/jobs/run-open/logs", content=b"step 1 loss 2.5\n",
                      headers={"content-type": "text/plain"}).status_code == 200
    with _as(app, "grafana") as c:
        everything = c.get("/jobs").text
        assert 'href="/jobs/run-1"' in everything and "run-open" in everything
        failed = c.get("/jobs", params={"status": "failed"}).text
        assert 'href="/jobs/run-1"' in failed and "run-open" not in failed
        assert "run-1" in c.get("/jobs", params={"host": truth.culprit_hosts[0]}).text
        assert "run-1" not in c.get("/jobs", params={"host": "no-such-node"}).text
        assert "run-1" not in c.get("/jobs", params={"category": "script"}).text
        assert c.get("/jobs/run-open").status_code == 409  # no diagnosis yet
        assert c.get("/jobs/nope").status_code == 404
        assert c.get("/jobs/" + "x" * 300).status_code == 400


def test_the_docs_pages_load_their_assets_from_the_package(app: LoopbackApp) -> None:
    with _as(app, "grafana") as c:
        for page in ("/docs", "/redoc"):
            html = c.get(page).text
            assert "cdn." not in html and "fonts.googleapis" not in html
            for url in [u for u in _asset_urls(html) if not u.startswith("/openapi")]:
                assert url.startswith("/static/"), url
                assert c.get(url).status_code == 200, url
        assert '"validatorUrl": null' in c.get("/docs").text


def _asset_urls(html: str) -> list[str]:
    import re

    return re.findall(r"""(?:src|href)=["']([^"']+)["']""", html)
