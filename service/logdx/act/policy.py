"""The safety policy: when a diagnosis may touch a cluster, and whether a failed job is restarted.
Every rule of it lives here, and `logdx run` and `logdx serve` both ask it, so that changing what
logdx is allowed to do is a change to this file and its tests, nothing else.

A node is cordoned (or, in `logdx run`, excluded from the next launch) only when all of these hold:

- the diagnosis is a failure of category infrastructure whose recommended action is
  `cordon_and_restart` (the log blames exactly one machine), or repeated events on one GPU
  escalate it (`actions.escalate`; an application-class Xid such as 13 is the job's once and the
  GPU's when it keeps coming back, whatever category each report had), or the node's grade is `exclude`
  (`actions.grades`: blamed `exclude_after` times for one family of infrastructure failure within `window_s`,
  this report's among them), which stands in for `cordon_and_restart` only: every other rule still holds;
- it is not a time limit or a preemption (the taxonomy's `resubmit` types never cordon);
- the culprit hosts are named and each is one plain, valid host name (never a range or a list);
- each was named by a sender that may speak for it (`culprits.verified`: a node's own credential, a collector
  of the operator's, the reader's own files), or the scheduler says the job ran there: a tenant's shipper, or
  a token not bound to the host, only claims a host;
- the attribution is corroborated (the host printed the fault itself, or the blamed rank stopped);
- the report is at least `actions.min_confidence` sure (an escalation stands in for that; a grade does not);
- a rule or an entry of the error catalog chose the verdict (`decided_by`): retrieval, the LLM or their
  fusion may name and explain a failure, never cordon, whatever `actions.min_confidence` says;

A node graded `avoid` (the scheduler is asked to prefer other nodes: a PreferNoSchedule taint, a Slurm weight)
passes the same rules with the grade standing in for `cordon_and_restart`; it uses none of the cordon budget, and
nothing is marked while the breaker is open.

and the evidence capsule (`logdx.act.capsule`) was written before it (`capsule_refusal`; in a dry run too),
unless `actions.capsule.act_without` lets a cordon go without it;

and, for a real cordon, the cluster-wide limits agree (`budget_refusal`, `breaker_refusal`):

- at most `actions.max_cordons` distinct nodes cordoned per `actions.window_s` (dry runs use none);
- the circuit breaker: no cordon that would put more than `actions.breaker_max_share` of the known
  nodes under cordon within `actions.breaker_window_s`. Once open it stays open until a person
  resets it (`logdx actions reset`, `POST /v1/actions/reset`); cordons are then counted from the reset.

A restart hook runs only for infrastructure causes (`restart` or `cordon_and_restart`) that are
sure enough, never onto a suspect node whose cordon did not happen, and only when the job's history
allows it (`restart_verdict`): the same failure type on a different node in consecutive attempts, or
an attempt that made no progress at all, stops the restarts and hands the job to its owner; a time
limit is resubmitted from the last checkpoint.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from logdx.act.actuators.base import NodeName, node_names
from logdx.act.report import Report
from logdx.config import ActionsSettings
from logdx.diagnose.culprit import UNVERIFIED
from logdx.model import Action, Category, rests_on_evidence
from logdx.taxonomy import is_resubmit

__all__ = [
    "ALREADY_CORDONED",
    "LEARNED_VERDICT",
    "NODE_UNKNOWN",
    "UNVERIFIED_HOST",
    "AttemptOutcome",
    "RestartVerdict",
    "breaker_refusal",
    "budget_refusal",
    "capsule_refusal",
    "cordon_refusal",
    "cordon_targets",
    "restart_confidence_refusal",
    "restart_refusal",
    "restart_verdict",
]

NODE_UNKNOWN = "node name unknown"
LEARNED_VERDICT = "learned verdict"
UNVERIFIED_HOST = UNVERIFIED  # the diagnosis's word for a culprit host that is only a claim


class _CordonOutcome(Protocol):
    action: str
    node: str | None
    outcome: str
    detail: str


# -- may this diagnosis cordon? ---------------------------------------------------------------------


def cordon_refusal(report: Report, settings: ActionsSettings, escalated: str = "", graded: str = "") -> str | None:
    """Why a report does not justify cordoning its culprit nodes; None when it does. `escalated`
    says why repeated events make a non-fatal one worth a cordon (see `NodeBook.escalation`); `graded`, why
    the node's grade does (`NodeBook.grade`): it stands in for the action asked, never for the category, the
    evidence, the host's trust or the confidence."""
    if report.status != "failed":
        return f"{report.status} report: nothing failed"  # healthy, unknown (neither shown) or empty
    if report.category != Category.INFRASTRUCTURE and not escalated:
        # (an application-class Xid that keeps coming back on one GPU is the GPU's: escalated)
        return f"category {report.category}: only infrastructure failures act on nodes"
    if is_resubmit(report.failure_type):
        return f"{report.failure_type}: the scheduler ended the job; resubmit from the last checkpoint, never cordon"
    if not rests_on_evidence(report.decided_by):
        # The floor no setting lowers (actions.min_confidence, escalation): an opinion never takes a node out.
        return f"{LEARNED_VERDICT}: {report.decided_by} chose {report.failure_type}; no rule or catalog entry supports it"
    if report.action != Action.CORDON_AND_RESTART and not escalated and not graded:
        return f"recommended action is {report.action}, not cordon_and_restart"
    if not report.culprits.hosts:
        why = report.notes[-1] if report.notes else "no line names the node"
        return f"{NODE_UNKNOWN}: {why}"
    _, refused = node_names(report.culprits.hosts)
    if refused:
        return f"not a single plain host name: {refused[0][:80]!r}"
    if not report.culprits.verified:
        return (f"{UNVERIFIED_HOST}: {', '.join(report.culprits.hosts)} named only by a sender that may not speak for "
                "it (server.tokens[].hosts, a node credential, or the scheduler's node list would say the job ran there)")
    if not report.culprits.corroborated:
        basis = report.culprits.basis or "no basis"
        return f"culprit not corroborated ({basis}): no second signal that {', '.join(report.culprits.hosts)} is at fault"
    if report.confidence < settings.min_confidence and not escalated:
        return f"confidence {report.confidence:.2f} below actions.min_confidence {settings.min_confidence:.2f}"
    return None


