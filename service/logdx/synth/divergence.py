"""Divergences of whole jobs: the loss goes wrong and training carries on printing it, with no
exception anywhere, until a person cancels the job or the log is taken while it still runs.

    from logdx.synth.divergence import divergence_job, divergence_set
    truth = divergence_job(out, seed=1, flavour="megatron", style="srun", ranks=64, lines=12000, kind="spike")

Kinds (``kind``), each a shape of the series the framework prints:
    ``spike``           the loss jumps to 2-2.6 times its level within one to three log steps and never
                        comes back (Megatron's ``lm loss`` going from ~6 to ~14: logdx issue 19; the
                        BLOOM team's "recovering from loss spikes strategies" thread,
                        bigscience-workshop/Megatron-DeepSpeed#57, for what not recovering means);
    ``nan``             the loss (and grad norm) turn NaN and stay NaN (``loss nan``, ``'loss': nan``);
    ``nan_iterations``  Megatron's ``number of nan iterations`` > 0 in every interval from then on, while
                        the reported ``lm loss`` (averaged over the finite iterations) still looks fine;
    ``skipped``         Megatron fp16: ``number of skipped iterations`` climbs until every iteration of an
                        interval is skipped and the ``loss scale`` collapses to 1.0; the loss stops moving;
    ``grad_norm``       the grad norm blows up by orders of magnitude and the loss climbs after it.
Frameworks: ``spike`` and ``nan`` on every framework that prints a loss; ``nan_iterations`` and
``skipped`` on Megatron; ``grad_norm`` on the frameworks that print a grad norm.

Label (``JobTruth``): status ``failed``, ``framework`` / ``nan_loss`` / ``no_restart`` (the fix is to roll
back to the checkpoint before the divergence and skip the data that followed, not to restart from the
latest one). ``divergence_step``: the iteration printed on the first progress line that shows the
divergence; ``step_tolerance``: two logging intervals. Right root lines: the progress lines of that
step that show it. ``variant["rollback_to"]``: the last checkpoint saved before it. ``exit_code``: 143
when a person cancelled the job (Slurm's ``CANCELLED`` line, the launchers' SIGTERM), ``None`` when the
log is cut while it still runs.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from random import Random
from typing import TextIO

from logdx.model import FT, Action, Category
from logdx.synth.cascade import end_job
from logdx.synth.hangs import step_lines
from logdx.synth.job import Job
from logdx.synth.longjob import GeneratedCase, JobTruth, log_interval, start_job, startup_lines, train_to
from logdx.synth.training import write_step

KINDS = ("spike", "nan", "nan_iterations", "skipped", "grad_norm")
LABEL = (Category.FRAMEWORK, FT.NAN_LOSS, Action.NO_RESTART)
# What a progress line shows when it shows the divergence, per kind.
_SHOWS = {
    "spike": re.compile(r"loss", re.IGNORECASE),
    "nan": re.compile(r"\bnan\b", re.IGNORECASE),
    "nan_iterations": re.compile(r"number of nan iterations:\s*[1-9]"),
    "skipped": re.compile(r"number of skipped iterations:\s*[1-9]"),
    "grad_norm": re.compile(r"grad[ _]norm", re.IGNORECASE),
}
FLAVOURS_OF = {
    "spike": ("megatron", "deepspeed", "hf", "lightning", "fsdp", "nemo", "plain"),
    "nan": ("deepspeed", "hf", "lightning", "fsdp", "nemo", "plain"),
    "nan_iterations": ("megatron",),
    "skipped": ("megatron",),
    "grad_norm": ("megatron", "deepspeed", "hf", "lightning", "plain"),
}


@dataclass
class Divergence:
    """Reshapes every step's values from log step ``onset`` on (a ``Job.step_hooks`` entry)."""

    kind: str
    onset: int
    factor: float
    rng: Random
    held_loss: float = 0.0
    skipped: int = 0

    def apply(self, job: Job) -> None:
        k = job.step - self.onset
        if k < 0:
            return
        iters = job.flavour.iters_per_step
        match self.kind:
            case "spike":
                ramp = min(1.0, (k + 1) / 2.0)
                job.loss *= 1.0 + (self.factor - 1.0) * ramp
                job.grad_norm *= 2.0 + 3.0 * self.rng.random()
            case "nan":
                job.nan = True
                job.loss = job.grad_norm = math.nan
            case "nan_iterations":
                job.nan_iters = min(iters, 1 + k // 2 + self.rng.randrange(2))
                job.grad_norm *= 1.5
            case "skipped":
                if k == 0:
                    self.held_loss = job.loss
                self.skipped = min(iters, 1 + 2 * k)
                job.skipped_iters = self.skipped
                job.loss_scale = max(1.0, job.loss_scale / 2 ** self.skipped)
                job.loss = self.held_loss + 0.01 * (self.rng.random() - 0.5)  # no update is applied any more
            case "grad_norm":
                job.grad_norm = min(1e6, job.grad_norm * 10 ** (1.5 + 0.4 * min(k, 10)))
                job.loss *= 1.0 + min(1.5, 0.12 * k)


def divergence_job(out: TextIO, *, seed: int, flavour: str, style: str, ranks: int, lines: int, kind: str = "spike",
                   ending: str = "cancel", gpus_per_host: int = 8, without: frozenset[str] = frozenset()) -> JobTruth:
    """Write one diverging whole job to ``out`` (see the module docstring)."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; choose from {', '.join(KINDS)}")
    if flavour not in FLAVOURS_OF[kind]:
        raise ValueError(f"{kind} needs one of {', '.join(FLAVOURS_OF[kind])}")
    if ending not in ("cancel", "cut"):
        raise ValueError("ending must be 'cancel' or 'cut'")

    def prepare(job: Job) -> None:
        if kind == "skipped":
            job.flavour.fp16 = True

    job, realism = start_job(out, name=f"diverge-{kind}", seed=seed, ranks=ranks, lines=lines, style=style,
                             flavour=flavour, gpus_per_host=gpus_per_host, nccl_debug=True, prepare=prepare,
                             exclude=without | {"spike"})  # a recovering spike has its own jobs
    rng = job.rng
    if kind == "skipped" and "overflow" not in realism.families:
        realism.scale_pow = 32
        job.step_hooks.insert(0, realism.megatron_scaler)
    per_step = job.cluster.world_size + 2 if job.flavour.per_rank_lines else 2
    room = max(0, lines - job.sink.count)
    after_steps = max(8, int(room * rng.uniform(0.15, 0.35)) // per_step)
    train_to(job, job.sink.count + room - after_steps * per_step)
    # the divergence starts on a step that prints the loss (the HF Trainer prints it every logging_steps)
    every = max(1, getattr(job.flavour, "logging_steps", 1))
    while (job.iteration + job.flavour.iters_per_step) % (every * job.flavour.iters_per_step) and every > 1:
        write_step(job)
    ckpt = _last_checkpoint(job)
    div = Divergence(kind, job.step + 1, rng.uniform(2.0, 2.6), rng)
    job.step_hooks.append(div.apply)
    onset = step_lines(job)
    shows = _SHOWS[kind]
    root_nos = [no for _, no, line in onset if shows.search(line)]
    onset_step = job.iteration
    train_to(job, job.sink.count + after_steps * per_step)
    exit_code: int | None = None
    if ending == "cancel":
        t = job.now + rng.uniform(60.0, 1800.0)
        burst = job.burst()
        if job.slurm:
            burst.add(t, f"slurmstepd: error: *** JOB {job.cluster.slurm_job_id} ON {job.cluster.hosts[0]} CANCELLED AT "
                         f"{job.clock.iso(t)} ***")
        end_job(job, burst, {}, cancel_at=t)
        job.now = burst.drain(job.sink)
        exit_code = 143
    job.sink.flush()
    c = job.cluster
    return JobTruth(
        kind="divergence", status="failed", category=LABEL[0], failure_type=LABEL[1], action=LABEL[2],
        exit_code=exit_code, root_line_nos=root_nos, root_line=next((line for _, no, line in onset if no == root_nos[0]),
                                                                     None) if root_nos else None,
        divergence_step=onset_step, step_tolerance=2 * log_interval(job), last_step=job.iteration,
        lines_written=job.sink.count, seed=seed, style=style, flavour=job.flavour.name, ranks=ranks,
        hosts=list(c.hosts), families=sorted(realism.families),
        variant={"kind": kind, "ending": ending, "rollback_to": ckpt, "factor": round(div.factor, 2)},
    )


def _last_checkpoint(job: Job) -> int | None:
    """The iteration of the last checkpoint written so far (``training.write_step`` saves every
    ``ckpt_every`` log steps)."""
    saves = job.step // job.ckpt_every
    if saves == 0:
        return job.start_iteration or None
    return job.start_iteration + saves * job.ckpt_every * job.flavour.iters_per_step


def divergence_set(per_kind: int = 5, recovering: int = 8, seed: int = 0) -> list[GeneratedCase]:
    """``per_kind`` diverging jobs of each kind and ``recovering`` healthy jobs whose loss spikes and
    recovers (labelled healthy: a spike that recovers is a note, not a failure)."""
    from logdx.synth.healthy import FRAMEWORKS, LONG_STYLES, RANK_CHOICES, healthy_job

    rng = Random(f"logdx-divergence-set:{seed}")
    out: list[GeneratedCase] = []
    for kind in KINDS:
        flavours = FLAVOURS_OF[kind]
        for i in range(per_kind):
            flavour = flavours[i % len(flavours)]
            style = LONG_STYLES[(i + KINDS.index(kind)) % len(LONG_STYLES)]
            ranks = RANK_CHOICES[rng.randrange(len(RANK_CHOICES))]
            lines = max(rng.randrange(2000, 20001), startup_lines(ranks) + 60 * (ranks + 2))
            kw = {"seed": rng.randrange(1 << 30), "flavour": flavour, "style": style, "ranks": ranks, "lines": lines,
                  "kind": kind, "ending": ("cancel", "cut")[i % 2]}
            out.append(GeneratedCase(f"diverge-{kind}-{i}-{flavour}-{style}-{ranks}r", divergence_job, kw))
    for i in range(recovering):
        flavour = FRAMEWORKS[(i * 2) % len(FRAMEWORKS)]
        style = LONG_STYLES[(i * 3 + 1) % len(LONG_STYLES)]
        ranks = RANK_CHOICES[rng.randrange(len(RANK_CHOICES))]
        lines = max(rng.randrange(2000, 20001), startup_lines(ranks) + 60 * (ranks + 2))
        kw = {"seed": rng.randrange(1 << 30), "flavour": flavour, "style": style, "ranks": ranks, "lines": lines,
              "ending": ("exit0", "cut")[i % 2], "spike": True}
        out.append(GeneratedCase(f"spike-recovers-{i}-{flavour}-{style}-{ranks}r", healthy_job, kw))
    return out
