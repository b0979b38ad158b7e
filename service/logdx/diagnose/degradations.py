"""What a job's start-up says will make it slow, from NCCL's own INFO lines (NCCL_DEBUG=INFO): advice, never an
action, in the report of a healthy job as of a failed one.

- `network_fallback`: a host's ranks chose TCP sockets (`NCCL INFO Using network Socket`) while other hosts of the
  job use InfiniBand or another RDMA network: that host has no usable HCA (a module not loaded, a container
  without the RDMA device, NCCL_IB_DISABLE), and every collective runs at its sockets' speed.
- `gdr_disabled`: GPU Direct RDMA disabled on a host (`GPU Direct RDMA Disabled for HCA 0 'mlx5_0'`) while other
  hosts have it enabled: its transfers go through host memory (nvidia-peermem not loaded).
- `p2p_disabled`: `NCCL_P2P_DISABLE set by environment to 1` on a host: its GPUs talk to each other through host
  memory instead of NVLink or PCIe peer-to-peer (a workaround that outlived its bug, or a wrong environment).

For the transport, only a host that differs from the job's other hosts is named: a cluster whose every host runs
on sockets says nothing here (it may have nothing else). P2P disabled is named wherever it is set: it is a choice
someone made, and it costs the same on every host.
"""

from __future__ import annotations

from logdx.model import CompressionSummary, Degradation

__all__ = ["degradations_of"]

_SOCKET = "Socket"
_EFFECT = {
    "network_fallback": "its collectives run over TCP sockets while the other hosts use {others}: the whole job "
                        "waits for this host (typically 5-20x less bandwidth); check its HCA (ibstat, the RDMA "
                        "device in the container, NCCL_IB_DISABLE, NCCL_NET)",
    "gdr_disabled": "GPU Direct RDMA is off on this host while the others have it: its transfers are staged through "
                    "host memory (load nvidia-peermem, check NCCL_NET_GDR_LEVEL)",
    "p2p_disabled": "NCCL_P2P_DISABLE is set: this host's GPUs exchange data through host memory instead of NVLink or "
                    "PCIe peer-to-peer (often several times slower within the node); unset it unless a known bug needs it",
}


def degradations_of(summary: CompressionSummary) -> list[Degradation]:
    named = {h: kinds for h, kinds in summary.nccl_setup.items() if h}  # to differ, a host must have a name
    return _network_fallbacks(named) + _gdr_disabled(named) + _p2p_disabled(summary.nccl_setup)


def _network_fallbacks(setup: dict[str, dict[str, tuple[str, int, str]]]) -> list[Degradation]:
    networks = {h: kinds["network"] for h, kinds in setup.items() if "network" in kinds}
    others = sorted({net for net, _, _ in networks.values() if net != _SOCKET})
    if not others:
        return []
    return [Degradation("network_fallback", host, line_no, raw, _EFFECT["network_fallback"].format(others="/".join(others)))
            for host, (net, line_no, raw) in sorted(networks.items()) if net == _SOCKET]


def _gdr_disabled(setup: dict[str, dict[str, tuple[str, int, str]]]) -> list[Degradation]:
    gdr = {h: kinds["gdr"] for h, kinds in setup.items() if "gdr" in kinds}
    if not any(state == "Enabled" for state, _, _ in gdr.values()):
        return []
    return [Degradation("gdr_disabled", host, line_no, raw, _EFFECT["gdr_disabled"])
            for host, (state, line_no, raw) in sorted(gdr.items()) if state == "Disabled"]


def _p2p_disabled(setup: dict[str, dict[str, tuple[str, int, str]]]) -> list[Degradation]:
    return [Degradation("p2p_disabled", host, kinds["p2p"][1], kinds["p2p"][2], _EFFECT["p2p_disabled"])
            for host, kinds in sorted(setup.items()) if "p2p" in kinds]
