"""No cross-site or DNS-rebinding access, bounded metric labels, the schema behind the token (issue 14,
points 3 and 6). Real requests (httpx) against the app served by uvicorn on loopback."""

from __future__ import annotations

import gzip
import random
import re
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.datastructures import Headers

from api_server import LoopbackApp
from logdx.api.guard import HostPolicy, RequestGuard, is_browser_simple, same_origin, split_host
from logdx.api.server import ServeError, check_bind
from logdx.config import ServerSettings, Settings
from logdx.pipeline import Engine

TOKEN = "guard-test-token"
EVIL = "http://evil.example"
ROOT_LINE = b"[rank3]:node-07 kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.\n"


def settings_for(tmp: Path, **server: Any) -> Settings:
    return Settings.model_validate({
        "data_dir": str(tmp), "llm": {"enabled": False}, "retrieval": {"enabled": False},
        "server": {"early_diagnosis_delay_s": 0.1, **server},
    })


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return Engine.create(settings_for(tmp_path_factory.mktemp("engine")))


@pytest.fixture(scope="module")
def open_app(tmp_path_factory: pytest.TempPathFactory, engine: Engine) -> Iterator[LoopbackApp]:
    """No token, on loopback: the case the checks matter most for."""
    settings = settings_for(tmp_path_factory.mktemp("open"), allowed_origins=["https://dash.example.com"])
    with LoopbackApp(settings, engine) as app:
        yield app


@pytest.fixture(scope="module")
def token_app(tmp_path_factory: pytest.TempPathFactory, engine: Engine) -> Iterator[LoopbackApp]:
    with LoopbackApp(settings_for(tmp_path_factory.mktemp("token"), token=TOKEN), engine) as app:
        yield app


