"""Quantised linear layers, storage-faithful (bitsandbytes does not run on the emulated GPU).

:class:`QuantLinear` keeps what the real layer keeps on the GPU and allocates what its
forward/backward allocate:

- ``nf4`` / ``int4`` (bnb ``Linear4bit``): packed ``uint8[out·in/2, 1]``, fp32 ``absmax`` per
  64-element block and a 16-entry fp32 code; with double quantisation (QLoRA) ``absmax`` is
  ``uint8`` plus fp32 second-level absmax per 256 blocks, a 256-entry code and an offset.
  ``Linear4bit.forward`` casts the input to the compute dtype. As bitsandbytes 0.50.2 runs it
  (the version in requirements/quant.txt; files and lines below are of it): the forward calls
  ``torch.ops.bitsandbytes.gemm_4bit`` (``autograd/_functions.py`` L324-345 under autograd,
  L462-491 without), whose CUDA kernel (``backends/cuda/ops.py`` L904-945) runs a fused 4-bit
  GEMM for up to 4 rows (``_GEMM_4BIT_CUSTOM_FLOOR_M``) — no dequantised weight — and otherwise
  ``_dequant_linear_fallback``: the fp32 absmax and absmax + offset (double quantisation, two
  fp32 ``[blocks]``) and the weight dequantised straight into the compute dtype, all live until
  the product is made. Nothing but the packed weight is saved for backward, where
  ``MatMul4Bit.backward`` (L384) dequantises the whole weight in the dtype the model was
  loaded in (``quant_state.dtype``; double quantisation first dequantises the absmax to fp32,
  ``functional.py`` L1053) and casts it to the gradient's dtype when that differs. peft wraps
  the layer in ``lora.bnb.Linear4bit``, whose forward clones the base output (peft 0.21.2
  ``tuners/lora/bnb.py`` L533): :func:`use_bnb_lora_forward`.
- ``int8`` (bnb ``Linear8bitLt``, LLM.int8): ``int8[out, in]`` + fp32 row scales ``SCB[out]``.
  Forward: int8 activations ``[T, in]`` + fp32 row scales, an int32 ``[T, out]`` product,
  fp16 output. Backward (LoRA training): a dequantised weight temporary.
- ``fp8``: ``float8_e4m3fn[out, in]`` + fp32 per-row scale; forward quantises the input
  (fp8 ``[T, in]`` + fp32 row scales) for ``_scaled_mm``; backward dequantises the weight.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..workload import Quant

BLOCK_4BIT = 64
DQ_BLOCK = 256
GEMM_4BIT_FUSED_ROWS = 4
"""Rows up to which bitsandbytes' CUDA ``gemm_4bit`` always runs its fused kernel
(``_GEMM_4BIT_CUSTOM_FLOOR_M``, bitsandbytes 0.50.2 ``backends/cuda/ops.py`` L921); above it a
per-architecture heuristic (``_gemm_4bit_use_custom_cuda``, L584) picks the fused kernel for some shapes up to 1536 rows,
which is not modelled: the trace dequantises there (an upper bound)."""


def _empty(shape: tuple[int, ...], dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=like.device)


class _Dequant(torch.autograd.Function):
    """``y = x @ dequant(W).T + b`` saving only the quantised weight (as bnb's matmuls do)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: QuantLinear) -> torch.Tensor:  # type: ignore[override]
        ctx.layer = layer
        return layer._forward_kernel(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        layer: QuantLinear = ctx.layer
        w = layer._dequantize(grad.dtype)
        return grad @ w, None


class QuantLinear(nn.Module):
    """A frozen quantised ``nn.Linear`` (storage and temporaries as bitsandbytes / fp8)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, kind: Quant,
                 compute_dtype: torch.dtype, double_quant: bool = False, device: Any = "meta",
                 storage_dtype: torch.dtype | None = None, quant_storage: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.kind = kind
        self.compute_dtype = compute_dtype
        self.storage_dtype = storage_dtype or compute_dtype
        """The dtype the weight was quantised from (bitsandbytes' ``quant_state.dtype``)."""
        self.double_quant = double_quant
        n = in_features * out_features
        dev = torch.device(device)
        if kind in (Quant.NF4, Quant.INT4):
            if quant_storage is not None:
                # FSDP-QLoRA (bnb ``bnb_4bit_quant_storage``): the packed bytes are a frozen
                # ``Params4bit`` parameter viewed as ``quant_storage`` — FSDP shards it like any
                # weight; the quant state (absmax, codes) is no parameter and stays whole per rank
                # (bitsandbytes functional.quantize_4bit: ``(n + 1) // (2 · itemsize)`` rows of quant_storage)
                rows = (n + 1) // (2 * quant_storage.itemsize)
                self.weight = nn.Parameter(torch.empty((rows, 1), dtype=quant_storage, device=dev), requires_grad=False)
            else:
                self.register_buffer("weight", torch.empty(((n + 1) // 2, 1), dtype=torch.uint8, device=dev))
            blocks = -(-n // BLOCK_4BIT)
            if double_quant:
                self.register_buffer("absmax", torch.empty(blocks, dtype=torch.uint8, device=dev))
                self.register_buffer("absmax2", torch.empty(-(-blocks // DQ_BLOCK), dtype=torch.float32, device=dev))
                self.register_buffer("code2", torch.empty(256, dtype=torch.float32, device=dev))
                self.register_buffer("offset", torch.empty((), dtype=torch.float32, device=dev))
            else:
                self.register_buffer("absmax", torch.empty(blocks, dtype=torch.float32, device=dev))
            self.register_buffer("code", torch.empty(16, dtype=torch.float32, device=dev))
        elif kind is Quant.INT8:
            self.register_buffer("weight", torch.empty((out_features, in_features), dtype=torch.int8, device=dev))
            self.register_buffer("SCB", torch.empty(out_features, dtype=torch.float32, device=dev))
        elif kind is Quant.FP8:
            self.register_buffer("weight", torch.empty((out_features, in_features), dtype=torch.float8_e4m3fn, device=dev))
            self.register_buffer("scale", torch.empty(out_features, dtype=torch.float32, device=dev))
        else:
            raise ValueError(f"no quantised storage for {kind}")
        self.bias = nn.Parameter(torch.empty(out_features, dtype=compute_dtype, device=dev),
                                 requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, lin: nn.Linear, kind: Quant, compute_dtype: torch.dtype, double_quant: bool,
                    storage_dtype: torch.dtype | None = None, quant_storage: torch.dtype | None = None) -> QuantLinear:
        return cls(lin.in_features, lin.out_features, bias=lin.bias is not None, kind=kind,
                   compute_dtype=compute_dtype, double_quant=double_quant, device=lin.weight.device,
                   storage_dtype=storage_dtype or lin.weight.dtype, quant_storage=quant_storage)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, kind={self.kind}"

    def _buffer(self, name: str) -> torch.Tensor:
        t = self._buffers[name]
        assert t is not None
        return t

    # --- kernels --------------------------------------------------------------------
    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        w = self.weight
        if self.kind in (Quant.NF4, Quant.INT4):
            absmax = _empty((self._buffer("absmax").numel(),), torch.float32, w) if self.double_quant else None
            out = _empty((self.out_features, self.in_features), self.storage_dtype, w)
            del absmax
            return out.to(dtype) if dtype != self.storage_dtype else out
        return _empty((self.out_features, self.in_features), dtype, w)

    def _gemm_4bit(self, x: torch.Tensor) -> torch.Tensor:
        """bitsandbytes' ``gemm_4bit`` dequantise-then-linear fallback: the absmax (fp32, and
        absmax + offset with double quantisation) and the weight dequantised straight into the
        input's dtype, all live until the product is made."""
        w = self.weight
        blocks = self._buffer("absmax").numel()
        absmax = [_empty((blocks,), torch.float32, w) for _ in range(2)] if self.double_quant else []
        dq = _empty((self.out_features, self.in_features), x.dtype, w)
        out = F.linear(x, dq)
        del absmax, dq
        return out

    def _forward_kernel(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(x.shape[-1], 1)
        out_shape = (*x.shape[:-1], self.out_features)
        if self.kind in (Quant.NF4, Quant.INT4):
            if rows <= GEMM_4BIT_FUSED_ROWS:
                return _empty(out_shape, x.dtype, x)  # the fused 4-bit kernel: no dequantised copy
            return self._gemm_4bit(x)
        if self.kind is Quant.INT8:
            ca = _empty(tuple(x.shape), torch.int8, x)
            sca = _empty((rows,), torch.float32, x)
            acc = _empty((*x.shape[:-1], self.out_features), torch.int32, x)
            out = _empty(out_shape, torch.float16, x)
            del ca, sca, acc
            return out if x.dtype == torch.float16 else out.to(x.dtype)
        xq = _empty(tuple(x.shape), torch.float8_e4m3fn, x)
        xs = _empty((rows,), torch.float32, x)
        out = _empty(out_shape, x.dtype, x)
        del xq, xs
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inp_dtype = x.dtype
        x = x.to(self.compute_dtype)
        if torch.is_grad_enabled() and x.requires_grad:
            out = _Dequant.apply(x, self)
        else:
            out = self._forward_kernel(x)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.to(inp_dtype)


def quantize_linears(model: nn.Module, kind: Quant, compute_dtype: torch.dtype, *, double_quant: bool,
                     skip: tuple[str, ...] = ("lm_head",), storage_dtype: torch.dtype | None = None,
                     quant_storage: torch.dtype | None = None) -> int:
    """Replace every ``nn.Linear`` (except ``skip`` names and LoRA adapters) by
    :class:`QuantLinear`; returns the count."""
    count = 0
    for name, mod in list(model.named_modules()):
        if name.rsplit(".", 1)[-1].startswith("lora_"):
            continue
        for child_name, child in list(mod.named_children()):
            if type(child) is nn.Linear and child_name not in skip:
                setattr(mod, child_name, QuantLinear.from_linear(child, kind, compute_dtype, double_quant,
                                                                 storage_dtype, quant_storage))
                count += 1
    return count


def _bnb_lora_forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """peft's ``lora.bnb.Linear4bit.forward`` (peft 0.21.2 ``tuners/lora/bnb.py`` L515-560) for
    plain LoRA adapters: the base output cloned, the adapter's output cast to its dtype (out
    of autocast), then added."""
    if self.disable_adapters or self.merged or not self.active_adapters:
        plain: Any = type(self).__mro__[1]  # peft's lora.Linear
        return plain.forward(self, x, *args, **kwargs)
    result = self.base_layer(x, *args, **kwargs).clone()
    for name in self.active_adapters:
        if name not in self.lora_A.keys():
            continue
        lora_a, lora_b = self.lora_A[name], self.lora_B[name]
        convert = not torch.is_autocast_enabled()
        expected = result.dtype
        if convert:
            x = self._cast_input_dtype(x, lora_a.weight.dtype)
        out = lora_b(lora_a(self.lora_dropout[name](x))) * self.scaling[name]
        result = result + (out.to(expected) if convert else out)
    return result


_BNB_LORA: dict[type, type] = {}


def use_bnb_lora_forward(model: nn.Module) -> int:
    """Give every peft LoRA ``Linear`` over a 4-bit :class:`QuantLinear` the forward of peft's
    bitsandbytes layer (what ``get_peft_model`` builds over a real ``bnb.nn.Linear4bit``);
    returns the count. DoRA and other variants keep peft's plain forward."""
    count = 0
    for mod in model.modules():
        base = getattr(mod, "base_layer", None)
        if (not isinstance(base, QuantLinear) or base.kind not in (Quant.NF4, Quant.INT4)
                or not hasattr(mod, "lora_A") or getattr(mod, "lora_variant", None)):
            continue
        cls = type(mod)
        if cls not in _BNB_LORA.values():
            if cls not in _BNB_LORA:
                _BNB_LORA[cls] = type(f"Bnb4bit{cls.__name__}", (cls,), {"forward": _bnb_lora_forward})
            mod.__class__ = _BNB_LORA[cls]
        count += 1
    return count
