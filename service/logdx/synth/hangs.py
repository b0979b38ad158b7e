"""Hangs of whole jobs: one rank stops, the others wait in a collective until the NCCL watchdog
(or a person) ends the job.

    from logdx.synth.hangs import silent_rank_hang, stack_hang
    truth = silent_rank_hang(out, seed=1, flavour="plain", style="torchrun", ranks=32, lines=9000)
    truth = stack_hang(out, seed=2, flavour="megatron", style="srun", ranks=64, lines=12000,
                       where="dataloader", dumper="py-spy")

Both start like any long job (``longjob.start_job``: launchers, store retries, downloads, warnings,
training with checkpoints and evaluations), then rank ``c`` (the culprit, from the seed) stops.

Silent rank (``silent_rank_hang``)
    ``report``: how the culprit shows in the watchdogs' reports. ``absent``: it never reports (it is
    stuck outside any collective, e.g. in its own code or on a dead GPU whose process hangs); the others
    all time out on the collective it never joined, ``WorkNCCL(SeqNum=S+1, ...)``. ``lower``: it is
    stuck inside the previous collective: its own watchdog times out on ``SeqNum=S`` (``last enqueued
    NCCL work: S``) a moment before the others time out on ``S+1``.
    ``gap``: the others print one more progress line that the culprit never prints (it stopped first);
    without it every rank's progress ends at the same step and only the watchdogs tell.
    Watchdog lines are torch's (``Watchdog caught collective operation timeout: WorkNCCL(SeqNum=...``,
    ``Exception (either an error or timeout) detected by watchdog at work: N, last enqueued NCCL work: N,
    last completed NCCL work: N-1``; cascade.py), then the launchers' reaction.
    Label: ``infrastructure`` / ``hang`` / ``restart`` (nothing names code to blame); ``cordon_and_restart``
    when the culprit's host is named and two independent signals name it: the watchdogs' reports (absent or
    lower) and its own progress lines stopping first (``gap``, on a flavour that prints a line per rank and
    a style whose prefixes carry the rank). One signal alone never excludes a node.

Stack dumps (``stack_hang``)
    Every process prints its Python stacks into the log: ``dumper="py-spy"`` (a hang watchdog in the job
    script runs ``py-spy dump --pid`` on each rank; py-spy's format: ``Process 1234: <cmdline>``, ``Python
    v3.10.12 (...)``, ``Thread 1234 (idle): "MainThread"``, frames ``    all_reduce
    (torch/distributed/distributed_c10d.py:2501)``, innermost first; as in huggingface/accelerate#3104 and
    the py-spy dumps users post), or ``dumper="faulthandler"`` (the script armed
    ``faulthandler.dump_traceback_later``: ``Timeout (0:10:00)!``, then ``Thread 0x00007f... (most recent
    call first):`` and ``  File "...", line N in f`` per frame, CPython's format). All ranks but the
    culprit sit in the same collective (``all_reduce`` / ``broadcast`` / ``barrier`` /
    ``all_gather_into_tensor``); the culprit's main thread sits in ``where``:
    ``dataloader`` (waiting on the DataLoader's queue: ``_try_get_data`` -> ``queue.get`` ->
    ``threading.wait``), ``io`` (a read that never returns, inside numpy's ``np.load``), ``lock`` (a file
    lock in torch.compile's cache, ``filelock``), or ``user`` (the user's own function, sleeping on a
    marker file). Then the NCCL watchdog of the others fires, or a person cancels the job.
    Label: by who owns the innermost frame outside the standard library: ``framework`` /
    ``framework_hang`` / ``no_restart`` for a library (DataLoader, numpy, filelock), ``script`` /
    ``script_hang`` / ``no_restart`` for the user's code.

Truth (``JobTruth``): the culprit rank; its host only when the log ties the rank to its host
(``longjob.host_named``). Right root lines: for a silent rank, the culprit's last line, its own watchdog
line (``lower``) and the first watchdog line of the job; for stack dumps, the lines of the culprit's
main-thread stack (its innermost frame first).
"""

from __future__ import annotations

import re
from random import Random
from typing import TextIO

