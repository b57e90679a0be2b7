"""MXFP8 training: torchao 0.18's ``MXFP8Linear`` (torchtitan 0.3.0's ``quantize.linear.mx``), traced.

torchtitan's ``MXFP8LinearConverter`` (torchtitan/components/quantization/mx.py:50-98) swaps
every ``Linear`` of the model (its ``fqns`` default is empty: the output head too) for a
``MXFP8Linear`` built with ``(in_features, out_features, bias)`` only (mx.py:38-44), i.e.
torchao's defaults: ``kernel_preference=AUTO``, ``scale_calculation_mode=RCEIL``,
``wgrad_with_hp=False`` (torchao/prototype/moe_training/mxfp8_linear.py:277-294). Its forward is
``mx_mm`` (mxfp8_linear.py:84-269) with the dim-0 cast on torchao's Triton kernel and the dim-1
cast on its CUDA kernel (mxfp8_linear.py:65-66); ``mx_mm`` saves the high-precision input and
weight for backward (mxfp8_linear.py:108) and casts again in backward.

:func:`convert` makes that swap with torchao's own class, so the trace runs torchao's code:
``MXTensor.to_mx``, the ``MXTensor`` dispatch of ``aten.mm``, ``to_blocked`` (the cuBLAS
block-scale layout) and ``torch._scaled_mm`` with e8m0 scales, whose meta kernel checks the
blocked scales' sizes. Two kernels have no implementation off an sm100 GPU: torchao defines
``triton_to_mxfp8_dim0`` and the ``torchao::mxfp8_quantize`` op (with its fake) only when CUDA
sm100+ is present at import (kernels.py:458-463, :1012-1018); elsewhere they are stubs that
raise. :func:`kernel_stand_ins` puts, for the traced step only, stand-ins in their place that
allocate what the kernels allocate (shapes, dtypes, strides, order) and nothing else, and check
what they assert; no op is registered, nothing outlives the step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..errors import TraceError

BLOCK = 32
"""MX scaling block (mxfp8_linear.py:64)."""


def convert(model: nn.Module, *, emulated: bool = False) -> int:
    """Swap every ``nn.Linear`` of ``model`` for torchao's ``MXFP8Linear`` (torchtitan's
    converter: no filter), keeping the weight and bias parameters (ties survive). ``emulated``:
    torchao's ``KernelPreference.EMULATED`` (pure torch casts, dequantise-then-mm: what runs on a
    CPU), not torchtitan's. Returns the number of layers swapped."""
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    pref = KernelPreference.EMULATED if emulated else KernelPreference.AUTO
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear]
    for parent, name, lin in swaps:
        with torch.device("meta"):
            new = MXFP8Linear(lin.in_features, lin.out_features, bias=lin.bias is not None,
                              kernel_preference=pref, dtype=lin.weight.dtype)
        new.weight = lin.weight
        if lin.bias is not None:
            new.bias = lin.bias
        new.train(lin.training)
        setattr(parent, name, new)
    return len(swaps)


def bad_dims(model: nn.Module) -> list[tuple[str, int, int]]:
    """Linears with a dimension that is not a multiple of 32: torchao's casts assert it (the
    Triton dim-0 cast on the columns, kernels.py:882; the CUDA dim-1 cast on both,
    mxfp8_extension.cpp ``rows % 32``/``cols % 32``), and torchtitan filters nothing."""
    return [(n, m.in_features, m.out_features) for n, m in model.named_modules()
            if type(m) is nn.Linear and (m.in_features % BLOCK or m.out_features % BLOCK)]


def _triton_to_mxfp8_dim0(x: torch.Tensor, inner_block_size: int = BLOCK,
                          scaling_mode: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """torchao 0.18 ``triton_to_mxfp8_dim0`` (kernels.py:843-914): its asserts, its two
    ``torch.empty`` (fp8 ``[rows, cols]``, uint8 ``[rows, cols/32]``), the views it returns."""
    assert x.is_contiguous(), "`x` must be contiguous"
    assert x.dtype == torch.bfloat16, f"only bfloat16 inputs are supported, got {x.dtype}"
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    rows, cols = x.shape
    assert cols % inner_block_size == 0, "columns must be divisible by inner block size"
    output = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, cols // inner_block_size), dtype=torch.uint8, device=x.device)
    return output.reshape(shape), scale.reshape(*shape[:-1], scale.shape[-1]).view(torch.float8_e8m0fnu)


def _mxfp8_quantize_cuda(x: torch.Tensor, rowwise: bool = False, colwise: bool = True,
                         scaling_mode: str = "rceil") -> tuple[torch.Tensor, ...]:
    """torchao's ``torchao::mxfp8_quantize`` as ``MXFP8Dim1CastKernelChoice.CUDA`` calls it
    (``rowwise=False, colwise=True``; utils.py:181-192): its outputs as the C++ op allocates them
    (torchao/csrc/cuda/mx_kernels/mxfp8_extension.cpp ``mxfp8_quantize``; the same as the fake at
    kernels.py:1071-1113): two empty rowwise tensors, the fp8 data ``[rows, cols]`` column-major,
    the e8m0 scales ``[cols, rows/32]`` with stride ``(1, cols)``."""
    assert x.ndim == 2
    rows, cols = x.shape
    if rows % BLOCK or cols % BLOCK:  # (the C++ op's TORCH_CHECKs; a real run stops here)
        raise TraceError(f"MXFP8 training: torchao's CUDA dim-1 cast asserts rows and columns that are multiples of "
                         f"32, and this step casts a [{rows}, {cols}] tensor (tokens x features, or a weight)",
                         hint="make the tokens per micro-batch (batch x seq) a multiple of 32")
    assert not rowwise and colwise, "rowwise scaling is not supported yet"
    assert x.is_contiguous(), "input must be contiguous"
    out_row = torch.empty((0,), dtype=torch.float8_e4m3fn, device=x.device)
    scale_row = torch.empty((0,), dtype=torch.float8_e8m0fnu, device=x.device)
    out_col = torch.empty_strided((rows, cols), (1, rows), dtype=torch.float8_e4m3fn, device=x.device)
    scale_col = torch.empty_strided((cols, rows // BLOCK), (1, cols), dtype=torch.float8_e8m0fnu, device=x.device)
    return out_row, out_col, scale_row, scale_col


@contextlib.contextmanager
def kernel_stand_ins() -> Iterator[None]:
    """For the traced step: torchao's two sm100 casts replaced where torchao looks them up
    (``mx_tensor`` imports ``triton_to_mxfp8_dim0`` at load, mx_tensor.py:73; ``utils`` imports
    ``mxfp8_quantize_cuda`` from ``kernels`` at each call, utils.py:185-187), restored after."""
    from torchao.prototype.mx_formats import kernels, mx_tensor

    saved: list[tuple[Any, str, Any]] = [(mx_tensor, "triton_to_mxfp8_dim0", mx_tensor.triton_to_mxfp8_dim0),
                                         (kernels, "mxfp8_quantize_cuda", kernels.mxfp8_quantize_cuda)]
    mx_tensor.triton_to_mxfp8_dim0 = _triton_to_mxfp8_dim0
    kernels.mxfp8_quantize_cuda = _mxfp8_quantize_cuda
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
