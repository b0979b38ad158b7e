"""Who ran where: the job's topology as its lines state it, kept beside the compressor's template counts.

NCCL's init lines tie a rank to its host, GPU and PCI bus; torchrun's failure box, MPICH's abort line, srun's
error lines, DeepSpeed's launcher and the scheduler's allocation name ranks, hosts and processes; NCCL's
start-up lines say how each host's ranks talk (`nccl_setup`). The compressor (`compress.py`) marks the shapes
of such lines once (`is_topology_line`) and hands their lines here; what is found goes into the
`CompressionSummary` (`Topology.fill`), which the diagnosis reads (culprits, Xid -> rank, degradations).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import hostlist

from logdx.compress_config import CompressConfig
from logdx.hosts import clean_hostname
from logdx.model import CompressionSummary, Record, TemplateStats
from logdx.patterns import pci_key

# NCCL's communicator init line ties a rank to its host, process, CUDA device and PCI bus.
# Lines that state which host a rank ran on, besides NCCL's init lines: MPICH's abort line
# ("[Rank 2047] [job id 5.0] [Fri Aug 28 ...] [nid004069]") and torchrun's error summary box, whose
# "host :" and "rank :" fields come on consecutive lines.
_MPICH_RANK_HOST = re.compile(r"\[Rank (\d+)\] \[job id [^\]]*\] \[[^\]]*\] \[([A-Za-z][\w.-]*)\]")
_BOX_HOST = re.compile(r"^\s*host\s+: ([A-Za-z][\w.-]*)\s*$")
_BOX_RANK = re.compile(r"^\s*rank\s+: (\d+) \(local_rank")
_BOX_PID = re.compile(r"^\s*exitcode\s+: -?\d+ \(pid: (\d+)\)")
# DeepSpeed's launcher on each node: "nnodes=2, num_local_procs=4, node_rank=1", then per worker "process 31870
# spawned with command: [..., '--local_rank=0', ...]": the worker's pid and rank (ranks are numbered node by node).
_DS_NODE = re.compile(r"\bnnodes=\d+, num_local_procs=(\d+), node_rank=(\d+)")
_DS_SPAWN = re.compile(r"\bprocess (\d+) spawned with command: .*'--local_rank=(\d+)'")
# What ends one rank's entry of that box: the next entry ("[2]:"), the box's rules, its "Root Cause" part.
_BOX_END = re.compile(r"^\s*(?:\[\d+\]:\s*$|={8,}|-{8,}|Root Cause|Failures:|\S+ FAILED\s*$)")
# Which stream wrote a line (its upload, host and rank label): a torchrun box is one stream's lines.
_Origin = tuple[int, str | None, int | None]


def _origin(rec: Record) -> _Origin:
    return rec.feed, rec.host, rec.rank


# srun's word on a task: "srun: error: node12: task 5: Out Of Memory", "...: tasks 0-3,6: Exited with exit code 1".
_SRUN_TASKS = re.compile(r"^srun: error: ([A-Za-z][\w.-]*): tasks? ([\d,-]{1,200}): ")
# The job's allocation as its scheduler prints it: PBS/Torque mail "Exec host: n1/0+n2/0", qstat -f
# "exec_host = n1/0*8+n2/0*8", Slurm "SLURM_JOB_NODELIST=n[01-04]" / scontrol "NodeList=n1", LSF's
# job report "Job was executed on host(s) <8*n1>, <8*n2>, in queue <gpu>".
_ALLOCATION = re.compile(
    r"(?:\bExec host:|\bexec_host = |\bSLURM_(?:JOB_)?NODELIST=|\bNodeList=|\bexecuted on host\(s\) )\s*(.+)")
_MAX_ALLOCATION = 4096
_MAX_BOXES = 4096
_HOSTLIST_PART = re.compile(r"(?:[^,\[]|\[[^\]]*\])+")  # a comma inside brackets is a range's
# NCCL's start-up lines on the transport: "NCCL INFO Using network IB" (and 2.19+'s "Assigned NET plugin Socket to
# comm"), "NET/IB : GPU Direct RDMA Disabled for HCA 0 'mlx5_0'", "NCCL_P2P_DISABLE set by environment to 1"; the
# interface it bootstraps on ("Bootstrap : Using ib0:10.0.0.1<0>", bootstrap.cc; "NET/IB : Using [0]mlx5_0:1/IB ;
# OOB ib0:10.0.0.1<0>", net_ib.cc), its channels ("32 coll channels, 32 collnet channels, ...", init.cc), its
# version ("NCCL version 2.18.1+cuda12.1") and the CUDA driver's ("cudaDriverVersion 12020").
_NCCL_SETUP = re.compile(r"NCCL INFO (?:Using network (?P<network>\w+)|Assigned NET plugin (?P<network2>\w+) to comm"
                         r"|.*GPU Direct RDMA (?P<gdr>Enabled|Disabled) for HCA"
                         r"|NCCL_P2P_DISABLE set by environment to (?P<p2p>[1-9])"
                         r"|Bootstrap ?: Using \[?\d*\]?(?P<bootstrap>[\w.-]+):"
                         r"|NET/IB : Using .*; OOB (?P<oob>[\w.-]+):"
                         r"|(?P<channels>\d+) coll channels, "
                         r"|NCCL version (?P<version>[\w.+-]+)"
                         r"|cudaDriverVersion (?P<driver>\d+))")
_NCCL_COMM = re.compile(r"NCCL INFO comm 0x[0-9a-fA-F]+ rank (\d+) nr?[Rr]anks \d+ cudaDev (\d+)(?: nvmlDev \d+)? busId ([0-9a-fA-F]+)")


def is_topology_line(text: str, masked: str) -> bool:
    """Whether lines of this shape may say something of the topology (asked once per shape)."""
    return (("NCCL INFO comm" in masked and "busId" in masked) or "[Rank <*>] [job id" in masked
            or _BOX_HOST.match(text) is not None or _BOX_RANK.match(text) is not None
            or _ALLOCATION.search(text) is not None or _SRUN_TASKS.match(text) is not None
            or "num_local_procs=" in masked or "spawned with command" in masked
            or _NCCL_SETUP.search(text) is not None)


@dataclass
class Topology:
    """The ranks, hosts, GPUs and processes the lines named, and the scheduler's allocation."""

    config: CompressConfig = field(default_factory=CompressConfig)

    def __post_init__(self) -> None:
        self._max_rank = -1
        self._hosts: set[str] = set()
        self._rank_hosts: dict[int, str] = {}
        self._allocated: list[str] | None = None  # the job's nodes, from the scheduler's own lines
        # The "host :" of a torchrun error box, until its "rank :", with the stream that printed it.
        self._box_host: tuple[_Origin, str] | None = None
        # The rank (and host) whose entry of that box is being printed, and the stream printing it: its
        # error lines are that rank's. Another stream's lines in between (other nodes' uploads interleave)
        # are not. Read by the compressor on every line (`box`), so a plain attribute.
        self.box: tuple[_Origin, int, str | None] | None = None
        self._srun_tasks: dict[int, str] = {}  # srun's task -> node, from its error lines
        # host -> what NCCL's start-up said of its transport: "network" / "gdr" / "p2p" -> (value, line, raw line)
        self._nccl_setup: dict[str, dict[str, tuple[str, int, str]]] = {}
        self.nccl_setup_words = 0  # how many words `_nccl_setup` holds: what changed since a reader last looked
        # (first line, last line, rank, host of the stream) of ranks' entries in that box
        self._boxes: list[tuple[int, int, int, str | None]] = []
        self._gpu_ranks: dict[str, int] = {}
        self._ds_nodes: dict[str, tuple[int, int]] = {}  # host -> (DeepSpeed's workers on it, its node rank)
        self.lines_in = 0  # the compressor's line count at the line being noted (`note`): where a box begins

    def rank_host(self, rank: int) -> str | None:
        """The host a rank ran on, when a line said it."""
        return self._rank_hosts.get(rank)

    def fill(self, summary: CompressionSummary, srun_tasks_are_ranks: bool) -> None:
        """What the lines said of the topology, into the compressor's summary (see `Compressor.summary`)."""
        summary.world_size = self._max_rank + 1
        summary.hosts = sorted(self._hosts)
        summary.rank_hosts = {**self._srun_tasks, **self._rank_hosts} if srun_tasks_are_ranks else dict(self._rank_hosts)
        summary.gpu_ranks = dict(self._gpu_ranks)
        summary.allocated_hosts = list(self._allocated or [])
        summary.failure_boxes = list(self._boxes)
        summary.nccl_setup = {h: dict(kinds) for h, kinds in self._nccl_setup.items()}
        summary.srun_task_hosts = dict(self._srun_tasks) if srun_tasks_are_ranks else {}
        summary.launcher_hosts = sorted(set(self._srun_tasks.values()))

    def note_origin(self, rank: int | None, host: str | None, stats: TemplateStats) -> None:
        """A line's rank and host (its prefix's), on every line that has one: the job's ranks and hosts, and
        who printed the line's template (`stats`)."""
        cap = self.config.max_ids_per_template
        if rank is not None:
            if rank > self._max_rank:
                self._max_rank = rank
            if len(stats.ranks) < cap:
                stats.ranks.add(rank)
        if host is not None:
            if rank is not None and rank not in self._rank_hosts and len(self._rank_hosts) < cap:
                self._rank_hosts[rank] = host
            if len(self._hosts) < cap:
                self._hosts.add(host)
            if len(stats.hosts) < cap:
                stats.hosts.add(host)

    def note(self, rec: Record, lines_in: int) -> None:
        """A line of a shape `is_topology_line` marked; `lines_in`: the compressor's count of lines so far."""
        self.lines_in = lines_in
        if self._note_named_rank_host(rec) or self._note_nccl_setup(rec):
            return
        m = _NCCL_COMM.search(rec.text)
        if m is None or rec.host is None or len(self._gpu_ranks) > 3 * self.config.max_ids_per_template:
            return
        rank = int(m.group(1))
        self._gpu_ranks[f"{rec.host}|dev:{m.group(2)}"] = rank
        self._gpu_ranks[f"{rec.host}|bus:{pci_key(m.group(3))}"] = rank
        if rec.pid is not None:
            self._gpu_ranks[f"{rec.host}|pid:{rec.pid}"] = rank
        self._rank_hosts.setdefault(rank, rec.host)
        self._max_rank = max(self._max_rank, rank)

    def _note_nccl_setup(self, rec: Record) -> bool:
        """NCCL's start-up word on how a host's ranks talk to the others: the network it chose (IB, Socket...),
        GPU Direct RDMA on or off, P2P off, the interface it bootstraps on, its channels, NCCL's and the CUDA
        driver's versions; the first line of each kind per host (what diagnose/degradations.py reads)."""
        m = _NCCL_SETUP.search(rec.text)
        if m is None:
            return False
        host = rec.host or ""
        if len(self._nccl_setup) < self.config.max_sources or host in self._nccl_setup:
            seen = self._nccl_setup.setdefault(host, {})
            kind = m.lastgroup or ""
            value = "disabled" if kind == "p2p" else m.group(kind)
            # One word per kind per host: its first (the default process group's communicator comes first).
            word = {"network2": "network", "oob": "bootstrap"}.get(kind, kind)
            if word not in seen:
                seen[word] = (value, rec.line_no, rec.raw)
                self.nccl_setup_words += 1
        return True

    @property
    def nccl_setup(self) -> dict[str, dict[str, tuple[str, int, str]]]:
        """host -> NCCL's start-up words so far (the streaming service's advice reads it; do not modify)."""
        return self._nccl_setup

    def _note_named_rank_host(self, rec: Record) -> bool:
        """A line that names a rank and its host in words (not NCCL's init line), or the job's
        allocation; True if it was one."""
        text = rec.text
        if (m := _ALLOCATION.search(text)) is not None:
            if self._allocated is None:  # the first statement of the allocation counts
                self._allocated = allocation_hosts(m.group(1))
            return True
        if (m := _BOX_HOST.match(text)) is not None:
            self._box_host = (_origin(rec), m.group(1))
            return True
        if (m := _BOX_RANK.match(text)) is not None:
            rank = int(m.group(1))
            origin = _origin(rec)
            host = self._box_host[1] if self._box_host is not None and self._box_host[0] == origin else None
            if host is not None:
                self._rank_hosts.setdefault(rank, host)
            self.box = (origin, rank, host)
            self._box_host = None
            if len(self._boxes) < _MAX_BOXES:
                self._boxes.append((self.lines_in, self.lines_in, rank, rec.host or host))
            return True
        if (m := _SRUN_TASKS.match(text)) is not None:
            host = clean_hostname(m.group(1))
            if host is not None:
                for task in _task_list(m.group(2)):
                    if len(self._srun_tasks) < self.config.max_ids_per_template:
                        self._srun_tasks.setdefault(task, host)
            return True
        if (m := _MPICH_RANK_HOST.search(text)) is not None:
            self._rank_hosts.setdefault(int(m.group(1)), m.group(2))
            return True
        return self._note_deepspeed_worker(rec)

    def _note_deepspeed_worker(self, rec: Record) -> bool:
        """DeepSpeed's launcher lines on a node: its rank among the nodes, then each worker's pid and local rank."""
        if rec.host is None:
            return False
        if (m := _DS_NODE.search(rec.text)) is not None:
            if len(self._ds_nodes) < self.config.max_ids_per_template:
                self._ds_nodes[rec.host] = (int(m.group(1)), int(m.group(2)))
            return True
        node = self._ds_nodes.get(rec.host)
        if node is not None and (m := _DS_SPAWN.search(rec.text)) is not None:
            procs, node_rank = node
            rank = node_rank * procs + int(m.group(2))
            self._note_pid(rec.host, int(m.group(1)), rank)
            self._rank_hosts.setdefault(rank, rec.host)
            return True
        return False

    def _note_pid(self, host: str, pid: int, rank: int) -> None:
        """Which rank a process of a host is (its stack dump, a ps row, an Xid name it by pid)."""
        if len(self._gpu_ranks) <= 3 * self.config.max_ids_per_template:
            self._gpu_ranks.setdefault(f"{host}|pid:{pid}", rank)

    def within_box(self, rec: Record) -> None:
        """A line of a rank's entry in torchrun's failure box (its exit code, the traceback of its error file) is
        that rank's report: it gets the rank (and the host) the entry names, unless its own prefix says another."""
        assert self.box is not None
        origin, rank, host = self.box
        if _origin(rec) != origin:
            return
        if _BOX_END.match(rec.text) is not None or _BOX_HOST.match(rec.text) is not None:
            self.box = None
            return
        if rec.rank is None:
            rec.rank = rank
            if rec.host is None:
                rec.host = host
        if "(pid: " in rec.text and (m := _BOX_PID.match(rec.text)) is not None and (host or rec.host):
            self._note_pid(host or rec.host or "", int(m.group(1)), rank)
        if self._boxes and self._boxes[-1][2] == rank:
            first, _, _, box_host = self._boxes[-1]
            self._boxes[-1] = (first, rec.line_no, rank, box_host)


