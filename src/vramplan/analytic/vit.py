"""Vision transformers (ViT, DeiT): pre-LayerNorm encoder over image patches.

Tokens per image = (image_size / patch_size)² + 1 (the class token). The head classifies
the class token only, so its logits are tiny; CNNs and UNets are not analytic (trace them).
"""

from __future__ import annotations

from dataclasses import replace

from vramplan.models.shape import vit_tokens
from vramplan.models.spec import ModelSpec

from ._config import act_saves, get_float
from .arch import Arch, Attn, Ffn, Head, LayerGroup, Linear
from .encoder import encoder_linears


def num_labels(spec: ModelSpec) -> int:
    labels = spec.config.get("id2label")
    if isinstance(labels, dict) and labels:
        return len(labels)
    n = spec.config.get("num_labels")
    return n if isinstance(n, int) and n > 0 else 1000


def build(spec: ModelSpec) -> Arch:
    cfg, shape = spec.config, spec.shape
    h, heads, head_dim = shape.hidden, shape.heads, shape.head_dim
    attn = Attn(heads=heads, kv_heads=shape.kv_heads, head_dim=head_dim, v_head_dim=head_dim,
                causal=False, rope=False, dropout=get_float(cfg, "attention_probs_dropout_prob"))
    ffn = Ffn(kind="plain", intermediate=shape.intermediate or 4 * h, act_saves=act_saves(cfg, "gelu"),
              dropout=get_float(cfg, "hidden_dropout_prob"))
    lins = encoder_linears(h, attn, ffn)
    qkv_bias = cfg.get("qkv_bias", True) is not False
    biases = sum(lin.d_out for lin in lins if qkv_bias or lin.role not in ("q", "k", "v"))
    group = LayerGroup(name="encoder", count=shape.layers, linears=lins, attn=attn, ffn=ffn,
                       norm="layernorm", small_params=biases + 2 * 2 * h)
    labels = num_labels(spec)
    patch, size = shape.patch_size, shape.image_size
    embed = spec.num_channels * patch * patch * h + h + h + vit_tokens(size, patch) * h
    head = Head(kind="cls", classes=labels,
                linears=(Linear("classifier", "head", h, labels, tp=False, lora=False),),
                small_params=labels)
    arch = Arch(
        shape=shape, groups=(group,), head=head,
        embed_params=embed, norm="layernorm", final_norm_params=2 * h,
        embed_dropout=ffn.dropout,
    )
    return replace(arch, extra_params=max(0, spec.params - arch.structured_params))
