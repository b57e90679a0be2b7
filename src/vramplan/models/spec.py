"""The architecture-neutral description of a model that estimators read.

``ModelSpec`` is produced by :mod:`vramplan.models.catalog` / :mod:`vramplan.models.load`
from a config.json (embedded, local or Hub). Fields that do not apply are 0 / None.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import field
from enum import Enum
from functools import cached_property
from typing import TYPE_CHECKING, Any

from vramplan._dataclass import dataclass

if TYPE_CHECKING:
    from .shape import ModelShape


class Family(str, Enum):
    DENSE = "dense"  # decoder-only dense transformer (Llama, Mistral, Qwen, Gemma, Phi, GPT-2)
    MOE = "moe"  # decoder-only mixture of experts (Mixtral, Qwen-MoE)
    MLA = "mla"  # multi-head latent attention (+ MoE): DeepSeek-V2/V3
    ENCODER = "encoder"  # BERT-style encoder
    VIT = "vit"  # vision transformer
    OTHER = "other"  # anything else (CNN, UNet, user module): trace only

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A model as every method reads it: its config and where it came from."""

    name: str
    """Short alias (``llama-3.1-8b``) or the path / Hub id it was loaded from."""
    hub_id: str | None
    family: Family
    source: str
    """Where the config came from: ``embedded catalog (<hub id> config.json)``, a path, or ``hub``."""
    config: Mapping[str, Any] = field(repr=False)
    """The raw config.json."""
    model_type: str = ""
    hidden: int = 0
    layers: int = 0
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    intermediate: int = 0
    vocab: int = 0
    max_positions: int = 0
    tie_embeddings: bool = False
    mlp_kind: str = "gated"  # gated (SwiGLU/GeGLU, 3 matrices) | plain (2 matrices, GELU)
    norm_kind: str = "rmsnorm"  # rmsnorm | layernorm
    sliding_window: int | None = None
    sliding_layers: int = 0
    """Number of layers that use the sliding window (others attend globally)."""
    # MoE
    n_experts: int = 0
    experts_per_token: int = 0
    shared_experts: int = 0
    moe_intermediate: int = 0
    dense_layers: int = 0
    """Leading layers that use a dense MLP in an MoE model (DeepSeek first_k_dense_replace)."""
    # MLA
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # vision
    image_size: int = 0
    patch_size: int = 0
    num_channels: int = 3
    # counts
    params: int = 0
    """Total parameters (exact, as published)."""
    active_params: int = 0
    """Parameters touched per token (MoE: routed experts only); = params for dense."""
    published_params: int | None = None
    """The figure the model card publishes, when the catalog records it."""
    dtype: str = "bfloat16"
    """The checkpoint's torch_dtype."""

    @property
    def is_decoder(self) -> bool:
        return self.family in (Family.DENSE, Family.MOE, Family.MLA)

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @cached_property
    def shape(self) -> ModelShape:
        """The one model shape (:func:`.shape.model_shape`), built once per spec and read by the
        analytic method, the step-time and FLOPs models and serving."""
        from .shape import model_shape

        return model_shape(self)
