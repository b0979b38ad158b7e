"""What the whole-job generators share: the ground truth of a generated job, and its healthy start.

``healthy.py``, ``hangs.py`` and ``divergence.py`` each write one long multi-rank job and return a
``JobTruth``: the label the generator knows to be right (never computed by logdx), with the lines any of
which is a right root line, the culprit, and for divergences the step where the loss went wrong.

Conventions shared by all three
    * ``exit_code``: what the launcher returned, ``0`` for a run that ended well; ``None`` when the log
      was cut while the job still ran (or its end is unknown), so only the log can tell.
    * ``root_line_nos``: 1-based line numbers of the lines that each are a right root line (several
      when the same evidence is printed by several ranks in the same moment); empty for healthy jobs.
    * ``culprit_ranks`` / ``culprit_hosts``: who is to blame; ``culprit_hosts`` is empty when the log
      never ties that rank to its host (no host in the prefixes, no NCCL INFO lines, no launcher
      line naming both), so a report cannot be asked to name it.
    * ``divergence_step``: the first logged step that shows the divergence, and ``step_tolerance``
      (two logging intervals: the loss is only seen where it is printed).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

from logdx.synth.generate import check_job_shape, make_job
from logdx.synth.job import Job
from logdx.synth.noise import Realism, new_realism
from logdx.synth.training import framework_startup, launcher_startup, nccl_init, train_until


@dataclass(slots=True)
class JobTruth:
    """What a correct diagnosis of one generated whole job says (see the module docstring)."""

    kind: str  # "healthy" | "silent_hang" | "stack_hang" | "divergence" | "spike"
    status: str  # "failed" | "healthy"
    category: str | None
    failure_type: str | None
    action: str
    exit_code: int | None
    root_line_nos: list[int] = field(default_factory=list)
    root_line: str | None = None  # the first of them, as written
    culprit_ranks: list[int] = field(default_factory=list)
    culprit_hosts: list[str] = field(default_factory=list)
    divergence_step: int | None = None
    step_tolerance: int = 0
    last_step: int | None = None  # the last training step the log shows
    # how the job was made
    lines_written: int = 0
    seed: int = 0
    style: str = ""
    flavour: str = ""
    ranks: int = 0
    hosts: list[str] = field(default_factory=list)
    families: list[str] = field(default_factory=list)  # the harmless noise families it carries
    variant: dict[str, object] = field(default_factory=dict)  # generator-specific choices

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


@dataclass(frozen=True, slots=True)
class GeneratedCase:
    """One job of a generated set: its id, its generator and the generator's keyword arguments."""

    case_id: str
    write: Callable[..., JobTruth]
    kwargs: dict[str, Any]

    def generate(self, out: TextIO) -> JobTruth:
        return self.write(out, **self.kwargs)


def start_job(out: TextIO, *, name: str, seed: int, ranks: int, lines: int, style: str, flavour: str,
              gpus_per_host: int = 8, nccl_debug: bool = True, exclude: frozenset[str] = frozenset(),
              prepare: Callable[[Job], None] | None = None) -> tuple[Job, Realism]:
    """A job with a realism profile, launched and started up (launchers, store retries, framework
    banner, downloads, warnings, NCCL INFO init when ``nccl_debug``), ready to train. ``prepare``
    sets the job up before anything is written (e.g. fp16 loss scaling, which the banner shows)."""
    check_job_shape(style, flavour, ranks, gpus_per_host)
    job = make_job(out, name=name, seed=seed, ranks=ranks, gpus_per_host=gpus_per_host, lines=lines, style=style,
                   noise=1.0, flavour=flavour)
    job.nccl_debug = nccl_debug
    if prepare is not None:
        prepare(job)
    realism = new_realism(job, steps=expected_steps(job, lines), exclude=exclude)
    realism.at_begin(job)
    launcher_startup(job)
    realism.at_launch(job)
    framework_startup(job)
    realism.at_startup(job)
    if nccl_debug:
        nccl_init(job)
    return job, realism


def expected_steps(job: Job, lines: int) -> int:
    """About how many log steps ``lines`` lines hold for this job."""
    per_step = job.cluster.world_size + 2 if job.flavour.per_rank_lines else 2
    return max(10, lines // per_step)


def startup_lines(ranks: int) -> int:
    """About how many lines the start of a ``ranks``-rank job takes (NCCL init is ~25 per rank)."""
    return 40 * ranks + 200


def train_to(job: Job, stop_line: int) -> None:
    train_until(job, stop_line)


def log_interval(job: Job) -> int:
    """Iterations between two lines that print the loss."""
    return job.flavour.iters_per_step * max(1, getattr(job.flavour, "logging_steps", 1))


def host_named(job: Job, rank: int, *, launcher_names_it: bool = False) -> bool:
    """Whether the log ties ``rank`` to its host: hosts in the prefixes, the framework's banner, NCCL INFO lines
    (``node-03:1234:1234 [2] NCCL INFO ... rank 17 nranks 64``), srun's per-host task lines, an NCCL WARN
    of the IB port flap on its node (printed with the rank's prefix), or a launcher line naming both
    (``launcher_names_it``: torchrun's failure box, mpirun's "process rank N ... on node H")."""
    if job.nccl_debug or launcher_names_it or job.flavour.names_hosts or job.style.name in ("pdsh", "pdsh_torchrun", "srun"):
        return True
    r = job.realism
    return (r is not None and "ib_flap" in r.families and 0 <= r.ib_flap_step < job.step
            and r.ib_flap_host == job.cluster.host_index(rank))
