"""BERT-style encoders (post-LayerNorm, GELU MLP, dropout) as :class:`~.arch.Arch`.

Training and inference use the masked-LM head of ``BertForMaskedLM`` (dense + GELU +
LayerNorm + decoder tied to the word embeddings), which produces logits for every position.
"""

from __future__ import annotations

from dataclasses import replace

from vramplan.models.spec import ModelSpec

from ._config import act_saves, get_float, get_int
from .arch import Arch, Attn, Ffn, Head, LayerGroup, Linear


def build(spec: ModelSpec) -> Arch:
    cfg, shape = spec.config, spec.shape
    h, heads, head_dim = shape.hidden, shape.heads, shape.head_dim
    attn = Attn(
        heads=heads, kv_heads=shape.kv_heads, head_dim=head_dim, v_head_dim=head_dim,
        causal=False, rope=False,
        dropout=get_float(cfg, "attention_probs_dropout_prob", "attention_dropout"),
    )
    ffn = Ffn(kind="plain", intermediate=shape.intermediate or 4 * h, act_saves=act_saves(cfg, "gelu"),
              dropout=get_float(cfg, "hidden_dropout_prob", "hidden_dropout"))
    lins = encoder_linears(h, attn, ffn)
    biases = sum(lin.d_out for lin in lins)
    group = LayerGroup(name="encoder", count=shape.layers, linears=lins, attn=attn, ffn=ffn,
                       norm="layernorm", small_params=biases + 2 * 2 * h)
    type_vocab = get_int(cfg, "type_vocab_size", default=2)
    head = Head(
        kind="mlm", classes=shape.vocab, tied=True,
        linears=(Linear("transform.dense", "head_transform", h, h, tp=False, lora=False),),
        small_params=h + 2 * h + shape.vocab,  # transform bias, LayerNorm, decoder bias
    )
    arch = Arch(
        shape=shape, groups=(group,),
        head=head, embed_params=(shape.vocab + spec.max_positions + type_vocab) * h + 2 * h,
        norm="layernorm", embed_dropout=ffn.dropout,
    )
    return replace(arch, extra_params=max(0, spec.params - arch.structured_params))


def encoder_linears(h: int, a: Attn, f: Ffn) -> tuple[Linear, ...]:
    """BERT/ViT module names: PEFT's ``dense`` matches the three output projections."""
    return (
        Linear("query", "q", h, a.q_dim, attn=True),
        Linear("key", "k", h, a.kv_dim, attn=True),
        Linear("value", "v", h, a.kv_dim, attn=True),
        Linear("dense", "o", a.q_dim, h, attn=True),
        Linear("dense", "fc1", h, f.intermediate),
        Linear("dense", "fc2", f.intermediate, h),
    )
