"""The healthy part of a log: launcher start-up, NCCL init, framework banner, training steps, noise."""

from __future__ import annotations

from collections.abc import Callable

from logdx.synth.job import Job
from logdx.synth.sink import Burst

NCCL_VERSION = "2.21.5+cuda12.4"


# -- start-up --------------------------------------------------------------------------------


def launcher_startup(job: Job) -> None:
    """What each node's launcher prints before the ranks start."""
    burst = job.burst()
    c = job.cluster
    for h in range(c.n_hosts):
        t = job.now - 25.0 + job.rng.random()
        p = job.agent_proc(burst, h, t)
        if job.style.launcher == "torchrun":
            for message in ("", "*****************************************",
                            "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to "
                            "avoid your system being overloaded, please further tune the variable for optimal "
                            "performance in your application as needed. ",
                            "*****************************************"):
                p.say(job.elastic("WARNING", p.tick(), "distributed.run", 793, message, h))
        elif job.style.launcher == "deepspeed":
            world_info = {c.hosts[i]: list(range(len(c.ranks_on(i)))) for i in range(c.n_hosts)}
            ds = f"[{job.clock.py(p.tick())}] [INFO] [launch.py:"
            p.put(f"{ds}146:main] WORLD INFO DICT: {world_info}")
            p.say(f"{ds}152:main] nnodes={c.n_hosts}, num_local_procs={len(c.ranks_on(h))}, node_rank={h}")
            p.say(f"{ds}164:main] dist_world_size={c.world_size}")
            p.say(f"{ds}168:main] Setting CUDA_VISIBLE_DEVICES={','.join(map(str, range(c.gpus_per_host)))}")
            for rank in c.ranks_on(h):
                p.say(f"{ds}256:main] process {c.worker_pids[rank]} spawned with command: ['{job.python}', '-u', "
                      f"'{job.flavour.entry}', '--local_rank={c.local_rank(rank)}', '--deepspeed', "
                      "'--deepspeed_config', 'ds_config.json']")
    burst.drain(job.sink)


def nccl_init(job: Job) -> None:
    """NCCL_DEBUG=INFO start-up lines of every rank, interleaved as they really are."""
    burst = job.burst()
    c = job.cluster
    comm = f"0x{job.rng.getrandbits(64):016x}"
    for rank in range(c.world_size):
        p = job.rank_proc(burst, rank, job.rank_time(rank) + 5.0 + job.rng.random())
        head = job.nccl_head(rank)
        ip = c.ips[c.host_index(rank)]
        local = c.local_rank(rank)
        info = f"{head} NCCL INFO "
        lines = [
            f"{info}Bootstrap : Using ib0:{ip}<0>",
            f"{info}NET/Plugin: No plugin found (libnccl-net.so)",
            f"{info}cudaDriverVersion 12040",
        ]
        if rank == 0:
            lines.append(f"{info}NCCL version {NCCL_VERSION}")
        nxt = (rank + 1) % c.world_size
        prv = (rank - 1) % c.world_size
        handle = f"0x{job.rng.getrandbits(40):x}"
        lines += [
            f"{info}NCCL_IB_TIMEOUT set by environment to 22.",
            f"{info}NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [2]mlx5_2:1/IB [3]mlx5_3:1/IB [RO]; OOB ib0:{ip}<0>",
            f"{info}Using non-device net plugin version 0",
            f"{info}Using network IB",
            f"{info}comm {handle} rank {rank} nranks {c.world_size} cudaDev {local} nvmlDev {local} busId "
            f"{c.nccl_bus(rank)} commId {comm} - Init START",
            f"{info}Setting affinity for GPU {local} to ffff,ffffffff,00000000,0000ffff,ffffffff",
            f"{info}Trees [0] {nxt}/-1/-1->{rank}->{prv} [1] {nxt}/-1/-1->{rank}->{prv} [2] {nxt}/-1/-1->{rank}->{prv}",
            f"{info}P2P Chunksize set to 524288",
        ]
        for channel in range(2):
            if c.local_rank(nxt) == 0 or nxt == 0:
                lines.append(f"{info}Channel {channel:02d}/0 : {rank}[{local}] -> {nxt}[0] [send] via NET/IB/{channel}/GDRDMA")
            else:
                lines.append(f"{info}Channel {channel:02d}/0 : {rank}[{local}] -> {nxt}[{c.local_rank(nxt)}] via P2P/IPC")
        lines += [
            f"{info}Connected all rings",
            f"{info}Connected all trees",
            f"{info}32 coll channels, 32 collnet channels, 0 nvls channels, 32 p2p channels, 32 p2p channels per peer",
            f"{info}comm {handle} rank {rank} nranks {c.world_size} cudaDev {local} nvmlDev {local} busId "
            f"{c.nccl_bus(rank)} commId {comm} - Init COMPLETE",
        ]
        p.says(lines, gap=0.02)
    job.now = burst.drain(job.sink) + 1.0


