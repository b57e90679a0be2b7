"""Typed reads from a raw config.json, with one-line errors that name the file and the key."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from vramplan.errors import ConfigError

_MISSING: Any = object()

# Sane upper limits for config sizes: generous (10x the largest published models) but small
# enough that a typo or a hostile config (num_hidden_layers: 1e9) fails at once instead of
# making an estimate loop for minutes and grow memory without bound. The first matching
# rule wins (substring of the key); anything else is capped at 2^31 - 1.
_LIMITS: tuple[tuple[tuple[str, ...], int], ...] = (
    (("layers", "n_layer", "layers_per_block", "decoder_sparse_step", "first_k_dense"), 10_000),
    (("experts",), 65_536),
    (("heads", "n_head"), 65_536),
    (("vocab",), 1 << 24),
    (("position", "n_ctx", "sliding_window", "max_seq"), 1 << 28),
    (("intermediate", "n_inner", "ffn"), 1 << 22),
    (("hidden", "n_embd", "d_model", "dim", "rank"), 1 << 20),
    (("image_size", "sample_size", "patch_size"), 1 << 16),
    (("channels",), 1 << 16),
)
_DEFAULT_LIMIT = (1 << 31) - 1
_AT_LEAST_ONE = frozenset({"num_hidden_layers", "n_layer", "hidden_size", "n_embd", "num_attention_heads",
                           "n_head", "num_key_value_heads", "vocab_size"})
"""Sizes a model cannot have zero of (a 0-layer config is a typo, not a model to estimate)."""


def limit_for(key: str) -> int:
    """The largest value :meth:`ConfigView.integer` accepts for ``key``."""
    k = key.lower()
    for parts, limit in _LIMITS:
        if any(p in k for p in parts):
            return limit
    return _DEFAULT_LIMIT


class ConfigView:
    """Read typed values from a config mapping; ``origin`` names the file in error messages."""

    def __init__(self, config: Mapping[str, Any], origin: str = "config") -> None:
        if not isinstance(config, Mapping):
            raise ConfigError(f"{origin}: a config must be a JSON object, got {type(config).__name__}")
        self.raw = config
        self.origin = origin

    def has(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def get(self, key: str, default: Any = None) -> Any:
        value = self.raw.get(key)
        return default if value is None else value

    def integer(self, key: str, default: Any = _MISSING) -> int:
        """A required (or defaulted) non-negative integer; JSON floats like 4096.0 are accepted."""
        value = self.raw.get(key)
        if value is None:
            if default is _MISSING:
                raise ConfigError(
                    f"{self.origin}: missing required key '{key}'",
                    hint="add it to the config.json (see the model's published config)",
                )
            return int(default)
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or (isinstance(value, float) and not math.isfinite(value)) or value != int(value) or value < 0):
            raise ConfigError(f"{self.origin}: key '{key}' must be a non-negative integer, got {value!r}",
                              hint="fix the config.json")
        if value == 0 and key in _AT_LEAST_ONE:
            raise ConfigError(f"{self.origin}: key '{key}' must be at least 1, got {value!r}",
                              hint="fix the config.json")
        limit = limit_for(key)
        if value > limit:
            raise ConfigError(f"{self.origin}: key '{key}' = {int(value):,} is out of range (at most {limit:,})",
                              hint="fix the config.json")
        return int(value)

    def opt_integer(self, key: str) -> int | None:
        return None if self.raw.get(key) is None else self.integer(key)

    def flag(self, key: str, default: bool) -> bool:
        value = self.raw.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ConfigError(f"{self.origin}: key '{key}' must be true or false, got {value!r}")
        return value

    def text(self, key: str, default: str = "") -> str:
        value = self.raw.get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise ConfigError(f"{self.origin}: key '{key}' must be a string, got {value!r}")
        return value

    def integers(self, key: str) -> list[int]:
        value = self.raw.get(key)
        if value is None:
            return []
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= limit_for(key) for v in value
        ):
            raise ConfigError(f"{self.origin}: key '{key}' must be a list of non-negative integers "
                              f"(at most {limit_for(key):,}), got {value!r}")
        return list(value)

    def texts(self, key: str) -> list[str]:
        value = self.raw.get(key)
        if value is None:
            return []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{self.origin}: key '{key}' must be a list of strings, got {value!r}")
        return list(value)