from logdx.model import FT, Action, Category
from logdx.synth.cascade import Fate, end_job, time_out_survivors, watchdog_timeout
from logdx.synth.flavours import USER_ROOT
from logdx.synth.job import Frame, Job
from logdx.synth.longjob import GeneratedCase, JobTruth, host_named, start_job, startup_lines, train_to
from logdx.synth.scenarios import stdlib

WHERE = {  # where the culprit sits -> (category, failure type, action)
    "dataloader": (Category.FRAMEWORK, FT.FRAMEWORK_HANG, Action.NO_RESTART),
    "io": (Category.FRAMEWORK, FT.FRAMEWORK_HANG, Action.NO_RESTART),
    "lock": (Category.FRAMEWORK, FT.FRAMEWORK_HANG, Action.NO_RESTART),
    "user": (Category.SCRIPT, FT.SCRIPT_HANG, Action.NO_RESTART),
}
SILENT_LABEL = (Category.INFRASTRUCTURE, FT.HANG, Action.RESTART)
CORROBORATED_LABEL = (Category.INFRASTRUCTURE, FT.HANG, Action.CORDON_AND_RESTART)
_WATCHDOG = re.compile(r"Watchdog caught collective operation timeout")


# -- one more step, tracking where each rank's progress line lands -------------------------------


def step_lines(job: Job, skip: int | None = None) -> list[tuple[int, int, str]]:
    """One log step like ``training.write_step`` (without extras), leaving out rank ``skip``'s lines;
    returns (rank, line number, line) of every line written, the logging rank's summary last."""
    job.begin_step()
    flavour, rng = job.flavour, job.rng
    order = list(range(job.cluster.world_size))
    rng.shuffle(order)
    written: list[tuple[int, str]] = []
    if flavour.per_rank_lines:
        written = [(r, job.prefixes[r] + flavour.rank_line(job, r, job.rank_time(r) + 0.03 * rng.random()))
                   for r in order if r != skip]
    log_rank = flavour.log_rank()
    if log_rank != skip:
        written += [(log_rank, job.prefixes[log_rank] + text)
                    for text in flavour.summary(job, job.rank_time(log_rank) + 0.04)]
    base = job.sink.count
    job.sink.extend([line for _, line in written])
    return [(r, base + i + 1, line) for i, (r, line) in enumerate(written)]


def step_tracking(job: Job, skip: int | None = None) -> dict[int, int]:
    """``step_lines`` as rank -> line number of that rank's first line of the step."""
    out: dict[int, int] = {}
    for rank, no, _ in step_lines(job, skip):
        out.setdefault(rank, no)
    return out


def _finish_truth(job: Job, realism_families: frozenset[str], kind: str, label: tuple[str, str, str],
                  exit_code: int | None, root_nos: list[int], culprit: int, *, launcher_names_it: bool, seed: int,
                  variant: dict[str, object]) -> JobTruth:
    job.sink.flush()
    rec, first = job.sink.recorded or [], job.sink.recorded_from
    root_nos = sorted(set(root_nos))
    root_line = rec[root_nos[0] - first] if root_nos and root_nos[0] >= first else None
    c = job.cluster
    return JobTruth(
        kind=kind, status="failed", category=label[0], failure_type=label[1], action=label[2], exit_code=exit_code,
        root_line_nos=root_nos, root_line=root_line, culprit_ranks=[culprit],
        culprit_hosts=[c.host(culprit)] if host_named(job, culprit, launcher_names_it=launcher_names_it) else [],
        last_step=job.iteration, lines_written=job.sink.count, seed=seed, style=job.style.name,
        flavour=job.flavour.name, ranks=c.world_size, hosts=list(c.hosts), families=sorted(realism_families),
        variant=variant)


def _hang_start(out: TextIO, name: str, seed: int, flavour: str, style: str, ranks: int, lines: int,
                gpus_per_host: int, nccl_debug: bool, without: frozenset[str]) -> tuple[Job, frozenset[str]]:
    job, realism = start_job(out, name=name, seed=seed, ranks=ranks, lines=lines, style=style, flavour=flavour,
                             gpus_per_host=gpus_per_host, nccl_debug=nccl_debug, exclude=without)
    cascade = 30 * ranks + 40 * job.cluster.n_hosts
    train_to(job, max(job.sink.count + 10 * (ranks + 2), lines - cascade))
    return job, realism.families


