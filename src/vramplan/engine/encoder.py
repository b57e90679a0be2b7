"""A vision-language model's vision tower as a serving engine loads and profiles it: its
weights (the tower, Qwen-VL's merger, Gemma 3's and LLaVA's projector) and the allocated peak of
encoding the profile run's dummy items (:class:`vramplan.pools.mm.MmProfile`), traced.

The encode is traced in the serving dtype through transformers' ``get_image_features`` on the
GPU's SDPA kernels (flash / memory-efficient: no attention matrix), for one item of at most
4,096 patches, and scaled to the profile's patches: the tower's activations grow linearly in
patches (windowed and per-frame attention, no patch-squared term; ``tests/test_vlm_serving.py``
checks the scaling against a direct trace). transformers' tower stands in for vLLM's own
(same layers and shapes; vLLM's attention runs its varlen kernels). Under tensor parallelism
the weights are divided by the TP size (vLLM 0.10.1.1 shards the tower's linears) and the
encode's activations are not (an approximation: the sharded heads and MLP shrink some).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from vramplan.models.spec import ModelSpec
from vramplan.pools.mm import PIXEL_BYTES, Encoder, MmProfile

if TYPE_CHECKING:
    from vramplan.hardware.gpu import GPU

TRACED_PATCHES = 4096
"""The most patches of the one item traced (64 × 64 for Qwen-VL; Gemma 3's 896-pixel image)."""
PROJECTORS = ("multi_modal_projector",)
"""Gemma 3's and LLaVA's projector into the language model (Qwen-VL's merger is in ``visual``)."""


def encoder(spec: ModelSpec, prof: MmProfile | None, *, dtype: str, tp: int, gpu: GPU | None,
            out_hidden: int) -> Encoder:
    """The tower's weights on one rank and, with a profile, its encode's peak and held outputs."""
    vision_params, traced = _trace(spec, prof, dtype, gpu.key if gpu is not None else None)
    weights = vision_params * _bytes(dtype) // tp
    if prof is None:
        return Encoder(weights=weights, profile=None)
    act, patches = traced
    peak = math.ceil(act * prof.patches / patches) + prof.pixel_bytes
    return Encoder(weights=weights, profile=prof, peak=peak, outputs=(prof.held_tokens or prof.tokens) * out_hidden * _bytes(dtype),
                   method=f"trace of {patches:,} patches, scaled to {prof.patches:,}")


def _bytes(dtype: str) -> int:
    return 4 if dtype == "fp32" else 2


def traced_grid(prof: MmProfile) -> tuple[int, int, int]:
    """The one item traced: the profile's grid cut to at most :data:`TRACED_PATCHES` patches
    (sides kept to whole 8-patch windows, the temporal patches to one)."""
    _, h, w = prof.grid
    side = int(math.isqrt(TRACED_PATCHES))
    return 1, min(h, side), min(w, side)


_CACHE: dict[tuple[object, ...], tuple[int, tuple[int, int]]] = {}


def _trace_cached(spec: ModelSpec, grid: tuple[int, int, int] | None, pixels: tuple[int, ...] | None, dtype: str,
                  gpu: str | None) -> tuple[int, tuple[int, int]]:
    """(vision parameters, (the encode's allocated peak above the weights, patches traced)),
    memoised on the model and the inputs (searches repeat them)."""
    key = (spec.name, spec.source, spec.hub_id, grid, pixels, dtype, gpu)
    if key not in _CACHE:
        if len(_CACHE) > 64:
            _CACHE.clear()
        _CACHE[key] = _run(spec, grid, pixels, dtype, gpu)
    return _CACHE[key]


def _run(spec: ModelSpec, grid: tuple[int, int, int] | None, pixels: tuple[int, ...] | None, dtype: str,
         gpu: str | None) -> tuple[int, tuple[int, int]]:
    import torch
    from torch import nn

    from vramplan.hardware.catalog import get_gpu
    from vramplan.models import vlm
    from vramplan.models.build import build_model
    from vramplan.trace.features import VISION_TOWERS
    from vramplan.trace.run import TraceOptions, trace_model
    from vramplan.workload import Attention, Precision, Task, Workload

    from .device import profile

    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16 if dtype == "bf16" else torch.float16

    built = build_model(spec, task="infer", attention="sdpa", device="meta", dtype=torch_dtype).model
    assert isinstance(built, nn.Module)
    vision = {id(p): p.numel() for n, m in built.named_modules()  # (Gemma 3's tower holds a vision_model)
              if n.rsplit(".", 1)[-1] in (*VISION_TOWERS, *PROJECTORS) for p in m.parameters()}
    params = sum(vision.values())
    if grid is None or pixels is None:
        return params, (0, 1)

    class Encode(nn.Module):
        """The model's ``get_image_features`` as a module (what the engine's encode calls)."""

        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, **kw: Any) -> Any:
            return getattr(self.model, "get_image_features")(**kw)  # noqa: B009 (a Module attribute: typed as Tensor | Module)

    family = vlm.PROCESSORS[spec.model_type].family
    kw: dict[str, Any] = {"pixel_values": torch.empty(pixels, dtype=torch_dtype, device="meta")}
    if family == "qwen":
        kw["image_grid_thw"] = torch.tensor([list(grid)])
    w = Workload(task=Task.INFER, batch=1, precision=Precision(dtype), attention=Attention.SDPA)
    dev = profile(get_gpu(gpu) if gpu else None, w)
    # (the model built above, on meta: the trace takes a copy)
    r = trace_model(Encode(built), kw, workload=w, device=dev, iterations=1, options=TraceOptions(workspaces=False))
    b = r.breakdown_at_peak
    patches = grid[0] * grid[1] * grid[2] if family == "qwen" else vlm.image_tokens(spec, 1, 1).patches
    return params, (r.peak_allocated - b.weights, patches)


def _trace(spec: ModelSpec, prof: MmProfile | None, dtype: str, gpu: str | None) -> tuple[int, tuple[int, int]]:
    if prof is None:
        return _trace_cached(spec, None, None, dtype, gpu)
    from vramplan.models import vlm

    if vlm.PROCESSORS[spec.model_type].family == "qwen":
        grid = traced_grid(prof)
        width = prof.pixel_values[1]
        return _trace_cached(spec, grid, (grid[0] * grid[1] * grid[2], width), dtype, gpu)
    one = (1, *prof.pixel_values[1:])
    return _trace_cached(spec, (1, 1, 1), one, dtype, gpu)


__all__ = ["PIXEL_BYTES", "TRACED_PATCHES", "encoder", "traced_grid"]
