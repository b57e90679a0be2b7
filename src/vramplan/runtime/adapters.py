"""LoRA adapter parameters of a model known by its shape (the runtime model's count)."""

from __future__ import annotations

from vramplan.models.shape import ModelShape
from vramplan.workload import ALL_LINEAR, Workload


def adapter_params(s: ModelShape, w: Workload) -> int:
    """LoRA adapter parameters: rank × (in + out) for each targeted linear of each layer."""
    h = s.hidden
    inter = s.intermediate or s.ffn
    dims = {
        "q_proj": (h, s.heads * s.qk_dim), "k_proj": (h, s.kv_heads * s.qk_dim),
        "v_proj": (h, s.kv_heads * s.v_dim), "o_proj": (s.heads * s.v_dim, h),
        "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h),
    }
    targets = dims if ALL_LINEAR in w.lora_targets else {t: dims[t] for t in w.lora_targets if t in dims}
    per_layer = sum(w.lora_rank * (i + o) for i, o in targets.values())
    return per_layer * s.layers
