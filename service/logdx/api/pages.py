"""The job pages: `GET /jobs` (recent jobs, filtered), `GET /jobs/{id}` (one job's diagnosis, its
timeline, what was done), `/login` and `/logout` (a session cookie from a token: `cookies.py`).

Same auth as the API: a reader may look, a shipper its tenant's jobs, feedback needs an operator (the
page posts to `/v1/reports/{id}/feedback`); a token with a tenant sees only its tenant's jobs, and of a
culprit node's history only its own jobs. A browser without a session is sent to the login form.
Each page is drawn from the view stored with the job's latest report (`logdx.web.store`), never from
its log; what was done (alerts, actions, the breaker, the culprit's history) is read at request time.
"""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import parse_qs, quote

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from logdx.access.auth import JOB_READ, OPERATE, READ, Principal
from logdx.act.report import Report
from logdx.api.cookies import COOKIE, LIFETIME_S, identify
from logdx.api.deps import ServicesDep
from logdx.api.services import Services
from logdx.jobs.limits import check_job_id
from logdx.web.render import (
    STATIC_DIR,
    STATIC_PREFIX,
    ActionRow,
    AlertRow,
    Done,
    NodeHistory,
    Viewer,
    render_job_body,
    render_jobs_page,
    render_login_page,
    render_page,
)
from logdx.web.view import MAX_TEMPLATES, view_from_report
from logdx.wire.errors import ApiError

__all__ = ["pages_router", "static_files", "STATIC_PREFIX"]

pages_router = APIRouter(include_in_schema=False)
_MAX_LOGIN_BODY = 8192
_LIST_LIMIT = 200
# The page loads only what this server sends; inline styles place the timeline's markers.
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
_HEADERS = {"Content-Security-Policy": _CSP, "Cache-Control": "no-store", "Referrer-Policy": "same-origin",
            "X-Content-Type-Options": "nosniff"}


def static_files() -> StaticFiles:
    """The pages' and API docs' scripts and styles, from the package."""
    return StaticFiles(directory=STATIC_DIR)


class _SignIn(Exception):
    """The browser has no valid session: send it to the login form."""


def _caller(request: Request, services: Services, allowed: frozenset[str], what: str) -> Principal:
    try:
        principal = identify(services.auth, services.cookies, request.headers.get("authorization"),
                             request.cookies.get(COOKIE))
    except ApiError as e:
        if e.status == 401 and "authorization" not in request.headers:
            raise _SignIn() from None
        raise
    services.auth.check(principal, allowed, what)
    request.state.principal = principal
    return principal


def _viewer(request: Request, services: Services, principal: Principal) -> Viewer:
    try:
        services.auth.check(principal, OPERATE, "give feedback")
        can = True
    except ApiError:
        can = False
    signed_in = principal.authenticated and "authorization" not in request.headers
    return Viewer(name=principal.name if principal.authenticated else "", can_feedback=can, signed_in=signed_in)


def _to_login(request: Request) -> RedirectResponse:
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return RedirectResponse(f"/login?next={quote(target, safe='')}", status_code=303)


def _html(body: str, status: int = 200) -> HTMLResponse:
    return HTMLResponse(body, status_code=status, headers=_HEADERS)


# --- one job --------------------------------------------------------------------------------------


@pages_router.get("/jobs/{job_id}", response_class=HTMLResponse)
def job_page(job_id: str, request: Request, services: ServicesDep) -> Response:
    try:
        principal = _caller(request, services, JOB_READ, "read jobs")
    except _SignIn:
        return _to_login(request)
    job_id = services.job_for(principal, check_job_id(job_id)).id
    report, body = _body_of(services, job_id)
    return _html(render_page(job_id, report, body, _done(services, job_id, report, principal),
                             _viewer(request, services, principal)))


def _body_of(services: Services, job_id: str) -> tuple[Report, str]:
    """The job's latest report and its page's log part, as rendered when it was diagnosed; drawn again
    from the stored view, or from the report alone, when there is none (another version of logdx)."""
    report_id = services.db.query_value("SELECT last_report_id FROM api_jobs WHERE job_id = ?", (job_id,))
    report = services.jobs.get_report(report_id or "")
    if report is None:
        raise ApiError(409, "no_diagnosis_yet",
                       f"job {job_id} has no diagnosis yet: its page comes with the first (GET /v1/jobs/{job_id})")
    views = services.jobs.views
    body = views.body(job_id, report.id)
    if body is not None:
        return report, body
    view = views.get(job_id)
    if view is None or view.report.id != report.id:
        job = services.jobs.get(job_id)
        assert job is not None
        view = view_from_report(job_id, report, services.jobs.templates(job, MAX_TEMPLATES, False))
    return report, render_job_body(view)


