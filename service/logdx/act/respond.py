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
from logdx.act.capsule import CapsuleWriter, Evidence
from logdx.act.costs import CostBook
from logdx.act.policy import RestartVerdict
from logdx.act.report import DegradationBlock, Report
from logdx.act.silences import Silence, Silences
from logdx.config import Settings
from logdx.store import Store

log = logging.getLogger(__name__)

__all__ = ["Responder", "Response", "describe_done"]


@dataclass(slots=True)
class Response:
    alert_queued: bool = False
    actions: list[ActionRecord] = field(default_factory=list)
    silenced_by: Silence | None = None  # a false alarm's silence held the alert and the actions
    errors: list[str] = field(default_factory=list)  # "alert not queued: ...", "actions failed: ..."
    report: Report | None = None  # as alerted: with a note when the evidence capsule is missing


def describe_done(records: Sequence[ActionRecord]) -> list[str]:
    """What was done, one sentence per action record, for alerts and `logdx run`'s messages."""
    out = []
    for r in records:
        what = f"{r.action} {r.node}" if r.node else r.action
        if r.action == "capsule":
            out.append(f"evidence capsule {r.detail}" if r.outcome == "ok" else r.detail)
        elif r.outcome == "ok":
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
        self.actions = Actions(db, settings.actions, clock=clock, capsules=CapsuleWriter(settings.actions.capsule))
        self.costs = CostBook(db, clock=clock)
        self.silences = Silences(db, settings.actions.false_alarm_silence_days, clock=clock)

    def start(self) -> Responder:
        self.worker.start()
        return self

    def respond(self, job_id: str, report: Report, *, act: bool = True, restart: bool = True,
                verdict: RestartVerdict | None = None, seen_hosts: Iterable[str] = (),
                also_done: Sequence[str] = (), evidence: Evidence | None = None) -> Response:
        """Cordon/restart as the policy allows (`act`), then alert about the failed diagnosis with
        what was done (plus `also_done`: what the caller did itself, e.g. `logdx run`'s exclusion).
        `restart=False` leaves restarting to the caller (`logdx run` restarts the job itself). `evidence`:
        the lines the caller kept, for the evidence capsule written before any cordon."""
        out = Response(report=report)
        if report.status != "failed":
            return out
        try:
            out.silenced_by = self.silences.matching(job_id, report)
        except Exception as e:
            log.exception("silences of job %s not read", job_id)
            out.errors.append(f"silences not read: {type(e).__name__}: {e}")
        if out.silenced_by is not None:
            # A person called this root line a false alarm: diagnosed as ever, but nobody paged, nothing touched.
            log.info("job %s: root line silenced by %s (false alarm %s)", job_id, out.silenced_by.id,
                     out.silenced_by.report_id)
            return out
        try:
            self.costs.record(job_id, report)
        except Exception as e:
            log.exception("cost of job %s not recorded", job_id)
            out.errors.append(f"cost not recorded: {type(e).__name__}: {e}")
        if act:
            try:
                out.actions = self.actions.apply(job_id, report, restart=restart, verdict=verdict,
                                                 seen_hosts=seen_hosts, evidence=evidence)
                without = ("cordoned without it (actions.capsule.act_without: true)"
                           if self.actions.settings.capsule.act_without
                           else "no cordon without it (actions.capsule.act_without: false)")
                missing = [f"{r.detail}; {without}" for r in out.actions if r.action == "capsule" and r.outcome != "ok"]
                if missing:
                    report = out.report = report.model_copy(update={"notes": [*report.notes, *missing]})
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

    def advise(self, job_id: str, degradations: Sequence[DegradationBlock]) -> int:
        """Advice about a running job (what its start-up says will slow it): an alert, never an action; once per
        job and kind and host. A failure is logged, never raised."""
        try:
            n = self.outbox.enqueue_advice(job_id, degradations)
        except Exception:
            log.exception("advice for job %s not queued", job_id)
            return 0
        if n:
            self.worker.wake()
        return n

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
