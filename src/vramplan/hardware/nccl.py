"""NCCL communicator memory per rank: device memory outside PyTorch's caching allocator.

Every process group that runs a collective owns one NCCL communicator (PyTorch's
ProcessGroupNCCL creates it lazily on the first collective, or eagerly when
``init_process_group(device_id=…)`` binds a device), and every communicator allocates its
own connection buffers with cudaMalloc / cuMem — never through the caching allocator. A
2-D mesh (FSDP × TP) therefore pays for two communicators, HSDP for two data-parallel ones,
and the default (world) group for a third when the job runs a barrier or a metric
all-reduce on it.

Per communicator of ``n`` ranks (``local`` of them on this rank's node), in NCCL's source
(``src/init.cc``, ``src/transport/nvls.cc``, ``src/transport/p2p.cc``; NCCL 2.18–2.2x):

* **collective connections** (ring and tree): ``channels × 2 connections × (SIMPLE
  NCCL_BUFFSIZE 4 MiB + LL 512 KiB + LL128 4,800 KiB)``. ``DEFAULT_BUFFSIZE = 1 << 22``;
  ``DEFAULT_LL_BUFFSIZE = LL_LINES_PER_THREAD 8 × LL_MAX_NTHREADS 512 × NCCL_STEPS 8 × 16 B``;
  ``DEFAULT_LL128_BUFFSIZE = 120 elems × 640 threads × NCCL_STEPS 8 × 8 B``. The two
  connections are the ring's receive side and the tree's (a chain inside one node). The
  channel count comes from NCCL's topology search: 16 over NVLink/NVSwitch, 4 over PCIe as
  seen in ``NCCL_DEBUG=INFO`` logs (an assumption; ``NCCL_MAX_NCHANNELS`` bounds it).
* **NVLS** (NVLink SHARP, NVSwitch systems of compute capability ≥ 9.0 with more than 2
  local GPUs, ``NCCL_NVLS_ENABLE`` default 2 = auto): ``nvlsChannels × 2 × NVLS_CHUNKSIZE
  128 KiB × NCCL_STEPS 8 × nHeads`` (``ncclNvlsBufferSetup``: ``buffSize = nvlsStepSize *
  NCCL_STEPS; nvlsPerRankSize = nChannels * 2 * buffSize; nvlsTotalSize = nvlsPerRankSize *
  nHeads``), with ``NVLS_NCHANNELS_SM90 = 16``, ``NVLS_NCHANNELS_SM100 = 32`` and one head
  per local GPU (assumption: the single-node NVLS graph). 8 H100s: 256 MiB per communicator.
  ``NCCL_NVLS_ENABLE=0`` removes it.
* **point-to-point** (pipeline send/recv; all-to-all for expert parallelism): per peer
  ``channels per peer 2 × P2P chunk × NCCL_STEPS 8`` with ``NCCL_P2P_NVL_CHUNKSIZE`` 512 KiB
  over NVLink and ``NCCL_P2P_NET_CHUNKSIZE`` / ``NCCL_P2P_PCI_CHUNKSIZE`` 128 KiB otherwise
  (channels per peer: ``NCCL_NCHANNELS_PER_NET_PEER``-style default of 2, an assumption).
  Connections are made lazily for the peers a rank talks to: 2 pipeline neighbours, or every
  other rank of the expert-parallel group.

Not counted (small or host-side): the per-channel device structures (kilobytes), the
proxy's pinned host buffers, and the rounding of each buffer to the cuMem granularity
(2 MiB) that NCCL ≥ 2.19 applies with ``NCCL_CUMEM_ENABLE`` on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from vramplan._dataclass import dataclass
from vramplan.errors import VramplanError
from vramplan.results import OverheadItem
from vramplan.units import KiB, MiB

if TYPE_CHECKING:
    from vramplan.hardware.gpu import GPU


NCCL_STEPS = 8
"""``NCCL_STEPS`` (src/include/device.h): slots per connection FIFO."""
SIMPLE_BUFFSIZE = 4 * MiB
"""``DEFAULT_BUFFSIZE`` (1 << 22), env NCCL_BUFFSIZE (src/init.cc)."""
LL_BUFFSIZE = 8 * 512 * NCCL_STEPS * 16
"""``DEFAULT_LL_BUFFSIZE`` = 8 lines/thread × 512 threads × 8 steps × 16 B = 512 KiB."""
LL128_BUFFSIZE = 120 * 640 * NCCL_STEPS * 8
"""``DEFAULT_LL128_BUFFSIZE`` = 120 elems/thread × 640 threads × 8 steps × 8 B = 4,800 KiB."""
CONNECTIONS_PER_CHANNEL = 2
"""Receive connections per collective channel: the ring's and the tree's."""
CHANNELS_NVLINK = 16
CHANNELS_PCIE = 4
CHANNELS_SOURCE = ("channel count as NCCL's topology search picks it in NCCL_DEBUG=INFO logs (16 over "
                   "NVLink, 4 over PCIe; assumption — NCCL_MAX_NCHANNELS bounds it)")
NVLS_CHUNKSIZE = 128 * KiB
"""``NCCL_NVLS_CHUNKSIZE`` default (src/transport/nvls.cc)."""
NVLS_CHANNELS_SM90 = 16
NVLS_CHANNELS_SM100 = 32
"""``NVLS_NCHANNELS_SM90`` / ``NVLS_NCHANNELS_SM100`` (src/transport/nvls.cc)."""
P2P_NVL_CHUNKSIZE = 512 * KiB
"""``NCCL_P2P_NVL_CHUNKSIZE`` default (1 << 19, src/init.cc)."""
P2P_CHUNKSIZE = 128 * KiB
"""``NCCL_P2P_NET_CHUNKSIZE`` / ``NCCL_P2P_PCI_CHUNKSIZE`` default (1 << 17, src/init.cc)."""
P2P_CHANNELS_PER_PEER = 2
"""Channels per point-to-point peer (assumption: NCCL's default of 2 per peer)."""
GPUS_PER_NODE = 8

PATTERNS = ("collective", "p2p", "all-to-all")


@dataclass(frozen=True)
class Communicator:
    """One NCCL communicator as one rank sees it."""

    name: str
    """The process group: dp, dp_shard, dp_replicate, tp, cp, pp, ep or world."""
    size: int
    """Ranks in the communicator."""
    local: int
    """Of them, ranks on this rank's node (NVLink reach)."""
    pattern: str = "collective"
    """collective (all-reduce / all-gather / reduce-scatter), p2p (pipeline send/recv) or
    all-to-all (expert dispatch)."""

    def __post_init__(self) -> None:
        if self.pattern not in PATTERNS:
            raise VramplanError(f"unknown communicator pattern {self.pattern!r}", hint=f"use {', '.join(PATTERNS)}")
        if self.size < 1 or not (1 <= self.local <= self.size):
            raise VramplanError(f"communicator {self.name}: size {self.size} with {self.local} local ranks",
                                hint="local ranks must be between 1 and the size")


def _local(size: int, stride: int, per_node: int) -> int:
    """Ranks of a group of ``size`` ranks ``stride`` apart that share one node."""
    if stride >= per_node:
        return 1
    return max(1, min(size, per_node // stride))


def mesh_communicators(*, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                       dp_shard: int = 0, gpus_per_node: int = GPUS_PER_NODE) -> tuple[Communicator, ...]:
    """The communicators one rank of a ``pp × dp × cp × tp`` device mesh joins.

    The mesh is laid out as torchtitan's (``["pp", "dp_replicate", "dp_shard", "cp", "tp"]``,
    torchtitan/distributed/parallel_dims.py): tensor parallelism innermost (neighbouring
    ranks, one node), pipeline stages outermost. ``dp_shard`` (HSDP) splits the data-parallel
    ranks into replicas of ``dp_shard``-rank shard groups; 0 means one group of ``dp``.
    Expert parallelism borrows ``ep`` ranks of the data-parallel dimension (all-to-all).
    """
    for name, v in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep), ("gpus_per_node", gpus_per_node)):
        if not isinstance(v, int) or v < 1:
            raise VramplanError(f"`{name}` must be a positive integer, got {v!r}", field=name)
    shard = dp_shard or dp
    if dp % shard:
        raise VramplanError(f"`dp_shard={dp_shard}` does not divide `dp={dp}`", field="dp_shard",
                            hint="the data-parallel size is replicas × shard-group size")
    out: list[Communicator] = []
    if tp > 1:
        out.append(Communicator("tp", tp, _local(tp, 1, gpus_per_node)))
    if cp > 1:
        out.append(Communicator("cp", cp, _local(cp, tp, gpus_per_node)))
    if shard < dp:
        if shard > 1:
            out.append(Communicator("dp_shard", shard, _local(shard, tp * cp, gpus_per_node)))
        out.append(Communicator("dp_replicate", dp // shard, _local(dp // shard, tp * cp * shard, gpus_per_node)))
    elif dp > 1:
        out.append(Communicator("dp", dp, _local(dp, tp * cp, gpus_per_node)))
    if ep > 1:
        out.append(Communicator("ep", ep, _local(ep, tp * cp, gpus_per_node), "all-to-all"))
    if pp > 1:
        out.append(Communicator("pp", pp, _local(pp, tp * cp * dp, gpus_per_node), "p2p"))
    world = dp * tp * pp * cp
    if world > 1 and not any(c.size == world and c.pattern == "collective" for c in out):
        out.append(Communicator("world", world, min(world, gpus_per_node)))
    return tuple(out)


def _nvlink(gpu: GPU | None) -> bool:
    return gpu is not None and "pcie" not in (gpu.interconnect or "pcie").lower().split("/")[0]


def _nvswitch(gpu: GPU | None) -> bool:
    """NVLS needs NVSwitch multicast: SXM (or superchip) NVIDIA parts of compute capability ≥ 9."""
    if gpu is None or gpu.vendor != "nvidia" or not gpu.sm or gpu.sm[0] < 9:
        return False
    return _nvlink(gpu) and "bridge" not in (gpu.interconnect or "").lower()


def collective_bytes(channels: int) -> int:
    return channels * CONNECTIONS_PER_CHANNEL * (SIMPLE_BUFFSIZE + LL_BUFFSIZE + LL128_BUFFSIZE)


def communicator_items(gpu: GPU | None, comms: Sequence[Communicator], *, channels: int | None = None,
                       nvls: bool | None = None) -> tuple[OverheadItem, ...]:
    """One overhead item per communicator (and one per NVLS buffer), each with its formula.

    ``channels`` overrides the collective channel count (NCCL_MIN/MAX_NCHANNELS); ``nvls``
    forces NVLS on or off (NCCL_NVLS_ENABLE), None: on where the GPU has NVSwitch multicast.
    """
    if channels is not None and channels < 1:
        raise VramplanError(f"NCCL channels must be >= 1, got {channels!r}")
    items: list[OverheadItem] = []
    per_conn = SIMPLE_BUFFSIZE + LL_BUFFSIZE + LL128_BUFFSIZE
    for c in comms:
        if c.size <= 1:
            continue
        where = f"{c.size} ranks, {c.local} local"
        if c.pattern == "collective":
            ch = channels or (CHANNELS_NVLINK if _nvlink(gpu) else CHANNELS_PCIE)
            items.append(OverheadItem(
                f"NCCL {c.name} communicator ({where})", collective_bytes(ch),
                f"{ch} channels × {CONNECTIONS_PER_CHANNEL} connections (ring + tree) × (SIMPLE 4 MiB "
                f"NCCL_BUFFSIZE + LL 512 KiB + LL128 4,800 KiB = {per_conn:,} B), NCCL src/init.cc defaults; "
                f"channels: {'given' if channels else CHANNELS_SOURCE}"))
            use_nvls = nvls if nvls is not None else _nvswitch(gpu)
            if use_nvls and c.local > 2:
                nch = NVLS_CHANNELS_SM100 if gpu is not None and gpu.sm and gpu.sm[0] >= 10 else NVLS_CHANNELS_SM90
                b = nch * 2 * NVLS_CHUNKSIZE * NCCL_STEPS * c.local
                items.append(OverheadItem(
                    f"NCCL {c.name} NVLS buffers", b,
                    f"{nch} NVLS channels × 2 × NVLS_CHUNKSIZE 128 KiB × NCCL_STEPS 8 × {c.local} heads "
                    "(src/transport/nvls.cc ncclNvlsBufferSetup; one head per local GPU assumed); "
                    "NCCL_NVLS_ENABLE=0 removes it"))
        else:
            peers = c.size - 1 if c.pattern == "all-to-all" else min(2, c.size - 1)
            near = min(peers, c.local - 1)
            chunk_nvl = P2P_NVL_CHUNKSIZE if _nvlink(gpu) else P2P_CHUNKSIZE
            b = P2P_CHANNELS_PER_PEER * NCCL_STEPS * (near * chunk_nvl + (peers - near) * P2P_CHUNKSIZE)
            what = "neighbours" if c.pattern == "p2p" else "peers"
            items.append(OverheadItem(
                f"NCCL {c.name} p2p buffers ({peers} {what})", b,
                f"per peer {P2P_CHANNELS_PER_PEER} channels × NCCL_STEPS 8 × P2P chunk (NCCL_P2P_NVL_CHUNKSIZE "
                f"512 KiB on the node over NVLink, NCCL_P2P_NET/PCI_CHUNKSIZE 128 KiB otherwise; src/init.cc); "
                f"{near} peer(s) on this node; channels per peer: assumption"))
    return tuple(items)


__all__ = ["Communicator", "communicator_items", "mesh_communicators", "collective_bytes"]