def _pick(rng: Random, world: int) -> int:
    return rng.randrange(world)


# -- silent rank ------------------------------------------------------------------------------------


def silent_rank_hang(out: TextIO, *, seed: int, flavour: str, style: str, ranks: int, lines: int,
                     report: str = "absent", gap: bool = True, nccl_debug: bool = True,
                     gpus_per_host: int = 8, without: frozenset[str] = frozenset()) -> JobTruth:
    """One rank goes quiet; the others' NCCL watchdogs time out (see the module docstring)."""
    if report not in ("absent", "lower"):
        raise ValueError("report must be 'absent' or 'lower'")
    job, families = _hang_start(out, "silent-hang", seed, flavour, style, ranks, lines, gpus_per_host, nccl_debug,
                                without)
    rng, c = job.rng, job.cluster
    culprit = _pick(rng, c.world_size)
    job.sink.record()
    last = step_tracking(job)  # the last step every rank finished
    root_nos = [last[culprit]] if culprit in last else []
    if gap:
        step_tracking(job, skip=culprit)  # the others get one step further
    seq = job.seq + 1  # the collective the culprit never joins
    t_stuck = job.now + rng.uniform(0.2, 2.0)
    burst = job.burst()
    fates: dict[int, Fate] = {}
    if report == "lower":  # stuck inside the previous collective: its watchdog fires first, on a lower SeqNum
        t_own = t_stuck - rng.uniform(0.5, 3.0)
        p = job.rank_proc(burst, culprit, t_own + job.nccl_timeout_ms / 1000.0 + 0.1 * rng.random())
        watchdog_timeout(job, p, culprit, seq - 1, job.nccl_timeout_ms + rng.randrange(1, 99))
        fates[culprit] = Fate(p.tick(0.01), -6)
    time_out_survivors(job, burst, fates, t_stuck, seq, silent=frozenset({culprit}))
    end_job(job, burst, fates)
    job.now = burst.drain(job.sink)
    rec, first = job.sink.recorded or [], job.sink.recorded_from
    watchdogs = [first + i for i, line in enumerate(rec) if _WATCHDOG.search(line)]
    own = [n for n in watchdogs if f"[Rank {culprit}] Watchdog" in rec[n - first]]
    root_nos += watchdogs[:1] + own
    variant = {"report": report, "gap": gap, "nccl_debug": nccl_debug, "seq": seq, "culprit": culprit}
    # a culprit that dies of its own watchdog is named with its host by torchrun's failure box and by mpirun
    names_it = report == "lower" and job.style.launcher in ("torchrun", "mpirun")
    # Two independent signals name the culprit when, besides the watchdogs' reports (absent, or lower), its
    # own progress lines show it stopping a step before the others (a gap, on lines that carry its rank):
    # then its node, when the log names it, is cordoned (README "Safety model"); one signal restarts.
    two_signals = gap and job.flavour.per_rank_lines and job.style.carries_rank
    label = CORROBORATED_LABEL if two_signals and host_named(job, culprit, launcher_names_it=names_it) else SILENT_LABEL
    return _finish_truth(job, families, "silent_hang", label, 1, root_nos, culprit, launcher_names_it=names_it,
                         seed=seed, variant=variant)


# -- stack dumps ------------------------------------------------------------------------------------

_OPS = {  # collective -> (line in distributed_c10d.py, code)
    "all_reduce": (2501, "work.wait()"),
    "broadcast": (2417, "work.wait()"),
    "barrier": (4159, "work.wait()"),
    "all_gather_into_tensor": (2709, "work.wait()"),
}


def _c10d(lib: str, op: str) -> list[Frame]:
    line, code = _OPS[op]
    return [(f"{lib}/torch/distributed/c10d_logger.py", 83, "wrapper", "return func(*args, **kwargs)"),
            (f"{lib}/torch/distributed/distributed_c10d.py", line, op, code)]


