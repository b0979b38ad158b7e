"""A job's logs as one file per host, the way a cluster's log collector leaves them: lines that name no
rank (each host's file is its own), timestamped, with the noise a trainer prints. One host's GPU falls
off the bus and its training stops; the others go on until the NCCL watchdog times out."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from pathlib import Path

HOSTS = ("gpu-node-01", "gpu-node-02", "gpu-node-03", "gpu-node-04")
CULPRIT = "gpu-node-03"
ROOT = "kernel: NVRM: Xid (PCI:0000:07:00): 79, pid=4242, name=python, GPU has fallen off the bus."


def write_host_files(folder: Path, *, steps: int = 120, fail_at: int = 90, seed: int = 7) -> list[Path]:
    """`folder`/HOST.log for every host; the culprit's progress ends at step `fail_at`, the others' at `steps`."""
    rnd = random.Random(seed)
    t0 = datetime(2026, 11, 30, 10, 0, 0, tzinfo=UTC)

    def at(sec: float) -> str:
        return (t0 + timedelta(seconds=sec)).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for host in HOSTS:
        lines = [f"{at(0)} INFO launcher: starting 8 workers on {host}"]
        last = fail_at if host == CULPRIT else steps
        for step in range(1, last + 1):
            sec = 5 + step * 2 + rnd.random()
            if step % 7 == 0:
                lines.append(f"{at(sec - 1)} INFO dataloader: prefetched shard {rnd.randrange(9999):04d}")
            lines.append(f"{at(sec)} INFO train: step {step} loss {2.5 - step * 0.004 + rnd.random() * 0.01:.4f} "
                         f"lr 3.0e-04 step_time {1.9 + rnd.random() * 0.2:.2f}s")
        fail = 5 + fail_at * 2 + 1.5
        if host == CULPRIT:
            lines += [f"{at(fail)} {ROOT}",
                      f"{at(fail + 1)} ERROR train: RuntimeError: CUDA error: unspecified launch failure"]
        else:
            lines.append(f"{at(fail + 600)} ERROR train: [E ProcessGroupNCCL.cpp:607] Watchdog caught collective "
                         "operation timeout: WorkNCCL(SeqNum=9001, OpType=ALLREDUCE) ran for 600012 milliseconds "
                         "before timing out.")
        path = folder / f"{host}.log"
        path.write_text("\n".join(lines) + "\n")
        paths.append(path)
    return paths
