"""The job page in a real browser (issue 22): Debian's `chromium`, headless, driven by playwright's
Python package (never a browser playwright downloads), against the real app on uvicorn.

Skipped, saying why, only where Chromium or playwright is absent (`make browser` installs both).
Every request the browser makes is recorded and must go to the server that sent the page (or, for
the single file, nowhere). Screenshots are kept in $LOGDX_TEST_ARTIFACTS (default
`.cache/test-artifacts`)."""

from __future__ import annotations

import io
import os
import shutil
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from api_server import REPO, LoopbackApp
from logdx.access.auth import token_digest
from logdx.config import Settings
from logdx.pipeline import Engine
from logdx.synth import generate
from logdx.synth.generate import Truth
from logdx.web.render import Done, render_job_page
from logdx.web.view import build_view
from per_host_logs import CULPRIT, HOSTS, write_host_files

pytestmark = pytest.mark.integration

CHROMIUM = os.environ.get("LOGDX_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
try:
    from playwright.sync_api import Browser, Page, Request, sync_playwright
except ImportError:  # pragma: no cover - make browser installs it
    sync_playwright = None  # type: ignore[assignment]

if CHROMIUM is None or sync_playwright is None:
    pytest.skip("the browser tests need Debian's chromium and playwright's Python package: run `make browser` "
                f"(chromium: {CHROMIUM or 'absent'}; playwright: {'present' if sync_playwright else 'absent'})",
                allow_module_level=True)

ARTIFACTS = Path(os.environ.get("LOGDX_TEST_ARTIFACTS") or REPO / ".cache" / "test-artifacts")
OPERATOR = "secret-of-oncall-0123456789abcdef"
RANKS, GPUS_PER_HOST = 32, 8
PHONE = {"width": 390, "height": 844}
# A job id as `diagnose DIR` or a scheduler makes them: long, one word, nowhere to break.
LONG_JOB = "pretrain-llama-70b-stage2-lr3e-4-bs2048-a100-eu-west-4-pool-b-run-0042"


@pytest.fixture(scope="module")
def job() -> tuple[bytes, Truth]:
    buf = io.StringIO()
    truth = generate(buf, scenario="xid79", seed=21, ranks=RANKS, gpus_per_host=GPUS_PER_HOST, lines=20000)
    return buf.getvalue().encode(), truth


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory, job: tuple[bytes, Truth]) -> Iterator[LoopbackApp]:
    settings = Settings.model_validate({
        "data_dir": str(tmp_path_factory.mktemp("browser")), "llm": {"enabled": False},
        "retrieval": {"enabled": False}, "server": {"early_diagnosis_delay_s": 3600, "tokens": [
            {"name": "oncall", "role": "operator", "sha256": token_digest(OPERATOR)}]}})
    with LoopbackApp(settings, Engine.create(settings)) as app:
        with httpx.Client(base_url=app.url, headers={"authorization": f"Bearer {OPERATOR}"}, timeout=120) as c:
            assert c.post("/v1/jobs/train-7b/logs", content=job[0],
                          headers={"content-type": "text/plain"}).status_code == 200
            assert c.post("/v1/jobs/train-7b/end", json={}).status_code == 200
            # Each node's own file, as a collector ships them: its lines name no rank, the header its host.
            for path in write_host_files(tmp_path_factory.mktemp("hosts")):
                assert c.post(f"/v1/jobs/{LONG_JOB}/logs", content=path.read_bytes(),
                              headers={"content-type": "text/plain", "x-logdx-host": path.stem}).status_code == 200
            assert c.post(f"/v1/jobs/{LONG_JOB}/end", json={}).status_code == 200
        yield app


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


class Watched:
    """A page whose every request is recorded; anything for another host is aborted and noted."""

    def __init__(self, page: Page, allowed_host: str | None) -> None:
        self.page = page
        self.allowed_host = allowed_host  # None: a file from disk, which may ask nobody
        self.requests: list[str] = []
        self.outside: list[str] = []
        self.errors: list[str] = []
        page.route("**/*", self._route)
        page.on("pageerror", lambda e: self.errors.append(str(e)))

    def _route(self, route: Any, request: Request) -> None:
        self.requests.append(request.url)
        parts = urlsplit(request.url)
        if parts.scheme in ("data", "blob") or (parts.scheme == "file" and self.allowed_host is None):
            route.continue_()
            return
        if self.allowed_host is None or parts.netloc != self.allowed_host:
            self.outside.append(request.url)
            route.abort()
            return
        route.continue_()


