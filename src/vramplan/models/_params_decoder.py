"""Exact parameter counts of decoder-only transformers (dense, MoE, MLA), as transformers builds them.

Every term mirrors a module of the HF implementation: q/k/v/o projections (with the biases
the config switches on), gated MLP (3 matrices), RMSNorm weights, router, shared experts,
and the LM head unless it is tied to the embedding.
"""

from __future__ import annotations

from ..errors import ConfigError
from .arch import BASE, CAUSAL_LM, SEQ_CLS, ParamLayout, num_labels
from .config_view import ConfigView


def head_dim(v: ConfigView, arch: ParamLayout) -> int:
    """Explicit ``head_dim`` (Gemma, Llama 3.2, Qwen3) else hidden / heads."""
    hidden = v.integer("hidden_size")
    heads = v.integer("num_attention_heads")
    if heads == 0:
        return 0
    if not v.has("head_dim") and hidden % heads:
        raise ConfigError(f"{v.origin}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}",
                          hint="fix the config.json, or give head_dim explicitly")
    return v.integer("head_dim", hidden // heads)


def kv_heads(v: ConfigView, arch: ParamLayout) -> int:
    heads = v.integer("num_attention_heads")
    kv = v.integer("num_key_value_heads", arch.defaults.get("num_key_value_heads", heads))
    if heads and (kv == 0 or heads % kv):
        raise ConfigError(f"{v.origin}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}",
                          hint="fix the config.json (grouped-query attention shares each KV head among whole groups)")
    return kv


def moe_layers(v: ConfigView, arch: ParamLayout) -> list[bool]:
    """Per layer: does it use the sparse MoE block (True) or a dense MLP (False)?"""
    n = v.integer("num_hidden_layers")
    if arch.moe in ("mixtral", "gpt_oss"):
        return [True] * n
    if arch.moe in ("qwen2_moe", "qwen3_moe"):
        experts = v.integer("num_experts")
        step = v.integer("decoder_sparse_step", 1)
        only_mlp = set(v.integers("mlp_only_layers"))
        return [i not in only_mlp and experts > 0 and step > 0 and (i + 1) % step == 0
                for i in range(n)]
    if arch.moe == "deepseek":
        first_dense = v.integer("first_k_dense_replace", 0)
        return [i >= first_dense for i in range(n)]
    if arch.moe == "llama4":  # Llama4TextConfig: moe_layers, else every step-th layer from step - 1
        given = v.integers("moe_layers")
        step = v.integer("interleave_moe_layer_step", 1)
        chosen = set(given) if given else set(range(step - 1, n, step)) if step > 0 else set()
        return [i in chosen for i in range(n)]
    return [False] * n


def n_experts(v: ConfigView, arch: ParamLayout) -> int:
    if arch.moe in ("mixtral", "gpt_oss", "llama4"):
        return v.integer("num_local_experts")
    if arch.moe in ("qwen2_moe", "qwen3_moe"):
        return v.integer("num_experts")
    if arch.moe == "deepseek":
        return v.integer("n_routed_experts")
    return 0


def expert_intermediate(v: ConfigView, arch: ParamLayout) -> int:
    if arch.moe in ("mixtral", "gpt_oss", "llama4"):
        return v.integer("intermediate_size")
    return v.integer("moe_intermediate_size") if arch.moe else 0


def dense_intermediate(v: ConfigView, arch: ParamLayout) -> int:
    """Width of the dense MLP of the layers without experts (Llama 4: ``intermediate_size_mlp``)."""
    if arch.moe == "llama4":
        return v.integer("intermediate_size_mlp")
    return v.integer("intermediate_size")


def shared_intermediate(v: ConfigView, arch: ParamLayout) -> int:
    """Width of the always-on shared expert MLP (0 when there is none)."""
    if arch.moe == "qwen2_moe":
        return v.integer("shared_expert_intermediate_size", 0)
    if arch.moe == "deepseek":
        return v.integer("moe_intermediate_size") * v.integer("n_shared_experts", 0)
    if arch.moe == "llama4":  # one shared expert as wide as a routed one
        return v.integer("intermediate_size")
    return 0


def _flag(v: ConfigView, arch: ParamLayout, key: str) -> bool:
    if not key:
        return False
    if key == "always":
        return True
    return v.flag(key, bool(arch.defaults.get(key, False)))


def _attention(v: ConfigView, arch: ParamLayout) -> int:
    d = v.integer("hidden_size")
    h = v.integer("num_attention_heads")
    hd = head_dim(v, arch)
    kv = kv_heads(v, arch)
    n = d * h * hd + 2 * d * kv * hd + h * hd * d
    if _flag(v, arch, arch.qkv_bias):
        n += h * hd + 2 * kv * hd
    if _flag(v, arch, arch.o_bias):
        n += d
    if arch.qk_norm:
        n += 2 * hd
    if arch.attn_sinks:
        n += h
    return n


def _mla_attention(v: ConfigView) -> int:
    d = v.integer("hidden_size")
    h = v.integer("num_attention_heads")
    nope = v.integer("qk_nope_head_dim")
    rope = v.integer("qk_rope_head_dim")
    vd = v.integer("v_head_dim")
    q_lora = v.integer("q_lora_rank", 0)
    kv_lora = v.integer("kv_lora_rank")
    bias = v.flag("attention_bias", False)
    qk = nope + rope
    n = (d * q_lora + (q_lora if bias else 0) + q_lora + q_lora * h * qk) if q_lora else d * h * qk
    n += d * (kv_lora + rope) + ((kv_lora + rope) if bias else 0) + kv_lora
    n += kv_lora * h * (nope + vd)
    n += h * vd * d + (d if bias else 0)
    return n


def _dense_mlp(v: ConfigView, arch: ParamLayout, width: int) -> int:
    d = v.integer("hidden_size")
    n = 3 * d * width
    if arch.mlp_bias and v.flag("mlp_bias", False):
        n += 2 * width + d
    return n


def _head(v: ConfigView, arch: ParamLayout, head: str) -> int:
    d = v.integer("hidden_size")
    if head == CAUSAL_LM:
        tied = v.flag("tie_word_embeddings", arch.tie_default)
        return 0 if tied else d * v.integer("vocab_size")
    if head == SEQ_CLS:
        return d * num_labels(v.raw)
    assert head == BASE
    return 0


def count_decoder(v: ConfigView, arch: ParamLayout, head: str) -> tuple[int, int]:
    d = v.integer("hidden_size")
    attn = _mla_attention(v) if arch.kind == "mla" else _attention(v, arch)
    per_layer_fixed = attn + arch.norms_per_layer * d
    total = v.integer("vocab_size") * d + d + _head(v, arch, head)
    inactive = 0
    sparse = moe_layers(v, arch)
    experts = n_experts(v, arch)
    width = expert_intermediate(v, arch)
    expert = 3 * d * width
    router = d
    if arch.moe == "gpt_oss":  # gate_up_proj_bias (2I), down_proj_bias (d); router bias
        expert += 2 * width + d
        router += 1
    shared = shared_intermediate(v, arch)
    k = v.integer("num_experts_per_tok", 0) if arch.moe else 0
    dense_width = dense_intermediate(v, arch)
    for is_moe in sparse:
        total += per_layer_fixed
        if not is_moe:
            total += _dense_mlp(v, arch, dense_width)
            continue
        total += experts * expert + experts * router  # experts + router
        if shared:
            total += 3 * d * shared
            if arch.moe == "qwen2_moe":
                total += d  # shared_expert_gate: hidden -> 1
        inactive += max(experts - k, 0) * expert
    return total, total - inactive
