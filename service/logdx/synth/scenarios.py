"""Failure scenarios: each writes its root cause, then the cascade the rest of the job prints.

A scenario function runs when the healthy log has reached the failure point. It returns the
culprits; the root line is whatever it emitted with ``root=True`` first (the sink remembers it).
The label (category, failure_type, action) is static per scenario and lives in ``REGISTRY``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from logdx.model import FT, Action, Category
from logdx.synth.cascade import (
    Fate,
    cuda_error_exception,
    cuda_error_in_watchdog,
    end_job,
    python_traceback,
    time_out_survivors,
    watchdog_abort,
)
from logdx.synth.flavours import USER_ROOT, torch_save_frames
from logdx.synth.job import Frame, Job
from logdx.synth.sink import Burst, Proc
from logdx.synth.training import NCCL_VERSION, finish_healthy, periodic, write_step


@dataclass(slots=True)
class Culprits:
    hosts: list[str] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    gpus: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    description: str
    category: Category | None  # None: healthy
    failure_type: str | None
    action: Action
    write: Callable[[Job], Culprits]
    at_startup: bool = False  # fails before training starts: the log is short whatever ``lines`` says
    min_hosts: int = 1


# -- helpers ------------------------------------------------------------------------------------


def culprits_of(job: Job, ranks: list[int], gpus: list[str] | None = None) -> Culprits:
    """Where the root line came from; nobody is singled out when every rank failed alike."""
    if len(set(ranks)) >= job.cluster.world_size:
        return Culprits(gpus=gpus or [])
    ranks = sorted(set(ranks))
    hosts = sorted({job.cluster.host_index(r) for r in ranks})
    return Culprits([job.cluster.hosts[h] for h in hosts], ranks, gpus or [])


def failure_time(job: Job) -> float:
    """Somewhere inside the step after the last progress line."""
    return job.now + job.step_ms * job.flavour.iters_per_step / 1000.0 * job.rng.uniform(0.15, 0.85)


def rank_proc(job: Job, burst: Burst, rank: int, t: float) -> Proc:
    return job.rank_proc(burst, rank, t + job.skew[rank])


def kernel_say(job: Job, k: Proc, host_index: int, text: str, *, root: bool = False, gap: float = 0.0005) -> None:
    k.put(job.kernel(host_index, k.tick(gap), text), root)


def process_name(job: Job) -> str:
    return "pt_main_thread" if job.new_torch else "python"


def cascade(job: Job, burst: Burst, fates: dict[int, Fate], t_stuck: float,
            silent: frozenset[int] = frozenset()) -> None:
    """The usual end: stuck ranks time out, launchers reap, everything is written in time order."""
    time_out_survivors(job, burst, fates, t_stuck, job.seq + 1, silent=silent)
    end_job(job, burst, fates)
    job.now = burst.drain(job.sink)


def everyone_raises(job: Job, t0: float, frames: list[Frame], exception: str,
                    ranks: list[int] | None = None) -> tuple[Burst, dict[int, Fate]]:
    """The same traceback from many ranks (all by default) at once, interleaved; each exits with code 1."""
    burst = job.burst()
    fates: dict[int, Fate] = {}
    for rank in ranks if ranks is not None else range(job.cluster.world_size):
        p = rank_proc(job, burst, rank, t0 + 0.005 * job.rng.random())
        python_traceback(job, p, frames, exception, root=True)
        fates[rank] = Fate(p.tick(0.2), 1)
    return burst, fates


def stdlib(job: Job) -> str:
    """The interpreter's own library directory, next to site-/dist-packages."""
    lib = job.lib
    if lib.endswith("dist-packages"):  # Debian's python: stdlib lives under /usr/lib
        return "/usr/lib/" + os.path.basename(os.path.dirname(lib))
    return os.path.dirname(lib)


# -- GPU hardware -------------------------------------------------------------------------------


def xid79(job: Job) -> Culprits:
    c, rng = job.cluster, job.rng
    culprit = rng.randrange(c.world_size)
    h, bus, pid = c.host_index(culprit), c.bus_id(culprit), c.worker_pids[culprit]
    burst = job.burst()
    t0 = failure_time(job)
    k = job.kernel_proc(burst, h, t0)
    kernel_say(job, k, h, f"NVRM: Xid (PCI:{bus}): 79, pid={pid}, name={process_name(job)}, GPU has fallen off the bus.", root=True)
    kernel_say(job, k, h, f"NVRM: GPU {bus}.0: GPU has fallen off the bus.")
    kernel_say(job, k, h, f"NVRM: GPU Board Serial Number: 1652{rng.randrange(10**8, 10**9)}")
    kernel_say(job, k, h, "NVRM: A GPU crash dump has been created. If possible, please run")
    kernel_say(job, k, h, "NVRM: nvidia-bug-report.sh as root to collect this data before")
    kernel_say(job, k, h, "NVRM: the NVIDIA kernel module is unloaded.")
    fates: dict[int, Fate] = {}
    silent: frozenset[int] = frozenset()
    if rng.random() < 0.6:  # the rank on the lost GPU notices; otherwise it just hangs
        p = rank_proc(job, burst, culprit, t0 + rng.uniform(0.5, 8.0))
        cuda_error_in_watchdog(job, p, culprit, rng.choice(("unspecified launch failure", "unknown error")))
        fates[culprit] = Fate(p.tick(0.05), -6)
    else:
        silent = frozenset({culprit})
    cascade(job, burst, fates, t0, silent=silent)
    return culprits_of(job, [culprit], [bus])


