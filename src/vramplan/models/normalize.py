"""Turn a raw config.json into an architecture-neutral :class:`ModelSpec`.

Each architecture names its sizes differently (``n_embd`` vs ``hidden_size``, ``num_local_experts``
vs ``n_routed_experts``); this module reads them once, so estimators never look at raw keys.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from ._params_decoder import (
    dense_intermediate,
    expert_intermediate,
    head_dim,
    kv_heads,
    moe_layers,
    n_experts,
    shared_intermediate,
)
from .arch import ParamLayout, arch_key, arch_of
from .config_view import ConfigView
from .params import VLM_COUNTED, count_params
from .spec import Family, ModelSpec

_VAE_SCALE = 8
"""Stable Diffusion's VAE downsamples 8x: a UNet ``sample_size`` of 64 is a 512-pixel image."""


def spec_from_config(
    config: Mapping[str, Any],
    *,
    name: str,
    source: str,
    hub_id: str | None = None,
    origin: str | None = None,
    published_params: int | None = None,
    params: int | None = None,
) -> ModelSpec:
    """Normalise ``config`` into a ModelSpec. ``params`` overrides the count for trace-only models."""
    view = ConfigView(config, origin or name)
    arch = arch_of(config)
    fields: dict[str, Any] = {"model_type": arch_key(config), "dtype": _dtype(view)}
    if arch is None:
        fields.update(_generic(view))
        family = Family.OTHER
    else:
        family = arch.family
        fields.update(_READERS[arch.kind](view, arch))
    if arch is not None and (arch.kind in _COUNTED or (arch.kind == "vlm" and fields["model_type"] in VLM_COUNTED)):
        total, active = count_params(config, origin=view.origin)
    else:
        total = active = params or 0
    return ModelSpec(
        name=name, hub_id=hub_id, family=family, source=source, config=config,
        params=total, active_params=active, published_params=published_params, **fields,
    )


_COUNTED = ("decoder", "mla", "gpt2", "bert", "vit")


def _dtype(v: ConfigView) -> str:
    """The checkpoint dtype; transformers writes ``torch_dtype`` (v4) or ``dtype`` (v5)."""
    return v.text("torch_dtype") or v.text("dtype") or "float32"


def _decoder(v: ConfigView, arch: ParamLayout) -> dict[str, Any]:
    layers = v.integer("num_hidden_layers")
    out: dict[str, Any] = {
        "hidden": v.integer("hidden_size"),
        "layers": layers,
        "heads": v.integer("num_attention_heads"),
        "kv_heads": kv_heads(v, arch),
        "head_dim": head_dim(v, arch),
        "intermediate": dense_intermediate(v, arch),
        "vocab": v.integer("vocab_size"),
        "max_positions": v.integer("max_position_embeddings", 0),
        "tie_embeddings": v.flag("tie_word_embeddings", arch.tie_default),
        "mlp_kind": "gated",
        "norm_kind": "rmsnorm",
    }
    window, sliding_layers = _sliding(v, arch, layers)
    out.update(sliding_window=window, sliding_layers=sliding_layers)
    if arch.moe:
        sparse = moe_layers(v, arch)
        experts = n_experts(v, arch)
        width = expert_intermediate(v, arch)
        out.update(
            n_experts=experts,
            experts_per_token=v.integer("num_experts_per_tok"),
            moe_intermediate=width,
            shared_experts=_shared_count(v, arch),
            dense_layers=sum(1 for s in sparse if not s),
        )
    if arch.kind == "mla":
        nope = v.integer("qk_nope_head_dim")
        rope = v.integer("qk_rope_head_dim")
        out.update(
            kv_heads=v.integer("num_key_value_heads", out["heads"]),
            head_dim=nope + rope,
            q_lora_rank=v.integer("q_lora_rank", 0),
            kv_lora_rank=v.integer("kv_lora_rank"),
            qk_rope_head_dim=rope,
            qk_nope_head_dim=nope,
            v_head_dim=v.integer("v_head_dim"),
        )
    return out


def _shared_count(v: ConfigView, arch: ParamLayout) -> int:
    if arch.moe == "deepseek":
        return v.integer("n_shared_experts", 0)
    if arch.moe == "qwen2_moe":
        return 1 if shared_intermediate(v, arch) else 0
    if arch.moe == "llama4":
        return 1
    return 0


