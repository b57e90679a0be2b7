"""Decoder-only transformers: dense (Llama, Mistral, Qwen, Gemma, Phi, GPT-2), MoE
(Mixtral, Qwen-MoE) and MLA (DeepSeek-V2/V3) — as :class:`~.arch.Arch`.

Module names follow transformers 5 (what PEFT targets match): ``q_proj … down_proj`` for
Llama-style models, ``c_attn/c_proj/c_fc`` for GPT-2, ``qkv_proj/gate_up_proj`` for Phi-3.
MoE experts are 3-D parameters (``experts.gate_up_proj``, ``experts.down_proj``) in
transformers 5, so PEFT's ``all-linear`` does not wrap them.
"""

from __future__ import annotations

from dataclasses import replace

from vramplan.models.shape import ModelShape
from vramplan.models.spec import Family, ModelSpec

from ._config import act_saves, get_bool, get_float, get_int
from .arch import Arch, Attn, Ffn, Head, LayerGroup, Linear
from .parallel import ROW_PARALLEL

_ALWAYS_QKV_BIAS = frozenset({"qwen2", "qwen2_moe", "qwen2_vl"})
GPT2_LIKE = frozenset({"gpt2", "gpt_bigcode"})
"""GPT-2 layout: c_attn / c_proj / c_fc, learned positions, LayerNorm, plain GELU MLP
(GPTBigCode / StarCoder is GPT-2 with multi-query attention)."""
_QK_NORM = frozenset({"qwen3", "qwen3_moe", "gemma3", "gemma3_text"})
_SANDWICH = frozenset({"gemma2", "gemma3", "gemma3_text"})


