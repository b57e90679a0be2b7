"""Fetch a ``config.json`` from the Hugging Face Hub — the only network access in vramplan.

Only ``config.json`` is downloaded (never weights), through ``huggingface_hub``'s cache. With
``HF_HUB_OFFLINE=1`` only the local cache is consulted.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from vramplan.errors import ConfigError, UnknownNameError

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_TRUE = {"1", "true", "yes", "on"}


def looks_like_hub_id(name: str) -> bool:
    """``owner/name`` with Hub-legal characters (not a path that exists: checked by the caller)."""
    return bool(_HUB_ID.match(name)) and not name.endswith(".json")


def offline() -> bool:
    return any(os.environ.get(k, "").strip().lower() in _TRUE for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _reachable(timeout: float = 3.0) -> bool:
    """Can we open a TCP connection to the Hub? (Skips huggingface_hub's ~25 s of retries.)"""
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # only the proxy knows; let huggingface_hub try
    import socket  # here, not at module level: every command imports this module, few fetch
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host = url.hostname or "huggingface.co"
    port = url.port or (443 if url.scheme != "http" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _offline_error(hub_id: str) -> ConfigError:
    return ConfigError(f"cannot fetch config for {hub_id} offline; pass a local config.json path")


def fetch_config(hub_id: str, *, subfolder: str | None = None) -> tuple[dict[str, Any], str]:
    """Download (or read from the HF cache) ``hub_id``'s config.json; returns (config, local path)."""
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import (
            EntryNotFoundError,
            GatedRepoError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:  # pragma: no cover - huggingface_hub is a dependency of the models extra
        raise ConfigError(
            f"cannot fetch config for {hub_id}: huggingface_hub is not installed",
            hint="pip install 'vramplan[models]', or pass a local config.json path",
        ) from None
    import logging

    local_only = offline() or not _reachable()
    hub_logger = logging.getLogger("huggingface_hub")
    level = hub_logger.level
    hub_logger.setLevel(logging.ERROR)  # the core never prints; failures become one-line errors
    try:
        path = hf_hub_download(hub_id, "config.json", subfolder=subfolder, local_files_only=local_only)
    except LocalEntryNotFoundError:  # offline and not in the HF cache (subclass of EntryNotFound)
        raise _offline_error(hub_id) from None
    except GatedRepoError:
        raise ConfigError(
            f"{hub_id} is gated on the Hub",
            hint="accept its licence and run `hf auth login`, or pass a local config.json path",
        ) from None
    except RepositoryNotFoundError:
        raise UnknownNameError(
            f"no model '{hub_id}' on the Hub (or it is private)",
            hint="check the id, or see `vramplan models` for the embedded catalog",
        ) from None
    except (EntryNotFoundError, RevisionNotFoundError):
        raise ConfigError(f"{hub_id} has no config.json on the Hub", hint="pass a local config.json path") from None
    except OSError:  # connection errors surface as OSError subclasses
        raise _offline_error(hub_id) from None
    finally:
        hub_logger.setLevel(level)
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{hub_id}: the downloaded config.json is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{hub_id}: config.json must be a JSON object")
    return config, str(path)
