"""Exact parameter counts of GPT-2, BERT and ViT (LayerNorm, biased linears, learned positions)."""

from __future__ import annotations

from .arch import BASE, CAUSAL_LM, IMAGE_CLS, MASKED_LM, SEQ_CLS, ParamLayout, num_labels
from .config_view import ConfigView


def _block(d: int, inner: int, qkv_bias: bool = True) -> int:
    """Post-/pre-LN transformer block: q,k,v,o (+biases), 2 LayerNorms, 2-matrix MLP (+biases)."""
    return 4 * d * d + (3 * d if qkv_bias else 0) + d + 2 * 2 * d + 2 * d * inner + inner + d


def count_gpt2(v: ConfigView, arch: ParamLayout, head: str) -> tuple[int, int]:
    d = v.integer("n_embd")
    inner = v.integer("n_inner", 4 * d)
    vocab = v.integer("vocab_size")
    n = vocab * d + v.integer("n_positions") * d + 2 * d  # wte, wpe, ln_f
    block = _block(d, inner)
    if v.raw.get("model_type") == "gpt_bigcode" and v.flag("multi_query", True):
        kv = d // max(1, v.integer("n_head"))  # one K and one V head: c_attn is d x (d + 2 kv)
        block -= 2 * (d * d + d) - 2 * (d * kv + kv)
    n += v.integer("n_layer") * block
    if head == CAUSAL_LM and not v.flag("tie_word_embeddings", arch.tie_default):
        n += vocab * d
    elif head == SEQ_CLS:
        n += d * num_labels(v.raw)  # score, no bias
    return n, n


def count_bert(v: ConfigView, arch: ParamLayout, head: str) -> tuple[int, int]:
    d = v.integer("hidden_size")
    vocab = v.integer("vocab_size")
    n = (vocab + v.integer("max_position_embeddings", 512) + v.integer("type_vocab_size", 2)) * d
    n += 2 * d  # embeddings LayerNorm
    n += v.integer("num_hidden_layers") * _block(d, v.integer("intermediate_size"))
    pooler = d * d + d
    if head == MASKED_LM:  # no pooler; transform (dense + LayerNorm) and decoder bias
        n += d * d + d + 2 * d + vocab
        if not v.flag("tie_word_embeddings", arch.tie_default):
            n += vocab * d + vocab  # untied, the decoder keeps its own bias besides the head's
    elif head == SEQ_CLS:
        labels = num_labels(v.raw)
        n += pooler + d * labels + labels
    else:
        assert head == BASE
        n += pooler
    return n, n


def count_vit(v: ConfigView, arch: ParamLayout, head: str) -> tuple[int, int]:
    d = v.integer("hidden_size")
    channels = v.integer("num_channels", 3)
    patch = v.integer("patch_size", 16)
    image = v.integer("image_size", 224)
    patches = (image // patch) ** 2 if patch else 0
    n = channels * patch * patch * d + d  # patch projection (conv) + bias
    n += d + (patches + 1) * d  # cls token, position embeddings
    block = _block(d, v.integer("intermediate_size"), qkv_bias=v.flag("qkv_bias", True))
    n += v.integer("num_hidden_layers") * block + 2 * d  # final LayerNorm
    if head == IMAGE_CLS:
        labels = num_labels(v.raw)
        n += d * labels + labels
    else:
        assert head == BASE
        out = v.integer("pooler_output_size", d)
        n += d * out + out
    return n, n
