"""What a job's start-up says will make it slow, from NCCL's own INFO lines (NCCL_DEBUG=INFO): advice, never an
action, in the report of a healthy job as of a failed one.

- `network_fallback`: a host's ranks chose TCP sockets (`NCCL INFO Using network Socket`) while other hosts of the
  job use InfiniBand or another RDMA network: that host has no usable HCA (a module not loaded, a container
  without the RDMA device, NCCL_IB_DISABLE), and every collective runs at its sockets' speed.
- `gdr_disabled`: GPU Direct RDMA disabled on a host (`GPU Direct RDMA Disabled for HCA 0 'mlx5_0'`) while other
  hosts have it enabled: its transfers go through host memory (nvidia-peermem not loaded).
- `p2p_disabled`: `NCCL_P2P_DISABLE set by environment to 1` on a host: its GPUs talk to each other through host
  memory instead of NVLink or PCIe peer-to-peer (a workaround that outlived its bug, or a wrong environment).

- `bootstrap_interface`: a host bootstraps (and runs NCCL's socket traffic) on another interface than the job's
  other hosts (`Bootstrap : Using eth0:10.0.0.1<0>` where the others print `ib0`; or the `OOB` of `NET/IB : Using
  ...; OOB eth0:...`): NCCL_SOCKET_IFNAME differs there, or that host lacks the interface the others use.
- `fewer_channels`: a host's communicator has fewer channels than the same communicator on the other hosts
  (`16 coll channels, 16 collnet channels, 0 nvls channels, 16 p2p channels, 16 p2p channels per peer` where the
  others print 32): fewer NICs or GPUs seen (a missing HCA, a PCIe topology NCCL reads differently,
  NCCL_MIN/MAX_NCHANNELS), and every ring runs at that host's width.
- `nccl_version_differs` / `driver_version_differs`: `NCCL version 2.18.1+cuda12.1` or `cudaDriverVersion 12020`
  on a host differs from the other hosts' (a stale container image, a node not upgraded with the rest).

For what every host prints, only a host that differs from the job's other hosts is named, and only when the
others agree (at least two of them, a strict majority): a cluster whose every host runs on sockets says nothing
here (it may have nothing else); two hosts that disagree do not say which is odd. P2P disabled is named wherever
it is set: it is a choice someone made, and it costs the same on every host. A PCIe link below its peers is not
read: NCCL_DEBUG=INFO prints no link width, and `nvidia-smi -q`'s "Link Width" block is not printed by jobs.
"""

from __future__ import annotations

from collections import Counter

from logdx.model import CompressionSummary, Degradation

__all__ = ["degradations_in", "degradations_of"]

_SOCKET = "Socket"
_EFFECT = {
    "network_fallback": "its collectives run over TCP sockets while the other hosts use {others}: the whole job "
                        "waits for this host (typically 5-20x less bandwidth); check its HCA (ibstat, the RDMA "
                        "device in the container, NCCL_IB_DISABLE, NCCL_NET)",
    "gdr_disabled": "GPU Direct RDMA is off on this host while the others have it: its transfers are staged through "
                    "host memory (load nvidia-peermem, check NCCL_NET_GDR_LEVEL)",
    "p2p_disabled": "NCCL_P2P_DISABLE is set: this host's GPUs exchange data through host memory instead of NVLink or "
                    "PCIe peer-to-peer (often several times slower within the node); unset it unless a known bug needs it",
    "bootstrap_interface": "NCCL bootstraps on {value} here while the other hosts use {others}: its socket traffic "
                           "(bootstrap, and the transport if it falls back to sockets) takes another network; check "
                           "NCCL_SOCKET_IFNAME and the interfaces on this host",
    "fewer_channels": "{value} coll channels here while the other hosts' communicator has {others}: every ring and "
                      "tree runs at this host's width (a missing HCA or GPU link NCCL did not see, "
                      "NCCL_MAX_NCHANNELS); compare its `nvidia-smi topo -m` and `ibstat` with a healthy host's",
    "nccl_version_differs": "NCCL {value} here, {others} on the other hosts: mixed NCCL versions may pick different "
                            "algorithms or protocols, hang or fail at init; run one image everywhere",
    "driver_version_differs": "CUDA driver {value} here, {others} on the other hosts: this node was not upgraded "
                              "(or downgraded) with the rest; drain it for the driver update",
}
# The kinds read as "one host differs from the agreeing others": the setup word and whether only a lower value counts.
_ODD_ONE = (("bootstrap", "bootstrap_interface", False), ("channels", "fewer_channels", True),
            ("version", "nccl_version_differs", False), ("driver", "driver_version_differs", False))


def degradations_of(summary: CompressionSummary) -> list[Degradation]:
    return degradations_in(summary.nccl_setup)


def degradations_in(setup: dict[str, dict[str, tuple[str, int, str]]]) -> list[Degradation]:
    """The degradations NCCL's start-up words (host -> kind -> (value, line number, line)) show: the report's, and
    the streaming service's advice while the job runs."""
    named = {h: kinds for h, kinds in setup.items() if h}  # to differ, a host must have a name
    odd = [g for word, kind, lower in _ODD_ONE for g in _odd_one_out(named, word, kind, lower_only=lower)]
    return _network_fallbacks(named) + _gdr_disabled(named) + _p2p_disabled(setup) + odd


def _odd_one_out(setup: dict[str, dict[str, tuple[str, int, str]]], word: str, kind: str, *,
                 lower_only: bool) -> list[Degradation]:
    """The hosts whose `word` differs from the value a strict majority of the hosts (two at least) print."""
    said = {h: kinds[word] for h, kinds in setup.items() if word in kinds}
    if len(said) < 3:
        return []
    (common, n), *_ = Counter(v for v, _, _ in said.values()).most_common(1)
    if n < 2 or n * 2 <= len(said):
        return []
    out = []
    for host, (value, line_no, raw) in sorted(said.items()):
        if value == common or (lower_only and not (value.isdigit() and common.isdigit() and int(value) < int(common))):
            continue
        out.append(Degradation(kind, host, line_no, raw, _EFFECT[kind].format(value=value, others=common)))
    return out


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
