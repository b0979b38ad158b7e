"""What `logdx run` was asked to do (`RunOptions`), and what happened to each attempt (`Attempt`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from logdx.model import Category

if TYPE_CHECKING:
    from logdx.act.capsule import Evidence
    from logdx.act.report import Report

TRIGGERS = ("ok", "exit", "root_cause", "stall", "loss_nan", "loss_spike", "interrupted", "launch_failed")


@dataclass
class RunOptions:
    command: list[str]
    job_id: str
    max_restarts: int = 3
    backoff: float = 10.0
    backoff_max: float = 300.0
    restart_on: frozenset[str] = frozenset({Category.INFRASTRUCTURE.value})
    root_cause_grace: float = 30.0
    stall_timeout: float | None = None  # None: derived from the step time; 0: off
    pause_max: float = 3600.0  # a checkpoint save or an evaluation pauses the stall timer this long at most
    kill_grace: float = 10.0
    loss_triggers: frozenset[str] = frozenset({"loss_nan", "loss_spike"})
    exclude_arg: str | None = None
    resume_arg: str | None = None
    json_history: Path | None = None
    color: bool = False


@dataclass
class Attempt:
    number: int
    argv: list[str]
    started_at: float
    ended_at: float = 0.0
    exit_code: int = 0
    trigger: str = "exit"
    trigger_detail: str = ""
    report: Report | None = None
    excluded_hosts: list[str] = field(default_factory=list)
    resumed_from: dict[str, Any] | None = None
    checkpoint: dict[str, Any] | None = None  # the last one saved during this attempt
    actions: list[dict[str, Any]] = field(default_factory=list)
    alert_queued: bool = False
    decision: str = ""  # what logdx did next: restart / stop, and why
    event_counts: dict[str, int] = field(default_factory=dict)  # the pipeline's events, by kind
    progress_lines: int | None = None  # training progress lines this attempt printed
    hosts: list[str] = field(default_factory=list)  # the hosts its log named
    pauses: list[dict[str, Any]] = field(default_factory=list)  # checkpoint saves / evaluations seen
    evidence: Evidence | None = field(default=None, repr=False)  # its recent lines, for the evidence capsule

    @property
    def duration_s(self) -> float:
        return max(0.0, self.ended_at - self.started_at)

    def to_dict(self) -> dict[str, Any]:
        return {
            "attempt": self.number,
            "argv": self.argv,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "duration_s": round(self.duration_s, 3),
            "exit_code": self.exit_code,
            "trigger": self.trigger,
            "trigger_detail": self.trigger_detail,
            "excluded_hosts": self.excluded_hosts,
            "resumed_from": self.resumed_from,
            "checkpoint": self.checkpoint,
            "actions": self.actions,
            "alert_queued": self.alert_queued,
            "decision": self.decision,
            "event_counts": self.event_counts,
            "progress_lines": self.progress_lines,
            "pauses": self.pauses,
            "report": self.report.model_dump(mode="json") if self.report else None,
        }
