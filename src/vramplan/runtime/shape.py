"""The few model dimensions the runtime model reads from a :class:`ModelSpec`.

Kept apart so that flops and traffic agree on what a "token", a "layer" and a
"matmul parameter" are, and so that non-transformer specs fail in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramplan.models.spec import Family, ModelSpec
from vramplan.workload import ALL_LINEAR, Attention, Workload

SEQUENCE_FAMILIES = (Family.DENSE, Family.MOE, Family.MLA, Family.ENCODER, Family.VIT)


@dataclass(frozen=True)
class Shape:
    """Dimensions of one model replica, as the runtime model sees them."""

    params: int
    active_params: int
    matmul_params: int
    """Active parameters that take part in a matmul per token (the input embedding
    lookup does not; a tied embedding does, as the output head)."""
    head_params: int
    """Parameters of the output head matmul (vocab × hidden), 0 for encoders/ViT."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    qk_dim: int
    """Per-head query/key width (MLA: nope + rope)."""
    v_dim: int
    ffn: int
    """MLP width a token passes through (MoE: routed experts per token + shared)."""
    vocab: int
    causal: bool
    sliding_window: int | None
    sliding_layers: int
    kv_elems: int
    """KV-cache elements per token per layer (2·kv_heads·head_dim; MLA: latent + rope)."""
    n_experts: int
    experts_per_token: int


def shape_of(spec: ModelSpec) -> Shape:
    """Read the dimensions; raises nothing (zeros mean "unknown")."""
    hidden = spec.hidden
    heads = spec.heads or 1
    head_dim = spec.head_dim or (hidden // heads if hidden else 0)
    kv_heads = spec.kv_heads or heads
    if spec.family is Family.MLA and spec.qk_nope_head_dim:
        qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
        v = spec.v_head_dim or head_dim
        kv_elems = spec.kv_lora_rank + spec.qk_rope_head_dim
    else:
        qk = v = head_dim
        kv_elems = 2 * kv_heads * head_dim
    if spec.is_moe:
        ffn = (spec.moe_intermediate or spec.intermediate) * (spec.experts_per_token + spec.shared_experts)
    else:
        ffn = spec.intermediate
    active = spec.active_params or spec.params
    decoder = spec.is_decoder
    head = spec.vocab * hidden if decoder else 0
    embed_lookup = 0 if spec.tie_embeddings or not decoder else spec.vocab * hidden
    if spec.family is Family.ENCODER:
        embed_lookup = spec.vocab * hidden
    matmul = max(active - embed_lookup, 0) if hidden else active
    return Shape(
        params=spec.params, active_params=active, matmul_params=matmul or active, head_params=head,
        layers=spec.layers, hidden=hidden, heads=heads, kv_heads=kv_heads, qk_dim=qk, v_dim=v,
        ffn=ffn, vocab=spec.vocab if decoder else 0, causal=decoder,
        sliding_window=spec.sliding_window, sliding_layers=spec.sliding_layers,
        kv_elems=kv_elems,
        n_experts=spec.n_experts, experts_per_token=spec.experts_per_token,
    )


def tokens_per_sample(spec: ModelSpec, w: Workload) -> int:
    """Sequence positions one sample occupies (ViT: patches + class token)."""
    if spec.family is Family.VIT:
        patch = spec.patch_size or 16
        return (w.image_size // patch) ** 2 + 1
    return w.seq


def keys_per_query(s: Shape, seq: int, w: Workload, window: int | None) -> float:
    """Average keys each query attends to in one layer, as the kernel computes them.

    Causal flash/SDPA kernels skip fully masked blocks, so they do ~half of s² work;
    eager attention computes the whole s×s score matrix and masks it.
    """
    if not s.causal or w.attention is Attention.EAGER:
        return float(seq)
    if window is None or window >= seq:
        return (seq + 1) / 2
    return (window * (window + 1) / 2 + (seq - window) * window) / seq


def adapter_params(spec: ModelSpec, w: Workload) -> int:
    """LoRA adapter parameters: rank × (in + out) for each targeted linear of each layer."""
    s = shape_of(spec)
    h = s.hidden
    inter = spec.intermediate or s.ffn
    dims = {
        "q_proj": (h, s.heads * s.qk_dim), "k_proj": (h, s.kv_heads * s.qk_dim),
        "v_proj": (h, s.kv_heads * s.v_dim), "o_proj": (s.heads * s.v_dim, h),
        "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h),
    }
    targets = dims if ALL_LINEAR in w.lora_targets else {t: dims[t] for t in w.lora_targets if t in dims}
    per_layer = sum(w.lora_rank * (i + o) for i, o in targets.values())
    return per_layer * s.layers
