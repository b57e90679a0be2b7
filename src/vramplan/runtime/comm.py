"""Collective communication time for DDP, ZeRO/FSDP, TP, PP, CP and EP.

Ring algorithms (NCCL's large-message choice): all-reduce moves ``2(n−1)/n · bytes`` per
rank, all-gather and reduce-scatter ``(n−1)/n · bytes`` (``bytes`` = the full, unsharded
buffer). Time = volume ÷ (link bandwidth per direction × efficiency) + a fixed latency.
Links: NVLink (catalog ``interconnect_bw``, bidirectional, so ÷2 per direction) inside a
node, PCIe when the GPU has no NVLink, InfiniBand between nodes (``Efficiency.inter_node_bw``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vramplan.hardware.gpu import GPU
from vramplan.models.shape import ModelShape, tokens
from vramplan.precision import precision_model
from vramplan.workload import Checkpointing, Peft, Task, Workload

from .rates import Efficiency

_PCIE_X16 = {3: 15.75e9, 4: 31.5e9, 5: 63.0e9, 6: 121.0e9}
"""Nominal PCIe x16 bandwidth per direction, bytes/s (PCI-SIG)."""


@dataclass(frozen=True)
class Link:
    bandwidth: float
    """Effective bytes/s per direction (efficiency applied)."""
    name: str


_PCIE_RE = re.compile(r"pcie\s*(\d)(?:\.0)?\s*x(\d+)", re.IGNORECASE)
_BRIDGE_RE = re.compile(r"bridge\s*\((\d+)(?:\s*or\s*(\d+))?\s*gpus?\)", re.IGNORECASE)


def _pcie_nominal(gpu: GPU) -> tuple[float, str]:
    """Per-direction PCIe bandwidth from the catalog's link string (``PCIe 4.0 x8``), else
    from ``pcie_gen`` at x16."""
    m = _PCIE_RE.search(gpu.interconnect or "")
    if m:
        gen, lanes = int(m.group(1)), int(m.group(2))
        return _PCIE_X16.get(gen, _PCIE_X16[4]) * lanes / 16, f"PCIe {gen}.0 x{lanes}"
    gen = gpu.pcie_gen or 4
    label = f"PCIe {gen}.0 x16" + ("" if gpu.pcie_gen else " (generation assumed)")
    return _PCIE_X16.get(gen, _PCIE_X16[4]), label


def pcie_link(gpu: GPU, eff: Efficiency) -> Link:
    """Host-device copies (offload) over the GPU's PCIe link."""
    nominal, label = _pcie_nominal(gpu)
    return Link(nominal * eff.pcie, label)


def link_for(gpu: GPU, group: int, spans_nodes: bool, eff: Efficiency) -> Link:
    """The bottleneck link of a ring over ``group`` ranks.

    NVLink / Infinity Fabric when the catalog lists a GPU-to-GPU link; an NVLink *bridge*
    joins only 2 (or 4) cards, so larger groups fall back to PCIe; InfiniBand between nodes.
    """
    ic = gpu.interconnect or ""
    bridge = _BRIDGE_RE.search(ic)
    direct = bool(gpu.interconnect_bw) and not ic.strip().lower().startswith("pcie")
    if bridge and group > max(int(g) for g in bridge.groups() if g):
        direct = False
    if direct and gpu.interconnect_bw:
        name = ic.split("/")[0].strip() or "NVLink"
        intra = Link(gpu.interconnect_bw / 2 * eff.link, name)
    else:
        nominal, label = _pcie_nominal(gpu)
        intra = Link(nominal * eff.link, label)
    if spans_nodes:
        inter = Link(eff.inter_node_bw * eff.link, f"InfiniBand {eff.inter_node_bw * 8 / 1e9:.0f} Gb/s per GPU (assumed)")
        return inter if inter.bandwidth < intra.bandwidth else intra
    return intra


def all_reduce(nbytes: float, n: int, link: Link, eff: Efficiency) -> float:
    if n <= 1:
        return 0.0
    return 2.0 * (n - 1) / n * nbytes / link.bandwidth + eff.collective_latency


