"""CUDA autocast, emulated above autograd (``torch.autocast("cuda")`` is unavailable here).

Op lists and policies are CUDA's (aten/src/ATen/autocast_mode.h/.cpp): matched by the
Python API name that reaches ``__torch_function__`` (``F.linear``, ``Tensor.matmul``,
``torch.exp``...). Casts happen before autograd records the op, so autograd saves the
16-bit copies, exactly as on CUDA.

Weight-cast cache (``cached_cast``): the 16-bit copy of an fp32 leaf tensor that requires
grad (a trainable weight) is made once per autocast region and kept until the outermost
region exits — category ``autocast_cache``. Checkpoint recompute runs with autocast on and
the cache off (PyTorch re-enters autocast per recomputed region; each weight is used once
per region, so the copies are the same).
"""

from __future__ import annotations

from typing import Any

import torch

from ..emulate.tensors import on_meta
from ..errors import TraceError
from ..events import Category
from .recorder import Recorder

LOWER_PRECISION = frozenset({
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "__matmul__",
    "__rmatmul__", "einsum", "mm", "mv", "vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul",
    "multi_dot", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "scaled_dot_product_attention",
})
FP32 = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
    "rsqrt", "sinh", "tan", "pow", "__pow__", "__rpow__", "softplus", "layer_norm", "group_norm",
    "frobenius_norm", "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss",
    "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss",
    "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm",
    "logsumexp", "interpolate", "upsample", "upsample_nearest", "upsample_bilinear",
    "cross_entropy",  # composite: log_softmax (fp32 dtype) + nll_loss (fp32)
})
FP32_SET_OPT_DTYPE = frozenset({
    "prod", "softmax", "log_softmax", "cumprod", "cumsum", "vector_norm", "matrix_norm", "sum", "norm",
})
PROMOTE = frozenset({
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sample", "tensordot",
    "scatter_add",
})
BANNED = frozenset({"binary_cross_entropy"})


class Autocast:
    """The state of one emulated ``torch.autocast("cuda", dtype)``."""

    def __init__(self, rec: Recorder, dtype: torch.dtype) -> None:
        self.rec = rec
        self.dtype = dtype
        self.enabled = False
        self.cache_enabled = True
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def enter(self) -> None:
        self.enabled = True

    def exit(self) -> None:
        """Leave the outermost region: the weight-cast cache is dropped."""
        self.enabled = False
        self._cache.clear()

    # --- casting ---------------------------------------------------------------------
    def _eligible(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and on_meta(t) and t.is_floating_point() \
            and t.dtype is not torch.float64

    def cast(self, t: Any, to: torch.dtype, cache: bool) -> Any:
        if not self._eligible(t) or t.dtype == to:
            if isinstance(t, (list, tuple)):
                return type(t)(self.cast(x, to, cache) for x in t)
            return t
        if (cache and self.cache_enabled and to == self.dtype and t.dtype == torch.float32
                and t.requires_grad and t.is_leaf and not t._is_view()):
            hit = self._cache.get(id(t))
            if hit is not None and hit[0] is t:
                return hit[1]
            c = t.to(to)
            self.rec.relabel(c, Category.AUTOCAST_CACHE)
            self._cache[id(t)] = (t, c)
            return c
        return t.to(to)

    def _widest(self, args: Any) -> torch.dtype:
        for a in args:
            if self._eligible(a) and a.dtype == torch.float32:
                return torch.float32
        return self.dtype

    def apply(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], cache: bool) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Arguments as CUDA autocast would pass them to the op ``name``."""
        if name in LOWER_PRECISION:
            to = self.dtype
        elif name in FP32:
            to = torch.float32
        elif name in FP32_SET_OPT_DTYPE:
            first = args[0] if args else None
            if self._eligible(first) and kwargs.get("dtype") is None and not any(isinstance(a, torch.dtype) for a in args):
                kwargs = {**kwargs, "dtype": torch.float32}
            return args, kwargs
        elif name in PROMOTE:
            to = self._widest(list(args) + list(kwargs.values()))
        elif name in BANNED:
            raise TraceError(
                "torch.nn.functional.binary_cross_entropy is unsafe to autocast (CUDA raises here)",
                hint="use binary_cross_entropy_with_logits / BCEWithLogitsLoss",
            )
        else:
            return args, kwargs
        # CUDA's autocast casts the op's arguments in one C++ pack expansion,
        # ``op(cached_cast(dtype, args, device)...)``, which GCC (torch's Linux builds) evaluates
        # right to left: the last argument's copy is made first. The order is the autograd
        # sequence of the cast nodes, so in the backward the first argument's gradient is cast
        # back first (``linear``: the input's, then the weight's, then the bias's).
        cast_kwargs = {k: self.cast(v, to, cache) for k, v in reversed(kwargs.items())}
        new_args = tuple(reversed([self.cast(a, to, cache) for a in reversed(args)]))
        return new_args, {k: cast_kwargs[k] for k in kwargs}


def handles(name: str) -> bool:
    return name in LOWER_PRECISION or name in FP32 or name in FP32_SET_OPT_DTYPE or name in PROMOTE or name in BANNED
