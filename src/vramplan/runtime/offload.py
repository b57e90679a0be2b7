"""Host-device transfers and CPU work of optimizer and parameter offload.

Optimizer offload (ZeRO-Offload, FSDP CPUOffload): each step the rank's 16-bit gradient
shard goes down over PCIe, the CPU optimizer updates the fp32 master shard, and the
updated 16-bit parameters come back up. Parameter offload (ZeRO-3 offload): every
micro-batch fetches the rank's parameter shard twice (forward, backward) and sends its
gradient shard down; prefetching hides part of it behind compute.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramplan.hardware.gpu import GPU

from .comm import pcie_link
from .rates import Efficiency


@dataclass(frozen=True)
class OffloadTime:
    total: float
    exposed: float
    notes: tuple[str, ...] = ()


def offload_time(
    gpu: GPU, *, optimizer: bool, params: bool, local_trainable: float, local_params: float,
    grad_bytes: float, param_bytes: float, microbatches: int, t_microbatch: float,
    t_backward: float, ranks_per_node: int, eff: Efficiency,
) -> OffloadTime:
    """Seconds of PCIe copies and CPU optimizer work per step on one rank."""
    if not (optimizer or params):
        return OffloadTime(0.0, 0.0)
    link = pcie_link(gpu, eff)
    total = exposed = 0.0
    notes: list[str] = []
    if params:
        per_mb = (2 * local_params * param_bytes + local_trainable * grad_bytes) / link.bandwidth
        total += microbatches * per_mb
        exposed += microbatches * max(per_mb - eff.overlap_offload * t_microbatch, 0.0)
        notes.append(
            f"parameter offload: shard fetched twice per micro-batch over {link.name} "
            f"({link.bandwidth / 1e9:.0f} GB/s effective), up to {eff.overlap_offload:.0%} hidden by prefetch"
        )
    if optimizer:
        down = 0.0 if params else local_trainable * grad_bytes / link.bandwidth
        cpu_rate = eff.cpu_adam_params_per_node_s / max(ranks_per_node, 1)
        cpu = local_trainable / cpu_rate
        up = local_trainable * param_bytes / link.bandwidth
        total += down + cpu + up
        exposed += max(down - eff.overlap_offload * t_backward, 0.0) + cpu + up
        notes.append(
            f"optimizer offload: grads down and params up over {link.name}, CPU optimizer at "
            f"{cpu_rate / 1e9:.2f} G params/s per rank (assumed; host-memory-bound CPU-Adam)"
        )
    return OffloadTime(total, exposed, tuple(notes))


def activation_offload_time(gpu: GPU, *, bytes_per_microbatch: float, microbatches: int, t_microbatch: float,
                            eff: Efficiency) -> OffloadTime:
    """Activation offloading (torchtune's ``OffloadActivations``, Unsloth's offloaded
    checkpointing): saved activations go to the host in the forward and come back in the
    backward, on a side stream that compute partly hides."""
    if bytes_per_microbatch <= 0:
        return OffloadTime(0.0, 0.0)
    link = pcie_link(gpu, eff)
    per_mb = 2.0 * bytes_per_microbatch / link.bandwidth
    exposed = microbatches * max(per_mb - eff.overlap_offload * t_microbatch, 0.0)
    return OffloadTime(microbatches * per_mb, exposed, (
        f"activation offload: saved activations down and back over {link.name} "
        f"({link.bandwidth / 1e9:.0f} GB/s effective), up to {eff.overlap_offload:.0%} hidden behind compute",))
