"""A job as its logs are collected: a folder of per-node files, not one merged log.

On-call engineers rarely get one merged stream. A collection script, a Slurm epilog or a shipper leaves
each node's stdout in a file of its own (named by its host in one of several conventions) and each node's
kernel log beside it (`dmesg -T`, raw `dmesg` with seconds since boot, syslog's `kern.log`, `journalctl -k`),
or appends the node's `dmesg` to the job's own output. `write_job_folder` turns a generated multi-node job
(``generate`` with the ``pdsh_torchrun`` style: every line names its host) into such a folder, the host
prefix taken off every line as a per-node file has none, and returns where each file's lines came from:
what a shipper would send as each file's host.

    truth = write_job_folder(Path("job"), scenario="nvlink", seed=3, ranks=16, layout="dmesg_prefix",
                             kernel_clock="raw")

Layouts (`LAYOUTS`): how files are named. Kernel clocks (`KERNEL_CLOCKS`): how kernel lines are stamped.
"""

from __future__ import annotations

import calendar
import io
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from random import Random

from logdx.synth.generate import Truth, generate

__all__ = ["KERNEL_CLOCKS", "LAYOUTS", "FolderTruth", "JobFile", "split_job", "write_job_folder"]

# layout -> (stdout file, kernel file), formatted with the host; `None`: the kernel lines go elsewhere.
LAYOUTS: dict[str, tuple[str, str | None]] = {
    "flat": ("{host}.log", "{host}.dmesg.txt"),
    "dmesg_prefix": ("{host}.out", "dmesg-{host}.txt"),  # a common collection script's naming
    "kern_suffix": ("{host}_stdout.log", "{host}_kern.log"),
    "dmesg_suffix": ("{host}.log", "{host}_dmesg.txt"),
    "per_host_dirs": ("{host}/stdout.log", "{host}/kern.log"),
    # A Slurm epilog that appends each node's dmesg to the job's output.
    "epilog": ("{host}.log", None),
}
# How a kernel line is stamped in its file.
KERNEL_CLOCKS = ("dmesg_T", "raw", "syslog", "syslog_raw", "journal_iso")

_KERNEL_DMESG_T = re.compile(r"^\[(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) (\w{3}) +(\d{1,2}) (\d\d):(\d\d):(\d\d) (\d{4})\] (.*)$")
_KERNEL_SYSLOG = re.compile(r"^(\w{3}) +(\d{1,2}) (\d\d):(\d\d):(\d\d) ([\w.-]+) kernel: (.*)$")
_HOST_PREFIX = re.compile(r"^([a-z][a-z0-9-]*\d[a-z0-9.-]*): ")
_MONTHS = {m: i for i, m in enumerate(("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct",
                                       "Nov", "Dec"), 1)}
# What a node's kernel printed at boot, days before the job: harmless, and in every raw dmesg.
_BOOT_LINES = (
    "Linux version 5.15.0-105-generic (buildd@lcy02-amd64-007) (gcc (Ubuntu 11.4.0-1ubuntu1~22.04) 11.4.0) #115-Ubuntu SMP",
    "Command line: BOOT_IMAGE=/vmlinuz-5.15.0-105-generic root=UUID=3e5c7a3e ro quiet splash",
    "nvidia: loading out-of-tree module taints kernel.",
    "nvidia-nvlink: Nvlink Core is being initialized, major device number 508",
    "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  535.161.08  Tue Mar  5 22:42:15 UTC 2024",
    "mlx5_core 0000:0c:00.0: firmware version: 28.39.1002",
    "mlx5_core 0000:0c:00.0 ibp12s0: Link up",
)


@dataclass(frozen=True, slots=True)
class JobFile:
    """One file of the folder: its path inside it, the host a shipper sends it as, and what it holds."""

    path: str
    host: str
    kind: str  # "stdout" | "kernel"
    lines: tuple[str, ...]


@dataclass(slots=True)
class FolderTruth:
    """The generated job's truth, and how its folder was laid out."""

    truth: Truth
    layout: str
    kernel_clock: str
    files: list[JobFile] = field(default_factory=list)

    @property
    def hosts(self) -> list[str]:
        return list(self.truth.hosts)


def _wall(m: re.Match[str], year: int | None = None) -> float:
    """Epoch seconds of a dmesg -T (month, day, hh, mm, ss, year) or syslog (month, day, hh, mm, ss) match."""
    g = m.groups()
    y = int(g[5]) if year is None else year
    return float(calendar.timegm((y, _MONTHS[g[0]], int(g[1]), int(g[2]), int(g[3]), int(g[4]), 0, 0, 0)))