def collective_stack(job: Job, op: str) -> list[Frame]:
    """Where every rank but the culprit sits: the training loop, down into ``op`` (outermost first)."""
    f, lib = job.flavour, job.lib
    loop = f.loop_frames()
    match f.name:
        case "megatron":
            mm = "/workspace/Megatron-LM/megatron"
            if op == "broadcast":
                return loop[:2] + [
                    (f"{mm}/training/training.py", 1301, "train", "evaluate_and_print_results(prefix, forward_step_func,"),
                    (f"{mm}/training/training.py", 1492, "evaluate", "loss_dicts = forward_backward_func("),
                    (f"{mm}/core/pipeline_parallel/schedules.py", 274, "forward_step",
                     "output_tensor, loss_func = forward_step_func(data_iterator, model)"),
                    (f"{f.entry}", 84, "get_batch", "batch = get_batch_on_this_tp_rank(data_iterator)"),
                    (f"{mm}/training/utils.py", 285, "_broadcast", "torch.distributed.broadcast(item, "
                     "mpu.get_tensor_model_parallel_src_rank(), group=mpu.get_tensor_model_parallel_group())"),
                ] + _c10d(lib, op)
            return loop + [
                (f"{mm}/core/pipeline_parallel/schedules.py", 274, "forward_step",
                 "output_tensor, loss_func = forward_step_func(data_iterator, model)"),
                (f.entry, 190, "loss_func", "averaged_loss = average_losses_across_data_parallel_group([loss])"),
                (f"{mm}/training/utils.py", 197, "average_losses_across_data_parallel_group",
                 "torch.distributed.all_reduce(averaged_losses, group=parallel_state.get_data_parallel_group())"),
            ] + _c10d(lib, "all_reduce")
        case "deepspeed":
            ds = f"{lib}/deepspeed"
            return loop + [
                (f"{lib}/transformers/trainer.py", 2474, "_inner_training_loop", "self.optimizer.step()"),
                (f"{lib}/accelerate/optimizer.py", 159, "step", "self.optimizer.step(closure)"),
                (f"{ds}/runtime/engine.py", 2213, "step", "self._take_model_step(lr_kwargs)"),
                (f"{ds}/runtime/engine.py", 2119, "_take_model_step", "self.optimizer.step()"),
                (f"{ds}/runtime/zero/stage_1_and_2.py", 1845, "step", "self._check_overflow(partition_gradients)"),
                (f"{ds}/runtime/zero/stage_1_and_2.py", 2013, "has_overflow",
                 "dist.all_reduce(overflow_gpu, op=dist.ReduceOp.MAX, group=self.dp_process_group)"),
                (f"{ds}/comm/comm.py", 117, "log_wrapper", "return func(*args, **kwargs)"),
                (f"{ds}/comm/comm.py", 496, "all_reduce", "return cdb.all_reduce(tensor, op, group, async_op)"),
                (f"{ds}/comm/torch.py", 171, "all_reduce",
                 "return torch.distributed.all_reduce(tensor=tensor, op=op, group=group, async_op=async_op)"),
            ] + _c10d(lib, "all_reduce")
        case "hf":
            return loop + [
                (f"{lib}/transformers/trainer.py", 2389, "_inner_training_loop",
                 "tr_loss_scalar = self._nested_gather(tr_loss).mean().item()"),
                (f"{lib}/transformers/trainer.py", 3847, "_nested_gather", "tensors = self.accelerator.gather(tensors)"),
                (f"{lib}/accelerate/accelerator.py", 2401, "gather", "return gather(tensor)"),
                (f"{lib}/accelerate/utils/operations.py", 378, "gather", "return _gpu_gather(tensor)"),
                (f"{lib}/accelerate/utils/operations.py", 353, "_gpu_gather_one", "gather_op(output_tensors, tensor)"),
            ] + _c10d(lib, "all_gather_into_tensor")
        case "lightning" | "nemo":
            pl = f"{lib}/lightning"
            return loop + [
                (f"{pl}/pytorch/loops/optimization/automatic.py", 319, "_training_step",
                 'training_step_output = call._call_strategy_hook(trainer, "training_step", *kwargs.values())'),
                (f"{pl}/pytorch/strategies/ddp.py", 390, "training_step", "return self.model(*args, **kwargs)"),
                (f"{USER_ROOT}/project/lit_module.py", 130, "training_step", "self.log('train_loss', loss, sync_dist=True)"),
                (f"{pl}/pytorch/core/module.py", 515, "log", "value = self.__sync("),
                (f"{pl}/pytorch/strategies/ddp.py", 332, "reduce",
                 "tensor = _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)"),
                (f"{pl}/fabric/utilities/distributed.py", 221, "_sync_ddp",
                 "torch.distributed.all_reduce(result, op=op, group=group, async_op=False)"),
            ] + _c10d(lib, "all_reduce")
    # a hand-written loop (plain, torchtitan-style FSDP): the user's own calls
    if op == "broadcast":
        return loop[:3] + [(f.entry, 268, "evaluate", "dist.broadcast(batch['input_ids'], src=0)")] + _c10d(lib, op)
    if op == "barrier":
        return loop[:3] + [(f.entry, 241, "train", "dist.barrier()")] + _c10d(lib, op)
    return loop + [(f.entry, 226, "train_step", "dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)")] + _c10d(lib, op)


