"""Whole jobs that end in NCCL watchdog timeouts, one cause class each (issue 31): what makes the ranks wait.

    from logdx.synth.timeouts import timeout_job, timeout_set
    truth = timeout_job(out, seed=1, flavour="plain", style="torchrun", ranks=32, lines=6000,
                        cause="cpu_side", variant="evaluation")

Each job starts like any long job (``longjob.start_job``: launchers, store retries, downloads, warnings, NCCL
INFO init, training with checkpoints), then the ranks stop in collective ``S`` of the default process group
for one cause, and the NCCL watchdogs give up after ``nccl_timeout_ms``. The strings are torch's and NCCL's:

- ProcessGroupNCCL's watchdog (``[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=S,
  OpType=ALLREDUCE, NumelIn=N, NumelOut=N, Timeout(ms)=600000) ran for 600013 milliseconds before timing
  out.``; torch 2.4+ with ``[PG ID 0 PG GUID 0(default_pg) Rank 3]`` and ``Exception (either an error or
  timeout) detected by watchdog at work: S, last enqueued NCCL work: S, last completed NCCL work: S-1.``);
- the desync report of TORCH_NCCL_DESYNC_DEBUG=1 (TraceUtils.h ``retrieveDesyncReport``: ``[c] joined but
  didn't finish collective #S (count from 1)``, ``[c] finished collective #S-1, but didn't join collective
  #S (count from 1)``), on some jobs;
- ProcessGroupWrapper's fingerprint check (TORCH_DISTRIBUTED_DEBUG=DETAIL): ``RuntimeError: Detected mismatch
  between collectives on ranks. Rank r is running collective: CollectiveFingerPrint(SequenceNumber=S,
  OpType=ALLREDUCE, TensorShape=[...], ...), but Rank c is running collective: ...``;
- NCCL's IB transport (``transport/net_ib.cc ... NCCL WARN NET/IB : Got completion from peer ... status=12``,
  ``NET/IB : mlx5_0:1 Got async event : port error``) and the kernel's mlx5 driver (``mlx5_core 0000:5e:00.0
  ib0: Link down``) on the culprit's host.

Classes and variants (``cause``, ``variant``):

- ``cpu_side``: rank ``c`` goes on with its own work while the others wait in ``S``: ``evaluation`` (an
  evaluation loop only that rank runs, tqdm's bar), ``caught_error`` (a data error it catches and retries on
  its own batch), ``recompile`` (torch.compile recompiling for a new shape on that rank, TORCH_LOGS=recompiles).
  Its lines go on past the others' watchdogs. Label: script / script_hang / no_restart.
- ``misconfig``: at the same SeqNum the ranks call different collectives: ``sizes`` (the culprit's NumelIn
  differs: an uneven shard), ``op`` (the culprit all-gathers where the others reduce-scatter), ``wrapper``
  (TORCH_DISTRIBUTED_DEBUG=DETAIL: every rank's check raises, naming the culprit's shape). Label: script /
  script_hang / no_restart.
- ``gpu_hang``: the culprit's GPU never completes ``S``: its own watchdog times out on ``S`` (enqueued, never
  completed) while the others completed it and time out on ``S+1``; ``lower`` alone, or ``desync`` with the
  report. Label: infrastructure / hang / restart (nothing names hardware to cordon).
- ``network``: a link of the culprit's host fails under the collective, every rank times out on ``S``:
  ``ib_completion``, ``port_error``, ``link_down``. Label: infrastructure / network_error / restart.

Only launcher styles whose prefixes carry the rank are used (a log without ranks cannot say who went on).
Truth (``JobTruth``): ``variant["timeout_class"]`` is the class; the culprit rank (its host for ``network``,
where a kernel line names the host, not the rank); root lines: the first watchdog line of the job and the
lines that show the cause (the culprit's first own line after the others stopped, its watchdog, the
mismatch, the network line).
"""

from __future__ import annotations

from random import Random
from typing import TextIO

from logdx.model import FT, Action, Category
from logdx.synth.cascade import Fate, end_job, watchdog_abort
from logdx.synth.hangs import step_tracking
from logdx.synth.job import Job
from logdx.synth.longjob import GeneratedCase, JobTruth, start_job, startup_lines, train_to
from logdx.synth.sink import Burst, Proc