def _watched(browser: Browser, host: str | None) -> Watched:
    return Watched(browser.new_page(viewport={"width": 1400, "height": 1000}), host)


def _signed_in(browser: Browser, app: LoopbackApp, viewport: dict[str, int] | None = None) -> Watched:
    w = Watched(browser.new_page(viewport=viewport or {"width": 1400, "height": 1000}), urlsplit(app.url).netloc)
    w.page.goto(f"{app.url}/jobs/train-7b")
    assert "/login" in w.page.url  # no session yet: the login form, no token in any URL
    w.page.fill("input[name=token]", OPERATOR)
    w.page.click("button[type=submit]")
    w.page.wait_for_url(f"{app.url}/jobs/train-7b")
    assert all(OPERATOR not in url for url in w.requests)
    return w


def test_the_job_page_in_a_browser(browser: Browser, app: LoopbackApp, job: tuple[bytes, Truth]) -> None:
    _, truth = job
    w = _signed_in(browser, app)
    page = w.page
    page.wait_for_selector("#loss-chart canvas")  # uPlot drew the loss
    verdict = page.locator("#verdict")
    assert verdict.is_visible() and truth.failure_type in verdict.inner_text()
    assert truth.culprit_hosts[0] in page.locator("#culprit").inner_text()
    root = page.locator("#root-line pre")
    assert root.is_visible() and root.inner_text().strip() == truth.root_line

    lanes = page.locator("details.lane")
    named = [h for h in lanes.evaluate_all("els => els.map(e => e.dataset.host)") if h]
    assert sorted(named) == sorted(truth.hosts)  # one lane per host
    marker = page.locator("#root-marker")
    assert marker.count() == 1 and marker.is_visible()
    lane_of_root = marker.evaluate("e => e.closest('details.lane').dataset.host")
    assert lane_of_root == truth.culprit_hosts[0]
    assert page.locator(".ev.cascade").count() > 0
    page.click("#show-cascade")
    assert page.locator(".lanes.linked").count() == 1
    whole = marker.bounding_box()
    page.click("#zoom")  # the lines where the job died, across the width: the root moves left, stays shown
    zoomed = marker.bounding_box()
    assert whole and zoomed and zoomed["x"] < whole["x"] - 100 and marker.is_visible()
    assert page.locator("#zoom[aria-pressed=true]").count() == 1

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "job-page.png"), full_page=True)

    items = page.locator("li.evidence-item")
    total = items.count()
    assert total > 1
    page.fill("#evidence-search", "Xid")
    shown = items.evaluate_all("els => els.filter(e => !e.hidden).map(e => e.textContent)")
    assert 0 < len(shown) < total and all("xid" in t.lower() for t in shown)
    page.fill("#evidence-search", "")
    assert items.evaluate_all("els => els.filter(e => !e.hidden).length") == total


    report_id = page.locator("#feedback-form").get_attribute("data-report")
    page.check("input[name=verdict][value=correct]")
    page.select_option("select[name=failure_type]", "infrastructure/ecc_error")
    page.fill("input[name=note]", "reseated, it was ECC")
    page.click("#feedback-form button[type=submit]")
    page.locator("#feedback-result", has_text="Thank you").wait_for()
    stored = [i for i in app.services.incidents.list(source="feedback") if i.report_id == report_id]
    assert [(i.failure_type, i.note) for i in stored] == [("ecc_error", "reseated, it was ECC")]

    page.check("input[name=verdict][value=false_alarm]")  # on second thought: the job did not fail at all
    page.fill("input[name=note]", "the checker's own probe")
    page.click("#feedback-form button[type=submit]")
    page.locator("#feedback-result", has_text="false alarm").wait_for()
    assert "silenced" in page.locator("#feedback-result").inner_text()
    assert not [i for i in app.services.incidents.list(source="feedback") if i.report_id == report_id]

    assert not w.outside, w.outside
    assert not w.errors, w.errors
    page.close()


