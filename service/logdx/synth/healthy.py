"""Long healthy runs with scary but harmless output.

    from logdx.synth.healthy import healthy_job, healthy_set
    truth = healthy_job(out, seed=3, flavour="megatron", style="srun", ranks=64, lines=12000)

A healthy run here is a whole job: launchers, the c10d store retries while the rendezvous store comes
up, downloads retried, deprecation warnings, the framework's banner and config, NCCL init, thousands of
training steps with checkpoints and evaluations, recovered warnings (an IB port that flaps and comes
back, retried uploads, fp16 overflow skips), sometimes a loss spike that recovers, and then either the
end of training with the launchers' success lines (exit code 0), or the log cut while the job still
trains (exit code unknown: a log being tailed). Which harmless families a run carries is drawn from its
seed (``noise.Realism``); ``spike=True`` forces a recovering spike.

Label (``JobTruth``): status ``healthy``, category / failure type ``None``, action ``none``, no root line.
``healthy_set(n, seed)`` lists ``n`` varied runs (every framework, launcher style, 8 to 128 ranks,
2,000 to 20,000 lines), deterministic in ``seed``.
"""

from __future__ import annotations

from collections.abc import Iterator
from random import Random
from typing import Any, TextIO

from logdx.model import Action
from logdx.synth.job import Job
from logdx.synth.longjob import GeneratedCase, JobTruth, start_job, startup_lines, train_to
from logdx.synth.noise import Spike
from logdx.synth.teardown import write_teardown
from logdx.synth.training import finish_healthy

# Every framework the generator knows, and what they look like in a log: Megatron (iteration lines),
# DeepSpeed under the HF Trainer, the HF Trainer alone (tqdm + metrics dicts), Lightning (tqdm bars),
# a torchtitan-style FSDP loop, NeMo, and a hand-written ``step N`` loop.
FRAMEWORKS = ("megatron", "deepspeed", "hf", "lightning", "fsdp", "nemo", "plain")
LONG_STYLES = ("torchrun", "srun", "srun_torchrun", "pdsh", "pdsh_torchrun", "torchrun_tee", "mpirun")
RANK_CHOICES = (8, 16, 32, 64, 128)


def healthy_job(out: TextIO, *, seed: int, flavour: str, style: str, ranks: int, lines: int,
                ending: str = "exit0", spike: bool = False, gpus_per_host: int = 8,
                without: frozenset[str] = frozenset(), teardown: bool = False, exit_known: bool = True) -> JobTruth:
    """Write one healthy whole job to ``out``; ``ending`` is ``exit0`` (trains to its end, exit code 0)
    or ``cut`` (the log stops mid-training: exit code unknown). ``without`` leaves noise families out.
    ``teardown``: after its end, what a job prints while it comes down and the nodes' kernel lines past
    the end (``teardown.py``); ``exit_known=False``: the exit code is not given (only the log tells)."""
    if ending not in ("exit0", "cut"):
        raise ValueError("ending must be 'exit0' or 'cut'")
    job, realism = start_job(out, name="healthy-long", seed=seed, ranks=ranks, lines=lines, style=style,
                             flavour=flavour, gpus_per_host=gpus_per_host, nccl_debug=job_rng_bool(seed, 0.6),
                             exclude=without)
    if spike and realism.spike is None:
        steps = max(12, (lines - job.sink.count) // max(2, ranks if job.flavour.per_rank_lines else 2))
        realism.spike = Spike(start=job.step + steps // 3, height=job.rng.uniform(0.8, 1.6), tau=job.rng.uniform(1.0, 2.5))
        job.step_hooks.append(realism.spike.apply)
    tail = 3 * ranks + 2 * job.cluster.n_hosts + 40
    train_to(job, lines - tail if ending == "exit0" else lines)
    after: dict[str, object] = {}
    if ending == "exit0":
        finish_healthy(job)
        realism.at_finish(job)
        if teardown:
            after = write_teardown(job)
    job.sink.flush()
    return JobTruth(
        kind="spike" if realism.spike is not None else "healthy", status="healthy", category=None,
        failure_type=None, action=Action.NONE, exit_code=0 if ending == "exit0" and exit_known else None,
        last_step=job.iteration,
        lines_written=job.sink.count, seed=seed, style=style, flavour=job.flavour.name, ranks=ranks,
        hosts=list(job.cluster.hosts), families=sorted(realism.families | ({"spike"} if realism.spike else set())),
        variant={"ending": ending, "spike_step": _spike_iteration(job, realism.spike), **after},
    )


def _spike_iteration(job: Job, spike: Spike | None) -> int | None:
    if spike is None:
        return None
    return job.start_iteration + spike.start * job.flavour.iters_per_step


def job_rng_bool(seed: int, p: float) -> bool:
    """A choice made before the job exists (it changes what the job prints at start)."""
    return Random(f"logdx-longjob-choice:{seed}").random() < p


def _varied(n: int, rng: Random, *, stride: int, rank_choices: tuple[int, ...], max_lines: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """``n`` runs' arguments: every framework in turn, the launcher styles ``stride`` apart, ranks drawn from
    ``rank_choices``, 2,000 to ``max_lines`` lines (more when the start of a large job needs them)."""
    for i in range(n):
        flavour = FRAMEWORKS[i % len(FRAMEWORKS)]
        style = LONG_STYLES[(i * stride + i // len(FRAMEWORKS)) % len(LONG_STYLES)]
        if flavour == "deepspeed" and style.startswith("srun_"):
            style = "pdsh"
        ranks = rank_choices[rng.randrange(len(rank_choices))]
        lines = max(rng.randrange(2000, max_lines + 1), startup_lines(ranks) + 30 * (ranks + 2))
        yield i, {"seed": rng.randrange(1 << 30), "flavour": flavour, "style": style, "ranks": ranks, "lines": lines}


def healthy_set(n: int = 32, seed: int = 0) -> list[GeneratedCase]:
    """``n`` healthy whole jobs: every framework and launcher style, 8-128 ranks, 2,000-20,000 lines (<= 20,000
    for 128 ranks); one in five cut mid-training, one in four with a recovering loss spike."""
    runs = _varied(n, Random(f"logdx-healthy-set:{seed}"), stride=3, rank_choices=RANK_CHOICES, max_lines=20000)
    return [GeneratedCase(f"healthy-{i:02d}-{kw['flavour']}-{kw['style']}-{kw['ranks']}r", healthy_job,
                          {**kw, "ending": "cut" if i % 5 == 4 else "exit0", "spike": i % 4 == 1}) for i, kw in runs]


def teardown_set(n: int = 24, seed: int = 0) -> list[GeneratedCase]:
    """``n`` healthy whole jobs that end well and then print their teardown and the nodes' kernel lines past
    their end (``teardown.py``): every framework and launcher style, 8-64 ranks, 2,000-12,000 lines; one in
    three with the exit code known (0), the others only the log."""
    runs = _varied(n, Random(f"logdx-teardown-set:{seed}"), stride=2, rank_choices=(8, 16, 32, 64), max_lines=12000)
    return [GeneratedCase(f"teardown-{i:02d}-{kw['flavour']}-{kw['style']}-{kw['ranks']}r", healthy_job,
                          {**kw, "teardown": True, "exit_known": i % 3 == 0}) for i, kw in runs]
