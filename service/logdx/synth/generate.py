"""``generate``: put a job together, write its log, return the ground truth."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from random import Random
from typing import TextIO

from logdx.synth.clock import Clock
from logdx.synth.cluster import make_cluster
from logdx.synth.flavours import AUTO_FLAVOURS, FLAVOURS
from logdx.synth.job import Job
from logdx.synth.scenarios import REGISTRY, Scenario
from logdx.synth.sink import LineSink
from logdx.synth.styles import STYLES
from logdx.synth.training import framework_startup, launcher_startup, nccl_init, train_until

# scenario name -> one-line description
SCENARIOS: dict[str, str] = {name: s.description for name, s in REGISTRY.items()}

_EPOCH_2024 = 1704067200  # 2024-01-01T00:00:00Z


@dataclass(slots=True)
class Truth:
    """What a correct diagnosis of the generated log says."""

    scenario: str
    status: str  # "failed" | "healthy"
    category: str | None  # logdx.model.Category value; None when healthy
    failure_type: str | None  # a canonical failure type; None when healthy
    action: str  # logdx.model.Action value
    culprit_hosts: list[str] = field(default_factory=list)
    culprit_ranks: list[int] = field(default_factory=list)
    culprit_gpus: list[str] = field(default_factory=list)
    root_line_no: int | None = None  # 1-based line number in the written log
    root_line: str | None = None  # that line, exactly as written
    # how the log was made
    lines_written: int = 0
    seed: int = 0
    style: str = ""
    flavour: str = ""
    ranks: int = 0
    hosts: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def generate(
    out: TextIO,
    *,
    scenario: str,
    seed: int = 0,
    ranks: int = 64,
    gpus_per_host: int = 8,
    lines: int = 20000,
    style: str = "torchrun",
    fail_at: float = 0.8,
    noise: float = 1.0,
    flavour: str = "auto",
    start: float | None = None,
) -> Truth:
    """Write one job's log to ``out`` (streamed, bounded memory) and return its ground truth. ``start``: when
    the job starts (epoch seconds); by default a moment of 2024-2025 drawn from the seed."""
    spec = _check(scenario, style, flavour, ranks, gpus_per_host, fail_at, noise)
    job = make_job(out, name=spec.name, seed=seed, ranks=ranks, gpus_per_host=gpus_per_host, lines=lines,
                   style=style, noise=noise, flavour=flavour, start=start)
    launcher_startup(job)
    if not spec.at_startup:
        framework_startup(job)
        nccl_init(job)
        stop = lines - _healthy_tail(job) if spec.category is None else int(fail_at * lines)
        train_until(job, stop)
    culprits = spec.write(job)
    job.sink.flush()
    return Truth(
        scenario=spec.name,
        status="healthy" if spec.category is None else "failed",
        category=spec.category.value if spec.category else None,
        failure_type=spec.failure_type,
        action=spec.action.value,
        culprit_hosts=culprits.hosts,
        culprit_ranks=culprits.ranks,
        culprit_gpus=culprits.gpus,
        root_line_no=job.sink.root_no,
        root_line=job.sink.root_line,
        lines_written=job.sink.count,
        seed=seed,
        style=style,
        flavour=job.flavour.name,
        ranks=ranks,
        hosts=list(job.cluster.hosts),
    )


def _check(scenario: str, style: str, flavour: str, ranks: int, gpus_per_host: int, fail_at: float,
           noise: float) -> Scenario:
    if scenario not in REGISTRY:
        raise ValueError(f"unknown scenario {scenario!r}; choose from {', '.join(REGISTRY)}")
    check_job_shape(style, flavour, ranks, gpus_per_host)
    hosts = -(-ranks // gpus_per_host)
    if hosts < REGISTRY[scenario].min_hosts:
        raise ValueError(f"{scenario} needs at least {REGISTRY[scenario].min_hosts} hosts; "
                         f"{ranks} ranks with {gpus_per_host} GPUs per host make {hosts}")
    if not 0.0 < fail_at <= 1.0:
        raise ValueError("fail_at must be in (0, 1]")
    if noise < 0:
        raise ValueError("noise must be >= 0")
    return REGISTRY[scenario]


def check_job_shape(style: str, flavour: str, ranks: int, gpus_per_host: int) -> None:
    """The arguments every generated job shares (a scenario's or a burial's); ValueError names the bad one."""
    if style not in STYLES:
        raise ValueError(f"unknown style {style!r}; choose from {', '.join(STYLES)}")
    if flavour != "auto" and flavour not in FLAVOURS:
        raise ValueError(f"unknown flavour {flavour!r}; choose from auto, {', '.join(FLAVOURS)}")
    if ranks < 2:
        raise ValueError("a multi-rank job needs ranks >= 2")
    if gpus_per_host < 1:
        raise ValueError("gpus_per_host must be >= 1")


def _start(rng: Random, start: float | None) -> float:
    drawn = _EPOCH_2024 + rng.randrange(0, 540 * 86400) + rng.random()  # drawn either way: the seed's other choices stay
    return drawn if start is None else start + (drawn % 1.0)


def make_job(out: TextIO, *, name: str, seed: int, ranks: int, gpus_per_host: int, lines: int, style: str,
             noise: float, flavour: str, start: float | None = None) -> Job:
    """A job ready to write its start-up (``generate`` uses it; so does ``bury.bury``).

    Seeded by ``seed`` and ``name`` (the scenario) only, so that changing the style or size keeps
    the other choices. ``style`` and ``flavour`` are names (``flavour`` may be ``"auto"``).
    """
    style_name, flavour_name = style, flavour
    rng = Random(f"logdx-synth:{seed}:{name}")
    cluster = make_cluster(rng, ranks, gpus_per_host)
    job_style = STYLES[style_name]
    if flavour_name == "auto":
        flavour_name = "deepspeed" if job_style.launcher == "deepspeed" else rng.choice(AUTO_FLAVOURS)
    job_flavour = FLAVOURS[flavour_name](rng, cluster)
    slurm = job_style.name.startswith("srun") or (job_style.launcher == "torchrun"
                                                  and not job_style.name.startswith("pdsh") and rng.random() < 0.5)
    if name == "node_lost" and not job_style.name.startswith("pdsh"):
        slurm = True  # a lost node is reported by Slurm (pdsh jobs see ssh die instead)
    est_steps = max(10, lines // ((ranks + 2) if job_flavour.per_rank_lines else 2))
    ckpt_every = max(4, est_steps // rng.randint(4, 10))
    job = Job(
        rng=rng,
        cluster=cluster,
        style=job_style,
        flavour=job_flavour,
        sink=LineSink(out),
        clock=Clock(),
        noise=noise,
        slurm=slurm,
        new_torch=rng.random() < 0.6,
        kernel_syslog=rng.random() < 0.5,
        nccl_timeout_ms=rng.choice((600_000, 600_000, 1_800_000, 300_000, 120_000)),
        now=_start(rng, start),
        run_name=f"{rng.choice(('gpt', 'llama3', 'moe', 'mixtral', 'olmo'))}-{rng.choice(('1b', '8b', '13b', '70b'))}"
                 f"-run{rng.randrange(1, 60):02d}",
        ckpt_every=ckpt_every,
        eval_every=max(2, ckpt_every // 2),
        start_iteration=rng.choice((0, 0, rng.randrange(1, 200) * 1000)),
    )
    job.iteration = job.start_iteration
    job.prefixes = job_style.rank_prefixes(cluster)
    job.agent_prefixes = job_style.agent_prefixes(cluster)
    job.skew = [rng.uniform(-0.05, 0.05) for _ in range(ranks)]
    job.nccl_tids = list(cluster.worker_pids)  # NCCL's main thread is the process's main thread
    return job


def _healthy_tail(job: Job) -> int:
    """About how many lines a successful end writes, so that a healthy log lands near ``lines``."""
    return 3 * job.cluster.world_size + 2 * job.cluster.n_hosts + 10
