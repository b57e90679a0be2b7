"""Exact parameter counts of Qwen2.5-VL, as transformers builds it (no torch import).

transformers 5.24.0 ``models/qwen2_5_vl/modeling_qwen2_5_vl.py``: the vision tower
(``Qwen2_5_VisionTransformerPretrainedModel``, ``:386-412``) is a patch embedding
(``Qwen2_5_VisionPatchEmbed``, ``:114``: a bias-free ``Conv3d`` over ``channels × temporal × patch²``),
``depth`` blocks (``Qwen2_5_VLVisionBlock``, ``:345-348``: two RMSNorm weights, ``qkv`` ``d → 3d`` and
``proj`` ``d → d`` with biases (``:266-267``), a SwiGLU MLP with biases (``Qwen2_5_VLMLP(bias=True)``,
``:88-92``)) and the patch merger (``Qwen2_5_VLPatchMerger``, ``:187-194``: an RMSNorm of ``d``, then
``Linear(merge² d, merge² d)``, GELU, ``Linear(merge² d, out_hidden_size)``, both with biases). The
window/full attention choice (``fullatt_block_indexes``) adds no parameters; the rotary tables are
buffers. The language model is a Qwen2 decoder (its keys at the top level of the Hub config).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError

QWEN_VL_TEXT = {"qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2"}
"""The language model of a Qwen-VL config (its text keys sit at the top level in the Hub
configs): a Qwen2 decoder."""

VISION_DEFAULTS: dict[str, Any] = {
    "depth": 32, "hidden_size": 3584, "intermediate_size": 3420, "num_heads": 16, "in_channels": 3,
    "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
    "out_hidden_size": 3584, "fullatt_block_indexes": (7, 15, 23, 31),
}
"""``Qwen2_5_VLVisionConfig``'s defaults (configuration_qwen2_5_vl.py:53-65, transformers 5.24.0),
for keys a config leaves out."""


def vision_value(vision: Mapping[str, Any], key: str) -> Any:
    if key == "in_channels":
        return vision.get("in_channels", vision.get("in_chans", VISION_DEFAULTS[key]))
    return vision.get(key, VISION_DEFAULTS[key])


def qwen_text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's config of a Qwen-VL config: the top-level keys (and a
    ``text_config``'s, where newer configs repeat them) as a plain Qwen2 config; multimodal RoPE
    has plain RoPE's table sizes."""
    text = config.get("text_config")
    out: dict[str, Any] = {k: v for k, v in config.items() if k not in ("vision_config", "text_config")}
    if isinstance(text, Mapping):
        out.update(text)
    out["model_type"] = QWEN_VL_TEXT[str(config.get("model_type"))]
    for key in ("rope_scaling", "rope_parameters"):
        rope = out.get(key)
        if isinstance(rope, Mapping) and "mrope" in (rope.get("type"), rope.get("rope_type")):
            out.pop(key)
    return out


def count_vision_qwen2_5(vision: Mapping[str, Any], origin: str) -> int:
    """Parameters of Qwen2.5-VL's vision tower (with its merger)."""
    try:
        d, i = int(vision_value(vision, "hidden_size")), int(vision_value(vision, "intermediate_size"))
        depth, out = int(vision_value(vision, "depth")), int(vision_value(vision, "out_hidden_size"))
        c, t = int(vision_value(vision, "in_channels")), int(vision_value(vision, "temporal_patch_size"))
        p, m = int(vision_value(vision, "patch_size")), int(vision_value(vision, "spatial_merge_size"))
    except (TypeError, ValueError):
        raise ConfigError(f"{origin}: vision_config sizes must be integers", hint="check the config.json") from None
    block = 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + 2 * (d * i + i) + (i * d + d)
    wide = m * m * d
    merger = d + (wide * wide + wide) + (wide * out + out)
    return c * t * p * p * d + depth * block + merger


def count_qwen2_5_vl(config: Mapping[str, Any], origin: str) -> int:
    """Vision tower + language model of a Qwen2.5-VL config (tied embeddings counted once)."""
    from .params import count_params

    vision = config.get("vision_config")
    if not isinstance(vision, Mapping):
        raise ConfigError(f"{origin}: a Qwen2.5-VL config needs a vision_config", hint="check the config.json")
    text = qwen_text_config(config)
    text["architectures"] = ["Qwen2ForCausalLM"]
    total, _ = count_params(text, origin=origin)
    return total + count_vision_qwen2_5(vision, origin)