def _done(services: Services, job_id: str, report: Report, principal: Principal) -> Done:
    actions = services.responder.actions
    nodes = []
    for host in report.culprits.hosts[:8]:
        info = actions.nodes.get(host, recent=0)
        if info is not None:
            # A node is shared: a tenant's viewer sees how often and in how many jobs it failed (the sign of
            # bad hardware), and only its own jobs by name.
            jobs = [j if services.tenants.may_read(principal, j) else "" for j in info.jobs[:50]]
            nodes.append(NodeHistory(node=info.node, state=info.state, events=info.events, jobs=jobs,
                                     failure_types=info.failure_types))
    return Done(
        served=True,
        dry_run=actions.settings.dry_run,
        alerts=[AlertRow(kind=a["kind"], destination=a["destination"], status=a["status"], attempts=a["attempts"],
                         last_error=a["last_error"]) for a in services.responder.outbox.history(job_id)],
        actions=[ActionRow(ts=r.ts, node=r.node, action=r.action, actuator=r.actuator, dry_run=r.dry_run,
                           outcome=r.outcome, detail=r.detail) for r in actions.audit(job_id)],
        breaker=actions.nodes.breaker().to_dict(),
        nodes=nodes,
    )


# --- the list ---------------------------------------------------------------------------------------


@pages_router.get("/", include_in_schema=False)
def root() -> RedirectResponse:
    """The service's address opened in a browser: its jobs."""
    return RedirectResponse("/jobs", status_code=303)


@pages_router.get("/jobs", response_class=HTMLResponse)
def jobs_page(
    request: Request,
    services: ServicesDep,
    status: Annotated[str, Query(max_length=32)] = "",
    category: Annotated[str, Query(max_length=32)] = "",
    host: Annotated[str, Query(max_length=253)] = "",
) -> Response:
    try:
        principal = _caller(request, services, READ, "list jobs")
    except _SignIn:
        return _to_login(request)
    rows = [_job_row(services, item)
            for item in services.jobs.list_jobs(None, _LIST_LIMIT, 0, services.tenant_jobs(principal))]
    options = {"status": sorted({r["status"] for r in rows}), "category": sorted({r["category"] for r in rows
                                                                                   if r["category"]}),
               "host": sorted({h for r in rows for h in r["hosts"]})}
    filters = {"status": status, "category": category, "host": host}
    chosen = [r for r in rows if (not status or r["status"] == status) and (not category or r["category"] == category)
              and (not host or host in r["hosts"])]
    return _html(render_jobs_page(chosen, filters, options, _viewer(request, services, principal)))


def _job_row(services: Services, item: dict[str, Any]) -> dict[str, Any]:
    d = item.get("diagnosis") or {}
    report = services.jobs.get_report(d.get("report_id") or "") if d else None
    return {"job_id": item["job_id"], "state": item["state"], "lines": item["lines"], "updated_at": item["updated_at"],
            "status": d.get("status") or "no diagnosis", "category": d.get("category") or "",
            "failure_type": d.get("failure_type"), "action": d.get("action"),
            "hosts": report.culprits.hosts if report is not None else []}


# --- signing in -------------------------------------------------------------------------------------


def _safe_next(value: str) -> str:
    """Only a path of this server (never `//elsewhere` nor a scheme): no open redirect."""
    if not value.startswith("/") or value.startswith("//") or "\\" in value or any(c < " " for c in value):
        return "/jobs"
    return value


@pages_router.get("/login", response_class=HTMLResponse)
def login_form(next: Annotated[str, Query(max_length=2000)] = "/jobs") -> Response:
    return _html(render_login_page(_safe_next(next)))


@pages_router.post("/login", response_class=HTMLResponse)
async def login(request: Request, services: ServicesDep) -> Response:
    body = await request.body()
    if len(body) > _MAX_LOGIN_BODY:
        raise ApiError(413, "request_too_large", "a login form is a token and a path")
    form = parse_qs(body.decode("utf-8", "replace"), max_num_fields=4)
    token = (form.get("token") or [""])[0].strip()
    next_path = _safe_next((form.get("next") or ["/jobs"])[0])
    if not services.auth.required:
        return RedirectResponse(next_path, status_code=303)  # no tokens: nothing to sign in to
    try:
        principal = services.auth.identify(f"Bearer {token}")
    except ApiError:
        return _html(render_login_page(next_path, "That token is not known to this server."), 401)
    assert services.cookies is not None
    response = RedirectResponse(next_path, status_code=303)
    response.set_cookie(COOKIE, services.cookies.issue(principal), max_age=LIFETIME_S, httponly=True,
                        samesite="strict", secure=_https(request, services), path="/")
    return response


@pages_router.post("/logout")
def logout(request: Request, services: ServicesDep) -> Response:
    """Sign out: the session ends in the shared store (every replica refuses the cookie from now on)."""
    cookie = request.cookies.get(COOKIE)
    if cookie and services.cookies is not None:
        services.cookies.revoke(cookie)
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict", secure=_https(request, services))
    return response


def _https(request: Request, services: Services) -> bool:
    return request.url.scheme == "https" or services.settings.server.public_url.startswith("https://")