def _task_list(spec: str) -> list[int]:
    """srun's task list, "0-3,6" -> [0, 1, 2, 3, 6] (at most 4096)."""
    tasks: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            return []
        tasks += range(int(lo), min(int(hi or lo), int(lo) + 4096) + 1)
        if len(tasks) > 4096:
            return tasks[:4096]
    return tasks


def allocation_hosts(spec: str) -> list[str]:
    """The hosts of an allocation as a scheduler writes it ("n1/0+n2/0*8", "n[01-03,07],m5",
    "<8*n1>, <n2>, in queue <q>"); [] when any part of it is not a plain host name."""
    spec = spec.strip()
    if spec.startswith("<"):  # LSF
        parts = re.findall(r"<(?:\d+\*)?([^>]+)>", spec.split(" in queue", 1)[0])
    elif "+" in spec or "/" in spec:  # PBS: host/slot[*count] joined by +
        parts = [p.split("/", 1)[0] for p in spec.split()[0].split("+")]
    else:  # Slurm hostlist
        parts = _expand_hostlist(spec.split()[0].rstrip(",;"))
    hosts: list[str] = []
    for part in parts:
        host = clean_hostname(part.strip())
        if host is None or len(hosts) >= _MAX_ALLOCATION:
            return []
        if host not in hosts:
            hosts.append(host)
    return hosts


def _expand_hostlist(expr: str) -> list[str]:
    """Slurm's hostlist syntax ("gpu[01-03,07]-ib[1,3],login1"), expanded by python-hostlist one
    top-level part at a time, so that a huge list stops past `_MAX_ALLOCATION` names (each part is
    bounded by the library); [] when a part is not a hostlist."""
    names: list[str] = []
    for part in _HOSTLIST_PART.findall(expr):
        try:
            names += hostlist.expand_hostlist(part)
        except hostlist.BadHostlist:
            return []
        if len(names) > _MAX_ALLOCATION:
            break
    return names

