"""Cloud instances with GPUs and their on-demand prices (``hardware/data/instances.json``).

Every row names the provider page it comes from and when it was read; prices drift, so
treat them as a starting point and check before buying.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from vramplan.errors import did_you_mean

from .catalog import get_gpu


@dataclass(frozen=True, kw_only=True)
class Instance:
    provider: str
    """aws | gcp | azure | lambda | runpod."""
    name: str
    gpu: str
    """Catalog key of the GPU (``a100-sxm4-40gb``, not the marketing name)."""
    count: int
    """GPUs in the instance."""
    usd_per_hour: float
    region: str
    source: str
    date_read: str
    notes: str = ""

    @property
    def usd_per_gpu_hour(self) -> float:
        return self.usd_per_hour / self.count


@lru_cache(maxsize=1)
def _instances() -> tuple[Instance, ...]:
    text = resources.files("vramplan.hardware").joinpath("data/instances.json").read_text(encoding="utf-8")
    return tuple(Instance(**row) for row in json.loads(text)["instances"])


def providers() -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for i in _instances():
        seen.setdefault(i.provider)
    return tuple(seen)


def list_instances(provider: str | None = None, gpu: str | None = None) -> list[Instance]:
    """Instances, optionally of one provider and one GPU (any catalog name or alias)."""
    rows = list(_instances())
    if provider is not None:
        p = provider.strip().lower()
        if p not in providers():
            raise did_you_mean(provider, providers(), kind="cloud provider")
        rows = [i for i in rows if i.provider == p]
    if gpu is not None:
        key = get_gpu(gpu).key
        rows = [i for i in rows if i.gpu == key]
    return rows


def cheapest(gpu: str) -> Instance | None:
    """The instance with the lowest price per GPU-hour for a GPU, or None if none is listed."""
    rows = list_instances(gpu=gpu)
    return min(rows, key=lambda i: i.usd_per_gpu_hour) if rows else None
