"""Vision-language models: how many tokens an image becomes, and the batch a step takes.

A Qwen2-VL / Qwen2.5-VL processor resizes each image so both sides are multiples of
``patch_size × merge_size`` (28 pixels) with the area inside ``[min_pixels, max_pixels]``
(``smart_resize``), cuts it into 14-pixel patches (the image repeated to
``temporal_patch_size`` frames: ``pixel_values`` is ``[patches, 3 · 2 · 14 · 14]``), and puts one
``<|image_pad|>`` token per 2 × 2 group of patches in the text, between ``<|vision_start|>``
and ``<|vision_end|>`` (``Qwen2_5_VLProcessor.__call__``). The patch count is transformers'
own (``Qwen2VLImageProcessor.get_number_of_image_patches``); the pixel bounds are the models'
``preprocessor_config.json`` (:data:`PROCESSORS`), not the class defaults.

The batch (:func:`inputs`): each sequence holds ``images`` images and then ``seq`` text tokens,
so a sequence is ``seq + images × (tokens per image + 2)`` long; token ids and the image grid
carry their values into the trace (the model reads them: where the image tokens sit, the
multimodal RoPE positions), the pixels do not.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from vramplan.errors import WorkloadError

from .spec import ModelSpec


@dataclass(frozen=True)
class Processor:
    min_pixels: int
    max_pixels: int
    source: str


_QWEN_SOURCE = ("Qwen/Qwen2.5-VL-*-Instruct preprocessor_config.json: min_pixels 3136, max_pixels 12845056 "
                "(transformers' class default is 1003520)")
PROCESSORS: dict[str, Processor] = {
    "qwen2_5_vl": Processor(3136, 12845056, _QWEN_SOURCE),
    "qwen2_vl": Processor(3136, 12845056, _QWEN_SOURCE.replace("Qwen2.5-VL", "Qwen2-VL")),
}


def is_vlm(spec: ModelSpec) -> bool:
    return spec.model_type in PROCESSORS


@dataclass(frozen=True)
class ImageTokens:
    width: int
    height: int
    """The size the processor resizes the image to."""
    patches: int
    """Rows of ``pixel_values`` for the image."""
    tokens: int
    """``<|image_pad|>`` tokens in the text (patches / merge²)."""


def _vision(spec: ModelSpec) -> Mapping[str, Any]:
    v = spec.config.get("vision_config")
    return v if isinstance(v, Mapping) else {}


def _patch(vision: Mapping[str, Any]) -> int:
    return int(vision.get("patch_size", vision.get("spatial_patch_size", 14)))


def no_images(spec: ModelSpec) -> WorkloadError:
    """The refusal of ``images`` for a model that takes none."""
    return WorkloadError(f"`images` applies to vision-language models; {spec.name} takes no images",
                         hint="drop `images`", field="images")


def _token_id(spec: ModelSpec, key: str) -> int:
    for where in (spec.config, spec.config.get("text_config") or {}):
        v = where.get(key) if isinstance(where, Mapping) else None
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    raise WorkloadError(f"{spec.name}: the config has no `{key}`", hint="check the config.json")


def image_tokens(spec: ModelSpec, width: int, height: int) -> ImageTokens:
    """What one ``width × height`` image becomes for ``spec``'s processor."""
    if not is_vlm(spec):
        raise no_images(spec)
    from .build import quiet
    from .hf_import import import_transformers

    vision = _vision(spec)
    patch = _patch(vision)
    merge = int(vision.get("spatial_merge_size", 2))
    proc = PROCESSORS[spec.model_type]
    with quiet():
        cls = import_transformers().Qwen2VLImageProcessor  # (the PIL variant without torchvision)
        smart_resize = importlib.import_module(cls.__module__).smart_resize
        h, w = smart_resize(height, width, factor=patch * merge, min_pixels=proc.min_pixels,
                            max_pixels=proc.max_pixels)
    patches = (h // patch) * (w // patch)
    return ImageTokens(width=w, height=h, patches=patches, tokens=patches // (merge * merge))


def inputs(spec: ModelSpec, *, batch: int, seq: int, images: int, width: int, height: int,
           device: str | torch.device = "meta", labels: bool = True,
           dtype: torch.dtype = torch.float32) -> tuple[dict[str, Any], list[tuple[torch.Tensor, torch.Tensor]]]:
    """(keyword arguments of the model's forward, (meta tensor, its values) pairs) for a batch
    of ``batch`` sequences of ``images`` images and ``seq`` text tokens each."""
    if images < 0:
        raise WorkloadError(f"`images` must be >= 0, got {images}", field="images")
    dev = torch.device(device)
    image_id = _token_id(spec, "image_token_id")
    start, end = _token_id(spec, "vision_start_token_id"), _token_id(spec, "vision_end_token_id")
    text_top = max(1, min(spec.vocab, start, end, image_id))  # text ids below the special tokens
    g = torch.Generator().manual_seed(0)
    rows = []
    one = image_tokens(spec, width, height) if images else None
    for _ in range(batch):
        row: list[torch.Tensor] = []
        for _ in range(images):
            assert one is not None
            row += [torch.tensor([start]), torch.full((one.tokens,), image_id), torch.tensor([end])]
        row.append(torch.randint(0, text_top, (seq,), generator=g))
        rows.append(torch.cat(row))
    ids = torch.stack(rows).to(torch.long)
    real = dev.type != "meta"  # (a measured run on a GPU: the values themselves)

    def carry(values: torch.Tensor) -> torch.Tensor:
        if real:
            return values.to(dev)
        meta = torch.empty(values.shape, dtype=values.dtype, device=dev)
        shadows.append((meta, values))
        return meta

    shadows: list[tuple[torch.Tensor, torch.Tensor]] = []
    out: dict[str, Any] = {"input_ids": carry(ids)}
    if images:
        assert one is not None
        vision = _vision(spec)
        patch = _patch(vision)
        temporal = int(vision.get("temporal_patch_size", 2))
        channels = int(vision.get("in_channels", vision.get("in_chans", 3)))
        n = batch * images
        shape = (n * one.patches, channels * temporal * patch * patch)
        out["pixel_values"] = torch.randn(shape, dtype=dtype, device=dev) if real else \
            torch.empty(shape, dtype=dtype, device=dev)
        out["image_grid_thw"] = carry(torch.tensor([[1, one.height // patch, one.width // patch]] * n))
    if labels:
        out["labels"] = torch.randint(0, text_top, tuple(ids.shape), dtype=torch.long, device=dev)
    return out, shadows


def describe(spec: ModelSpec, images: int, width: int, height: int, seq: int) -> str:
    """One line for the report: what the images became."""
    one = image_tokens(spec, width, height)
    total = seq + images * (one.tokens + 2)
    return (f"{images} image(s) of {width}x{height} per sequence, each resized to {one.width}x{one.height} by the "
            f"processor ({PROCESSORS[spec.model_type].source}): {one.patches:,} patches, {one.tokens:,} image tokens "
            f"+ 2 markers; sequence {total:,} tokens = {seq:,} text + {images} × {one.tokens + 2:,}")


__all__ = ["PROCESSORS", "ImageTokens", "describe", "image_tokens", "inputs", "is_vlm"]
