"""Typed reads from a raw config.json, with one-line errors that name the file and the key."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vramplan.errors import ConfigError

_MISSING: Any = object()


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
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 0:
            raise ConfigError(f"{self.origin}: key '{key}' must be a non-negative integer, got {value!r}")
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
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise ConfigError(f"{self.origin}: key '{key}' must be a list of integers, got {value!r}")
        return list(value)

    def texts(self, key: str) -> list[str]:
        value = self.raw.get(key)
        if value is None:
            return []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{self.origin}: key '{key}' must be a list of strings, got {value!r}")
        return list(value)