def _data_path(job: Job) -> list[Frame]:
    """From the entry script to the DataLoader's ``__next__`` (outermost first)."""
    f, lib = job.flavour, job.lib
    if f.name in ("lightning", "nemo"):
        pl = f"{lib}/lightning/pytorch"
        return f.loop_frames()[:-1] + [
            (f"{pl}/loops/training_epoch_loop.py", 196, "advance", "batch = next(data_fetcher)"),
            (f"{pl}/loops/fetchers.py", 133, "__next__", "batch = super().__next__()"),
            (f"{pl}/loops/fetchers.py", 60, "__next__", "batch = next(self.iterator)"),
            (f"{pl}/utilities/combined_loader.py", 341, "__next__", "out = next(self._iterator)"),
            (f"{pl}/utilities/combined_loader.py", 78, "__next__", "out[i] = next(self.iterators[i])"),
            (f"{lib}/torch/utils/data/dataloader.py", 701, "__next__", "data = self._next_data()"),
        ]
    loop = f.loop_frames()
    if f.name == "megatron":
        return loop + f.data_frames()
    return loop[:-1] + f.data_frames() if f.name in ("plain", "fsdp") else loop + f.data_frames()


def culprit_stack(job: Job, where: str) -> list[Frame]:
    """Where the culprit's main thread sits (outermost first)."""
    lib, std = job.lib, stdlib(job)
    dl = f"{lib}/torch/utils/data/dataloader.py"
    match where:
        case "dataloader":
            return _data_path(job) + [
                (dl, 1332, "_next_data", "idx, data = self._get_data()"),
                (dl, 1294, "_get_data", "success, data = self._try_get_data()"),
                (dl, 1133, "_try_get_data", "data = self._data_queue.get(timeout=timeout)"),
                (f"{std}/queue.py", 180, "get", "self.not_empty.wait(remaining)"),
                (f"{std}/threading.py", 324, "wait", "gotit = waiter.acquire(True, timeout)"),
            ]
        case "io":
            return _data_path(job) + [
                (dl, 757, "_next_data", "data = self._dataset_fetcher.fetch(index)  # may raise StopIteration"),
                (f"{lib}/torch/utils/data/_utils/fetch.py", 52, "fetch",
                 "data = [self.dataset[idx] for idx in possibly_batched_index]"),
                (f"{lib}/torch/utils/data/_utils/fetch.py", 52, "<listcomp>",
                 "data = [self.dataset[idx] for idx in possibly_batched_index]"),
                (f"{USER_ROOT}/project/data/shards.py", 88, "__getitem__", "arr = np.load(self.paths[shard])"),
                (f"{lib}/numpy/lib/npyio.py", 456, "load", "return format.read_array(fid, allow_pickle=allow_pickle,"),
                (f"{lib}/numpy/lib/format.py", 831, "read_array", 'data = _read_bytes(fp, read_size, "array data")'),
                (f"{lib}/numpy/lib/format.py", 966, "_read_bytes", "r = fp.read(size - len(data))"),
            ]
        case "lock":
            f = job.flavour
            return f.loop_frames() + f.forward_frames()[:3] + [
                (f"{lib}/torch/_dynamo/eval_frame.py", 465, "_fn", "return fn(*args, **kwargs)"),
                (f"{lib}/torch/_inductor/codecache.py", 2071, "load_by_key_path",
                 "with FileLock(get_lock_path(), timeout=LOCK_TIMEOUT):"),
                (f"{lib}/filelock/_api.py", 297, "__enter__", "self.acquire()"),
                (f"{lib}/filelock/_api.py", 264, "acquire", "time.sleep(poll_interval)"),
            ]
        case "user":
            return job.flavour.user_call_frames("wait_for_shard(cfg.data_dir, step)") + [
                (f"{USER_ROOT}/project/data/sync.py", 41, "wait_for_shard", "time.sleep(5)"),
            ]
    raise ValueError(f"unknown where {where!r}; choose from {', '.join(WHERE)}")


