"""Small readers of config.json fields that ModelSpec does not carry (dropout, activation, biases)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Activations that transformers implements as several Python ops, each saving an
# intermediate-sized tensor for backward (gelu_new: x, tanh(·), 0.5·x, 1 + tanh(·)).
_COMPOSITE_ACTS = frozenset({"gelu_new", "gelu_fast", "gelu_python", "gelu_accurate", "gelu_python_tanh"})


def get_float(cfg: Mapping[str, Any], *keys: str, default: float = 0.0) -> float:
    for k in keys:
        v = cfg.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return default


def get_int(cfg: Mapping[str, Any], *keys: str, default: int = 0) -> int:
    for k in keys:
        v = cfg.get(k)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return default


def get_bool(cfg: Mapping[str, Any], *keys: str, default: bool = False) -> bool:
    for k in keys:
        v = cfg.get(k)
        if isinstance(v, bool):
            return v
    return default


def activation(cfg: Mapping[str, Any], default: str = "silu") -> str:
    for k in ("hidden_act", "activation_function", "hidden_activation"):
        v = cfg.get(k)
        if isinstance(v, str):
            return v
    return default


def act_saves(cfg: Mapping[str, Any], default: str = "silu") -> int:
    """Intermediate-sized tensors the activation saves for backward (see ``Ffn.act_saves``)."""
    return 4 if activation(cfg, default) in _COMPOSITE_ACTS else 1