def ecc(job: Job) -> Culprits:
    c, rng = job.cluster, job.rng
    culprit = rng.randrange(c.world_size)
    h, bus, pid = c.host_index(culprit), c.bus_id(culprit), c.worker_pids[culprit]
    burst = job.burst()
    t0 = failure_time(job)
    seen_by_kernel = rng.random() < 0.5  # the merged log has the node's kernel messages
    if seen_by_kernel:
        k = job.kernel_proc(burst, h, t0)
        kernel_say(job, k, h, f"NVRM: Xid (PCI:{bus}): 48, pid={pid}, name={process_name(job)}, An uncorrectable double "
                              f"bit error (DBE) has been detected on GPU in the framebuffer at partition "
                              f"{rng.randrange(8)}, subpartition 0.", root=True)
        if c.gpu_model == "A100":
            kernel_say(job, k, h, f"NVRM: Xid (PCI:{bus}): 63, pid={pid}, name={process_name(job)}, Row Remapper: New "
                                  f"row (0x{rng.getrandbits(32):08x}) marked for remapping, reset gpu to activate.")
        else:
            kernel_say(job, k, h, f"NVRM: Xid (PCI:{bus}): 94, pid={pid}, name={process_name(job)}, Contained: "
                                  f"CE User Channel (0x{rng.randrange(1, 9)}). RST: No, D-RST: No")
    p = rank_proc(job, burst, culprit, t0 + rng.uniform(0.05, 2.0))
    message = "uncorrectable ECC error encountered"
    if rng.random() < 0.5:  # seen first by the NCCL watchdog thread, or by the Python training step
        cuda_error_in_watchdog(job, p, culprit, message, root=not seen_by_kernel)
        fates = {culprit: Fate(p.tick(0.05), -6)}
    else:
        frames = job.flavour.loop_frames() + job.flavour.forward_frames()
        python_traceback(job, p, frames, cuda_error_exception(message), root=not seen_by_kernel)
        fates = {culprit: Fate(p.tick(0.2), 1)}
    cascade(job, burst, fates, t0)
    return culprits_of(job, [culprit], [bus] if seen_by_kernel else [])


def nvlink(job: Job) -> Culprits:
    c, rng = job.cluster, job.rng
    culprit = rng.randrange(c.world_size)
    h, bus, pid = c.host_index(culprit), c.bus_id(culprit), c.worker_pids[culprit]
    burst = job.burst()
    t0 = failure_time(job)
    k = job.kernel_proc(burst, h, t0)
    link = rng.randrange(12 if c.gpu_model == "A100" else 18)
    kernel_say(job, k, h, f"NVRM: Xid (PCI:{bus}): 74, pid={pid}, name={process_name(job)}, NVLink: fatal error detected "
                          f"on link {link}(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)", root=True)
    p = rank_proc(job, burst, culprit, t0 + rng.uniform(0.05, 1.5))
    cuda_error_in_watchdog(job, p, culprit, "an uncorrectable NVLink error was detected during the execution")
    cascade(job, burst, {culprit: Fate(p.tick(0.05), -6)}, t0)
    return culprits_of(job, [culprit], [bus])


# -- network and nodes ----------------------------------------------------------------------------

_NCCL_ERROR_FRAMES = [
    ("c10::Error::Error(c10::SourceLocation, std::string) + 0x96", "libc10.so"),
    ("c10d::ProcessGroupNCCL::WorkNCCL::checkAndSetException() + 0x64", "libtorch_cuda.so"),
    ("c10d::ProcessGroupNCCL::watchdogHandler() + 0x213", "libtorch_cuda.so"),
    ("c10d::ProcessGroupNCCL::ncclCommWatchdog() + 0x14d", "libtorch_cuda.so"),
    ("<unknown function> + 0xdc253", "/lib/x86_64-linux-gnu/libstdc++.so.6"),
    ("<unknown function> + 0x94ac3", "/lib/x86_64-linux-gnu/libc.so.6"),
]