def capsule_refusal(missing: str, settings: ActionsSettings, action: str = "cordon") -> str | None:
    """Why an action whose evidence capsule could not be written (`missing` says why) must not happen; None when
    the capsule is there, or the operator lets it go without one (`actions.capsule.act_without`)."""
    if not missing or settings.capsule.act_without:
        return None
    return f"{missing}; actions.capsule.act_without is false: no {action} without the evidence"


def cordon_targets(report: Report) -> list[NodeName]:
    """The nodes a report's cordon is about: its culprit hosts that are valid names."""
    return node_names(report.culprits.hosts)[0]


# -- cluster-wide limits ----------------------------------------------------------------------------


def budget_refusal(node: NodeName, recent: Collection[str], settings: ActionsSettings) -> str | None:
    """Why cordoning `node` would break the per-window budget, given the keys of the nodes cordoned
    (for real) in the window. Re-cordoning one of those is no new cordon."""
    if node.key in recent or len(recent) < settings.max_cordons:
        return None
    return (f"safety limit: {len(recent)} node(s) already cordoned in the last {settings.window_s:g} s "
            f"({', '.join(sorted(recent)) or '-'}); actions.max_cordons={settings.max_cordons}")


def breaker_refusal(node: NodeName, recent: Collection[str], known: int, settings: ActionsSettings) -> str | None:
    """Why cordoning `node` must open the circuit breaker: it would put more than
    `breaker_max_share` of the `known` nodes under cordon within the breaker's window (`recent`:
    the keys of the nodes cordoned in it). One node alone never trips it: the budget covers that."""
    after = set(recent) | {node.key}
    if len(after) < 2:
        return None
    known = max(known, len(after))
    share = len(after) / known
    if share <= settings.breaker_max_share:
        return None
    return (f"circuit breaker: cordoning {node} would put {len(after)} of {known} known nodes under cordon within "
            f"{settings.breaker_window_s:g} s ({share:.0%} > actions.breaker_max_share "
            f"{settings.breaker_max_share:.0%})")


