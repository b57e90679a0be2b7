"""Runtime helpers on the one model shape (:class:`vramplan.models.shape.ModelShape`)."""

from __future__ import annotations

from vramplan.models.shape import ModelShape
from vramplan.workload import ALL_LINEAR, Attention, Workload


def keys_per_query(s: ModelShape, seq: int, w: Workload, window: int | None) -> float:
    """Average keys each query attends to in one layer, as the kernel computes them.

    Causal flash/SDPA kernels skip fully masked blocks, so they do ~half of s² work;
    eager attention computes the whole s×s score matrix and masks it.
    """
    if not s.causal or w.attention is Attention.EAGER:
        return float(seq)
    if window is None or window >= seq:
        return (seq + 1) / 2
    return (window * (window + 1) / 2 + (seq - window) * window) / seq


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