def ib_error(job: Job) -> Culprits:
    c, rng = job.cluster, job.rng
    culprit = rng.randrange(c.world_size)
    h = c.host_index(culprit)
    peer_host = (h + 1 + rng.randrange(max(1, c.n_hosts - 1))) % c.n_hosts if c.n_hosts > 1 else h
    peer = f"{c.ips[peer_host]}<{rng.randrange(32768, 61000)}>"
    gids = f"localGid ::ffff:{c.ips[h]} remoteGids::ffff:{c.ips[peer_host]}"
    src = rng.choice(("transport/net_ib.cc:1696", "ib_plugin.c:1615"))
    proxy = f"{c.host(culprit)}:{c.worker_pids[culprit]}:{job.nccl_tids[culprit] + rng.randrange(40, 900)} [{c.local_rank(culprit)}]"
    burst = job.burst()
    t0 = failure_time(job)
    p = rank_proc(job, burst, culprit, t0)
    first = f"NET/IB : Got completion from peer {peer} with status=12 opcode={rng.choice((0, 129, 32616))} len=0 vendor err 129 (Recv) {gids}"
    for i in range(rng.randint(1, 3)):
        status = "12" if i == 0 else "5"
        text = first if i == 0 else first.replace("status=12", f"status={status}").replace("vendor err 129", "vendor err 249")
        p.say(f"{proxy} {src} NCCL WARN {text}", root=(i == 0))
        for line in ("transport/net.cc:1302 -> 6", "proxy.cc:698 -> 6", "proxy.cc:878 -> 6 [Progress Thread]"):
            p.say(f"{proxy} NCCL INFO {line}")
        p.say("")
    pg = f"[PG 0 (default_pg) Rank {culprit}]" if job.new_torch else f"[Rank {culprit}]"
    what = [f"NCCL error: remote process exited or there was a network error, NCCL version {NCCL_VERSION.split('+')[0]}",
            "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.",
            "Last error:", first]
    p.tick(rng.uniform(0.1, 3.0))
    watchdog_abort(job, p, pg, what, "checkForNCCLErrorsInternal at ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1972",
                   _NCCL_ERROR_FRAMES)
    cascade(job, burst, {culprit: Fate(p.tick(0.05), -6)}, t0)
    return culprits_of(job, [culprit])


def node_lost(job: Job) -> Culprits:
    c, rng = job.cluster, job.rng
    via_pdsh = job.style.name.startswith("pdsh")
    lost = rng.randrange(1 if via_pdsh else 0, c.n_hosts)  # pdsh itself runs on the first node
    lost_ranks = list(c.ranks_on(lost))
    burst = job.burst()
    t0 = failure_time(job)  # the node dies silently: its ranks simply stop writing
    store_lost = lost == 0  # the c10d store (rendezvous) lives on the first node
    for rank in range(c.world_size):
        if c.host_index(rank) == lost or not (store_lost or c.host_index(rank) == (lost + 1) % c.n_hosts):
            continue
        p = rank_proc(job, burst, rank, t0 + rng.uniform(2.0, 30.0))
        peer = c.hosts[lost]
        port = c.master_port if store_lost else rng.randrange(30000, 60000)
        me = f"[{c.host(rank)}]:{rng.randrange(30000, 60000)}"
        p.say(job.c10("W", p.t, "socket.cpp:464") + f"[c10d] recvValue failed on SocketImpl(fd={rng.randrange(40, 90)}, "
              f"addr={me}, remote=[{peer}]:{port}): Connection reset by peer")
        if store_lost:
            pg = f"[PG 0 (default_pg) Rank {rank}]" if job.new_torch else f"[Rank {rank}]"
            p.say(job.c10("E", p.tick(1.0), "ProcessGroupNCCL.cpp:1346") + f"{pg} Failed to check the \"should dump\" "
                  "flag on TCPStore, (maybe TCPStore server has shut down too early), with error: Broken pipe")
    if store_lost and job.style.launcher == "torchrun":
        for h in range(1, c.n_hosts):
            a = job.agent_proc(burst, h, t0 + rng.uniform(5.0, 15.0))
            node = f"{c.hosts[h]}_{c.agent_pids[h]}_0"
            a.say(job.elastic("WARNING", a.t, "distributed.elastic.rendezvous.dynamic_rendezvous", 1211,
                              f"The node '{node}' has failed to send a keep-alive heartbeat to the rendezvous "
                              f"'{c.slurm_job_id}' due to an error of type RendezvousConnectionError.", h))
    t_detect = t0 + rng.uniform(60.0, 400.0)  # SlurmdTimeout / ssh keep-alive
    fates: dict[int, Fate] = {}
    if via_pdsh:
        burst.add(t_detect, f"pdsh@{c.hosts[0]}: {c.hosts[lost]}: ssh exited with exit code 255", root=True)
        time_out_survivors(job, burst, fates, t0, job.seq + 1, lost_hosts=frozenset({lost}))
        end_job(job, burst, fates, lost_hosts=frozenset({lost}))
    else:
        time_out_survivors(job, burst, fates, t0, job.seq + 1, lost_hosts=frozenset({lost}), deadline=t_detect)
        slurm_node_failure(job, burst, lost, t_detect)
        end_job(job, burst, fates, lost_hosts=frozenset({lost}), cancel_at=t_detect + 0.5)
    job.now = burst.drain(job.sink)
    return Culprits([c.hosts[lost]], lost_ranks, [])


