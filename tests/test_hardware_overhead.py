"""Device overhead: every item sourced, calibration points reproduced, documented scaling."""

from __future__ import annotations

import pytest

from vramplan.errors import VramplanError
from vramplan.hardware.catalog import get_gpu, list_gpus
from vramplan.hardware.overhead import (
    NCCL_LL128_BUFFSIZE,
    NCCL_LL_BUFFSIZE,
    NCCL_SIMPLE_BUFFSIZE,
    cublas_workspace_bytes,
    cublaslt_workspace_bytes,
    device_overhead,
    parse_cublas_workspace_config,
)
from vramplan.units import GiB, KiB, MiB


def _context(items) -> int:
    """Context + kernel images + stack: what `torch.ones(1).cuda()` measures, less 2 MiB."""
    return sum(o.bytes for o in items if o.name.startswith(("CUDA context", "thread stack")))


def _item(items, prefix):
    return next((o for o in items if o.name.startswith(prefix)), None)


def test_every_item_has_a_source_and_bytes():
    for g in [*list_gpus(), None]:
        for kw in ({}, {"lazy_loading": False}, {"torch_version": "1.10"}, {"world_size": 8, "cudnn": True}):
            items = device_overhead(g, **kw)
            assert items
            for o in items:
                assert o.bytes > 0 and isinstance(o.bytes, int)
                assert o.source.strip() and o.name.strip()


def test_reproduces_the_v100_calibration():
    # HF: 1,343 MB nvidia-smi after torch.ones((1,1)).to("cuda") on V100, torch 1.x
    items = device_overhead(get_gpu("v100"), torch_version="1.10")
    assert _context(items) == 1343 * MiB - 2 * MiB


@pytest.mark.parametrize("version, lazy, measured", [
    ("1.10.2", True, 1.78), ("1.13.1", False, 0.90), ("2.1.1", False, 0.92), ("2.1.1", True, 0.47),
])
def test_reproduces_the_a100_measurements(version, lazy, measured):
    items = device_overhead(get_gpu("a100-80gb"), torch_version=version, lazy_loading=lazy)
    assert _context(items) == pytest.approx(measured * GiB - 2 * MiB, abs=1)


def test_lazy_loading_is_smaller_and_ignored_before_1_13():
    for g in list_gpus(vendor="nvidia"):
        lazy = sum(o.bytes for o in device_overhead(g))
        eager = sum(o.bytes for o in device_overhead(g, lazy_loading=False))
        assert lazy < eager, g.key
    old = device_overhead(get_gpu("h100"), torch_version="1.12", lazy_loading=True)
    assert "eager" in old[0].name


def test_stack_scales_with_sms_and_threads():
    h100 = _item(device_overhead(get_gpu("h100")), "thread stack").bytes
    a100 = _item(device_overhead(get_gpu("a100-80gb")), "thread stack").bytes
    assert h100 - a100 == (132 - 108) * 2048 * KiB
    assert _item(device_overhead(get_gpu("t4")), "thread stack").bytes == 40 * 1024 * KiB
    # a card without an SM count gets the measured card's figure, said so
    b300 = _item(device_overhead(get_gpu("b300")), "thread stack")
    assert b300.bytes == a100 and "placeholder" in b300.source


def test_nccl_buffers_follow_the_documented_formula():
    per_peer = NCCL_SIMPLE_BUFFSIZE + NCCL_LL_BUFFSIZE + NCCL_LL128_BUFFSIZE
    assert per_peer == 4 * MiB + 512 * KiB + 4800 * KiB
    h100 = get_gpu("h100")
    assert _item(device_overhead(h100, world_size=1), "NCCL") is None
    two = _item(device_overhead(h100, world_size=2), "NCCL").bytes
    many = _item(device_overhead(h100, world_size=64), "NCCL").bytes
    assert two == many == 16 * 2 * per_peer  # a ring: two peers whatever the world size
    assert _item(device_overhead(h100, world_size=8, nccl_channels=8), "NCCL").bytes == 8 * 2 * per_peer
    pcie = _item(device_overhead(get_gpu("l4"), world_size=8), "NCCL").bytes
    assert pcie == 4 * 2 * per_peer < two


def test_cudnn_is_opt_in():
    g = get_gpu("a100")
    assert _item(device_overhead(g), "cuDNN") is None
    assert _item(device_overhead(g, cudnn=True), "cuDNN") is not None


@pytest.mark.parametrize("kw", [{"torch_version": "two"}, {"world_size": 0}, {"nccl_channels": 0}])
def test_bad_arguments_raise_user_errors(kw):
    with pytest.raises(VramplanError):
        device_overhead(get_gpu("h100"), **kw)


@pytest.mark.parametrize("name, expected", [
    ("v100", 8_519_680), ("t4", 8_519_680), ("a100", 8_519_680), ("rtx-4090", 8_519_680),
    ("h100", 32 * MiB), ("h200", 32 * MiB), ("b200", 32 * MiB), ("rtx-5090", 32 * MiB),
    ("mi300x", 128 * MiB), ("mi250x", 32 * MiB), ("gaudi3", 0),
])
def test_cublas_workspace(name, expected):
    assert cublas_workspace_bytes(get_gpu(name)) == expected


def test_cublas_workspace_config_and_lt():
    assert cublas_workspace_bytes(None) == 4096 * 1024 * 2 + 16 * 1024 * 8 == 8_519_680
    assert parse_cublas_workspace_config(":4096:8") == 32 * MiB
    assert parse_cublas_workspace_config(":4096:2:16:8") == 8_519_680
    assert cublas_workspace_bytes(get_gpu("h100"), config=":16:8") == 128 * KiB
    with pytest.raises(VramplanError):
        parse_cublas_workspace_config("4096")
    assert cublaslt_workspace_bytes(get_gpu("h100")) == 1 * MiB
    assert cublaslt_workspace_bytes(get_gpu("mi300x")) == 76 * MiB