def framework_startup(job: Job) -> None:
    burst = job.burst()
    job.flavour.banner(job, burst)
    job.now = max(job.now, burst.drain(job.sink))
    startup_warnings(job)


def startup_warnings(job: Job) -> None:
    """Warnings every process prints once (deprecations, barrier notes), all at the same moment."""
    burst = job.burst()
    lib = job.lib
    for rank in range(job.cluster.world_size):
        p = job.rank_proc(burst, rank, job.rank_time(rank) + 0.5 + job.rng.random())
        local = job.cluster.local_rank(rank)
        p.say(job.c10("W", p.t, "Utils.hpp:164") + "Warning: Environment variable NCCL_ASYNC_ERROR_HANDLING is "
              "deprecated; use TORCH_NCCL_ASYNC_ERROR_HANDLING instead (function operator())")
        p.say(job.c10("W", p.tick(0.05), "ProcessGroupNCCL.cpp:4115") + f"[PG 0 (default_pg) Rank {rank}]  using GPU "
              f"{local} to perform barrier as devices used by this process are currently unknown. This can potentially "
              "cause a barrier to hang if this rank to GPU mapping is incorrect.Specify device_ids in barrier() to "
              "force use of a particular device,or call init_process_group() with a device_id.")
        if job.noise > 0:
            p.say(f"{lib}/torch/_utils.py:831: UserWarning: TypedStorage is deprecated. It will be removed in the future "
                  "and UntypedStorage will be the only storage class. This should only matter to you if you are using "
                  "storages directly.  To access UntypedStorage directly, use tensor.untyped_storage() instead of "
                  "tensor.storage()", 0.2)
            p.say("  return self.fget.__get__(instance, owner)()")
    job.now = max(job.now, burst.drain(job.sink))


# -- training ---------------------------------------------------------------------------------


def train_until(job: Job, stop_line: int, min_steps: int = 3) -> None:
    """Write training steps until the log reaches ``stop_line`` lines (at least ``min_steps`` steps)."""
    steps = 0
    while job.sink.count < stop_line or steps < min_steps:
        write_step(job)
        steps += 1


def write_step(job: Job, extras: bool = True) -> list[str]:
    """One log step: every rank's progress line and the logging rank's summary, shuffled, then
    (with ``extras``) noise, evaluation and checkpoints when due.

    Returns the progress lines, which were written first and in this order.
    """
    job.begin_step()
    flavour = job.flavour
    rng = job.rng
    prefixes = job.prefixes
    now = job.now
    skew = job.skew
    order = list(range(job.cluster.world_size))
    rng.shuffle(order)
    if flavour.per_rank_lines:
        lines = [prefixes[r] + flavour.rank_line(job, r, now + skew[r] + 0.03 * rng.random()) for r in order]
    else:  # only the logging rank reports progress (HF Trainer, NeMo)
        lines = []
    log_rank = flavour.log_rank()
    summary = flavour.summary(job, now + skew[log_rank] + 0.04)
    if summary:
        after_own_line = order.index(log_rank) + 1 if lines else 0  # a rank's own lines stay in time order
        slots = sorted(rng.randrange(after_own_line, len(lines) + 1) for _ in summary)
        for slot, text in reversed(list(zip(slots, summary))):  # back to front keeps earlier slots valid
            lines.insert(slot, prefixes[log_rank] + text)
    job.sink.extend(lines)
    if not extras:
        return lines
    if job.noise > 0:
        write_noise(job)
    if job.realism is not None:
        job.realism.after_step(job)
    if job.step % job.eval_every == 0:
        periodic(job, flavour.evaluate)
    if job.step % job.ckpt_every == 0:
        periodic(job, flavour.checkpoint)
    return lines


def periodic(job: Job, write: Callable[[Job, Burst], None]) -> None:
    burst = job.burst()
    write(job, burst)
    job.now = max(job.now, burst.drain(job.sink))


# -- noise: harmless lines that look alarming to a naive grep -----------------------------------


def write_noise(job: Job) -> None:
    """A few warnings per step across the job, at a rate set by ``noise``."""
    rng = job.rng
    world = job.cluster.world_size
    rate = job.noise * 0.02 * world  # expected noisy lines per step
    while rng.random() < rate / (1.0 + rate):
        rank = rng.randrange(world)
        t = job.rank_time(rank) + 0.05
        for text in noise_lines(job, rank, t):
            job.sink.emit(job.prefixes[rank] + text)


