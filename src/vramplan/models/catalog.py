"""Where models come from: the embedded catalog, a local config.json, or a Hub id.

``resolve(name)`` accepts, in this order: a catalog alias (``llama-3.1-8b``) or a catalog Hub id
(``meta-llama/Llama-3.1-8B``), case-insensitive; a local ``config.json`` path or a folder
holding one; any other Hub id (its config.json fetched through ``huggingface_hub`` when
online). Nothing here imports torch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from functools import cache, lru_cache
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from vramplan._dataclass import dataclass
from vramplan.errors import ConfigError, did_you_mean

from .hub import fetch_config, looks_like_hub_id
from .normalize import spec_from_config
from .spec import Family, ModelSpec

if TYPE_CHECKING:
    from pathlib import Path

_INDEX = "index.json"


@dataclass(frozen=True)
class CatalogEntry:
    """One model of the embedded catalog: its Hub id, family and published size."""

    alias: str
    hub_id: str
    family: Family
    published_params: int
    published_text: str
    published_kind: str
    """exact | rounded (a figure with its stated precision) | nominal (the size in the name)."""
    published_source: str
    published_active: int | None = None
    subfolder: str | None = None
    params: int | None = None
    """Exact count recorded for trace-only models (no closed-form formula)."""
    aliases: tuple[str, ...] = ()


def _configs_dir() -> str:
    # package data (pyproject: models/configs/*.json); os.path, not pathlib: pathlib imports
    # urllib.parse and ipaddress (~4 ms of the analytic command's start-up)
    return os.path.join(os.path.dirname(__file__), "configs")


def _read(file: str) -> str:
    with open(file, encoding="utf-8") as f:
        return f.read()


@lru_cache(maxsize=1)
def catalog_entries() -> dict[str, CatalogEntry]:
    """alias → entry, in catalog order."""
    raw = json.loads(_read(os.path.join(_configs_dir(), _INDEX)))
    out: dict[str, CatalogEntry] = {}
    for alias, e in raw["models"].items():
        out[alias] = CatalogEntry(
            alias=alias, hub_id=e["hub_id"], family=Family(e["family"]),
            published_params=int(e["published_params"]), published_text=e["published_text"],
            published_kind=e["published_kind"], published_source=e["published_source"],
            published_active=e.get("published_active"), subfolder=e.get("subfolder"),
            params=e.get("params"), aliases=tuple(e.get("aliases", ())),
        )
    return out


@lru_cache(maxsize=1)
def _lookup() -> dict[str, str]:
    """Every accepted spelling (lower-case) → alias."""
    table: dict[str, str] = {}
    for alias, e in catalog_entries().items():
        for key in (alias, e.hub_id, *e.aliases):
            table[key.lower()] = alias
    return table


def catalog_alias(name: str) -> str | None:
    """The catalog alias ``name`` refers to (alias, Hub id or extra spelling), or None."""
    return _lookup().get(name.strip().lower())


def list_models(family: Family | str | None = None) -> list[ModelSpec]:
    """Every catalog model, in catalog order (optionally one family)."""
    want = Family(str(family).lower()) if family is not None else None
    specs = [_catalog_spec(alias) for alias in catalog_entries()]
    return [s for s in specs if want is None or s.family is want]


def resolve(name: str) -> ModelSpec:
    """A ModelSpec for a catalog alias / Hub id, a local config.json (or its folder), or a Hub id."""
    if not isinstance(name, str) or not name.strip():
        raise ConfigError("empty model name", hint="pass an alias such as llama-3.1-8b (see `vramplan models`)")
    name = name.strip()
    alias = catalog_alias(name)
    if alias is not None:
        return _catalog_spec(alias)
    from pathlib import Path

    path = Path(os.path.expanduser(name))
    if path.exists() or name.endswith(".json"):
        return _local_spec(path)
    if looks_like_hub_id(name):
        return _hub_spec(name)
    raise did_you_mean(name, catalog_entries().keys(), kind="model", listing="vramplan models")


def spec_from_text(text: str, name: str = "config.json") -> ModelSpec:
    """A ModelSpec from the text of a config.json (e.g. uploaded to the web page): parsed as
    JSON data only, never executed (``auto_map`` code is not loaded; see ``build``)."""
    return spec_from_config(_parse(text, name), name=name, source=f"{name} (uploaded)", origin=name)


@cache
def _catalog_spec(alias: str) -> ModelSpec:
    e = catalog_entries()[alias]
    config = _parse(_read(os.path.join(_configs_dir(), f"{alias}.json")), f"embedded {alias}.json")
    where = f"{e.hub_id}/{e.subfolder}" if e.subfolder else e.hub_id
    return spec_from_config(
        config, name=alias, hub_id=e.hub_id, source=f"embedded catalog ({where} config.json)",
        origin=f"embedded {alias}.json", published_params=e.published_params, params=e.params,
    )


def _local_spec(path: Path) -> ModelSpec:
    if path.is_dir():
        file = path / "config.json"
        if not file.is_file():
            raise ConfigError(f"{path}: no config.json in this folder", hint="pass the config.json file itself")
    else:
        file = path
        if not file.exists():
            raise ConfigError(f"{file}: no such file", hint="check the path, or use a catalog alias")
        if not file.is_file():
            raise ConfigError(f"{file}: not a regular file (a device, pipe or socket)",
                              hint="pass the path of a config.json file, or a catalog alias")
    stat = file.stat()
    return _local_spec_cached(str(file.resolve()), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=64)
def _local_spec_cached(file: str, mtime_ns: int, size: int) -> ModelSpec:
    try:
        text = _read(file)
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file}: cannot read ({e.__class__.__name__})") from None
    config = _parse(text, file)
    return spec_from_config(config, name=file, source=file, origin=file)


@lru_cache(maxsize=64)
def _hub_spec(hub_id: str) -> ModelSpec:
    config, _ = fetch_config(hub_id)
    return spec_from_config(config, name=hub_id, hub_id=hub_id, source=f"hub ({hub_id} config.json)",
                            origin=f"{hub_id} config.json")


def _parse(text: str, origin: str) -> Mapping[str, Any]:
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{origin}: malformed JSON at line {e.lineno} column {e.colno} ({e.msg})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{origin}: a config.json must hold a JSON object, not {type(config).__name__}")
    if not (config.get("model_type") or config.get("_class_name")):
        raise ConfigError(f"{origin}: missing required key 'model_type'",
                          hint="a transformers config.json names its model_type")
    return MappingProxyType(config)  # specs are cached and shared: keep their config read-only