def slurm_node_failure(job: Job, burst: Burst, lost: int, t: float) -> None:
    c = job.cluster
    tasks = f"task {lost}" if job.style.launcher == "torchrun" else _task_span(c.ranks_on(lost))
    alive = 0 if lost != 0 else 1
    burst.add(t, f"srun: error: Node failure on {c.hosts[lost]}", root=True)
    burst.add(t + 0.4, f"slurmstepd: error: *** STEP {c.slurm_job_id}.0 ON {c.hosts[alive]} CANCELLED AT "
                       f"{job.clock.iso(t + 0.4)} DUE TO NODE FAILURE, SEE SLURMCTLD LOG FOR DETAILS ***")
    burst.add(t + 0.6, "srun: Job step aborted: Waiting up to 32 seconds for job step to finish.")
    burst.add(t + 0.7, f"srun: error: {c.hosts[lost]}: {tasks}: Killed")


def _task_span(ranks: range) -> str:
    return f"tasks {ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else f"task {ranks[0]}"


def nccl_hang(job: Job) -> Culprits:
    """Symptoms only: one rank never joins collective N; every other rank times out on it."""
    c, rng = job.cluster, job.rng
    silent = rng.randrange(c.world_size)
    burst = job.burst()
    t0 = failure_time(job)
    fates: dict[int, Fate] = {}
    time_out_survivors(job, burst, fates, t0, job.seq + 1, silent=frozenset({silent}), root=True)
    end_job(job, burst, fates)
    job.now = burst.drain(job.sink)
    return culprits_of(job, [silent])


# -- storage --------------------------------------------------------------------------------------


def _botocore_frames(lib: str) -> list[Frame]:
    b = f"{lib}/botocore"
    return [
        (f"{b}/client.py", 569, "_api_call", "return self._make_api_call(operation_name, kwargs)"),
        (f"{b}/client.py", 1005, "_make_api_call", "http, parsed_response = self._make_request("),
        (f"{b}/client.py", 1029, "_make_request", "return self._endpoint.make_request(operation_model, request_dict)"),
        (f"{b}/endpoint.py", 119, "make_request", "return self._send_request(request_dict, operation_model)"),
        (f"{b}/endpoint.py", 200, "_send_request", "while self._needs_retry("),
        (f"{b}/endpoint.py", 360, "_needs_retry", "responses = self._event_emitter.emit("),
        (f"{b}/hooks.py", 412, "emit", "return self._emitter.emit(aliased_event_name, **kwargs)"),
        (f"{b}/hooks.py", 256, "emit", "return self._emit(event_name, kwargs)"),
        (f"{b}/hooks.py", 239, "_emit", "response = handler(**kwargs)"),
        (f"{b}/retryhandler.py", 207, "__call__", "if self._checker(**checker_kwargs):"),
        (f"{b}/retryhandler.py", 284, "__call__", "should_retry = self._should_retry("),
        (f"{b}/retryhandler.py", 320, "_should_retry", "return self._checker(attempt_number, response, caught_exception)"),
        (f"{b}/retryhandler.py", 363, "__call__", "checker_response = checker("),
        (f"{b}/retryhandler.py", 247, "__call__", "return self._check_caught_exception("),
        (f"{b}/retryhandler.py", 416, "_check_caught_exception", "raise caught_exception"),
        (f"{b}/endpoint.py", 279, "_do_get_response", "http_response = self._send(request)"),
        (f"{b}/endpoint.py", 383, "_send", "return self.http_session.send(request)"),
        (f"{b}/httpsession.py", 501, "send", "raise ReadTimeoutError(endpoint_url=request.url, error=e)"),
    ]