def build(spec: ModelSpec) -> Arch:
    cfg, shape = spec.config, spec.shape
    h, heads = shape.hidden, shape.heads
    head_dim, kv_heads = shape.head_dim, shape.kv_heads
    mt = spec.model_type
    gpt2 = mt in GPT2_LIKE
    norm = "layernorm" if gpt2 else spec.norm_kind
    if norm == "rmsnorm" and mt.startswith("gemma"):
        norm = "gemma_rmsnorm"
    norm_p = (2 if norm == "layernorm" else 1) * h
    sandwich = mt in _SANDWICH
    layer_norms = norm_p * (4 if sandwich else 2)
    attn_drop = get_float(cfg, "attn_pdrop", "attention_dropout")
    resid_drop = get_float(cfg, "resid_pdrop") if gpt2 else 0.0

    if spec.family is Family.MLA:
        attn = Attn(
            kind="mla", heads=heads, kv_heads=heads,
            head_dim=shape.qk_dim, v_head_dim=shape.v_dim, softmax_fp32=True, dropout=attn_drop,
            q_lora_rank=spec.q_lora_rank, kv_lora_rank=spec.kv_lora_rank,
            rope_dim=spec.qk_rope_head_dim, nope_dim=spec.qk_nope_head_dim,
        )
        attn_lins = _mla_linears(spec, attn)
        attn_small = spec.kv_lora_rank + spec.q_lora_rank  # q_a / kv_a RMSNorm weights
        attn_col = 0
    else:
        attn = Attn(
            heads=heads, kv_heads=kv_heads, head_dim=head_dim, v_head_dim=head_dim,
            rope=not gpt2, softmax_fp32=not gpt2, dropout=attn_drop, qk_norm=mt in _QK_NORM,
        )
        attn_lins = _mha_linears(mt, h, attn)
        attn_small = attn_col = 0  # (attn_col: the column-parallel linears' biases, which TP shards)
        if gpt2 or get_bool(cfg, "attention_bias"):
            attn_small = sum(lin.d_out for lin in attn_lins)
            attn_col = sum(lin.d_out for lin in attn_lins if lin.role not in ROW_PARALLEL)
        elif mt in _ALWAYS_QKV_BIAS:
            attn_small = attn_col = attn.q_dim + 2 * attn.kv_dim  # Qwen2: q, k, v biases, none on o
        if attn.qk_norm:
            attn_small += 2 * head_dim  # q_norm, k_norm weights shared across heads

    act = act_saves(cfg, ("gelu_pytorch_tanh" if mt == "gpt_bigcode" else "gelu_new") if gpt2 else "silu")
    mlp_bias = gpt2 or get_bool(cfg, "mlp_bias")
    dense_ffn = Ffn(kind="plain" if spec.mlp_kind == "plain" or gpt2 else "gated",
                    intermediate=shape.intermediate or 4 * h, act_saves=act, dropout=resid_drop)
    dense_lins = _mlp_linears(mt, h, dense_ffn)
    dense_small = layer_norms + attn_small + (sum(lin.d_out for lin in dense_lins) if mlp_bias else 0)
    dense_col = attn_col + (sum(lin.d_out for lin in dense_lins if lin.role not in ROW_PARALLEL) if mlp_bias else 0)
    groups: list[LayerGroup] = []
    n_dense = shape.layers
    if spec.is_moe:
        n_dense = min(spec.dense_layers, shape.layers)
        moe_i = shape.moe_intermediate
        shared_i = get_int(cfg, "shared_expert_intermediate_size") or shape.shared_experts * moe_i
        moe_ffn = Ffn(kind="moe", intermediate=moe_i, act_saves=act, experts=shape.n_experts,
                      top_k=shape.experts_per_token or 1, shared_intermediate=shared_i,
                      router_fp32=spec.family is Family.MLA)
        moe_lins = _moe_linears(h, moe_ffn)
        moe_small = layer_norms + attn_small
        if spec.model_type == "gpt_oss":
            # transformers models/gpt_oss/modeling_gpt_oss.py: expert biases (gate_up 2i and down h
            # per expert), a router bias per expert and one attention sink per head
            e = moe_ffn.experts
            moe_small += e * (2 * moe_i + h) + e + heads
        groups.append(LayerGroup(  # DeepSeek's e_score_correction_bias is a buffer, not counted
            name="moe", count=shape.layers - n_dense, linears=attn_lins + moe_lins, attn=attn,
            ffn=moe_ffn, norm=norm, post_norms=sandwich, small_params=moe_small, tp_small=attn_col,
        ))
    if n_dense:
        groups.insert(0, LayerGroup(
            name="dense", count=n_dense, linears=attn_lins + dense_lins, attn=attn,
            ffn=dense_ffn, norm=norm, post_norms=sandwich, small_params=dense_small, tp_small=dense_col,
        ))
    groups = _split_sliding(shape, groups)
    tied = shape.tie_embeddings
    head = Head(
        kind="lm", classes=shape.vocab, tied=tied,
        linears=() if tied else (Linear("lm_head", "head", h, shape.vocab, lora=False),),
        softcap=bool(cfg.get("final_logit_softcapping")),
    )
    embed = shape.vocab * h + (spec.max_positions * h if gpt2 else 0)
    arch = Arch(
        shape=shape, groups=tuple(groups),
        head=head, embed_params=embed, norm=norm, final_norm_params=norm_p,
        embed_dropout=get_float(cfg, "embd_pdrop") if gpt2 else 0.0,
    )
    return replace(arch, extra_params=max(0, spec.params - arch.structured_params))


def value_head(arch: Arch) -> Arch:
    """``arch`` as PPO's critic: the backbone and a scalar score head in place of the LM head, as verl
    0.7.0 builds its critic (``fsdp_workers.py`` ``_build_critic_model_optimizer``: ``num_labels = 1``,
    ``classifier_dropout = 0.0``, loaded with ``AutoModelForTokenClassification``, L1292-L1310) and as
    :class:`vramplan.trace.ppo.ValueModel` traces it. transformers 5.24 ``modeling_layers.py:268-290``
    ``GenericForTokenClassification``: the base model (the embeddings, the layers, the final norm; no
    LM head, so nothing is tied) then ``score = nn.Linear(hidden_size, num_labels)``, one value per
    token. A per-token output as the LM head's (``kind="lm"``), of one class: the embeddings are the
    embeddings alone, the root unit under FSDP2 the embeddings, the final norm and the ``[1, hidden]``
    score. (transformers gives ``score`` a bias, ``token_classification_bias``; the trace's value head has
    none: one element, left out as the trace does.)"""
    h = arch.hidden
    head = Head(kind="lm", classes=1, tied=False, linears=(Linear("score", "head", h, 1, tp=False, lora=False),))
    return replace(arch, head=head)


