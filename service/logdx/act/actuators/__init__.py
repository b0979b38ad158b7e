"""Actuators (cordon a node), each behind a small Protocol (`base.py`); restart hooks are `restart.py`.

`ACTUATORS` is the registry: each class declares its own name (`actions.actuator`, the audit's `actuator`
column) and its own settings (the section `actions.<name>`), and `logdx.config` builds the `actions`
section from it. So this package stays light (no Kubernetes client, no HTTP client, no `logdx.config`
at import): the configuration imports it. `logdx.act.actions.Actions` applies the policy
(`logdx.act.policy`), calls the actuator, and audits every call.
"""

from __future__ import annotations

from typing import Protocol

from logdx.act.actuators.base import ActionFailed, Actuator, ActuatorClass, NodeName, RestartHook, node_names
from logdx.act.actuators.kubernetes import TAINT_KEY, KubernetesActuator
from logdx.act.actuators.slurm import SlurmActuator
from logdx.settings_base import Section

__all__ = [
    "ACTUATORS",
    "TAINT_KEY",
    "ActionFailed",
    "Actuator",
    "ActuatorClass",
    "ChosenActuator",
    "KubernetesActuator",
    "NodeName",
    "RestartHook",
    "SlurmActuator",
    "make_actuator",
    "node_names",
]

# One line per actuator: nothing else lists them.
ACTUATORS: dict[str, ActuatorClass] = {cls.name: cls for cls in (KubernetesActuator, SlurmActuator)}


class ChosenActuator(Protocol):
    """What `make_actuator` reads of the settings (`logdx.config.ActionsSettings`, which imports this
    registry: naming it here would be an import circle)."""

    @property
    def actuator(self) -> str: ...

    def actuator_settings(self) -> Section | None: ...


def make_actuator(settings: ChosenActuator) -> Actuator | None:
    """The configured actuator, built from its own section; None for `actions.actuator: none`."""
    cls = ACTUATORS.get(settings.actuator)
    return cls(settings.actuator_settings()) if cls is not None else None