def s3_timeout(job: Job) -> Culprits:
    c, rng = job.cluster, job.rng
    lib = job.lib
    culprit = rng.randrange(c.world_size)
    endpoint = rng.choice(("https://s3.us-east-1.amazonaws.com", "https://s3.us-west-2.amazonaws.com",
                           "https://s3.cluster.internal:9000"))
    bucket = rng.choice(("training-data", "llm-pretrain", "ml-datasets-prod"))
    burst = job.burst()
    t0 = failure_time(job)
    if rng.random() < 0.5:  # reading the next training shard
        key = f"shards/{job.run_name}/train-{rng.randrange(100000):05d}.tar"
        frames = job.flavour.loop_frames() + job.flavour.data_frames() + [
            (f"{lib}/torch/utils/data/dataloader.py", 757, "_next_data", "data = self._dataset_fetcher.fetch(index)  # may raise StopIteration"),
            (f"{lib}/torch/utils/data/_utils/fetch.py", 33, "fetch", "data.append(next(self.dataset_iter))"),
            (f"{USER_ROOT}/project/data/s3_shards.py", 88, "__iter__", "obj = self.s3.get_object(Bucket=self.bucket, Key=key)"),
        ]
        t_raise = t0 + 60.0  # botocore's default read timeout
    else:  # uploading a checkpoint shard
        periodic(job, lambda j, b: j.flavour.checkpoint(j, b, complete=False))
        t0 = max(t0, job.now)
        key = f"ckpt/{job.run_name}/iter_{job.iteration:07d}/shard_{culprit:05d}.pt?uploadId={rng.getrandbits(64):x}&partNumber={rng.randrange(1, 60)}"
        frames = job.flavour.user_call_frames("uploader.upload(local_dir, step)") + [
            (f"{USER_ROOT}/project/checkpoint.py", 63, "upload", "self.s3.upload_file(local_path, self.bucket, key)"),
            (f"{lib}/boto3/s3/inject.py", 145, "upload_file", "return transfer.upload_file("),
            (f"{lib}/boto3/s3/transfer.py", 371, "upload_file", "future.result()"),
            (f"{lib}/s3transfer/futures.py", 103, "result", "return self._coordinator.result()"),
            (f"{lib}/s3transfer/futures.py", 266, "result", "raise self._exception"),
            (f"{lib}/s3transfer/tasks.py", 139, "__call__", "return self._execute_main(kwargs)"),
            (f"{lib}/s3transfer/tasks.py", 162, "_execute_main", "return_value = self._main(**kwargs)"),
            (f"{lib}/s3transfer/upload.py", 764, "_main", "response = client.upload_part("),
        ]
        t_raise = t0 + 60.0 * rng.randint(1, 5)  # retried a few times first
    url = f"{endpoint}/{bucket}/{key}"
    p = rank_proc(job, burst, culprit, t_raise)
    python_traceback(job, p, frames + _botocore_frames(lib),
                     f'botocore.exceptions.ReadTimeoutError: Read timeout on endpoint URL: "{url}"', root=True)
    cascade(job, burst, {culprit: Fate(p.tick(0.3), 1)}, t0)
    return culprits_of(job, [culprit])


def disk_full(job: Job) -> Culprits:
    c, rng = job.cluster, job.rng
    periodic(job, lambda j, b: j.flavour.checkpoint(j, b, complete=False))
    writers = [0] if job.flavour.name in ("plain", "lightning") else rng.sample(range(c.world_size), min(c.world_size, rng.randint(1, 3)))
    t0 = max(failure_time(job), job.now) + rng.uniform(2.0, 30.0)
    frames = job.flavour.save_stack() + torch_save_frames(job.lib)
    burst, fates = everyone_raises(job, t0, frames, "OSError: [Errno 28] No space left on device", writers)
    cascade(job, burst, fates, t0)
    return culprits_of(job, writers)


# -- resources and the framework -------------------------------------------------------------------


def cuda_oom(job: Job) -> Culprits:
    c, rng = job.cluster, job.rng
    if rng.random() < 0.6:
        ranks = [rng.randrange(c.world_size)]
    else:  # the ranks holding the longest sequences, or one pipeline stage
        ranks = sorted(rng.sample(range(c.world_size), min(c.world_size, rng.randint(2, 6))))
    t0 = failure_time(job)
    burst = job.burst()
    fates: dict[int, Fate] = {}
    frames = job.flavour.loop_frames() + job.flavour.forward_frames()
    for rank in ranks:
        p = rank_proc(job, burst, rank, t0 + 0.01 * rng.random())
        python_traceback(job, p, frames, oom_message(job, rank), root=True)
        fates[rank] = Fate(p.tick(0.2), 1)
    cascade(job, burst, fates, t0)
    return culprits_of(job, ranks)


