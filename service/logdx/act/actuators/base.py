"""What an actuator and a restart hook are: the two ways logdx acts on a cluster.

A new actuator is one module beside this one (see `slurm.py`, the smallest) and one line in
`ACTUATORS` (`__init__.py`): its class declares its `name` (a choice of `actions.actuator`) and its
`Settings` (the section `actions.<name>`), from which `logdx.config` builds the configuration. It never
decides *whether* to act: `logdx.act.policy` does, and `logdx.act.actions.Actions` audits every call.

Actuators only ever receive `NodeName`s: one plain, validated host name each (`logdx.hosts`), never
a Slurm range (`gpu[001-512]`), a list, a glob or `ALL`, which a scheduler would expand into many
nodes. `node_names()` turns what a report says into such names and says what it refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from logdx.act.report import Report
from logdx.hosts import is_valid_hostname
from logdx.settings_base import Section


class ActionFailed(Exception):
    """An action was tried and did not work; the message is what the audit records."""


class NodeName(str):
    """One node, by a name that cannot stand for several: constructing one validates it."""

    __slots__ = ()

    def __new__(cls, name: str) -> NodeName:
        if isinstance(name, NodeName):
            return name
        if not isinstance(name, str) or not is_valid_hostname(name):
            raise ValueError(f"not a single plain host name: {str(name)[:80]!r}")
        return super().__new__(cls, name)

    @property
    def key(self) -> str:
        """What identifies the node (host names are case-insensitive): what budgets count."""
        return self.lower()


def node_names(values: Iterable[str]) -> tuple[list[NodeName], list[str]]:
    """The distinct valid node names among `values` (in order), and the values refused."""
    valid: dict[str, NodeName] = {}
    refused: list[str] = []
    for value in values:
        try:
            node = NodeName(value)
        except ValueError:
            refused.append(str(value))
            continue
        valid.setdefault(node.key, node)
    return list(valid.values()), refused


def require_node(node: object) -> NodeName:
    """The last check before a node name reaches a command line or an API path."""
    if not isinstance(node, NodeName):
        raise TypeError(f"actuators take NodeName, not {type(node).__name__}")
    return node


class Actuator(Protocol):
    """Takes a node out of scheduling (cordon, drain) and puts it back (uncordon, resume)."""

    name: str  # as in `actions.actuator` and the audit's `actuator` column

    def describe(self, node: NodeName, job_id: str, report: Report, *, capsule: str = "") -> str:
        """What `cordon` would do, in words a dry run audits ("run: scontrol update ...")."""
        ...

    def cordon(self, node: NodeName, job_id: str, report: Report, *, capsule: str = "") -> str:
        """Do it; returns what was done. Any exception is audited as a failure. `capsule`: the sha256 of the
        evidence capsule written before (`logdx.act.capsule`), which the node's reason or annotation names."""
        ...

    def describe_uncordon(self, node: NodeName) -> str:
        """What `uncordon` would do."""
        ...

    def uncordon(self, node: NodeName) -> str:
        """Put the node back into scheduling; returns what was done."""
        ...

    def describe_avoid(self, node: NodeName, family: str) -> str:
        """What `avoid` would do."""
        ...

    def avoid(self, node: NodeName, family: str, reason: str) -> tuple[str, str]:
        """Make the scheduler prefer other nodes over this one, without taking it out (a node graded `avoid`,
        `logdx.act.nodes`); returns what was done and what `unavoid` needs to undo it exactly (the weight it
        had). Any exception is audited as a failure."""
        ...

    def describe_unavoid(self, node: NodeName, undo: str) -> str:
        """What `unavoid` would do."""
        ...

    def unavoid(self, node: NodeName, undo: str) -> str:
        """Lift the avoid mark (`undo`: what `avoid` returned for it); returns what was done."""
        ...

    def nodes_of_job(self, job_name: str) -> list[str] | None:
        """The nodes the scheduler ran the job on (its name as its shipper gave it), or None when the scheduler
        does not know it: what makes a culprit host that only a claim named one of the job's
        (`actions.ask_scheduler`). Any exception is a "does not know"."""
        ...


class ActuatorClass(Protocol):
    """What `ACTUATORS` holds: an actuator's class, which names itself and its settings section."""

    name: str  # a choice of `actions.actuator`, and the name of its section `actions.<name>`

    @property
    def Settings(self) -> type[Section]:  # a class: the fields of `actions.<name>`
        ...

    def __call__(self, settings: Any) -> Actuator:
        """Build the actuator from its own section (an instance of `Settings`)."""
        ...


class RestartHook(Protocol):
    """Restarts a job after an infrastructure failure (a command, a webhook)."""

    name: str  # the audit's `actuator` column: "command" | "webhook"

    def describe(self, values: dict[str, str]) -> str:
        """What `trigger` would do ("run: sbatch ...", "POST https://host/path")."""
        ...

    def trigger(self, job_id: str, values: dict[str, str], report: Report) -> str:
        """Do it; returns what was done; raises `ActionFailed` with the audit's detail."""
        ...