def _kernel_message(body: str, year: int) -> tuple[float, str] | None:
    """(time, message) of a kernel line as the merged log wrote it (after its host prefix, for dmesg -T)."""
    m = _KERNEL_DMESG_T.match(body)
    if m:
        return _wall(m), m.group(7)
    m = _KERNEL_SYSLOG.match(body)
    if m:
        return _wall(m, year), m.group(7)
    return None


def _stamp(clock: str, host: str, t: float, boot: float, message: str) -> str:
    rel = f"[{t - boot:12.6f}]"
    if clock == "dmesg_T":
        return f"[{time.strftime('%a %b %e %H:%M:%S %Y', time.gmtime(t))}] {message}"
    if clock == "raw":
        return f"{rel} {message}"
    if clock == "syslog":
        return f"{time.strftime('%b %e %H:%M:%S', time.gmtime(t))} {host} kernel: {message}"
    if clock == "syslog_raw":
        return f"{time.strftime('%b %e %H:%M:%S', time.gmtime(t))} {host} kernel: {rel} {message}"
    if clock == "journal_iso":
        return f"{time.strftime('%Y-%m-%dT%H:%M:%S+0000', time.gmtime(t))} {host} kernel: {message}"
    raise ValueError(f"unknown kernel clock {clock!r}")


def split_job(merged: list[str], hosts: list[str], layout: str, kernel_clock: str, rng: Random,
              year: int) -> list[JobFile]:
    """The merged log of a ``pdsh_torchrun`` job as per-node files (`layout`, `kernel_clock`)."""
    stdout_name, kernel_name = LAYOUTS[layout]
    out: dict[str, list[str]] = {h: [] for h in hosts}
    kernel: dict[str, list[tuple[float, str]]] = {h: [] for h in hosts}
    first_ts: float | None = None
    for line in merged:
        m = _HOST_PREFIX.match(line)
        host, body = (m.group(1), line[m.end():]) if m else (None, line)
        found = _kernel_message(body, year)
        if found is not None:
            syslog = _KERNEL_SYSLOG.match(body)
            kernel_host = syslog.group(6) if syslog else host
            if kernel_host in kernel:
                kernel[kernel_host].append(found)
                first_ts = found[0] if first_ts is None else min(first_ts, found[0])
                continue
        out.setdefault(host or hosts[0], []).append(body)  # a line naming no host: the head node's
    boots = {h: (first_ts or 1.7e9) - rng.uniform(2, 30) * 86400 for h in hosts}
    files: list[JobFile] = []
    for host in hosts:
        klines = [_stamp(kernel_clock, host, boots[host] + 3.2 + 0.4 * i, boots[host], text)
                  for i, text in enumerate(_BOOT_LINES)]
        klines += [_stamp(kernel_clock, host, t, boots[host], text) for t, text in kernel[host]]
        lines = out.get(host, [])
        if kernel_name is None and kernel[host]:
            lines = [*lines, "+ dmesg", *klines]  # the epilog's `set -x` echo, then the node's kernel log
        files.append(JobFile(stdout_name.format(host=host), host, "stdout", tuple(lines)))
        if kernel_name is not None:
            files.append(JobFile(kernel_name.format(host=host), host, "kernel", tuple(klines)))
    return files


def write_job_folder(folder: Path | None, *, scenario: str, seed: int, ranks: int = 16, gpus_per_host: int = 8,
                     lines: int = 6000, layout: str = "flat", kernel_clock: str = "dmesg_T",
                     noise: float = 1.0, start: float | None = None) -> FolderTruth:
    """Generate a job and write it as a folder of per-node files (`folder` None: only return them). `start`:
    when the job starts (epoch seconds; by default a moment of 2024-2025 drawn from the seed)."""
    buf = io.StringIO()
    truth = generate(buf, scenario=scenario, seed=seed, ranks=ranks, gpus_per_host=gpus_per_host, lines=lines,
                     style="pdsh_torchrun", noise=noise, start=start)
    text = buf.getvalue()
    stamped = re.search(r"\b(20\d\d)-\d\d-\d\d", text[:200_000])
    year = int(stamped.group(1)) if stamped else 2024  # syslog stamps carry no year
    files = split_job(text.splitlines(), list(truth.hosts), layout, kernel_clock, Random(seed), year)
    if folder is not None:
        for f in files:
            path = folder / f.path
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(line + "\n" for line in f.lines), encoding="utf-8")
    return FolderTruth(truth=truth, layout=layout, kernel_clock=kernel_clock, files=files)