def refused(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["code"] == code and r.json()["error"]["message"], r.text


def job_ids(client: httpx.Client) -> set[str]:
    return {j["job_id"] for j in client.get("/v1/jobs", params={"limit": 1000}).json()["jobs"]}


# --- cross-site requests -----------------------------------------------------------------------------


@pytest.mark.integration  # a server on loopback
def test_cross_site_text_plain_post_is_refused_and_changes_nothing(open_app: LoopbackApp) -> None:
    with httpx.Client(base_url=open_app.url) as c:
        before = job_ids(c)
        # What a page on another site can send without a preflight: text/plain or a form, no custom header.
        page = {"origin": EVIL, "content-type": "text/plain;charset=UTF-8"}
        refused(c.post("/v1/jobs/victim/logs", content=ROOT_LINE, headers=page), 403, "origin_not_allowed")
        refused(c.post("/v1/jobs/victim/end", content=b"exit_code=1",
                       headers={"origin": EVIL, "content-type": "application/x-www-form-urlencoded"}),
                403, "origin_not_allowed")
        # A browser that sends no Origin on a simple POST still cannot: such a POST is refused as such.
        refused(c.post("/v1/jobs/victim/logs", content=ROOT_LINE, headers={"content-type": "text/plain"}),
                403, "simple_request_refused")
        refused(c.post("/v1/diagnose", content=ROOT_LINE), 403, "simple_request_refused")
        refused(c.post("/v1/incidents", content=b'{"root_line": "x"}', headers={"content-type": "text/plain"}),
                403, "simple_request_refused")
        # Methods a page can only send after a preflight (that logdx never answers) are refused by Origin.
        refused(c.delete("/v1/incidents/seed-xid-79", headers={"origin": EVIL}), 403, "origin_not_allowed")
        assert job_ids(c) == before
        refused(c.get("/v1/jobs/victim", headers={"x-requested-with": "t"}), 404, "job_not_found")


@pytest.mark.integration  # a server on loopback
def test_legitimate_shippers_still_work_without_a_token(open_app: LoopbackApp) -> None:
    with httpx.Client(base_url=open_app.url) as c:
        ok = [
            c.post("/v1/jobs/ship-text/logs", content=b"step 1\n", headers={"x-logdx-host": "node-07"}),
            c.post("/v1/jobs/ship-text/logs", content=b"step 2\n",
                   headers={"content-type": "text/plain", "x-requested-with": "vector"}),
            c.post("/v1/jobs/ship-text/logs", content=b"step 3\n", headers={"idempotency-key": "k-3"}),
            c.post("/v1/jobs/ship-text/logs", content=gzip.compress(b"step 4\n"), headers={"content-encoding": "gzip"}),
            c.post("/v1/jobs/ship-ndjson/logs", content=b'{"log": "step 1"}\n',
                   headers={"content-type": "application/x-ndjson"}),
            c.post("/v1/jobs/ship-ndjson/logs", json=[{"log": "step 2"}], headers={"user-agent": "Fluent-Bit"}),
            c.post("/v1/jobs/ship-ndjson/end", json={"exit_code": 0}),
            # the service's own pages (Swagger UI's "try it out") and configured dashboards
            c.post("/v1/jobs/ship-text/end", json={}, headers={"origin": open_app.url}),
            c.post("/v1/diagnose", content=ROOT_LINE,
                   headers={"origin": "https://dash.example.com", "x-requested-with": "dash"}),
        ]
        assert [r.status_code for r in ok] == [200] * len(ok), [r.text for r in ok if r.status_code != 200]
        assert ok[3].json()["job_lines"] == 4
        assert c.get("/openapi.json").status_code == 200  # no token configured: public on loopback


# --- DNS rebinding -------------------------------------------------------------------------------------


@pytest.mark.integration  # a server on loopback
def test_a_rebound_host_is_refused(open_app: LoopbackApp, token_app: LoopbackApp) -> None:
    port = open_app.port
    with httpx.Client(base_url=open_app.url) as c:
        for path in ("/v1/incidents", "/v1/jobs", "/metrics", "/openapi.json", "/healthz"):
            refused(c.get(path, headers={"host": f"evil.example:{port}"}), 400, "host_not_allowed")
        refused(c.post("/v1/jobs/x/end", json={}, headers={"host": "attacker.test"}), 400, "host_not_allowed")
        refused(c.get("/v1/jobs", headers={"host": "127.0.0.1.evil.example"}), 400, "host_not_allowed")
        refused(c.get("/v1/jobs", headers={"host": "user@127.0.0.1"}), 400, "host_not_allowed")
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST", "127.0.0.2"):
            assert c.get("/v1/jobs", headers={"host": host}).status_code == 200, host
    with httpx.Client(base_url=token_app.url, headers={"authorization": f"Bearer {TOKEN}"}) as c:
        refused(c.get("/v1/incidents", headers={"host": "evil.example"}), 400, "host_not_allowed")


@pytest.mark.integration  # a server on loopback
def test_a_wildcard_bind_answers_to_addresses_and_configured_names(tmp_path: Path, engine: Engine) -> None:
    settings = settings_for(tmp_path, host="0.0.0.0", token=TOKEN, allowed_hosts=["logdx.internal", "*.example.com"])
    with LoopbackApp(settings, engine) as app, httpx.Client(base_url=app.url) as c:
        for host in ("logdx.internal:8077", "logdx.internal.", "gpu.example.com", "10.1.2.3:8077", "[fd00::1]:8077"):
            assert c.get("/healthz", headers={"host": host}).status_code == 200, host
        for host in ("example.com", "logdx.internal.evil", "evil.com:8077"):
            refused(c.get("/healthz", headers={"host": host}), 400, "host_not_allowed")


# --- the schema, the docs, the token -------------------------------------------------------------------


@pytest.mark.integration  # a server on loopback
def test_schema_and_docs_need_the_token(token_app: LoopbackApp) -> None:
    with httpx.Client(base_url=token_app.url) as anon:
        for path in ("/openapi.json", "/docs", "/redoc"):
            refused(anon.get(path), 401, "unauthorized")
        assert anon.get("/healthz").status_code == 200
    with httpx.Client(base_url=token_app.url, headers={"authorization": f"Bearer {TOKEN}"}) as c:
        schema = c.get("/openapi.json").json()
        assert "/v1/jobs/{job_id}/logs" in schema["paths"] and "/openapi.json" not in schema["paths"]
        assert "swagger-ui" in c.get("/docs").text and c.get("/redoc").status_code == 200
        # With the token, a plain text upload needs nothing else; a foreign Origin is still refused.
        assert c.post("/v1/jobs/tok/logs", content=b"hello\n", headers={"content-type": "text/plain"}).status_code == 200
        refused(c.post("/v1/jobs/tok/logs", content=b"x\n", headers={"origin": EVIL}), 403, "origin_not_allowed")
        refused(c.post("/v1/jobs/tok/logs", content=b"x\n", headers={"origin": "null"}), 403, "origin_not_allowed")
    with httpx.Client(base_url=token_app.url) as anon:  # no token: 401 before anything else is said
        refused(anon.post("/v1/jobs/tok/logs", content=b"x\n"), 401, "unauthorized")


# --- bounded metrics -------------------------------------------------------------------------------------


def _series(text: str) -> set[str]:
    return {line.split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def _flood(c: httpx.Client, seed: int, n: int = 300) -> int:
    """Random methods and random paths (the audit's 20,000 requests made 360,000 series); returns
    how many requests had a method outside HTTP's."""
    rng = random.Random(seed)
    methods = 0
    for i in range(n):
        path = "/" + "/".join(rng.choice(["v1", "jobs", "x", "%2e%2e", "a" * rng.randint(1, 40), str(rng.random())])
                              for _ in range(rng.randint(1, 4)))
        if i % 2:
            methods += 1
            refused(c.request("".join(rng.choices(string.ascii_uppercase, k=rng.randint(3, 12))), path),
                    405, "method_not_allowed")
        else:
            assert c.get(path + "/zz").status_code == 404, path
    return methods


@pytest.mark.integration  # a server on loopback
def test_random_methods_and_paths_add_no_series(open_app: LoopbackApp) -> None:
    with httpx.Client(base_url=open_app.url) as c:
        first = _flood(c, seed=1)
        c.get("/metrics")
        before = c.get("/metrics").text
        second = _flood(c, seed=2)
        after = c.get("/metrics").text
    assert _series(after) == _series(before), sorted(_series(after) ^ _series(before))
    assert f'logdx_http_refused_total{{reason="method"}} {float(first + second)}' in after
    methods = {m for s in _series(after) for m in re.findall(r'method="([^"]*)"', s)}
    assert methods <= {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "other"}, methods
    routes = {m for s in _series(after) for m in re.findall(r'route="([^"]*)"', s)}
    assert all(r == "unmatched" or r in {"/metrics", "/readyz", "/healthz"} or r.startswith(("/v1/", "/openapi", "/jobs"))
               for r in routes) and not any("zz" in r for r in routes), routes
    assert len(after) < 40_000, len(after)


# --- the pieces, without a server -------------------------------------------------------------------------


def test_host_policy_by_bind() -> None:
    loop = HostPolicy.from_settings(ServerSettings())
    assert loop.allows("127.0.0.1") and loop.allows("localhost") and loop.allows("::1") and loop.allows("127.9.9.9")
    assert not loop.allows("10.0.0.5") and not loop.allows("evil.example") and not loop.allows("0.0.0.0")
    named = HostPolicy.from_settings(ServerSettings(host="logdx.lan", token="t", allowed_hosts=["*.corp.example"]))
    assert named.allows("logdx.lan") and named.allows("a.b.corp.example") and not named.allows("corp.example")
    assert not named.allows("192.168.1.1")
    anything = HostPolicy.from_settings(ServerSettings(host="10.0.0.5", token="t", allowed_hosts=["*"]))
    assert anything.allows("whatever.example") and anything.allows("10.0.0.5") and not anything.allows("10.0.0.6")


def test_host_header_parsing() -> None:
    assert split_host("Example.COM:8077") == ("example.com", 8077)
    assert split_host("[::1]:80") == ("::1", 80) and split_host("localhost") == ("localhost", None)
    for bad in ("a:b", "a:99999", "user@host", "host/path", "", "[::1", "a b", "a\x00b", "[x]:80", "h:1:2"):
        assert split_host(bad) is None, bad


def test_same_origin_and_simple_requests() -> None:
    assert same_origin("http://127.0.0.1:8077", ("127.0.0.1", 8077))
    assert same_origin("https://logdx.lan", ("logdx.lan", None))
    assert not same_origin("http://127.0.0.1:3000", ("127.0.0.1", 8077))
    assert not same_origin("null", ("127.0.0.1", 8077)) and not same_origin("file://", ("127.0.0.1", None))
    simple = [{}, {"content-type": "text/plain; charset=utf-8"}, {"content-type": "multipart/form-data; boundary=x"},
              {"content-type": "application/x-www-form-urlencoded", "accept": "*/*", "cookie": "a=b"}]
    assert all(is_browser_simple(Headers(h)) for h in simple)
    not_simple = [{"content-type": "application/json"}, {"content-type": "application/x-ndjson"},
                  {"authorization": "Bearer x"}, {"x-logdx-rank": "3"}, {"content-encoding": "gzip"},
                  {"idempotency-key": "k"}, {"content-type": "application/octet-stream"}]
    assert not any(is_browser_simple(Headers(h)) for h in not_simple)


def test_guard_order_and_token_setting() -> None:
    guard = RequestGuard(lambda *a: None, ServerSettings())
    h = Headers({"host": "evil.example", "origin": EVIL})
    assert guard.refusal("BREW", h)[0] == "method"
    assert guard.refusal("POST", h)[0] == "host"
    assert guard.refusal("POST", Headers({"host": "127.0.0.1", "origin": EVIL}))[0] == "origin"
    assert guard.refusal("POST", Headers({"host": "127.0.0.1"}))[0] == "simple_request"
    assert guard.refusal("GET", Headers({"host": "127.0.0.1"})) is None
    with_token = RequestGuard(lambda *a: None, ServerSettings(token="t"))
    assert with_token.refusal("POST", Headers({"host": "127.0.0.1"})) is None  # the route answers 401


def test_any_host_needs_a_token() -> None:
    with pytest.raises(ServeError, match="needs a token"):
        check_bind(ServerSettings(allowed_hosts=["*"]))
    with pytest.raises(ServeError, match="without a token"):
        check_bind(ServerSettings(host="0.0.0.0"))
    check_bind(ServerSettings(host="0.0.0.0", token="t", allowed_hosts=["*"]))
    check_bind(ServerSettings(allowed_hosts=["logdx.lan"]))
