"""A cache of meta-kernel results: the same op on the same shapes gives the same shapes.

Many meta kernels are Python (``torch._refs`` decompositions, broadcasting checks), and a
transformer repeats the same ops on the same shapes in every layer. The first call of an op
with a given *signature* (op, each tensor's shape/stride/dtype/offset, every other
argument) runs the meta kernel; later calls rebuild the outputs with ``empty_strided``
(functional ops) or return ``self`` (in-place ops), skipping the kernel.

Only ops whose tensor arguments are all ``meta`` are cached (host tensors carry real values,
e.g. optimizer step counters), and none with a wrapper subclass among its arguments or
results: the subclass decides in its own ``__torch_dispatch__`` what an op returns (torchao's
``WeightWithDynamicFloat8CastTensor`` keeps its type through ``new_zeros``/``view``/``slice``,
which FSDP2's sharding relies on to find its ``fsdp_pre_all_gather``), the key does not see the
type, and the rebuild makes plain tensors. (The trace hands such ops to the subclass before the
cache, :func:`.dispatch._redispatching`; this keeps the cache right on its own.) Only
results that this rebuild reproduces exactly are kept: outputs that are fresh,
distinct, contiguous-from-offset-0 storages of the minimal size; in-place ops that return
their first argument (or nothing) and do not change metadata. Anything else (views, ops
that alias despite their schema, data-dependent or random-shaped ops) always runs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..emulate.tensors import on_meta

_UNCACHEABLE, _FUNCTIONAL, _INPLACE = 0, 1, 2
_METADATA_MUTATORS = frozenset({"resize_", "resize_as_", "set_", "_resize_output_", "as_strided_", "detach_"})
_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)


def _kind(func: Any) -> int:
    schema = func._schema
    if torch.Tag.inplace_view in func.tags or func.__name__.split(".")[0] in _METADATA_MUTATORS:
        return _UNCACHEABLE
    writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    if any(r.alias_info is not None for r in schema.returns):
        if writes and len(schema.returns) == 1 and schema.arguments and schema.arguments[0].alias_info is not None \
                and schema.arguments[0].alias_info.is_write:
            return _INPLACE
        return _UNCACHEABLE
    if writes:
        return _INPLACE if not schema.returns else _UNCACHEABLE
    return _FUNCTIONAL


def _wrapper(x: torch.Tensor) -> bool:
    return type(x) is not torch.Tensor and is_traceable_wrapper_subclass(x)


def _sig(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        if not on_meta(x) or _wrapper(x):
            raise TypeError  # host tensors hold real values, subclasses dispatch themselves: their ops must run
        return (tuple(x.shape), x.stride(), x.dtype, x.storage_offset())
    if isinstance(x, (list, tuple)):
        return tuple(_sig(v) for v in x)
    if isinstance(x, _SCALARS):
        return x
    raise TypeError


def _min_bytes(shape: tuple[int, ...], stride: tuple[int, ...], itemsize: int) -> int:
    if any(s == 0 for s in shape):
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(shape, stride, strict=True))) * itemsize


class MetaCache:
    """Memoised meta-kernel outputs keyed by op signature."""

    def __init__(self) -> None:
        self._kinds: dict[Any, int] = {}
        self._results: dict[tuple[Any, ...], Any] = {}
        self.hits = 0
        self.misses = 0
        self.enabled = True

    def key(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
        if not self.enabled:
            return None
        kind = self._kinds.get(func)
        if kind is None:
            kind = self._kinds[func] = _kind(func)
        if kind == _UNCACHEABLE:
            return None
        try:
            return (func, _sig(args), tuple((k, _sig(v)) for k, v in kwargs.items()) if kwargs else ())
        except TypeError:
            return None

    def get(self, key: tuple[Any, ...], args: tuple[Any, ...]) -> tuple[bool, Any]:
        """(hit, outputs)."""
        spec = self._results.get(key)
        if spec is None:
            return False, None
        self.hits += 1
        if spec == "self":
            return True, args[0]
        if spec == "none":
            return True, None
        return True, _build(spec)

    def put(self, key: tuple[Any, ...], args: tuple[Any, ...], out: Any) -> None:
        self.misses += 1
        if self._kinds[key[0]] == _INPLACE:
            if out is None:
                self._results[key] = "none"
            elif out is args[0]:
                self._results[key] = "self"
            return
        in_keys = set()
        for a in _tensors(args):
            in_keys.add(a.untyped_storage()._cdata)
        spec = _spec(out, in_keys, set())
        if spec is not None:
            self._results[key] = spec


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


def _spec(out: Any, in_keys: set[int], seen: set[int]) -> Any:
    """How to rebuild ``out``; None when it cannot be rebuilt exactly."""
    if isinstance(out, torch.Tensor):
        if not on_meta(out) or out.storage_offset() != 0 or _wrapper(out):
            return None
        st = out.untyped_storage()
        k = st._cdata
        if k in in_keys or k in seen:
            return None
        seen.add(k)
        shape, stride = tuple(out.shape), out.stride()
        if st.nbytes() != _min_bytes(shape, stride, out.element_size()):
            return None
        return ("t", shape, stride, out.dtype)
    if isinstance(out, (list, tuple)):
        parts = []
        for o in out:
            p = _spec(o, in_keys, seen)
            if p is None:
                return None
            parts.append(p)
        return ("l" if isinstance(out, list) else "u", tuple(parts))
    if isinstance(out, (int, float, bool, type(None))):
        return ("v", out)
    return None


def _build(spec: Any) -> Any:
    tag = spec[0]
    if tag == "t":
        return torch.empty_strided(spec[1], spec[2], dtype=spec[3], device="meta")
    if tag == "v":
        return spec[1]
    parts = [_build(p) for p in spec[1]]
    return parts if tag == "l" else tuple(parts)
