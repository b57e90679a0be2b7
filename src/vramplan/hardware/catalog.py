"""The embedded GPU catalog: lookup by name or alias, listing, usable capacity.

Data: ``hardware/data/gpus.json`` (every figure with its source; conventions at the top of
that file). Reading it needs neither torch nor a GPU.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from functools import lru_cache
from importlib import resources
from typing import Any

from vramplan.errors import UnknownNameError, VramplanError, did_you_mean
from vramplan.units import MiB

from .gpu import GPU

VENDORS = ("nvidia", "amd", "intel")

HBM_RESERVE = 0.010
"""Driver/firmware reserve on HBM cards, as a fraction of capacity. Fitted to the measured
CUDA totals in the catalog: H100 1.01 %, A100-40 1.04 %, A100-80 0.99 %, H200 0.85 %,
B200 0.91 %, V100-16 1.37 %, V100-32 0.78 %."""

GDDR_RESERVE = 0.015
"""The same for GDDR cards (after the ECC carve-out): T4 1.68 %, A10G 1.97 %, L40S 1.07 %,
RTX 3090 1.25 %, RTX 4090 0.05 % (display and driver dependent)."""

ECC_GDDR_FRACTION = 1 / 16
"""ECC on GDDR6 takes one byte in 16: T4 16,384 MiB → 15,360 MiB, L4/A10G 24,576 → 23,040
(nvidia-smi shows 23,034 / 23,028), L40S 49,152 → 46,080 (46,068)."""

_GPU_FIELDS = set(GPU.__dataclass_fields__)
_SOURCE_FIELDS = {"cuda_total", "smi_total"} | _GPU_FIELDS


@lru_cache(maxsize=1)
def _document() -> Mapping[str, Any]:
    text = resources.files("vramplan.hardware").joinpath("data/gpus.json").read_text(encoding="utf-8")
    doc: Mapping[str, Any] = json.loads(text)
    return doc


def _expand(value: str, raw: Mapping[str, Any], citations: Mapping[str, str]) -> str:
    """Turn a citation key (``epoch``, ``vendor``, ``research`` …) into its full text."""
    template = citations.get(value)
    if template is None:
        return value
    return template.format(epoch_row=raw.get("epoch_row") or "?", spec_url=raw.get("spec_url") or "?")


def _build(raw: Mapping[str, Any], citations: Mapping[str, str]) -> GPU:
    sources = {k: _expand(v, raw, citations) for k, v in raw.get("sources", {}).items()}
    kwargs = {k: v for k, v in raw.items() if k in _GPU_FIELDS and k != "sources"}
    kwargs["aliases"] = tuple(raw.get("aliases", ()))
    return GPU(**kwargs, sources=sources)


@lru_cache(maxsize=1)
def _gpus() -> tuple[GPU, ...]:
    doc = _document()
    citations = doc["citations"]
    return tuple(_build(raw, citations) for raw in doc["gpus"])


def conventions() -> tuple[str, ...]:
    """The catalog's unit and capacity conventions, one sentence each."""
    return tuple(_document()["conventions"])


def _norm(name: str) -> str:
    s = re.sub(r"[\s_/]+", "-", name.strip().lower())
    s = re.sub(r"-+", "-", s).strip("-")
    for prefix in ("nvidia-", "geforce-", "tesla-", "amd-", "intel-", "habana-", "instinct-"):
        if s.startswith(prefix):
            s = s[len(prefix):]
    return s


@lru_cache(maxsize=1)
def _index() -> Mapping[str, GPU]:
    idx: dict[str, GPU] = {}
    for g in _gpus():
        for n in (g.key, *g.aliases, g.name):
            for form in (n.lower(), _norm(n)):
                idx.setdefault(form, g)
    return idx


def get_gpu(name: str) -> GPU:
    """A catalog GPU by key, alias or marketing name (case-insensitive: ``h100``, ``RTX 4090``)."""
    if not isinstance(name, str) or not name.strip():
        raise VramplanError("empty GPU name", hint="see `vramplan gpus` for the list")
    idx = _index()
    g = idx.get(name.strip().lower()) or idx.get(_norm(name))
    if g is None:
        names = [x.key for x in _gpus()] + [a for x in _gpus() for a in x.aliases]
        raise did_you_mean(name, names, kind="GPU", listing="vramplan gpus")
    return g


