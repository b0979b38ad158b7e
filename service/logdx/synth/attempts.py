"""A multi-attempt job with known timings: what a failure cost, to check `cost` against.

One log holds every attempt of a Megatron-style job (a Slurm batch script that restarts `torchrun` until it
succeeds, or a supervisor's merged output): each attempt starts its ranks (NCCL init of every rank), loads
the last checkpoint, trains (the last rank prints `iteration N/ M | ... | lm loss`), saves a checkpoint
every `save_every` steps ("saving checkpoint at iteration N" then "successfully saved checkpoint at
iteration N" from rank 0), and ends with the failure drawn for it (an Xid 79 on the culprit's host with the
others' NCCL watchdog timeouts, a CUDA OOM traceback on one rank), or runs to its end. Every line carries an
ISO timestamp and its host, so the truth (`AttemptsTruth`) is exact: the failure's time, the last save
completed before it, the GPUs, the time between the failure and the next attempt's first step, and when
that attempt was back at the failed step.

The line formats are Megatron-LM's (`training.py`: `iteration`, `elapsed time per iteration (ms)`,
`lm loss`; `checkpointing.py`: "saving checkpoint at iteration", "successfully saved checkpoint at
iteration"), the NVIDIA driver's Xid message, and PyTorch's ProcessGroupNCCL watchdog and OOM messages.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import TextIO

__all__ = ["AttemptPlan", "AttemptTruth", "AttemptsTruth", "write_attempts_job"]

_START = 1_767_225_600.0  # 2026-01-01T00:00:00Z


@dataclass(frozen=True, slots=True)
class AttemptPlan:
    """One attempt: how far it trains and how it ends ("xid79", "oom", "ok")."""

    until_step: int
    ending: str = "xid79"
    culprit_host: int = 0  # index into the job's hosts (xid79)
    culprit_rank: int = 0  # oom
    downtime_s: float = 300.0  # from this attempt's failure to the next attempt's first line


@dataclass(slots=True)
class AttemptTruth:
    failure_ts: float | None
    failure_step: int
    checkpoint_step: int | None
    checkpoint_ts: float | None
    attempt_start_ts: float  # its first progress line
    lost_gpu_hours: float | None  # gpus * (failure - max(checkpoint, attempt start))
    next_first_step_ts: float | None = None  # the next attempt's first progress line
    passed_ts: float | None = None  # when the next attempt printed failure_step again
    culprit_host: str | None = None


@dataclass(slots=True)
class AttemptsTruth:
    gpus: int
    hosts: list[str]
    first_ts: float
    attempts: list[AttemptTruth] = field(default_factory=list)
    lines: int = 0


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts * 1000) % 1000:03d}Z"


class _Out:
    def __init__(self, out: TextIO) -> None:
        self.out, self.lines = out, 0

    def put(self, ts: float, host: str, text: str) -> None:
        self.out.write(f"{_iso(ts)} {host}: {text}\n")
        self.lines += 1


def write_attempts_job(out: TextIO, plans: list[AttemptPlan], *, hosts: list[str], gpus_per_host: int = 8,
                       step_s: float = 2.0, log_every: int = 10, save_every: int = 500, save_s: float = 20.0,
                       total_steps: int = 100_000, seed: int = 0, start: float = _START) -> AttemptsTruth:
    """Write every attempt of `plans` into `out`; the truth of each failure."""
    rng = random.Random(seed)
    w = _Out(out)
    world = len(hosts) * gpus_per_host
    truth = AttemptsTruth(gpus=world, hosts=list(hosts), first_ts=start)
    t = start
    step = 0
    last_save: tuple[int, float] | None = None
    for plan in plans:
        t = _start_ranks(w, t, hosts, gpus_per_host, rng)
        if last_save is not None:
            step = last_save[0]
            t += 30.0
            w.put(t, hosts[0], f"[rank0]:  successfully loaded checkpoint from /ckpt/run at iteration {step}")
        attempt_start: float | None = None
        previous = truth.attempts[-1] if truth.attempts else None
        last_host = hosts[-1]
        while step < plan.until_step:
            step += 1
            t += step_s * (1 + 0.02 * (rng.random() - 0.5))
            if step % log_every == 0:
                w.put(t, last_host, f"[rank{world - 1}]:  iteration {step:8d}/{total_steps:8d} | consumed samples: "
                      f"{step * 512:12d} | elapsed time per iteration (ms): {step_s * 1000:.1f} | learning rate: "
                      f"1.500E-04 | global batch size:   512 | lm loss: {2.2 + 3 / (1 + step / 500):.6E} | "
                      "loss scale: 1.0 | grad norm: 0.812 | number of skipped iterations:   0 | "
                      "number of nan iterations:   0 |")
                if attempt_start is None:
                    attempt_start = t
                    if previous is not None:
                        previous.next_first_step_ts = t
                if previous is not None and previous.passed_ts is None and step >= previous.failure_step:
                    previous.passed_ts = t
            if step % save_every == 0:
                w.put(t, hosts[0], f"[rank0]: saving checkpoint at iteration {step:7d} to /ckpt/run")
                t += save_s
                w.put(t, hosts[0], f"[rank0]:   successfully saved checkpoint at iteration {step:7d} to /ckpt/run")
                last_save = (step, t)
        t += step_s * rng.random()
        start_ts = attempt_start if attempt_start is not None else t
        if plan.ending == "ok":
            w.put(t, hosts[0], "[rank0]: [after training is done] datetime: done")
            break
        failure_ts = t
        culprit = _fail(w, t, plan, hosts, gpus_per_host, rng)
        since = max(last_save[1], start_ts) if last_save is not None else start_ts
        truth.attempts.append(AttemptTruth(
            failure_ts=failure_ts, failure_step=step, checkpoint_step=last_save[0] if last_save else None,
            checkpoint_ts=last_save[1] if last_save else None, attempt_start_ts=start_ts,
            lost_gpu_hours=world * (failure_ts - since) / 3600, culprit_host=culprit))
        t += plan.downtime_s
    truth.lines = w.lines
    return truth


def _start_ranks(w: _Out, t: float, hosts: list[str], per_host: int, rng: random.Random) -> float:
    world = len(hosts) * per_host
    for h, host in enumerate(hosts):
        for local in range(per_host):
            rank = h * per_host + local
            t += 0.01 * rng.random()
            w.put(t, host, f"[rank{rank}]: {host}:{4000 + rank}:{4100 + rank} [{local}] NCCL INFO comm 0x{rank + 4096:x} "
                  f"rank {rank} nranks {world} cudaDev {local} nvmlDev {local} busId {0x18 + 0x10 * local:x}000 "
                  "commId 0x5a1e - Init COMPLETE")
    return t + 5.0


def _fail(w: _Out, t: float, plan: AttemptPlan, hosts: list[str], per_host: int, rng: random.Random) -> str | None:
    world = len(hosts) * per_host
    if plan.ending == "oom":
        r = plan.culprit_rank
        host = hosts[r // per_host]
        for text in ("Traceback (most recent call last):",
                     '  File "/workspace/megatron/pretrain_gpt.py", line 228, in <module>',
                     '  File "/usr/local/lib/python3.10/dist-packages/torch/nn/modules/module.py", line 1532, in _wrapped_call_impl',
                     "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
                     "of 79.15 GiB of which 1.02 GiB is free."):
            w.put(t, host, f"[rank{r}]: {text}")
        w.put(t + 2, hosts[0], f"[rank0]: torch.distributed.elastic.multiprocessing.errors.ChildFailedError: rank {r} failed")
        return None
    host = hosts[plan.culprit_host]
    w.put(t, host, "NVRM: Xid (PCI:0000:8a:00): 79, pid=4242, name=python, GPU has fallen off the bus.")
    t += 600.0
    for rank in range(world):
        if rank // per_host == plan.culprit_host:
            continue
        t += 0.001 * rng.random()
        w.put(t, hosts[rank // per_host], f"[rank{rank}]: [Rank {rank}] Watchdog caught collective operation timeout: "
              "WorkNCCL(SeqNum=88211, OpType=ALLREDUCE, NumelIn=1048576, NumelOut=1048576, Timeout(ms)=600000) ran "
              "for 600043 milliseconds before timing out.")
    return host
