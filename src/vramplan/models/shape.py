"""The one model shape: the dimensions every method reads, derived once from a :class:`ModelSpec`.

A :class:`ModelSpec` is the config as normalised (fields that do not apply are 0 / None);
:func:`model_shape` decides the defaults once — head size ``hidden / heads``, ``kv_heads =
heads``, the MLA query/key and value widths, the MLP width a token passes through, KV-cache
elements per token, the matmul and head parameters, the ViT patch grid — so that the analytic
method (:mod:`vramplan.analytic`), the runtime model (:mod:`vramplan.runtime`) and the FLOPs
model (:mod:`.flops`) agree on what a layer, a head and a token are. Tokens per sample, per rank
and per step are derived here too (:func:`tokens`), once.
"""

from __future__ import annotations

from vramplan._dataclass import dataclass
from vramplan.workload import Workload

from .spec import Family, ModelSpec

SEQUENCE_FAMILIES = (Family.DENSE, Family.MOE, Family.MLA, Family.ENCODER, Family.VIT)
"""Families whose shape is known (transformers); others (CNNs, UNets) are traced."""
DECODER_FAMILIES = (Family.DENSE, Family.MOE, Family.MLA)
DEFAULT_PATCH = 16
"""ViT patch size when the config does not say."""
DEFAULT_IMAGE = 224


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """Dimensions of one model replica (before tensor/pipeline/expert-parallel splits)."""

    name: str
    family: Family
    model_type: str = ""
    params: int
    """Total parameters (published / exact)."""
    active_params: int
    """Parameters touched per token (MoE: routed experts only)."""
    matmul_params: int
    """Active parameters that take part in a matmul per token (the input embedding lookup does
    not; a tied embedding does, as the output head)."""
    head_params: int
    """Parameters of the output head matmul (vocab × hidden: a decoder's LM head, an encoder's
    masked-LM decoder), 0 for ViT."""
    layers: int
    hidden: int
    heads: int
    """Query heads (1 when unknown)."""
    kv_heads: int
    head_dim: int
    """Head size of standard attention (``hidden / heads`` unless the config says)."""
    qk_dim: int
    """Per-head query/key width (MLA: nope + rope)."""
    v_dim: int
    intermediate: int
    """Dense MLP width as configured (0 when unknown)."""
    moe_intermediate: int
    """Per-expert MLP width (MoE)."""
    ffn: int
    """MLP width a token passes through (MoE: routed experts per token + shared)."""
    vocab: int
    """Vocabulary size as configured (BERT's MLM head reads it; ViT: 0)."""
    causal: bool
    """A decoder: causal attention, logits over the vocabulary for every position."""
    sliding_window: int | None
    sliding_layers: int
    kv_elems: int
    """KV-cache elements per token per layer (2·kv_heads·head_dim; MLA: latent + rope)."""
    n_experts: int
    experts_per_token: int
    shared_experts: int = 0
    tie_embeddings: bool = False
    patch_size: int = DEFAULT_PATCH
    """ViT patch size."""
    image_size: int = DEFAULT_IMAGE
    """ViT image size the config was trained at (position embeddings)."""

    @property
    def is_decoder(self) -> bool:
        return self.family in DECODER_FAMILIES

    @property
    def is_sequence(self) -> bool:
        """A transformer whose shape is known (others are traced)."""
        return self.family in SEQUENCE_FAMILIES

    @property
    def lm_vocab(self) -> int:
        """Logit width per position of a decoder's LM head (0 for encoders/ViT)."""
        return self.vocab if self.causal else 0

    def tokens_per_sample(self, w: Workload) -> int:
        """Sequence positions one sample occupies (ViT: patches + class token)."""
        if self.family is Family.VIT:
            return vit_tokens(w.image_size, self.patch_size)
        return w.seq