def list_gpus(min_memory: int | None = None, vendor: str | None = None) -> list[GPU]:
    """Catalog GPUs, optionally with at least ``min_memory`` bytes and of one vendor."""
    if vendor is not None:
        v = vendor.strip().lower()
        if v not in VENDORS:
            raise UnknownNameError(f"unknown vendor '{vendor}'", hint=f"use one of {', '.join(VENDORS)}")
    else:
        v = None
    if min_memory is not None and min_memory < 0:
        raise VramplanError("`min_memory` must not be negative", field="min_memory")
    return [g for g in _gpus()
            if (v is None or g.vendor == v) and (min_memory is None or g.capacity >= min_memory)]


def usable_capacity(gpu: GPU) -> tuple[int, str]:
    """Bytes a CUDA process can get in total (before its own context), and where it comes from.

    This is what CUDA reports as total (``torch.cuda.mem_get_info()[1]``, the "total
    capacity" of PyTorch's OOM message): the capacity minus the driver/firmware reserve and,
    on GDDR cards with ECC on by default, 1/16 for ECC. The CUDA context and library
    overheads come on top (see :mod:`vramplan.hardware.overhead`).
    """
    if gpu.cuda_total:
        src = gpu.sources.get("cuda_total", "measured")
        return gpu.cuda_total, f"measured CUDA total {gpu.cuda_total / MiB:,.0f} MiB ({src})"
    base = gpu.capacity
    steps = []
    if gpu.ecc_gddr:
        base = int(base * (1 - ECC_GDDR_FRACTION))
        steps.append("ECC on GDDR takes 1/16")
    hbm = (gpu.memory_type or "").upper().startswith("HBM")
    frac = HBM_RESERVE if hbm else GDDR_RESERVE
    usable = int(base * (1 - frac))
    steps.append(f"driver reserve {frac:.1%} ({'HBM' if hbm else 'GDDR'} rule fitted to measured cards)")
    if gpu.vendor != "nvidia":
        steps.append("rule from NVIDIA measurements; no measured total for this vendor")
    return usable, "estimated: capacity − " + ", − ".join(steps)


# --- matching a live device name (NVML) to the catalog --------------------------------

_NVML_NAMES: Mapping[str, str] = {
    "nvidia h100 80gb hbm3": "h100-sxm",
    "nvidia h100 pcie": "h100-pcie",
    "nvidia h100 nvl": "h100-nvl",
    "nvidia h200": "h200-sxm",
    "nvidia h200 nvl": "h200-nvl",
    "nvidia gh200 480gb": "gh200",
    "nvidia gh200 144g hbm3e": "gh200",
    "nvidia b200": "b200",
    "nvidia a100-sxm4-40gb": "a100-sxm4-40gb",
    "nvidia a100-sxm4-80gb": "a100-sxm4-80gb",
    "nvidia a100-pcie-40gb": "a100-pcie-40gb",
    "nvidia a100 80gb pcie": "a100-pcie-80gb",
    "a100-sxm4-40gb": "a100-sxm4-40gb",
    "a100-sxm4-80gb": "a100-sxm4-80gb",
    "tesla t4": "t4",
    "tesla v100-sxm2-16gb": "v100-sxm2-16gb",
    "tesla v100-sxm2-32gb": "v100-sxm2-32gb",
    "tesla v100-pcie-16gb": "v100-pcie-16gb",
    "tesla v100-pcie-32gb": "v100-pcie-32gb",
    "nvidia a10g": "a10g",
    "nvidia a10": "a10",
    "nvidia l4": "l4",
    "nvidia l40s": "l40s",
    "nvidia l40": "l40",
    "nvidia rtx a6000": "rtx-a6000",
    "nvidia rtx 6000 ada generation": "rtx-6000-ada",
}


def match_device_name(name: str, total: int | None = None) -> GPU | None:
    """The catalog GPU a driver-reported name (``NVIDIA H100 80GB HBM3``) refers to, or None.

    Exact NVML names first, then the alias index; ``total`` (bytes) breaks ties between
    memory variants, as cloud-reported sizes are imprecise (gpuhunt's idea).
    """
    low = " ".join(name.lower().split())
    if low in _NVML_NAMES:
        return get_gpu(_NVML_NAMES[low])
    idx = _index()
    hit = idx.get(low) or idx.get(_norm(name))
    if hit is not None:
        return hit
    tokens = set(_norm(name).split("-"))
    cands = [g for g in _gpus() if g.vendor == "nvidia" and _model_token(g) in tokens]
    if not cands:
        return None
    for ff in ("pcie", "nvl", "sxm"):
        narrowed = [g for g in cands if ff in g.key]
        if any(ff in t for t in tokens) and narrowed:
            cands = narrowed
    if total is not None:
        return min(cands, key=lambda g: abs(g.capacity - total))
    return cands[0]


def _model_token(g: GPU) -> str:
    parts = g.key.split("-")
    return parts[1] if parts[0] == "rtx" and len(parts) > 1 else parts[0]
