"""How lines get prefixed on their way into the merged log, and which launcher that implies.

| style          | a rank's line              | a node launcher's line | launcher  |
|----------------|----------------------------|------------------------|-----------|
| torchrun       | ``[rank3]:msg``            | ``msg``                | torchrun  |
| torchrun_tee   | ``[default3]:[rank3]:msg`` | ``msg``                | torchrun  |
| srun           | `` 3: msg`` (``srun -l``)  | (none: srun starts ranks) | srun   |
| srun_torchrun  | ``1: [rank11]:msg``        | ``1: msg`` (task = node) | torchrun |
| pdsh           | ``node-03: msg``           | ``node-03: msg``       | deepspeed |
| pdsh_torchrun  | ``node-03: [rank27]:msg``  | ``node-03: msg``       | torchrun  |
| mpirun         | ``[1,3]<stdout>:msg``      | (none: mpirun starts ranks) | mpirun |

``srun -l`` pads task numbers to the width of the largest one, as Slurm does. With plain
``pdsh`` a rank is only known from what the line says (``[Rank 5]``...), as in real DeepSpeed runs.
``mpirun`` is Open MPI's ``mpirun --tag-output --merge-stderr-to-stdout``: every line of rank N of the
application (job 1) carries ``[1,N]<stdout>:`` (format as in the Open MPI users' posts and the NCCL
tests' output quoted in public threads, e.g. ``[1,3]<stdout>:test-nccl-efa-worker-0:23:75 [3] NCCL INFO``).
"""

from __future__ import annotations

from dataclasses import dataclass

from logdx.synth.cluster import Cluster


@dataclass(frozen=True, slots=True)
class Style:
    name: str
    launcher: str  # "torchrun" | "srun" | "deepspeed"
    carries_rank: bool  # whether a rank's lines name the rank in their prefix

    def rank_prefixes(self, cluster: Cluster) -> list[str]:
        return [self._rank_prefix(cluster, r) for r in range(cluster.world_size)]

    def agent_prefixes(self, cluster: Cluster) -> list[str]:
        return [self._agent_prefix(cluster, h) for h in range(cluster.n_hosts)]

    def _rank_prefix(self, cluster: Cluster, rank: int) -> str:
        host_index = cluster.host_index(rank)
        match self.name:
            case "torchrun":
                return f"[rank{rank}]:"
            case "torchrun_tee":
                return f"[default{cluster.local_rank(rank)}]:[rank{rank}]:"
            case "srun":
                width = len(str(cluster.world_size - 1))
                return f"{rank:>{width}}: "
            case "srun_torchrun":
                width = len(str(cluster.n_hosts - 1))
                return f"{host_index:>{width}}: [rank{rank}]:"
            case "pdsh":
                return f"{cluster.hosts[host_index]}: "
            case "pdsh_torchrun":
                return f"{cluster.hosts[host_index]}: [rank{rank}]:"
            case "mpirun":
                return f"[1,{rank}]<stdout>:"
        raise ValueError(f"unknown style {self.name!r}")

    def _agent_prefix(self, cluster: Cluster, host_index: int) -> str:
        if self.name == "srun_torchrun":
            return f"{host_index:>{len(str(cluster.n_hosts - 1))}}: "
        if self.name.startswith("pdsh"):
            return f"{cluster.hosts[host_index]}: "
        return ""


STYLES: dict[str, Style] = {
    s.name: s
    for s in (
        Style("torchrun", "torchrun", True),
        Style("torchrun_tee", "torchrun", True),
        Style("srun", "srun", True),
        Style("srun_torchrun", "torchrun", True),
        Style("pdsh", "deepspeed", False),
        Style("pdsh_torchrun", "torchrun", True),
        Style("mpirun", "mpirun", True),
    )
}