CLASSES = ("cpu_side", "misconfig", "gpu_hang", "network")
VARIANTS = {
    "cpu_side": ("evaluation", "caught_error", "recompile"),
    "misconfig": ("sizes", "op", "wrapper"),
    "gpu_hang": ("lower", "desync"),
    "network": ("ib_completion", "port_error", "link_down"),
}
LABELS = {
    "cpu_side": (Category.SCRIPT, FT.SCRIPT_HANG, Action.NO_RESTART),
    "misconfig": (Category.SCRIPT, FT.SCRIPT_HANG, Action.NO_RESTART),
    "gpu_hang": (Category.INFRASTRUCTURE, FT.HANG, Action.RESTART),
    "network": (Category.INFRASTRUCTURE, FT.NETWORK_ERROR, Action.RESTART),
}
RANK_STYLES = ("torchrun", "srun", "srun_torchrun", "pdsh_torchrun", "torchrun_tee", "mpirun")
# (op, NumelOut / NumelIn): what ProcessGroupNCCL names the collectives FSDP and DDP issue.
_OPS = (("ALLREDUCE", 1.0), ("_REDUCE_SCATTER_BASE", -1.0), ("_ALLGATHER_BASE", 0.0), ("BROADCAST", 1.0))
_WATCHDOG_FRAMES = [
    ("c10::Error::Error(c10::SourceLocation, std::string) + 0x96", "libc10.so"),
    ("c10d::ProcessGroupNCCL::WorkNCCL::checkTimeout(std::optional<std::chrono::duration<long, std::ratio<1l, "
     "1000l> > >) + 0x1d2", "libtorch_cuda.so"),
    ("c10d::ProcessGroupNCCL::watchdogHandler() + 0x233", "libtorch_cuda.so"),
    ("c10d::ProcessGroupNCCL::ncclCommWatchdog() + 0x14d", "libtorch_cuda.so"),
    ("<unknown function> + 0xdc253", "/lib/x86_64-linux-gnu/libstdc++.so.6"),
    ("<unknown function> + 0x94ac3", "/lib/x86_64-linux-gnu/libc.so.6"),
]


class _Work:
    """One collective as a rank's watchdog names it."""

    __slots__ = ("nin", "nout", "op", "seq")

    def __init__(self, seq: int, op: str, nin: int, nout: int) -> None:
        self.seq, self.op, self.nin, self.nout = seq, op, nin, nout

    def text(self, timeout_ms: int, ran_ms: int) -> str:
        return (f"WorkNCCL(SeqNum={self.seq}, OpType={self.op}, NumelIn={self.nin}, NumelOut={self.nout}, "
                f"Timeout(ms)={timeout_ms}) ran for {ran_ms} milliseconds before timing out.")