def _pin_memory_thread(job: Job) -> list[Frame]:
    lib, std = job.lib, stdlib(job)
    return [
        (f"{std}/threading.py", 1016, "_bootstrap_inner", "self.run()"),
        (f"{std}/threading.py", 953, "run", "self._target(*self._args, **self._kwargs)"),
        (f"{lib}/torch/utils/data/_utils/pin_memory.py", 55, "_pin_memory_loop", "do_one_step()"),
        (f"{lib}/torch/utils/data/_utils/pin_memory.py", 31, "do_one_step", "r = in_queue.get(timeout=MP_STATUS_CHECK_INTERVAL)"),
        (f"{std}/multiprocessing/queues.py", 113, "get", "if not self._poll(timeout):"),
        (f"{std}/multiprocessing/connection.py", 257, "poll", "return self._poll(timeout)"),
        (f"{std}/multiprocessing/connection.py", 424, "_poll", "r = wait([self], timeout)"),
        (f"{std}/multiprocessing/connection.py", 931, "wait", "ready = selector.select(timeout)"),
        (f"{std}/selectors.py", 416, "select", "fd_event_list = self._selector.poll(timeout)"),
    ]


def _short(job: Job, path: str) -> str:
    """How py-spy names a file: relative to site-/dist-packages, the stdlib, or the working directory."""
    for base in (job.lib, stdlib(job), USER_ROOT, "/workspace/Megatron-LM", "/opt/NeMo"):
        if path.startswith(base + "/"):
            return path[len(base) + 1:]
    return path


def pyspy_dump(job: Job, rank: int, threads: list[tuple[str, str, list[Frame]]]) -> list[str]:
    """``py-spy dump --pid`` of one rank: ``threads`` are (name, state, frames outermost first)."""
    c = job.cluster
    pid = c.worker_pids[rank]
    version = re.search(r"python(3\.\d+)", job.lib)
    ver = f"{version.group(1) if version else '3.10'}.{4 + c.slurm_job_id % 11}"  # one interpreter for the job
    out = [f"Process {pid}: {job.python} -u {job.flavour.entry} --config configs/{job.run_name}.yaml",
           f"Python v{ver} ({job.python})", ""]
    for i, (name, state, frames) in enumerate(threads):
        tid = pid if i == 0 else pid + 40 + 7 * i
        out.append(f'Thread {tid} ({state}): "{name}"')
        out.extend(f"    {func} ({_short(job, path)}:{line})" for path, line, func, _ in reversed(frames))
    out.append("")
    return out


def faulthandler_dump(job: Job, rank: int, timeout_s: int, threads: list[tuple[str, str, list[Frame]]]) -> list[str]:
    """``faulthandler.dump_traceback_later`` firing: newest thread first, the main thread last."""
    h, rem = divmod(timeout_s, 3600)
    out = [f"Timeout ({h}:{rem // 60:02d}:{rem % 60:02d})!"]
    base = 0x7F0000000000 + (job.cluster.worker_pids[rank] * 7919 % 0xFFFF) * 0x1000000
    for i, (_name, _state, frames) in enumerate(reversed(threads)):
        if i:
            out.append("")
        main = i == len(threads) - 1
        out.append(f"Thread 0x{(base + 0x740 if main else base - 0x10000 * (i + 1) + 0x640):016x} (most recent call first):")
        out.extend(f'  File "{path}", line {line} in {func}' for path, line, func, _ in reversed(frames))
    out.append("")
    return out


