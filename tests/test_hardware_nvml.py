"""Live GPU reading through NVML, exercised with a fake ``pynvml`` module (no GPU here)."""

from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass, field

import pytest

from vramplan.cli.main import main
from vramplan.errors import NoGPUError
from vramplan.hardware.nvml import local_gpus
from vramplan.units import MiB


@dataclass
class FakeDevice:
    name: str
    total: int
    used: int
    bus: int
    mem_mhz: int
    nvlinks: int | None  # None: NVLink not supported
    pcie: tuple[int, int]
    cc: tuple[int, int]
    power_mw: int
    mem_v2: bool = True
    extra: dict = field(default_factory=dict)



@pytest.fixture(autouse=True)
def _wide(monkeypatch):
    """Rich sizes tables to the terminal; keep keys unabbreviated in captured output."""
    monkeypatch.setenv("COLUMNS", "200")


def fake_pynvml(devices: list[FakeDevice], *, init_error: bool = False) -> types.ModuleType:
    m = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):  # noqa: N801 - pynvml's name
        pass

    class NVMLError_InvalidArgument(NVMLError):  # noqa: N801
        pass

    m.NVMLError = NVMLError
    m.NVMLError_NotSupported = NVMLError_NotSupported
    m.nvmlMemory_v2 = 0x02000028
    m.NVML_CLOCK_MEM = 2
    m.NVML_FEATURE_ENABLED = 1
    m.NVML_NVLINK_MAX_LINKS = 18
    m.calls = []

    def init():
        if init_error:
            raise NVMLError("NVML Shared Library Not Found")
        m.calls.append("init")

    def shutdown():
        m.calls.append("shutdown")

    def mem(h, version=None):
        d = devices[h]
        if version is not None and not d.mem_v2:
            raise NVMLError("Function Not Found")
        ns = types.SimpleNamespace(total=d.total, used=d.used, free=d.total - d.used)
        if version is not None:
            ns.reserved = 512 * MiB
        return ns

    def nvlink_state(h, link):
        d = devices[h]
        if d.nvlinks is None:
            raise NVMLError_NotSupported("Not Supported")
        if link >= d.nvlinks:
            raise NVMLError_InvalidArgument("Invalid Argument")
        return 1

    m.nvmlInit = init
    m.nvmlShutdown = shutdown
    m.nvmlDeviceGetCount = lambda: len(devices)
    m.nvmlSystemGetDriverVersion = lambda: b"550.54.15"
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetName = lambda h: devices[h].name.encode()
    m.nvmlDeviceGetMemoryInfo = mem
    m.nvmlDeviceGetMemoryBusWidth = lambda h: devices[h].bus
    m.nvmlDeviceGetMaxClockInfo = lambda h, t: devices[h].mem_mhz if t == 2 else 0
    m.nvmlDeviceGetNvLinkState = nvlink_state
    m.nvmlDeviceGetCurrPcieLinkGeneration = lambda h: devices[h].pcie[0]
    m.nvmlDeviceGetGpuMaxPcieLinkGeneration = lambda h: devices[h].pcie[1]
    m.nvmlDeviceGetCudaComputeCapability = lambda h: devices[h].cc
    m.nvmlDeviceGetEnforcedPowerLimit = lambda h: devices[h].power_mw
    return m


H100 = FakeDevice("NVIDIA H100 80GB HBM3", 81559 * MiB, 4 * MiB, 5120, 2619, 18, (5, 5), (9, 0), 700_000)
RTX = FakeDevice("NVIDIA GeForce RTX 4090", 24564 * MiB, 300 * MiB, 384, 10501, None, (4, 4), (8, 9), 450_000,
                 mem_v2=False)


def test_reads_devices_and_matches_the_catalog(monkeypatch):
    fake = fake_pynvml([H100, RTX])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    h, r = local_gpus()
    assert h.catalog_key == "h100-sxm" and r.catalog_key == "rtx-4090"
    assert h.total == 81559 * MiB and h.free == h.total - 4 * MiB and h.reserved == 512 * MiB
    assert h.bandwidth == pytest.approx(5120 / 8 * 2619 * 2 * 1e6)  # 3.35 TB/s
    assert r.bandwidth == pytest.approx(384 / 8 * 10501 * 2 * 1e6)  # 1.008 TB/s
    assert "384 bit ÷ 8 × 10,501 MHz × 2 = 1,008 GB/s" == r.bandwidth_formula
    assert h.nvlink_active == 18 and r.nvlink_active is None
    assert (h.pcie_gen_current, h.pcie_gen_max) == (5, 5)
    assert h.compute_capability == "9.0" and h.power_limit_w == 700
    assert r.reserved is None  # memory info v2 missing: v1 used
    assert h.driver_version == "550.54.15"
    assert fake.calls == ["init", "shutdown"]


def test_no_driver_is_no_gpu_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([], init_error=True))
    with pytest.raises(NoGPUError, match="no NVIDIA GPU found"):
        local_gpus()


def test_zero_devices_is_no_gpu_error(monkeypatch):
    fake = fake_pynvml([])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with pytest.raises(NoGPUError, match="no NVIDIA GPU found"):
        local_gpus()
    assert fake.calls == ["init", "shutdown"]


def test_missing_bindings_is_no_gpu_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    with pytest.raises(NoGPUError, match="nvidia-ml-py"):
        local_gpus()


def test_cli_local_with_fake(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([H100]))
    assert main(["gpus", "--local", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["local_gpus"]
    assert data[0]["catalog_key"] == "h100-sxm" and data[0]["total"] == 81559 * MiB
    assert main(["gpus", "--local"]) == 0
    assert "h100-sxm" in capsys.readouterr().out


def test_cli_local_without_gpu_exits_2(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([], init_error=True))
    assert main(["gpus", "--local"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no NVIDIA GPU found") and "\n" not in err
