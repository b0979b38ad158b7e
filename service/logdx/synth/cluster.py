"""Who runs where in a synthetic job: hosts, ranks, GPUs, process ids and addresses."""

from __future__ import annotations

from dataclasses import dataclass
from random import Random

# PCI bus numbers of the eight GPUs of a DGX A100 / DGX H100, as `nvidia-smi` and Xids show them.
_BUS_NUMBERS = {
    "A100": ("07", "0f", "47", "4e", "87", "90", "b7", "bd"),
    "H100": ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db"),
}
_CAPACITY_GIB = {"A100": "79.15", "H100": "79.11"}
_PRODUCT = {"A100": "NVIDIA A100-SXM4-80GB", "H100": "NVIDIA H100 80GB HBM3"}
_HOST_PATTERNS: tuple[tuple[str, str | None], ...] = (
    ("node-{:02d}", None),
    ("gpu-a100-{:03d}", "A100"),
    ("gpu-h100-{:03d}", "H100"),
    ("nid{:06d}", None),
)


@dataclass(frozen=True, slots=True)
class Cluster:
    hosts: tuple[str, ...]
    ips: tuple[str, ...]
    gpus_per_host: int
    world_size: int
    gpu_model: str  # "A100" | "H100"
    bus_ids: tuple[str, ...]  # per local GPU, as an Xid prints it: "0000:4e:00"
    worker_pids: tuple[int, ...]  # per rank
    agent_pids: tuple[int, ...]  # per host: the launcher (torchrun agent, deepspeed launch.py)
    master_port: int
    slurm_job_id: int

    @property
    def n_hosts(self) -> int:
        return len(self.hosts)

    @property
    def capacity_gib(self) -> str:
        return _CAPACITY_GIB[self.gpu_model]

    @property
    def product(self) -> str:
        return _PRODUCT[self.gpu_model]

    def host_index(self, rank: int) -> int:
        return rank // self.gpus_per_host

    def host(self, rank: int) -> str:
        return self.hosts[rank // self.gpus_per_host]

    def local_rank(self, rank: int) -> int:
        return rank % self.gpus_per_host

    def ranks_on(self, host_index: int) -> range:
        start = host_index * self.gpus_per_host
        return range(start, min(start + self.gpus_per_host, self.world_size))

    def bus_id(self, rank: int) -> str:
        return self.bus_ids[self.local_rank(rank)]

    def nccl_bus(self, rank: int) -> str:
        """NCCL's short form of the bus id: ``4e000`` for 0000:4e:00.0."""
        return self.bus_id(rank).split(":")[1] + "000"


def make_cluster(rng: Random, world_size: int, gpus_per_host: int) -> Cluster:
    if world_size < 1 or gpus_per_host < 1:
        raise ValueError("ranks and gpus_per_host must be positive")
    n_hosts = -(-world_size // gpus_per_host)
    pattern, model = _HOST_PATTERNS[rng.randrange(len(_HOST_PATTERNS))]
    gpu_model = model or rng.choice(("A100", "H100"))
    # Slurm allocations are rarely contiguous: pick sorted numbers from a wider range.
    first = rng.randrange(0, 40) if "nid" not in pattern else rng.randrange(1000, 9000)
    numbers = sorted(rng.sample(range(first, first + 2 * n_hosts + 6), n_hosts))
    hosts = tuple(pattern.format(n) for n in numbers)
    subnet = rng.randrange(1, 250)
    ips = tuple(f"10.{subnet}.{n // 200}.{n % 200 + 10}" for n in numbers)
    buses: tuple[str, ...] = _BUS_NUMBERS[gpu_model]
    if gpus_per_host > len(buses):  # exotic boxes: invent further distinct bus numbers
        extra = [f"{b:02x}" for b in range(0x10, 0xFF) if f"{b:02x}" not in buses]
        buses = buses + tuple(sorted(rng.sample(extra, gpus_per_host - len(buses))))
    bus_ids = tuple(f"0000:{b}:00" for b in buses[:gpus_per_host])
    agent_pids: list[int] = []
    worker_pids: list[int] = []
    for h in range(n_hosts):
        agent = rng.randrange(1000, 400000)
        agent_pids.append(agent)
        for local in range(min(gpus_per_host, world_size - h * gpus_per_host)):
            worker_pids.append(agent + 3 + local)
    return Cluster(
        hosts=hosts,
        ips=ips,
        gpus_per_host=gpus_per_host,
        world_size=world_size,
        gpu_model=gpu_model,
        bus_ids=bus_ids,
        worker_pids=tuple(worker_pids),
        agent_pids=tuple(agent_pids),
        master_port=rng.choice((29500, 29400, 6000, 12355, 23456)),
        slurm_job_id=rng.randrange(100000, 9999999),
    )
