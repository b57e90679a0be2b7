"""Where models come from: the embedded catalog of configs, local config.json, Hub ids.

Public entry points: :func:`resolve` (name/path/Hub id → :class:`ModelSpec`),
:func:`list_models`, :func:`build_meta_model` (an ``nn.Module`` on ``meta``).
"""

from .spec import Family, ModelSpec

__all__ = ["Family", "ModelSpec"]
