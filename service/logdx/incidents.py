"""Past incidents (the retrieval knowledge base) and stored reports, in the shared SQLite file.

An incident is a failure compressed to what retrieval and the LLM need: the root line, its
masked template, the masked templates near it, the label (category, failure type, action), what
kind of culprit it had, and a resolution note. Incidents come from the shipped seed knowledge base
(``kb/seed_incidents.jsonl``, loaded into an empty database), from JSONL imports, and from
feedback: a stored report that a human confirmed or corrected becomes an incident, so the next
similar failure is found by retrieval.

Tenants: an incident learned from a tenant's report is that tenant's (`tenant`), and so is a report
of a tenant's job. The root line and templates of an incident are log text, kept verbatim as data
(`LOG_TEXT_FIELDS`), never folded into its note. Diagnoses retrieve among the shared incidents only
(`tenant` ""; `list()` without a tenant), so one tenant's log text never reaches another's reports nor
steers their verdicts; an incident is shared by a cluster-wide operator's choice.

Masking: incidents are embedded from their masked text, like the query side
(``FailureContext.as_query()``). Lines that arrive raw (seed file, imports, feedback without a
stored context) go through ``mask_text``: the pipeline's own normaliser and mask, so both sides
mask alike. ``IncidentStore(masker=...)`` can override it.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from logdx.model import Action, Category, FailureContext, Label
from logdx.normalize import Normalizer
from logdx.patterns import mask
from logdx.store import Store, migrate
from logdx.taxonomy import default_action, is_canonical
from logdx.tenancy import TENANT

__all__ = [
    "SEED_PATH",
    "CulpritKind",
    "ImportResult",
    "Incident",
    "IncidentError",
    "IncidentIn",
    "IncidentStore",
    "LOG_TEXT_FIELDS",
    "SharedIncident",
    "mask_text",
]

SEED_PATH = Path(__file__).resolve().parent / "kb" / "seed_incidents.jsonl"
CulpritKind = Literal["node", "gpu", "rank", "none"]
Source = Literal["seed", "feedback", "import", "manual"]  # manual: added by hand (CLI, API)
# An incident's fields that hold log text (the root line as it was printed, its masked templates): data
# from whoever wrote the log, served as such (`logdx mcp` marks them untrusted), never instructions.
LOG_TEXT_FIELDS = ("root_line", "root_template", "templates")
_MAX_TEMPLATES = 8  # as many as FailureContext.as_query() embeds
_MAX_LINE = 2000

MIGRATIONS: list[str] = [
    # 1: incidents, reports, and a revision counter bumped by triggers on every incident write, so
    # a reader (the FAISS index) can tell cheaply that the table changed, whoever changed it.
    """
    CREATE TABLE incidents (
        id            TEXT PRIMARY KEY,
        root_line     TEXT NOT NULL,
        root_template TEXT NOT NULL,
        templates     TEXT NOT NULL DEFAULT '[]',
        category      TEXT NOT NULL,
        failure_type  TEXT NOT NULL,
        action        TEXT NOT NULL,
        culprit_kind  TEXT NOT NULL DEFAULT 'none',
        note          TEXT NOT NULL DEFAULT '',
        source        TEXT NOT NULL,
        report_id     TEXT,
        created_at    REAL NOT NULL,
        updated_at    REAL NOT NULL
    );
    CREATE INDEX incidents_label ON incidents(category, failure_type);
    CREATE UNIQUE INDEX incidents_report ON incidents(report_id) WHERE report_id IS NOT NULL;
    CREATE TABLE reports (
        id         TEXT PRIMARY KEY,
        created_at REAL NOT NULL,
        report     TEXT NOT NULL,
        context    TEXT,
        feedback   TEXT
    );
    CREATE TABLE incidents_meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
    INSERT INTO incidents_meta(key, value) VALUES ('revision', 0);
    CREATE TRIGGER incidents_rev_ins AFTER INSERT ON incidents BEGIN
        UPDATE incidents_meta SET value = value + 1 WHERE key = 'revision';
    END;
    CREATE TRIGGER incidents_rev_upd AFTER UPDATE ON incidents BEGIN
        UPDATE incidents_meta SET value = value + 1 WHERE key = 'revision';
    END;
    CREATE TRIGGER incidents_rev_del AFTER DELETE ON incidents BEGIN
        UPDATE incidents_meta SET value = value + 1 WHERE key = 'revision';
    END;
    """,
    # 2: whose incidents and reports they are ("" shared: every tenant's; see `IncidentStore.list`).
    """
    ALTER TABLE incidents ADD COLUMN tenant TEXT NOT NULL DEFAULT '';
    ALTER TABLE reports ADD COLUMN tenant TEXT NOT NULL DEFAULT '';
    CREATE INDEX incidents_tenant ON incidents(tenant);
    """,
]
_TENANT_MIGRATION = MIGRATIONS[1]


# The same schema on PostgreSQL (`store.url`): one revision counter for every replica.
PG_MIGRATIONS: list[str] = [
    """
    CREATE TABLE incidents (
        id            TEXT PRIMARY KEY,
        root_line     TEXT NOT NULL,
        root_template TEXT NOT NULL,
        templates     TEXT NOT NULL DEFAULT '[]',
        category      TEXT NOT NULL,
        failure_type  TEXT NOT NULL,
        action        TEXT NOT NULL,
        culprit_kind  TEXT NOT NULL DEFAULT 'none',
        note          TEXT NOT NULL DEFAULT '',
        source        TEXT NOT NULL,
        report_id     TEXT,
        created_at    DOUBLE PRECISION NOT NULL,
        updated_at    DOUBLE PRECISION NOT NULL
    );
    CREATE INDEX incidents_label ON incidents(category, failure_type);
    CREATE UNIQUE INDEX incidents_report ON incidents(report_id) WHERE report_id IS NOT NULL;
    CREATE TABLE reports (
        id         TEXT PRIMARY KEY,
        created_at DOUBLE PRECISION NOT NULL,
        report     TEXT NOT NULL,
        context    TEXT,
        feedback   TEXT
    );
    CREATE TABLE incidents_meta (key TEXT PRIMARY KEY, value BIGINT NOT NULL);
    INSERT INTO incidents_meta(key, value) VALUES ('revision', 0);
    CREATE FUNCTION incidents_bump_revision() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        UPDATE incidents_meta SET value = value + 1 WHERE key = 'revision';
        RETURN NULL;
    END $$;
    CREATE TRIGGER incidents_rev AFTER INSERT OR UPDATE OR DELETE ON incidents
        FOR EACH STATEMENT EXECUTE FUNCTION incidents_bump_revision();
    """,
    _TENANT_MIGRATION,
]


class IncidentError(ValueError):
    """Bad input for an incident or a feedback (unknown report, non-canonical label...)."""


class SharedIncident(IncidentError):
    """A tenant's feedback would change an incident shared with every tenant (a cluster-wide operator's)."""


# --- masking -----------------------------------------------------------------------------------

_NORMALIZER = Normalizer()


def mask_text(line: str) -> str:
    """A raw log line as the pipeline's query side sees it: launcher prefixes (rank, host, NCCL's
    host:pid:tid, timestamps) peeled off by the normaliser, then the shared mask (numbers, ids,
    addresses, paths -> <*>). Using the very same functions keeps incident and query text alike."""
    return mask(_NORMALIZER.normalize(line[:_MAX_LINE]).text.strip())


# --- the incident ------------------------------------------------------------------------------


@dataclass(slots=True)
class Incident:
    id: str
    root_line: str
    root_template: str
    templates: list[str]
    category: Category
    failure_type: str
    action: Action
    culprit_kind: str = "none"
    note: str = ""
    source: str = "import"
    report_id: str | None = None
    created_at: float = 0.0
    updated_at: float = 0.0
    tenant: str = ""  # "": shared by every tenant, and retrieved in every diagnosis

    @property
    def label(self) -> Label:
        return Label(self.category, self.failure_type, self.action)

    def as_query(self) -> str:
        """The same shape as ``FailureContext.as_query()``, so both sides embed alike."""
        return "\n".join([self.root_template, *self.templates[:_MAX_TEMPLATES]])

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["category"] = self.category.value
        d["action"] = self.action.value
        return d


class IncidentIn(BaseModel):
    """An incident as it arrives from outside (seed file, JSONL import): validated strictly.

    Either masked ``root_template``/``templates`` or raw ``nearby`` lines (masked on the way in).
    """

    model_config = ConfigDict(extra="ignore", str_strip_whitespace=True)

    id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")
    root_line: str = Field(min_length=1, max_length=_MAX_LINE)
    root_template: str | None = None
    templates: list[str] | None = None
    nearby: list[str] = Field(default_factory=list, max_length=32)
    category: Category
    failure_type: str
    action: Action | None = None
    culprit_kind: CulpritKind = "none"
    note: str = ""
    source: Source | None = None
    report_id: str | None = None
    created_at: float | None = None
    updated_at: float | None = None
    tenant: str = Field("", pattern=rf"^({TENANT})?$", description="whose it is; empty: shared by every tenant")

    @field_validator("category")
    @classmethod
    def _known_category(cls, v: Category) -> Category:
        if v is Category.UNKNOWN:
            raise ValueError("an incident needs a known category")
        return v

    @model_validator(mode="after")
    def _canonical(self) -> IncidentIn:
        if not is_canonical(self.category, self.failure_type):
            raise ValueError(f"failure_type {self.failure_type!r} is not canonical for category {self.category.value}")
        if self.action is Action.NONE:
            raise ValueError("action 'none' is for healthy jobs, not incidents")
        return self


@dataclass(slots=True)
class ImportResult:
    added: int = 0
    updated: int = 0
    errors: list[str] = field(default_factory=list)  # "<file>:<line>: <why>"


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def _row_to_incident(row: Any) -> Incident:
    return Incident(
        id=row["id"],
        root_line=row["root_line"],
        root_template=row["root_template"],
        templates=json.loads(row["templates"]),
        category=Category(row["category"]),
        failure_type=row["failure_type"],
        action=Action(row["action"]),
        culprit_kind=row["culprit_kind"],
        note=row["note"],
        source=row["source"],
        report_id=row["report_id"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        tenant=row["tenant"],
    )


def _visible_to(tenant: str | None) -> tuple[str, list[object]]:
    """The incidents a tenant sees: the shared ones and its own; None: every tenant's."""
    if tenant is None:
        return "", []
    if not tenant:
        return "tenant = ''", []
    return "tenant IN ('', ?)", [tenant]


