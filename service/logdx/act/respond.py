"""From a diagnosis to alerts and actions: the one path `logdx run` and the service share.

`Responder.respond(job_id, report)` first applies the actions the policy allows (dry-run by
default), then queues the alert, which says both what logdx recommends and what it actually did
(executed, dry run, refused by which limit). The outbox dedupes per job and diagnosis and delivers
in the background. A failure of one never stops the other: it is logged and returned in
`Response.errors`. `resolved_job` / `uncordon` send the "resolved" follow-ups.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from logdx.act.actions import ActionRecord, Actions
from logdx.act.alerts.outbox import Outbox, OutboxWorker
from logdx.act.costs import CostBook
from logdx.act.policy import RestartVerdict
from logdx.act.report import Report
from logdx.config import Settings
from logdx.store import Store

log = logging.getLogger(__name__)

__all__ = ["Responder", "Response", "describe_done"]


@dataclass(slots=True)
class Response:
    alert_queued: bool = False
    actions: list[ActionRecord] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # "alert not queued: ...", "actions failed: ..."


def describe_done(records: Sequence[ActionRecord]) -> list[str]:
    """What was done, one sentence per action record, for alerts and `logdx run`'s messages."""
    out = []
    for r in records:
        what = f"{r.action} {r.node}" if r.node else r.action
        if r.outcome == "ok":
            out.append(f"{what}: done ({r.detail})")
        elif r.outcome == "dry_run":
            out.append(f"{what}: dry run, nothing changed ({r.detail})")
        elif r.outcome == "pending":
            out.append(f"{what}: in progress")
        else:
            out.append(f"{what}: {r.outcome} ({r.detail})")
    return out


class Responder:
    def __init__(
        self,
        db: Store,
        settings: Settings,
        *,
        public_url: str = "",
        on_delivery: Callable[[str, str], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`public_url` links alerts to the stored report (the service has one; `logdx run` keeps its
        reports in --json-history, so it has none). `on_delivery(kind, outcome)`: see `Outbox`."""
        self.outbox = Outbox(db, settings.alerts, public_url, clock=clock, on_delivery=on_delivery)
        self.worker = OutboxWorker(self.outbox)
        self.actions = Actions(db, settings.actions, clock=clock)
        self.costs = CostBook(db, clock=clock)

    def start(self) -> Responder:
        self.worker.start()
        return self

    def respond(self, job_id: str, report: Report, *, act: bool = True, restart: bool = True,
                verdict: RestartVerdict | None = None, seen_hosts: Iterable[str] = (),
                also_done: Sequence[str] = ()) -> Response:
        """Cordon/restart as the policy allows (`act`), then alert about the failed diagnosis with
        what was done (plus `also_done`: what the caller did itself, e.g. `logdx run`'s exclusion).
        `restart=False` leaves restarting to the caller (`logdx run` restarts the job itself)."""
        out = Response()
        if report.status != "failed":
            return out
        try:
            self.costs.record(job_id, report)
        except Exception as e:
            log.exception("cost of job %s not recorded", job_id)
            out.errors.append(f"cost not recorded: {type(e).__name__}: {e}")
        if act:
            try:
                out.actions = self.actions.apply(job_id, report, restart=restart, verdict=verdict,
                                                 seen_hosts=seen_hosts)
            except Exception as e:
                log.exception("actions for job %s failed", job_id)
                out.errors.append(f"actions failed: {type(e).__name__}: {e}")
        done = [*describe_done(out.actions), *also_done]
        if not act:
            done.append("no action taken on the cluster")
        try:
            out.alert_queued = self.outbox.enqueue(job_id, report, done)
            if out.alert_queued:
                self.worker.wake()
        except Exception as e:
            log.exception("alert for job %s not queued", job_id)
            out.errors.append(f"alert not queued: {type(e).__name__}: {e}")
        return out

    def credit(self, job_id: str, report: Report, hosts: Iterable[str], runtime_s: float) -> list[ActionRecord]:
        """A job whose report earned `healthy` ran on `hosts`: evidence for those nodes' grades
        (`Actions.credit`); a failure is logged, never raised."""
        try:
            return self.actions.credit(job_id, report, hosts, runtime_s)
        except Exception:
            log.exception("crediting the nodes of job %s failed", job_id)
            return []

    def resolved_job(self, job_id: str, why: str) -> int:
        """The job later succeeded: a "resolved" follow-up to its alerts."""
        try:
            n = self.outbox.resolve_job(job_id, why)
        except Exception:
            log.exception("resolved alert for job %s not queued", job_id)
            return 0
        if n:
            self.worker.wake()
        return n

    def uncordon(self, node: str, by: str, reason: str = "") -> ActionRecord:
        """Put a node back (audited), and follow its alerts with "resolved" when it is back."""
        rec = self.actions.uncordon(node, by, reason)
        if rec.outcome == "ok":
            self._resolved_node(rec)
        return rec

    def health_checks(self) -> list[ActionRecord]:
        recs = self.actions.health_checks()
        for rec in recs:
            if rec.outcome == "ok":
                self._resolved_node(rec)
        return recs

    def _resolved_node(self, rec: ActionRecord) -> None:
        try:
            if rec.node and self.outbox.resolve_node(rec.node, f"node {rec.node} is back in service: {rec.detail}"):
                self.worker.wake()
        except Exception:
            log.exception("resolved alert for node %s not queued", rec.node)

    def close(self, *, deliver_due: bool = False) -> None:
        """Stop delivering in the background; `deliver_due` first sends what is due now (a CLI
        about to exit), retries stay queued in the database."""
        self.worker.stop()
        if deliver_due:
            try:
                self.outbox.deliver_due()
            except Exception:
                log.exception("last alert delivery round failed")
        self.outbox.close()