def vit_tokens(image_size: int, patch_size: int) -> int:
    """Positions of a ViT: (image_size / patch_size)² patches + the class token."""
    return (image_size // patch_size) ** 2 + 1


def model_shape(spec: ModelSpec) -> ModelShape:
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
    moe_i = spec.moe_intermediate or spec.intermediate
    if spec.is_moe:
        ffn = moe_i * (spec.experts_per_token + spec.shared_experts)
    else:
        ffn = spec.intermediate
    active = spec.active_params or spec.params
    decoder = spec.is_decoder
    # the head matmul: a decoder's logits over the vocabulary (tied or not), an encoder's masked-LM
    # decoder (tied to the word embeddings, BertForMaskedLM); an untied input embedding is a lookup
    lm_head = decoder or spec.family is Family.ENCODER
    head = spec.vocab * hidden if lm_head else 0
    embed_lookup = 0 if spec.tie_embeddings or spec.family is Family.ENCODER or not decoder else spec.vocab * hidden
    matmul = max(active - embed_lookup, 0) if hidden else active
    return ModelShape(
        name=spec.name, family=spec.family, model_type=spec.model_type,
        params=spec.params, active_params=active, matmul_params=matmul or active, head_params=head,
        layers=spec.layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        qk_dim=qk, v_dim=v, intermediate=spec.intermediate, moe_intermediate=moe_i, ffn=ffn,
        vocab=0 if spec.family is Family.VIT else spec.vocab, causal=decoder, sliding_window=spec.sliding_window,
        sliding_layers=spec.sliding_layers, kv_elems=kv_elems, n_experts=spec.n_experts,
        experts_per_token=spec.experts_per_token, shared_experts=spec.shared_experts,
        tie_embeddings=spec.tie_embeddings, patch_size=spec.patch_size or DEFAULT_PATCH,
        image_size=spec.image_size or DEFAULT_IMAGE,
    )


def opaque_shape(name: str, params: int) -> ModelShape:
    """A model known only by its parameter count (CNNs, UNets: FLOPs come from a trace)."""
    return ModelShape(
        name=name, family=Family.OTHER, params=params, active_params=params, matmul_params=params,
        head_params=0, layers=0, hidden=0, heads=1, kv_heads=1, head_dim=0, qk_dim=0, v_dim=0,
        intermediate=0, moe_intermediate=0, ffn=0, vocab=0, causal=False, sliding_window=None,
        sliding_layers=0, kv_elems=0, n_experts=0, experts_per_token=0,
    )


@dataclass(frozen=True)
class Tokens:
    """How many tokens (sequence positions) one step processes, derived once from a workload.

    ``micro_batch`` = batch × positions per sample, on one model replica; context parallelism
    splits each sequence over ``cp`` ranks, data parallelism the global batch over ``dp``.
    """

    per_sample: int
    """Positions of one sample (text: ``seq``; ViT: patches + 1)."""
    batch: int
    """Samples per micro-batch per data-parallel rank."""
    cp: int
    microbatches: int
    """Gradient-accumulation micro-batches per optimizer step."""
    dp: int

    @property
    def micro_batch(self) -> int:
        """Tokens of one micro-batch on one replica (before the CP split)."""
        return self.batch * self.per_sample

    @property
    def per_rank(self) -> int:
        """Tokens of one micro-batch on one rank (its CP share of each sequence)."""
        return self.micro_batch // self.cp

    @property
    def samples_per_step(self) -> int:
        """Samples one data-parallel rank processes per optimizer step."""
        return self.batch * self.microbatches

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all data-parallel ranks."""
        return self.samples_per_step * self.dp

    @property
    def global_tokens(self) -> int:
        """Tokens per optimizer step over all data-parallel ranks."""
        return self.micro_batch * self.microbatches * self.dp


def tokens(w: Workload, per_sample: int | None = None) -> Tokens:
    """The token counts of ``w``; ``per_sample`` defaults to ``w.seq`` (pass
    :meth:`ModelShape.tokens_per_sample` for a ViT)."""
    p = w.parallel
    return Tokens(per_sample=w.seq if per_sample is None else per_sample, batch=w.batch, cp=p.cp,
                  microbatches=w.grad_accum, dp=p.dp)


def samples_per_rank(global_batch: int, dp: int) -> int | None:
    """Samples per step on each of ``dp`` data-parallel ranks sharing ``global_batch`` (micro-batch ×
    accumulation); None when the global batch does not split evenly."""
    return global_batch // dp if global_batch % dp == 0 else None


__all__ = [
    "DECODER_FAMILIES", "SEQUENCE_FAMILIES", "ModelShape", "Tokens", "model_shape", "opaque_shape",
    "samples_per_rank", "tokens", "vit_tokens",
]
