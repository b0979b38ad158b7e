"""Actuators (cordon a node) and restart hooks, each behind a small Protocol (`base.py`).

`ACTUATORS` maps `actions.actuator` to an implementation; `logdx.act.actions.Actions` applies the
policy (`logdx.act.policy`), calls them, and audits every call.
"""

from __future__ import annotations

from collections.abc import Callable

from logdx.act.actuators.base import ActionFailed, Actuator, NodeName, RestartHook, node_names
from logdx.act.actuators.kubernetes import TAINT_KEY, KubernetesActuator
from logdx.act.actuators.restart import (
    CommandRestart,
    TemplateError,
    WebhookRestart,
    fill_argv,
    fill_command,
    make_restart_hook,
    parse_template,
)
from logdx.act.actuators.slurm import SlurmActuator
from logdx.config import ActionsSettings

__all__ = [
    "ACTUATORS",
    "TAINT_KEY",
    "ActionFailed",
    "Actuator",
    "CommandRestart",
    "KubernetesActuator",
    "NodeName",
    "RestartHook",
    "SlurmActuator",
    "TemplateError",
    "WebhookRestart",
    "fill_argv",
    "fill_command",
    "make_actuator",
    "make_restart_hook",
    "node_names",
    "parse_template",
]

# Each implementation declares its own name (`actions.actuator`, the audit's `actuator` column).
ACTUATORS: dict[str, Callable[[ActionsSettings], Actuator]] = {
    cls.name: cls for cls in (KubernetesActuator, SlurmActuator)
}


def make_actuator(settings: ActionsSettings) -> Actuator | None:
    """The configured actuator; None for `actions.actuator: none`."""
    factory = ACTUATORS.get(settings.actuator)
    return factory(settings) if factory is not None else None