def _mha_linears(mt: str, h: int, a: Attn) -> tuple[Linear, ...]:
    if mt in GPT2_LIKE:
        return (Linear("c_attn", "qkv", h, a.q_dim + 2 * a.kv_dim, attn=True),
                Linear("c_proj", "o", a.q_dim, h, attn=True))
    if mt == "phi3":
        return (Linear("qkv_proj", "qkv", h, a.q_dim + 2 * a.kv_dim, attn=True),
                Linear("o_proj", "o", a.q_dim, h, attn=True))
    return (
        Linear("q_proj", "q", h, a.q_dim, attn=True),
        Linear("k_proj", "k", h, a.kv_dim, attn=True),
        Linear("v_proj", "v", h, a.kv_dim, attn=True),
        Linear("o_proj", "o", a.q_dim, h, attn=True),
    )


def _mla_linears(spec: ModelSpec, a: Attn) -> tuple[Linear, ...]:
    h, n = spec.hidden, a.heads
    q: tuple[Linear, ...]
    if a.q_lora_rank:
        q = (Linear("q_a_proj", "q_a", h, a.q_lora_rank, tp=False, attn=True),
             Linear("q_b_proj", "q_b", a.q_lora_rank, n * a.head_dim, attn=True))
    else:
        q = (Linear("q_proj", "q", h, n * a.head_dim, attn=True),)
    return q + (
        Linear("kv_a_proj_with_mqa", "kv_a", h, a.kv_lora_rank + a.rope_dim, tp=False, attn=True),
        Linear("kv_b_proj", "kv_b", a.kv_lora_rank, n * (a.nope_dim + a.v_head_dim), attn=True),
        Linear("o_proj", "o", n * a.v_head_dim, h, attn=True),
    )


def _mlp_linears(mt: str, h: int, f: Ffn) -> tuple[Linear, ...]:
    i = f.intermediate
    if f.kind == "plain":
        if mt in GPT2_LIKE:
            return (Linear("c_fc", "fc1", h, i), Linear("c_proj", "fc2", i, h))
        return (Linear("fc1", "fc1", h, i), Linear("fc2", "fc2", i, h))
    if mt == "phi3":
        return (Linear("gate_up_proj", "gate_up", h, 2 * i), Linear("down_proj", "down", i, h))
    return (Linear("gate_proj", "gate", h, i), Linear("up_proj", "up", h, i),
            Linear("down_proj", "down", i, h))


def _moe_linears(h: int, f: Ffn) -> tuple[Linear, ...]:
    i, e = f.intermediate, f.experts
    lins = [
        Linear("gate", "router", h, e, tp=False, lora=False),
        Linear("experts.gate_up_proj", "experts_gate_up", h, 2 * i, count=e, expert=True, lora=False),
        Linear("experts.down_proj", "experts_down", i, h, count=e, expert=True, lora=False),
    ]
    if f.shared_intermediate:
        s = f.shared_intermediate
        lins += [Linear("gate_proj", "shared_gate", h, s), Linear("up_proj", "shared_up", h, s),
                 Linear("down_proj", "shared_down", s, h)]
    return tuple(lins)


def _split_sliding(shape: ModelShape, groups: list[LayerGroup]) -> list[LayerGroup]:
    """Mark sliding-window layers (Mistral v0.1: all; Gemma 2/3: the local ones)."""
    win = shape.sliding_window
    if not win or shape.sliding_layers <= 0:
        return groups
    local_left = min(shape.sliding_layers, shape.layers)
    out: list[LayerGroup] = []
    for g in groups:
        n_local = min(local_left, g.count)
        local_left -= n_local
        if n_local:
            out.append(replace(g, name=f"{g.name}-local", count=n_local, attn=replace(g.attn, window=win)))
        if g.count - n_local:
            out.append(replace(g, count=g.count - n_local))
    return out