def stack_hang(out: TextIO, *, seed: int, flavour: str, style: str, ranks: int, lines: int, where: str = "dataloader",
               dumper: str = "py-spy", op: str | None = None, ending: str = "watchdog", nccl_debug: bool = True,
               gpus_per_host: int = 8, without: frozenset[str] = frozenset()) -> JobTruth:
    """All ranks but one wait in a collective and every rank's Python stacks are printed (see the
    module docstring); ``ending`` is ``watchdog`` (the others' NCCL watchdog fires) or ``cancel``."""
    if where not in WHERE:
        raise ValueError(f"unknown where {where!r}; choose from {', '.join(WHERE)}")
    if dumper not in ("py-spy", "faulthandler"):
        raise ValueError("dumper must be 'py-spy' or 'faulthandler'")
    job, families = _hang_start(out, "stack-hang", seed, flavour, style, ranks, lines, gpus_per_host, nccl_debug,
                                without)
    rng, c = job.rng, job.cluster
    culprit = _pick(rng, c.world_size)
    op = op or ("broadcast" if job.flavour.name in ("plain", "fsdp", "megatron") and rng.random() < 0.3 else "all_reduce")
    if job.flavour.name == "hf":
        op = "all_gather_into_tensor"
    gap = rng.random() < 0.5
    step_tracking(job)
    if gap:
        step_tracking(job, skip=culprit)
    seq = job.seq + 1
    t_stuck = job.now + rng.uniform(0.2, 2.0)
    timeout_s = job.nccl_timeout_ms / 1000.0
    dump_after = int(min(rng.choice((300, 600, 900)), timeout_s * 0.5))
    majority = collective_stack(job, op)
    minority = culprit_stack(job, where)
    pin = rng.random() < 0.7  # DataLoader(pin_memory=True): every rank has a pin-memory thread
    burst = job.burst()
    job.sink.record()
    tags: dict[object, int] = {}
    main_state = "idle" if where in ("dataloader", "user", "lock") else "active"
    if dumper == "py-spy":
        p0 = job.rank_proc(burst, 0, t_stuck + dump_after)
        p0.say(f"{job.clock.py(p0.t)} - WARNING - hang_watchdog.py:38 - no training progress for {dump_after}s: "
               "dumping the Python stacks of every rank (py-spy dump)")
    for rank in range(c.world_size):
        is_culprit = rank == culprit
        threads = [("MainThread", main_state if is_culprit else rng.choice(("active", "idle")),
                    minority if is_culprit else majority)]
        if pin:
            threads.append(("Thread-2 (_pin_memory_loop)", "idle", _pin_memory_thread(job)))
        if dumper == "py-spy":
            text = pyspy_dump(job, rank, threads)
            p = job.rank_proc(burst, rank, t_stuck + dump_after + 1.0 + 0.8 * rank)  # one py-spy after the other
            gap_s = 0.0001
            main_block = range(3, 4 + len(threads[0][2]))
        else:
            text = faulthandler_dump(job, rank, dump_after, threads)
            p = job.rank_proc(burst, rank, t_stuck + dump_after + rng.uniform(0.0, 0.02))  # armed at the same step
            gap_s = 0.0005
            start = len(text) - 1 - len(threads[0][2]) - 1  # the main thread is last: header + frames, then ""
            main_block = range(start, start + 1 + len(threads[0][2]))
        for i, line in enumerate(text):
            p.tick(gap_s)
            burst.add(p.t, p.prefix + line, tag=(rank, i) if is_culprit and i in main_block else None)
    fates: dict[int, Fate] = {}
    t_end = t_stuck + timeout_s
    if ending == "cancel" and job.slurm:
        t_cancel = t_stuck + dump_after + rng.uniform(120.0, 0.9 * max(121.0, timeout_s - dump_after))
        if t_cancel < t_end:
            burst.add(t_cancel, f"slurmstepd: error: *** STEP {c.slurm_job_id}.0 ON {c.hosts[0]} CANCELLED AT "
                                f"{job.clock.iso(t_cancel)} ***")
            end_job(job, burst, fates, cancel_at=t_cancel)
        else:
            ending = "watchdog"
    else:
        ending = "watchdog"
    if ending == "watchdog":
        time_out_survivors(job, burst, fates, t_stuck, seq, silent=frozenset({culprit}))
        end_job(job, burst, fates)
    job.now = burst.drain(job.sink, tags)
    # the culprit's innermost frame line first, then the rest of its main-thread block
    block = sorted(tags.values())
    innermost = block[1] if len(block) > 1 else block[0]
    root_nos = [innermost, *block]
    label = WHERE[where]
    variant = {"where": where, "dumper": dumper, "op": op, "gap": gap, "ending": ending, "nccl_debug": nccl_debug,
               "dump_after_s": dump_after, "culprit": culprit}
    truth = _finish_truth(job, families, "stack_hang", label, 1 if ending == "watchdog" else 143, root_nos, culprit,
                          launcher_names_it=False, seed=seed, variant=variant)
    truth.root_line_nos = sorted(set(root_nos))
    rec, first = job.sink.recorded or [], job.sink.recorded_from
    truth.root_line = rec[innermost - first]
    return truth


