"""Healthy multi-host jobs whose NCCL start-up (NCCL_DEBUG=INFO) shows one degradation on one host, or none.

    from logdx.synth.startup import startup_job, startup_set
    truth = startup_job(out, seed=1, flavour="megatron", style="srun", ranks=32, lines=4000,
                        degradation="fewer_channels")

Each job is a long healthy run (``longjob.start_job``: launchers, store retries, framework banner, warnings), whose
NCCL init lines are NCCL's own (init.cc, bootstrap.cc, transport/net_ib.cc, graph/topo.cc, as NCCL 2.18-2.21 print
them, every rank): ``Bootstrap : Using ib0:10.1.0.10<0>``, ``cudaDriverVersion 12040``, ``NCCL version
2.21.5+cuda12.4``, ``NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ... ; OOB ib0:10.1.0.10<0>``, ``Using network
IB``, ``NET/IB : GPU Direct RDMA Enabled for HCA 0 'mlx5_0'``, the rings' channels, ``32 coll channels, 32 collnet
channels, 0 nvls channels, 32 p2p channels, 32 p2p channels per peer``, ``Init COMPLETE``. Then it trains and ends
well (exit code 0).

``degradation`` (on one host, the ``odd`` host index drawn from the seed; None: a clean start-up):

- ``network_fallback``: ``NET/IB : No device found.``, ``NET/Socket : Using [0]eth0:...``, ``Using network Socket``;
- ``gdr_disabled``: ``GPU Direct RDMA Disabled for HCA 0 'mlx5_0'``;
- ``p2p_disabled``: ``NCCL_P2P_DISABLE set by environment to 1.`` (its intra-node channels ``via SHM/direct/direct``);
- ``bootstrap_interface``: ``Bootstrap : Using eth0:172.16...`` and ``OOB eth0:...`` where the others use ``ib0``;
- ``fewer_channels``: 16 coll channels where the others have 32 (one HCA fewer listed);
- ``nccl_version_differs``: another NCCL version on that host; ``driver_version_differs``: another driver.

Truth (``JobTruth``): status healthy, action none; ``variant["degradation"]`` and ``variant["degraded_host"]`` (the
host the report must name; None for a clean start-up).
"""

from __future__ import annotations

from random import Random
from typing import TextIO

from logdx.model import Action
from logdx.synth.job import Job
from logdx.synth.longjob import GeneratedCase, JobTruth, start_job, startup_lines, train_to
from logdx.synth.training import NCCL_VERSION, finish_healthy

KINDS = ("network_fallback", "gdr_disabled", "p2p_disabled", "bootstrap_interface", "fewer_channels",
         "nccl_version_differs", "driver_version_differs")
_OLD_NCCL = ("2.18.1+cuda12.1", "2.19.3+cuda12.3", "2.20.5+cuda12.4")
_DRIVERS = (12020, 12030, 12060)
_DRIVER = 12040


def nccl_init_with(job: Job, degradation: str | None, odd: int) -> None:
    """Every rank's NCCL_DEBUG=INFO start-up, with ``degradation`` on host index ``odd``."""
    burst = job.burst()
    c, rng = job.cluster, job.rng
    comm = f"0x{rng.getrandbits(64):016x}"
    old_nccl = _OLD_NCCL[rng.randrange(len(_OLD_NCCL))]
    old_driver = _DRIVERS[rng.randrange(len(_DRIVERS))]
    for rank in range(c.world_size):
        h = c.host_index(rank)
        bad = degradation if h == odd else None
        p = job.rank_proc(burst, rank, job.rank_time(rank) + 5.0 + rng.random())
        info = f"{job.nccl_head(rank)} NCCL INFO "
        ip = c.ips[h]
        iface, addr = ("eth0", f"172.16.{h}.{20 + h}") if bad == "bootstrap_interface" else ("ib0", ip)
        local = c.local_rank(rank)
        hcas = 2 if bad == "fewer_channels" else 4
        lines = [f"{info}Bootstrap : Using {iface}:{addr}<0>",
                 f"{info}NET/Plugin: No plugin found (libnccl-net.so)",
                 f"{info}cudaDriverVersion {old_driver if bad == 'driver_version_differs' else _DRIVER}",
                 f"{info}NCCL version {old_nccl if bad == 'nccl_version_differs' else NCCL_VERSION}",
                 f"{info}NCCL_IB_TIMEOUT set by environment to 22."]
        if bad == "p2p_disabled":
            lines.append(f"{info}NCCL_P2P_DISABLE set by environment to 1.")
        if bad == "network_fallback":
            lines += [f"{info}NET/IB : No device found.",
                      f"{info}NET/Socket : Using [0]eth0:172.16.{h}.{20 + h}<0>",
                      f"{info}Using non-device net plugin version 0",
                      f"{info}Using network Socket"]
        else:
            devs = " ".join(f"[{i}]mlx5_{i}:1/IB" for i in range(hcas))
            lines += [f"{info}NET/IB : Using {devs} [RO]; OOB {iface}:{addr}<0>",
                      f"{info}Using non-device net plugin version 0",
                      f"{info}Using network IB"]
        handle = f"0x{rng.getrandbits(40):x}"
        lines.append(f"{info}comm {handle} rank {rank} nranks {c.world_size} cudaDev {local} nvmlDev {local} busId "
                     f"{c.nccl_bus(rank)} commId {comm} - Init START")
        if bad != "network_fallback":
            state = "Disabled" if bad == "gdr_disabled" else "Enabled"
            lines += [f"{info}NET/IB : GPU Direct RDMA {state} for HCA {i} 'mlx5_{i}'" for i in range(hcas)]
        nxt, prv = (rank + 1) % c.world_size, (rank - 1) % c.world_size
        lines += [f"{info}Setting affinity for GPU {local} to ffff,ffffffff,00000000,0000ffff,ffffffff",
                  f"{info}Trees [0] {nxt}/-1/-1->{rank}->{prv} [1] {nxt}/-1/-1->{rank}->{prv}",
                  f"{info}P2P Chunksize set to 524288"]
        for channel in range(2):
            if c.local_rank(nxt) == 0 or nxt == 0:
                via = "NET/Socket/0" if bad == "network_fallback" else f"NET/IB/{channel}" + (
                    "" if bad == "gdr_disabled" else "/GDRDMA")
                lines.append(f"{info}Channel {channel:02d}/0 : {rank}[{local}] -> {nxt}[0] [send] via {via}")
            else:
                via = "SHM/direct/direct" if bad == "p2p_disabled" else "P2P/IPC"
                lines.append(f"{info}Channel {channel:02d}/0 : {rank}[{local}] -> {nxt}[{c.local_rank(nxt)}] via {via}")
        n = 16 if bad == "fewer_channels" else 32
        lines += [f"{info}Connected all rings", f"{info}Connected all trees",
                  f"{info}{n} coll channels, {n} collnet channels, 0 nvls channels, {n} p2p channels, {n} p2p channels "
                  "per peer",
                  f"{info}comm {handle} rank {rank} nranks {c.world_size} cudaDev {local} nvmlDev {local} busId "
                  f"{c.nccl_bus(rank)} commId {comm} - Init COMPLETE"]
        p.says(lines, gap=0.02)
    job.now = burst.drain(job.sink) + 1.0


