"""What vramplan knows about each architecture: family, layout rules and the task heads.

One :class:`ParamLayout` per ``model_type`` (or diffusers ``_class_name``). The parameter formulas
(:mod:`.params`), the ModelSpec normaliser (:mod:`.normalize`) and the meta builder
(:mod:`.build`) all read this table, so a new architecture is added in one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import field
from typing import Any

from vramplan._dataclass import dataclass
from vramplan.errors import ConfigError

from .spec import Family

# Task heads a catalog model can be built with (``build_model(head=...)``).
CAUSAL_LM = "causal-lm"
MASKED_LM = "masked-lm"
SEQ_CLS = "sequence-classification"
IMAGE_CLS = "image-classification"
BASE = "base"
"""The bare backbone (HF ``*Model``; BERT/ViT with their pooler)."""
DENOISE = "denoise"
"""A diffusion UNet predicting noise."""
IMAGE_TEXT = "image-text-to-text"
"""A vision-language model: a vision tower whose image tokens join the text of a causal LM
(transformers ``AutoModelForImageTextToText``)."""
DENOISERS = ("UNet2DConditionModel", "FluxTransformer2DModel", "WanTransformer3DModel")
"""diffusers denoisers (their ``_class_name``) built with the ``denoise`` head."""
HEADS: tuple[str, ...] = (CAUSAL_LM, MASKED_LM, SEQ_CLS, IMAGE_CLS, BASE, DENOISE, IMAGE_TEXT)


@dataclass(frozen=True, kw_only=True)
class ParamLayout:
    """How one transformers ``model_type`` lays out its parameters (see CONTRIBUTING.md)."""

    family: Family
    kind: str
    """Layout the parameter formula follows: decoder | mla | gpt2 | bert | vit | resnet | unet | dit | vlm
    (vision-language: trace only, its language model's sizes read for display)."""
    heads: tuple[str, ...]
    """Heads this architecture supports; the first is the default."""
    tie_default: bool = False
    """``tie_word_embeddings`` when the config does not say."""
    qkv_bias: str = ""
    """Whether q/k/v carry a bias: '' never, 'always' (Qwen2), or the config key that says."""
    o_bias: str = ""
    """Whether the output projection carries a bias: '' never, or the config key that says."""
    mlp_bias: bool = False
    """The dense MLP honours the config's ``mlp_bias`` (Llama)."""
    qk_norm: bool = False
    """Per-head RMSNorm on q and k (Qwen3, Gemma 3)."""
    norms_per_layer: int = 2
    """RMSNorms per decoder layer (Gemma 2/3 add pre/post-feedforward norms: 4)."""
    moe: str = ""
    """MoE layout: mixtral | qwen2_moe | qwen3_moe | deepseek | gpt_oss | llama4 ('' = dense)."""
    attn_sinks: bool = False
    """One learned attention-sink logit per query head (gpt-oss)."""
    sliding: str = "none"
    """Which layers use ``sliding_window``: all | qwen | alternate | pattern | none."""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """HF class defaults for keys a config may omit (where they differ from the generic ones)."""


_DEC = (CAUSAL_LM, SEQ_CLS, BASE)
_AB: dict[str, Any] = {"qkv_bias": "attention_bias", "o_bias": "attention_bias"}

ARCHS: dict[str, ParamLayout] = {
    "llama": ParamLayout(family=Family.DENSE, kind="decoder", heads=_DEC, mlp_bias=True, **_AB),
    "mistral": ParamLayout(family=Family.DENSE, kind="decoder", heads=_DEC, sliding="all",
                    defaults={"num_key_value_heads": 8}),
    "qwen2": ParamLayout(family=Family.DENSE, kind="decoder", heads=_DEC, qkv_bias="always",
                   sliding="qwen"),
    "qwen3": ParamLayout(family=Family.DENSE, kind="decoder", heads=_DEC, qk_norm=True, sliding="qwen",
                   **_AB),
    "phi3": ParamLayout(family=Family.DENSE, kind="decoder", heads=_DEC, sliding="all"),
    "gemma": ParamLayout(family=Family.DENSE, kind="decoder", heads=_DEC, tie_default=True, **_AB),
    "gemma2": ParamLayout(family=Family.DENSE, kind="decoder", heads=_DEC, tie_default=True,
                   norms_per_layer=4, sliding="alternate", defaults={"num_key_value_heads": 4},
                   **_AB),
    "gemma3_text": ParamLayout(family=Family.DENSE, kind="decoder", heads=_DEC, tie_default=True,
                        norms_per_layer=4, qk_norm=True, sliding="pattern",
                        defaults={"num_key_value_heads": 4}, **_AB),
    "mixtral": ParamLayout(family=Family.MOE, kind="decoder", heads=_DEC, moe="mixtral", sliding="all",
                    defaults={"num_key_value_heads": 8}),
    "qwen2_moe": ParamLayout(family=Family.MOE, kind="decoder", heads=_DEC, moe="qwen2_moe",
                      qkv_bias="qkv_bias", sliding="qwen", defaults={"qkv_bias": True}),
    "qwen3_moe": ParamLayout(family=Family.MOE, kind="decoder", heads=_DEC, moe="qwen3_moe",
                      qk_norm=True, sliding="qwen", defaults={"num_key_value_heads": 4}, **_AB),
    # gpt-oss: experts with biased gate_up/down projections, a biased router, attention sinks;
    # transformers models/gpt_oss/modeling_gpt_oss.py
    "gpt_oss": ParamLayout(family=Family.MOE, kind="decoder", heads=_DEC, moe="gpt_oss",
                    attn_sinks=True, sliding="alternate", **_AB),
    # Llama 4 (Scout, Maverick) language model: a routed expert (fused gate_up/down over all experts,
    # a bias-free router) plus one shared expert on every `interleave_moe_layer_step`-th layer, a dense
    # MLP of `intermediate_size_mlp` on the others; its q/k norm is a weightless L2 norm;
    # transformers models/llama4/modeling_llama4.py
    "llama4_text": ParamLayout(family=Family.MOE, kind="decoder", heads=(CAUSAL_LM, BASE), moe="llama4",
                               defaults={"num_key_value_heads": 8}, **_AB),
    "deepseek_v2": ParamLayout(family=Family.MLA, kind="mla", heads=_DEC, moe="deepseek", **_AB),
    "deepseek_v3": ParamLayout(family=Family.MLA, kind="mla", heads=_DEC, moe="deepseek", **_AB),
    "gpt2": ParamLayout(family=Family.DENSE, kind="gpt2", heads=_DEC, tie_default=True),
    # GPTBigCode (StarCoder, SantaCoder): GPT-2 with multi-query attention (multi_query: true →
    # one K/V head); transformers models/gpt_bigcode/modeling_gpt_bigcode.py
    "gpt_bigcode": ParamLayout(family=Family.DENSE, kind="gpt2", heads=_DEC, tie_default=True),
    "bert": ParamLayout(family=Family.ENCODER, kind="bert", heads=(MASKED_LM, SEQ_CLS, BASE),
                 tie_default=True),
    "vit": ParamLayout(family=Family.VIT, kind="vit", heads=(IMAGE_CLS, BASE)),
    "resnet": ParamLayout(family=Family.OTHER, kind="resnet", heads=(IMAGE_CLS, BASE)),
    "UNet2DConditionModel": ParamLayout(family=Family.OTHER, kind="unet", heads=(DENOISE,)),
    # FLUX.1: a diffusion transformer over 2 x 2 patches of 16-channel latents (64 inputs per token),
    # double-stream blocks (image and text tokens apart) then single-stream ones; diffusers
    # models/transformers/transformer_flux.py. Traced (no formula).
    "FluxTransformer2DModel": ParamLayout(family=Family.OTHER, kind="dit", heads=(DENOISE,)),
    # Wan 2.1: a video diffusion transformer over 1 x 2 x 2 patches of 16-channel video latents (8x
    # smaller sides, 4x fewer frames), each block self-attention, cross-attention to the UMT5 text
    # states and a feed-forward; diffusers models/transformers/transformer_wan.py. Traced (no formula).
    "WanTransformer3DModel": ParamLayout(family=Family.OTHER, kind="dit", heads=(DENOISE,)),
    # Qwen2-VL / Qwen2.5-VL: a ViT over 14-pixel patches (windowed attention in 2.5), a merger of
    # 2 x 2 patches into one token of the language model's width, and a Qwen2 language model with
    # multimodal RoPE; transformers models/qwen2_5_vl/modeling_qwen2_5_vl.py. Traced (no formula).
    "qwen2_vl": ParamLayout(family=Family.OTHER, kind="vlm", heads=(IMAGE_TEXT,)),
    "qwen2_5_vl": ParamLayout(family=Family.OTHER, kind="vlm", heads=(IMAGE_TEXT,)),
    # Gemma 3 (4B and up): a SigLIP tower over 896-pixel images, its patches average-pooled to 256
    # soft tokens and projected into a Gemma 3 language model; transformers models/gemma3/modeling_gemma3.py.
    "gemma3": ParamLayout(family=Family.OTHER, kind="vlm", heads=(IMAGE_TEXT,)),
    # LLaVA (1.5): a CLIP tower's second-to-last layer, a 2-layer projector, a Llama language
    # model; transformers models/llava/modeling_llava.py.
    "llava": ParamLayout(family=Family.OTHER, kind="vlm", heads=(IMAGE_TEXT,)),
    # Llama 3.2 Vision: a tiled ViT (up to 4 tiles of 560 pixels, local and global layers) whose
    # states the Llama language model's interleaved cross-attention layers attend to;
    # transformers models/mllama/modeling_mllama.py.
    "mllama": ParamLayout(family=Family.OTHER, kind="vlm", heads=(IMAGE_TEXT,)),
}


def arch_key(config: Mapping[str, Any]) -> str:
    """``model_type``, or the diffusers ``_class_name`` for diffusers configs."""
    key = config.get("model_type") or config.get("_class_name") or ""
    return str(key)


def arch_of(config: Mapping[str, Any]) -> ParamLayout | None:
    """The architecture entry for a config, or None when vramplan has no formula for it."""
    return ARCHS.get(arch_key(config))


def require_arch(config: Mapping[str, Any], origin: str = "config") -> ParamLayout:
    arch = arch_of(config)
    if arch is None:
        key = arch_key(config)
        what = f"model_type '{key}'" if key else "a config without 'model_type'"
        raise ConfigError(
            f"{origin}: no parameter formula for {what}",
            hint=f"known: {', '.join(sorted(ARCHS))}; other models can still be traced",
        )
    return arch


def head_from_architectures(config: Mapping[str, Any]) -> str | None:
    """The head the config's ``architectures[0]`` (or diffusers class) names, if recognisable."""
    if config.get("_class_name") in DENOISERS:
        return DENOISE
    names = config.get("architectures") or []
    name = names[0] if isinstance(names, list) and names and isinstance(names[0], str) else ""
    for suffix, head in (
        ("ForCausalLM", CAUSAL_LM), ("LMHeadModel", CAUSAL_LM), ("ForMaskedLM", MASKED_LM),
        ("ForSequenceClassification", SEQ_CLS), ("ForImageClassification", IMAGE_CLS),
        ("ForConditionalGeneration", IMAGE_TEXT), ("Model", BASE),
    ):
        if name.endswith(suffix):
            return head
    return None


def default_head(config: Mapping[str, Any], arch: ParamLayout) -> str:
    """The head ``architectures`` names when this architecture supports it, else its first."""
    head = head_from_architectures(config)
    return head if head in arch.heads else arch.heads[0]


def check_head(head: str, arch: ParamLayout, origin: str) -> str:
    if head not in arch.heads:
        raise ConfigError(
            f"{origin}: head '{head}' is not available for this architecture",
            hint=f"choose one of {', '.join(arch.heads)}",
        )
    return head


def num_labels(config: Mapping[str, Any]) -> int:
    """Classifier width as transformers computes it: ``id2label`` size, else ``num_labels``, else 2."""
    id2label = config.get("id2label")
    if isinstance(id2label, Mapping) and id2label:
        return len(id2label)
    n = config.get("num_labels")
    return int(n) if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 2
