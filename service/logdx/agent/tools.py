"""What `logdx mcp` offers an agent, as plain methods with typed answers (the MCP server in
`server.py` only registers them): no protocol here, so each is usable and testable on its own.

Read-only (always): `diagnose` a file, a folder or several files (the same reading as the
`diagnose` command) or a job of a running `logdx serve`; a `report`; a job's `templates` and the
`evidence` of a diagnosis; the `nodes` history; `search_incidents` among past incidents; `jobs`.
Changing something (only with `mcp.allow_actions`): `feedback` (learn from a report), `act` on a
report (cordon / restart through `logdx.act`: the policy, dry run, budget and breaker all apply) and
`uncordon`.

In read-only mode nothing is written: the reports of this process's diagnoses are kept in memory
(the last `_RECENT`), so their ids still resolve. With actions allowed they are stored like the
CLI's, and the nodes they name feed `logdx nodes`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field

from logdx.act.report import EvidenceItem, Report, RootCause
from logdx.api.nodes import ActionOut, NodeOut
from logdx.api.schemas import IncidentOut, JobItem, TemplateItem

if TYPE_CHECKING:
    from logdx.cli.diagnose import Diagnosed
    from logdx.config import Settings
    from logdx.incidents import IncidentStore
    from logdx.pipeline import Engine

_RECENT = 32  # diagnoses of this process kept in memory (their templates and context)


class ToolFailure(Exception):
    """What the agent did wrong or what is not there: its message goes back to the agent."""


# -- answers ----------------------------------------------------------------------------------------


class Templates(BaseModel):
    source: Literal["report", "job"] = Field(description="a diagnosis of this process (report id) or a service's job")
    id: str
    total: int = Field(description="templates in the whole log")
    templates: list[TemplateItem] = Field(description="most frequent first")


class Evidence(BaseModel):
    report_id: str
    status: str
    label: str = Field(description="category/failure_type, or the status (healthy, unknown, empty) when nothing failed")
    action: str
    confidence: float
    root_cause: RootCause | None
    culprits: dict[str, Any]
    evidence: list[EvidenceItem] = Field(description="the root line first, then what corroborates it and the symptoms")
    excerpt: list[str] = Field(default_factory=list, description="raw lines around the root cause (this process's "
                               "diagnoses only)")
    near_templates: list[str] = Field(default_factory=list, description="masked error templates near the failure")
    explanation: str
    hint: str
    notes: list[str]


class Nodes(BaseModel):
    nodes: list[NodeOut]


class IncidentHit(BaseModel):
    similarity: float | None = Field(description="cosine similarity (None: a text match, retrieval is off)")
    incident: IncidentOut


class IncidentHits(BaseModel):
    query: str
    hits: list[IncidentHit]


class Jobs(BaseModel):
    service: str
    jobs: list[JobItem]


class ActionsDone(BaseModel):
    job_id: str
    report_id: str
    dry_run: bool
    actions: list[ActionOut] = Field(description="what was done, dry run, skipped or refused, and why (audited)")
    alert_queued: bool
    errors: list[str]


# -- the toolbox --------------------------------------------------------------------------------------


class Toolbox:
    def __init__(self, settings: Settings, *, extra_rules: list[Path] | None = None, http: bool = False) -> None:
        self.settings = settings
        self.extra_rules = list(extra_rules or [])
        self.http = http  # over HTTP, paths are readable only under mcp.paths
        self.allow_actions = settings.mcp.allow_actions
        self._engine: Engine | None = None
        self._store: IncidentStore | None = None
        self._engine_lock = threading.Lock()
        self._diagnose_lock = threading.Lock()  # one diagnosis at a time: they are CPU-bound
        self._recent: OrderedDict[str, Diagnosed] = OrderedDict()
        self._retriever: Any = None

    # -- what the tools share ---------------------------------------------------------------------

    def engine(self) -> Engine:
        """Built once (rules, and the model stages the settings enable), on first use or by `warm`."""
        from logdx.faces import UsageError, build_engine

        with self._engine_lock:
            if self._engine is None:
                try:
                    self._engine = build_engine(self.settings, self.extra_rules)
                except UsageError as e:
                    raise ToolFailure(str(e)) from None
            return self._engine

    def warm(self) -> None:
        """Build the engine and warm the models (an OpenAI-compatible server gets its warm-up request)."""
        self.engine().warm_up()

    def store(self) -> IncidentStore:
        from logdx.incidents import IncidentStore
        from logdx.store import open_db

        with self._engine_lock:
            if self._store is None:
                engine = self._engine
                self._store = engine.incidents if engine is not None and engine.incidents is not None else \
                    IncidentStore(open_db(self.settings.store.location, self.settings.store.pool_size))
            return self._store

    def _readable(self, raw: str) -> str:
        path = Path(raw).expanduser()
        roots = [r.expanduser().resolve() for r in self.settings.mcp.paths]
        if not roots:
            if self.http:
                raise ToolFailure("reading paths over HTTP needs mcp.paths (the folders logs may be read from)")
            return str(path)
        resolved = path.resolve()
        if not any(resolved == r or r in resolved.parents for r in roots):
            raise ToolFailure(f"{raw}: outside the folders logdx may read (mcp.paths: "
                              f"{', '.join(str(r) for r in roots)})")
        return str(path)

    def _remember(self, diagnosed: Diagnosed) -> None:
        self._recent[diagnosed.report.id] = diagnosed
        while len(self._recent) > _RECENT:
            self._recent.popitem(last=False)

    # -- read-only tools --------------------------------------------------------------------------

    def diagnose(self, paths: list[str] | None = None, job_id: str | None = None, fmt: str = "auto",
                 exit_code: int | None = None) -> Report:
        """A log file, a folder or several files (one job), or the latest diagnosis of a service's job."""
        if bool(paths) == bool(job_id):
            raise ToolFailure("give either paths (files or folders of one job) or job_id (a job of logdx serve)")
        if job_id:
            return self._job_report(job_id)
        return self._diagnose_paths([self._readable(p) for p in paths or []], fmt, exit_code)

    def _diagnose_paths(self, paths: list[str], fmt: str, exit_code: int | None) -> Report:
        from logdx.cli.diagnose import diagnose_file, diagnose_files, keep
        from logdx.cli.inputs import collect
        from logdx.faces import UsageError
        from logdx.formats import FormatError
        from logdx.normalize import InputError

        engine = self.engine()
        try:
            with self._diagnose_lock:
                if len(paths) > 1 or Path(paths[0]).is_dir():
                    diagnosed = diagnose_files(engine, collect(paths, self.settings.input), fmt, exit_code)
                else:
                    diagnosed = diagnose_file(engine, paths[0], fmt, exit_code)
        except (UsageError, InputError, FormatError) as e:
            raise ToolFailure(str(e)) from None
        if diagnosed.report.status == "empty":
            raise ToolFailure(f"{', '.join(paths)}: no log lines to diagnose (empty input)")
        if self.allow_actions:
            keep(engine, diagnosed, ", ".join(str(Path(p).resolve()) for p in paths))
        self._remember(diagnosed)
        return diagnosed.report

    def report(self, report_id: str) -> Report:
        """A report: this process's, the store's, or the service's."""
        if report_id in self._recent:
            return self._recent[report_id].report
        stored = self.store().get_report(report_id)
        if stored is not None:
            return Report.model_validate(stored)
        if self._service_url():
            return Report.model_validate(self._service_get(f"/v1/reports/{report_id}", what=f"report {report_id}"))
        raise ToolFailure(f"no report {report_id!r}")

    def templates(self, report_id: str | None = None, job_id: str | None = None, errors_only: bool = True,
                  limit: int = 50) -> Templates:
        from logdx.api.jobs import template_dict

        if bool(report_id) == bool(job_id):
            raise ToolFailure("give either report_id (a diagnosis of this tool) or job_id (a job of logdx serve)")
        limit = max(1, min(limit, 1000))
        if job_id:
            doc = self._service_get(f"/v1/jobs/{job_id}/templates", what=f"job {job_id}",
                                    params={"errors_only": str(errors_only).lower(), "limit": limit})
            return Templates(source="job", id=job_id, total=doc["total"],
                             templates=[TemplateItem.model_validate(t) for t in doc["templates"]])
        diagnosed = self._recent.get(str(report_id))
        if diagnosed is None:
            raise ToolFailure(f"report {report_id!r} is not one of this tool's last {_RECENT} diagnoses: "
                              "diagnose the log again")
        chosen = [t for t in diagnosed.templates if t.error_bearing] if errors_only else diagnosed.templates
        chosen = sorted(chosen, key=lambda t: -t.count)[:limit]
        return Templates(source="report", id=str(report_id), total=len(diagnosed.templates),
                         templates=[TemplateItem.model_validate(template_dict(t)) for t in chosen])

    def evidence(self, report_id: str) -> Evidence:
        report = self.report(report_id)
        diagnosed = self._recent.get(report_id)
        context = diagnosed.context if diagnosed is not None else None
        label = f"{report.category}/{report.failure_type}" if report.status == "failed" else report.status
        return Evidence(
            report_id=report.id, status=report.status, label=label, action=report.action,
            confidence=report.confidence, root_cause=report.root_cause,
            culprits=report.culprits.model_dump(), evidence=report.evidence,
            excerpt=list(context.excerpt) if context is not None else [],
            near_templates=list(context.templates[:8]) if context is not None else [],
            explanation=report.explanation, hint=report.hint, notes=report.notes,
        )

    def nodes(self, node: str | None = None, blamed_only: bool = False, limit: int = 50) -> Nodes:
        from logdx.act.nodes import NodeBook

        book = NodeBook(self.store().db, self.settings.actions)
        if node:
            info = book.get(node)
            if info is None:
                raise ToolFailure(f"logdx has not seen node {node!r}")
            found = [info]
        else:
            found = book.list(blamed_only=blamed_only, limit=max(1, min(limit, 1000)))
        return Nodes(nodes=[NodeOut.model_validate(n.to_dict()) for n in found])

    def search_incidents(self, query: str, k: int = 5) -> IncidentHits:
        """Past incidents like `query` (a log line or a few): by meaning with retrieval on, else by words."""
        from logdx.incidents import mask_text

        query = query.strip()
        if not query:
            raise ToolFailure("query is empty: give a log line (or a few) to look up")
        k = max(1, min(k, 50))
        store = self.store()
        if self.settings.retrieval.enabled:
            masked = "\n".join(mask_text(line) for line in query.splitlines() if line.strip())
            found = self._retrieval(store).neighbours(masked, k=k, apply_threshold=False)
            hits = [IncidentHit(similarity=round(n.similarity, 4), incident=IncidentOut.model_validate(
                n.incident.to_json())) for n in found]
            return IncidentHits(query=query, hits=hits)
        words = {w for w in query.lower().split() if len(w) > 2}
        scored = []
        for inc in store.list():
            text = f"{inc.root_line} {inc.note}".lower()
            score = sum(1 for w in words if w in text)
            if score:
                scored.append((score, inc))
        scored.sort(key=lambda si: -si[0])
        return IncidentHits(query=query, hits=[IncidentHit(similarity=None, incident=IncidentOut.model_validate(
            inc.to_json())) for _, inc in scored[:k]])

    def _retrieval(self, store: IncidentStore) -> Any:
        engine = self.engine()
        if engine.diagnoser.retrieval is not None:
            return engine.diagnoser.retrieval
        with self._engine_lock:
            if self._retriever is None:
                from logdx.diagnose.retrieval import Retriever

                self._retriever = Retriever(store, self.settings.retrieval)
            return self._retriever

    def jobs(self, limit: int = 50) -> Jobs:
        doc = self._service_get("/v1/jobs", what="the job list", params={"limit": max(1, min(limit, 500))})
        items = [JobItem.model_validate(j) for j in doc.get("jobs", [])]
        return Jobs(service=self._service_url(), jobs=items)

    # -- the running service ----------------------------------------------------------------------

    def _service_url(self) -> str:
        s = self.settings
        return (s.mcp.service_url or s.server.public_url or f"http://127.0.0.1:{s.server.port}").rstrip("/")

    def _service_get(self, path: str, *, what: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        import httpx

        url = self._service_url()
        headers = {"Authorization": f"Bearer {self.settings.server.token}"} if self.settings.server.token else {}
        try:
            r = httpx.get(url + path, params=params, headers=headers, timeout=30.0)
        except httpx.HTTPError as e:
            raise ToolFailure(f"cannot reach logdx serve at {url} ({type(e).__name__}): is it running? "
                              "(mcp.service_url)") from None
        if r.status_code == 404:
            raise ToolFailure(f"logdx serve at {url} has no {what}")
        if r.status_code >= 400:
            raise ToolFailure(f"logdx serve at {url} answered {r.status_code} for {what}: {r.text[:300]}")
        return r.json()

    def _job_report(self, job_id: str) -> Report:
        detail = self._service_get(f"/v1/jobs/{job_id}", what=f"job {job_id}")
        report = detail.get("report")
        state, lines = detail.get("state"), detail.get("lines")
        if report is None:
            raise ToolFailure(
                f"job {job_id} ({state}, {lines} lines) has no diagnosis yet: logdx serve diagnoses a job when a "
                "root cause appears, when it hangs, and when it ends (POST /v1/jobs/{id}/end)")
        out = Report.model_validate(report)
        kind = detail["reports"][0]["kind"] if detail.get("reports") else "latest"
        out.notes.insert(0, f"job {job_id} ({state}, {lines} lines): the {kind} diagnosis of logdx serve "
                            f"at {self._service_url()}")
        return out

    # -- tools that change something (mcp.allow_actions) ------------------------------------------

    def _need_actions(self) -> None:
        if not self.allow_actions:
            raise ToolFailure("this logdx mcp is read-only: start it with --allow-actions (mcp.allow_actions)")

    def feedback(self, report_id: str, category: str, failure_type: str, action: str | None = None,
                 note: str | None = None) -> IncidentOut:
        """A person confirmed or corrected a report: it becomes an incident retrieval finds next time."""
        from logdx.incidents import IncidentError

        self._need_actions()
        store = self.store()
        if store.get_report(report_id) is None:
            raise ToolFailure(f"no stored report {report_id!r}")
        try:
            inc = store.feedback(report_id, category, failure_type, action, note)
        except IncidentError as e:
            raise ToolFailure(str(e)) from None
        return IncidentOut.model_validate(inc.to_json())

    def act(self, report_id: str, job_id: str) -> ActionsDone:
        """Cordon / restart as the policy allows for a stored report, and alert: `logdx.act`, as the service does."""
        from logdx.act.respond import Responder

        self._need_actions()
        report = self.report(report_id)
        responder = Responder(self.store().db, self.settings, public_url=self.settings.server.public_url)
        try:
            response = responder.respond(job_id, report, seen_hosts=report.culprits.hosts)
        finally:
            responder.close(deliver_due=True)
        return ActionsDone(
            job_id=job_id, report_id=report.id, dry_run=self.settings.actions.dry_run,
            actions=[ActionOut.model_validate(a.to_dict()) for a in response.actions],
            alert_queued=response.alert_queued, errors=response.errors)

    def uncordon(self, node: str, by: str, reason: str = "") -> ActionOut:
        from logdx.act.respond import Responder

        self._need_actions()
        if not by.strip():
            raise ToolFailure("by: who decided the node is healthy (audited)")
        responder = Responder(self.store().db, self.settings, public_url=self.settings.server.public_url)
        try:
            if responder.actions.nodes.get(node) is None:
                raise ToolFailure(f"logdx has not seen node {node!r}")
            rec = responder.uncordon(node, by, reason)
        finally:
            responder.close(deliver_due=True)
        return ActionOut.model_validate(rec.to_dict())
