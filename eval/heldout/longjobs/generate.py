#!/usr/bin/env python3
"""Held-out long multi-rank training jobs for logdx, written from real message strings.

    python eval/heldout/longjobs/generate.py OUT_DIR [--seed N]

writes OUT_DIR/NNN.log (2,000-10,000 lines, 8-128 ranks) and OUT_DIR/labels.jsonl. Standalone on purpose
(no logdx import): it is an outside tester's benchmark. Deterministic from the seed.

Every job is a whole run: launcher start-up noise (c10d store connect retries, NCCL INFO banners, framework
warnings), normal training output of one framework with checkpoints and evaluations, recovered warnings, then
either a clean end (healthy runs with scary output) or one fault on one rank/host and its cascade on the others
(watchdog timeouts, SIGABRT/SIGTERM, elastic ChildFailedError summaries, srun/slurmstepd lines).

Message families and where their text was taken from (public logs and issue threads):

  launcher prefixes
    [rankN]:            https://github.com/hiyouga/LlamaFactory/issues/7396 (torchrun, PyTorch >= 2.2)
    [defaultN]:         https://github.com/bigscience-workshop/bigscience/blob/master/train/tr11-176B-ml/chronicles.md
    srun -l "N: "       https://github.com/stas00/ml-engineering/blob/master/debug/pytorch.md (srun -l / --label)
    pdsh "host: "       https://github.com/stas00/ml-engineering/blob/master/debug/pytorch.md (ds_ssh / pdsh)
  start-up noise
    c10d client socket  https://github.com/ofsoundof/GRL-Image-Restoration/issues/27 ,
                        https://github.com/gensyn-ai/rl-swarm/issues/197 (glog "[W427 01:04:16.149509694 socket.cpp:752]")
    OMP_NUM_THREADS     https://github.com/bigscience-workshop/bigscience/tree/master/experiments/gpt2-hf-ds (whole logs)
    NCCL INFO banners   https://github.com/bigscience-workshop/bigscience/tree/master/experiments/gpt2-meg (whole logs),
                        https://github.com/NVIDIA/nccl/issues/1609
    NCCL connect retry  "NCCL INFO Call to connect returned Connection refused, retrying" (NCCL socket retry, recovered);
                        the fatal WARN form is in https://github.com/bigscience-workshop/bigscience/blob/master/jz/slurm/README.md
    compiler warning    https://github.com/bigscience-workshop/bigscience/tree/master/experiments/gpt2-meg (WRONG_COMPILER_WARNING)
    TypedStorage        https://github.com/pytorch/pytorch/issues/97207 (UserWarning: TypedStorage is deprecated)
  training output
    Megatron iteration  https://github.com/bigscience-workshop/bigscience/blob/master/train/tr11-176B-ml/chronicles.md ,
                        train/tr1-13B-base/chronicles.md (checkpoint save lines, validation block, exit-duration line)
    DeepSpeed           https://github.com/bigscience-workshop/bigscience/tree/master/experiments/gpt2-meg-ds-3d-old
                        ("steps: N loss: ..."), train/tr8b-104B/chronicles.md ("[deepscale] OVERFLOW! ...")
    HF Trainer dicts    https://github.com/pytorch/ao/issues/3356 , experiments/gpt2-hf-ds (train metrics block)
    Lightning/NeMo bar  https://github.com/pytorch/pytorch/issues/118369
    torchtitan          https://github.com/pytorch/torchtitan/pull/3393 , https://github.com/pytorch/torchtitan/pull/2389
    plain "iter N step" https://github.com/Lightning-AI/litgpt/issues/291
    per-rank heartbeat  https://github.com/huggingface/m4-logs (tr_141-hanging: "PID n:  After clip in _do_batch")
  faults and cascades
    watchdog timeout    https://github.com/hiyouga/LlamaFactory/issues/6269 , /7396 , https://github.com/ai2cm/ace/issues/348 ,
                        https://github.com/mila-iqia/milabench/pull/269 ("Timeout at NCCL work: ...")
    elastic summary     https://github.com/rwth-i6/returnn/issues/1454 (ChildFailedError, Root Cause block)
    srun / slurmstepd   https://github.com/huggingface/m4-logs (Node failure, STEP CANCELLED), experiments/gpt2-meg (TIME LIMIT,
                        "Killing subprocess", "Main process received SIGTERM, exiting")
    Xid kernel lines    https://github.com/NVIDIA/NVSentinel/issues/155 (79), https://github.com/akash-network/support/issues/244
                        (dmesg -T Xid 94/43/31), https://github.com/leptonai/gpud/pull/1174 (94, NVLink),
                        https://docs.nvidia.com/deploy/xid-errors/index.html (48 DBE, 74 NVLink)
    CUDA errors         train/tr11-176B-ml/chronicles.md (c10::CUDAError unknown error), train/tr1-13B-base/chronicles.md (ECC)
    NCCL / IB           https://github.com/NVIDIA/nccl/issues/1405 (NET/IB completion status=12),
                        jz/slurm/README.md (unhandled system error)
    Lustre / NFS        https://github.com/pytorch/pytorch/issues/42107 (files vanishing under a run),
                        Lustre client eviction text as printed by the kernel (LustreError: 167-0 ... evicted)
    disk full           https://github.com/NVIDIA/Megatron-LM/issues/878 , https://github.com/databrickslabs/dolly/issues/139
    CUDA OOM            https://github.com/NVIDIA/nccl/issues/1284 (torch.cuda.OutOfMemoryError)
    host OOM            kernel "Out of memory: Killed process" + elastic "Signal 9 (SIGKILL)"
    DataLoader killed   https://github.com/open-mmlab/mmsegmentation/issues/1356 , https://github.com/pytorch/pytorch/issues/108861
    NaN / divergence    train/tr8-104B-wide/chronicles.md (loss spike that never recovers, missing lm loss field),
                        https://github.com/epfLLM/Megatron-LLM/issues/33
    checkpoint load     PytorchStreamReader "failed finding central directory" (truncated checkpoint)
    version mismatch    flash-attn "undefined symbol" ImportError
    CUDA error 804      https://github.com/DeepVAC/TorchPod/issues/43 , https://github.com/NVIDIA/nvidia-docker/issues/1479
    config assertion    Megatron "global batch size (...) is not divisible by micro batch size (...) times data parallel size"
                        ; train/tr8b-104B/chronicles.md (AnnealingLR assertion)
    stack dumps         train/tr11-176B-ml/chronicles.md (py-spy groups), faulthandler "Timeout (0:30:00)!" dumps
    fr_trace            https://github.com/pytorch/tutorials/blob/main/prototype_source/flight_recorder_tutorial.rst
    PG not destroyed    PyTorch >= 2.4 exit warning "process group has NOT been destroyed before we destruct ProcessGroupNCCL"
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

PY = "/usr/local/lib/python3.10/dist-packages"
TORCH = f"{PY}/torch"


# ----------------------------------------------------------------------------------------------------------------
# the job: cluster, launcher prefix, clock, lines
# ----------------------------------------------------------------------------------------------------------------

@dataclass
class Cluster:
    hosts: list[str]
    gpn: int

    @property
    def ranks(self) -> int:
        return len(self.hosts) * self.gpn

    def host(self, rank: int) -> str:
        return self.hosts[rank // self.gpn]

    def local(self, rank: int) -> int:
        return rank % self.gpn

    def ranks_of(self, host: str) -> list[int]:
        i = self.hosts.index(host)
        return list(range(i * self.gpn, (i + 1) * self.gpn))


HOST_STYLES: list[Callable[[random.Random, int], str]] = [
    lambda r, i: f"dgx-{i + r.randint(1, 40):03d}",
    lambda r, i: f"gpu-st-p4d-24xlarge-{i + r.randint(1, 60)}",
    lambda r, i: f"ip-10-{r.randint(0, 3)}-{r.randint(10, 250)}-{i + 10}",
    lambda r, i: f"node{i + r.randint(100, 400):04d}",
    lambda r, i: f"hgx-h100-{i + r.randint(1, 90):02d}",
]


def make_cluster(rng: random.Random, ranks: int) -> Cluster:
    gpn = 8 if ranks >= 16 else 4
    nodes = ranks // gpn
    style = rng.choice(HOST_STYLES)
    hosts: list[str] = []
    while len(hosts) < nodes:
        h = style(rng, len(hosts) * 3)
        if h not in hosts:
            hosts.append(h)
    return Cluster(hosts, gpn)


@dataclass
class Job:
    jid: str
    rng: random.Random
    cluster: Cluster
    launcher: str          # rank | default | srun | pdsh
    framework: str         # megatron | deepspeed | hf | lightning | titan | plain
    t: datetime
    lines: list[str] = field(default_factory=list)
    slurm_id: int = 0
    torch_new: bool = True

    def __post_init__(self) -> None:
        self.pids = {r: 40000 + self.rng.randint(0, 20000) + r for r in range(self.cluster.ranks)}
        self.agent_pid = {h: 1000 + self.rng.randint(0, 9000) for h in self.cluster.hosts}
        self.ips = {h: f"10.{self.rng.randint(0, 7)}.{self.rng.randint(0, 255)}.{self.rng.randint(2, 250)}" for h in self.cluster.hosts}
        self.slurm_id = self.rng.randint(100000, 9999999)

    # -- prefixes and emission --------------------------------------------------------------------------------
    def pfx(self, rank: int) -> str:
        if self.launcher == "rank":
            return f"[rank{rank}]:"
        if self.launcher == "default":
            return f"[default{self.cluster.local(rank)}]:"
        if self.launcher == "srun":
            return f"{rank}: "
        return f"{self.cluster.host(rank)}: "

    def hpfx(self, host: str) -> str:
        """Prefix of a line printed by a node-level process (agent, launcher) of `host`.

        torchrun agents write unprefixed into the merged log; with srun -l the node-level line carries the task id of
        the host's first rank (one task per GPU); pdsh prefixes the host."""
        if self.launcher == "srun":
            return f"{self.cluster.ranks_of(host)[0]}: "
        if self.launcher == "pdsh":
            return f"{host}: "
        return ""

    def out(self, rank: int, text: str) -> int:
        self.lines.append(self.pfx(rank) + text)
        return len(self.lines)

    def raw(self, text: str) -> int:
        self.lines.append(text)
        return len(self.lines)

    def node(self, host: str, text: str) -> int:
        self.lines.append(self.hpfx(host) + text)
        return len(self.lines)

    def tick(self, seconds: float) -> None:
        self.t += timedelta(seconds=seconds)

    # -- clock formats ----------------------------------------------------------------------------------------
    def glog(self, level: str, where: str) -> str:
        ns = self.rng.randint(0, 999_999_999)
        return f"[{level}{self.t:%m%d} {self.t:%H:%M:%S}.{ns:09d} {where}]"

    def glog_old(self, level: str, where: str) -> str:
        return f"[{level} {where}]"

    def pylog(self) -> str:
        return f"{self.t:%Y-%m-%d %H:%M:%S},{self.rng.randint(0, 999):03d}"

    def elastic(self, level: str, host: str, where: str) -> str:
        if self.torch_new:
            us = self.rng.randint(0, 999999)
            return f"{level}{self.t:%m%d} {self.t:%H:%M:%S}.{us:06d} {self.agent_pid[host]} {where}]"
        name = {"W": "WARNING", "E": "ERROR", "I": "INFO"}[level]
        return f"{name}:{where.split(':')[0].replace('/', '.').removesuffix('.py')}:"

    def syslog(self, host: str, text: str) -> int:
        if not hasattr(self, "_boot"):
            self._boot = {h: self.t - timedelta(seconds=self.rng.randint(100000, 900000)) for h in self.cluster.hosts}
        uptime = (self.t - self._boot[host]).total_seconds() + self.rng.random() / 10
        return self.raw(f"{self.t:%b} {self.t.day:2d} {self.t:%H:%M:%S} {host} kernel: [{uptime:.6f}] {text}")


# ----------------------------------------------------------------------------------------------------------------
# loss curves
# ----------------------------------------------------------------------------------------------------------------

@dataclass
class Curve:
    start: float
    floor: float
    tau: float
    noise: float
    spike_at: int | None = None        # recovered spike (healthy) at this step
    diverge_at: int | None = None      # spike that never recovers; NaN later
    nan_at: int | None = None

    def loss(self, rng: random.Random, step: int) -> float:
        base = self.floor + (self.start - self.floor) * math.exp(-step / self.tau)
        val = base + rng.gauss(0, self.noise)
        if self.spike_at is not None and step >= self.spike_at:
            d = step - self.spike_at
            val += base * 1.6 * math.exp(-d / max(3.0, self.tau / 60))
        if self.diverge_at is not None and step >= self.diverge_at:
            d = step - self.diverge_at
            val = base * (2.3 + 0.4 * math.sin(d / 7.0)) + abs(rng.gauss(0, self.noise * 3))
        return max(val, 0.01)

    def is_nan(self, step: int) -> bool:
        return self.nan_at is not None and step >= self.nan_at


# ----------------------------------------------------------------------------------------------------------------
# start-up noise
# ----------------------------------------------------------------------------------------------------------------

