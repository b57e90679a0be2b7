"""The one JSON helper: any result value → plain JSON types (the only copy in the package)."""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any


def jsonable(x: Any) -> Any:
    """Enums → their values, mappings → dicts with string keys, sequences → lists, numpy
    scalars → Python numbers; anything else not JSON-native → its ``str``."""
    if isinstance(x, Enum):
        return x.value
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, Mapping):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    item = getattr(x, "item", None)
    if callable(item):
        return jsonable(item())
    return str(x)


__all__ = ["jsonable"]