class IncidentStore:
    """CRUD over incidents and reports; one per process, shared by threads (the Database locks)."""

    COMPONENT = "incidents"

    def __init__(
        self,
        db: Store,
        *,
        masker: Callable[[str], str] = mask_text,
        seed_path: Path | None = SEED_PATH,
    ) -> None:
        self.db = db
        self.masker = masker
        migrate(db, self.COMPONENT, MIGRATIONS, postgres=PG_MIGRATIONS)
        if seed_path is not None:
            self.sync_seed(seed_path)

    # -- incidents ------------------------------------------------------------------------------

    def add(self, incident: Incident | IncidentIn | dict[str, Any], *, source: str | None = None) -> Incident:
        """Insert or replace (by id) one incident; returns it as stored."""
        inc = self._to_incident(incident, source=source)
        with self.db.transaction() as conn:
            self._upsert(conn, inc)
        return inc

    def get(self, incident_id: str, *, tenant: str | None = None) -> Incident | None:
        """The incident, when `tenant` may see it (see `list`; None: whoever's it is)."""
        visible, params = _visible_to(tenant)
        rows = self.db.query("SELECT * FROM incidents WHERE id = ?" + (f" AND {visible}" if visible else ""),
                             (incident_id, *params))
        return _row_to_incident(rows[0]) if rows else None

    def get_many(self, ids: Iterable[str], *, tenant: str | None = "") -> dict[str, Incident]:
        """The shared incidents among `ids` (retrieval's), or those `tenant` may see (see `list`)."""
        ids = list(ids)
        visible, extra = _visible_to(tenant)
        out: dict[str, Incident] = {}
        for i in range(0, len(ids), 500):  # stay under SQLite's bound-parameter limit
            chunk = ids[i : i + 500]
            marks = ",".join("?" * len(chunk))
            sql = f"SELECT * FROM incidents WHERE id IN ({marks})" + (f" AND {visible}" if visible else "")
            for row in self.db.query(sql, [*chunk, *extra]):
                out[row["id"]] = _row_to_incident(row)
        return out

    def list(
        self,
        *,
        category: Category | str | None = None,
        failure_type: str | None = None,
        source: str | None = None,
        limit: int | None = None,
        tenant: str | None = "",
    ) -> list[Incident]:
        """Incidents by id. `tenant` "" (the default, what retrieval indexes): the shared ones only; a
        tenant: the shared ones and that tenant's; None: every incident, whoever's."""
        visible, visible_params = _visible_to(tenant)
        where: list[str] = [visible] if visible else []
        params: list[object] = [*visible_params]
        for col, val in (("category", category), ("failure_type", failure_type), ("source", source)):
            if val is not None:
                where.append(f"{col} = ?")
                params.append(val.value if isinstance(val, Category) else val)
        sql = "SELECT * FROM incidents" + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY id"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(int(limit))
        return [_row_to_incident(r) for r in self.db.query(sql, params)]

    def remove(self, incident_id: str) -> bool:
        with self.db.transaction() as conn:
            return conn.execute("DELETE FROM incidents WHERE id = ?", (incident_id,)).rowcount > 0

    def count(self) -> int:
        return int(self.db.query_value("SELECT COUNT(*) FROM incidents"))

    def remove_if(self, incident_id: str, tenant: str) -> bool:
        """Delete an incident of `tenant` (a tenant's operator deletes only its own)."""
        with self.db.transaction() as conn:
            return conn.execute("DELETE FROM incidents WHERE id = ? AND tenant = ?", (incident_id, tenant)).rowcount > 0

    def revision(self) -> int:
        """Bumped (by triggers) on every write to the incidents table: a cheap "has it changed?"."""
        return int(self.db.query_value("SELECT value FROM incidents_meta WHERE key = 'revision'"))

    def fingerprint(self) -> str:
        """A checksum of everything retrieval depends on: the shared incidents' ids, labels and embedded text."""
        h = hashlib.sha256()
        for row in self.db.query(
            "SELECT id, category, failure_type, action, root_template, templates FROM incidents"
            " WHERE tenant = '' ORDER BY id"
        ):
            h.update("\x1f".join(str(row[k]) for k in row.keys()).encode())  # noqa: SIM118 - a Row iterates its values
            h.update(b"\x1e")
        return h.hexdigest()[:32]

    # -- import / export ------------------------------------------------------------------------

    def export_jsonl(self, dest: str | Path | IO[str]) -> int:
        incidents = self.list(tenant=None)
        with _open_text(dest, "w") as f:
            for inc in incidents:
                f.write(json.dumps(inc.to_json(), ensure_ascii=False) + "\n")
        return len(incidents)

    def import_jsonl(
        self, src: str | Path | IO[str], *, source: str = "import", strict: bool = False
    ) -> ImportResult:
        """Upsert every valid line (by id); invalid lines are reported as "<file>:<line>: why".

        ``strict``: any invalid line aborts the whole import (nothing is written).
        """
        name = str(src) if isinstance(src, (str, Path)) else getattr(src, "name", "<stream>")
        result = ImportResult()
        parsed: list[Incident] = []
        with _open_text(src, "r") as f:
            for n, raw in enumerate(f, start=1):
                if not raw.strip() or raw.lstrip().startswith("#"):
                    continue
                try:
                    item = IncidentIn.model_validate_json(raw)
                    parsed.append(self._to_incident(item, source=item.source or source))
                except ValidationError as e:
                    why = "; ".join(f"{'.'.join(map(str, er['loc'])) or 'line'}: {er['msg']}" for er in e.errors())
                    result.errors.append(f"{name}:{n}: {why}")
                except IncidentError as e:
                    result.errors.append(f"{name}:{n}: {e}")
        if strict and result.errors:
            raise IncidentError("import aborted:\n" + "\n".join(result.errors))
        with self.db.transaction() as conn:
            for inc in parsed:
                existed = conn.execute("SELECT 1 FROM incidents WHERE id = ?", (inc.id,)).fetchone()
                self._upsert(conn, inc)
                if existed:
                    result.updated += 1
                else:
                    result.added += 1
        return result

    def sync_seed(self, path: Path = SEED_PATH) -> int:
        """Bring the shipped knowledge base into the store; returns how many incidents were written.

        On the first start all of it; after an upgrade that changed the file, the seed incidents it adds
        or rewrites, so that a database older than this logdx still learns its new failure types. An
        incident a person changed (its source is no longer "seed") is left as it is, and one a person
        deleted stays deleted until the shipped file changes again."""
        if not path.exists():
            return 0
        digest = int(hashlib.sha256(path.read_bytes()).hexdigest()[:15], 16)  # fits a signed 64-bit value
        if self.db.query_value("SELECT value FROM incidents_meta WHERE key = 'seed'") == digest:
            return 0
        with path.open(encoding="utf-8") as f:
            shipped = [self._to_incident(IncidentIn.model_validate_json(raw), source="seed")
                       for raw in f if raw.strip() and not raw.lstrip().startswith("#")]
        written = 0
        with self.db.transaction() as conn:
            for inc in shipped:
                row = conn.execute("SELECT source FROM incidents WHERE id = ?", (inc.id,)).fetchone()
                if row is None or row[0] == "seed":
                    self._upsert(conn, inc)
                    written += 1
            conn.execute("INSERT INTO incidents_meta(key, value) VALUES ('seed', ?) "
                         "ON CONFLICT(key) DO UPDATE SET value = excluded.value", (digest,))
        return written

    # -- reports and feedback -------------------------------------------------------------------

    def save_report(self, report: dict[str, Any] | str, *, context: FailureContext | None = None,
                    tenant: str = "") -> str:
        """Store a report (the JSON contract of DESIGN.md) and, when given, the failure context it
        was made from (so feedback can build an incident from the same masked text); `tenant`: whose
        job (or one-shot upload) it is."""
        data = json.loads(report) if isinstance(report, str) else report
        if not isinstance(data, dict):
            raise IncidentError("a report is a JSON object")
        report_id = str(data.get("report_id") or data.get("id") or _new_id("rep"))
        ctx = None
        if context is not None:
            ctx = json.dumps(
                {
                    "root_text": context.root_text,
                    "root_masked": context.root_masked,
                    "templates": context.templates,
                    "exception_type": context.exception_type,
                }
            )
        with self.db.transaction() as conn:
            conn.execute(
                "INSERT INTO reports(id, created_at, report, context, tenant) VALUES (?,?,?,?,?) ON CONFLICT(id)"
                " DO UPDATE SET created_at = excluded.created_at, report = excluded.report,"
                " context = excluded.context, feedback = NULL, tenant = excluded.tenant",
                (report_id, time.time(), json.dumps(data), ctx, tenant),
            )
        return report_id

    def get_report(self, report_id: str) -> dict[str, Any] | None:
        row = self.db.query("SELECT report FROM reports WHERE id = ?", (report_id,))
        return json.loads(row[0]["report"]) if row else None

    def report_tenant(self, report_id: str) -> str | None:
        """The tenant a report was stored for ("" for none); None when there is no such report."""
        value = self.db.query_value("SELECT tenant FROM reports WHERE id = ?", (report_id,))
        return None if value is None else str(value)

    def feedback(
        self,
        report_id: str,
        category: Category | str,
        failure_type: str,
        action: Action | str | None = None,
        note: str | None = None,
        *,
        tenant: str | None = None,
        by_tenant: str = "",
    ) -> Incident:
        """A human confirmed or corrected a report: remember it as an incident (one per report;
        feeding back the same report again updates that incident). The incident is the report's
        tenant's (`tenant` None), or shared (`tenant` "": an operator's choice) or another's.
        `by_tenant`: the tenant of whoever gives it, who may not change a shared incident
        (`SharedIncident`): every tenant's diagnoses retrieve it."""
        rows = self.db.query("SELECT report, context, tenant FROM reports WHERE id = ?", (report_id,))
        if not rows:
            raise IncidentError(f"no report {report_id!r}")
        try:
            cat = Category(category)
        except ValueError as e:
            raise IncidentError(f"unknown category {category!r}") from e
        if not is_canonical(cat, failure_type):
            raise IncidentError(f"failure_type {failure_type!r} is not canonical for category {cat.value}")
        try:
            act = Action(action) if action is not None else default_action(cat, failure_type)
        except ValueError as e:
            raise IncidentError(f"unknown action {action!r}") from e
        report = json.loads(rows[0]["report"])
        stored_ctx = json.loads(rows[0]["context"]) if rows[0]["context"] else None
        root_line, root_template, templates = self._context_of(report, stored_ctx)
        was = f"{report.get('category')}/{report.get('failure_type')}"
        verdict = "confirmed" if was == f"{cat.value}/{failure_type}" else f"corrected from {was}"
        now = time.time()
        existing = self.db.query("SELECT id, created_at, tenant FROM incidents WHERE report_id = ?", (report_id,))
        if existing and by_tenant and not existing[0]["tenant"]:
            raise SharedIncident(f"the incident learned from report {report_id} ({existing[0]['id']}) is shared with "
                                 "every tenant: a cluster-wide operator changes it")
        inc = Incident(
            id=existing[0]["id"] if existing else _new_id("inc"),
            root_line=root_line,
            root_template=root_template,
            templates=templates,
            category=cat,
            failure_type=failure_type,
            action=act,
            culprit_kind=_culprit_kind(report),
            note=(note or "").strip() or f"Report {report_id} {verdict}.",
            source="feedback",
            report_id=report_id,
            created_at=existing[0]["created_at"] if existing else now,
            updated_at=now,
            tenant=rows[0]["tenant"] if tenant is None else tenant,
        )
        fb = {"category": cat.value, "failure_type": failure_type, "action": act.value,
              "verdict": verdict, "incident_id": inc.id, "at": now}
        with self.db.transaction() as conn:
            self._upsert(conn, inc)
            conn.execute("UPDATE reports SET feedback = ? WHERE id = ?", (json.dumps(fb), report_id))
        return inc

    def false_alarm(self, report_id: str, note: str | None = None, *, by_tenant: str = "") -> dict[str, Any]:
        """A person established that the job of a failed report did not fail (a false alarm): the report's
        feedback says so, and an incident learned from an earlier correction of it is removed. No incident is
        learned from it: a "healthy" incident would let retrieval call the next real failure of that shape
        healthy (a learned stage never decides health)."""
        rows = self.db.query("SELECT report FROM reports WHERE id = ?", (report_id,))
        if not rows:
            raise IncidentError(f"no report {report_id!r}")
        report = json.loads(rows[0]["report"])
        if report.get("status") != "failed":
            raise IncidentError(f"report {report_id} is {report.get('status')}, not failed: there is no alarm to call false")
        existing = self.db.query("SELECT id, tenant FROM incidents WHERE report_id = ?", (report_id,))
        if existing and by_tenant and not existing[0]["tenant"]:
            raise SharedIncident(f"the incident learned from report {report_id} ({existing[0]['id']}) is shared with "
                                 "every tenant: a cluster-wide operator changes it")
        fb = {"verdict": "false alarm", "was": f"{report.get('category')}/{report.get('failure_type')}",
              "note": (note or "").strip(), "removed_incident": existing[0]["id"] if existing else None,
              "at": time.time()}
        with self.db.transaction() as conn:
            if existing:
                conn.execute("DELETE FROM incidents WHERE id = ?", (existing[0]["id"],))
            conn.execute("UPDATE reports SET feedback = ? WHERE id = ?", (json.dumps(fb), report_id))
        return fb

    # -- internals ------------------------------------------------------------------------------

    # builtins.list: in this class `list` names the method above.
    def _context_of(self, report: dict[str, Any], ctx: dict[str, Any] | None) -> tuple[str, str, builtins.list[str]]:
        root = report.get("root_cause") or {}
        root_line = str((ctx or {}).get("root_text") or root.get("text") or "").strip()
        if not root_line:
            raise IncidentError("the report has no root line to learn from")
        if ctx and ctx.get("root_masked"):
            return root_line, str(ctx["root_masked"]), [str(t) for t in ctx.get("templates", [])][:_MAX_TEMPLATES]
        root_template = self.masker(root_line)
        templates: list[str] = []
        for ev in report.get("evidence") or []:
            t = self.masker(str(ev.get("text", "")))
            if t and t != root_template and t not in templates:
                templates.append(t)
        return root_line, root_template, templates[:_MAX_TEMPLATES]

    def _to_incident(self, item: Incident | IncidentIn | dict[str, Any], *, source: str | None) -> Incident:
        if isinstance(item, Incident):
            if not is_canonical(item.category, item.failure_type):
                raise IncidentError(f"not canonical: {item.category}/{item.failure_type}")
            if source:
                item.source = source
            return item
        if isinstance(item, dict):
            try:
                item = IncidentIn.model_validate(item)
            except ValidationError as e:
                raise IncidentError(str(e)) from e
        now = time.time()
        root_template = item.root_template or self.masker(item.root_line)
        if item.templates is not None:
            templates = item.templates
        else:
            templates = [t for t in (self.masker(line) for line in item.nearby) if t]
        return Incident(
            id=item.id or _new_id("inc"),
            root_line=item.root_line,
            root_template=root_template,
            templates=list(dict.fromkeys(templates))[:_MAX_TEMPLATES],
            category=item.category,
            failure_type=item.failure_type,
            action=item.action or default_action(item.category, item.failure_type),
            culprit_kind=item.culprit_kind,
            note=item.note,
            source=source or item.source or "import",
            report_id=item.report_id,
            created_at=item.created_at or now,
            updated_at=item.updated_at or now,
            tenant=item.tenant,
        )

    @staticmethod
    def _upsert(conn: Any, inc: Incident) -> None:
        conn.execute(
            """INSERT INTO incidents(id, root_line, root_template, templates, category, failure_type,
                   action, culprit_kind, note, source, report_id, created_at, updated_at, tenant)
               VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)
               ON CONFLICT(id) DO UPDATE SET
                   root_line=excluded.root_line, root_template=excluded.root_template,
                   templates=excluded.templates, category=excluded.category,
                   failure_type=excluded.failure_type, action=excluded.action,
                   culprit_kind=excluded.culprit_kind, note=excluded.note, source=excluded.source,
                   report_id=excluded.report_id, updated_at=excluded.updated_at, tenant=excluded.tenant""",
            (
                inc.id, inc.root_line, inc.root_template, json.dumps(inc.templates), inc.category.value,
                inc.failure_type, inc.action.value, inc.culprit_kind, inc.note, inc.source,
                inc.report_id, inc.created_at, inc.updated_at, inc.tenant,
            ),
        )


def _culprit_kind(report: dict[str, Any]) -> str:
    c = report.get("culprits") or {}
    if c.get("gpus"):
        return "gpu"
    if c.get("hosts"):
        return "node"
    if c.get("ranks"):
        return "rank"
    return "none"


class _open_text:
    """Open a path, or pass an already open text stream through (not closing it)."""

    def __init__(self, target: str | Path | IO[str], mode: str) -> None:
        self.target, self.mode = target, mode
        self._owned: IO[str] | None = None

    def __enter__(self) -> IO[str]:
        if isinstance(self.target, (str, Path)):
            self._owned = open(self.target, self.mode, encoding="utf-8")
            return self._owned
        return self.target

    def __exit__(self, *exc: object) -> None:
        if self._owned is not None:
            self._owned.close()