def all_gather(nbytes: float, n: int, link: Link, eff: Efficiency) -> float:
    """Also the time of a reduce-scatter of a ``nbytes`` buffer."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / link.bandwidth + eff.collective_latency


@dataclass(frozen=True)
class CommTime:
    total: float
    """Seconds of communication per optimizer step (or request batch), before overlap."""
    exposed: float
    """Seconds not hidden behind computation."""
    notes: tuple[str, ...] = ()


def communication(
    s: ModelShape, w: Workload, gpu: GPU, *, trainable: int, base_bytes_per_param: float,
    t_microbatch: float, t_backward: float, decode_tokens: int = 0, eff: Efficiency,
) -> CommTime:
    """Communication of one step on one rank.

    ``t_microbatch`` / ``t_backward``: computation seconds of one micro-batch / of its
    backward on this rank (what overlapped communication can hide behind).
    """
    p = w.parallel
    nodes_span = p.world_size > eff.gpus_per_node
    notes: list[str] = []
    total = exposed = 0.0
    cb = precision_model(w).compute
    stage = max(p.tp * p.pp, 1)
    m = w.grad_accum if w.task is Task.TRAIN else 1

    if w.task is Task.TRAIN and p.dp > 1:
        link = link_for(gpu, p.dp, nodes_span, eff)
        grads = trainable / stage * precision_model(w).trainable_bytes
        if p.zero == 3:
            adapters = trainable if w.peft is not Peft.NONE else 0
            params = (s.params * base_bytes_per_param + adapters * cb) / stage
            per_mb = 2 * all_gather(params, p.dp, link, eff) + all_gather(grads, p.dp, link, eff)
            hidden = min(per_mb, eff.overlap_fsdp * t_microbatch)
            total += m * per_mb
            exposed += m * (per_mb - hidden)
            notes.append(
                f"ZeRO-3/FSDP over {p.dp} GPUs ({link.name}): params all-gathered twice and grads "
                f"reduce-scattered every micro-batch, up to {eff.overlap_fsdp:.0%} hidden by prefetch"
            )
        elif p.zero in (1, 2):
            rs = all_gather(grads, p.dp, link, eff)
            times = m if p.zero == 2 else 1  # ZeRO-2 cannot accumulate unsharded grads
            ag = all_gather(trainable / stage * cb, p.dp, link, eff)
            total += times * rs + ag
            exposed += times * max(rs - eff.overlap_ddp * t_backward, 0.0) + ag
            notes.append(
                f"ZeRO-{p.zero} over {p.dp} GPUs ({link.name}): grads reduce-scattered (overlapped with "
                f"backward up to {eff.overlap_ddp:.0%}), updated params all-gathered after the step (exposed)"
            )
        else:
            ar = all_reduce(grads, p.dp, link, eff)
            total += ar
            exposed += max(ar - eff.overlap_ddp * t_backward, 0.0)
            notes.append(
                f"DDP over {p.dp} GPUs ({link.name}): one gradient all-reduce per step (no_sync during "
                f"accumulation), overlapped with backward up to {eff.overlap_ddp:.0%}"
            )

    if p.tp > 1:
        link = link_for(gpu, p.tp, p.tp > eff.gpus_per_node, eff)
        layers = s.layers / p.pp
        if w.task is Task.GENERATE:
            act = float(tokens(w).per_rank * s.hidden * cb)
            per = 2 * layers * all_reduce(act, p.tp, link, eff)
            tok = 2 * layers * all_reduce(w.batch * s.hidden * cb, p.tp, link, eff)
            t = per + decode_tokens * tok
        else:
            act = float(tokens(w).per_rank * s.hidden * cb)
            count = 2.0
            if w.task is Task.TRAIN:
                count += 2.0
                if w.checkpointing is Checkpointing.FULL:
                    count += 2.0 * w.checkpoint_fraction
            t = m * count * layers * all_reduce(act, p.tp, link, eff)
        total += t
        exposed += t
        notes.append(f"TP {p.tp} ({link.name}): two activation all-reduces per layer per pass, not overlapped")

    if p.pp > 1:
        link = link_for(gpu, 2, nodes_span, eff)
        act = tokens(w).per_rank * s.hidden * cb / p.tp
        passes = 2 if w.task is Task.TRAIN else 1
        t = m * passes * act / link.bandwidth
        total += t
        exposed += t

    if p.cp > 1:
        link = link_for(gpu, p.cp, nodes_span, eff)
        kv = tokens(w).per_rank * s.kv_elems * cb * s.layers / p.pp
        passes = 3 if w.task is Task.TRAIN else 1
        t = m * passes * (p.cp - 1) * kv / link.bandwidth
        total += t
        exposed += max(t - eff.overlap_fsdp * m * t_microbatch, 0.0)
        notes.append(f"context parallel {p.cp}: ring attention passes K/V chunks, mostly hidden")

    if p.ep > 1 and s.n_experts:
        link = link_for(gpu, p.ep, nodes_span, eff)
        vol = tokens(w).per_rank * s.experts_per_token * s.hidden * cb * (p.ep - 1) / p.ep
        passes = 4 if w.task is Task.TRAIN else 2
        t = m * passes * (s.layers / p.pp) * (vol / link.bandwidth + eff.collective_latency)
        total += t
        exposed += t
        notes.append(f"expert parallel {p.ep}: token all-to-all before and after each MoE layer")

    return CommTime(total, exposed, tuple(notes))
