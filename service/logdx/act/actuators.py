"""Actions: cordon or drain the node that broke a job, then restart the job. Dry-run by default.

`Actions.apply(job_id, report)` acts only when the diagnosis is sure enough to justify touching a
cluster: the report says `cordon_and_restart`, the category is infrastructure, the culprit hosts
are known and the confidence is at least `actions.min_confidence`. A restart hook (a shell
command, or a webhook POST) is triggered only for infrastructure causes (`restart` or
`cordon_and_restart`): script and framework failures would fail again.

Actuators:

- `kubernetes`: cordon = PATCH the Node's `spec.unschedulable: true` (what `kubectl cordon` does),
  with an annotation saying why; with `actions.kube_taint`, also the taint
  `logdx.io/failure=<failure_type>:NoSchedule`. The API server is `actions.kube_api` with
  `actions.kube_token` when set, else the in-cluster service account, else `~/.kube/config`.
- `slurm`: `scontrol update NodeName=<node> State=DRAIN Reason="logdx: <failure_type> <job>"`
  (`actions.scontrol` names the executable).

Safety: at most `actions.max_cordons` distinct nodes are cordoned per `actions.window_s`, counted
from the audit table (so the limit survives restarts, and holds across processes sharing the
database: the check and a reservation row are written in one write transaction). Beyond it the
cordon is refused and audited as refused: a misdiagnosis repeated across jobs can never empty the
cluster. A dry run counts its would-be cordons against the same limit, so it shows what a real run
would do.

Every decision is audited (component "actions"): time, job, node, action, dry_run, outcome
(`ok` | `dry_run` | `failed` | `refused` | `skipped`), detail.
"""

from __future__ import annotations

import json
import logging
import re
import shlex
import sqlite3
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from logdx import __version__
from logdx.act.alerts import DB
from logdx.act.report import Report
from logdx.config import ActionsSettings
from logdx.store import Database

log = logging.getLogger(__name__)

__all__ = ["ActionRecord", "Actions", "TAINT_KEY", "eligible_for_cordon", "fill_command"]

TAINT_KEY = "logdx.io/failure"
ANNOTATION_KEY = "logdx.io/cordon-reason"
_COMMAND_TIMEOUT_S = 60.0
_KUBE_TIMEOUT_S = 30.0

MIGRATIONS = [
    """
    CREATE TABLE action_audit (
        id           INTEGER PRIMARY KEY AUTOINCREMENT,
        ts           REAL NOT NULL,
        job_id       TEXT NOT NULL,
        node         TEXT,
        action       TEXT NOT NULL,
        actuator     TEXT NOT NULL,
        dry_run      INTEGER NOT NULL,
        outcome      TEXT NOT NULL,
        detail       TEXT NOT NULL DEFAULT '',
        report_id    TEXT,
        failure_type TEXT
    );
    CREATE INDEX action_audit_job ON action_audit(job_id);
    CREATE INDEX action_audit_cordons ON action_audit(action, ts);
    """,
]


@dataclass
class ActionRecord:
    id: int
    ts: float
    job_id: str
    node: str | None
    action: str  # cordon | restart | none
    actuator: str  # kubernetes | slurm | command | webhook | none
    dry_run: bool
    outcome: str  # ok | dry_run | failed | refused | skipped | pending
    detail: str
    report_id: str | None = None
    failure_type: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def eligible_for_cordon(report: Report, min_confidence: float) -> tuple[bool, str]:
    """Whether a report justifies cordoning its culprit nodes, and if not, why not."""
    if report.status != "failed":
        return False, "healthy report"
    if report.category != "infrastructure":
        return False, f"category {report.category}: only infrastructure failures act on nodes"
    if report.action != "cordon_and_restart":
        return False, f"recommended action is {report.action}, not cordon_and_restart"
    if not report.culprits.hosts:
        return False, "culprit host unknown"
    if report.confidence < min_confidence:
        return False, f"confidence {report.confidence:.2f} below actions.min_confidence {min_confidence:.2f}"
    return True, ""


_PLACEHOLDER = re.compile(r"\{(job_id|report_id|category|failure_type|action|hosts|node|confidence)\}")