def preamble(job: Job, extra_warnings: bool = True) -> None:
    rng, c = job.rng, job.cluster
    master = c.hosts[0]
    if job.launcher in ("rank", "default"):
        for h in c.hosts:
            if rng.random() < 0.6:
                job.node(h, "*****************************************")
                job.node(h, "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid "
                            "your system being overloaded, please further tune the variable for optimal performance in "
                            "your application as needed. ")
                job.node(h, "*****************************************")
    elif job.launcher == "pdsh":
        job.raw(f"[{job.pylog()}] [INFO] [runner.py:555:main] cmd = pdsh -S -f 1024 -w {','.join(c.hosts[:3])}... "
                f"export NCCL_DEBUG=INFO; cd /workspace; /usr/bin/python -u -m deepspeed.launcher.launch")
        for h in c.hosts:
            job.node(h, f"[{job.pylog()}] [INFO] [launch.py:145:main] WORLD INFO DICT: {{'{c.hosts[0]}': "
                        f"{list(range(c.gpn))}, ...}}")
            job.node(h, f"[{job.pylog()}] [INFO] [launch.py:151:main] nnodes={len(c.hosts)}, num_local_procs={c.gpn}, "
                        f"node_rank={c.hosts.index(h)}")
    # the agents of the other nodes retry the rendezvous store until the master's agent is up: harmless
    retriers = [h for h in c.hosts[1:] if rng.random() < 0.8] or c.hosts[1:2]
    for _ in range(rng.randint(2, 6)):
        for h in retriers:
            job.tick(rng.uniform(0.05, 0.6))
            where = "socket.cpp:752" if job.torch_new else "socket.cpp:558"
            stamp = job.glog("W", where) if job.torch_new else job.glog_old("W", where)
            target = rng.choice([f"[{master}]:29500", f"{master}:29500", f"[{job.ips[master]}]:29500"])
            job.node(h, f"{stamp} [c10d] The client socket has failed to connect to {target} (errno: 111 - Connection refused).")
    job.tick(rng.uniform(5, 30))
    # per-rank Python warnings printed at import
    if extra_warnings:
        for r in range(c.ranks):
            if rng.random() < 0.5:
                job.out(r, f"{TORCH}/_utils.py:831: UserWarning: TypedStorage is deprecated. It will be removed in the "
                           "future and UntypedStorage will be the only storage class. This should only matter to you if "
                           "you are using storages directly.  To access UntypedStorage directly, use tensor.untyped_storage() "
                           "instead of tensor.storage()")
                job.out(r, "  return self.fget.__get__(instance, owner)()")


def nccl_init(job: Job) -> None:
    rng, c = job.rng, job.cluster
    version = rng.choice(["2.18.5+cuda12.2", "2.19.3+cuda12.3", "2.20.5+cuda12.4", "2.21.5+cuda12.4"])
    tid = {r: job.pids[r] + rng.randint(100, 300) for r in range(c.ranks)}

    def n(r: int, msg: str, tid_: int | None = None) -> None:
        h = c.host(r)
        job.out(r, f"{h}:{job.pids[r]}:{tid_ or job.pids[r]} [{c.local(r)}] NCCL INFO {msg}")

    n(0, f"Bootstrap : Using ib0:{job.ips[c.host(0)]}<0>")
    n(0, "NET/Plugin: No plugin found (libnccl-net.so)")
    n(0, f"NCCL version {version}")
    order = list(range(c.ranks))
    rng.shuffle(order)
    for r in order:
        n(r, f"NET/IB : Using [0]mlx5_{c.local(r)}:1/IB [1]mlx5_{(c.local(r) + 1) % 8}:1/IB ; OOB ib0:{job.ips[c.host(r)]}<0>")
        n(r, "Using network IB")
    for r in order:
        n(r, f"comm 0x{rng.randint(0x14e000000000, 0x15ffffffffff):x} rank {r} nranks {c.ranks} cudaDev {c.local(r)} "
             f"busId {rng.choice(['1a', '1c', '3d', '41', '88', '8b', 'c8', 'cb'])}000 - Init COMPLETE", tid[r])
    if rng.random() < 0.5:
        # a peer's listening socket was not up yet at bootstrap: NCCL retries (INFO) and succeeds; the WARN form
        # "Connect to ... failed : Connection refused" is printed only when it gives up, so it is not used here
        r = rng.randrange(c.ranks)
        for _ in range(rng.randint(1, 3)):
            job.out(r, f"{c.host(r)}:{job.pids[r]}:{tid[r]} [{c.local(r)}] NCCL INFO Call to connect returned "
                       f"Connection refused, retrying")


def compiler_warning(job: Job, rank: int) -> None:
    job.out(rank, f"{TORCH}/utils/cpp_extension.py:283: UserWarning: ")
    job.out(rank, "")
    job.out(rank, "                               !! WARNING !!")
    job.out(rank, "")
    job.out(rank, "!" * 79)
    job.out(rank, "Your compiler (c++) is not compatible with the compiler Pytorch was")
    job.out(rank, "built with for this platform, which is g++ on linux. Please")
    job.out(rank, "use g++ to to compile your extension. Alternatively, you may")
    job.out(rank, "compile PyTorch from source using c++, and then you can also use")
    job.out(rank, "c++ to compile your extension.")
    job.out(rank, "!" * 79)
    job.out(rank, "")
    job.out(rank, "                              !! WARNING !!")
    job.out(rank, "")
    job.out(rank, "  warnings.warn(WRONG_COMPILER_WARNING.format(")


def framework_init(job: Job, total_steps: int) -> None:
    rng, c, fw = job.rng, job.cluster, job.framework
    r0 = 0
    if fw == "megatron":
        job.out(r0, f"using world size: {c.ranks}, data-parallel-size: {c.ranks // min(8, c.ranks)}, tensor-model-parallel size: {min(8, c.ranks) // 2}, pipeline-model-parallel size: {2} ")
        job.out(r0, "------------------------ arguments ------------------------")
        for k, v in [("adam_beta1", 0.9), ("adam_beta2", 0.95), ("clip_grad", 1.0), ("data_impl", "mmap"),
                     ("eval_interval", 1000), ("eval_iters", 5), ("fp16", True), ("global_batch_size", 1024),
                     ("hidden_size", 8192), ("lr", 0.00015), ("lr_decay_style", "cosine"), ("micro_batch_size", 1),
                     ("num_layers", 64), ("save_interval", 500), ("seq_length", 2048), ("train_iters", total_steps)]:
            job.out(r0, f"  {k} {'.' * (40 - len(k))} {v}")
        job.out(r0, "-------------------- end of arguments ---------------------")
        job.out(r0, "> initializing torch distributed ...")
        job.out(r0, "> initializing tensor model parallel with size 4")
        job.out(r0, "> initializing pipeline model parallel with size 2")
        job.out(r0, "> setting random seeds to 42 ...")
        job.out(r0, "> compiling dataset index builder ...")
        job.out(r0, ">>> done with dataset index builder. Compilation time: 0.109 seconds")
        job.out(r0, "> compiling and loading fused kernels ...")
        compiler_warning(job, r0)
        for r in rng.sample(range(c.ranks), min(c.ranks, 8)):
            job.out(r, f" > number of parameters on (tensor, pipeline) model parallel rank ({r % 4}, {r // 4 % 2}): "
                       f"{rng.randint(900_000_000, 930_000_000)}")
        job.out(r0, "WARNING: could not find the metadata file /lustre/ckpt/gpt-13b/latest_checkpointed_iteration.txt ")
        job.out(r0, "    will not load any checkpoints and will start from random")
        job.out(r0, f"[after model, optimizer, and learning rate scheduler are built] datetime: {job.t:%Y-%m-%d %H:%M:%S} ")
        job.out(r0, "> building train, validation, and test datasets ...")
        job.out(r0, f"[after dataloaders are built] datetime: {job.t:%Y-%m-%d %H:%M:%S} ")
        job.out(r0, "training ...")
    elif fw == "deepspeed":
        for r in range(c.ranks):
            job.out(r, f"[{job.pylog()}] [INFO] [comm.py:637:init_distributed] cdb=None")
        job.out(r0, f"[{job.pylog()}] [INFO] [logging.py:96:log_dist] [Rank 0] DeepSpeed info: version=0.14.2, git-hash=unknown, git-branch=unknown")
        job.out(r0, f"[{job.pylog()}] [INFO] [stage_1_and_2.py:148:__init__] Reduce bucket size 500000000")
        job.out(r0, f"[{job.pylog()}] [INFO] [logging.py:96:log_dist] [Rank 0] DeepSpeed Final Optimizer = adamw")
        job.out(r0, f"[{job.pylog()}] [INFO] [logging.py:96:log_dist] [Rank 0] step=0, skipped=0, lr=[0.0], mom=[(0.9, 0.95)]")
        job.out(r0, f"[{job.pylog()}] [INFO] [config.py:984:print] DeepSpeedEngine configuration:")
        for k, v in [("fp16_enabled", True), ("gradient_accumulation_steps", 8), ("gradient_clipping", 1.0),
                     ("steps_per_print", 10), ("train_batch_size", 2048), ("zero_optimization_stage", 2)]:
            job.out(r0, f"[{job.pylog()}] [INFO] [config.py:988:print]   {k} {'.' * (30 - len(k))} {v}")
    elif fw == "hf":
        for r in range(c.ranks):
            job.out(r, f"{job.t:%m/%d/%Y %H:%M:%S} - WARNING - __main__ - Process rank: {r}, device: cuda:{c.local(r)}, "
                       f"n_gpu: 1, distributed training: True, 16-bits training: False")
        job.out(r0, f"[INFO|trainer.py:2078] {job.pylog()} >> ***** Running training *****")
        job.out(r0, f"[INFO|trainer.py:2079] {job.pylog()} >>   Num examples = 4,812,345")
        job.out(r0, f"[INFO|trainer.py:2083] {job.pylog()} >>   Total train batch size (w. parallel, distributed & accumulation) = {c.ranks * 16}")
        job.out(r0, f"[INFO|trainer.py:2085] {job.pylog()} >>   Total optimization steps = {total_steps:,}")
    elif fw == "lightning":
        job.out(r0, "GPU available: True (cuda), used: True")
        job.out(r0, "TPU available: False, using: 0 TPU cores")
        for r in range(c.ranks):
            job.out(r, f"Initializing distributed: GLOBAL_RANK: {r}, MEMBER: {r + 1}/{c.ranks}")
        job.out(r0, "----------------------------------------------------------------------------------------------------")
        job.out(r0, "distributed_backend=nccl")
        job.out(r0, f"All distributed processes registered. Starting with {c.ranks} processes")
        job.out(r0, "----------------------------------------------------------------------------------------------------")
        for r in range(c.ranks):
            job.out(r, f"LOCAL_RANK: {c.local(r)} - CUDA_VISIBLE_DEVICES: [0,1,2,3,4,5,6,7]")
        job.out(r0, "  | Name  | Type     | Params")
        job.out(r0, "-----------------------------------")
        job.out(r0, "0 | model | GPTModel | 1.3 B ")
    elif fw == "titan":
        for r in titan_loggers(job):
            job.out(r, f"[titan] {job.pylog()} - root - INFO - Starting job: Llama 3 8B training")
            job.out(r, f"[titan] {job.pylog()} - root - INFO - Building 1-D device mesh with ['dp_shard'], [{c.ranks}]")
            job.out(r, f"[titan] {job.pylog()} - root - INFO - Applied FSDP to the model")
            job.out(r, f"[titan] {job.pylog()} - root - INFO - CUDA memory usage for model: 3.76GiB(4.75%)")
            job.out(r, f"[titan] {job.pylog()} - root - INFO - Training starts at step 1, with local batch size 2, "
                       f"global batch size {2 * c.ranks}, sequence length 8192, total steps {total_steps}")
    else:
        job.out(r0, "Seed set to 1337")
        job.out(r0, "Loading model with {'name': 'pythia-1b', 'block_size': 2048, 'n_layer': 16, 'n_embd': 2048}")
        job.out(r0, "Number of trainable parameters: 1,011,781,632")


def titan_loggers(job: Job) -> list[int]:
    """torchtitan prints from every rank when --log-rank is not restricted; keep it small for big jobs."""
    return list(range(job.cluster.ranks)) if getattr(job, "all_ranks_log", False) else [0]


# ----------------------------------------------------------------------------------------------------------------
# training loop output
# ----------------------------------------------------------------------------------------------------------------

@dataclass
class Train:
    total: int
    log_every: int
    ckpt_every: int
    eval_every: int
    step_time: float
    curve: Curve
    ckpt_dir: str = "/lustre/fsw/ckpt/run"
    loss_scale: float = 65536.0


def progress_rank(job: Job) -> int:
    return job.cluster.ranks - 1 if job.framework == "megatron" else 0


def fmt_loss(x: float) -> str:
    return f"{x:.6E}"