def owner_is_user(frames: list[Frame], job: Job) -> bool:
    """Whether the innermost frame outside the standard library is the user's own code."""
    std = stdlib(job)
    for path, _line, _func, _code in reversed(frames):
        if path.startswith(std + "/") and not path.startswith(job.lib):
            continue
        return path.startswith(USER_ROOT) and "site-packages" not in path and "dist-packages" not in path
    return False


# -- the set ----------------------------------------------------------------------------------------


def hang_set(n_silent: int = 20, n_stack: int = 20, seed: int = 0) -> list[GeneratedCase]:
    """Deterministic hang jobs of every framework and launcher style, 8-128 ranks, 2,000-20,000 lines:
    silent ranks (absent / lower SeqNum, with and without a gap, with and without NCCL INFO lines) and
    stack dumps (each ``where``, py-spy and faulthandler, ended by the watchdog or a cancel)."""
    from logdx.synth.healthy import FRAMEWORKS, LONG_STYLES, RANK_CHOICES

    rng = Random(f"logdx-hang-set:{seed}")
    out: list[GeneratedCase] = []
    for i in range(n_silent):
        flavour = FRAMEWORKS[(i * 5) % len(FRAMEWORKS)]
        style = LONG_STYLES[i % len(LONG_STYLES)]
        ranks = RANK_CHOICES[rng.randrange(len(RANK_CHOICES))]
        lines = max(rng.randrange(2000, 20001), startup_lines(ranks) + 40 * (ranks + 2))
        kw = {"seed": rng.randrange(1 << 30), "flavour": flavour, "style": style, "ranks": ranks, "lines": lines,
              "report": ("absent", "lower")[i % 2], "gap": (i // 2) % 2 == 0, "nccl_debug": (i // 4) % 2 == 0}
        out.append(GeneratedCase(f"silent-{i:02d}-{flavour}-{style}-{ranks}r-{kw['report']}", silent_rank_hang, kw))
    wheres = tuple(WHERE)
    for i in range(n_stack):
        flavour = FRAMEWORKS[(i * 3) % len(FRAMEWORKS)]
        style = LONG_STYLES[(i + 3) % len(LONG_STYLES)]
        ranks = RANK_CHOICES[rng.randrange(len(RANK_CHOICES) - 1)]  # dumps of 128 ranks make very long logs
        lines = max(rng.randrange(2000, 20001), startup_lines(ranks) + 40 * (ranks + 2))
        kw = {"seed": rng.randrange(1 << 30), "flavour": flavour, "style": style, "ranks": ranks, "lines": lines,
              "where": wheres[i % len(wheres)], "dumper": ("py-spy", "faulthandler")[(i // 4) % 2],
              "ending": ("watchdog", "cancel")[(i // 8) % 2], "nccl_debug": i % 3 != 2}
        out.append(GeneratedCase(f"stack-{i:02d}-{flavour}-{style}-{ranks}r-{kw['where']}-{kw['dumper']}", stack_hang,
                                 kw))
    return out


__all__ = ["SILENT_LABEL", "WHERE", "collective_stack", "culprit_stack", "faulthandler_dump", "hang_set",
           "owner_is_user", "pyspy_dump", "silent_rank_hang", "stack_hang", "step_lines", "step_tracking"]
