"""Other libraries' quantised linears on the trace device: AWQ, GPTQ, HQQ, torchao, compressed-tensors.

:class:`FormatLinear` holds the tensors :func:`vramplan.quantformats.stored` lists for its
format and allocates, in each forward, what that library's forward allocates, in the same
order and with the same lifetimes (the caching allocator sees the same requests). The shapes
and op sequences follow the files each :class:`~vramplan.quantformats.Format` cites; the CPU
paths of HQQ, torchao's int8/fp8 weight-only and compressed-tensors were checked op by op
against the real libraries (tests/test_quant_formats.py). Inference only: none of these is
traced under autograd.

compressed-tensors under transformers keeps the compressed tensors until the model's first
forward, whose pre-hook (``ct_decompress_hook``) decompresses every linear in turn to a dense
weight and frees the compressed one; :func:`quantize_format` installs the same hook.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import TraceError
from ..quantformats import DECOMPRESSED, layout_problem, stored
from ..workload import Quant
from .quant import _empty

INT_MM_MIN_ROWS = 17
"""torchao ``safe_int_mm``: cuBLAS ``_int_mm`` needs more than 16 rows; fewer fall back to fp32."""

_KERNELS = {Quant.AWQ: "_marlin", Quant.GPTQ: "_marlin", Quant.HQQ: "_hqq", Quant.AO_INT4: "_ao_int4",
            Quant.AO_INT8: "_ao_int8", Quant.AO_INT8_DYN: "_ao_int8_dyn", Quant.AO_FP8: "_ao_fp8",
            Quant.AO_FP8_DYN: "_ao_fp8_dyn", **{q: "_ct" for q in DECOMPRESSED}}
"""Each format's forward (the method that allocates what its library's forward allocates)."""


def _dt(name: str) -> torch.dtype:
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype


class FormatLinear(nn.Module):
    """A frozen quantised ``nn.Linear`` in one of :data:`vramplan.quantformats.FORMATS`."""

    def __init__(self, lin: nn.Linear, kind: Quant, compute: torch.dtype, sm_count: int = 108, group: int = 0) -> None:
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.kind, self.compute = kind, compute
        self.decompressed = False
        self.vramplan_on_new_weight: Any = None
        """Set by the trace session (duck-typed): called with the dense weight a decompression
        makes, so that it is booked as a weight and not as a forward temporary."""
        self.sm_count = sm_count
        dev = lin.weight.device
        for name, dtype, shape in stored(kind, self.in_features, self.out_features, _name(compute), group=group):
            self.register_buffer(name, torch.empty(shape, dtype=_dt(dtype), device=dev))
        self.bias = nn.Parameter(torch.empty(self.out_features, dtype=compute, device=dev),
                                 requires_grad=False) if lin.bias is not None else None

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, kind={self.kind}"

    def _buf(self, name: str) -> torch.Tensor:
        t = self._buffers[name]
        assert t is not None
        return t

    # --- compressed-tensors' first-forward decompression --------------------------------
    def decompress(self) -> None:
        """``decompress_module``: unpack/cast the stored weight to a dense one (the temporaries
        of compressed_tensors' pack_quantized ``unpack_from_int32`` + ``dequantize``), then
        replace the compressed tensor (``replace_direct_state_dict``)."""
        w = self._buf("weight_packed" if self.kind is Quant.CT_W4A16 else "weight")
        n = self.in_features * self.out_features
        if self.kind is Quant.CT_W4A16:
            unpacked = _empty((n,), torch.uint8, w)  # stack of the nibbles (int8 view of it)
            as_float = _empty((n,), self.compute, w)  # .to(scale dtype), grouped [O, I/g, g]
            dense = _empty((self.out_features, self.in_features), self.compute, w)  # * scale
            del unpacked, as_float
            del self._buffers["weight_packed"]
        else:
            as_float = _empty((n,), self.compute, w)
            dense = _empty((self.out_features, self.in_features), self.compute, w)
            del as_float
            del self._buffers["weight"]
        del w
        self.register_buffer("weight", dense)
        self.decompressed = True
        if self.vramplan_on_new_weight is not None:
            self.vramplan_on_new_weight(dense)

    # --- forwards ----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, _KERNELS[self.kind])(x)  # type: ignore[no-any-return]

    def _rows(self, x: torch.Tensor) -> int:
        return x.numel() // max(x.shape[-1], 1)

    def _out(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return _empty((*x.shape[:-1], self.out_features), dtype, x)

    def _marlin(self, x: torch.Tensor) -> torch.Tensor:
        # gptq_marlin_gemm: the output [M, N] (bias fused), then an fp32 c_tmp of
        # sms · min(ceil16(M), 64) · max_thread_n (256) for the call (use_fp32_reduce, the default)
        rows = self._rows(x)
        out = self._out(x, x.dtype)
        m_block = min(-(-rows // 16) * 16, 64)
        c_tmp = _empty((self.sm_count * m_block * 256,), torch.float32, x)
        del c_tmp
        return out

    def _hqq(self, x: torch.Tensor) -> torch.Tensor:
        # HQQLinear.matmul → dequantize(): unpack_4bit_u8 into a compute-dtype buffer
        wq = self._buf("W_q")
        w_r = _empty((2 * wq.shape[0], wq.shape[1]), self.compute, wq)
        for _ in range(2):  # (W_q & mask) >> 4, W_q & mask: uint8 temporaries copied into halves
            t = _empty(tuple(wq.shape), torch.uint8, wq)
            del t
        sub = w_r - self._buf("zero")
        w_est = (sub * self._buf("scale")).view(self.out_features, self.in_features)
        del sub, w_r
        out = torch.matmul(x, w_est.t())
        del w_est
        if self.bias is not None:
            out += self.bias
        return out

    def _ao_int4(self, x: torch.Tensor) -> torch.Tensor:
        # Int4Tensor linear: mslk/fbgemm bf16i4bf16_rowwise writes the output; res + bias
        out = self._out(x, x.dtype)
        return out + self.bias if self.bias is not None else out

    def _ao_int8(self, x: torch.Tensor) -> torch.Tensor:
        # Int8Tensor (weight-only): qdata.t().to(x.dtype), mm, * scale, bias in place
        w = self._buf("qdata").t().to(x.dtype)
        y = torch.matmul(x, w)
        del w
        out = y * self._buf("scale").to(x.dtype).view(-1)
        del y
        if self.bias is not None:
            out.add_(self.bias)
        return out

    def _ao_int8_dyn(self, x: torch.Tensor) -> torch.Tensor:
        rows = self._rows(x)
        # per-token symmetric quantisation of the input (choose_qparams on [T, 1], then fp32 math)
        f = x.to(torch.float32)
        r = torch.round(f)
        del f
        a = r + 0
        del r
        c = torch.clamp(a, -128, 127)
        del a
        xq = c.to(torch.int8)
        del c
        scale = _empty((rows, 1), torch.float32, x)
        w = self._buf("qdata")
        wc = _empty((self.in_features, self.out_features), torch.int8, w)  # mat2.contiguous(), before the try
        if rows < INT_MM_MIN_ROWS:  # _int_mm refuses 16 rows or fewer: the fallback's fp32 copies of both
            xf = xq.to(torch.float32)
            wf = _empty((self.in_features, self.out_features), torch.float32, w)
            f32 = _empty((*x.shape[:-1], self.out_features), torch.float32, x)
            acc = f32.to(torch.int32)
            del xf, wf, f32
        else:
            acc = _empty((*x.shape[:-1], self.out_features), torch.int32, x)  # torch._int_mm
        del wc
        del xq
        y = acc.to(torch.float32) * scale.view(*x.shape[:-1], 1)
        del acc, scale
        y2 = y.to(x.dtype)
        del y
        out = y2 * self._buf("scale").view(-1).to(x.dtype)
        del y2
        if self.bias is not None:
            out.add_(self.bias)
        return out

    def _ao_fp8(self, x: torch.Tensor) -> torch.Tensor:
        # _dequantize_affine_float8: fp8 → fp32, * scale (fp32), → x.dtype; then mm, + bias
        # (fp8_tensor and hp_tensor are locals of _dequantize_affine_float8: both fp32 copies live
        # until the cast to x.dtype returns — 10 B per weight at that moment)
        q = self._buf("qdata")
        f = q.to(torch.float32)
        s = f * self._buf("scale")
        w = s.to(x.dtype)
        del f, s
        out = torch.matmul(x, w.t())
        del w
        return out + self.bias if self.bias is not None else out

    def _ao_fp8_dyn(self, x: torch.Tensor) -> torch.Tensor:
        # _choose_scale_float8 (abs, amax) then _quantize_affine_float8 (fp32 div, clamp, → e4m3)
        a = torch.abs(x)
        del a
        f = x.to(torch.float32)
        d = f / 1.0
        del f
        c = torch.clamp(d, -448.0, 448.0)
        del d
        xq = c.to(torch.float8_e4m3fn)
        del c
        out = self._out(x, x.dtype)  # torch._scaled_mm, bias fused
        del xq
        return out

    def _ct(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind is not Quant.CT_W4A16:
            x = self._fake_quant(x)
        return F.linear(x, self._buf("weight"), self.bias)

    def _fake_quant(self, x: torch.Tensor) -> torch.Tensor:
        # quantized_forward → fake_quantize → _quantize_dequantize (per-token dynamic args):
        # x / scale, += zp, clamp, round (fp8: → e4m3 → back), - zp, * scale
        rows = self._rows(x)
        scale = _empty((*x.shape[:-1], 1), x.dtype, x)
        zp = _empty((*x.shape[:-1], 1), x.dtype, x)
        scaled = x / scale
        scaled += zp
        c = torch.clamp(scaled, -128, 127)
        if self.kind is Quant.CT_FP8:
            f8 = c.to(torch.float8_e4m3fn)
            del c
            q = f8.to(x.dtype)
            del f8
        else:
            q = torch.round(c)
            del c
        dq = q - zp
        out = dq * scale
        del scaled, q, dq, scale, zp, rows
        return out


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def skipped(full: str, skip: tuple[str, ...]) -> bool:
    """transformers' ``modules_to_not_convert`` rule: a name matches itself, a leaf name, or a
    prefix of the module's full name."""
    leaf = full.rsplit(".", 1)[-1]
    return any(p == full or p == leaf or full.startswith(p + ".") or full.endswith("." + p) for p in skip)


def quantize_format(model: nn.Module, kind: Quant, compute: torch.dtype, *,
                    skip: tuple[str, ...] = ("lm_head",), sm_count: int = 108, group: int = 0) -> int:
    """Replace every ``nn.Linear`` (except ``skip`` names) by :class:`FormatLinear`; returns the
    count. compressed-tensors formats get transformers' first-forward decompression hook.
    Refused (:class:`TraceError`): a layer the format cannot pack, a model with nothing to
    quantise, and MoE expert weights outside ``nn.Linear`` (fused expert tensors: not modelled)."""
    layers: list[FormatLinear] = []
    for prefix, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            full = f"{prefix}.{child_name}" if prefix else child_name
            if type(child) is nn.Linear and not skipped(full, skip):
                why = layout_problem(kind, child.in_features, child.out_features, group)
                if why:
                    raise TraceError(f"{kind}: {full} ({child.in_features}→{child.out_features}) cannot be stored: {why}",
                                     hint="use another `quant` (nf4/int8 store any shape)")
                fl = FormatLinear(child, kind, compute, sm_count, group)
                setattr(mod, child_name, fl)
                layers.append(fl)
    if not layers:
        raise TraceError(f"{kind}: the model has no nn.Linear layer to quantise (GPT-2's Conv1D and fused expert "
                         "tensors are not converted)", hint="use a model with nn.Linear layers, or drop `quant`")
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n and p.dim() >= 3)
    if experts:
        raise TraceError(f"{kind} with fused MoE expert weights ({experts:,} parameters in 3-D expert tensors) is not "
                         "modelled: the format's libraries quantise experts their own way", hint="drop `quant`, "
                         "or use `quant=nf4`/`int8` (bitsandbytes leaves fused experts in 16-bit, as traced)")
    if kind in DECOMPRESSED:
        model.register_forward_pre_hook(_DecompressOnce(layers))
    return len(layers)


class _DecompressOnce:
    """compressed_tensors ``ct_decompress_hook``: on the model's first forward, decompress each
    quantised module in turn (later calls find nothing left to decompress)."""

    def __init__(self, layers: list[FormatLinear]) -> None:
        self.layers = layers

    def __call__(self, module: nn.Module, args: Any) -> None:
        for layer in self.layers:
            if not layer.decompressed:
                layer.decompress()