def _sliding(v: ConfigView, arch: ParamLayout, layers: int) -> tuple[int | None, int]:
    """(window, number of layers that use it), as transformers decides per architecture."""
    window = v.opt_integer("sliding_window")
    if not window or arch.sliding == "none":
        return None, 0
    types = v.texts("layer_types")
    if types:
        count = sum(1 for t in types if t == "sliding_attention")
        return (window, count) if count else (None, 0)
    if arch.sliding == "qwen":
        if not v.flag("use_sliding_window", False):
            return None, 0
        first = v.integer("max_window_layers", layers)
        return (window, max(layers - first, 0)) if layers > first else (None, 0)
    if arch.sliding == "alternate":  # Gemma 2: even layers local, odd layers global
        return window, (layers + 1) // 2
    if arch.sliding == "pattern":  # Gemma 3: every Nth layer global
        period = v.integer("sliding_window_pattern", 6)
        return window, sum(1 for i in range(layers) if period and (i + 1) % period)
    return window, layers  # "all": Mistral v0.1, Mixtral, Phi-3


def _gpt2(v: ConfigView, arch: ParamLayout) -> dict[str, Any]:
    d = v.integer("n_embd")
    heads = v.integer("n_head")
    mqa = arch_key(v.raw) == "gpt_bigcode" and v.flag("multi_query", True)
    return {
        "hidden": d, "layers": v.integer("n_layer"), "heads": heads, "kv_heads": 1 if mqa else heads,
        "head_dim": d // heads if heads else 0, "intermediate": v.integer("n_inner", 4 * d),
        "vocab": v.integer("vocab_size"), "max_positions": v.integer("n_positions"),
        "tie_embeddings": v.flag("tie_word_embeddings", arch.tie_default),
        "mlp_kind": "plain", "norm_kind": "layernorm",
    }


def _bert(v: ConfigView, arch: ParamLayout) -> dict[str, Any]:
    d = v.integer("hidden_size")
    heads = v.integer("num_attention_heads")
    return {
        "hidden": d, "layers": v.integer("num_hidden_layers"), "heads": heads, "kv_heads": heads,
        "head_dim": d // heads if heads else 0, "intermediate": v.integer("intermediate_size"),
        "vocab": v.integer("vocab_size"), "max_positions": v.integer("max_position_embeddings", 512),
        "tie_embeddings": v.flag("tie_word_embeddings", arch.tie_default),
        "mlp_kind": "plain", "norm_kind": "layernorm",
    }


