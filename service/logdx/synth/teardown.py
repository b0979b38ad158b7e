"""What a job that ended well prints after its end: teardown noise and the nodes' kernel lines past the end.

    from logdx.synth.healthy import healthy_job
    truth = healthy_job(out, seed=3, flavour="hf", style="srun", ranks=16, lines=6000, teardown=True)
    from logdx.synth.healthy import teardown_set    # the evaluation set of such runs

``write_teardown(job)`` writes, after the run's end marker and the launchers' success lines, a subset
(drawn from the job's seed) of what real jobs print while they come down, with the real message strings:

``nccl_teardown``   NCCL while the communicators close after some ranks already exited:
                    ``include/alloc.h:243 NCCL WARN Cuda failure 'driver shutting down'`` (NVIDIA/nccl#1485,
                    NVIDIA/nccl-tests#188), ``NCCL INFO [Service thread] Connection closed by localRank 1`` and
                    ``NCCL INFO comm 0x... rank 28 nranks 32 cudaDev 4 busId 97000 - Abort COMPLETE``
                    (aws/aws-k8s-tester#524), the proxy's ``[Service thread] Error encountered progressing
                    operation=Connect, res=3, closing connection`` (NCCL's proxy.cc); torch's watchdog
                    ``main process destroyed cuda before watchdog loop exited, terminating watchdog. (Watchdog
                    caught exception: CUDA error: driver shutting down`` with the CUDA lines after it
                    (NVIDIA/Fuser#2497), and torch >= 2.6's ``destroy_process_group() was not called before
                    program exit, which can leak resources`` (anhvth/opensloth#17).
``slurm_teardown``  slurmstepd while the step is torn down (Slurm jobs): ``slurmstepd: error: _is_a_lwp:
                    open() /proc/27543/status failed: No such file or directory`` (job accounting polling a
                    process that just exited; NERSC's and HPC centres' pages: "should not affect the job") and
                    ``slurmstepd: error: Exceeded step memory limit at some point.`` (galaxyproject/galaxy#2359:
                    the job COMPLETED).
``nvml``            torch imported by the batch script's last step on a node whose driver is being reset:
                    ``torch/cuda/__init__.py:829: UserWarning: Can't initialize NVML`` (vLLM and torch users'
                    reports quote it verbatim).
``late_kernel``     an epilog appends each node's kernel log (``dmesg -T``, or syslog) since the job started,
                    20 s to 2.5 min past the job's end: ``NVRM: Xid (PCI:...): 45, pid=..., name=...,
                    Ch 0000000e`` (Robust Channel Preemptive Removal, which NVIDIA's Xid catalogue logs "when the
                    application is killed"), and in one run in three a fatal Xid on one node minutes after the
                    job ended (79, fallen off the bus; 48, a double-bit ECC error): the node's trouble for the next
                    job, not this one's failure.

Label: still the healthy run's (``healthy.py``): status ``healthy``, action ``none``. ``variant["teardown"]``
lists the families written, ``variant["late_xid"]`` the fatal Xid's host when there is one.
"""

from __future__ import annotations

from random import Random

from logdx.synth.job import Job
from logdx.synth.scenarios import process_name
from logdx.synth.sink import Burst

FAMILIES = ("nccl_teardown", "slurm_teardown", "nvml", "late_kernel")


def write_teardown(job: Job) -> dict[str, object]:
    """Write the teardown of a job that ended well (see the module docstring); returns what was written."""
    rng = job.rng
    burst = job.burst()
    families = [f for f in FAMILIES if rng.random() < 0.75 and (f != "slurm_teardown" or job.slurm)] or ["late_kernel"]
    t_end = job.now
    late_xid = None
    if "nccl_teardown" in families:
        _nccl_teardown(job, burst, t_end, rng)
    if "slurm_teardown" in families:
        _slurm_teardown(job, burst, t_end + rng.uniform(1.0, 5.0), rng)
    if "nvml" in families:
        p = job.agent_proc(burst, rng.randrange(job.cluster.n_hosts), t_end + rng.uniform(2.0, 8.0))
        p.say(f"{job.lib}/torch/cuda/__init__.py:829: UserWarning: Can't initialize NVML")
        p.say("  warnings.warn(\"Can't initialize NVML\")")
    if "late_kernel" in families:
        late_xid = _late_kernel(job, burst, t_end, rng)
    job.now = max(job.now, burst.drain(job.sink))
    return {"teardown": families, "late_xid": late_xid}


