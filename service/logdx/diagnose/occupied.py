"""A CUDA out-of-memory that is not the job's own: another process held most of the GPU.

torch's message says who holds the GPU's memory: "GPU 2 has a total capacity of 178.35 GiB of which
73.44 MiB is free. Process 3196149 has 96.44 GiB memory in use. Including non-PyTorch memory, this process
has 81.81 GiB memory in use." The other processes are not this rank: a leftover of an earlier job (a
zombie), another tenant on a shared node. Lowering the batch size is the wrong advice; the node must be
freed, and the job restarted once it is (or elsewhere). Several ranks of one job sharing a GPU (a wrong
device mapping) list each other the same way: a holder the log shows as one of the job's own
processes (the launcher names its workers' pids) keeps the out-of-memory the job's.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from logdx.diagnose.rules.compiled import RuleHit
from logdx.model import FT, Category, Event, Label, Role
from logdx.taxonomy import make_label


class _Finding(Protocol):
    """What this reads of a finding (`rootcause.Finding`, whose module imports this one)."""

    @property
    def event(self) -> Event: ...

    @property
    def hit(self) -> RuleHit: ...



__all__ = ["taken_by_another_process", "taken_label"]

_UNITS = {"KiB": 1 / (1024 * 1024), "MiB": 1 / 1024, "GiB": 1.0}
_STATEMENT = re.compile(
    r"GPU (?P<gpu>\d+) has a total capacity of (?P<total>[\d.]+) (?P<tu>[KMG]iB) of which (?P<free>[\d.]+) "
    r"(?P<fu>[KMG]iB) is free\.(?P<procs>(?:\s*Process \d+ has [\d.]+ [KMG]iB memory in use\.)+)"
    r"\s*Including non-PyTorch memory, this process has [\d.]+ [KMG]iB memory in use")
_PROCESS = re.compile(r"Process (?P<pid>\d+) has (?P<n>[\d.]+) (?P<u>[KMG]iB) memory in use")
_JOB_PID = re.compile(r"(?:\bpid[:=\s]+|[Ss]ending process |\bPID )(?P<pid>\d+)")
_TAKEN_SHARE = 0.25  # other processes held at least this share of the GPU: not the job's own growth
_CONFIDENCE = 0.85


def taken_by_another_process(winner: _Finding, findings: Sequence[_Finding]) -> RuleHit | None:
    """`winner`'s hit as a GPU another process held, when its out-of-memory says so; else None (the
    caller, which owns the finding, puts the new hit in it)."""
    if winner.hit.label.failure_type != FT.CUDA_OOM:
        return None
    s = _statement(winner)
    if s is None or s.held_by_others < _TAKEN_SHARE * s.total or _one_of_the_jobs(set(s.holders), findings):
        return None
    host = winner.hit.line.host
    where = f"GPU {s.gpu} of {host}" if host else f"GPU {s.gpu}"
    hint = (f"{where} had {s.free:.2f} GiB free of {s.total:.0f} GiB: process {s.holders[0]}, not this job, held "
            f"{s.held_by_others:.1f} GiB. "
            f"Find it (nvidia-smi on that node): a leftover of an earlier job or another tenant. Restart once it "
            f"is gone, or on other nodes; drain the node if it stays.")
    return replace(winner.hit, rule_id="gpu-memory-taken", pack="occupied", role=Role.ROOT_CAUSE,
                   title="Another process held the GPU's memory", confidence=_CONFIDENCE, hint=hint, hint_rule=None,
                   label=taken_label())


def taken_label() -> Label:
    """The label of an out-of-memory another process caused (decided here, from the message's numbers)."""
    return make_label(Category.INFRASTRUCTURE, FT.GPU_MEMORY_TAKEN)


@dataclass(frozen=True, slots=True)
class _Statement:
    """What an out-of-memory message says of its GPU (sizes in GiB)."""

    gpu: int
    total: float
    free: float
    holders: list[str]  # the other processes' pids, the biggest first
    held_by_others: float


def _statement(finding: _Finding) -> _Statement | None:
    text = " ".join([finding.event.exception_message or "", *(r.text for r in finding.event.lines[-6:])])
    m = _STATEMENT.search(text)
    if m is None:
        return None
    procs = [(p["pid"], float(p["n"]) * _UNITS[p["u"]]) for p in _PROCESS.finditer(m["procs"])]
    procs.sort(key=lambda p: -p[1])
    return _Statement(gpu=int(m["gpu"]), total=float(m["total"]) * _UNITS[m["tu"]],
                      free=float(m["free"]) * _UNITS[m["fu"]], holders=[p for p, _ in procs],
                      held_by_others=sum(n for _, n in procs))


def _one_of_the_jobs(pids: set[str], findings: Sequence[_Finding]) -> bool:
    """Whether the log shows a holder as one of the job's own processes (the launcher's "exitcode : 1
    (pid: 4412)", "Sending process 4412 closing signal"): ranks sharing a GPU by a wrong device mapping."""
    for f in findings:
        for rec in f.event.lines:
            for m in _JOB_PID.finditer(rec.text):
                if m["pid"] in pids:
                    return True
    return False
