"""Scaled-dot-product attention as the target GPU would run it.

On ``meta`` tensors ``F.scaled_dot_product_attention`` takes the math path (a materialised
``B·H·T·T`` score matrix, fp32 upcasts). On CUDA, PyTorch picks a fused kernel in
``select_sdp_backend`` (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp); this module
follows its filters and priority order and calls that kernel's aten op, whose meta kernel
gives the true outputs and saved tensors (logsumexp fp32 ``[B,H,T]``, rng state):

- order: cuDNN, flash, memory-efficient, math when cuDNN is preferred (sm90/sm10x, PyTorch
  ≥ 2.10 with cuDNN > 9.15); flash, memory-efficient, math otherwise.
- flash (sm80–sm121): fp16/bf16, no ``attn_mask``, equal head dims ≤ 256, causal only
  with Tq == Tk, GQA native; training with head dim in (192, 224] is refused on sm86/89/120.
- memory-efficient (sm50–sm121): fp32 too (bf16 from sm80), masks allowed (bool masks are
  converted to an additive float mask, padded to a multiple of 16 keys), head dims
  divisible by the GEMM alignment; GQA inputs are expanded with ``repeat_interleave``
  (assumption: the meta backward has no GQA support).
- cuDNN (sm80–sm121, NVIDIA): fp16/bf16, head dim ≤ 128 (256 on sm90/sm10x), multiple of
  8, dropout a multiple of 1/16, more than one key.
- math: PyTorch's own decomposition on meta (same as CUDA's math kernel).

Backward workspaces (fp32 dQ accumulators of the memory-efficient and cuDNN kernels) are
added by :mod:`.dispatch` (``_fused_bwd_workspace``) next to flash's ``mha_bwd`` buffers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .cuda import DeviceProfile

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)


def _sm_in(sm: tuple[int, int], lo: tuple[int, int], hi: tuple[int, int]) -> bool:
    return lo <= sm <= hi


def _common(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool, same_heads: bool) -> bool:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return False
    if q.shape[2] == 0 or k.shape[2] == 0:
        return False
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        return False
    hq, hk, hv = q.shape[1], k.shape[1], v.shape[1]
    if enable_gqa:
        if hk != hv or hq % hk:
            return False
    elif same_heads and not (hq == hk == hv):
        return False
    return True


def _last_dim_contiguous(*ts: torch.Tensor | None, ignore_singleton: bool = False) -> bool:
    for t in ts:
        if t is None:
            continue
        if t.stride(-1) != 1 and not (ignore_singleton and t.shape[-1] == 1):
            return False
    return True


def can_flash(p: DeviceProfile, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              dropout: float, causal: bool, gqa: bool, grad: bool) -> bool:
    if p.vendor == "intel" or mask is not None:
        return False
    if not _common(q, k, v, gqa, same_heads=True) or not _last_dim_contiguous(q, k, v, ignore_singleton=True):
        return False
    d = q.shape[-1]
    if not (d == k.shape[-1] == v.shape[-1]) or d > 256:
        return False
    if not _sm_in(p.sm, (8, 0), (12, 1)):
        return False
    if grad and (_sm_in(p.sm, (8, 6), (8, 9)) or _sm_in(p.sm, (12, 0), (12, 1))):
        if not (d <= 192 or (dropout == 0.0 and d > 224)):
            return False
    if causal and q.shape[2] != k.shape[2]:
        return False
    return q.dtype in _HALF and q.dtype == k.dtype == v.dtype


def _gemm_alignment(p: DeviceProfile, dtype: torch.dtype) -> int:
    half = dtype in _HALF
    tensor_cores = p.sm[0] >= 8 or (p.sm[0] >= 7 and half)
    align = 4 if p.sm[0] >= 8 else 1
    if tensor_cores:
        align = max(align, 128 // (16 if half else 32))
    return align


def can_efficient(p: DeviceProfile, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  dropout: float, causal: bool, gqa: bool, grad: bool) -> bool:
    if p.vendor == "intel" or not _sm_in(p.sm, (5, 0), (12, 1)):
        return False
    if not _common(q, k, v, gqa, same_heads=True) or not _last_dim_contiguous(q, k, v):
        return False
    align = _gemm_alignment(p, q.dtype)
    dq, dv = q.shape[-1], v.shape[-1]
    if dq != k.shape[-1] or dq % align or dv % align or dq == 0 or dv == 0:
        return False
    if p.sm[0] >= 8:
        a_bytes = align * q.element_size()
        for t in (q, k, v):
            if t.numel() and (t.storage_offset() * t.element_size()) % a_bytes:
                return False
    ok = (torch.float16, torch.float32, torch.bfloat16) if p.sm[0] >= 8 else (torch.float16, torch.float32)
    return q.dtype in ok and q.dtype == k.dtype == v.dtype


def can_cudnn(p: DeviceProfile, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              dropout: float, causal: bool, gqa: bool, grad: bool) -> bool:
    if not p.has_cudnn_attention or not _sm_in(p.sm, (8, 0), (12, 1)):
        return False
    if q.dtype not in _HALF or not (q.dtype == k.dtype == v.dtype):
        return False
    if dropout * 16.0 != int(dropout * 16.0):
        return False
    if not _common(q, k, v, gqa, same_heads=False) or not _last_dim_contiguous(q, k, v, ignore_singleton=True):
        return False
    b, h, sq, dqk = q.shape
    sk, dv = k.shape[2], v.shape[-1]
    if b > 65535 or h > 65535:
        return False
    sm90_10x = p.sm == (9, 0) or p.sm[0] == 10
    limit = 256 if sm90_10x else 128
    if dqk > limit or dv > limit or dqk % 8 or dv % 8:
        return False
    if sk == 1 or (dropout > 0.0 and sq == 1):
        return False
    if grad and sm90_10x:
        if not ((dqk <= 128 and dv <= 128) or (dqk, dv) in ((192, 128), (256, 256))):
            return False
    return True


def choose_backend(p: DeviceProfile, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: torch.Tensor | None = None, dropout: float = 0.0, causal: bool = False,
                   gqa: bool = False, grad: bool = False) -> str:
    """``cudnn`` | ``flash`` | ``efficient`` | ``math``, as ``select_sdp_backend`` would."""
    order = ("cudnn", "flash", "efficient") if p.prefer_cudnn_attention else ("flash", "efficient")
    checks = {"cudnn": can_cudnn, "flash": can_flash, "efficient": can_efficient}
    for name in order:
        if checks[name](p, q, k, v, mask, dropout, causal, gqa, grad):
            return name
    return "math"


def _float_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``convert_boolean_attn_mask``: a bool mask becomes an additive mask of ``dtype``."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask.logical_not(), torch.tensor(float("-inf"), dtype=dtype, device=mask.device),
                       torch.tensor(0.0, dtype=dtype, device=mask.device))


def _pad_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``preprocess_mask`` for the memory-efficient kernel: pad keys to a multiple of 16 and
    expand (a view) to ``[B, H, Tq, Tk]``."""
    tk = mask.shape[-1]
    if tk % 16:
        mask = F.pad(mask, (0, 16 - tk % 16))[..., :tk]
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return mask.expand(shape)


