"""DeepSpeed ZeRO-1/2/3 as DeepSpeed itself allocates it (``Parallel.engine = deepspeed``).

Read from deepspeed 0.19.8 (``deepspeed/runtime/zero/config.py``, ``stage_1_and_2.py``,
``stage3.py``); the defaults are :class:`ZeroSettings`'s. What differs from the generic ZeRO
accounting (16-bit weights and gradients, fp32 master + Adam states, sharded by stage):

* **reduce buckets** (``contiguous_gradients``, default on): ZeRO-1/2 allocate
  ``torch.empty(reduce_bucket_size)`` in the model dtype at the first backward
  (``setup_buckets``), a second one with ``overlap_comm`` (default off for stages 1–2, on for
  stage 3); ZeRO-3 keeps one bucket of ``reduce_bucket_size`` for its whole life. The size
  does not depend on the model: 5e8 elements = 0.93 GiB in bf16 each by default.
* **ZeRO-3 gathering** works per *submodule* (each ``nn.Linear``), not per block: the module
  running is gathered plus up to ``stage3_prefetch_bucket_size`` (5e7) prefetched elements,
  capped by ``stage3_max_live_parameters`` (1e9); parameters of at most
  ``stage3_param_persistence_threshold`` (1e5) elements (norms, biases) stay whole on every
  rank.
* **optimizer step**: ZeRO-1/2 build an fp32 copy of the rank's gradient partition; ZeRO-3
  works in ``sub_group_size`` (1e9) pieces, so the fp32 gradient is at most that size.
* **gradient accumulation dtype** (``data_types.grad_accum_dtype``) defaults to the model
  dtype (``DeepSpeedEngine.get_data_types``): 16-bit gradient partitions under bf16.

Host RAM is what DeepSpeed's own estimators give (``estimate_zero2_model_states_mem_needs``,
``estimate_zero3_model_states_mem_needs``): per node, with their 1.5 buffer factor.

Why analytic, not traced (tried 2026-12-01, deepspeed 0.19.8, torch 2.13 CPU): DeepSpeed's
engine *does* initialise and step on PyTorch's fake process group — ``init_process_group("fake",
store=FakeStore(), rank=0, world_size=8)`` then ``deepspeed.initialize(model, optimizer=
torch.optim.AdamW(…), config={"zero_optimization": {"stage": 2 or 3}}, dist_init_required=False)``
runs forward, ``engine.backward`` and ``engine.step`` with ``DeepSpeedZeroOptimizer`` /
``DeepSpeedZeroOptimizer_Stage3``. What blocks a trace: DeepSpeed picks its accelerator at import
(the CPU one on a machine without CUDA) and allocates its flat buffers, buckets and partitions
with ``device=get_accelerator().current_device_name()`` — host tensors, not our emulated CUDA
device — so tracing needs a DeepSpeed accelerator that answers "cuda" and maps to the trace
device; and ``"optimizer": {"type": "AdamW"}`` in the config JIT-builds DeepSpeed's fused Adam C++
op (``op_builder``), which a trace must replace by torch's.
"""

from __future__ import annotations

from vramplan._dataclass import dataclass
from vramplan.workload import Workload


@dataclass(frozen=True)
class ZeroSettings:
    """DeepSpeed's ``zero_optimization`` sizes (elements), with DeepSpeed's defaults."""

    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    prefetch_bucket_size: int = 50_000_000
    """``stage3_prefetch_bucket_size``."""
    max_live_parameters: int = 1_000_000_000
    """``stage3_max_live_parameters``."""
    param_persistence_threshold: int = 100_000
    """``stage3_param_persistence_threshold``."""
    sub_group_size: int = 1_000_000_000
    contiguous_gradients: bool = True
    overlap_comm: bool | None = None
    """None: DeepSpeed's dynamic default (on for stage 3 only, ``overlap_comm_valid``)."""

    def overlap(self, stage: int) -> bool:
        return self.overlap_comm if self.overlap_comm is not None else stage == 3


DEFAULTS = ZeroSettings()
ADDITIONAL_BUFFER_FACTOR = 1.5
"""The estimators' ``additional_buffer_factor`` default."""


def reduce_buckets(stage: int, grad_bytes: int, s: ZeroSettings = DEFAULTS) -> int:
    """Bytes of the gradient reduce buckets one rank keeps (0 for stage 0)."""
    if stage == 3:
        return s.reduce_bucket_size * grad_bytes
    if stage in (1, 2) and s.contiguous_gradients:
        return (2 if s.overlap(stage) else 1) * s.reduce_bucket_size * grad_bytes
    return 0


def gathered(largest_param: int, weight_bytes: int, s: ZeroSettings = DEFAULTS) -> int:
    """ZeRO-3: bytes of gathered 16-bit parameters at once — the running submodule's largest
    parameter plus the prefetch bucket, within ``max_live_parameters``."""
    live = min(largest_param + s.prefetch_bucket_size, max(s.max_live_parameters, largest_param))
    return live * weight_bytes


def persistent(small_params: int, shard: int, weight_bytes: int, s: ZeroSettings = DEFAULTS) -> int:
    """ZeRO-3: parameters under the persistence threshold stay whole: the bytes beyond their shard."""
    if s.param_persistence_threshold <= 0 or shard <= 1:
        return 0
    return (small_params - small_params // shard) * weight_bytes


def step_fp32_grads(stage: int, shard_elems: int, s: ZeroSettings = DEFAULTS) -> int:
    """fp32 gradient the optimizer step builds: the whole partition (ZeRO-1/2) or one sub-group (ZeRO-3)."""
    if stage == 3:
        return 4 * min(shard_elems, s.sub_group_size)
    return 4 * shard_elems


def host_ram(w: Workload, total_params: int, largest_layer_params: int, *, gpus_per_node: int = 8,
             additional_buffer_factor: float = ADDITIONAL_BUFFER_FACTOR, zero_init: bool = True) -> int:
    """Host RAM per node as DeepSpeed's estimators compute it (ZeRO-2 formula for stages 1–2).

    Mirrors ``estimate_zero2_model_states_mem_needs`` (stage_1_and_2.py) and
    ``estimate_zero3_model_states_mem_needs`` (stage3.py) of deepspeed 0.19.8; a test calls
    both and checks the agreement.
    """
    p = w.parallel
    per_node = min(gpus_per_node, p.world_size)
    nodes = max(1, p.world_size // per_node)
    total_gpus = nodes * per_node
    if p.zero == 3:
        gpus_factor = 1 / nodes
        if p.offload_optimizer and p.offload_params:
            cpu = total_params * (18 * gpus_factor if zero_init else max(4 * per_node, 18 * gpus_factor))
        elif p.offload_optimizer:
            cpu = total_params * (16 * gpus_factor if zero_init else max(4 * per_node, 16 * gpus_factor))
        else:
            cpu = (largest_layer_params if zero_init else total_params) * 4 * per_node
        return int(cpu * additional_buffer_factor)
    if p.offload_optimizer:
        return int(total_params * max(4 * total_gpus, 16) * additional_buffer_factor)
    return int(total_params * 4 * per_node * additional_buffer_factor)


__all__ = ["DEFAULTS", "ZeroSettings", "gathered", "host_ram", "persistent", "reduce_buckets", "step_fp32_grads"]
