"""Where models come from: the embedded catalog of configs, local config.json, Hub ids.

Public entry points: :func:`resolve` (name/path/Hub id → :class:`ModelSpec`),
:func:`list_models`, :func:`count_params` (pure Python), and — importing torch only when
used — :func:`build_model` (an ``nn.Module`` on ``meta``) and :func:`example_inputs`.
"""

from __future__ import annotations

from typing import Any

from .catalog import list_models, resolve
from .params import count_params
from .spec import Family, ModelSpec

__all__ = ["Family", "ModelSpec", "build_model", "count_params", "example_inputs", "list_models", "resolve"]


def __getattr__(name: str) -> Any:  # lazy: building needs torch, resolving must not
    if name in ("build_model", "example_inputs"):
        from . import build

        return getattr(build, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