def oom_message(job: Job, rank: int) -> str:
    rng = job.rng
    gpu = job.cluster.local_rank(rank)
    cap = float(job.cluster.capacity_gib)
    want = rng.choice((0.5, 1.0, 1.95, 2.0, 3.91, 7.81, 15.62))
    free = rng.uniform(0.05, min(want, 1.5) * 0.9)
    in_use = cap - free
    allocated = in_use - rng.uniform(0.5, 3.0)
    reserved_unused = rng.uniform(0.1, 2.5)
    if job.new_torch:
        return (f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {want:.2f} GiB. GPU {gpu} has a total "
                f"capacity of {cap:.2f} GiB of which {free:.2f} GiB is free. Including non-PyTorch memory, this process "
                f"has {in_use:.2f} GiB memory in use. Of the allocated memory {allocated:.2f} GiB is allocated by "
                f"PyTorch, and {reserved_unused:.2f} GiB is reserved by PyTorch but unallocated. If reserved but "
                "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
                "fragmentation.  See documentation for Memory Management  "
                "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
    return (f"torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate {want:.2f} GiB (GPU {gpu}; {cap:.2f} "
            f"GiB total capacity; {allocated:.2f} GiB already allocated; {free:.2f} GiB free; "
            f"{allocated + reserved_unused:.2f} GiB reserved in total by PyTorch) If reserved memory is >> allocated "
            "memory try setting max_split_size_mb to avoid fragmentation.  See documentation for Memory Management "
            "and PYTORCH_CUDA_ALLOC_CONF")


def dataloader_killed(job: Job) -> Culprits:
    c, rng = job.cluster, job.rng
    lib, std = job.lib, stdlib(job)
    culprit = rng.randrange(c.world_size)
    worker_pid = c.worker_pids[culprit] + rng.randrange(200, 5000)
    burst = job.burst()
    t0 = failure_time(job)
    p = rank_proc(job, burst, culprit, t0)
    inner = [
        (f"{lib}/torch/utils/data/dataloader.py", 1243, "_try_get_data", "data = self._data_queue.get(timeout=timeout)"),
        (f"{std}/multiprocessing/queues.py", 113, "get", "if not self._poll(timeout):"),
        (f"{std}/multiprocessing/connection.py", 257, "poll", "return self._poll(timeout)"),
        (f"{std}/multiprocessing/connection.py", 440, "_poll", "r = wait([self], timeout)"),
        (f"{std}/multiprocessing/connection.py", 1136, "wait", "ready = selector.select(timeout)"),
        (f"{std}/selectors.py", 415, "select", "fd_event_list = self._selector.poll(timeout)"),
        (f"{lib}/torch/utils/data/_utils/signal_handling.py", 73, "handler", "_error_if_any_worker_fails()"),
    ]
    python_traceback(job, p, inner, f"RuntimeError: DataLoader worker (pid {worker_pid}) is killed by signal: Killed.", root=True)
    for line in ("", "The above exception was the direct cause of the following exception:", ""):
        p.say(line)
    outer = job.flavour.loop_frames() + job.flavour.data_frames() + [
        (f"{lib}/torch/utils/data/dataloader.py", 1448, "_next_data", "idx, data = self._get_data()"),
        (f"{lib}/torch/utils/data/dataloader.py", 1402, "_get_data", "success, data = self._try_get_data()"),
        (f"{lib}/torch/utils/data/dataloader.py", 1256, "_try_get_data",
         "raise RuntimeError(f'DataLoader worker (pid(s) {pids_str}) exited unexpectedly') from e"),
    ]
    python_traceback(job, p, outer, f"RuntimeError: DataLoader worker (pid(s) {worker_pid}) exited unexpectedly")
    cascade(job, burst, {culprit: Fate(p.tick(0.3), 1)}, t0)
    return culprits_of(job, [culprit])


def host_oom(job: Job) -> Culprits:
    """The kernel's OOM killer takes a rank while the job gathers a checkpoint in host memory."""
    c, rng = job.cluster, job.rng
    periodic(job, lambda j, b: j.flavour.checkpoint(j, b, complete=False))
    culprit = rng.randrange(c.world_size)
    h, pid = c.host_index(culprit), c.worker_pids[culprit]
    burst = job.burst()
    t_kill = max(failure_time(job), job.now) + rng.uniform(5.0, 60.0)
    if job.slurm and rng.random() < 0.7:
        burst.add(t_kill + rng.uniform(0.2, 2.0), f"slurmstepd: error: Detected 1 oom_kill event in StepId="
                                                  f"{c.slurm_job_id}.0. Some of the step tasks have been OOM Killed.", root=True)
    else:
        k = job.kernel_proc(burst, h, t_kill)
        gib = rng.uniform(200, 1800)
        kernel_say(job, k, h, f"Out of memory: Killed process {pid} ({process_name(job)}) total-vm:{int(gib * 1.3 * 2**20)}kB, "
                              f"anon-rss:{int(gib * 2**20)}kB, file-rss:{rng.randrange(10**5, 10**6)}kB, shmem-rss:"
                              f"{rng.randrange(10**4, 10**6)}kB, UID:0 pgtables:{rng.randrange(10**5, 10**6)}kB oom_score_adj:0", root=True)
        kernel_say(job, k, h, f"oom_reaper: reaped process {pid} ({process_name(job)}), now anon-rss:0kB, file-rss:0kB, shmem-rss:0kB", gap=0.3)
    cascade(job, burst, {culprit: Fate(t_kill, -9)}, t_kill)
    return culprits_of(job, [culprit])


def nan_loss(job: Job) -> Culprits:
    """The loss turns NaN; the framework carries on a few steps, then gives up on every rank."""
    pattern = re.compile(r"loss\W{0,4}\s*nan\b", re.IGNORECASE)
    job.nan = True
    steps, k = job.rng.randint(1, 4), 0
    while k < steps or (job.sink.root_no is None and k < 100):  # some frameworks print the loss every N steps
        k += 1
        before = job.sink.count
        lines = write_step(job)
        for i, line in enumerate(lines):
            if pattern.search(line):
                job.sink.mark_root(before + i + 1, line)
                break
        periodic(job, job.flavour.nan_lines)
    t0 = failure_time(job)
    burst = job.burst()
    fates: dict[int, Fate] = {}
    for rank in range(job.cluster.world_size):
        frames, exception = job.flavour.nan_exception(job, rank)
        p = rank_proc(job, burst, rank, t0 + 0.005 * job.rng.random())
        python_traceback(job, p, frames, exception)
        fates[rank] = Fate(p.tick(0.2), 1)
    cascade(job, burst, fates, t0)
    return Culprits()


def lib_attr_error(job: Job) -> Culprits:
    frames, exception = job.flavour.library_attribute_error()
    t0 = failure_time(job)
    burst, fates = everyone_raises(job, t0, frames, exception)
    cascade(job, burst, fates, t0)
    return Culprits()


# -- the user's own code ---------------------------------------------------------------------------


def import_error(job: Job) -> Culprits:
    rng = job.rng
    entry = job.flavour.entry
    if rng.random() < 0.5:
        frames: list[Frame] = [
            (entry, 14, "<module>", "from project.data.loader import build_dataloader, ShardedSampler"),
            (f"{USER_ROOT}/project/data/loader.py", 9, "<module>", "from project.data.tokenize import pack_sequences"),
        ]
        exception = ("ImportError: cannot import name 'pack_sequences' from 'project.data.tokenize' "
                     f"({USER_ROOT}/project/data/tokenize.py)")
    else:
        frames = [
            (entry, 17, "<module>", "from project.models import build_model"),
            (f"{USER_ROOT}/project/models/__init__.py", 4, "<module>", "from project.models.llama3 import Llama3ForCausalLM"),
        ]
        exception = "ModuleNotFoundError: No module named 'project.models.llama3'"
    burst, fates = everyone_raises(job, job.now + 2.0, frames, exception)
    end_job(job, burst, fates)
    job.now = burst.drain(job.sink)
    return Culprits()


def syntax_error(job: Job) -> Culprits:
    entry = job.flavour.entry
    if job.rng.random() < 0.5:  # in a module the entry script imports
        lines = ["Traceback (most recent call last):",
                 f'  File "{entry}", line 12, in <module>', "    from project.models import build_model",
                 f'  File "{USER_ROOT}/project/models/__init__.py", line 3, in <module>', "    from .gpt import GPTModel",
                 f'  File "{USER_ROOT}/project/models/gpt.py", line 211', "    if self.use_rope",
                 "                    ^", "SyntaxError: expected ':'"]
    else:  # in the entry script itself: Python prints no "Traceback" header
        lines = [f'  File "{entry}", line 57', '    print(f"step {step} loss {loss:.4f}"',
                 "         ^", "SyntaxError: '(' was never closed"]
    burst = job.burst()
    fates: dict[int, Fate] = {}
    for rank in range(job.cluster.world_size):
        p = rank_proc(job, burst, rank, job.now + 1.0 + 0.005 * job.rng.random())
        p.says(lines, gap=0.001, root_index=len(lines) - 1)
        fates[rank] = Fate(p.tick(0.1), 1)
    end_job(job, burst, fates)
    job.now = burst.drain(job.sink)
    return Culprits()


def key_error(job: Job) -> Culprits:
    rng = job.rng
    if rng.random() < 0.5:
        call = "metrics.update(step_metrics)"
        inner: Frame = (f"{USER_ROOT}/project/metrics.py", 64, "update", "self.totals[name] += value.detach().float()")
        exception = "KeyError: 'loss_ema'"
    else:
        call = "input_ids, mask = unpack(batch)"
        inner = (f"{USER_ROOT}/project/batching.py", 38, "unpack", "mask = batch['attention_mask']")
        exception = "KeyError: 'attention_mask'"
    ranks = None if rng.random() < 0.6 else [0]  # a rank-0-only logging path, or everyone
    t0 = failure_time(job)
    burst, fates = everyone_raises(job, t0, job.flavour.user_call_frames(call) + [inner], exception, ranks)
    cascade(job, burst, fates, t0)
    return culprits_of(job, ranks or list(range(job.cluster.world_size)))


# -- no failure, or no evidence ------------------------------------------------------------------


def healthy(job: Job) -> Culprits:
    finish_healthy(job)
    return Culprits()


def stall(job: Job) -> Culprits:
    """Progress stops and nothing is printed until someone (or the time limit) kills the job."""
    c, rng = job.cluster, job.rng
    before = job.sink.count
    lines = write_step(job, extras=False)
    job.sink.mark_root(before + len(lines), lines[-1])  # the last sign of life
    t_kill = job.now + rng.uniform(1800.0, 4 * 3600.0)
    burst = job.burst()
    if job.slurm:
        reason = rng.choice(("", " DUE TO TIME LIMIT"))
        burst.add(t_kill, f"slurmstepd: error: *** STEP {c.slurm_job_id}.0 ON {c.hosts[0]} CANCELLED AT "
                          f"{job.clock.iso(t_kill)}{reason} ***")
    end_job(job, burst, {}, cancel_at=t_kill)
    job.now = burst.drain(job.sink)
    return Culprits()


_I, _F, _S = Category.INFRASTRUCTURE, Category.FRAMEWORK, Category.SCRIPT
_CR, _R, _NR = Action.CORDON_AND_RESTART, Action.RESTART, Action.NO_RESTART

REGISTRY: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("healthy", "a run that completes normally (noise but no failure)", None, None, Action.NONE, healthy),
        Scenario("xid79", "Xid 79, one GPU fell off the bus; the other ranks hit NCCL watchdog timeouts", _I,
                 FT.GPU_FELL_OFF_BUS, _CR, xid79),
        Scenario("ecc", "uncorrectable ECC error (Xid 48 DBE and/or CUDA error) on one GPU; cascade", _I, FT.ECC_ERROR, _CR, ecc),
        Scenario("nvlink", "Xid 74 fatal NVLink error on one GPU; cascade", _I, FT.NVLINK_ERROR, _CR, nvlink),
        Scenario("ib_error", "NET/IB completion error status=12 on one rank; cascade", _I, FT.NETWORK_ERROR, _R, ib_error),
        Scenario("node_lost", "one host goes silent; c10d errors, Slurm NODE FAILURE (or pdsh ssh 255)", _I,
                 FT.NODE_FAILURE, _CR, node_lost, min_hosts=2),
        Scenario("nccl_hang", "symptoms only: all ranks but one time out on the same SeqNum: a hang whose silent "
                 "rank, named by its own NCCL lines, is the culprit; one signal (the watchdogs' reports) names it, "
                 "so its node is not cordoned: a restart", _I, FT.HANG, _R, nccl_hang),
        Scenario("s3_timeout", "botocore ReadTimeoutError reading a shard or uploading a checkpoint", _I,
                 FT.STORAGE_ERROR, _R, s3_timeout),
        Scenario(FT.DISK_FULL, "OSError: [Errno 28] No space left on device while saving a checkpoint", _I,
                 FT.DISK_FULL, _R, disk_full),
        Scenario(FT.CUDA_OOM, "torch.OutOfMemoryError on one or several ranks", _F, FT.CUDA_OOM, _NR, cuda_oom),
        Scenario(FT.DATALOADER_KILLED, "DataLoader worker killed by signal: Killed", _F, FT.DATALOADER_KILLED, _NR,
                 dataloader_killed),
        Scenario(FT.HOST_OOM, "kernel / Slurm OOM killer takes a rank during a checkpoint (exitcode -9)", _F,
                 FT.HOST_OOM, _NR, host_oom),
        Scenario(FT.NAN_LOSS, "the loss becomes NaN, then the framework raises on every rank", _F, FT.NAN_LOSS, _NR, nan_loss),
        Scenario("lib_attr_error", "AttributeError raised inside a library (innermost frame in site-/dist-packages)",
                 _F, FT.FRAMEWORK_ERROR, _NR, lib_attr_error),
        Scenario(FT.IMPORT_ERROR, "ImportError / ModuleNotFoundError in the user's code at start-up, all ranks", _S,
                 FT.IMPORT_ERROR, _NR, import_error, at_startup=True),
        Scenario(FT.SYNTAX_ERROR, "SyntaxError in the user's code at start-up, all ranks", _S, FT.SYNTAX_ERROR, _NR,
                 syntax_error, at_startup=True),
        Scenario(FT.KEY_ERROR, "KeyError in the user's code during training (rank 0 or all ranks)", _S, FT.KEY_ERROR,
                 _NR, key_error),
        Scenario("stall", "progress stops with no error until the job is killed hours later: a hang", _I,
                 FT.HANG, _R, stall),
    )
}