def _collective(rng: Random, seq: int, world: int) -> _Work:
    op, ratio = rng.choice(_OPS)
    nin = rng.choice((1 << 20, 4 << 20, 16 << 20, 25 << 20, 50 << 20))
    if ratio == 0.0:  # all-gather: each rank gives its shard, gets everyone's
        nin, nout = nin // world, (nin // world) * world
    elif ratio < 0:  # reduce-scatter: the whole in, its shard out
        nin, nout = (nin // world) * world, nin // world
    else:
        nout = nin
    return _Work(seq, op, nin, nout)


def _pg(job: Job, rank: int) -> str:
    return f"[PG ID 0 PG GUID 0(default_pg) Rank {rank}]" if job.new_torch else f"[Rank {rank}]"


def _watchdog(job: Job, p: Proc, rank: int, work: _Work, ran_ms: int, *, completed: int | None = None,
              enqueued: int | None = None) -> None:
    """``rank``'s watchdog gives up on ``work`` and takes the process down (ProcessGroupNCCL's lines)."""
    pg = _pg(job, rank)
    caught = f"{pg} Watchdog caught collective operation timeout: {work.text(job.nccl_timeout_ms, ran_ms)}"
    p.say(job.c10("E", p.t, "ProcessGroupNCCL.cpp:632") + caught)
    done = work.seq - 1 if completed is None else completed
    enq = work.seq if enqueued is None else enqueued
    if job.new_torch:
        p.say(job.c10("E", p.tick(), "ProcessGroupNCCL.cpp:1664") + f"{pg} Exception (either an error or timeout) "
              f"detected by watchdog at work: {work.seq}, last enqueued NCCL work: {enq}, last completed NCCL work: "
              f"{done}.")
    p.say(job.c10("E", p.tick(), "ProcessGroupNCCL.cpp:577") + f"{pg} Some NCCL operations have failed or timed out. "
          "Due to the asynchronous nature of CUDA kernels, subsequent GPU operations might run on "
          "corrupted/incomplete data.")
    p.say(job.c10("E", p.tick(), "ProcessGroupNCCL.cpp:583") + f"{pg} To avoid data inconsistency, we are taking the "
          "entire process down.")
    watchdog_abort(job, p, pg, [caught], "checkTimeout at /opt/pytorch/pytorch/torch/csrc/distributed/c10d/"
                   "ProcessGroupNCCL.cpp:635", _WATCHDOG_FRAMES)


def _say(p: Proc, text: str, tag: object = None, gap: float = 0.0005) -> None:
    """``Proc.say`` with a tag: ``Burst.drain`` reports where the line landed (a root line)."""
    p.tick(gap)
    p.burst.add(p.t, p.prefix + text, tag=tag)


def _desync(p: Proc, rank: int, work: _Work, lines: list[str]) -> None:
    """TORCH_NCCL_DESYNC_DEBUG=1: the timed-out rank asks the store who is behind (retrieveDesyncReport)."""
    p.say(f"[Rank {rank}] Timeout at collective: {work.op}, #{work.seq}")
    p.say("\t - To our best knowledge, the lagging/dead/mismatched ranks that caused the desync are:")
    for line in lines:
        p.say(line)


# -- what the culprit does while the others wait ------------------------------------------------------


def _own_work(job: Job, variant: str, c: int, i: int, t: float, t0: float) -> list[str]:
    rng = job.rng
    match variant:
        case "evaluation":
            total = 400
            done = min(total - 1, 3 * i + rng.randrange(3))
            pct = 100 * done // total
            bar = "█" * (pct // 10) + " " * (10 - pct // 10)
            el = int(t - t0)
            return [f"Evaluating:  {pct:2d}%|{bar}| {done}/{total} [{el // 60:02d}:{el % 60:02d}<"
                    f"{(total - done) // 2 // 60:02d}:{(total - done) // 2 % 60:02d},  {1.8 + rng.random() * 0.4:.2f}s/it]"]
        case "caught_error":  # the user's loop skips the batch it could not use and draws others, on its own
            return [f"{job.clock.py(t)} - WARNING - train.py:301 - rank {c}: batch {i} of shard-{700 + c:05d} "
                    f"is too long too ({8192 + rng.randrange(64, 4096)} tokens > max_seq_len 8192): skipping it, "
                    f"drawing another ({i + 1} skipped)"]
        case "recompile":
            stamp = job.clock.glog(t)
            pid = job.cluster.worker_pids[c]
            frame = f"[0/{i % 8 + 1}]"
            return [f"V{stamp} {pid} torch/_dynamo/guards.py:2791] {frame} [__recompiles] Recompiling function forward "
                    "in /workspace/model/transformer.py:211",
                    f"V{stamp} {pid} torch/_dynamo/guards.py:2791] {frame} [__recompiles]     triggered by the "
                    "following guard failure(s):",
                    f"V{stamp} {pid} torch/_dynamo/guards.py:2791] {frame} [__recompiles]     - {frame[1:-1]}: "
                    f"tensor 'L['x']' size mismatch at index 1. expected 4096, actual {4096 + 64 * (i % 9 + 1)}"]
    raise ValueError(f"unknown cpu_side variant {variant!r}")


def _cpu_side(job: Job, burst: Burst, c: int, variant: str, work: _Work, t_stuck: float, fates: dict[int, Fate],
              desync: bool) -> None:
    timeout_s = job.nccl_timeout_ms / 1000.0
    fire = t_stuck + timeout_s
    t = t_start = t_stuck + job.rng.uniform(0.5, 3.0)
    p = job.rank_proc(burst, c, t)
    i = 0
    if variant == "caught_error":  # what its loop caught and went on from, once
        p.say(f"{job.clock.py(t)} - WARNING - train.py:296 - rank {c}: batch of shard-{700 + c:05d} is longer than "
              "max_seq_len (8192 tokens): skipping it and drawing another")
    end = fire + job.rng.uniform(15.0, 45.0)  # it is still at it when the others' watchdogs fire
    while t < end:
        for k, text in enumerate(_own_work(job, variant, c, i, t, t_start)):
            _say(p, text, ("own", c) if i == 0 and k == 0 else None)
        i += 1
        t = p.t + job.rng.uniform(12.0, 25.0)
        p.t = t
    for r in range(job.cluster.world_size):
        if r == c:
            continue
        q = job.rank_proc(burst, r, fire + 0.1 * job.rng.random())
        _watchdog(job, q, r, work, int((q.t - t_stuck) * 1000))
        if desync and r == (1 if c == 0 else 0):
            _desync(q, r, work, [f"\t     [{c}] finished collective #{work.seq - 1}, but didn't join collective "
                                 f"#{work.seq} (count from 1)"])
        fates[r] = Fate(q.tick(0.01), -6)


def _misconfig(job: Job, burst: Burst, c: int, variant: str, work: _Work, t_stuck: float,
               fates: dict[int, Fate]) -> None:
    rng, world = job.rng, job.cluster.world_size
    if variant == "wrapper":  # every rank's fingerprint check raises before the collective runs
        shape = f"[{work.nin // 1024}, 1024]"
        odd = f"[{work.nin // 1024 - 8 * (1 + rng.randrange(4))}, 1024]"
        for r in range(world):
            other = c if r != c else (c + 1) % world
            p = job.rank_proc(burst, r, t_stuck + 0.05 + 0.02 * rng.random())
            mine, theirs = (odd, shape) if r == c else (shape, odd)
            fp = ("CollectiveFingerPrint(SequenceNumber={seq}, OpType=ALLREDUCE, TensorShape={shape}, TensorDtypes="
                  "Float, TensorDeviceTypes=TensorOptions(dtype=float (default), device=cuda, layout=strided "
                  "(default), requires_grad=false (default), pinned_memory=false (default), memory_format=(nullopt)))")
            for line in ("Traceback (most recent call last):",
                         f'  File "{job.flavour.entry}", line 412, in <module>', "    main()",
                         f'  File "{job.flavour.entry}", line 388, in train_step',
                         "    dist.all_reduce(grads, group=dp_group)",
                         f'  File "{job.lib}/torch/distributed/c10d_logger.py", line 83, in wrapper',
                         "    return func(*args, **kwargs)",
                         f'  File "{job.lib}/torch/distributed/distributed_c10d.py", line 2501, in all_reduce',
                         "    work = group.allreduce([tensor], opts)"):
                p.say(line, 0.001)
            p.say(f"RuntimeError: Detected mismatch between collectives on ranks. Rank {r} is running collective: "
                  f"{fp.format(seq=work.seq, shape=mine)}, but Rank {other} is running collective: "
                  f"{fp.format(seq=work.seq, shape=theirs)}.Collectives differ in the following aspects: "
                  f"\t Tensor Tensor shapes: {mine}vs {theirs}", 0.001)
            fates[r] = Fate(p.tick(0.5), 1)
        return
    fire = t_stuck + job.nccl_timeout_ms / 1000.0
    for r in range(world):
        w = work
        if r == c and variant == "sizes":
            delta = 4096 * (1 + rng.randrange(8))
            w = _Work(work.seq, work.op, work.nin - delta, work.nout - delta * (work.nout // max(1, work.nin)))
        elif r == c:
            w = _Work(work.seq, "_ALLGATHER_BASE" if work.op != "_ALLGATHER_BASE" else "_REDUCE_SCATTER_BASE",
                      work.nin, work.nout)
        p = job.rank_proc(burst, r, fire + 0.1 * rng.random())
        _watchdog(job, p, r, w, int((p.t - t_stuck) * 1000))
        fates[r] = Fate(p.tick(0.01), -6)


def _gpu_hang(job: Job, burst: Burst, c: int, variant: str, work: _Work, t_stuck: float,
              fates: dict[int, Fate]) -> None:
    rng = job.rng
    timeout_s = job.nccl_timeout_ms / 1000.0
    t_own = t_stuck - rng.uniform(0.5, 3.0)  # its GPU stopped inside S; the others finished S and entered S+1
    p = job.rank_proc(burst, c, t_own + timeout_s + 0.1 * rng.random())
    _watchdog(job, p, c, work, int((p.t - t_own) * 1000))
    if variant == "desync":
        _desync(p, c, work, [f"\t   - [{c}] joined but didn't finish collective #{work.seq} (count from 1)"])
    fates[c] = Fate(p.tick(0.01), -6)
    nxt = _Work(work.seq + 1, work.op, work.nin, work.nout)
    for r in range(job.cluster.world_size):
        if r == c or (job.style.launcher != "srun" and job.cluster.host_index(r) == job.cluster.host_index(c)):
            continue  # a per-node launcher kills the culprit's local peers as soon as it dies
        q = job.rank_proc(burst, r, t_stuck + timeout_s + 0.1 * rng.random())
        if q.t <= fates[c].t:
            continue
        if job.style.launcher == "mpirun":
            break  # mpirun takes every process down with the first
        _watchdog(job, q, r, nxt, int((q.t - t_stuck) * 1000))
        fates[r] = Fate(q.tick(0.01), -6)


def _network(job: Job, burst: Burst, c: int, variant: str, work: _Work, t_stuck: float,
             fates: dict[int, Fate]) -> None:
    rng, cl = job.rng, job.cluster
    h = cl.host_index(c)
    t0 = t_stuck + rng.uniform(0.5, 5.0)
    head = f"{cl.host(c)}:{cl.worker_pids[c]}:{job.nccl_tids[c] + rng.randrange(40, 900)} [{cl.local_rank(c)}]"
    hca = f"mlx5_{cl.local_rank(c) % 4}"
    p = job.rank_proc(burst, c, t0)
    if variant == "ib_completion":
        peer_h = (h + 1) % cl.n_hosts
        _say(p, f"{head} transport/net_ib.cc:1696 NCCL WARN NET/IB : Got completion from peer {cl.ips[peer_h]}<"
                f"{rng.randrange(32768, 61000)}> with status=12 opcode=0 len=0 vendor err 129 (Recv) localGid "
                f"::ffff:{cl.ips[h]} remoteGids::ffff:{cl.ips[peer_h]} hca {hca}", ("net", c))
        p.say(f"{head} NCCL INFO transport/net.cc:1302 -> 6")
        p.say(f"{head} NCCL INFO proxy.cc:698 -> 6")
    elif variant == "port_error":
        _say(p, f"{head} transport/net_ib.cc:101 NCCL WARN NET/IB : {hca}:1 Got async event : port error", ("net", c))
    else:
        k = job.kernel_proc(burst, h, t0)
        bus = f"0000:{rng.choice(('1a', '3c', '5e', '9b'))}:00.0"
        _say(k, job.kernel(h, k.t, f"mlx5_core {bus} ib{cl.local_rank(c) % 4}: Link down"), ("net", c))
        k.say(job.kernel(h, k.t + 0.2, f"mlx5_core {bus}: Port module event: module 0, Cable unplugged"), 0.2)
    fire = t_stuck + job.nccl_timeout_ms / 1000.0
    for r in range(cl.world_size):
        q = job.rank_proc(burst, r, fire + 0.1 * rng.random())
        _watchdog(job, q, r, work, int((q.t - t_stuck) * 1000))
        fates[r] = Fate(q.tick(0.01), -6)


# -- one job ------------------------------------------------------------------------------------------


def timeout_job(out: TextIO, *, seed: int, flavour: str, style: str, ranks: int, lines: int, cause: str,
                variant: str, desync: bool = False, gpus_per_host: int = 8,
                without: frozenset[str] = frozenset()) -> JobTruth:
    """One job that ends in collective timeouts of class ``cause`` (see the module docstring)."""
    if cause not in VARIANTS:
        raise ValueError(f"unknown cause {cause!r}; choose from {', '.join(VARIANTS)}")
    if variant not in VARIANTS[cause]:
        raise ValueError(f"unknown {cause} variant {variant!r}; choose from {', '.join(VARIANTS[cause])}")
    job, realism = start_job(out, name=f"timeout-{cause}", seed=seed, ranks=ranks, lines=lines, style=style,
                             flavour=flavour, gpus_per_host=gpus_per_host, nccl_debug=True, exclude=without)
    tail = 40 * ranks + 40 * job.cluster.n_hosts
    train_to(job, max(job.sink.count + 10 * (ranks + 2), lines - tail))
    rng, cl = job.rng, job.cluster
    culprit = rng.randrange(cl.world_size)
    if variant == "evaluation" and rng.random() < 0.75:
        culprit = 0  # the classic: `if rank == 0: evaluate()` while the others go on into the next collective
    job.sink.record()
    step_tracking(job)  # the last step every rank finished
    work = _collective(rng, job.seq + 1, cl.world_size)
    t_stuck = job.now + rng.uniform(0.2, 2.0)
    burst = job.burst()
    fates: dict[int, Fate] = {}
    tags: dict[object, int] = {}
    match cause:
        case "cpu_side":
            _cpu_side(job, burst, culprit, variant, work, t_stuck, fates, desync)
        case "misconfig":
            _misconfig(job, burst, culprit, variant, work, t_stuck, fates)
        case "gpu_hang":
            _gpu_hang(job, burst, culprit, variant, work, t_stuck, fates)
        case "network":
            _network(job, burst, culprit, variant, work, t_stuck, fates)
    end_job(job, burst, fates)
    job.now = burst.drain(job.sink, tags)
    job.sink.flush()
    rec, first = job.sink.recorded or [], job.sink.recorded_from
    watchdogs = [first + i for i, line in enumerate(rec) if "Watchdog caught collective operation timeout" in line]
    says = (f"Rank {culprit}] Watchdog caught", f"Rank {culprit} is running collective",
            f"[{culprit}] joined but didn't finish", f"[{culprit}] finished collective")
    mine = [next(first + i for i, line in enumerate(rec) if s in line) for s in says if any(s in line for line in rec)]
    root_nos = sorted(set(watchdogs[:1] + mine + list(tags.values())))
    label = LABELS[cause]
    host = cl.host(culprit)
    return JobTruth(
        kind=f"timeout_{cause}", status="failed", category=label[0], failure_type=label[1], action=label[2],
        exit_code=1, root_line_nos=root_nos, root_line=rec[root_nos[0] - first] if root_nos else None,
        culprit_ranks=[] if cause == "network" else [culprit], culprit_hosts=[host] if cause == "network" else [],
        last_step=job.iteration, lines_written=job.sink.count, seed=seed, style=job.style.name,
        flavour=job.flavour.name, ranks=cl.world_size, hosts=list(cl.hosts), families=sorted(realism.families),
        variant={"timeout_class": cause, "variant": variant, "desync": desync, "seq": work.seq, "op": work.op,
                 "culprit": culprit, "culprit_host": host})


# -- the set ------------------------------------------------------------------------------------------


def timeout_set(per_class: int = 8, seed: int = 0) -> list[GeneratedCase]:
    """``per_class`` jobs of each class, every variant in turn, every framework, the launcher styles that carry
    the rank, 8-64 ranks, 2,000-12,000 lines; deterministic in ``seed``."""
    from logdx.synth.healthy import FRAMEWORKS

    rng = Random(f"logdx-timeout-set:{seed}")
    out: list[GeneratedCase] = []
    for cause in CLASSES:
        for i in range(per_class):
            flavour = FRAMEWORKS[(i * 3 + len(cause)) % len(FRAMEWORKS)]
            style = RANK_STYLES[(i + len(cause)) % len(RANK_STYLES)]
            ranks = (8, 16, 32, 64)[rng.randrange(4)]
            lines = max(rng.randrange(2000, 12001), startup_lines(ranks) + 60 * (ranks + 2))
            variant = VARIANTS[cause][i % len(VARIANTS[cause])]
            kw = {"seed": rng.randrange(1 << 30), "flavour": flavour, "style": style, "ranks": ranks, "lines": lines,
                  "cause": cause, "variant": variant, "desync": cause == "cpu_side" and i % 2 == 1}
            out.append(GeneratedCase(f"timeout-{cause}-{i:02d}-{variant}-{flavour}-{style}-{ranks}r", timeout_job, kw))
    return out


__all__ = ["CLASSES", "LABELS", "VARIANTS", "timeout_job", "timeout_set"]
