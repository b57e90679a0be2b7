"""Read the GPUs of this machine through NVML (``pip install nvidia-ml-py``, module ``pynvml``).

Peak bandwidth from NVML: bus bits ÷ 8 × max memory clock (MHz) × 2, because NVML reports
a memory clock whose double is the per-pin data rate (H100 NVL: 6016/8 × 2619 × 2 =
3.94 TB/s; RTX 4090: 384/8 × 10501 × 2 = 1.008 TB/s).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from vramplan.errors import NoGPUError

from .catalog import match_device_name

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class LocalGPU:
    index: int
    name: str
    catalog_key: str | None
    """The catalog GPU this device was matched to (None if unknown)."""
    total: int
    free: int
    used: int
    reserved: int | None
    """Driver-reserved bytes (memory info v2); None where the driver lacks v2."""
    bus_width_bits: int | None
    max_memory_clock_mhz: int | None
    nvlink_active: int | None
    """Active NVLink links; None where NVLink is not supported."""
    pcie_gen_current: int | None
    pcie_gen_max: int | None
    compute_capability: str | None
    power_limit_w: float | None
    driver_version: str | None

    @property
    def bandwidth(self) -> float | None:
        """Peak memory bandwidth in bytes/s: bits/8 × MHz × 2 × 10^6."""
        if self.bus_width_bits and self.max_memory_clock_mhz:
            return self.bus_width_bits / 8 * self.max_memory_clock_mhz * 2 * 1e6
        return None

    @property
    def bandwidth_formula(self) -> str:
        if self.bandwidth is None:
            return "bus width or memory clock not reported"
        return (f"{self.bus_width_bits} bit ÷ 8 × {self.max_memory_clock_mhz:,} MHz × 2 = "
                f"{self.bandwidth / 1e9:,.0f} GB/s")


def _import_pynvml() -> Any:
    try:
        import pynvml
    except ImportError:
        raise NoGPUError("no NVIDIA GPU found: the NVML bindings are not installed",
                         hint="pip install nvidia-ml-py") from None
    return pynvml


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def local_gpus() -> list[LocalGPU]:
    """Every NVIDIA GPU NVML sees, with memory, bus, clocks, links and its catalog match."""
    nv = _import_pynvml()
    try:
        nv.nvmlInit()
    except nv.NVMLError as e:
        raise NoGPUError(f"no NVIDIA GPU found (NVML: {e})",
                         hint="is the NVIDIA driver installed and a GPU visible?") from None
    try:
        count = nv.nvmlDeviceGetCount()
        if count == 0:
            raise NoGPUError("no NVIDIA GPU found (NVML sees 0 devices)")
        driver = _try(nv, lambda: _text(nv.nvmlSystemGetDriverVersion()))
        return [_read(nv, i, driver) for i in range(count)]
    finally:
        try:
            nv.nvmlShutdown()
        except nv.NVMLError:  # pragma: no cover - shutdown failing is not the user's problem
            pass


def _try(nv: Any, fn: Callable[[], T]) -> T | None:
    """The value, or None when NVML says the query is not supported on this device."""
    try:
        return fn()
    except nv.NVMLError:
        return None


def _read(nv: Any, index: int, driver: str | None) -> LocalGPU:
    h = nv.nvmlDeviceGetHandleByIndex(index)
    name = _text(nv.nvmlDeviceGetName(h))
    mem = _try(nv, lambda: nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2))
    reserved: int | None = None
    if mem is not None:
        reserved = int(mem.reserved)
    else:
        mem = nv.nvmlDeviceGetMemoryInfo(h)
    cc = _try(nv, lambda: nv.nvmlDeviceGetCudaComputeCapability(h))
    power = _try(nv, lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h))
    match = match_device_name(name, int(mem.total))
    return LocalGPU(
        index=index, name=name, catalog_key=match.key if match else None,
        total=int(mem.total), free=int(mem.free), used=int(mem.used), reserved=reserved,
        bus_width_bits=_try(nv, lambda: int(nv.nvmlDeviceGetMemoryBusWidth(h))),
        max_memory_clock_mhz=_try(nv, lambda: int(nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_MEM))),
        nvlink_active=_nvlink_active(nv, h),
        pcie_gen_current=_try(nv, lambda: int(nv.nvmlDeviceGetCurrPcieLinkGeneration(h))),
        pcie_gen_max=_try(nv, lambda: int(nv.nvmlDeviceGetGpuMaxPcieLinkGeneration(h))),
        compute_capability=f"{cc[0]}.{cc[1]}" if cc else None,
        power_limit_w=power / 1000 if power is not None else None,
        driver_version=driver,
    )


def _nvlink_active(nv: Any, h: Any) -> int | None:
    active = 0
    for link in range(nv.NVML_NVLINK_MAX_LINKS):
        try:
            state = nv.nvmlDeviceGetNvLinkState(h, link)
        except nv.NVMLError_NotSupported:
            return None if link == 0 else active
        except nv.NVMLError:  # invalid link index past the device's last link
            break
        if state == nv.NVML_FEATURE_ENABLED:
            active += 1
    return active
