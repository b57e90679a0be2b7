"""The real-run tracker (``trace.testing``'s storage peak, what real CPU runs are measured with)
computes bf16/fp16 matrix products in fp32 (the CPU's bf16 fallback is slow): the same output
tensors, the same tracked bytes at every point, as the ops themselves give."""

from __future__ import annotations

import pytest
import torch

from vramplan.trace.testing import _StoragePeak


def _products(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    a, b, c, x, y = r(8, 16), r(16, 4), r(4), r(3, 8, 16), r(3, 16, 4)
    w = torch.nn.Parameter(r(4, 16))  # (a module's weight: a Parameter reaches the op)
    out = [a @ b, torch.addmm(c, a, b, beta=0.5, alpha=2.0), torch.nn.functional.linear(a, w, c), x @ y,
           torch.baddbmm(r(3, 8, 4), x, y, beta=0.5), torch.nn.functional.linear(a, w), a.t() @ a]
    return [t.detach() for t in out]


def _tracked(dtype: torch.dtype, native: bool) -> tuple[list[torch.Tensor], int, int]:
    tracker = _StoragePeak()
    tracker.native_half_matmuls = native
    with tracker:
        out = _products(dtype)
    return out, tracker.peak, tracker.current


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_products_under_the_tracker_equal_the_ops_own(dtype: torch.dtype) -> None:
    native, native_peak, native_now = _tracked(dtype, True)
    fast, peak, now = _tracked(dtype, False)
    for p, t in zip(native, fast, strict=True):
        assert (t.dtype, t.shape, t.stride()) == (p.dtype, p.shape, p.stride())
        torch.testing.assert_close(t, p)  # (the CPU's fallback accumulates in fp32 too)
    assert (peak, now) == (native_peak, native_now) > (0, 0)  # no fp32 copy is seen
