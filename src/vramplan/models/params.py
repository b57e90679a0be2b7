"""Exact parameter counts from a config.json, in pure Python (no torch import).

``count_params(config)`` returns ``(total, active)``: total equals
``sum(p.numel() for p in model.parameters())`` of the transformers model built from the same
config (tied weights counted once; buffers such as DeepSeek-V3's ``e_score_correction_bias``
are not parameters); active counts, per token, only the ``num_experts_per_tok`` routed
experts of each MoE layer (shared experts, routers, attention and embeddings included).
Dense models have ``active == total``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vramplan.errors import ConfigError

from ._params_classic import count_bert, count_gpt2, count_vit
from ._params_decoder import count_decoder
from ._params_vlm import count_qwen2_5_vl
from .arch import check_head, default_head, require_arch
from .config_view import ConfigView

VLM_COUNTED = ("qwen2_5_vl",)
"""Vision-language models with a closed-form count (:mod:`._params_vlm`); the others are traced."""

_COUNTERS = {
    "decoder": count_decoder,
    "mla": count_decoder,
    "gpt2": count_gpt2,
    "bert": count_bert,
    "vit": count_vit,
}


def count_params(
    config: Mapping[str, Any], *, head: str | None = None, origin: str = "config"
) -> tuple[int, int]:
    """(total, active) parameters of the model ``config`` describes, with ``head`` on top.

    ``head`` defaults to the one the config's ``architectures`` names (``LlamaForCausalLM`` →
    causal-lm, ``BertForMaskedLM`` → masked-lm, ``ViTForImageClassification`` →
    image-classification); ``"base"`` is the bare backbone (BERT/ViT with their pooler).
    """
    view = ConfigView(config, origin)
    arch = require_arch(config, origin)
    if arch.kind == "vlm" and config.get("model_type") in VLM_COUNTED:
        if head is not None:
            check_head(head, arch, origin)
        total = count_qwen2_5_vl(config, origin)
        return total, total
    counter = _COUNTERS.get(arch.kind)
    if counter is None:
        raise ConfigError(
            f"{origin}: no closed-form parameter count for {arch.kind} models",
            hint="build it with vramplan.models.build.build_model and count, or use the trace method",
        )
    chosen = check_head(head, arch, origin) if head is not None else default_head(config, arch)
    return counter(view, arch, chosen)