def fill_command(template: str, values: dict[str, str]) -> str:
    """Replace `{job_id}`-style placeholders by shell-quoted values; other braces are left alone
    (so `awk '{print $1}'` survives)."""
    return _PLACEHOLDER.sub(lambda m: shlex.quote(values.get(m.group(1), "")), template)


class Actions:
    def __init__(
        self,
        conn: Database | sqlite3.Connection,
        settings: ActionsSettings,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.db = DB(conn)
        self.db.migrate("actions", MIGRATIONS)
        self.settings = settings
        self.clock = clock
        self._kube_api = None  # CoreV1Api, built on first use

    # -- the decision ---------------------------------------------------------------------------

    def apply(self, job_id: str, report: Report, restart: bool = True) -> list[ActionRecord]:
        """Act on a diagnosis; returns what was done (or would have been, or was refused).

        `restart=False` only cordons (`logdx run` restarts the job itself)."""
        if report.status != "failed":
            return []
        s = self.settings
        out: list[ActionRecord] = []
        ok, why = eligible_for_cordon(report, s.min_confidence)
        if ok:
            for node in dict.fromkeys(report.culprits.hosts):
                out.append(self._cordon(job_id, node, report))
        elif report.action == "cordon_and_restart":
            # Worth saying why a diagnosis that asks for a cordon touched nothing.
            out.append(self._audit(job_id, None, "cordon", s.actuator, "skipped", why, report))
        if restart and (s.restart_command or s.restart_webhook):
            out.append(self._restart(job_id, report, cordons=out))
        return out

    # -- cordon ---------------------------------------------------------------------------------

    def _cordon(self, job_id: str, node: str, report: Report) -> ActionRecord:
        s = self.settings
        if s.actuator == "none":
            return self._audit(job_id, node, "cordon", "none", "skipped",
                               "no actuator configured (actions.actuator: kubernetes | slurm)", report)
        # Reserve a slot under the safety limit, atomically with the count.
        now = self.clock()
        with self.db.transaction() as db:
            rows = db.query(
                "SELECT DISTINCT node FROM action_audit WHERE action = 'cordon' AND dry_run = ?"
                " AND outcome IN ('ok', 'dry_run', 'pending') AND ts >= ? AND node IS NOT NULL",
                (int(s.dry_run), now - s.window_s),
            )
            recent = {r["node"] for r in rows}
            if node not in recent and len(recent) >= s.max_cordons:
                detail = (f"safety limit: {len(recent)} node(s) already cordoned in the last {s.window_s:g} s "
                          f"({', '.join(sorted(recent)) or '-'}); actions.max_cordons={s.max_cordons}")
                return self._audit(job_id, node, "cordon", s.actuator, "refused", detail, report)
            rec = self._audit(job_id, node, "cordon", s.actuator, "pending", "", report)
        if s.dry_run:
            outcome, detail = "dry_run", "would " + self._describe(node, job_id, report)
        else:
            try:
                if s.actuator == "kubernetes":
                    detail = self._kube_cordon(node, job_id, report)
                else:
                    detail = self._slurm_drain(node, job_id, report)
                outcome = "ok"
            except Exception as e:  # noqa: BLE001 - audit every failure, whatever raised it
                outcome, detail = "failed", f"{type(e).__name__}: {e}"[:2000]
                log.warning("cordon of %s failed: %s", node, detail)
        return self._update(rec, outcome, detail)

    def _describe(self, node: str, job_id: str, report: Report) -> str:
        s = self.settings
        if s.actuator == "kubernetes":
            what = f"PATCH node {node}: spec.unschedulable=true"
            if s.kube_taint:
                what += f", taint {TAINT_KEY}={report.failure_type}:NoSchedule"
            return what
        return "run: " + shlex.join(self._scontrol_argv(node, job_id, report))

    def _scontrol_argv(self, node: str, job_id: str, report: Report) -> list[str]:
        reason = f"logdx: {report.failure_type or 'unknown'} {job_id}"
        return [self.settings.scontrol, "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"]

    def _slurm_drain(self, node: str, job_id: str, report: Report) -> str:
        argv = self._scontrol_argv(node, job_id, report)
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{shlex.join(argv)} exited {proc.returncode}: {proc.stderr.strip()[:500]}")
        return "ran: " + shlex.join(argv)

    def _kube(self):  # noqa: ANN202 - kubernetes.client.CoreV1Api
        if self._kube_api is None:
            from kubernetes import client, config

            s = self.settings
            if s.kube_api:
                cfg = client.Configuration()
                cfg.host = s.kube_api.rstrip("/")
                if s.kube_token:
                    cfg.api_key = {"BearerToken": s.kube_token}
                    cfg.api_key_prefix = {"BearerToken": "Bearer"}
                api_client = client.ApiClient(cfg)
            else:
                try:
                    config.load_incluster_config()
                except config.ConfigException:
                    config.load_kube_config()
                api_client = client.ApiClient()
            self._kube_api = client.CoreV1Api(api_client)
        return self._kube_api

    def _kube_cordon(self, node: str, job_id: str, report: Report) -> str:
        from kubernetes.client.exceptions import ApiException

        api = self._kube()
        failure = report.failure_type or "unknown"
        for attempt in range(3):
            current = api.read_node(node, _request_timeout=_KUBE_TIMEOUT_S)  # 404: no such node
            patch: dict[str, Any] = {
                "metadata": {
                    "resourceVersion": current.metadata.resource_version,
                    "annotations": {ANNOTATION_KEY: f"logdx: {failure} in job {job_id}"[:250]},
                },
                "spec": {"unschedulable": True},
            }
            if self.settings.kube_taint:
                own = (current.spec.taints or []) if current.spec else []
                taints = [t.to_dict() for t in own if t.key != TAINT_KEY]
                taints = [{k: v for k, v in t.items() if v is not None} for t in taints]
                taints.append({"key": TAINT_KEY, "value": failure, "effect": "NoSchedule"})
                patch["spec"]["taints"] = taints
            try:
                api.patch_node(node, patch, _content_type="application/merge-patch+json",
                               _request_timeout=_KUBE_TIMEOUT_S)
            except ApiException as e:
                if e.status == 409 and attempt < 2:  # the node changed under us: read it again
                    continue
                raise
            return f"patched node {node}: unschedulable" + (f", taint {TAINT_KEY}={failure}:NoSchedule"
                                                             if self.settings.kube_taint else "")
        raise RuntimeError("conflict patching node")  # pragma: no cover - loop always returns or raises

    # -- restart --------------------------------------------------------------------------------

    def _restart(self, job_id: str, report: Report, cordons: list[ActionRecord]) -> ActionRecord:
        s = self.settings
        actuator = "command" if s.restart_command else "webhook"
        if report.category != "infrastructure" or report.action not in ("restart", "cordon_and_restart"):
            return self._audit(job_id, None, "restart", actuator, "skipped",
                               f"{report.category} / {report.action}: restarts only follow infrastructure causes",
                               report)
        if report.confidence < s.min_confidence:
            return self._audit(job_id, None, "restart", actuator, "skipped",
                               f"confidence {report.confidence:.2f} below actions.min_confidence", report)
        bad = [c for c in cordons if c.action == "cordon" and c.outcome in ("refused", "failed")]
        if bad:
            nodes = ", ".join(c.node or "?" for c in bad)
            return self._audit(job_id, None, "restart", actuator, "skipped",
                               f"not restarting onto a suspect node: cordon of {nodes} {bad[0].outcome}", report)
        values = {
            "job_id": job_id, "report_id": report.id, "category": report.category or "",
            "failure_type": report.failure_type or "", "action": report.action,
            "hosts": ",".join(report.culprits.hosts), "node": report.culprits.hosts[0] if report.culprits.hosts else "",
            "confidence": f"{report.confidence:.2f}",
        }
        if s.restart_command:
            cmd = fill_command(s.restart_command, values)
            if s.dry_run:
                return self._audit(job_id, None, "restart", actuator, "dry_run", f"would run: {cmd}", report)
            try:
                proc = subprocess.run(["/bin/sh", "-c", cmd], capture_output=True, text=True,
                                      timeout=_COMMAND_TIMEOUT_S, check=False)
            except Exception as e:  # noqa: BLE001
                return self._audit(job_id, None, "restart", actuator, "failed",
                                   f"{cmd}: {type(e).__name__}: {e}", report)
            if proc.returncode != 0:
                return self._audit(job_id, None, "restart", actuator, "failed",
                                   f"{cmd}: exit {proc.returncode}: {proc.stderr.strip()[:500]}", report)
            return self._audit(job_id, None, "restart", actuator, "ok", f"ran: {cmd}", report)
        url = s.restart_webhook
        if s.dry_run:
            return self._audit(job_id, None, "restart", actuator, "dry_run", f"would POST {_redact(url)}", report)
        body = json.dumps({"type": "logdx.restart", "job_id": job_id, **values,
                           "report": report.model_dump(mode="json")}, separators=(",", ":")).encode()
        try:
            resp = httpx.post(url, content=body, timeout=30.0, follow_redirects=False,
                              headers={"content-type": "application/json", "user-agent": f"logdx/{__version__}"})
        except httpx.HTTPError as e:
            return self._audit(job_id, None, "restart", actuator, "failed", f"POST {_redact(url)}: {e}", report)
        if not 200 <= resp.status_code < 300:
            return self._audit(job_id, None, "restart", actuator, "failed",
                               f"POST {_redact(url)}: HTTP {resp.status_code}", report)
        return self._audit(job_id, None, "restart", actuator, "ok",
                           f"POST {_redact(url)}: HTTP {resp.status_code}", report)

    # -- the audit ------------------------------------------------------------------------------

    def _audit(self, job_id: str, node: str | None, action: str, actuator: str, outcome: str,
               detail: str, report: Report) -> ActionRecord:
        rec = ActionRecord(id=0, ts=self.clock(), job_id=job_id, node=node, action=action, actuator=actuator,
                           dry_run=self.settings.dry_run, outcome=outcome, detail=detail,
                           report_id=report.id, failure_type=report.failure_type)
        cur = self.db.execute(
            "INSERT INTO action_audit(ts, job_id, node, action, actuator, dry_run, outcome, detail, report_id,"
            " failure_type) VALUES (?,?,?,?,?,?,?,?,?,?)",
            (rec.ts, job_id, node, action, actuator, int(rec.dry_run), outcome, detail, rec.report_id,
             rec.failure_type),
        )
        rec.id = int(cur.lastrowid or 0)
        if outcome not in ("pending",):
            log.info("action %s %s on %s: %s %s", action, actuator, node or "-", outcome, detail)
        return rec

    def _update(self, rec: ActionRecord, outcome: str, detail: str) -> ActionRecord:
        self.db.execute("UPDATE action_audit SET outcome = ?, detail = ? WHERE id = ?", (outcome, detail, rec.id))
        rec.outcome, rec.detail = outcome, detail
        return rec

    def audit(self, job_id: str | None = None) -> list[ActionRecord]:
        sql = ("SELECT id, ts, job_id, node, action, actuator, dry_run, outcome, detail, report_id, failure_type"
               " FROM action_audit")
        rows = (self.db.query(sql + " WHERE job_id = ? ORDER BY id", (job_id,)) if job_id is not None
                else self.db.query(sql + " ORDER BY id"))
        return [ActionRecord(**{**r, "dry_run": bool(r["dry_run"])}) for r in rows]

    def cordoned_recently(self) -> list[str]:
        """Nodes cordoned (for real, or in dry runs when dry-running) inside the safety window."""
        rows = self.db.query(
            "SELECT DISTINCT node FROM action_audit WHERE action = 'cordon' AND dry_run = ?"
            " AND outcome IN ('ok', 'dry_run', 'pending') AND ts >= ? AND node IS NOT NULL ORDER BY node",
            (int(self.settings.dry_run), self.clock() - self.settings.window_s),
        )
        return [r["node"] for r in rows]


def _redact(url: str) -> str:
    from urllib.parse import urlsplit

    p = urlsplit(url)
    return f"{p.scheme}://{p.hostname or ''}{':' + str(p.port) if p.port else ''}{p.path}"
