"""KV cache: 2 · layers · kv_heads · head_dim · tokens · batch · bytes, per rank.

- GQA/MQA: only the key/value heads are cached; TP splits them.
- Sliding-window layers (Mistral v0.1, Gemma 2/3 local layers) keep ``window`` tokens.
- MLA (DeepSeek-V2/V3): transformers 5 caches the *compressed* latent — ``kv_lora_rank``
  + ``qk_rope_head_dim`` values per token per layer, not per head — and re-expands it with
  ``kv_b_proj`` on every forward (a per-layer transient, see :func:`mla_expansion`). Older
  transformers (< 4.5x) cached the decompressed per-head K/V, as do naive ports; vLLM and
  SGLang cache the latent too.
- ``kv_dtype``: auto = the compute dtype; fp8/int8 1 B, int4 0.5 B per value (scales and
  HF QuantizedCache's residual window of full-precision tokens are not counted).
"""

from __future__ import annotations

import math

from vramplan.workload import Attention, Checkpointing, KVDtype, Workload

from .arch import LayerGroup
from .blocks import Ctx
from .parallel import Stage

_KV_BYTES = {KVDtype.FP32: 4.0, KVDtype.BF16: 2.0, KVDtype.FP16: 2.0, KVDtype.FP8: 1.0,
             KVDtype.INT8: 1.0, KVDtype.INT4: 0.5}


def kv_bytes(w: Workload, compute: int) -> float:
    return float(compute) if w.kv_dtype is KVDtype.AUTO else _KV_BYTES[w.kv_dtype]


def per_token(g: LayerGroup, tp: int, value_bytes: float) -> float:
    """Cache bytes per token for one layer of this group, on one TP rank."""
    a = g.attn
    if a.kind == "mla":
        return (a.kv_lora_rank + a.rope_dim) * value_bytes
    return 2 * a.kv_heads * a.head_dim * value_bytes / tp


def cache(stage: Stage, w: Workload, compute: int, tokens: int) -> int:
    """KV cache of ``tokens`` positions for every layer of this stage, whole micro-batch."""
    vb, tp = kv_bytes(w, compute), w.parallel.tp
    total = 0.0
    for g, n in stage.groups:
        kept = min(tokens, g.attn.window) if g.attn.window else tokens
        total += n * per_token(g, tp, vb) * kept
    return math.ceil(total * w.batch / w.parallel.cp)


def grow_transient(stage: Stage, w: Workload, compute: int, tokens: int) -> int:
    """DynamicCache grows by ``torch.cat``: old and new K (or V) of one layer coexist."""
    vb, tp = kv_bytes(w, compute), w.parallel.tp
    worst = 0.0
    for g, _ in stage.groups:
        kept = min(tokens, g.attn.window) if g.attn.window else tokens
        worst = max(worst, per_token(g, tp, vb) * kept / (1 if g.attn.kind == "mla" else 2))
    return math.ceil(worst * w.batch)


def mla_expansion(stage: Stage, w: Workload, compute: int, tokens: int) -> int:
    """MLA decode: kv_b_proj output and the assembled keys for the whole cache, one layer."""
    worst = 0
    for g, _ in stage.groups:
        a = g.attn
        if a.kind == "mla":
            per = a.heads * (a.nope_dim + a.v_head_dim + a.head_dim) // w.parallel.tp
            worst = max(worst, compute * per * tokens * w.batch)
    return worst


def training_cache(stage: Stage, w: Workload, ctx: Ctx, tokens: int) -> int:
    """Bytes HF's DynamicCache adds to a training forward (``use_cache`` defaults to True;
    gradient checkpointing turns it off). The cache references each layer's post-RoPE k and
    v; they cost extra only where attention saved other tensors: under AMP the keys are
    fp32 (RoPE tables follow the fp32 embedding) while the kernel saves 16-bit casts, and
    eager attention saves head-repeated copies instead of the originals."""
    if w.checkpointing is Checkpointing.FULL:
        return 0
    c, amp_rope = ctx.rg.compute, ctx.rg.autocast and ctx.rg.stream == 4
    total = 0.0
    for g, n in stage.groups:
        a = g.attn
        if a.kind == "mla" or not a.rope:
            continue
        k_b = 4 if amp_rope else c
        if w.attention is Attention.EAGER:
            per = (k_b + c) * a.kv_dim
        elif k_b != c:
            per = k_b * a.kv_dim
        else:
            continue
        total += n * per / w.parallel.tp
    return math.ceil(total * tokens)
