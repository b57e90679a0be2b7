"""Deterministic answers for ops whose output size depends on tensor values.

On ``meta`` tensors these ops have no kernel (FakeTensorMode raises
``DynamicOutputShapeException`` / ``DataDependentOutputException`` for the same reason).
When every input has a known value (a shadow, see :mod:`.values`) the answer is exact.
Otherwise the documented rule below is used, and the trace's notes say so:

========================  ======================================================================
op                        answer without values
========================  ======================================================================
nonzero / argwhere /      every element counts as non-zero (the no-padding, all-valid case;
``torch.where(mask)``     an upper bound), except masks derived from ``one_hot`` over ``n``
                          classes or equality masks ``idx == e`` of indices below ``n``
                          (``topk``/``argmax``/``sort`` over ``n``): a fraction ``1/n`` —
                          uniform MoE routing, each expert gets ``tokens·top_k/n`` tokens
                          (times ``Workload.routing_skew``, capped at every token)
mask.sum() / count        of such a mask: ``numel·share`` (a known value, so ``.item()`` works)
x[bool_mask],             as nonzero of the mask; a mask with values (labels built from
masked_select             known masks) indexing model data: its exact count
unique (all variants)     every element distinct
torchvision nms           every box kept (an upper bound; detectors keep ``post_nms_top_n`` /
                          ``detections_per_img`` of them right after)
repeat_interleave(r)      every repeat is 1
bincount                  ``max(minlength, index bound or numel)`` bins; the counts of indices
                          below ``n`` are known under the routing rule: ``numel/n`` each (the
                          remainder to the first bins; with a skew, bin 0 takes
                          ``skew·numel/n`` and the rest share what is left), so ``.tolist()``
                          and ``torch.split`` by counts work; ``torch.histc`` of such indices
                          gets the same counts
routing map               ``zeros(…, n).scatter_(dim, topk_ids, True)`` (torchtitan's MoE): each
                          row holds ``k`` ones; its sums over every dimension but the classes'
                          are the bincount counts above (``rows·k`` over ``n``)
all_to_all_single         of known values (torchtitan's per-expert token counts), on the fake
                          process group: every rank taken to send what this rank sends (ranks
                          symmetric: the routing rule gives every rank the same counts), so
                          rank ``r`` of ``W`` receives its own ``r``-th chunk ``W`` times
.item(), bool(t), .cpu()  no answer: raises :class:`~vramplan.errors.TraceError` naming the op
                          and the user's ``file:line`` (control flow on model data cannot be
                          traced without values)
========================  ======================================================================
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .values import SHADOW_LIMIT, Values

aten = torch.ops.aten

Rule = Callable[[Values, Any, tuple[Any, ...], dict[str, Any]], Any]

RULE_TEXT: dict[str, str] = {
    "nonzero": "assumed every element non-zero (masks from one_hot over n classes: 1/n, i.e. uniform expert load)",
    "masked_select": "assumed every mask element true (one_hot-derived masks: 1/n)",
    "index_bool": "boolean-mask indexing assumed every element selected (one_hot-derived masks: 1/n)",
    "unique": "assumed every element distinct",
    "nms": "non-maximum suppression without box values keeps every box (upper bound; detectors cap it next)",
    "repeat_interleave": "assumed every repeat count is 1",
    "bincount": "assumed max(minlength, index bound) bins; counts of routed indices uniform over the bins "
                "(times the routing skew for the first)",
    "routing_map": "routing maps (zeros with True scattered at top-k ids) hold k ones a row; their per-expert "
                   "sums are the bincount counts",
    "symmetric_exchange": "all-to-all of known values (per-expert token counts) on the fake process group: every "
                          "rank taken to send what this rank sends (the same routing on every rank), so this rank "
                          "receives, from each rank, the tokens its own experts get from itself",
    "eq_mask": "equality masks of indices below n select 1/n of the elements (uniform routing, times the routing skew)",
    "mask_count": "counts of routed masks taken as numel x share (uniform routing, times the routing skew)",
    "optimizer_value": "values the optimizer reads (norms, step counts on the device) taken as 1",
    "host_float": "floats the script reads back (.item() of losses, norms) taken as 1.0",
    "finite": "isnan/isinf/isfinite of activations taken as finite (no overflow)",
    "host_bool": "booleans the script reads back from device data without values taken as False, and sampled "
                 "tokens never a stop token (isin: False): a generation loop runs to its length limit",
    "sampled_index": "sampled or selected indices the script reads back (multinomial, argmax, topk) taken as the "
                     "middle of their range",
    "host_without_values": "large host tensors from factories whose values do not matter (empty, zeros, randn…: "
                           "weights before .to('cuda'), synthetic data) kept without values: no RAM",
}


def _meta(shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def _count(values: Values, mask: torch.Tensor, numel: int | None = None) -> int:
    n = mask.numel() if numel is None else numel
    known = values.cpu_view(mask)
    if known is not None:  # a mask with values (indexing model data with it: the data has none)
        return int(known.count_nonzero()) * (n // max(mask.numel(), 1))
    d = values.get_density(mask)
    return n if d >= 1.0 else max(1, min(n, math.ceil(n * d)))


def nonzero(values: Values, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    x = args[0]
    count = _count(values, x)
    out = _meta((count, x.dim()), torch.int64)
    return out


def nonzero_numpy(values: Values, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    x = args[0]
    count = _count(values, x)
    return tuple(_meta((count,), torch.int64) for _ in range(max(x.dim(), 1)))


def full_grid_values(x: torch.Tensor, out: Any) -> Any:
    """Values of ``out`` when the rule answered "every element non-zero": the full index
    grid (known exactly), or None when the answer was a fraction or is too large."""
    if x.numel() > SHADOW_LIMIT:
        return None
    grid = torch.nonzero(torch.ones(tuple(x.shape), dtype=torch.bool))
    if isinstance(out, torch.Tensor):
        return grid if out.shape == grid.shape else None
    cols = tuple(grid.unbind(1)) if x.dim() else (grid.reshape(-1),)
    return cols if all(o.shape == c.shape for o, c in zip(out, cols, strict=False)) else None


def masked_select(values: Values, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    x, mask = args[0], args[1]
    shape = torch.broadcast_shapes(x.shape, mask.shape)
    return _meta((_count(values, mask, math.prod(shape)),), x.dtype)


def index_bool(values: Values, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    x, indices = args[0], list(args[1])
    new: list[Any] = []
    for idx in indices:
        if isinstance(idx, torch.Tensor) and idx.dtype in (torch.bool, torch.uint8):
            count = _count(values, idx)
            new.extend(_meta((count,), torch.int64) for _ in range(idx.dim()))
        else:
            new.append(idx)
    return func(x, new)


def unique(values: Values, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    name = func.__name__
    if name.startswith("unique_dim"):
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        shape = list(x.shape)
        uniq = _meta(shape, x.dtype)
        return uniq, _meta((x.shape[dim],), torch.int64), _meta((x.shape[dim],), torch.int64)
    return cuda_unique(func, args, kwargs, x.numel())


def _flag(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str) -> bool:
    return bool(args[index] if len(args) > index else kwargs.get(name, False))


def cuda_unique(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], count: int) -> Any:
    """The outputs of CUDA's ``unique`` / ``unique_consecutive`` over a flat input with ``count``
    distinct runs, storages as CUDA's kernel leaves them (ATen ``native/cuda/UniqueCub.cu``
    ``compute_unique``): the values in a storage of the input's length, resized down to
    ``count``; counts likewise when asked for (else an empty tensor); inverse indices the
    input's shape when asked for (else empty). A boolean input that is not consecutive
    keeps storages of two."""
    x = args[0]
    n = x.numel()
    name = func.__name__
    consecutive = name.startswith("unique_consecutive")
    if consecutive:  # unique_consecutive(self, return_inverse, return_counts, dim)
        inverse, counts = _flag(args, kwargs, 1, "return_inverse"), _flag(args, kwargs, 2, "return_counts")
    else:  # _unique2(self, sorted, return_inverse, return_counts) / _unique(self, sorted, return_inverse)
        inverse = _flag(args, kwargs, 2, "return_inverse")
        counts = name.startswith("_unique2") and _flag(args, kwargs, 3, "return_counts")
    room = 2 if x.dtype == torch.bool and not consecutive and n else n
    out = _meta((room,), x.dtype).resize_(count)
    inv = _meta(tuple(x.shape), torch.int64) if inverse else _meta((0,), torch.int64)
    if name.startswith("_unique2") or consecutive:
        cnt = _meta((room,), torch.int64).resize_(count) if counts else _meta((0,), torch.int64)
        return out, inv, cnt
    return out, inv


def repeat_interleave(values: Values, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    repeats = args[0]
    size = kwargs.get("output_size")
    if size is None:
        size = repeats.numel()
    return _meta((int(size),), torch.int64)


def repeat_interleave_self(values: Values, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """``x.repeat_interleave(repeats_tensor, dim, output_size=…)`` without the repeats' values:
    the size the caller states (else torch's own error: no size to give)."""
    x = args[0]
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    size = args[3] if len(args) > 3 else kwargs.get("output_size")
    if size is None:
        return func(*args, **kwargs)
    if dim is None:
        return _meta((int(size),), x.dtype)
    shape = list(x.shape)
    shape[dim] = int(size)
    return _meta(shape, x.dtype)


def bincount(values: Values, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    x = args[0]
    weights = args[1] if len(args) > 1 else kwargs.get("weights")
    minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
    bins = max(int(minlength), values.get_bound(x) or x.numel())
    dtype = torch.int64 if weights is None else (weights.dtype if weights.is_floating_point() else torch.float64)
    return _meta((bins,), dtype)


def uniform_counts(total: int, bins: int, skew: float) -> torch.Tensor:
    """``total`` items over ``bins`` classes under the routing rule (sums to ``total``)."""
    bins = max(bins, 1)
    first = min(total, math.ceil(skew * total / bins)) if skew > 1.0 else None
    counts = torch.zeros(bins, dtype=torch.int64)
    if first is not None and bins > 1:
        counts[0] = first
        rest, n = total - first, bins - 1
        counts[1:] = rest // n
        counts[1:1 + rest % n] += 1
    else:
        counts[:] = total // bins
        counts[: total % bins] += 1
    return counts


def rule_values(name: str, values: Values, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
    """Values of a rule's output where the rule determines them (else None)."""
    if name == "nonzero":
        return full_grid_values(args[0], out)
    if name == "bincount" and isinstance(out, torch.Tensor) and out.dtype == torch.int64:
        x = args[0]
        if values.get_bound(x) is not None and out.numel() <= SHADOW_LIMIT:
            return uniform_counts(x.numel(), out.numel(), values.routing_skew)
    return None


def known_masks(values: Values, rule: str, args: tuple[Any, ...]) -> bool:
    """Whether the boolean masks a rule counts all have values (its answer is then exact)."""
    if rule == "index_bool":
        masks = [i for i in args[1] if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)]
    elif rule == "masked_select":
        masks = [args[1]]
    else:
        return False
    return bool(masks) and all(values.cpu_view(m) is not None for m in masks)


def _has_bool_index(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])


RULES: dict[Any, tuple[str, Rule]] = {
    aten.nonzero.default: ("nonzero", nonzero),
    aten.argwhere.default: ("nonzero", nonzero),
    aten.nonzero_numpy.default: ("nonzero", nonzero_numpy),
    aten.where.default: ("nonzero", nonzero_numpy),
    aten.masked_select.default: ("masked_select", masked_select),
    aten._unique2.default: ("unique", unique),
    aten._unique.default: ("unique", unique),
    aten.unique_dim.default: ("unique", unique),
    aten.unique_consecutive.default: ("unique", unique),
    aten.repeat_interleave.Tensor: ("repeat_interleave", repeat_interleave),
    aten.repeat_interleave.self_Tensor: ("repeat_interleave", repeat_interleave_self),
    aten.bincount.default: ("bincount", bincount),
}
INDEX_OPS = frozenset({aten.index.Tensor, aten._unsafe_index.Tensor})
"""Ops that become data-dependent only with boolean indices (checked per call)."""


def nms(values: Values, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """``torchvision.ops.nms`` without box values: every box kept (an upper bound; detectors
    cap what they keep — ``post_nms_top_n``, ``detections_per_img`` — right after)."""
    return _meta((int(args[0].shape[0]),), torch.int64)


NAMED_RULES: dict[str, tuple[str, Rule]] = {"torchvision::nms": ("nms", nms)}
"""Rules for ops of libraries that may not be imported (matched by schema name)."""


def needs_rule(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, Rule] | None:
    rule = RULES.get(func)
    if rule is not None:
        return rule
    if func.namespace != "aten":
        return NAMED_RULES.get(func._schema.name)
    if func in INDEX_OPS and _has_bool_index(args, kwargs):
        return ("index_bool", index_bool)
    return None


NO_VALUE_OPS = frozenset({
    aten._local_scalar_dense.default, aten.equal.default, aten.item.default, aten.is_nonzero.default,
    aten.allclose.default,
})
"""Ops that return a Python value computed from tensor data."""
SKIP_OPS = frozenset({
    aten._assert_async.default, aten._assert_async.msg, aten._assert_scalar.default,
    aten.sym_constrain_range.default, aten.sym_constrain_range_for_size.default,
    aten._assert_tensor_metadata.default,
})
"""Runtime checks on values: skipped in a trace (they allocate nothing)."""


def symmetric_all_to_all(x: torch.Tensor, output_split_sizes: list[int] | None, input_split_sizes: list[int] | None,
                         group_name: str) -> torch.Tensor | None:
    """Rank ``r``'s output of ``all_to_all_single(x, output_split_sizes, input_split_sizes)``
    when every rank of the group holds ``x``: each sends ``r`` its ``r``-th chunk, so ``r``
    receives its own ``r``-th chunk once per rank. None when the stated output splits say
    otherwise (the script's ranks are not symmetric)."""
    from torch.distributed import distributed_c10d as c10d

    name: Any = getattr(c10d, "GroupName", str)(group_name)  # (a NewType of str where torch has it)
    pg = c10d._resolve_process_group(name)
    rank, size = pg.rank(), pg.size()
    rows = x.shape[0]
    splits = list(input_split_sizes) if input_split_sizes else [rows // size] * size
    if len(splits) != size or sum(splits) != rows:
        return None
    mine = x.split(splits)[rank]
    if output_split_sizes and list(output_split_sizes) != [mine.shape[0]] * size:
        return None
    return torch.cat([mine] * size)
