"""Slurm: `scontrol update NodeName=<node> State=DRAIN Reason="logdx: <failure_type> <job> capsule=<sha256 prefix>"`
to cordon (the evidence capsule's sha256, when one was written), `State=RESUME` to uncordon
(`actions.slurm.scontrol` names the executable). Avoid (a node graded `avoid`) = `scontrol update NodeName=<node>
Weight=<actions.slurm.avoid_weight>`: Slurm allocates the lowest-weight nodes first, so jobs land there only when
nothing better is free; the weight the node had (read with `scontrol show node -o`) is what unavoid puts back. The
argv is built from one validated `NodeName`, never from a range or a list, and run without a shell."""

from __future__ import annotations

import re
import shlex
import subprocess

from pydantic import Field

from logdx.act.actuators.base import NodeName, require_node
from logdx.act.report import Report
from logdx.settings_base import Section

COMMAND_TIMEOUT_S = 60.0
CAPSULE_PREFIX = 16  # hex digits of the evidence capsule's sha256 in the reason: enough to find its folder


class SlurmSettings(Section):
    """How the Slurm actuator drains and resumes a node."""

    scontrol: str = Field("scontrol", description="the scontrol executable (a name on PATH, or a path)")
    job_id: str = Field(r"(\d+)$", description="with actions.ask_scheduler: how the Slurm job id is read from a "
                        "logdx job's name (a regular expression, its first group; ship with X-Logdx-Job: $SLURM_JOB_ID)")

    avoid_weight: int = Field(1_000_000, ge=1, le=4_294_967_280,
                              description="the Weight an avoided node is given (Slurm allocates the lowest weights "
                              "first): above every weight of slurm.conf")

    moved_here = {"scontrol": "scontrol"}


class SlurmActuator:
    name = "slurm"
    Settings = SlurmSettings

    def __init__(self, settings: SlurmSettings) -> None:
        self.scontrol = settings.scontrol
        self.job_id = re.compile(settings.job_id)
        self.avoid_weight = settings.avoid_weight

    def argv(self, node: NodeName, job_id: str, report: Report, capsule: str = "") -> list[str]:
        reason = f"logdx: {report.failure_type or 'unknown'} {job_id}"
        if capsule:
            reason += f" capsule={capsule[:CAPSULE_PREFIX]}"
        return [self.scontrol, "update", f"NodeName={require_node(node)}", "State=DRAIN", f"Reason={reason}"]

    def resume_argv(self, node: NodeName) -> list[str]:
        return [self.scontrol, "update", f"NodeName={require_node(node)}", "State=RESUME"]

    def describe(self, node: NodeName, job_id: str, report: Report, *, capsule: str = "") -> str:
        return "run: " + shlex.join(self.argv(node, job_id, report, capsule))

    def cordon(self, node: NodeName, job_id: str, report: Report, *, capsule: str = "") -> str:
        return _run(self.argv(node, job_id, report, capsule))

    def describe_uncordon(self, node: NodeName) -> str:
        return "run: " + shlex.join(self.resume_argv(node))

    def uncordon(self, node: NodeName) -> str:
        return _run(self.resume_argv(node))

    def weight_argv(self, node: NodeName, weight: int) -> list[str]:
        return [self.scontrol, "update", f"NodeName={require_node(node)}", f"Weight={weight}"]

    def describe_avoid(self, node: NodeName, family: str) -> str:
        return "run: " + shlex.join(self.weight_argv(node, self.avoid_weight))

    def avoid(self, node: NodeName, family: str, reason: str) -> tuple[str, str]:
        before = self._weight(node)
        done = _run(self.weight_argv(node, self.avoid_weight))
        return f"{done} (was Weight={before})", f"Weight={before}"

    def describe_unavoid(self, node: NodeName, undo: str) -> str:
        return "run: " + shlex.join(self.weight_argv(node, _weight_of(undo)))

    def unavoid(self, node: NodeName, undo: str) -> str:
        return _run(self.weight_argv(node, _weight_of(undo)))

    def _weight(self, node: NodeName) -> int:
        """The node's Weight now (`scontrol show node -o`)."""
        argv = [self.scontrol, "show", "node", "-o", require_node(node)]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False)
        found = _WEIGHT.search(proc.stdout) if proc.returncode == 0 else None
        if found is None:
            raise RuntimeError(f"{shlex.join(argv)}: no Weight= in its answer (exit {proc.returncode}): "
                               f"{(proc.stderr or proc.stdout).strip()[:300]}")
        return int(found.group(1))

    def nodes_of_job(self, job_name: str) -> list[str] | None:
        """`scontrol show job -o <id>`'s NodeList, expanded (a job Slurm no longer knows: None)."""
        m = self.job_id.search(job_name)
        if m is None:
            return None
        out = subprocess.run([self.scontrol, "show", "job", "-o", m.group(1)], capture_output=True, text=True,
                             timeout=COMMAND_TIMEOUT_S, check=False)
        found = _NODE_LIST.search(out.stdout) if out.returncode == 0 else None
        if found is None or found.group(1) in ("", "(null)"):
            return None
        return _expanded(found.group(1))


_NODE_LIST = re.compile(r"(?:^|\s)NodeList=(\S*)")
_WEIGHT = re.compile(r"(?:^|\s)Weight=(\d+)\b")
_DEFAULT_WEIGHT = 1  # Slurm's own default


def _weight_of(undo: str) -> int:
    """The weight an `undo` word of `avoid` puts back (Slurm's default when it says none)."""
    m = re.fullmatch(r"Weight=(\d+)", undo.strip())
    return int(m.group(1)) if m else _DEFAULT_WEIGHT


_MAX_JOB_NODES = 100_000


def _expanded(node_list: str) -> list[str] | None:
    """A Slurm hostlist as plain host names; None when it is none."""
    import hostlist

    from logdx.hosts import clean_hostname

    try:
        names = hostlist.expand_hostlist(node_list)
    except hostlist.BadHostlist:
        return None
    hosts = [h for name in names[:_MAX_JOB_NODES] if (h := clean_hostname(name))]
    return hosts or None


def _run(argv: list[str]) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)} exited {proc.returncode}: {proc.stderr.strip()[:500]}")
    return "ran: " + shlex.join(argv)