def noise_lines(job: Job, rank: int, t: float) -> list[str]:
    lib = job.lib
    pick = job.rng.randrange(10)
    if pick == 0:
        return [f"{lib}/torch/autograd/graph.py:825: UserWarning: c10d::allreduce_: an autograd kernel was not "
                "registered to the Autograd key(s) but we are trying to backprop through it. This may lead to silently "
                "incorrect behavior. This behavior is deprecated and will be removed in a future version of PyTorch. "
                "If your operator is differentiable, please ensure you have registered an autograd kernel to the "
                "correct Autograd key (e.g. DispatchKey::Autograd, DispatchKey::CompositeImplicitAutograd). If your "
                "operator is not differentiable, or to squash this warning and use the previous behavior, please "
                "register torch::CppFunction::makeFallthrough() to DispatchKey::Autograd. (Triggered internally at "
                "../torch/csrc/autograd/autograd_not_implemented_fallback.cpp:63.)",
                "  return Variable._execution_engine.run_backward(  # Calls into the C++ engine to run the backward pass"]
    if pick == 1:
        return [f"{lib}/torch/utils/checkpoint.py:1399: FutureWarning: `torch.cpu.amp.autocast(args...)` is deprecated. "
                "Please use `torch.amp.autocast('cpu', args...)` instead.",
                "  with device_autocast_ctx, torch.cpu.amp.autocast(**cpu_autocast_kwargs), recompute_context:  # type: ignore[attr-defined]"]
    if pick == 2:
        return ["huggingface/tokenizers: The current process just got forked, after parallelism has already been used. "
                "Disabling parallelism to avoid deadlocks...",
                "To disable this warning, you can either:",
                "\t- Avoid using `tokenizers` before the fork if possible",
                "\t- Explicitly set the environment variable TOKENIZERS_PARALLELISM=(true | false)"]
    if pick == 3:
        return [f"Token indices sequence length is longer than the specified maximum sequence length for this model "
                f"({job.rng.randrange(8200, 40000)} > 8192). Running this sequence through the model will result in "
                "indexing errors"]
    if pick == 4:
        return [f"{job.clock.py(t)} - INFO - data.py:77 - shard check: 0 errors, 0 warnings in "
                f"{job.rng.choice((1024, 2048, 4096))} samples (shard {job.rng.randrange(100000):05d})"]
    if pick == 5:
        return [f"wandb: WARNING Step must only increase in log calls.  Step {job.iteration - 1} < {job.iteration}; "
                f"dropping {{'loss': {job.loss:.4f}}}."]
    if pick == 6 and job.flavour.name == "deepspeed":
        return [f"[{job.clock.py(t)}] [WARNING] [stage3.py:2069:step] {job.rng.randrange(1, 6)} pytorch allocator cache "
                "flushes since last step. this happens when there is high memory pressure and is detrimental to "
                "performance. if this is happening frequently consider adjusting settings to reduce memory "
                "consumption. If you are unable to make the cache flushes go away consider adding "
                "get_accelerator().empty_cache() calls in your training loop to ensure that all ranks flush their "
                "caches at the same time"]
    if pick == 7:
        return [f"{lib}/torch/distributed/fsdp/_state_dict_utils.py:827: FutureWarning: Please use DTensor instead and we "
                "are deprecating ShardedTensor.",
                "  warnings.warn("]
    if pick == 8:
        # A retried and recovered upload: mentions a timeout, is not a failure.
        return ["wandb: Network error (ReadTimeout), entering retry loop."]
    if not job.nccl_debug:  # without NCCL_DEBUG=INFO NCCL prints no INFO line
        return ["wandb: Network error (ReadTimeout), entering retry loop."]
    return [f"{job.nccl_head(rank)} NCCL INFO NCCL_IB_TIMEOUT set by environment to 22."]


# -- a successful end -----------------------------------------------------------------------------


def finish_healthy(job: Job) -> None:
    burst = job.burst()
    job.flavour.finish(job, burst)
    c = job.cluster
    t_done = burst.end + 1.0
    for h in range(c.n_hosts):
        p = job.agent_proc(burst, h, t_done + job.rng.random())
        if job.style.launcher == "torchrun":
            p.say(job.elastic("INFO", p.t, "distributed.elastic.agent.server.api", 864,
                              "[default] worker group successfully finished. Waiting 300 seconds for other agents to finish.", h))
            p.say(job.elastic("INFO", p.tick(0.5), "distributed.elastic.agent.server.api", 879,
                              f"Done waiting for other agents. Elapsed: {job.rng.uniform(0.0005, 0.9):.6f} seconds", h))
        elif job.style.launcher == "deepspeed":
            for rank in c.ranks_on(h):
                p.say(f"[{job.clock.py(p.tick())}] [INFO] [launch.py:351:main] Process {c.worker_pids[rank]} exits successfully.")
    job.now = burst.drain(job.sink)
