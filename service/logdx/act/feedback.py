"""A false alarm, as every face records it: the report's feedback says the job did not fail, the incident an
earlier correction of it taught goes, and the nodes it blamed are no longer charged with it: their grades are
replayed without it, and an avoid mark the grade no longer justifies is lifted (audited `unavoid`)."""

from __future__ import annotations

from dataclasses import dataclass

from logdx.act.actions import ActionRecord, Actions
from logdx.config import ActionsSettings
from logdx.incidents import IncidentStore

__all__ = ["FalseAlarm", "record_false_alarm"]


@dataclass(frozen=True, slots=True)
class FalseAlarm:
    report_id: str
    was: str  # the report's category/failure type
    withdrawn_from: list[str]  # the nodes whose history no longer counts it
    removed_incident: str | None
    lifted: tuple[ActionRecord, ...] = ()  # avoid marks lifted (or, in a dry run, that would be)

    def describe(self) -> str:
        nodes = f"; no longer counted against {', '.join(self.withdrawn_from)}" if self.withdrawn_from else ""
        gone = f"; incident {self.removed_incident} removed" if self.removed_incident else ""
        lifted = "".join(f"; unavoid {r.node}: {r.outcome}" for r in self.lifted)
        return f"report {self.report_id} ({self.was}) recorded as a false alarm{nodes}{gone}{lifted}"


def record_false_alarm(store: IncidentStore, actions: ActionsSettings, report_id: str, note: str | None = None,
                       *, by_tenant: str = "") -> FalseAlarm:
    """Raises IncidentError (no such report, or it did not say failed) and SharedIncident as `store.feedback`."""
    fb = store.false_alarm(report_id, note, by_tenant=by_tenant)
    withdrawn, lifted = Actions(store.db, actions).withdraw(report_id)
    return FalseAlarm(report_id=report_id, was=str(fb["was"]), withdrawn_from=withdrawn,
                      removed_incident=fb["removed_incident"], lifted=tuple(lifted))