def test_the_job_list_and_the_docs_load_nothing_from_elsewhere(browser: Browser, app: LoopbackApp) -> None:
    w = _signed_in(browser, app)
    w.page.goto(f"{app.url}/jobs")
    assert w.page.locator("a[href='/jobs/train-7b']").is_visible()
    w.page.goto(f"{app.url}/docs")
    w.page.wait_for_selector("#swagger-ui .information-container")  # swagger-ui rendered from the package
    w.page.goto(f"{app.url}/redoc")
    w.page.wait_for_selector("redoc .api-content, [role=navigation]", timeout=60_000)
    assert not w.outside, w.outside
    assert not w.errors, w.errors
    w.page.close()


def test_the_single_file_opens_from_disk_and_asks_nothing(browser: Browser, job: tuple[bytes, Truth],
                                                          tmp_path: Path) -> None:
    log, truth = job
    settings = Settings.model_validate({"data_dir": str(tmp_path), "llm": {"enabled": False},
                                        "retrieval": {"enabled": False}})
    session = Engine.create(settings).new_session()
    session.feed_lines(log.decode().splitlines())
    report = session.report()
    path = tmp_path / "report.html"
    path.write_text(render_job_page(build_view("train-7b", report, session), Done(served=False), inline=True))
    w = _watched(browser, None)
    w.page.goto(path.as_uri())
    w.page.wait_for_selector("#loss-chart canvas")
    assert w.page.locator("#root-line pre").inner_text().strip() == truth.root_line
    assert w.requests == [path.as_uri()] and not w.outside and not w.errors
    w.page.screenshot(path=str(ARTIFACTS / "job-file.png"))
    w.page.close()

    no_js = browser.new_context(java_script_enabled=False)  # the verdict, timeline and root line are HTML
    page = no_js.new_page()
    page.goto(path.as_uri())
    assert truth.failure_type in page.locator("#verdict").inner_text()
    assert page.locator("#root-line pre").inner_text().strip() == truth.root_line
    assert page.locator("#root-marker").is_visible()
    no_js.close()


# -- issue 33: the page's papercuts ------------------------------------------------------------------


def _root_line_shown(page: Page) -> bool:
    """The root line lies inside the visible part of its context box (opened on it, not below its fold)."""
    return bool(page.locator("pre.context").evaluate("""box => {
        const root = box.querySelector('.ctx.root'), b = box.getBoundingClientRect(), r = root.getBoundingClientRect();
        return r.height > 0 && r.top >= b.top && r.bottom <= b.top + box.clientHeight;
    }"""))


def _fits(page: Page) -> tuple[int, int]:
    return page.evaluate("[document.scrollingElement.scrollWidth, window.innerWidth]")


@pytest.mark.parametrize("viewport", [{"width": 1400, "height": 1000}, PHONE], ids=["desktop", "phone"])
def test_the_context_box_opens_on_the_root_line(browser: Browser, app: LoopbackApp, viewport: dict[str, int]) -> None:
    w = _signed_in(browser, app, viewport)
    page = w.page
    page.wait_for_selector("#loss-chart canvas")
    box = page.locator("pre.context")
    lines = box.locator(".ctx").count()
    assert lines > 30 and box.evaluate("b => b.scrollHeight > b.clientHeight")  # a box that needs scrolling
    assert _root_line_shown(page)
    assert page.evaluate("window.scrollY") == 0  # the box scrolled, not the page
    assert not w.errors, w.errors
    page.close()


def test_a_phone_shows_the_jobs_and_the_job_page_without_sideways_scrolling(browser: Browser,
                                                                            app: LoopbackApp) -> None:
    w = _signed_in(browser, app, PHONE)
    for path in ("/jobs", "/jobs/train-7b", f"/jobs/{LONG_JOB}"):
        w.page.goto(f"{app.url}{path}")
        w.page.wait_for_load_state("load")
        width, inner = _fits(w.page)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        w.page.screenshot(path=str(ARTIFACTS / f"phone{path.replace('/', '-')[:40]}.png"), full_page=True)
        assert width <= inner, f"{path}: {width}px wide on a {inner}px screen"
    w.page.goto(f"{app.url}/jobs")
    table = w.page.locator("table.jobs")
    assert table.is_visible() and w.page.locator(f"a[href='/jobs/{LONG_JOB}']").count() == 1
    assert not w.outside and not w.errors, (w.outside, w.errors)
    w.page.close()