def startup_job(out: TextIO, *, seed: int, flavour: str, style: str, ranks: int, lines: int,
                degradation: str | None = None, gpus_per_host: int = 8,
                without: frozenset[str] = frozenset()) -> JobTruth:
    """One healthy job whose start-up shows ``degradation`` on one host (see the module docstring)."""
    if degradation is not None and degradation not in KINDS:
        raise ValueError(f"unknown degradation {degradation!r}; choose from {', '.join(KINDS)}")
    job, realism = start_job(out, name="startup", seed=seed, ranks=ranks, lines=lines, style=style, flavour=flavour,
                             gpus_per_host=gpus_per_host, nccl_debug=False, exclude=without)
    if job.cluster.n_hosts < 3:
        raise ValueError("a start-up degradation is told from the other hosts: use 3 hosts or more")
    odd = job.rng.randrange(job.cluster.n_hosts)
    job.nccl_debug = True
    nccl_init_with(job, degradation, odd)
    tail = 3 * ranks + 2 * job.cluster.n_hosts + 40
    train_to(job, max(job.sink.count + 10 * (ranks + 2), lines - tail))
    finish_healthy(job)
    job.sink.flush()
    c = job.cluster
    return JobTruth(
        kind="startup", status="healthy", category=None, failure_type=None, action=Action.NONE, exit_code=0,
        last_step=job.iteration, lines_written=job.sink.count, seed=seed, style=job.style.name,
        flavour=job.flavour.name, ranks=c.world_size, hosts=list(c.hosts), families=sorted(realism.families),
        variant={"degradation": degradation, "degraded_host": c.hosts[odd] if degradation else None})


def startup_set(per_kind: int = 4, clean: int = 12, seed: int = 0) -> list[GeneratedCase]:
    """``per_kind`` jobs of each degradation and ``clean`` clean start-ups: every framework and launcher style,
    3-8 hosts (16-64 ranks), 2,000-8,000 lines; deterministic in ``seed``."""
    from logdx.synth.healthy import FRAMEWORKS, LONG_STYLES

    rng = Random(f"logdx-startup-set:{seed}")
    plan: list[str | None] = [k for k in KINDS for _ in range(per_kind)] + [None] * clean
    out: list[GeneratedCase] = []
    for i, kind in enumerate(plan):
        gpus = (4, 8)[rng.randrange(2)]
        ranks = gpus * rng.randrange(3, 9)
        lines = max(rng.randrange(2000, 8001), startup_lines(ranks) + 40 * (ranks + 2))
        kw = {"seed": rng.randrange(1 << 30), "flavour": FRAMEWORKS[i % len(FRAMEWORKS)],
              "style": LONG_STYLES[(i * 3) % len(LONG_STYLES)], "ranks": ranks, "lines": lines, "degradation": kind,
              "gpus_per_host": gpus}
        out.append(GeneratedCase(f"startup-{i:02d}-{kind or 'clean'}-{kw['style']}-{ranks}r", startup_job, kw))
    return out


__all__ = ["KINDS", "nccl_init_with", "startup_job", "startup_set"]
