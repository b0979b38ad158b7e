"""The state of one synthetic job while its log is written, and line formats every part shares."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from random import Random
from typing import Protocol

from logdx.synth.clock import Clock
from logdx.synth.cluster import Cluster
from logdx.synth.sink import Burst, LineSink, Proc
from logdx.synth.styles import Style

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
    realism: JobNoise | None = None
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


class JobNoise(Protocol):
    """What a job asks of its harmless noise (`noise.Realism`, whose module imports this one)."""

    @property
    def families(self) -> frozenset[str]: ...

    @property
    def ib_flap_step(self) -> int: ...  # the step an IB port flaps at (-1: none)

    @property
    def ib_flap_host(self) -> int: ...

    def after_step(self, job: Job) -> None: ...

    def at_finish(self, job: Job) -> None: ...


# -- the framework a job's lines look like: the base of `flavours` (a job and its flavour read each other) --

USER_ROOT = "/workspace/project"  # the user's own code, for script errors


class Flavour:
    """The defaults are a plain torchrun loop; subclasses override what their framework prints."""

    name = "plain"
    entry = f"{USER_ROOT}/train.py"
    lib = "/usr/local/lib/python3.11/site-packages"
    python = "/usr/local/bin/python3.11"
    carets = True  # Python >= 3.11 prints ^^^^ under the failing expression
    iters_per_step = 1  # iterations between two progress lines
    collectives_per_iteration = 3
    per_rank_lines = True  # every rank prints a line per step (else only ``log_rank``'s summary)
    names_hosts = True  # its banner says on which host each rank runs ("rank 5/16 ... on node-03")
    fp16 = False  # dynamic loss scaling (overflow skips); whole-job generators switch it on

    def __init__(self, rng: Random, cluster: Cluster) -> None:
        self.rng = rng
        self.cluster = cluster
        self.step_ms = rng.uniform(300.0, 6000.0)
        self.train_iters = rng.choice((100_000, 250_000, 500_000, 1_000_000))
        self.tokens_per_rank = rng.choice((8192, 16384, 32768))
        self.mem_base = [rng.uniform(30.0, 60.0) for _ in range(cluster.world_size)]

    # -- who logs ----------------------------------------------------------------------------

    def log_rank(self) -> int:
        return 0

    # -- hot path ----------------------------------------------------------------------------

    def rank_line(self, job: Job, rank: int, t: float) -> str:
        loss = job.loss + 0.02 * (self.rng.random() - 0.5)
        tps = self.tokens_per_rank * 1000.0 / job.step_ms * (0.97 + 0.06 * self.rng.random())
        return (
            f"{job.clock.py(t)} - INFO - train.py:212 - step {job.iteration} | loss {loss:.4f} | "
            f"lr {job.lr:.3e} | grad_norm {job.grad_norm:.3f} | tokens/s {tps:.0f} | "
            f"elapsed_ms {job.step_ms:.1f}"
        )

    def summary(self, job: Job, t: float) -> list[str]:
        return [
            f"{job.clock.py(t)} - INFO - train.py:230 - [step {job.iteration}] global loss {job.loss:.4f} "
            f"over {self.cluster.world_size} ranks | nan/inf grads: {self.cluster.world_size if job.nan else 0} | "
            "skipped steps: 0"
        ]

    # -- start-up ----------------------------------------------------------------------------

    def banner(self, job: Job, burst: Burst) -> None:
        for rank in range(self.cluster.world_size):
            p = self.proc(job, burst, rank, 0.5)
            c = self.cluster
            p.say(f"{job.clock.py(p.t)} - INFO - train.py:88 - rank {rank}/{c.world_size} local_rank "
                  f"{c.local_rank(rank)} on {c.host(rank)} (cuda:{c.local_rank(rank)})", 0.01)
            p.say(f"{job.clock.py(p.t)} - INFO - train.py:97 - grad clipping: max_norm=1.0, norm_type=2.0, "
                  "error_if_nonfinite=False, foreach=True", 0.01)
        p = self.proc(job, burst, 0, 1.0)
        p.say(f"{job.clock.py(p.t)} - INFO - train.py:104 - config: {{'model': 'gpt-1.3b', 'seq_len': 4096, "
              f"'micro_batch': 4, 'lr': 0.0003, 'warmup': 2000, 'max_steps': {self.train_iters}, "
              "'max_retries': 3, 'fail_fast': False, 'ckpt_dir': '/ckpt'}")
        p.say(f"{job.clock.py(p.t)} - INFO - train.py:131 - model has 1,315,575,808 parameters; "
              "0 missing keys, 0 unexpected keys")

    # -- periodic ----------------------------------------------------------------------------

    def checkpoint(self, job: Job, burst: Burst, complete: bool = True) -> None:
        p = self.proc(job, burst, 0, 0.2)
        path = f"/ckpt/{job.run_name}/step_{job.iteration:07d}.pt"
        p.say(f"{job.clock.py(p.t)} - INFO - checkpoint.py:41 - saving checkpoint to {path}")
        if complete:
            secs = self.rng.uniform(5, 40)
            p.say(f"{job.clock.py(p.t)} - INFO - checkpoint.py:58 - checkpoint saved in {secs:.1f}s (5.3 GB)", secs)

    def evaluate(self, job: Job, burst: Burst) -> None:
        p = self.proc(job, burst, 0, 0.3)
        v = job.loss - 0.05
        p.say(f"{job.clock.py(p.t)} - INFO - train.py:281 - eval step {job.iteration}: val_loss {v:.4f} "
              f"ppl {math.exp(min(v, 50)):.2f} (0 errors)", 20.0)

    def finish(self, job: Job, burst: Burst) -> None:
        for rank in range(self.cluster.world_size):
            p = self.proc(job, burst, rank, 0.5)
            p.say(f"{job.clock.py(p.t)} - INFO - train.py:300 - training finished after {job.iteration} "
                  f"steps; final loss {job.loss:.4f}")

    # -- failures the framework itself reports ------------------------------------------------

    def nan_lines(self, job: Job, burst: Burst) -> None:
        """Extra lines a framework prints on a NaN step (DeepSpeed's OVERFLOW! messages...)."""

    def nan_exception(self, job: Job, rank: int) -> tuple[list[Frame], str]:
        return self.loop_frames() + self.clip_frames(), (
            "RuntimeError: The total norm of order 2.0 for gradients from `parameters` is non-finite, so it "
            "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, "
            "set `error_if_nonfinite=False`"
        )

    # -- code paths, for tracebacks -----------------------------------------------------------

    def loop_frames(self) -> list[Frame]:
        """From the entry script down to the training step."""
        return [
            (self.entry, 412, "<module>", "main()"),
            (f"{self.lib}/torch/distributed/elastic/multiprocessing/errors/__init__.py", 355, "wrapper",
             "return f(*args, **kwargs)"),
            (self.entry, 398, "main", "train(cfg, model, optimizer, loader)"),
            (self.entry, 214, "train", "loss = train_step(model, batch, optimizer, scaler)"),
        ]

    def forward_frames(self) -> list[Frame]:
        """From the training step into the model's forward pass."""
        return [
            (self.entry, 171, "train_step", "logits = model(batch['input_ids'], attention_mask=batch['attention_mask'])"),
            *self.module_call_frames(),
            (f"{self.lib}/torch/nn/parallel/distributed.py", 1643, "forward", "else self._run_ddp_forward(*inputs, **kwargs)"),
            (f"{self.lib}/torch/nn/parallel/distributed.py", 1459, "_run_ddp_forward", "return self.module(*inputs, **kwargs)  # type: ignore[index]"),
            *self.module_call_frames(),
            (f"{USER_ROOT}/project/models/gpt.py", 188, "forward", "x = block(x, mask)"),
            *self.module_call_frames(),
            (f"{USER_ROOT}/project/models/gpt.py", 97, "forward", "att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))"),
        ]

    def data_frames(self) -> list[Frame]:
        return [
            (self.entry, 209, "train", "batch = next(data_iter)"),
            (f"{self.lib}/torch/utils/data/dataloader.py", 701, "__next__", "data = self._next_data()"),
        ]

    def save_frames(self) -> list[Frame]:
        return [
            (self.entry, 240, "train", "save_checkpoint(cfg.ckpt_dir, step, model, optimizer)"),
            (f"{USER_ROOT}/project/checkpoint.py", 47, "save_checkpoint", "torch.save(state, path)"),
        ]

    def clip_frames(self) -> list[Frame]:
        return [
            (self.entry, 178, "train_step", "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)"),
            (f"{self.lib}/torch/nn/utils/clip_grad.py", 30, "_no_grad_wrapper", "return func(*args, **kwargs)"),
            (f"{self.lib}/torch/nn/utils/clip_grad.py", 91, "clip_grad_norm_", "raise RuntimeError("),
        ]

    def module_call_frames(self) -> list[Frame]:
        return [
            (f"{self.lib}/torch/nn/modules/module.py", 1736, "_wrapped_call_impl", "return self._call_impl(*args, **kwargs)"),
            (f"{self.lib}/torch/nn/modules/module.py", 1747, "_call_impl", "return forward_call(*args, **kwargs)"),
        ]

    def save_stack(self) -> list[Frame]:
        """From the entry script down to the ``torch.save`` of a checkpoint."""
        return self.loop_frames()[:3] + self.save_frames()

    def user_call_frames(self, call: str) -> list[Frame]:
        """Down to the user's own code calling one of its helpers (``call`` is that line)."""
        return self.loop_frames()[:3] + [(self.entry, 251, "train", call)]

    def library_attribute_error(self) -> tuple[list[Frame], str]:
        """An AttributeError raised by library code itself (not a ``__getattr__`` pass-through)."""
        lib = self.lib
        frames = self.loop_frames() + [
            self.backward_call,
            (f"{lib}/torch/_tensor.py", 581, "backward", "torch.autograd.backward("),
            (f"{lib}/torch/autograd/__init__.py", 347, "backward", "_engine_run_backward("),
            (f"{lib}/torch/autograd/graph.py", 825, "_engine_run_backward",
             "return Variable._execution_engine.run_backward(  # Calls into the C++ engine to run the backward pass"),
            (f"{lib}/torch/distributed/fsdp/_runtime_utils.py", 715, "_post_backward_hook", "if flat_param.grad.requires_grad:"),
        ]
        return frames, "AttributeError: 'NoneType' object has no attribute 'requires_grad'"

    @property
    def backward_call(self) -> Frame:
        return (self.entry, 175, "train_step", "loss.backward()")

    # -- helpers -----------------------------------------------------------------------------

    def proc(self, job: Job, burst: Burst, rank: int, after: float) -> Proc:
        return job.rank_proc(burst, rank, job.rank_time(rank) + after * (0.5 + self.rng.random()))