def test_a_job_shipped_per_host_has_a_progress_bar_on_every_host(browser: Browser, app: LoopbackApp) -> None:
    w = _signed_in(browser, app)
    w.page.goto(f"{app.url}/jobs/{LONG_JOB}")
    for host in HOSTS:
        bar = w.page.locator(f"details.lane[data-host='{host}'] .host-row .bar")
        assert bar.count() == 1 and bar.is_visible(), host
    widths = {h: w.page.locator(f"details.lane[data-host='{h}'] .host-row .bar").bounding_box() for h in HOSTS}
    assert all(widths[h] and widths[CULPRIT] and widths[CULPRIT]["width"] < widths[h]["width"]  # type: ignore[index]
               for h in HOSTS if h != CULPRIT)  # the culprit's training stopped first
    w.page.close()


def _pixels(png: bytes) -> tuple[int, int, list[bytes]]:
    """An 8-bit RGB(A) PNG (what Chromium's screenshots are) as its rows of RGB pixels."""
    pos, size, data, colour = 8, (0, 0), b"", 2
    while pos < len(png):
        (n,), kind = struct.unpack(">I", png[pos:pos + 4]), png[pos + 4:pos + 8]
        body, pos = png[pos + 8:pos + 8 + n], pos + 12 + n
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and colour in (2, 6), (depth, colour)
            size = (width, height)
        elif kind == b"IDAT":
            data += body
    bpp = 3 if colour == 2 else 4
    raw, stride = zlib.decompress(data), size[0] * bpp
    rows, prev, at = [], bytearray(stride), 0
    for _ in range(size[1]):
        kind_, line, at = raw[at], bytearray(raw[at + 1:at + 1 + stride]), at + 1 + stride
        for x in range(stride):
            a, b, c = (line[x - bpp] if x >= bpp else 0), prev[x], (prev[x - bpp] if x >= bpp else 0)
            p = a + b - c
            pred = [0, a, b, (a + b) // 2, a if abs(p - a) <= abs(p - b) and abs(p - a) <= abs(p - c)
                    else b if abs(p - b) <= abs(p - c) else c][kind_]
            line[x] = (line[x] + pred) & 255
        rows.append(b"".join(bytes(line[x:x + 3]) for x in range(0, stride, bpp)))
        prev = line
    return size[0], size[1], rows


def _drawn(page: Page, selector: str, text: str | None = None) -> tuple[int, int, list[bytes]]:
    """The pixels of the first `selector`, as it is or with `text` in it instead (same place, same style)."""
    el = page.locator(selector).first
    if text is not None:
        el.evaluate("(e, t) => { e.textContent = t; }", text)
    return _pixels(el.screenshot(animations="disabled"))


def test_the_timeline_marks_are_glyphs_debians_fonts_have(browser: Browser, tmp_path: Path) -> None:
    """Issue 33: `⏹` (stopped first) was an empty box with Debian's fonts. Each mark must not look like
    the same element holding a codepoint no font has (U+0378, unassigned): the .notdef box."""
    buf = io.StringIO()
    generate(buf, scenario="nccl_hang", seed=4, ranks=16, gpus_per_host=8, lines=6000)
    settings = Settings.model_validate({"data_dir": str(tmp_path), "llm": {"enabled": False},
                                        "retrieval": {"enabled": False}})
    session = Engine.create(settings).new_session()
    session.feed_lines(buf.getvalue().splitlines())
    report = session.report()
    assert report.progress and report.progress.first_stopped and report.progress.first_stopped.ranks
    path = tmp_path / "hang.html"
    path.write_text(render_job_page(build_view("hang", report, session), Done(served=False), inline=True))
    page = browser.new_page(viewport={"width": 1400, "height": 1000}, device_scale_factor=4)
    page.goto(path.as_uri())
    for mark in (".row.stopped-first .stopped-first-mark", ".legend .first-sample", ".track .stop",
                 ".legend .stop-sample"):
        assert page.locator(mark).first.is_visible(), mark
        shown = _drawn(page, mark)
        assert len({px for row in shown[2] for px in (row[i:i + 3] for i in range(0, len(row), 3))}) > 2, mark
        tofu = _drawn(page, mark, "\u0378")
        assert _drawn(page, mark, "\u0379") == tofu  # the check itself: any missing codepoint draws this box
        like_tofu = shown == tofu
        assert not like_tofu, f"{mark} draws as the missing-glyph box"
    page.close()
