"""Symptoms: what the rest of the job prints after one process fails.

A scenario writes its root cause, says which ranks died when (``Fate``), then calls
``time_out_survivors`` (NCCL watchdog timeouts on ranks left waiting in a collective) and
``end_job`` (the launchers' reaction: SIGTERMs, ChildFailedError, srun/pdsh messages).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from logdx.synth.job import Frame, Job, traceback_lines
from logdx.synth.sink import Burst, Proc

SIGNAL_NAMES = {6: "SIGABRT", 7: "SIGBUS", 9: "SIGKILL", 11: "SIGSEGV", 15: "SIGTERM"}
CPP_GAP = 0.002  # seconds between the lines of a C++ error report (backtraces are symbolised line by line)
SRUN_STATUS = {-6: "Aborted (core dumped)", -7: "Bus error", -9: "Killed", -11: "Segmentation fault", -15: "Terminated"}


@dataclass(slots=True)
class Fate:
    """How and when a worker process ended."""

    t: float
    exitcode: int  # 1 for a Python exception, -N for signal N


# -- lines a dying rank prints ------------------------------------------------------------------


def python_traceback(job: Job, p: Proc, frames: list[Frame], exception: str, *, root: bool = False,
                     gap: float = 0.001) -> None:
    """A traceback written line by line (so other ranks' lines slip in between); the exception
    line is the root-cause candidate when ``root``."""
    lines = traceback_lines(frames, exception, carets=job.flavour.carets)
    first_exception_line = len(lines) - len(exception.split("\n"))
    for i, line in enumerate(lines):
        p.say(line, gap, root=root and i == first_exception_line)


def cpp_frames(job: Job, raised_from: str, frames: list[tuple[str, str]]) -> list[str]:
    """``Exception raised from X (most recent call first):`` and the ``frame #N`` lines of a c10::Error."""
    lib = job.lib
    out = [f"Exception raised from {raised_from} (most recent call first):"]
    base = 0x7F0000000000 + job.rng.getrandbits(24) * 0x1000
    for i, (symbol, so) in enumerate(frames):
        where = so if so.startswith("/lib") else f"{lib}/torch/lib/{so}"
        out.append(f"frame #{i}: {symbol} (0x{base + i * 0x2A3F1:x} in {where})")
    return out


_WATCHDOG_TIMEOUT_FRAMES = [
    ("c10::Error::Error(c10::SourceLocation, std::string) + 0x96", "libc10.so"),
    ("c10d::ProcessGroupNCCL::WorkNCCL::checkTimeout(std::optional<std::chrono::duration<long, std::ratio<1l, 1000l> > >) + 0x1d2", "libtorch_cuda.so"),
    ("c10d::ProcessGroupNCCL::watchdogHandler() + 0x233", "libtorch_cuda.so"),
    ("c10d::ProcessGroupNCCL::ncclCommWatchdog() + 0x14d", "libtorch_cuda.so"),
    ("<unknown function> + 0xdc253", "/lib/x86_64-linux-gnu/libstdc++.so.6"),
    ("<unknown function> + 0x94ac3", "/lib/x86_64-linux-gnu/libc.so.6"),
    ("<unknown function> + 0x126850", "/lib/x86_64-linux-gnu/libc.so.6"),
]
_CUDA_CHECK_FRAMES = [
    ("c10::Error::Error(c10::SourceLocation, std::string) + 0x96", "libc10.so"),
    ("c10::detail::torchCheckFail(char const*, char const*, unsigned int, std::string const&) + 0x64", "libc10.so"),
    ("c10::cuda::c10_cuda_check_implementation(int, char const*, char const*, int, bool) + 0x118", "libc10_cuda.so"),
    ("c10d::ProcessGroupNCCL::WorkNCCL::finishedGPUExecutionInternal() const + 0x56", "libtorch_cuda.so"),
    ("c10d::ProcessGroupNCCL::WorkNCCL::isCompleted() + 0xa0", "libtorch_cuda.so"),
    ("c10d::ProcessGroupNCCL::watchdogHandler() + 0x1da", "libtorch_cuda.so"),
    ("c10d::ProcessGroupNCCL::ncclCommWatchdog() + 0x14d", "libtorch_cuda.so"),
    ("<unknown function> + 0xdc253", "/lib/x86_64-linux-gnu/libstdc++.so.6"),
    ("<unknown function> + 0x94ac3", "/lib/x86_64-linux-gnu/libc.so.6"),
]


def work_nccl(job: Job, seq: int, ran_ms: int) -> str:
    # One collective has one size on every rank (ranks that disagree are a misconfiguration of their own); the
    # draw stays so that every other line of a generated job is what it was.
    job.rng.randrange(20, 27)
    numel = 1 << (20 + seq % 7)
    return (f"WorkNCCL(SeqNum={seq}, OpType=ALLREDUCE, NumelIn={numel}, NumelOut={numel}, "
            f"Timeout(ms)={job.nccl_timeout_ms}) ran for {ran_ms} milliseconds before timing out.")


def watchdog_timeout(job: Job, p: Proc, rank: int, seq: int, ran_ms: int, *, root: bool = False) -> None:
    """The NCCL watchdog of ``rank`` gives up on collective ``seq`` and aborts the process."""
    pg = f"[PG 0 (default_pg) Rank {rank}]" if job.new_torch else f"[Rank {rank}]"
    work = work_nccl(job, seq, ran_ms)
    caught = f"[Rank {rank}] Watchdog caught collective operation timeout: {work}"
    p.say(job.c10("E", p.t, "ProcessGroupNCCL.cpp:607") + caught, root=root)
    if job.new_torch:
        p.say(job.c10("E", p.tick(), "ProcessGroupNCCL.cpp:1664") + f"{pg} Exception (either an error or timeout) "
              f"detected by watchdog at work: {seq}, last enqueued NCCL work: {seq}, last completed NCCL work: {seq - 1}.")
    p.say(job.c10("E", p.tick(), "ProcessGroupNCCL.cpp:621") + f"[Rank {rank}] Some NCCL operations have failed or "
          "timed out. Due to the asynchronous nature of CUDA kernels, subsequent GPU operations might run on "
          "corrupted/incomplete data.")
    p.say(job.c10("E", p.tick(), "ProcessGroupNCCL.cpp:627") + f"[Rank {rank}] To avoid data inconsistency, we are "
          "taking the entire process down.")
    watchdog_abort(job, p, pg, [caught], "checkTimeout at ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:609",
                   _WATCHDOG_TIMEOUT_FRAMES)


def watchdog_abort(job: Job, p: Proc, pg: str, what: list[str], raised_from: str,
                   frames: list[tuple[str, str]], *, root_first: bool = False) -> None:
    """``Process group watchdog thread terminated with exception: ...`` then std::terminate.

    ``what`` is the exception text, one entry per printed line; when ``root_first`` the first
    line written is the root-cause candidate (e.g. an uncorrectable ECC error seen by the watchdog).
    """
    error = "c10::DistBackendError" if "Watchdog caught" in what[0] else "c10::Error"
    head = "Process group watchdog thread terminated with exception: " if job.new_torch else "NCCL watchdog thread terminated with exception: "
    block = [f"{head}{what[0]}", *what[1:], *cpp_frames(job, raised_from, frames), ""]
    p.say(job.c10("E", p.tick(), "ProcessGroupNCCL.cpp:1595") + f"{pg} {block[0]}", root=root_first)
    for line in block[1:]:
        p.say(line, CPP_GAP)
    p.say(f"terminate called after throwing an instance of '{error}'", CPP_GAP)
    p.say(f"  what():  {pg} {block[0]}", CPP_GAP)
    for line in block[1:-1]:
        p.say(line, CPP_GAP)
    p.say("", CPP_GAP)


def cuda_error_in_watchdog(job: Job, p: Proc, rank: int, message: str, *, root: bool = False) -> None:
    """The watchdog thread polls a CUDA event and gets a sticky CUDA error (ECC, NVLink, lost GPU)."""
    pg = f"[PG 0 (default_pg) Rank {rank}]" if job.new_torch else f"[Rank {rank}]"
    what = [f"CUDA error: {message}",
            "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.",
            "For debugging consider passing CUDA_LAUNCH_BLOCKING=1",
            "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.",
            ""]
    watchdog_abort(job, p, pg, what, "c10_cuda_check_implementation at ../c10/cuda/CUDAException.cpp:43",
                   _CUDA_CHECK_FRAMES, root_first=root)


def cuda_error_exception(message: str) -> str:
    """A ``RuntimeError: CUDA error: ...`` as raised to Python, with torch's standard advice lines."""
    return "\n".join([
        f"RuntimeError: CUDA error: {message}",
        "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.",
        "For debugging consider passing CUDA_LAUNCH_BLOCKING=1",
        "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.",
        "",
    ])


# -- survivors ------------------------------------------------------------------------------------


def time_out_survivors(job: Job, burst: Burst, fates: dict[int, Fate], t_stuck: float, seq: int, *,
                       silent: frozenset[int] = frozenset(), lost_hosts: frozenset[int] = frozenset(),
                       deadline: float | None = None, root: bool = False) -> None:
    """Ranks still waiting in collective ``seq`` since ``t_stuck`` hit the NCCL timeout.

    Skips ranks a node launcher will have killed earlier (a peer on their node died first),
    ``silent`` ranks (hung elsewhere), ranks on ``lost_hosts``, and everything after ``deadline``
    (e.g. Slurm cancelled the step first). Adds a ``Fate`` (-6, SIGABRT) for each rank that times out.
    With ``root`` the timeouts are themselves the root cause (a hang with no other evidence).
    """
    c = job.cluster
    fire = t_stuck + job.nccl_timeout_ms / 1000.0
    if deadline is not None and fire >= deadline:
        return
    if job.style.launcher == "mpirun" and any(f.t < fire for f in fates.values()):
        return  # mpirun kills every process of the job as soon as the first one exits
    killed_early: set[int] = set()
    if job.style.launcher != "srun":  # per-node launchers kill a dead rank's local peers at once
        for rank, fate in fates.items():
            if fate.t < fire:
                killed_early.add(c.host_index(rank))
    for rank in range(c.world_size):
        h = c.host_index(rank)
        if rank in fates or rank in silent or h in lost_hosts or h in killed_early:
            continue
        t = fire + 0.1 * job.rng.random()  # watchdogs poll every 100 ms
        p = job.rank_proc(burst, rank, t)
        watchdog_timeout(job, p, rank, seq, int((t - t_stuck) * 1000), root=root)
        fates[rank] = Fate(p.tick(0.01), -6)


# -- launchers ------------------------------------------------------------------------------------


def end_job(job: Job, burst: Burst, fates: dict[int, Fate], *, lost_hosts: frozenset[int] = frozenset(),
            cancel_at: float | None = None) -> None:
    """The launchers react to the deaths in ``fates``; ``cancel_at`` is when Slurm (or an operator)
    killed whatever was still running. Fills in the fates of the ranks the launchers kill."""
    match job.style.launcher:
        case "torchrun":
            for h in range(job.cluster.n_hosts):
                if h not in lost_hosts:
                    torchrun_agent_ends(job, burst, h, fates, cancel_at)
        case "deepspeed":
            for h in range(job.cluster.n_hosts):
                if h not in lost_hosts:
                    deepspeed_launcher_ends(job, burst, h, fates, cancel_at)
        case "srun":
            srun_ends(job, burst, fates, lost_hosts, cancel_at)
        case "mpirun":
            mpirun_ends(job, burst, fates, cancel_at)


def _local_failures(job: Job, host_index: int, fates: dict[int, Fate], cancel_at: float | None) -> list[int]:
    local = [r for r in job.cluster.ranks_on(host_index) if r in fates]
    if cancel_at is not None:
        local = [r for r in local if fates[r].t < cancel_at]
    return sorted(local, key=lambda r: fates[r].t)


def torchrun_agent_ends(job: Job, burst: Burst, h: int, fates: dict[int, Fate], cancel_at: float | None) -> None:
    c = job.cluster
    failed = _local_failures(job, h, fates, cancel_at)
    rng = job.rng
    if failed:
        first = fates[failed[0]]
        t_agent = first.t + rng.uniform(0.1, 2.0)
        failed = [r for r in failed if fates[r].t <= t_agent + 3.0]  # died in the same breath: failures too
        p = job.agent_proc(burst, h, t_agent)
        for rank in c.ranks_on(h):
            if rank not in failed:
                p.say(job.elastic("WARNING", p.t, "distributed.elastic.multiprocessing.api", 897,
                                  f"Sending process {c.worker_pids[rank]} closing signal SIGTERM", h), 0.001)
                fates[rank] = Fate(p.t + 0.5, -15)
        p.tick(1.0)
        code = fates[failed[0]].exitcode
        p.say(job.elastic("ERROR", p.t, "distributed.elastic.multiprocessing.api", 869,
                          f"failed (exitcode: {code}) local_rank: {c.local_rank(failed[0])} (pid: "
                          f"{c.worker_pids[failed[0]]}) of binary: {job.python}", h))
        for line in _torchrun_traceback(job) + child_failed_summary(job, h, failed, fates):
            p.say(line, 0.0002)
        _slurm_task_exit(job, burst, h, p.t + 0.2, 1)
    elif cancel_at is not None:
        p = job.agent_proc(burst, h, cancel_at + rng.uniform(0.01, 0.3))
        pid = c.agent_pids[h]
        p.say(job.elastic("WARNING", p.t, "distributed.elastic.agent.server.api", 704,
                          "Received Signals.SIGTERM death signal, shutting down workers", h))
        for rank in c.ranks_on(h):
            p.say(job.elastic("WARNING", p.t, "distributed.elastic.multiprocessing.api", 897,
                              f"Sending process {c.worker_pids[rank]} closing signal SIGTERM", h), 0.001)
            fates[rank] = Fate(p.t + 0.5, -15)
        lib = job.lib
        frames = _torchrun_frames(job)[:-2] + [
            (f"{lib}/torch/distributed/launcher/api.py", 260, "launch_agent", "result = agent.run()"),
            (f"{lib}/torch/distributed/elastic/metrics/api.py", 137, "wrapper", "result = f(*args, **kwargs)"),
            (f"{lib}/torch/distributed/elastic/agent/server/api.py", 696, "run", "result = self._invoke_run(role)"),
            (f"{lib}/torch/distributed/elastic/agent/server/api.py", 855, "_invoke_run", "time.sleep(monitor_interval)"),
            (f"{lib}/torch/distributed/elastic/multiprocessing/api.py", 84, "_terminate_process_handler",
             'raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)'),
        ]
        for line in traceback_lines(frames, f"torch.distributed.elastic.multiprocessing.api.SignalException: "
                                            f"Process {pid} got signal: 15"):
            p.say(line, 0.0002)


def _torchrun_frames(job: Job) -> list[Frame]:
    lib = job.lib
    return [
        (f"{os.path.dirname(job.python)}/torchrun", 8, "<module>", "sys.exit(main())"),
        (f"{lib}/torch/distributed/elastic/multiprocessing/errors/__init__.py", 355, "wrapper", "return f(*args, **kwargs)"),
        (f"{lib}/torch/distributed/run.py", 919, "main", "run(args)"),
        (f"{lib}/torch/distributed/run.py", 910, "run", "elastic_launch("),
        (f"{lib}/torch/distributed/launcher/api.py", 138, "__call__", "return launch_agent(self._config, self._entrypoint, list(args))"),
        (f"{lib}/torch/distributed/launcher/api.py", 269, "launch_agent", "raise ChildFailedError("),
    ]


def _torchrun_traceback(job: Job) -> list[str]:
    return traceback_lines(_torchrun_frames(job), "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ")


def child_failed_summary(job: Job, h: int, failed: list[int], fates: dict[int, Fate]) -> list[str]:
    """The box torchrun prints; its "Root Cause" is merely the first failure *on this node*."""
    c = job.cluster

    def entry(index: int, rank: int) -> list[str]:
        fate = fates[rank]
        pid = c.worker_pids[rank]
        if fate.exitcode < 0:
            sig = -fate.exitcode
            trace = f"Signal {sig} ({SIGNAL_NAMES.get(sig, 'SIG' + str(sig))}) received by PID {pid}"
        else:
            trace = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
        return [f"[{index}]:", f"  time      : {job.clock.underscored(fate.t)}", f"  host      : {c.hosts[h]}",
                f"  rank      : {rank} (local_rank: {c.local_rank(rank)})",
                f"  exitcode  : {fate.exitcode} (pid: {pid})", "  error_file: <N/A>", f"  traceback : {trace}"]

    out = ["=" * 60, f"{os.path.basename(job.flavour.entry)} FAILED", "-" * 60, "Failures:"]
    if len(failed) == 1:
        out.append("  <NO_OTHER_FAILURES>")
    for i, rank in enumerate(failed[1:], start=1):
        out += entry(i, rank)
    out += ["-" * 60, "Root Cause (first observed failure):", *entry(0, failed[0]), "=" * 60]
    return out


def deepspeed_launcher_ends(job: Job, burst: Burst, h: int, fates: dict[int, Fate], cancel_at: float | None) -> None:
    c = job.cluster
    failed = _local_failures(job, h, fates, cancel_at)
    if not failed and cancel_at is None:
        return
    if failed:
        t = fates[failed[0]].t + job.rng.uniform(0.1, 1.0)
    else:
        assert cancel_at is not None
        t = cancel_at + 0.1
    p = job.agent_proc(burst, h, t)
    for rank in c.ranks_on(h):
        p.say(f"[{job.clock.py(p.t)}] [INFO] [launch.py:319:sigkill_handler] Killing subprocess {c.worker_pids[rank]}", 0.001)
        if rank not in failed:
            fates[rank] = Fate(p.t + 0.1, -9)
    rank = failed[0] if failed else c.ranks_on(h)[0]
    code = fates[rank].exitcode
    p.say(f"[{job.clock.py(p.tick(0.3))}] [ERROR] [launch.py:325:sigkill_handler] ['{job.python}', '-u', "
          f"'{job.flavour.entry}', '--local_rank={c.local_rank(rank)}', '--deepspeed', '--deepspeed_config', "
          f"'ds_config.json'] exits with return code = {code}")
    # pdsh runs on the first node and reports each remote shell's exit status, unprefixed.
    burst.add(p.t + 0.05, f"pdsh@{c.hosts[0]}: {c.hosts[h]}: ssh exited with exit code {code % 256}")


def srun_ends(job: Job, burst: Burst, fates: dict[int, Fate], lost_hosts: frozenset[int], cancel_at: float | None) -> None:
    """srun started every rank itself: it reports failed tasks, then ends the step."""
    c = job.cluster
    dead = sorted((f.t, r) for r, f in fates.items() if cancel_at is None or f.t < cancel_at)
    if not dead and cancel_at is None:
        return
    step = f"StepId={c.slurm_job_id}.0"
    # srun reports exits as they happen, one line per node and status for tasks dying together.
    groups: list[tuple[int, int, list[int]]] = []  # host, exit code, ranks
    open_groups: dict[tuple[int, int], tuple[float, list[int]]] = {}
    for t, rank in dead:
        key = (c.host_index(rank), fates[rank].exitcode)
        if key in open_groups and t - open_groups[key][0] < 1.0:
            open_groups[key][1].append(rank)
        else:
            open_groups[key] = (t, [rank])
            groups.append((*key, open_groups[key][1]))
    for h, code, ranks in groups:
        t = max(fates[r].t for r in ranks) + 0.2
        burst.add(t, f"srun: error: {c.hosts[h]}: {_tasks(sorted(ranks))}: {_srun_status(code)}")
    if cancel_at is None:  # the step ends when its last task has; a cancel is announced by whoever cancelled
        t_kill = dead[-1][0] + 1.0
        burst.add(t_kill + 0.3, f"srun: launch/slurm: _step_signal: Terminating {step}")
        burst.add(t_kill + 0.4, f"slurmstepd: error: *** STEP {c.slurm_job_id}.0 ON {c.hosts[0]} CANCELLED AT "
                                f"{job.clock.iso(t_kill + 0.4)} ***")
    else:
        t_kill = cancel_at
    terminated: dict[int, list[int]] = {}
    for rank in range(c.world_size):
        if rank not in fates and c.host_index(rank) not in lost_hosts:
            fates[rank] = Fate(t_kill + 0.5, -15)
            terminated.setdefault(c.host_index(rank), []).append(rank)
    for h, ranks in terminated.items():
        burst.add(t_kill + 0.6 + 0.01 * h, f"srun: error: {c.hosts[h]}: {_tasks(ranks)}: Terminated")
    burst.add(t_kill + 1.0, f"srun: Force Terminated {step}")


# Open MPI's own epilogue, as users paste it (Open MPI users' list and GitHub threads, e.g. the
# "Primary job  terminated normally" / "mpirun detected that one or more processes exited with non-zero
# status" block, and "mpirun noticed that process rank 14 with PID 4257 on node compute-0-2.local exited
# on signal 11 (Segmentation fault)."). The double space after "job" is Open MPI's.
_MPI_RULE = "-" * 74
_MPI_SIGNALS = {6: "Aborted", 7: "Bus error", 9: "Killed", 11: "Segmentation fault", 15: "Terminated"}


def mpirun_ends(job: Job, burst: Burst, fates: dict[int, Fate], cancel_at: float | None) -> None:
    """mpirun started every rank itself; at the first non-zero exit it kills the rest and says who."""
    c = job.cluster
    dead = sorted((f.t, r) for r, f in fates.items() if cancel_at is None or f.t < cancel_at)
    if dead:
        t_first, first = dead[0]
        code = fates[first].exitcode
        t = t_first + job.rng.uniform(0.05, 0.5)
        if code < 0:
            sig = -code
            block = [_MPI_RULE, f"mpirun noticed that process rank {first} with PID {c.worker_pids[first]} on node "
                                f"{c.host(first)} exited on signal {sig} ({_MPI_SIGNALS.get(sig, 'Unknown signal')}).",
                     _MPI_RULE]
        else:
            block = [_MPI_RULE, "Primary job  terminated normally, but 1 process returned",
                     "a non-zero exit code. Per user-direction, the job has been aborted.", _MPI_RULE, _MPI_RULE,
                     "mpirun detected that one or more processes exited with non-zero status, thus causing",
                     "the job to be terminated. The first process to do so was:", "",
                     f"  Process name: [[{c.slurm_job_id % 65536},1],{first}]", f"  Exit code:    {code}", _MPI_RULE]
        for i, line in enumerate(block):
            burst.add(t + 0.0001 * i, line)
        t_kill = t
    elif cancel_at is not None:
        t_kill = cancel_at
    else:
        return
    for rank in range(c.world_size):
        if rank not in fates:
            fates[rank] = Fate(t_kill + 0.2, -15)


def _slurm_task_exit(job: Job, burst: Burst, h: int, t: float, code: int) -> None:
    """Under Slurm each node's launcher is one srun task, numbered like its node."""
    if job.slurm:
        burst.add(t, f"srun: error: {job.cluster.hosts[h]}: task {h}: Exited with exit code {code}")


def _srun_status(code: int) -> str:
    return SRUN_STATUS.get(code, f"Exited with exit code {code}")


def _tasks(ranks: list[int]) -> str:
    """``task 26`` or ``tasks 24-25,27-31`` as srun writes them."""
    if len(ranks) == 1:
        return f"task {ranks[0]}"
    spans: list[str] = []
    start = prev = ranks[0]
    for r in ranks[1:] + [-2]:
        if r != prev + 1:
            spans.append(f"{start}-{prev}" if prev != start else str(start))
            start = r
        prev = r
    return "tasks " + ",".join(spans)
