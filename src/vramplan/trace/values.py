"""Values that a trace *does* know, and the documented answers for those it does not.

``meta`` tensors carry no data. Two kinds of code still need values:

1. Small index/shape bookkeeping (``arange`` positions, ``cache_position[-1]``, a mask built
   with ``torch.ones``): these are computed exactly. A *shadow* — a real CPU copy of the
   storage — is kept for storages made by deterministic factory ops (up to
   :data:`SHADOW_LIMIT` elements), for inputs the user gave as small CPU tensors, and for
   the output of any op whose tensor arguments all have shadows. ``.item()``, ``.tolist()``
   and data-dependent shapes then get the true answer.
2. Data-dependent shapes of model data (router choices, masks of hidden states) cannot be
   known; they get a deterministic answer (see :mod:`.datadep`). Two hints help:
   *density* (expected fraction of non-zeros: ``one_hot`` over ``n`` classes is ``1/n``, so
   uniform MoE routing gives each expert ``tokens·top_k/n`` tokens) and *bound* (indices
   from ``topk``/``argmax``/``sort`` lie below the reduced dimension's size). A *routing map*
   (zeros with ``True`` scattered at the top-k indices along the class dimension, as
   torchtitan's MoE builds it) also records that dimension and ``k``: each row holds exactly
   ``k`` ones, so its per-class sums are the routing rule's counts.
"""

from __future__ import annotations

from typing import Any

import torch

from ..emulate.tensors import on_meta

SHADOW_LIMIT = 1 << 20
"""Largest storage (elements) that gets a shadow."""


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class Values:
    """Shadows, densities and index bounds, keyed by storage (views share them)."""

    def __init__(self) -> None:
        self.shadow: dict[int, torch.Tensor] = {}
        self.density: dict[int, float] = {}
        self.bound: dict[int, int] = {}
        self.hot: dict[int, tuple[int, int]] = {}
        """Routing maps: (class dimension, ones per row)."""
        self.routing_skew = 1.0
        """Each class's share relative to uniform (``Workload.routing_skew``)."""

    def forget(self, key: int) -> None:
        self.shadow.pop(key, None)
        self.density.pop(key, None)
        self.bound.pop(key, None)
        self.hot.pop(key, None)

    # --- shadows ---------------------------------------------------------------------
    def cpu_view(self, t: torch.Tensor) -> torch.Tensor | None:
        """The real values of meta tensor ``t`` (a CPU view of its shadow), or None."""
        if not on_meta(t):
            return t
        flat = self.shadow.get(_key(t))
        if flat is None:
            return None
        if flat.dtype != t.dtype:  # a dtype view (``x.view(torch.uint64)``): the same bytes, reinterpreted
            try:
                flat = flat.contiguous().view(torch.uint8).view(t.dtype)
            except RuntimeError:  # (a storage whose bytes do not divide into t's elements)
                return None
        return torch.as_strided(flat, t.shape, t.stride(), t.storage_offset())

    def set_shadow(self, t: torch.Tensor, value: torch.Tensor) -> None:
        """Give meta tensor ``t`` (a fresh storage) the values ``value`` (CPU, same shape)."""
        if not on_meta(t):
            return
        st = t.untyped_storage()
        n = st.nbytes() // max(t.element_size(), 1)
        if n > SHADOW_LIMIT:
            return
        flat = torch.zeros(n, dtype=t.dtype)
        torch.as_strided(flat, t.shape, t.stride(), t.storage_offset()).copy_(value)
        self.shadow[st._cdata] = flat

    def drop_shadow(self, t: torch.Tensor) -> None:
        if on_meta(t):
            self.shadow.pop(_key(t), None)

    def has_shadow(self, t: torch.Tensor) -> bool:
        return not on_meta(t) or _key(t) in self.shadow

    # --- hints -----------------------------------------------------------------------
    def get_density(self, t: torch.Tensor) -> float:
        if not on_meta(t):
            return 1.0
        return self.density.get(_key(t), 1.0)

    def class_share(self, classes: int) -> float:
        """Fraction of elements that equal one given class out of ``classes`` (routing rule)."""
        return min(1.0, self.routing_skew / max(classes, 1))

    def set_density(self, t: torch.Tensor, d: float) -> None:
        if on_meta(t) and 0.0 < d < 1.0:
            self.density[_key(t)] = d

    def get_hot(self, t: torch.Tensor) -> tuple[int, int] | None:
        """(class dimension, ones per row) of a routing map, else None."""
        return self.hot.get(_key(t)) if on_meta(t) else None

    def set_hot(self, t: torch.Tensor, dim: int, k: int) -> None:
        if on_meta(t):
            self.hot[_key(t)] = (dim, k)

    def get_bound(self, t: torch.Tensor) -> int | None:
        if not on_meta(t):
            return None
        return self.bound.get(_key(t))

    def set_bound(self, t: torch.Tensor, b: int) -> None:
        if on_meta(t) and b > 0:
            self.bound[_key(t)] = int(b)


def to_cpu_args(values: Values, obj: Any) -> tuple[Any, bool]:
    """Replace meta tensors in ``obj`` (args/kwargs, one level of lists) by their shadows.

    Returns (converted, ok); ok is False when some meta tensor has no shadow.
    """
    if isinstance(obj, torch.Tensor):
        v = values.cpu_view(obj)
        return v, v is not None
    if isinstance(obj, (list, tuple)):
        out = []
        for x in obj:
            c, ok = to_cpu_args(values, x)
            if not ok:
                return obj, False
            out.append(c)
        return type(obj)(out) if isinstance(obj, tuple) else out, True
    if isinstance(obj, dict):
        d = {}
        for k, x in obj.items():
            c, ok = to_cpu_args(values, x)
            if not ok:
                return obj, False
            d[k] = c
        return d, True
    if isinstance(obj, torch.device) and obj.type == "meta":
        return torch.device("cpu"), True
    return obj, True