# -- restarts ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AttemptOutcome:
    """What one attempt of a job came to, as the restart policy needs it."""

    failure_type: str | None
    hosts: tuple[str, ...] = ()
    progress_lines: int | None = None  # None: not known
    ok: bool = False

    @classmethod
    def of(cls, report: Report | None, progress_lines: int | None, ok: bool = False) -> AttemptOutcome:
        if report is None or report.status != "failed":
            return cls(None, (), progress_lines, ok=ok or report is not None)
        return cls(report.failure_type, tuple(sorted(report.culprits.hosts)), progress_lines, ok=ok)


@dataclass(frozen=True, slots=True)
class RestartVerdict:
    decision: Literal["restart", "resubmit", "stop"]
    reason: str

    @property
    def stop(self) -> bool:
        return self.decision == "stop"


def restart_verdict(previous: AttemptOutcome | None, current: AttemptOutcome) -> RestartVerdict:
    """Restart, resubmit (time limit: from the last checkpoint, never cordon) or stop, from this
    attempt and the one before it (None: the first attempt)."""
    if previous is not None and not previous.ok:
        if current.progress_lines == 0:
            return RestartVerdict("stop", "no progress since the last attempt: handing the job to its owner")
        same = current.failure_type is not None and current.failure_type == previous.failure_type
        if same and current.hosts and previous.hosts and set(current.hosts) != set(previous.hosts):
            return RestartVerdict(
                "stop", f"{current.failure_type} again, now on {', '.join(current.hosts)} after "
                f"{', '.join(previous.hosts)}: the failure follows the job, not a node; handing it to its owner")
    if is_resubmit(current.failure_type):
        return RestartVerdict("resubmit", f"{current.failure_type}: resubmit from the last checkpoint (no cordon)")
    return RestartVerdict("restart", f"{current.failure_type or 'failure'}")


def restart_confidence_refusal(report: Report, settings: ActionsSettings) -> str | None:
    """Why a report is not sure enough to restart a job; None when it is. A time limit or a
    preemption says so in the scheduler's own words: when a rule matched that very root line, its
    resubmission needs no more (nothing is cordoned); any other verdict, the LLM's included, needs
    `actions.min_confidence`."""
    if report.confidence >= settings.min_confidence:
        return None
    if is_resubmit(report.failure_type) and _rule_matched_root(report):
        return None
    return f"confidence {report.confidence:.2f} below actions.min_confidence {settings.min_confidence:.2f}"


def _rule_matched_root(report: Report) -> bool:
    root = report.root_cause
    return root is not None and any(e.line_no == root.line_no and e.source.startswith("rule:")
                                    for e in report.evidence)


def restart_refusal(report: Report, settings: ActionsSettings, cordons: Sequence[_CordonOutcome],
                    verdict: RestartVerdict | None = None) -> str | None:
    """Why the restart hook must not run after these cordons; None when it may."""
    if report.category != Category.INFRASTRUCTURE or report.action not in (Action.RESTART, Action.CORDON_AND_RESTART):
        return f"{report.category} / {report.action}: restarts only follow infrastructure causes"
    unsure = restart_confidence_refusal(report, settings)
    if unsure is not None:
        return unsure
    if verdict is not None and verdict.stop:
        return verdict.reason
    if report.action == Action.CORDON_AND_RESTART and not is_resubmit(report.failure_type):
        bad = [c for c in cordons if c.action == "cordon" and c.outcome in ("refused", "failed", "skipped")
               and not is_already_cordoned(c)]
        if bad:
            return f"not restarting onto a suspect node: cordon of {bad[0].node or 'the node'} {bad[0].outcome}"
    return None


ALREADY_CORDONED = "already cordoned"


def is_already_cordoned(c: _CordonOutcome) -> bool:
    """A cordon skipped because the node is cordoned already: the node is out of scheduling."""
    return c.outcome == "skipped" and c.detail.startswith(ALREADY_CORDONED)