def _nccl_teardown(job: Job, burst: Burst, t: float, rng: Random) -> None:
    c = job.cluster
    ranks = rng.sample(range(c.world_size), k=min(c.world_size, rng.randint(2, 6)))
    for rank in ranks:
        p = job.rank_proc(burst, rank, t + rng.uniform(0.2, 3.0))
        head = job.nccl_head(rank)
        bus = c.nccl_bus(rank)
        lines = [f"{head} NCCL INFO [Service thread] Connection closed by localRank {rng.randrange(c.gpus_per_host)}",
                 f"{head} include/alloc.h:243 NCCL WARN Cuda failure 'driver shutting down'",
                 f"{head} proxy.cc:1519 NCCL WARN [Service thread] Error encountered progressing operation=Connect, "
                 "res=3, closing connection",
                 f"{head} NCCL INFO comm 0x{rng.randrange(1 << 44):x} rank {rank} nranks {c.world_size} cudaDev "
                 f"{c.local_rank(rank)} busId {bus} - Abort COMPLETE"]
        p.says(rng.sample(lines, k=rng.randint(2, len(lines))), gap=0.002)
        if job.new_torch and rng.random() < 0.5:
            p.says([job.c10("I", p.tick(), "ProcessGroupNCCL.cpp:1501") + f"[PG 0 Rank {rank}] main process destroyed "
                    "cuda before watchdog loop exited, terminating watchdog. (Watchdog caught exception: CUDA error: "
                    "driver shutting down",
                    "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace "
                    "below might be incorrect.", "For debugging consider passing CUDA_LAUNCH_BLOCKING=1",
                    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.", ")"])
        elif job.new_torch:
            p.say(job.c10("W", p.tick(), "ProcessGroupNCCL.cpp:1479") + "Warning: WARNING: destroy_process_group() was "
                  "not called before program exit, which can leak resources. For more info, please see "
                  "https://pytorch.org/docs/stable/distributed.html#shutdown (function operator())")


def _slurm_teardown(job: Job, burst: Burst, t: float, rng: Random) -> None:
    c = job.cluster
    for _ in range(min(c.n_hosts, rng.randint(1, 3))):  # one a node at most
        burst.add(t + rng.uniform(0.0, 2.0), f"slurmstepd: error: _is_a_lwp: open() /proc/{rng.randrange(2000, 4_000_000)}"
                  "/status failed: No such file or directory")
    if rng.random() < 0.3:
        burst.add(t + rng.uniform(2.0, 4.0), "slurmstepd: error: Exceeded step memory limit at some point.")


def _late_kernel(job: Job, burst: Burst, t_end: float, rng: Random) -> str | None:
    c = job.cluster
    name = process_name(job)
    for h in rng.sample(range(c.n_hosts), k=min(c.n_hosts, rng.randint(1, 3))):
        k = job.kernel_proc(burst, h, t_end + rng.uniform(20.0, 40.0))
        for rank in rng.sample(c.ranks_on(h), k=min(len(c.ranks_on(h)), rng.randint(1, 3))):
            k.say(job.kernel(h, k.tick(0.01), f"NVRM: Xid (PCI:{c.bus_id(rank)}): 45, pid={c.worker_pids[rank]}, "
                                              f"name={name}, Ch 0000000e"))
    if rng.random() >= 1 / 3:
        return None
    h = rng.randrange(c.n_hosts)
    rank = c.ranks_on(h)[rng.randrange(len(c.ranks_on(h)))]
    k = job.kernel_proc(burst, h, t_end + rng.uniform(60.0, 150.0))
    bus = c.bus_id(rank)
    if rng.random() < 0.5:
        k.say(job.kernel(h, k.tick(), f"NVRM: Xid (PCI:{bus}): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."))
        k.say(job.kernel(h, k.tick(), f"NVRM: GPU {bus}.0: GPU has fallen off the bus."))
    else:
        k.say(job.kernel(h, k.tick(), f"NVRM: Xid (PCI:{bus}): 48, pid='<unknown>', name=<unknown>, An uncorrectable "
                                      "double bit error (DBE) has been detected on GPU in the framebuffer at partition 6, "
                                      "subpartition 0."))
    return c.hosts[h]