def _vit(v: ConfigView, arch: ParamLayout) -> dict[str, Any]:
    d = v.integer("hidden_size")
    heads = v.integer("num_attention_heads")
    image = v.integer("image_size", 224)
    patch = v.integer("patch_size", 16)
    return {
        "hidden": d, "layers": v.integer("num_hidden_layers"), "heads": heads, "kv_heads": heads,
        "head_dim": d // heads if heads else 0, "intermediate": v.integer("intermediate_size"),
        "max_positions": (image // patch) ** 2 + 1 if patch else 0,
        "mlp_kind": "plain", "norm_kind": "layernorm",
        "image_size": image, "patch_size": patch, "num_channels": v.integer("num_channels", 3),
    }


def _resnet(v: ConfigView, arch: ParamLayout) -> dict[str, Any]:
    depths = v.integers("depths")
    sizes = v.integers("hidden_sizes")
    return {
        "layers": sum(depths), "hidden": sizes[-1] if sizes else 0, "norm_kind": "batchnorm",
        "mlp_kind": "plain", "num_channels": v.integer("num_channels", 3),
    }


def _unet(v: ConfigView, arch: ParamLayout) -> dict[str, Any]:
    channels = v.integers("block_out_channels")
    return {
        "hidden": channels[-1] if channels else 0,
        "layers": len(channels) * v.integer("layers_per_block", 2),
        "norm_kind": "groupnorm", "mlp_kind": "plain",
        "image_size": v.integer("sample_size", 64) * _VAE_SCALE,
        "num_channels": v.integer("in_channels", 4),
    }


def _generic(v: ConfigView) -> dict[str, Any]:
    """Best-effort sizes of an architecture without a formula (for display; trace-only)."""
    out: dict[str, Any] = {}
    for field_name, keys in (
        ("hidden", ("hidden_size", "n_embd", "d_model")),
        ("layers", ("num_hidden_layers", "n_layer", "num_layers")),
        ("heads", ("num_attention_heads", "n_head")),
        ("intermediate", ("intermediate_size", "n_inner", "ffn_dim")),
        ("vocab", ("vocab_size",)),
        ("max_positions", ("max_position_embeddings", "n_positions")),
    ):
        for key in keys:
            value = v.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                out[field_name] = value
                break
    if "heads" in out:
        kv = v.get("num_key_value_heads", out["heads"])
        out["kv_heads"] = kv if isinstance(kv, int) and not isinstance(kv, bool) else out["heads"]
    return out


def _dit(v: ConfigView, arch: ParamLayout) -> dict[str, Any]:
    """A diffusion transformer: width heads x head size, its blocks as layers. FLUX.1's: double-
    and single-stream blocks, images of 1024 pixels by default (the pipeline's
    ``default_sample_size`` 128 latents). Wan's: one kind of block, its feed-forward ``ffn_dim``
    wide; the video's size is WanPipeline's (:func:`.build.example_inputs`)."""
    heads = v.integer("num_attention_heads")
    wan = v.get("_class_name") == "WanTransformer3DModel"
    out: dict[str, Any] = {
        "hidden": heads * v.integer("attention_head_dim"), "heads": heads, "kv_heads": heads,
        "head_dim": v.integer("attention_head_dim"),
        "layers": v.integer("num_layers") + v.integer("num_single_layers", 0),
        "norm_kind": "layernorm", "mlp_kind": "plain",
        "num_channels": v.integer("in_channels", 16 if wan else 64),
    }
    if wan:
        out["intermediate"] = v.integer("ffn_dim")
    else:
        out["image_size"] = 1024
    return out


_TEXT_KEYS = ("num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size", "num_hidden_layers",
              "intermediate_size", "vocab_size", "max_position_embeddings")


TEXT_CLASS_DEFAULTS: dict[str, dict[str, int]] = {
    # Gemma3TextConfig's sizes (transformers 5.24 models/gemma3/configuration_gemma3.py:73-81):
    # the catalog's Gemma 3 configs name few of them, and resolving a catalog model imports no
    # transformers (tests/test_vlm.py checks this table against the class)
    "gemma3_text": {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "max_position_embeddings": 131_072},
}


def text_defaults(text: Mapping[str, Any]) -> Mapping[str, Any]:
    """``text_config`` with the sizes a Hub config leaves to the class defaults (Gemma 3's lists
    five keys; heads, head size and vocabulary are ``Gemma3TextConfig``'s) filled in from
    :data:`TEXT_CLASS_DEFAULTS`, else from transformers' config class when it is installed; as
    written otherwise."""
    if all(k in text for k in _TEXT_KEYS):
        return text
    known = TEXT_CLASS_DEFAULTS.get(str(text.get("model_type")))
    if known is not None:
        return {**known, **text}
    try:
        from .hf_import import import_transformers

        kwargs = copy.deepcopy({k: w for k, w in text.items() if k != "model_type"})
        t = import_transformers().AutoConfig.for_model(str(text.get("model_type")), **kwargs)
    except Exception:  # noqa: BLE001 (no transformers or an unknown type: the keys as written)
        return text
    return {**{k: getattr(t, k) for k in _TEXT_KEYS if getattr(t, k, None) is not None}, **text}


def _vlm(v: ConfigView, arch: ParamLayout) -> dict[str, Any]:
    """A vision-language model's language model (``text_config``, or the top level of the older
    flat configs): its sizes, for display and the KV cache; the vision tower is traced."""
    text = v.get("text_config")
    t = ConfigView(text_defaults(text), v.origin) if isinstance(text, Mapping) else v
    heads = t.integer("num_attention_heads")
    kv = t.get("num_key_value_heads", heads)
    hidden = t.integer("hidden_size")
    head_dim = t.get("head_dim")
    return {
        "hidden": hidden, "layers": t.integer("num_hidden_layers"), "heads": heads,
        "kv_heads": kv if isinstance(kv, int) and not isinstance(kv, bool) else heads,
        "head_dim": head_dim if isinstance(head_dim, int) and head_dim > 0 else hidden // heads if heads else 0,
        "intermediate": t.integer("intermediate_size"),
        "vocab": t.integer("vocab_size"), "max_positions": t.integer("max_position_embeddings", 0),
        "tie_embeddings": v.flag("tie_word_embeddings", False),
    }


_READERS = {
    "decoder": _decoder, "mla": _decoder, "gpt2": _gpt2, "bert": _bert, "vit": _vit,
    "resnet": _resnet, "unet": _unet, "dit": _dit, "vlm": _vlm,
}