def progress(job: Job, tr: Train, step: int, ranks: list[int] | None = None) -> int:
    """One progress line per logging rank; returns the last line number."""
    rng, fw = job.rng, job.framework
    loss = tr.curve.loss(rng, step)
    nan = tr.curve.is_nan(step)
    lr = 3e-4 * min(1.0, step / max(1, tr.total // 20)) * (0.5 + 0.5 * math.cos(math.pi * step / tr.total))
    targets = ranks if ranks is not None else [progress_rank(job)]
    last = 0
    for r in targets:
        if fw == "megatron":
            loss_field = "" if nan else f" lm loss: {fmt_loss(loss)} |"
            nan_count = 1 if nan else 0
            gn = "nan" if nan else f"{abs(rng.gauss(0.25, 0.05)) * (40 if tr.curve.diverge_at and step >= tr.curve.diverge_at else 1):.3f}"
            last = job.out(r, f" iteration {step:8d}/{tr.total:8d} | consumed samples: {step * 1024:12d} | "
                              f"elapsed time per iteration (ms): {tr.step_time * 1000 + rng.gauss(0, 30):.1f} | "
                              f"learning rate: {lr:.3E} | global batch size:  1024 |{loss_field} "
                              f"loss scale: {tr.loss_scale:.1f} | grad norm: {gn} | num zeros: 0.0 | "
                              f"number of skipped iterations:   {nan_count} | number of nan iterations:   {nan_count} |")
        elif fw == "deepspeed":
            last = job.out(r, f"[{job.pylog()}] [INFO] [logging.py:96:log_dist] [Rank 0] step={step}, skipped=0, "
                              f"lr=[{lr:.10f}], mom=[(0.9, 0.95)]")
            shown = "nan" if nan else f"{loss:.4f}"
            last = job.out(r, f"steps: {step} loss: {shown} iter time (s): {tr.step_time + rng.gauss(0, 0.02):.3f} "
                              f"samples/sec: {2048 / tr.step_time:.3f}")
        elif fw == "hf":
            shown = "nan" if nan else f"{loss:.4f}"
            gn = "nan" if nan else f"{abs(rng.gauss(0.6, 0.1))}"
            last = job.out(r, f"{{'loss': {shown}, 'grad_norm': {gn}, 'learning_rate': {lr:.4g}, "
                              f"'epoch': {step / tr.total * 3:.2f}}}")
        elif fw == "lightning":
            pct = int(step / tr.total * 100)
            elapsed = timedelta(seconds=int(step * tr.step_time))
            remaining = timedelta(seconds=int((tr.total - step) * tr.step_time))
            shown = "nan" if nan else f"{loss:.3g}"
            last = job.out(r, f"Epoch 0: {pct:3d}%|{'█' * (pct // 5):<20}| {step}/{tr.total} [{elapsed}<{remaining}, "
                              f"{1 / tr.step_time:.2f}it/s, loss={shown}, v_num=95nc, reduced_train_loss={shown}, "
                              f"global_step={float(step):.1f}]")
        elif fw == "titan":
            shown = "    nan" if nan else f"{loss:8.5f}"
            gn = "    nan" if nan else f"{abs(rng.gauss(0.45, 0.08)):7.4f}"
            last = job.out(r, f"[titan] {job.pylog()} - root - INFO - step: {step:2d}  loss: {shown}  grad_norm: {gn}  "
                              f"memory: 58.21GiB(73.53%)  tps: {rng.randint(6800, 7200):,}  tflops: 391.{rng.randint(10, 99)}  "
                              f"mfu: 39.{rng.randint(10, 99)}%")
        else:
            shown = "nan" if nan else f"{loss:.4f}"
            last = job.out(r, f"iter {step * 8} step {step}: loss {shown}, iter time: {tr.step_time * 1000 + rng.gauss(0, 20):.2f}ms")
    return last


def checkpoint(job: Job, tr: Train, step: int) -> None:
    fw, rng = job.framework, job.rng
    r = progress_rank(job)
    if fw == "megatron":
        job.out(r, f"saving checkpoint at iteration {step:7d} to {tr.ckpt_dir}")
        job.tick(rng.uniform(20, 60))
        job.out(r, f"  successfully saved checkpoint at iteration {step:7d} to {tr.ckpt_dir}")
        job.out(r, f"time (ms) | save-checkpoint: {rng.uniform(20000, 60000):.2f}")
    elif fw == "deepspeed":
        job.out(0, f"[{job.pylog()}] [INFO] [logging.py:96:log_dist] [Rank 0] Saving model checkpoint: "
                   f"{tr.ckpt_dir}/global_step{step}/mp_rank_00_model_states.pt")
        job.tick(rng.uniform(10, 40))
        job.out(0, f"[{job.pylog()}] [INFO] [torch_checkpoint_engine.py:33:commit] [Torch] Checkpoint global_step{step} is ready now!")
    elif fw == "hf":
        job.out(0, f"[INFO|trainer.py:3305] {job.pylog()} >> Saving model checkpoint to {tr.ckpt_dir}/checkpoint-{step}")
        job.out(0, f"[INFO|configuration_utils.py:471] {job.pylog()} >> Configuration saved in {tr.ckpt_dir}/checkpoint-{step}/config.json")
    elif fw == "lightning":
        job.out(0, f"Epoch 0, global step {step}: 'val_loss' reached {tr.curve.loss(rng, step):.5f} (best "
                   f"{tr.curve.loss(rng, step):.5f}), saving model to '{tr.ckpt_dir}/epoch=0-step={step}.ckpt' as top 1")
    elif fw == "titan":
        job.out(0, f"[titan] {job.pylog()} - root - INFO - Saving the checkpoint (or staging if async is enabled).")
        job.tick(rng.uniform(10, 40))
        job.out(0, f"[titan] {job.pylog()} - root - INFO - [GC] Performing periodical GC collection 0.05 seconds")
        job.out(0, f"[titan] {job.pylog()} - root - INFO - Finished saving the checkpoint (or staging if async is "
                   f"enabled)in {rng.uniform(8, 30):.2f} seconds.")
    else:
        job.out(0, f"Saving checkpoint to '{tr.ckpt_dir}/iter-{step * 8:06d}-ckpt.pth'")


def evaluate(job: Job, tr: Train, step: int) -> None:
    fw, rng = job.framework, job.rng
    r = progress_rank(job)
    v = tr.curve.loss(rng, step) * 1.04
    if fw == "megatron":
        job.out(r, "-" * 96)
        job.out(r, f" validation loss at iteration {step} | lm loss value: {fmt_loss(v)} | lm loss PPL: {math.exp(min(v, 50)):.6E} | ")
        job.out(r, "-" * 96)
    elif fw == "hf":
        job.out(0, f"[INFO|trainer.py:3614] {job.pylog()} >> ***** Running Evaluation *****")
        job.out(0, f"{{'eval_loss': {v:.4f}, 'eval_runtime': {rng.uniform(20, 60):.4f}, 'eval_samples_per_second': "
                   f"{rng.uniform(100, 300):.3f}, 'eval_steps_per_second': {rng.uniform(1, 5):.3f}, 'epoch': {step / tr.total * 3:.2f}}}")
    elif fw == "lightning":
        job.out(0, "Validation DataLoader 0: 100%|████████████████████| 50/50 [00:31<00:00,  1.60it/s]")
    elif fw == "titan":
        job.out(0, f"[titan] {job.pylog()} - root - INFO - validate step: {step:2d}  loss: {v:8.5f}  memory: 41.02GiB(51.82%)")
    elif fw == "deepspeed":
        job.out(0, f"eval at step {step}: loss {v:.4f} ppl {math.exp(min(v, 50)):.2f}")
    else:
        job.out(0, f"iter {step * 8}: val loss {v:.4f}, val time: {rng.uniform(8000, 20000):.2f}ms")


RECOVERED: list[Callable[[Job, Train, int], None]] = []


def recovered(fn: Callable[[Job, Train, int], None]) -> Callable[[Job, Train, int], None]:
    RECOVERED.append(fn)
    return fn


@recovered
def overflow_skip(job: Job, tr: Train, step: int) -> None:
    if job.framework == "deepspeed":
        job.out(0, f"[{job.pylog()}] [INFO] [loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping step. "
                   f"Attempted loss scale: {tr.loss_scale:.0f}, reducing to {tr.loss_scale / 2:.0f}")


@recovered
def nccl_connect_retry(job: Job, tr: Train, step: int) -> None:
    c, rng = job.cluster, job.rng
    r = rng.randrange(c.ranks)
    for _ in range(rng.randint(1, 4)):
        job.out(r, f"{c.host(r)}:{job.pids[r]}:{job.pids[r] + 211} [{c.local(r)}] NCCL INFO Call to connect returned "
                   f"Connection refused, retrying")


@recovered
def hub_retry(job: Job, tr: Train, step: int) -> None:
    job.out(0, "wandb: Network error (ReadTimeout), entering retry loop.")
    job.tick(job.rng.uniform(5, 30))
    job.out(0, f"wandb: Network error resolved after 0:00:{job.rng.randint(10, 59)}.{job.rng.randint(100000, 999999)}, resuming normal operation.")


@recovered
def dataloader_slow(job: Job, tr: Train, step: int) -> None:
    job.out(job.rng.randrange(job.cluster.ranks),
            f"{TORCH}/utils/data/dataloader.py:557: UserWarning: This DataLoader will create 16 worker processes in total. "
            f"Our suggested max number of worker in current system is 12, which is smaller than what this DataLoader is "
            f"going to create. Please be aware that excessive worker creation might get DataLoader running slow or even freeze, "
            f"lower the worker number to avoid potential slowness/freeze if necessary.")


@recovered
def ib_async_event(job: Job, tr: Train, step: int) -> None:
    c, rng = job.cluster, job.rng
    r = rng.randrange(c.ranks)
    job.out(r, f"{c.host(r)}:{job.pids[r]}:{job.pids[r] + 230} [{c.local(r)}] NCCL INFO NET/IB : Got async event : "
               f"GID table change")


def train_loop(job: Job, tr: Train, stop: int, recovered_events: int = 3, per_rank: Callable[[int], None] | None = None,
               progress_ranks: list[int] | None = None) -> int:
    """Run steps 1..stop (inclusive); returns the line of the last progress line."""
    rng = job.rng
    events = sorted(rng.sample(range(2, max(3, stop)), min(recovered_events, max(0, stop - 2))))
    last = 0
    for step in range(1, stop + 1):
        job.tick(tr.step_time)
        if per_rank is not None:
            per_rank(step)
        if step % tr.log_every == 0 or step == 1:
            last = progress(job, tr, step, progress_ranks)
        if events and step == events[0]:
            events.pop(0)
            rng.choice(RECOVERED)(job, tr, step)
        if step % tr.eval_every == 0:
            evaluate(job, tr, step)
        if step % tr.ckpt_every == 0:
            checkpoint(job, tr, step)
    return last


# ----------------------------------------------------------------------------------------------------------------
# cascades
# ----------------------------------------------------------------------------------------------------------------

def frames_c10d(job: Job, rank: int, fn: str) -> None:
    job.out(rank, f"Exception raised from {fn} at ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:609 (most recent call first):")
    base = job.rng.randint(0x7f0000000000, 0x7fffffffffff)
    job.out(rank, f"frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x96 (0x{base:x} in {TORCH}/lib/libc10.so)")
    job.out(rank, f"frame #1: c10d::ProcessGroupNCCL::WorkNCCL::checkTimeout(std::optional<std::chrono::duration<long, "
                  f"std::ratio<1l, 1000l> > >) + 0x1d2 (0x{base + 0x11b38d2:x} in {TORCH}/lib/libtorch_cuda.so)")
    job.out(rank, f"frame #2: c10d::ProcessGroupNCCL::watchdogHandler() + 0x233 (0x{base + 0x11ba313:x} in {TORCH}/lib/libtorch_cuda.so)")
    job.out(rank, f"frame #3: c10d::ProcessGroupNCCL::ncclCommWatchdog() + 0x10c (0x{base + 0x11bc6fc:x} in {TORCH}/lib/libtorch_cuda.so)")
    job.out(rank, f"frame #4: <unknown function> + 0xdbbf4 (0x{base + 0x4eaa5dbf4:x} in /lib/x86_64-linux-gnu/libstdc++.so.6)")
    job.out(rank, f"frame #5: <unknown function> + 0x94ac3 (0x{base + 0x4ff9ac3:x} in /lib/x86_64-linux-gnu/libc.so.6)")


def watchdog_cascade(job: Job, survivors: list[int], seq: int, timeout_ms: int, op: str = "ALLREDUCE",
                     numel: int | None = None) -> int:
    """The ranks still in the collective time out; returns the first watchdog line."""
    rng = job.rng
    numel = numel or rng.choice([33554432, 466119168, 160672064, 544997376])
    order = survivors[:]
    rng.shuffle(order)
    first = 0
    for r in order:
        job.tick(rng.uniform(0.0, 0.05))
        ran = timeout_ms + rng.randint(1, 90)
        n = job.out(r, f"{job.glog('E', 'ProcessGroupNCCL.cpp:607')} [Rank {r}] Watchdog caught collective operation timeout: "
                       f"WorkNCCL(SeqNum={seq}, OpType={op}, NumelIn={numel}, NumelOut={numel}, Timeout(ms)={timeout_ms}) "
                       f"ran for {ran} milliseconds before timing out.")
        first = first or n
    for r in order:
        job.out(r, f"{job.glog('E', 'ProcessGroupNCCL.cpp:1664')} [PG 0 (default_pg) Rank {r}] Exception (either an error or "
                   f"timeout) detected by watchdog at work: {seq}, last enqueued NCCL work: {seq + 2}, last completed NCCL work: {seq - 1}.")
        job.out(r, f"{job.glog('E', 'ProcessGroupNCCL.cpp:621')} [Rank {r}] Some NCCL operations have failed or timed out. Due "
                   f"to the asynchronous nature of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete data.")
        job.out(r, f"{job.glog('E', 'ProcessGroupNCCL.cpp:627')} [Rank {r}] To avoid data inconsistency, we are taking the entire process down.")
    for r in order:
        job.out(r, "terminate called after throwing an instance of 'c10::DistBackendError'")
        job.out(r, f"  what():  [PG 0 (default_pg) Rank {r}] Process group watchdog thread terminated with exception: "
                   f"[Rank {r}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum={seq}, OpType={op}, "
                   f"NumelIn={numel}, NumelOut={numel}, Timeout(ms)={timeout_ms}) ran for {timeout_ms + 37} milliseconds before timing out.")
        frames_c10d(job, r, "checkTimeout")
    return first


def elastic_teardown(job: Job, failures: dict[int, int], signal_kill: dict[int, int] | None = None) -> None:
    """torchrun agents: SIGTERM the local workers, then print the ChildFailedError summary. failures: rank -> exitcode."""
    rng, c = job.rng, job.cluster
    signal_kill = signal_kill or {}
    job.tick(rng.uniform(1, 5))
    by_host: dict[str, list[int]] = {}
    for r in sorted(failures):
        by_host.setdefault(c.host(r), []).append(r)
    for h in c.hosts:
        failed = by_host.get(h)
        if not failed:
            continue
        first = failed[0]
        for r in c.ranks_of(h):
            if r not in failures:
                job.node(h, f"{job.elastic('W', h, 'torch/distributed/elastic/multiprocessing/api.py:897')} "
                            f"Sending process {job.pids[r]} closing signal SIGTERM")
        job.node(h, f"{job.elastic('E', h, 'torch/distributed/elastic/multiprocessing/api.py:869')} failed (exitcode: "
                    f"{failures[first]}) local_rank: {c.local(first)} (pid: {job.pids[first]}) of binary: /usr/bin/python3")
        job.node(h, "Traceback (most recent call last):")
        job.node(h, '  File "/usr/local/bin/torchrun", line 8, in <module>')
        job.node(h, "    sys.exit(main())")
        job.node(h, f'  File "{TORCH}/distributed/elastic/multiprocessing/errors/__init__.py", line 355, in wrapper')
        job.node(h, "    return f(*args, **kwargs)")
        job.node(h, f'  File "{TORCH}/distributed/launcher/api.py", line 263, in launch_agent')
        job.node(h, "    raise ChildFailedError(")
        job.node(h, "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ")
        job.node(h, "============================================================")
        job.node(h, "train.py FAILED")
        job.node(h, "------------------------------------------------------------")
        job.node(h, "Failures:")
        others = failed[1:]
        if not others:
            job.node(h, "  <NO_OTHER_FAILURES>")
        for i, r in enumerate(others, 1):
            summary_entry(job, h, i, r, failures[r], signal_kill.get(r))
        job.node(h, "------------------------------------------------------------")
        job.node(h, "Root Cause (first observed failure):")
        summary_entry(job, h, 0, first, failures[first], signal_kill.get(first))
        job.node(h, "============================================================")


def summary_entry(job: Job, h: str, i: int, r: int, code: int, sig: int | None) -> None:
    c = job.cluster
    job.node(h, f"[{i}]:")
    job.node(h, f"  time      : {job.t:%Y-%m-%d_%H:%M:%S}")
    job.node(h, f"  host      : {h}")
    job.node(h, f"  rank      : {r} (local_rank: {c.local(r)})")
    job.node(h, f"  exitcode  : {code} (pid: {job.pids[r]})")
    job.node(h, "  error_file: <N/A>")
    if sig:
        job.node(h, f"  traceback : Signal {sig} ({ {9: 'SIGKILL', 6: 'SIGABRT', 15: 'SIGTERM'}[sig] }) received by PID {job.pids[r]}")
    else:
        job.node(h, "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html")


def srun_teardown(job: Job, failed_ranks: list[int], code: int = 1, aborted: bool = False) -> None:
    rng, c = job.rng, job.cluster
    if job.launcher != "srun":
        return
    for r in failed_ranks[:1]:
        job.raw(f"srun: error: {c.host(r)}: task {r}: {'Aborted (core dumped)' if aborted else f'Exited with exit code {code}'}")
    job.raw(f"srun: launch/slurm: _step_signal: Terminating StepId={job.slurm_id}.0")
    job.tick(rng.uniform(0.5, 2))
    job.raw(f"slurmstepd: error: *** STEP {job.slurm_id}.0 ON {c.hosts[0]} CANCELLED AT {job.t:%Y-%m-%dT%H:%M:%S} ***")
    for r in failed_ranks[1:4]:
        job.raw(f"srun: error: {c.host(r)}: task {r}: {'Aborted (core dumped)' if aborted else 'Terminated'}")
    job.raw(f"srun: Force Terminated StepId={job.slurm_id}.0")


def pdsh_teardown(job: Job, failed_ranks: list[int]) -> None:
    c = job.cluster
    if job.launcher != "pdsh":
        return
    for h in c.hosts:
        for r in c.ranks_of(h)[:2]:
            job.node(h, f"Killing subprocess {job.pids[r]}")
        job.node(h, "Main process received SIGTERM, exiting")
    r = failed_ranks[0]
    job.node(c.host(r), f"[{job.pylog()}] [ERROR] [launch.py:321:sigkill_handler] ['/usr/bin/python', '-u', 'train.py', "
                        f"'--local_rank={c.local(r)}', '--deepspeed_config', 'ds_config.json'] exits with return code = 1")
    job.raw(f"pdsh@{c.hosts[0]}: {c.host(r)}: ssh exited with exit code 1")


def teardown(job: Job, culprits: list[int], others_abort: list[int], code: int = 1, sig: int | None = None) -> None:
    """The generic end of a failed job: the launcher's own view of who died."""
    failures = dict.fromkeys(culprits, code if sig is None else -sig)
    for r in others_abort:
        failures.setdefault(r, -6)
    sigs = {r: sig for r in culprits if sig} | dict.fromkeys(others_abort, 6)
    if job.launcher in ("rank", "default"):
        elastic_teardown(job, failures, sigs)
    elif job.launcher == "srun":
        srun_teardown(job, sorted(failures, key=lambda r: (r not in culprits, r)), code, aborted=bool(others_abort))
    else:
        pdsh_teardown(job, culprits or others_abort)


# ----------------------------------------------------------------------------------------------------------------
# tracebacks
# ----------------------------------------------------------------------------------------------------------------

def traceback(job: Job, rank: int, frames: list[tuple[str, int, str, str]], exc: str, chained: str | None = None) -> int:
    """Python traceback on `rank`; frames are (file, line, function, source). Returns the exception line number."""
    job.out(rank, "Traceback (most recent call last):")
    for f, ln, fn, src in frames:
        job.out(rank, f'  File "{f}", line {ln}, in {fn}')
        job.out(rank, f"    {src}")
    n = 0
    for part in exc.split("\n"):
        m = job.out(rank, part)
        n = n or m
    if chained:
        job.out(rank, "")
        job.out(rank, chained)
    return n


def user_frames(entry: str = "/workspace/train.py") -> list[tuple[str, int, str, str]]:
    return [(entry, 412, "<module>", "main()"),
            (f"{TORCH}/distributed/elastic/multiprocessing/errors/__init__.py", 355, "wrapper", "return f(*args, **kwargs)"),
            (entry, 398, "main", "train(args, model, optimizer, train_loader)")]


# ----------------------------------------------------------------------------------------------------------------
# scenarios: each returns the label fields
# ----------------------------------------------------------------------------------------------------------------

@dataclass
class Spec:
    scenario: str
    ranks: int
    launcher: str
    framework: str
    lines: int          # approximate target
    fn: Callable[[Job, Train, int], dict]


def setup_train(job: Job, target_lines: int, fail_frac: float | None, divergence: bool = False,
                spike: bool = False, per_step_lines: float = 1.0) -> tuple[Train, int]:
    """Choose logging cadence so the job lands near target_lines. Returns (train, fail_step)."""
    rng = job.rng
    # what the preamble, the cascade and the teardown will add, roughly: a few lines per rank
    overhead = len(job.lines) + 400 + 22 * job.cluster.ranks
    budget = max(900, target_lines - overhead)
    per_log = per_step_lines * (2.3 if job.framework == "deepspeed" else 1.15)
    log_every = rng.choice([1, 1, 5, 10])
    # the job stops at the fault: spread the budget over the steps it will really run
    logged = int(budget / max(per_log, 1.0) / (fail_frac or (0.7 if divergence else 1.0)))
    total = logged * log_every
    curve = Curve(start=rng.uniform(9.5, 11.0), floor=rng.uniform(1.9, 2.8), tau=total / rng.uniform(4, 9),
                  noise=rng.uniform(0.01, 0.04))
    fail_step = int(total * fail_frac) if fail_frac is not None else total
    fail_step = max(fail_step, 2 * log_every)
    if spike:
        curve.spike_at = int(total * rng.uniform(0.3, 0.6)) // log_every * log_every
    if divergence:
        curve.diverge_at = int(total * rng.uniform(0.5, 0.7)) // log_every * log_every
        curve.nan_at = curve.diverge_at + log_every * rng.randint(30, 80)
    ckpt_every = max(log_every, (total // rng.randint(4, 8)) // log_every * log_every)
    eval_every = max(log_every, (total // rng.randint(3, 6)) // log_every * log_every)
    tr = Train(total=total, log_every=log_every, ckpt_every=ckpt_every, eval_every=eval_every,
               step_time=rng.uniform(0.8, 12.0), curve=curve,
               ckpt_dir=rng.choice(["/lustre/fsw/llm/ckpt/run-7b", "/checkpoints/gpt-13b", "/fsx/ckpt/llama3-8b",
                                    "/gpfs/scratch/ckpt/tr-42"]))
    return tr, fail_step


def start(job: Job, total: int) -> None:
    preamble(job)
    framework_init(job, total)
    nccl_init(job)


def run_to_fault(job: Job, target: int, lo: float, hi: float) -> tuple[Train, int]:
    """Start-up and normal training up to the step where the fault strikes (a fraction lo..hi of the run)."""
    tr, fail = setup_train(job, target, job.rng.uniform(lo, hi))
    start(job, tr.total)
    train_loop(job, tr, fail)
    return tr, fail


def label(status: str, category: str | None, ftype: str | None, action: str, root: int | None = None,
          alts: list[int] | None = None, hosts: list[str] | None = None, ranks: list[int] | None = None,
          evidence: str = "", **extra) -> dict:
    return {"status": status, "category": category, "failure_type": ftype, "action": action, "root": root,
            "alts": alts or [], "culprit_hosts": hosts or [], "culprit_ranks": ranks or [], "evidence": evidence} | extra


# -- healthy runs ------------------------------------------------------------------------------------------------

def healthy(job: Job, target: int) -> dict:
    tr, _ = setup_train(job, target, None, spike=job.rng.random() < 0.7)
    start(job, tr.total)
    train_loop(job, tr, tr.total, recovered_events=job.rng.randint(4, 9))
    fw, c = job.framework, job.cluster
    if fw == "megatron":
        checkpoint(job, tr, tr.total)
        job.out(progress_rank(job), f"[after training is done] datetime: {job.t:%Y-%m-%d %H:%M:%S} ")
    elif fw == "hf":
        job.out(0, "")
        job.out(0, "")
        job.out(0, "Training completed. Do not forget to share your model on huggingface.co/models =)")
        for r in range(c.ranks):
            job.out(r, f"{{'train_runtime': {tr.total * tr.step_time:.4f}, 'train_samples_per_second': 3.663, "
                       f"'train_steps_per_second': 0.007, 'train_loss': {tr.curve.floor + 0.1:.4f}, 'epoch': 3.0}}")
        job.out(0, f"[INFO|trainer_pt_utils.py:1133] {job.pylog()} >> ***** train metrics *****")
        job.out(0, f"[INFO|trainer_pt_utils.py:1138] {job.pylog()} >>   epoch                    =        3.0")
    elif fw == "lightning":
        job.out(0, f"`Trainer.fit` stopped: `max_steps={tr.total}` reached.")
    elif fw == "titan":
        job.out(0, f"[titan] {job.pylog()} - root - INFO - Sleeping 2 seconds for other ranks to complete")
        job.out(0, f"[titan] {job.pylog()} - root - INFO - Training completed")
        for r in range(c.ranks):
            job.out(r, f"{job.glog('W', 'ProcessGroupNCCL.cpp:1250')} Warning: WARNING: process group has NOT been destroyed "
                       "before we destruct ProcessGroupNCCL. On normal program exit, the application should call "
                       "destroy_process_group to ensure that any pending NCCL operations have finished in this process. "
                       "In rare cases this process can exit before this point and block the progress of another member "
                       "of the process group. This constraint has always been present,  but this warning has only been "
                       "added since PyTorch 2.4 (function operator())")
    elif fw == "deepspeed":
        checkpoint(job, tr, tr.total)
        job.out(0, f"[{job.pylog()}] [INFO] [launch.py:347:main] Process {job.pids[0]} exits successfully.")
    else:
        job.out(0, f"Training time: {tr.total * tr.step_time:.2f}s")
        job.out(0, "Memory used: 61.02 GB")
    if job.launcher in ("rank", "default"):
        for h in c.hosts:
            job.node(h, f"{job.elastic('I', h, 'torch/distributed/elastic/agent/server/api.py:879')} [default] worker group "
                        f"successfully finished. Waiting 300 seconds for other agents to finish.")
    return label("healthy", None, None, "none",
                 evidence="Run completes: every step logged, completion marker printed; warnings along the way recovered.")


# -- infrastructure ------------------------------------------------------------------------------------------------

XID_TEXT = {
    79: "GPU has fallen off the bus.",
    48: "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 6, subpartition 0.",
    74: "NVLink: fatal error detected on link 4(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)",
    94: "Contained ECC error",
}
XID_TYPE = {79: "gpu_fell_off_bus", 48: "ecc_error", 74: "nvlink_error", 94: "ecc_error"}
XID_CUDA = {79: "CUDA error: unknown error", 48: "CUDA error: uncorrectable ECC error encountered",
            74: "CUDA error: an illegal memory access was encountered", 94: "CUDA error: uncorrectable ECC error encountered"}


def xid(code: int) -> Callable[[Job, int], dict]:
    def run(job: Job, target: int) -> dict:
        rng, c = job.rng, job.cluster
        tr, fail = setup_train(job, target, rng.uniform(0.55, 0.9))
        start(job, tr.total)
        train_loop(job, tr, fail)
        host = rng.choice(c.hosts[1:] or c.hosts)
        victim = rng.choice(c.ranks_of(host))
        bus = f"0000:{rng.choice(['07', '0b', '48', '4c', '88', '8b', 'c8', 'cb'])}:00"
        job.tick(rng.uniform(1, 20))
        pid = job.pids[victim]
        name = rng.choice(["python", "pt_main_thread", "python3"])
        text = XID_TEXT[code] if code != 79 else XID_TEXT[79]
        if code == 94:
            root = job.syslog(host, f"NVRM: Xid (PCI:{bus}): 94, pid={pid}, name={name}, Contained: SM (0x1). RST: No, D-RST: No")
        else:
            root = job.syslog(host, f"NVRM: Xid (PCI:{bus}): {code}, pid={pid}, name={name}, {text}")
        alts = []
        if code == 79:
            alts.append(job.syslog(host, f"NVRM: GPU {bus}.0: GPU has fallen off the bus."))
        job.tick(rng.uniform(0.1, 3))
        job.out(victim, "terminate called after throwing an instance of 'c10::CUDAError'")
        alts.append(job.out(victim, f"  what():  {XID_CUDA[code]}"))
        job.out(victim, "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.")
        job.out(victim, "For debugging consider passing CUDA_LAUNCH_BLOCKING=1")
        job.out(victim, "Exception raised from query at ../aten/src/ATen/cuda/CUDAEvent.h:95 (most recent call first):")
        base = rng.randint(0x7f0000000000, 0x7fffffffffff)
        job.out(victim, f"frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x42 (0x{base:x} in {TORCH}/lib/libc10.so)")
        job.out(victim, f"frame #1: c10d::ProcessGroupNCCL::WorkNCCL::finishedGPUExecutionInternal() const + 0x11a (0x{base + 0x6c29ea:x} in {TORCH}/lib/libtorch_cuda.so)")
        job.out(victim, f"frame #2: c10d::ProcessGroupNCCL::WorkNCCL::isCompleted() + 0x50 (0x{base + 0x6c4fd0:x} in {TORCH}/lib/libtorch_cuda.so)")
        job.tick(600 + rng.uniform(0, 5))
        seq = fail * 4 + rng.randint(0, 3)
        survivors = [r for r in range(c.ranks) if r != victim]
        watchdog_cascade(job, survivors, seq, 600000)
        teardown(job, [victim], survivors, sig=6)
        return label("failed", "infrastructure", XID_TYPE[code], "cordon_and_restart", root, alts, [host], [victim],
                     evidence=f"Xid {code} on {host} ({bus}) kills rank {victim}; the other {len(survivors)} ranks time out in NCCL.",
                     fault_step=fail)
    return run


def ib_error(job: Job, target: int) -> dict:
    rng, c = job.rng, job.cluster
    tr, fail = run_to_fault(job, target, 0.4, 0.85)
    victim = rng.randrange(c.gpn, c.ranks)
    host = c.host(victim)
    peer = rng.choice([h for h in c.hosts if h != host])
    tid = job.pids[victim] + 433
    root = job.out(victim, f"{host}:{job.pids[victim]}:{tid} [{c.local(victim)}] transport/net_ib.cc:1696 NCCL WARN NET/IB : "
                           f"Got completion from peer {job.ips[peer]}<{rng.randint(30000, 60000)}> with status=12 opcode=0 len=0 "
                           f"vendor err 129 (Recv) localGid ::ffff:{job.ips[host]} remoteGidsfe80::{rng.randint(1000, 9999):x}:ffff:fe{rng.randint(10, 99)}")
    job.out(victim, f"{host}:{job.pids[victim]}:{tid} [{c.local(victim)}] NCCL INFO transport/net.cc:1140 -> 6")
    job.out(victim, f"{host}:{job.pids[victim]}:{tid} [{c.local(victim)}] NCCL INFO proxy.cc:1489 -> 6")
    job.tick(rng.uniform(1, 5))
    alt = job.out(victim, f"{job.glog('E', 'ProcessGroupNCCL.cpp:1515')} [PG 0 (default_pg) Rank {victim}] Process group watchdog "
                          f"thread terminated with exception: NCCL error: remote process exited or there was a network error, "
                          f"NCCL version 2.20.5")
    job.out(victim, "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.")
    job.out(victim, "Last error:")
    job.out(victim, f"NET/IB : Got completion from peer {job.ips[peer]}<{rng.randint(30000, 60000)}> with status=12 opcode=0 len=0 vendor err 129 (Recv)")
    job.tick(600)
    survivors = [r for r in range(c.ranks) if r != victim]
    watchdog_cascade(job, survivors[: max(4, len(survivors) // 2)], fail * 3, 600000)
    teardown(job, [victim], survivors[: max(4, len(survivors) // 2)], sig=6)
    # status 12 (transport retry counter exceeded) says the path to the peer failed, not which end of it is bad:
    # restart, and name the rank that reported it, not a node to cordon
    return label("failed", "infrastructure", "network_error", "restart", root, [alt], [], [victim],
                 evidence=f"IB work completion error (status=12, transport retry exceeded) between {host} and {peer}; "
                          f"NCCL aborts on rank {victim}, peers time out.",
                 fault_step=fail)


def nccl_system_error(job: Job, target: int) -> dict:
    rng, c = job.rng, job.cluster
    tr, fail = run_to_fault(job, target, 0.3, 0.8)
    victim = rng.randrange(c.ranks)
    host = c.host(victim)
    peer = rng.choice(c.hosts)
    root = job.out(victim, f"{host}:{job.pids[victim]}:{job.pids[victim] + 120} [{c.local(victim)}] misc/socket.cc:484 NCCL WARN "
                           f"socketStartConnect: Connect to {job.ips[peer]}<{rng.randint(30000, 60000)}> failed : Software caused connection abort")
    job.out(victim, f"{host}:{job.pids[victim]}:{job.pids[victim] + 120} [{c.local(victim)}] NCCL INFO misc/socket.cc:565 -> 2")
    tb = traceback(job, victim, user_frames() + [
        ("/workspace/train.py", 233, "train", "loss = training_step(model, batch)"),
        (f"{TORCH}/distributed/c10d_logger.py", 83, "wrapper", "return func(*args, **kwargs)"),
        (f"{TORCH}/distributed/distributed_c10d.py", 2501, "all_reduce", "work = group.allreduce([tensor], opts)")],
        "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, "
        "unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.19.3\n"
        "ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device error. \n"
        "Last error:\n"
        f"socketStartConnect: Connect to {job.ips[peer]}<{rng.randint(30000, 60000)}> failed : Software caused connection abort")
    job.tick(1800)
    survivors = [r for r in range(c.ranks) if r != victim]
    watchdog_cascade(job, survivors, fail * 2 + 7, 1800000)
    teardown(job, [victim], survivors)
    return label("failed", "infrastructure", "nccl_error", "restart", root, [tb], [], [victim],
                 evidence="NCCL socket connect aborted on one rank (unhandled system error); the others time out after 30 min.",
                 fault_step=fail)


def node_failure(job: Job, target: int) -> dict:
    rng, c = job.rng, job.cluster
    job.launcher = "srun"
    tr, fail = run_to_fault(job, target, 0.4, 0.9)
    host = rng.choice(c.hosts[1:] or c.hosts)
    job.tick(rng.uniform(120, 400))
    root = job.raw(f"srun: error: Node failure on {host}")
    job.raw("srun: Job step aborted: Waiting up to 62 seconds for job step to finish.")
    job.tick(62)
    alt = job.raw(f"slurmstepd: error: *** STEP {job.slurm_id}.0 ON {c.hosts[0]} CANCELLED AT {job.t:%Y-%m-%dT%H:%M:%S} "
                  f"DUE TO NODE FAILURE, SEE SLURMCTLD LOG FOR DETAILS ***")
    for r in rng.sample([r for r in range(c.ranks) if c.host(r) != host], min(6, c.ranks - c.gpn)):
        job.raw(f"srun: error: {c.host(r)}: task {r}: Killed")
    job.raw(f"srun: Force Terminated StepId={job.slurm_id}.0")
    return label("failed", "infrastructure", "node_failure", "cordon_and_restart", root, [alt], [host], [],
                 evidence=f"Slurm reports node {host} failed under the step and cancels it.", fault_step=fail)


def lustre_eviction(job: Job, target: int) -> dict:
    rng, c = job.rng, job.cluster
    tr, fail = setup_train(job, target, rng.uniform(0.4, 0.85))
    tr.ckpt_dir = "/lustre/fsw/llm/ckpt/run-7b"
    start(job, tr.total)
    train_loop(job, tr, fail)
    writer = progress_rank(job)
    host = c.host(writer)
    ost = f"fsw-OST{rng.randint(0, 63):04x}"
    job.syslog(host, f"Lustre: {ost}-osc-ffff{rng.randint(0x10000000, 0xffffffff):08x}: Connection to {ost} (at "
                     f"10.{rng.randint(0, 9)}.0.{rng.randint(2, 99)}@o2ib) was lost; in progress operations using this "
                     f"service will wait for recovery to complete")
    job.tick(rng.uniform(60, 200))
    root = job.syslog(host, f"LustreError: 167-0: {ost}-osc-ffff{rng.randint(0x10000000, 0xffffffff):08x}: This client was "
                            f"evicted by {ost}; in progress operations using this service will fail.")
    if job.framework == "megatron":
        job.out(writer, f"saving checkpoint at iteration {fail:7d} to {tr.ckpt_dir}")
    exc = traceback(job, writer, user_frames("/workspace/pretrain_gpt.py") + [
        ("/workspace/megatron/training.py", 1126, "train", "save_checkpoint_and_time(iteration, model, optimizer,"),
        ("/workspace/megatron/checkpointing.py", 387, "save_checkpoint", "torch.save(state_dict, checkpoint_name)"),
        (f"{TORCH}/serialization.py", 628, "save", "with _open_zipfile_writer(f) as opened_zipfile:"),
        (f"{TORCH}/serialization.py", 502, "__init__", "super().__init__(torch._C.PyTorchFileWriter(self.name))")],
        f"OSError: [Errno 5] Input/output error: '{tr.ckpt_dir}/iter_{fail:07d}/mp_rank_00_000/model_optim_rng.pt'")
    job.tick(600)
    survivors = [r for r in range(c.ranks) if r != writer]
    watchdog_cascade(job, survivors, fail * 5 + 1, 600000, op="_ALLGATHER_BASE")
    teardown(job, [writer], survivors)
    return label("failed", "infrastructure", "storage_error", "restart", root, [exc], [], [],
                 evidence="Lustre evicts the client of the checkpoint writer; torch.save fails with EIO; peers time out.",
                 fault_step=fail)


def nfs_stale(job: Job, target: int) -> dict:
    rng, c = job.rng, job.cluster
    tr, fail = run_to_fault(job, target, 0.3, 0.8)
    victim = rng.randrange(c.ranks)
    host = c.host(victim)
    job.syslog(host, "nfs: server fileserver-02 not responding, still trying")
    job.tick(rng.uniform(30, 300))
    job.syslog(host, "nfs: server fileserver-02 OK")
    shard = f"/nfs/datasets/pile/train/{rng.randint(0, 29):02d}.jsonl.zst"
    root = traceback(job, victim, user_frames() + [
        ("/workspace/train.py", 201, "train", "for step, batch in enumerate(train_loader, start=start_step):"),
        (f"{TORCH}/utils/data/dataloader.py", 631, "__next__", "data = self._next_data()"),
        (f"{TORCH}/utils/data/dataloader.py", 1346, "_next_data", "return self._process_data(data)"),
        (f"{TORCH}/utils/data/dataloader.py", 1372, "_process_data", "data.reraise()"),
        (f"{TORCH}/_utils.py", 705, "reraise", "raise exception")],
        "OSError: Caught OSError in DataLoader worker process 3.\nOriginal Traceback (most recent call last):")
    exc = job.out(victim, f'  File "{PY}/datasets/packaged_modules/json/json.py", line 113, in _generate_tables')
    job.out(victim, "    with open(file, \"rb\") as f:")
    exc = job.out(victim, f"OSError: [Errno 116] Stale file handle: '{shard}'")
    job.tick(600)
    survivors = [r for r in range(c.ranks) if r != victim]
    watchdog_cascade(job, survivors, fail * 3 + 2, 600000)
    teardown(job, [victim], survivors)
    return label("failed", "infrastructure", "storage_error", "restart", exc, [root], [], [],
                 evidence="The dataset on NFS returns ESTALE to a DataLoader worker; the rank dies, peers time out.",
                 fault_step=fail)


def disk_full(job: Job, target: int) -> dict:
    rng, c = job.rng, job.cluster
    tr, fail = setup_train(job, target, rng.uniform(0.5, 0.9))
    start(job, tr.total)
    fail = max(tr.ckpt_every, fail // tr.ckpt_every * tr.ckpt_every)
    tr.ckpt_every = max(tr.ckpt_every, fail)   # no normal save at the failing step
    train_loop(job, tr, fail)
    job.out(0, f"[{job.pylog()}] [INFO] [logging.py:96:log_dist] [Rank 0] Saving model checkpoint: "
               f"{tr.ckpt_dir}/global_step{fail}/mp_rank_00_model_states.pt")
    root = traceback(job, 0, user_frames() + [
        ("/workspace/train.py", 281, "train", "model_engine.save_checkpoint(args.save_dir, tag=f\"global_step{step}\")"),
        (f"{PY}/deepspeed/runtime/engine.py", 3125, "save_checkpoint", "self._save_checkpoint(save_dir,"),
        (f"{PY}/deepspeed/runtime/engine.py", 3337, "_save_checkpoint", "self.checkpoint_engine.save(state, save_path)"),
        (f"{PY}/deepspeed/runtime/checkpoint_engine/torch_checkpoint_engine.py", 22, "save", "torch.save(state_dict, path)"),
        (f"{TORCH}/serialization.py", 629, "save", "_save(obj, opened_zipfile, pickle_module, pickle_protocol, _disable_byteorder_record)"),
        (f"{TORCH}/serialization.py", 863, "_save", "zip_file.write_record(name, storage, num_bytes)")],
        "RuntimeError: [enforce fail at inline_container.cc:764] . PytorchStreamWriter failed writing file data/183: file write failed",
        chained="During handling of the above exception, another exception occurred:")
    job.out(0, "Traceback (most recent call last):")
    job.out(0, f'  File "{TORCH}/serialization.py", line 628, in save')
    job.out(0, "    with _open_zipfile_writer(f) as opened_zipfile:")
    alt = job.out(0, "OSError: [Errno 28] No space left on device")
    job.tick(600)
    survivors = list(range(1, c.ranks))
    watchdog_cascade(job, survivors, fail * 4 + 9, 600000, op="BROADCAST")
    teardown(job, [0], survivors)
    return label("failed", "infrastructure", "disk_full", "restart", alt, [root], [], [],
                 evidence="The checkpoint volume fills up during save on rank 0 (ENOSPC); the others time out.",
                 fault_step=fail)


def time_limit(job: Job, target: int) -> dict:
    rng, c = job.rng, job.cluster
    job.launcher = "srun"
    tr, fail = setup_train(job, target, rng.uniform(0.7, 0.95))
    start(job, tr.total)
    train_loop(job, tr, fail, recovered_events=5)
    job.tick(rng.uniform(1, 60))
    root = job.raw(f"slurmstepd: error: *** JOB {job.slurm_id} ON {c.hosts[0]} CANCELLED AT {job.t:%Y-%m-%dT%H:%M:%S} DUE TO TIME LIMIT ***")
    alt = job.raw(f"slurmstepd: error: *** STEP {job.slurm_id}.0 ON {c.hosts[0]} CANCELLED AT {job.t:%Y-%m-%dT%H:%M:%S} DUE TO TIME LIMIT ***")
    job.raw("srun: Job step aborted: Waiting up to 32 seconds for job step to finish.")
    for r in rng.sample(range(c.ranks), min(8, c.ranks)):
        job.out(r, f"{job.glog('W', 'ProcessGroupNCCL.cpp:1250')} Warning: WARNING: process group has NOT been destroyed "
                   "before we destruct ProcessGroupNCCL. On normal program exit, the application should call "
                   "destroy_process_group to ensure that any pending NCCL operations have finished in this process. "
                   "In rare cases this process can exit before this point and block the progress of another member "
                   "of the process group. This constraint has always been present,  but this warning has only been "
                   "added since PyTorch 2.4 (function operator())")
    for r in rng.sample(range(c.ranks), min(4, c.ranks)):
        job.raw(f"srun: error: {c.host(r)}: task {r}: Terminated")
    job.raw(f"srun: Force Terminated StepId={job.slurm_id}.0")
    return label("failed", "infrastructure", "time_limit", "restart", root, [alt], [], [],
                 evidence="Slurm ends the job at its time limit while it trains normally; resubmit from the last checkpoint.",
                 fault_step=fail)


# -- hangs ---------------------------------------------------------------------------------------------------------------

def silent_hang_watchdog(job: Job, target: int) -> dict:
    """One rank stops (nothing printed by it); the others report a watchdog timeout; the silent rank does not."""
    rng, c = job.rng, job.cluster
    job.all_ranks_log = True                       # type: ignore[attr-defined]
    tr, fail = setup_train(job, target, rng.uniform(0.4, 0.85), per_step_lines=c.ranks)
    start(job, tr.total)
    silent = rng.randrange(c.ranks)
    train_loop(job, tr, fail, progress_ranks=list(range(c.ranks)))
    # the silent rank never logs the next step; the others log it and block in the next collective
    nxt = (fail // tr.log_every + 1) * tr.log_every
    job.tick(tr.step_time * tr.log_every)
    progress(job, tr, nxt, [r for r in range(c.ranks) if r != silent])
    job.tick(1800)
    survivors = [r for r in range(c.ranks) if r != silent]
    watchdog_cascade(job, survivors, nxt * 6 + 3, 1800000, op="_REDUCE_SCATTER_BASE")
    teardown(job, [], survivors)
    return label("failed", "infrastructure", "hang", "cordon_and_restart", None, [], [c.host(silent)], [silent],
                 evidence=f"Rank {silent} ({c.host(silent)}) stops after step {fail} without a word; every other rank logs "
                          f"step {nxt} and times out in the collective 30 min later.", fault_step=fail)


def silent_hang_no_watchdog(job: Job, target: int) -> dict:
    """No NCCL timeout at all: per-rank heartbeats stop, one rank first; the job sits until the time limit."""
    rng, c = job.rng, job.cluster
    job.launcher = "srun"
    tr, fail = setup_train(job, target, rng.uniform(0.5, 0.85), per_step_lines=1 + c.ranks * 0.5)
    start(job, tr.total)
    silent = rng.randrange(c.ranks)
    phases = ["Before backward pass in _do_batch", "After deepspeed backward pass in _do_batch",
              "Before sync_gradients in _do_batch", "After clip in _do_batch"]

    def beat(step: int) -> None:
        if step % tr.log_every:
            return
        for ph in rng.sample(phases, 2):
            for r in rng.sample(range(c.ranks), max(2, c.ranks // 4)):
                job.out(r, f"PID {job.pids[r]}:  {ph}")
    train_loop(job, tr, fail, per_rank=beat)
    # last step: everyone but `silent` reaches the sync; `silent` stops inside clip
    for ph in phases:
        for r in range(c.ranks):
            if r == silent and ph in phases[2:]:
                continue
            job.out(r, f"PID {job.pids[r]}:  {ph}")
    job.tick(3 * 3600)
    job.raw(f"slurmstepd: error: *** JOB {job.slurm_id} ON {c.hosts[0]} CANCELLED AT {job.t:%Y-%m-%dT%H:%M:%S} DUE TO TIME LIMIT ***")
    job.raw(f"slurmstepd: error: *** STEP {job.slurm_id}.0 ON {c.hosts[0]} CANCELLED AT {job.t:%Y-%m-%dT%H:%M:%S} DUE TO TIME LIMIT ***")
    return label("failed", "infrastructure", "hang", "cordon_and_restart", None, [], [c.host(silent)], [silent],
                 evidence=f"All heartbeats stop after step {fail}; rank {silent} stopped one phase before the others "
                          f"(never reached sync_gradients); no timeout fires until the time limit 3 h later.",
                 fault_step=fail)


def stack_dump(job: Job, rank: int, frames: list[tuple[str, int, str]], thread: str | None = None) -> list[int]:
    """faulthandler.dump_traceback_later output (most recent call first). Returns the line numbers of the frames."""
    job.out(rank, "Timeout (0:30:00)!")
    job.out(rank, f"Thread {thread or hex(job.rng.randint(0x7f0000000000, 0x7fffffffffff))} (most recent call first):")
    nums = []
    for f, ln, fn in frames:
        nums.append(job.out(rank, f'  File "{f}", line {ln} in {fn}'))
    job.out(rank, "")
    return nums


COLLECTIVE_STACK = [
    (f"{TORCH}/distributed/distributed_c10d.py", 2501, "all_reduce"),
    (f"{TORCH}/distributed/c10d_logger.py", 83, "wrapper"),
    ("/workspace/megatron/core/distributed/param_and_grad_buffer.py", 182, "finish_grad_sync"),
    ("/workspace/megatron/core/distributed/distributed_data_parallel.py", 287, "finish_grad_sync"),
    ("/workspace/megatron/core/pipeline_parallel/schedules.py", 1412, "forward_backward_pipelining_without_interleaving"),
    ("/workspace/megatron/training/training.py", 741, "train_step"),
    ("/workspace/megatron/training/training.py", 1270, "train"),
    ("/workspace/pretrain_gpt.py", 243, "<module>"),
]


def stack_hang(kind: str) -> Callable[[Job, int], dict]:
    def run(job: Job, target: int) -> dict:
        rng, c = job.rng, job.cluster
        tr, fail = setup_train(job, target, rng.uniform(0.4, 0.85), per_step_lines=1.0)
        start(job, tr.total)
        train_loop(job, tr, fail)
        culprit = rng.randrange(c.ranks)
        job.tick(1800)
        root = alts = None
        order = list(range(c.ranks))
        rng.shuffle(order)
        for r in order:
            if r != culprit:
                stack_dump(job, r, COLLECTIVE_STACK)
                continue
            if kind == "framework":
                frames = [("/usr/lib/python3.10/threading.py", 324, "wait"),
                          ("/usr/lib/python3.10/queue.py", 180, "get"),
                          (f"{TORCH}/utils/data/dataloader.py", 1133, "_try_get_data"),
                          (f"{TORCH}/utils/data/dataloader.py", 1294, "_get_data"),
                          (f"{TORCH}/utils/data/dataloader.py", 1332, "_next_data"),
                          (f"{TORCH}/utils/data/dataloader.py", 631, "__next__"),
                          ("/workspace/megatron/training/utils.py", 276, "get_batch_on_this_tp_rank"),
                          ("/workspace/pretrain_gpt.py", 152, "get_batch"),
                          ("/workspace/megatron/core/pipeline_parallel/schedules.py", 1412, "forward_backward_pipelining_without_interleaving"),
                          ("/workspace/megatron/training/training.py", 741, "train_step"),
                          ("/workspace/pretrain_gpt.py", 243, "<module>")]
                nums = stack_dump(job, r, frames)
                root, alts = nums[2], nums[:2] + nums[3:6]
            else:
                frames = [("/workspace/utils/sync.py", 41, "poll_marker_file"),
                          ("/workspace/utils/sync.py", 58, "wait_for_eval_results"),
                          ("/workspace/train.py", 288, "maybe_evaluate"),
                          ("/workspace/train.py", 233, "train"),
                          ("/workspace/train.py", 398, "main"),
                          ("/workspace/train.py", 412, "<module>")]
                nums = stack_dump(job, r, frames)
                root, alts = nums[0], nums[1:3]
        job.tick(rng.uniform(60, 600))
        job.raw(f"slurmstepd: error: *** JOB {job.slurm_id} ON {c.hosts[0]} CANCELLED AT {job.t:%Y-%m-%dT%H:%M:%S} ***")
        if kind == "framework":
            return label("failed", "framework", "framework_hang", "no_restart", root, alts, [c.host(culprit)], [culprit],
                         evidence=f"After 30 min without progress the faulthandler dumps show every rank in all_reduce except "
                                  f"rank {culprit}, which waits on the DataLoader queue; the operator cancels the job.",
                         fault_step=fail)
        return label("failed", "script", "script_hang", "no_restart", root, alts, [c.host(culprit)], [culprit],
                     evidence=f"The dumps show every rank in all_reduce except rank {culprit}, looping in the user's own "
                              f"poll_marker_file(); the operator cancels the job.", fault_step=fail)
    return run


def fr_trace_hang(job: Job, target: int) -> dict:
    rng, c = job.rng, job.cluster
    tr, fail = run_to_fault(job, target, 0.4, 0.85)
    missing = rng.randrange(c.ranks)
    seq = fail * 8 + 5
    job.tick(600)
    survivors = [r for r in range(c.ranks) if r != missing]
    for r in survivors[:3]:
        job.out(r, f"{job.glog('E', 'ProcessGroupNCCL.cpp:1590')} [PG ID 0 PG GUID 0(default_pg) Rank {r}] ProcessGroupNCCL "
                   f"preparing to dump debug info. Include stack trace: 1")
    watchdog_cascade(job, survivors, seq, 600000)
    teardown(job, [], survivors)
    job.raw("$ python -m torch.distributed.flight_recorder.fr_trace /shared/fr_dumps/ -p nccl_trace_rank_")
    job.raw(f"Not all ranks joining collective, sequence number: {seq}")
    job.raw("internal record id: 1184")
    job.raw("group info: 0:default_pg")
    job.raw("collective: nccl:all_reduce")
    job.raw(f"missing ranks: {{{missing}}}")
    job.raw("input sizes: [[262144000]]")
    job.raw("output sizes: [[262144000]]")
    job.raw(f"world size: {c.ranks}")
    job.raw("expected ranks: {}".format(set(range(c.ranks)) if c.ranks <= 16 else f"{{0, 1, 2, ..., {c.ranks - 1}}}"))
    job.raw("collective state: scheduled")
    return label("failed", "infrastructure", "hang", "cordon_and_restart", None, [], [c.host(missing)], [missing],
                 evidence=f"The flight-recorder analysis names rank {missing} as the only rank missing from collective "
                          f"{seq}; it printed nothing itself.", fault_step=fail)


# -- framework -------------------------------------------------------------------------------------------------------

def rank_exception(job: Job, target: int, frames, exc: str, category: str, ftype: str, action: str,
                   evidence: str, victims: str = "one", chained_alt: Callable[[Job, int], int] | None = None,
                   sig: int | None = None, fail_frac: tuple[float, float] = (0.3, 0.85)) -> dict:
    rng, c = job.rng, job.cluster
    tr, fail = setup_train(job, target, rng.uniform(*fail_frac))
    start(job, tr.total)
    train_loop(job, tr, fail)
    if victims == "one":
        hit = [rng.randrange(c.ranks)]
    elif victims == "zero":
        hit = [0]
    else:
        hit = list(range(c.ranks))
    root = 0
    alts: list[int] = []
    for r in hit:
        n = traceback(job, r, frames, exc)
        if chained_alt:
            alts.append(chained_alt(job, r))
        root = root or n
    survivors = [r for r in range(c.ranks) if r not in hit]
    if survivors:
        job.tick(600)
        watchdog_cascade(job, survivors, fail * 3 + 4, 600000)
    teardown(job, hit, survivors)
    culprit_ranks = hit if len(hit) == 1 else []
    culprit_hosts = [c.host(hit[0])] if len(hit) == 1 else []
    return label("failed", category, ftype, action, root, alts[:1], culprit_hosts, culprit_ranks,
                 evidence=evidence, fault_step=fail)


def cuda_oom(job: Job, target: int) -> dict:
    r = job.rng
    gpu = r.randint(0, 7)
    return rank_exception(job, target, user_frames() + [
        ("/workspace/train.py", 241, "train", "loss.backward()"),
        (f"{TORCH}/_tensor.py", 521, "backward", "torch.autograd.backward("),
        (f"{TORCH}/autograd/__init__.py", 289, "backward", "_engine_run_backward("),
        (f"{TORCH}/autograd/graph.py", 768, "_engine_run_backward", "return Variable._execution_engine.run_backward(  # Calls into the C++ engine to run the backward pass")],
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.91 GiB. GPU {gpu} has a total capacity of 79.11 GiB "
        f"of which 2.06 GiB is free. Including non-PyTorch memory, this process has 77.04 GiB memory in use. Of the allocated "
        f"memory 71.52 GiB is allocated by PyTorch, and 4.33 GiB is reserved by PyTorch but unallocated. If reserved but "
        f"unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  "
        f"See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
        "framework", "cuda_oom", "no_restart", "One rank runs out of GPU memory on a long batch; the others time out.")


def host_oom(job: Job, target: int) -> dict:
    rng, c = job.rng, job.cluster
    tr, fail = run_to_fault(job, target, 0.3, 0.85)
    victim = rng.randrange(c.ranks)
    host = c.host(victim)
    job.tick(rng.uniform(1, 30))
    job.syslog(host, "python3 invoked oom-killer: gfp_mask=0x140dca(GFP_HIGHUSER_MOVABLE|__GFP_COMP|__GFP_ZERO), order=0, oom_score_adj=0")
    root = job.syslog(host, f"Out of memory: Killed process {job.pids[victim]} (python3) total-vm:312471228kB, "
                            f"anon-rss:189234112kB, file-rss:102400kB, shmem-rss:8192kB, UID:1001 pgtables:412312kB oom_score_adj:0")
    job.tick(600)
    survivors = [r for r in range(c.ranks) if r != victim]
    watchdog_cascade(job, survivors[: len(survivors) // 2 + 1], fail * 3, 600000)
    teardown(job, [victim], survivors[: len(survivors) // 2 + 1], code=-9, sig=9)
    return label("failed", "framework", "host_oom", "no_restart", root, [], [host], [victim],
                 evidence=f"The kernel OOM killer kills rank {victim} on {host} (host memory); the others time out.",
                 fault_step=fail)


def dataloader_killed(job: Job, target: int) -> dict:
    rng, c = job.rng, job.cluster
    tr, fail = run_to_fault(job, target, 0.2, 0.7)
    victim = rng.randrange(c.ranks)
    alt = job.out(victim, "ERROR: Unexpected bus error encountered in worker. This might be caused by insufficient shared memory (shm).")
    root = traceback(job, victim, user_frames() + [
        ("/workspace/train.py", 201, "train", "for step, batch in enumerate(train_loader, start=start_step):"),
        (f"{TORCH}/utils/data/dataloader.py", 631, "__next__", "data = self._next_data()"),
        (f"{TORCH}/utils/data/dataloader.py", 1329, "_next_data", "idx, data = self._get_data()"),
        (f"{TORCH}/utils/data/dataloader.py", 1285, "_get_data", "success, data = self._try_get_data()"),
        (f"{TORCH}/utils/data/dataloader.py", 1146, "_try_get_data", "raise RuntimeError(f'DataLoader worker (pid(s) {pids_str}) exited unexpectedly') from e")],
        f"RuntimeError: DataLoader worker (pid {rng.randint(2000, 90000)}) is killed by signal: Bus error. It is possible that "
        f"dataloader's workers are out of shared memory. Please try to raise your shared memory limit.")
    job.tick(600)
    survivors = [r for r in range(c.ranks) if r != victim]
    watchdog_cascade(job, survivors, fail * 3 + 1, 600000)
    teardown(job, [victim], survivors)
    return label("failed", "framework", "dataloader_killed", "no_restart", root, [alt], [c.host(victim)], [victim],
                 evidence="A DataLoader worker dies of SIGBUS (/dev/shm too small); its rank raises, the others time out.",
                 fault_step=fail)


def divergence(job: Job, target: int) -> dict:
    """The loss spikes at diverge_at and never recovers; NaN later. The job is cancelled by its owner."""
    rng, c = job.rng, job.cluster
    tr, _ = setup_train(job, target, None, divergence=True)
    start(job, tr.total)
    stop = min(tr.total, tr.curve.nan_at + tr.log_every * rng.randint(10, 40))
    first_spike = {"line": 0, "nan": 0}
    # run, remembering the first logged line at/after the divergence step and the first NaN line
    for step in range(1, stop + 1):
        job.tick(tr.step_time)
        if step % tr.log_every == 0 or step == 1:
            n = progress(job, tr, step)
            if tr.curve.diverge_at is not None and step >= tr.curve.diverge_at and not first_spike["line"]:
                first_spike["line"] = n
            if tr.curve.is_nan(step) and not first_spike["nan"]:
                first_spike["nan"] = n
        if step % tr.eval_every == 0:
            evaluate(job, tr, step)
        if step % tr.ckpt_every == 0:
            checkpoint(job, tr, step)
    job.tick(rng.uniform(600, 3600))
    if job.framework == "hf":
        for r in range(c.ranks):
            job.out(r, f"{{'train_runtime': {stop * tr.step_time:.4f}, 'train_samples_per_second': 3.663, "
                       f"'train_steps_per_second': 0.007, 'train_loss': nan, 'epoch': {stop / tr.total * 3:.2f}}}")
    else:
        job.raw(f"slurmstepd: error: *** JOB {job.slurm_id} ON {c.hosts[0]} CANCELLED AT {job.t:%Y-%m-%dT%H:%M:%S} ***")
    return label("failed", "framework", "nan_loss", "no_restart", first_spike["line"], [first_spike["nan"]], [], [],
                 evidence=f"Loss jumps at step {tr.curve.diverge_at} and never comes back; NaN from step {tr.curve.nan_at}.",
                 fault_step=tr.curve.diverge_at)


def checkpoint_error(job: Job, target: int) -> dict:
    """A resumed run: the previous attempt's output, then the restart fails to load the truncated checkpoint."""
    rng, c = job.rng, job.cluster
    tr, fail = run_to_fault(job, target, 0.5, 0.9)
    job.tick(60)
    job.raw(f"slurmstepd: error: *** JOB {job.slurm_id} ON {c.hosts[0]} CANCELLED AT {job.t:%Y-%m-%dT%H:%M:%S} DUE TO PREEMPTION ***")
    job.tick(900)
    job.raw("+ echo 'requeued: attempt 2'")
    preamble(job, extra_warnings=False)
    last = fail // tr.ckpt_every * tr.ckpt_every + tr.ckpt_every
    r = progress_rank(job)
    root = 0
    for rr in range(c.ranks):
        if rr == r or rng.random() < 0.5:
            job.out(rr, f" loading checkpoint from {tr.ckpt_dir} at iteration {last}")
            n = traceback(job, rr, [("/workspace/pretrain_gpt.py", 243, "<module>", "pretrain(train_valid_test_datasets_provider,"),
                                    ("/workspace/megatron/training/training.py", 281, "pretrain", "model, optimizer, opt_param_scheduler = setup_model_and_optimizer("),
                                    ("/workspace/megatron/training/training.py", 617, "setup_model_and_optimizer", "args.iteration, args.num_floating_point_operations_so_far = load_checkpoint("),
                                    ("/workspace/megatron/training/checkpointing.py", 1071, "load_checkpoint", "state_dict, checkpoint_name, release = _load_base_checkpoint(load_dir, rank0=False, **load_kwargs)"),
                                    ("/workspace/megatron/training/checkpointing.py", 842, "_load_base_checkpoint", "state_dict = torch.load(checkpoint_name, map_location='cpu')"),
                                    (f"{TORCH}/serialization.py", 1065, "load", "with _open_zipfile_reader(opened_file) as opened_zipfile:"),
                                    (f"{TORCH}/serialization.py", 468, "__init__", "super().__init__(torch._C.PyTorchFileReader(name_or_buffer))")],
                          "RuntimeError: PytorchStreamReader failed reading zip archive: failed finding central directory")
            root = root or n
    teardown(job, [r], [])
    return label("failed", "framework", "checkpoint_error", "no_restart", root, [], [], [],
                 evidence=f"The job is preempted during the save of iteration {last}; the requeued attempt cannot read "
                          f"the truncated checkpoint (no zip central directory).", fault_step=fail)


def startup_all_ranks(job: Job, target: int, frames, exc: str, category: str, ftype: str, action: str, evidence: str,
                      before: Callable[[Job, int], int | None] | None = None, code: int = 1,
                      with_nccl: bool = False) -> dict:
    """A failure at start-up on every rank (import, arguments, environment). Long because of 64-128 ranks."""
    rng, c = job.rng, job.cluster
    preamble(job)
    if with_nccl:
        nccl_init(job)
    order = list(range(c.ranks))
    rng.shuffle(order)
    root = 0
    alts: list[int] = []
    pad_each = max(0, (target - len(job.lines)) // c.ranks - len(frames) * 2 - 6)
    for r in order:
        job.tick(rng.uniform(0.01, 0.2))
        for _ in range(min(pad_each, 12)):
            job.out(r, f"{PY}/transformers/utils/generic.py:441: FutureWarning: `torch.utils._pytree._register_pytree_node` "
                       "is deprecated. Please use `torch.utils._pytree.register_pytree_node` instead.")
            job.out(r, "  _torch_pytree._register_pytree_node(")
        if before:
            a = before(job, r)
            if a:
                alts.append(a)
        n = traceback(job, r, frames, exc)
        root = root or n
    teardown(job, order, [], code=code)
    return label("failed", category, ftype, action, root, alts[:1], [], [], evidence=evidence)


def version_mismatch(job: Job, target: int) -> dict:
    so = f"{PY}/flash_attn_2_cuda.cpython-310-x86_64-linux-gnu.so"
    return startup_all_ranks(job, target, [
        ("/workspace/train.py", 14, "<module>", "from model import GPT"),
        ("/workspace/model.py", 9, "<module>", "from flash_attn import flash_attn_func"),
        (f"{PY}/flash_attn/__init__.py", 3, "<module>", "from flash_attn.flash_attn_interface import ("),
        (f"{PY}/flash_attn/flash_attn_interface.py", 10, "<module>", "import flash_attn_2_cuda as flash_attn_cuda")],
        f"ImportError: {so}: undefined symbol: _ZN3c104cuda9SetDeviceEi",
        "framework", "version_mismatch", "no_restart",
        "flash-attn was built against another torch: its extension fails to load on every rank.")


def env_804(job: Job, target: int) -> dict:
    def warn(job_: Job, r: int) -> int:
        job_.out(r, f"{TORCH}/cuda/__init__.py:128: UserWarning: CUDA initialization: Unexpected error from cudaGetDeviceCount(). "
                    "Did you run some cuda functions before calling NumCudaDevices() that might have already set an error? "
                    "Error 804: forward compatibility was attempted on non supported HW (Triggered internally at "
                    "../c10/cuda/CUDAFunctions.cpp:108.)")
        return job_.out(r, "  return torch._C._cuda_getDeviceCount() > 0")
    return startup_all_ranks(job, target, [
        ("/workspace/train.py", 412, "<module>", "main()"),
        ("/workspace/train.py", 361, "main", "torch.cuda.set_device(local_rank)"),
        (f"{TORCH}/cuda/__init__.py", 399, "set_device", "torch._C._cuda_setDevice(device)"),
        (f"{TORCH}/cuda/__init__.py", 302, "_lazy_init", "torch._C._cuda_init()")],
        "RuntimeError: Unexpected error from cudaGetDeviceCount(). Did you run some cuda functions before calling "
        "NumCudaDevices() that might have already set an error? Error 804: forward compatibility was attempted on non supported HW",
        "framework", "environment_error", "no_restart",
        "The container's CUDA needs a newer driver than the nodes have (error 804): CUDA cannot start on any rank.",
        before=warn)


def config_error(job: Job, target: int) -> dict:
    c = job.cluster
    dp = c.ranks // 4
    return startup_all_ranks(job, target, [
        ("/workspace/pretrain_gpt.py", 243, "<module>", "pretrain(train_valid_test_datasets_provider,"),
        ("/workspace/megatron/training/training.py", 215, "pretrain", "initialize_megatron(extra_args_provider=extra_args_provider,"),
        ("/workspace/megatron/training/initialize.py", 73, "initialize_megatron", "set_global_variables(args)"),
        ("/workspace/megatron/training/global_vars.py", 93, "set_global_variables", "init_num_microbatches_calculator("),
        ("/workspace/megatron/core/num_microbatches_calculator.py", 134, "__init__", "assert (")],
        f"AssertionError: global batch size (1000) is not divisible by micro batch size (4) times data parallel size ({dp})",
        "framework", "config_error", "no_restart",
        "The global batch size does not divide by micro batch x data-parallel size for this world size.", with_nccl=True)


# -- script ------------------------------------------------------------------------------------------------------------

def key_error(job: Job, target: int) -> dict:
    return rank_exception(job, target, user_frames() + [
        ("/workspace/train.py", 201, "train", "for step, batch in enumerate(train_loader, start=start_step):"),
        (f"{TORCH}/utils/data/dataloader.py", 631, "__next__", "data = self._next_data()"),
        (f"{TORCH}/utils/data/dataloader.py", 675, "_next_data", "data = self._dataset_fetcher.fetch(index)  # may raise StopIteration"),
        (f"{TORCH}/utils/data/_utils/fetch.py", 54, "fetch", "return self.collate_fn(data)"),
        ("/workspace/data/collate.py", 37, "collate_packed", "labels = [ex[\"labels\"] for ex in examples]")],
        "KeyError: 'labels'", "script", "key_error", "no_restart",
        "A sample without 'labels' reaches the user's collate function on one rank; the others time out.")


def name_error(job: Job, target: int) -> dict:
    return rank_exception(job, target, user_frames() + [
        ("/workspace/train.py", 288, "train", "val_loss = evaluate(model, val_loader, step)"),
        ("/workspace/train.py", 151, "evaluate", "for batch in islice(val_loader, eval_iters):")],
        "NameError: name 'eval_iters' is not defined", "script", "name_error", "no_restart",
        "The first evaluation runs on rank 0 only and hits an undefined name in the user's evaluate(); the others time out.",
        victims="zero")


def attribute_error(job: Job, target: int) -> dict:
    return rank_exception(job, target, user_frames() + [
        ("/workspace/train.py", 305, "train", "log_metrics(step, loss, model_engine)"),
        ("/workspace/utils/logging.py", 48, "log_metrics", "\"lr\": engine.get_lr()[0], \"scale\": engine.optimizer.cur_scale.item(),")],
        "AttributeError: 'float' object has no attribute 'item'", "script", "attribute_error", "no_restart",
        "The user's metric logger calls .item() on a float on every rank at the first logging step.", victims="all",
        fail_frac=(0.05, 0.15))


def import_error(job: Job, target: int) -> dict:
    return startup_all_ranks(job, target, [
        ("/workspace/train.py", 22, "<module>", "from utils.tokenizer import build_tokenizer"),
        ("/workspace/utils/tokenizer.py", 4, "<module>", "import sentencepiece as spm")],
        "ModuleNotFoundError: No module named 'sentencepiece'", "script", "import_error", "no_restart",
        "The user's tokenizer module imports a package that the image does not have.")


def file_not_found(job: Job, target: int) -> dict:
    return startup_all_ranks(job, target, [
        ("/workspace/train.py", 412, "<module>", "main()"),
        ("/workspace/train.py", 366, "main", "cfg = load_config(args.config)"),
        ("/workspace/utils/config.py", 19, "load_config", "with open(path) as f:")],
        "FileNotFoundError: [Errno 2] No such file or directory: 'configs/llama3_8b_pretrain.yaml'",
        "script", "file_not_found", "no_restart", "The run points at a config file that is not in the image.",
        with_nccl=True)


def argument_error(job: Job, target: int) -> dict:
    rng, c = job.rng, job.cluster
    preamble(job)
    root = 0
    order = list(range(c.ranks))
    rng.shuffle(order)
    for r in order:
        for _ in range(3):
            job.out(r, f"{PY}/transformers/utils/generic.py:441: FutureWarning: `torch.utils._pytree._register_pytree_node` "
                       "is deprecated. Please use `torch.utils._pytree.register_pytree_node` instead.")
            job.out(r, "  _torch_pytree._register_pytree_node(")
        job.out(r, "usage: pretrain_gpt.py [-h] [--num-layers NUM_LAYERS] [--hidden-size HIDDEN_SIZE]")
        for opt in ["[--ffn-hidden-size FFN_HIDDEN_SIZE]", "[--num-attention-heads NUM_ATTENTION_HEADS]",
                    "[--seq-length SEQ_LENGTH] [--max-position-embeddings MAX_POSITION_EMBEDDINGS]",
                    "[--micro-batch-size MICRO_BATCH_SIZE] [--global-batch-size GLOBAL_BATCH_SIZE]",
                    "[--lr LR] [--min-lr MIN_LR] [--lr-decay-style {constant,linear,cosine}]",
                    "[--lr-warmup-iters LR_WARMUP_ITERS] [--lr-warmup-fraction LR_WARMUP_FRACTION]",
                    "[--train-iters TRAIN_ITERS] [--save SAVE] [--load LOAD] [--data-path [DATA_PATH ...]]",
                    "[--tensor-model-parallel-size TENSOR_MODEL_PARALLEL_SIZE]",
                    "[--pipeline-model-parallel-size PIPELINE_MODEL_PARALLEL_SIZE]", "..."]:
            job.out(r, f"                      {opt}")
        n = job.out(r, "pretrain_gpt.py: error: unrecognized arguments: --lr-warmup-ratio 0.01")
        root = root or n
    teardown(job, order, [], code=2)
    return label("failed", "script", "argument_error", "no_restart", root, [], [], [],
                 evidence="The launch script passes an option the program does not have; argparse exits with 2 on every rank.")


# ----------------------------------------------------------------------------------------------------------------
# the job list
# ----------------------------------------------------------------------------------------------------------------

def specs(rng: random.Random) -> list[Spec]:
    def n() -> int:
        return rng.randint(2600, 9200)
    s = [
        Spec("xid79", 64, "srun", "megatron", n(), xid(79)),
        Spec("xid48", 32, "pdsh", "deepspeed", n(), xid(48)),
        Spec("xid74", 16, "rank", "titan", n(), xid(74)),
        Spec("xid94", 64, "default", "hf", n(), xid(94)),
        Spec("ib_error", 128, "rank", "megatron", n(), ib_error),
        Spec("nccl_system_error", 32, "srun", "lightning", n(), nccl_system_error),
        Spec("node_failure", 64, "srun", "megatron", n(), node_failure),
        Spec("lustre_eviction", 32, "rank", "megatron", n(), lustre_eviction),
        Spec("nfs_stale", 16, "rank", "hf", n(), nfs_stale),
        Spec("disk_full", 16, "pdsh", "deepspeed", n(), disk_full),
        Spec("time_limit", 32, "srun", "titan", n(), time_limit),
        Spec("silent_hang_watchdog", 16, "rank", "titan", n(), silent_hang_watchdog),
        Spec("silent_hang_no_watchdog", 8, "srun", "plain", n(), silent_hang_no_watchdog),
        Spec("stack_hang_framework", 32, "rank", "megatron", n(), stack_hang("framework")),
        Spec("stack_hang_script", 16, "srun", "plain", n(), stack_hang("script")),
        Spec("fr_trace_hang", 64, "rank", "titan", n(), fr_trace_hang),
        Spec("cuda_oom", 32, "rank", "megatron", n(), cuda_oom),
        Spec("host_oom", 16, "srun", "hf", n(), host_oom),
        Spec("dataloader_killed", 8, "rank", "lightning", n(), dataloader_killed),
        Spec("divergence_megatron", 64, "default", "megatron", n(), divergence),
        Spec("divergence_titan", 16, "rank", "titan", n(), divergence),
        Spec("divergence_hf", 8, "rank", "hf", n(), divergence),
        Spec("checkpoint_error", 32, "srun", "megatron", n(), checkpoint_error),
        Spec("version_mismatch", 128, "pdsh", "deepspeed", n(), version_mismatch),
        Spec("env_804", 128, "rank", "hf", n(), env_804),
        Spec("config_error", 128, "rank", "megatron", n(), config_error),
        Spec("key_error", 32, "rank", "plain", n(), key_error),
        Spec("name_error", 16, "srun", "lightning", n(), name_error),
        Spec("attribute_error", 8, "pdsh", "deepspeed", n(), attribute_error),
        Spec("import_error", 128, "rank", "titan", n(), import_error),
        Spec("file_not_found", 128, "srun", "hf", n(), file_not_found),
        Spec("argument_error", 128, "rank", "megatron", n(), argument_error),
        Spec("healthy_megatron", 64, "rank", "megatron", n(), healthy),
        Spec("healthy_deepspeed", 32, "pdsh", "deepspeed", n(), healthy),
        Spec("healthy_hf", 16, "srun", "hf", n(), healthy),
        Spec("healthy_lightning", 8, "rank", "lightning", n(), healthy),
        Spec("healthy_titan", 32, "rank", "titan", n(), healthy),
        Spec("healthy_plain", 16, "srun", "plain", n(), healthy),
    ]
    return s


def build(spec: Spec, jid: str, seed: int) -> tuple[list[str], dict]:
    rng = random.Random(f"{seed}:{jid}:{spec.scenario}")
    cluster = make_cluster(rng, spec.ranks)
    t0 = datetime(2024, rng.randint(1, 12), rng.randint(1, 28), rng.randint(0, 23), rng.randint(0, 59), rng.randint(0, 59))
    job = Job(jid, rng, cluster, spec.launcher, spec.framework, t0, torch_new=rng.random() < 0.8)
    lab = spec.fn(job, spec.lines)
    return job.lines, lab


def finish_label(jid: str, spec: Spec, job_lines: list[str], lab: dict, seed: int) -> dict:
    root = lab.pop("root")
    alts = lab.pop("alts")
    hosts, ranks = lab["culprit_hosts"], lab["culprit_ranks"]
    culprit = None
    if hosts or ranks:
        parts = []
        if hosts:
            parts.append(", ".join(hosts))
        if ranks:
            parts.append("rank " + ", ".join(map(str, ranks)))
        culprit = " ".join(parts)
    return {
        "id": jid,
        "source": f"generated: eval/heldout/longjobs/generate.py --seed {seed} (scenario {spec.scenario})",
        "status": lab["status"], "category": lab["category"], "failure_type": lab["failure_type"],
        "action": lab["action"], "culprit": culprit, "culprit_hosts": hosts, "culprit_ranks": ranks,
        "root_line": job_lines[root - 1] if root else None, "root_line_no": root or None,
        "root_line_alt": [job_lines[a - 1] for a in alts if a],
        "evidence": lab["evidence"],
        "scenario": spec.scenario, "ranks": spec.ranks, "launcher": spec.launcher, "framework": spec.framework,
        "lines": len(job_lines), "fault_step": lab.get("fault_step"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--seed", type=int, default=19)
    args = ap.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    labels = []
    for i, spec in enumerate(specs(rng), 1):
        jid = f"{i:03d}"
        lines, lab = build(spec, jid, args.seed)
        (args.out_dir / f"{jid}.log").write_text("\n".join(lines) + "\n", encoding="utf-8")
        labels.append(finish_label(jid, spec, lines, lab, args.seed))
    with (args.out_dir / "labels.jsonl").open("w", encoding="utf-8") as f:
        for rec in labels:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    print(f"{len(labels)} jobs written to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