def run_sdpa(p: DeviceProfile, original: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
             scale: float | None = None, enable_gqa: bool = False) -> tuple[torch.Tensor, str]:
    """Attention through the kernel the target GPU would pick; returns (output, backend)."""
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    backend = choose_backend(p, q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, grad)
    if backend == "flash":
        d = q.shape[-1]
        if d % 8:
            pad = 8 - d % 8
            q2, k2, v2 = (F.pad(t, (0, pad)) for t in (q, k, v))
            s = scale if scale is not None else d ** -0.5
            out = aten._scaled_dot_product_flash_attention(q2, k2, v2, dropout_p, is_causal, False, scale=s)[0]
            return out[..., :d], backend
        return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0], backend
    if backend == "cudnn":
        mask = _float_mask(attn_mask, q.dtype)
        out = aten._scaled_dot_product_cudnn_attention(q, k, v, mask, grad, dropout_p, is_causal, False, scale=scale)
        return out[0], backend
    if backend == "efficient":
        mask = _float_mask(attn_mask, q.dtype)
        if mask is not None:
            mask = _pad_mask(mask, q, k)
        if enable_gqa and k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = aten._scaled_dot_product_efficient_attention(q, k, v, mask, grad, dropout_p, is_causal, scale=scale)
        return out[0], backend
    out = original(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                   enable_gqa=enable_gqa)
    return out, backend
