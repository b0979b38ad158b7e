"""The state of one synthetic job while its log is written, and line formats every part shares."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from random import Random
from typing import TYPE_CHECKING

from logdx.synth.clock import Clock
from logdx.synth.cluster import Cluster
from logdx.synth.sink import Burst, LineSink, Proc
from logdx.synth.styles import Style

if TYPE_CHECKING:
    from logdx.synth.flavours import Flavour
    from logdx.synth.noise import Realism

# One frame of a Python traceback: path, line number, function, source line ("" for none).
Frame = tuple[str, int, str, str]


@dataclass
class Job:
    rng: Random
    cluster: Cluster
    style: Style
    flavour: Flavour
    sink: LineSink
    clock: Clock
    noise: float
    slurm: bool  # runs under Slurm: srun/slurmstepd messages may appear
    new_torch: bool  # torch >= 2.4 stamps its C++ and elastic lines; 2.2 did not stamp C++ lines
    kernel_syslog: bool  # kernel lines as syslog ("May  1 ... host kernel: ...") or "host: [dmesg -T]"
    nccl_timeout_ms: int
    now: float  # wall-clock of the current log step
    run_name: str
    prefixes: list[str] = field(default_factory=list)  # per rank
    agent_prefixes: list[str] = field(default_factory=list)  # per host
    skew: list[float] = field(default_factory=list)  # per-rank clock offset, seconds
    nccl_tids: list[int] = field(default_factory=list)  # per rank: NCCL's main thread id
    step: int = 0  # log steps done
    start_iteration: int = 0  # resumed runs do not start at 0
    iteration: int = 0  # training iteration of the current step (kept, not computed: read on every line)
    ckpt_every: int = 100  # in log steps
    eval_every: int = 50
    nan: bool = False  # the loss has gone NaN
    # values of the current step, shared by every line that prints them
    loss: float = 10.0
    lr: float = 0.0
    grad_norm: float = 1.0
    step_ms: float = 1000.0
    # per-interval counters the frameworks print (Megatron: skipped / NaN iterations; the fp16 loss scale)
    skipped_iters: int = 0
    skipped_total: int = 0  # since the start (DeepSpeed's "skipped=N")
    nan_iters: int = 0
    loss_scale: float = 1.0
    # Whole-job generators (noise.py, divergence.py) reshape the step's values and add harmless output;
    # a plain job has neither, and writes exactly what it always wrote.
    step_hooks: list[Callable[[Job], None]] = field(default_factory=list)
    realism: Realism | None = None
    nccl_debug: bool = True  # NCCL_DEBUG=INFO: NCCL's INFO lines (which name every rank's host) are printed

    # -- time and numbers --------------------------------------------------------------------

    @property
    def seq(self) -> int:
        """NCCL collective sequence number now: a few collectives per iteration."""
        return 7 + self.iteration * self.flavour.collectives_per_iteration

    def rank_time(self, rank: int) -> float:
        return self.now + self.skew[rank]

    def begin_step(self) -> None:
        self.step += 1
        base_ms = self.flavour.step_ms
        self.step_ms = base_ms * (0.97 + 0.06 * self.rng.random())
        self.now += self.step_ms * self.flavour.iters_per_step / 1000.0
        it = self.iteration = self.start_iteration + self.step * self.flavour.iters_per_step
        total = self.flavour.train_iters
        self.lr = 3e-4 * min(1.0, it / 2000) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(it, total) / total)))
        if self.nan:
            self.loss = math.nan
            self.grad_norm = math.nan
        else:
            self.loss = 1.7 + 8.6 * math.exp(-it / 2500) + 0.08 * (self.rng.random() - 0.5)
            self.grad_norm = 0.25 + 0.6 * math.exp(-it / 4000) + 0.1 * self.rng.random()
        for hook in self.step_hooks:
            hook(self)

    # -- prefixes and line formats shared by launchers, cascades and scenarios -------------------

    def burst(self) -> Burst:
        return Burst(self.rng)

    def rank_proc(self, burst: Burst, rank: int, t: float) -> Proc:
        return burst.proc(rank, self.prefixes[rank], t)

    def agent_proc(self, burst: Burst, host_index: int, t: float) -> Proc:
        """The node's launcher (torchrun agent, DeepSpeed launch.py)."""
        return burst.proc(("agent", host_index), self.agent_prefixes[host_index], t)

    def kernel_proc(self, burst: Burst, host_index: int, t: float) -> Proc:
        """The node's kernel; its lines carry their own host (see ``kernel``)."""
        return burst.proc(("kernel", host_index), "", t)

    def c10(self, level: str, t: float, where: str) -> str:
        """Prefix of a torch C++ log line: ``[E501 12:00:03.123456789 ProcessGroupNCCL.cpp:1515] ``."""
        if self.new_torch:
            return f"[{level}{self.clock.c10(t)} {where}] "
        return f"[{level} {where}] "

    def elastic(self, level: str, t: float, module: str, line_no: int, message: str, host_index: int) -> str:
        """A torch.distributed.elastic (torchrun agent) log line in the torch era of the job."""
        if self.new_torch:
            pid = self.cluster.agent_pids[host_index]
            return f"{level[0]}{self.clock.glog(t)} {pid} torch/{module.replace('.', '/')}.py:{line_no}] {message}"
        return f"[{self.clock.py(t)}] torch.{module}: [{level}] {message}"

    def kernel(self, host_index: int, t: float, text: str) -> str:
        """A kernel message as collected from a node into the merged log (it always names the node)."""
        host = self.cluster.hosts[host_index]
        if self.kernel_syslog:
            return f"{self.clock.syslog(t)} {host} kernel: {text}"
        return f"{host}: [{self.clock.dmesg(t)}] {text}"

    def nccl_head(self, rank: int) -> str:
        """``node-03:12345:12345 [2]`` — host, pid, thread and CUDA device of an NCCL line."""
        c = self.cluster
        return f"{c.host(rank)}:{c.worker_pids[rank]}:{self.nccl_tids[rank]} [{c.local_rank(rank)}]"

    @property
    def lib(self) -> str:
        return self.flavour.lib

    @property
    def python(self) -> str:
        return self.flavour.python


def traceback_lines(frames: list[Frame], exception: str, *, carets: bool = False) -> list[str]:
    """A Python traceback as the interpreter prints it; ``carets`` adds 3.11's ``^^^^`` markers."""
    out = ["Traceback (most recent call last):"]
    for i, (path, line_no, function, code) in enumerate(frames):
        out.append(f'  File "{path}", line {line_no}, in {function}')
        if code:
            out.append(f"    {code}")
            # 3.11 underlines the failing expression, and only when it is not the whole line
            if carets and i == len(frames) - 1 and " = " in code:
                col = code.index(" = ") + 3
                out.append(" " * (4 + col) + "^" * (len(code) - col))
    out.extend(exception.split("\n"))
    return out
