"""Where a measurement ran: GPU, driver, CUDA and library versions; NVML memory reads.

Everything here degrades to ``None`` fields rather than failing: a measurement without the
driver version is still a measurement.
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Any


@dataclass(frozen=True)
class Environment:
    gpu_name: str | None
    gpu_memory: int | None
    """Total device memory in bytes (NVML, else torch)."""
    compute_capability: str | None
    driver: str | None
    cuda: str | None
    """The CUDA version torch was built with."""
    torch: str | None
    transformers: str | None
    peft: str | None
    bitsandbytes: str | None
    vramplan: str | None
    python: str
    platform: str
    alloc_conf: str | None = None
    """``PYTORCH_CUDA_ALLOC_CONF`` in effect."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _nvml() -> Any | None:
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # no library, no driver, no device: NVML is optional
        return None


def nvml_used(index: int = 0) -> int | None:
    """Device memory in use on GPU ``index`` per NVML (all processes, as nvidia-smi shows it)."""
    nv = _nvml()
    if nv is None:
        return None
    try:
        return int(nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(index)).used)
    except Exception:
        return None


def _driver() -> str | None:
    nv = _nvml()
    if nv is None:
        return None
    try:
        v = nv.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:
        return None


def _nvml_total(index: int) -> int | None:
    nv = _nvml()
    if nv is None:
        return None
    try:
        return int(nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(index)).total)
    except Exception:
        return None


def environment(index: int = 0, alloc_conf: str | None = None) -> Environment:
    """Describe this machine (device ``index`` when a CUDA GPU is present)."""
    torch_v = package_version("torch")
    name = cc = cuda = None
    total = _nvml_total(index)
    try:
        import torch

        torch_v = torch.__version__
        cuda = torch.version.cuda
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(index)
            name = props.name
            cc = f"{props.major}.{props.minor}"
            total = total or int(props.total_memory)
    except ImportError:
        pass
    return Environment(
        gpu_name=name, gpu_memory=total, compute_capability=cc, driver=_driver(), cuda=cuda,
        torch=torch_v, transformers=package_version("transformers"), peft=package_version("peft"),
        bitsandbytes=package_version("bitsandbytes"), vramplan=package_version("vramplan"),
        python=platform.python_version(), platform=platform.platform(terse=True), alloc_conf=alloc_conf,
    )
