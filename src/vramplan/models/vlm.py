"""Vision-language models: how many tokens an image becomes, and the batch a step takes.

Four processor families (:data:`PROCESSORS`, keyed by the config's ``model_type``):

* **Qwen2-VL / Qwen2.5-VL** resize each image so both sides are multiples of
  ``patch_size × merge_size`` (28 pixels) with the area inside ``[min_pixels, max_pixels]``
  (``smart_resize``), cut it into 14-pixel patches (the image repeated to
  ``temporal_patch_size`` frames: ``pixel_values`` is ``[patches, 3 · 2 · 14 · 14]``), and put one
  ``<|image_pad|>`` token per 2 × 2 group of patches in the text, between ``<|vision_start|>``
  and ``<|vision_end|>`` (``Qwen2_5_VLProcessor.__call__``). The patch count is transformers'
  own (``Qwen2VLImageProcessor.get_number_of_image_patches``); the pixel bounds are the models'
  ``preprocessor_config.json``, not the class defaults.
* **Gemma 3** resizes every image to the vision tower's square (896 pixels in the released
  checkpoints; ``pixel_values`` ``[images, 3, 896, 896]``) and the model pools its patches to
  ``mm_tokens_per_image`` (256) soft tokens; the processor writes
  ``"\\n\\n<start_of_image>" + 256 × <image_soft_token> + "<end_of_image>\\n\\n"`` and returns
  ``token_type_ids`` (1 on the image tokens: their attention is bidirectional within an image)
  (``Gemma3Processor``; pan-and-scan crops, off by default, are not modelled). In transformers
  5.24: ``processing_gemma3.py:41-49`` (``image_seq_length`` 256, the expanded sequence),
  ``:29`` (``do_pan_and_scan`` False), ``modeling_gemma3.py:647-650`` (the tower's 64 × 64
  patches average-pooled to √256 = 16 per side). Catalog: ``gemma-3-4b``, ``gemma-3-27b``.
* **LLaVA** (1.5) resizes and centre-crops to the CLIP tower's square (336) and puts one
  ``<image>`` token per patch (576; the ``default`` feature strategy drops the CLS position)
  (``LlavaProcessor._get_number_of_features``).
* **Llama 3.2 Vision** (``mllama``) fits each image to the canvas of up to ``max_num_tiles`` (4)
  tiles of the tower's side (560) that keeps the most resolution (``get_optimal_tiled_canvas``,
  ``image_processing_pil_mllama.py:279``), pads the tiles to ``max_num_tiles``
  (``pixel_values`` ``[batch, images, 4, 3, 560, 560]``, ``:85-118``), names the canvas by its
  aspect-ratio id and mask (``:51-78``), and puts one ``<|image|>`` token in the text; the tower
  encodes every tile slot, ``(560 / 14)² + 1`` = 1,601 positions a tile with the class token
  (``modeling_mllama.py:148``), for the cross-attention layers, which the processor's
  cross-attention mask gates (``processing_mllama.py:27``, ``:75``). No catalog entry: no verbatim
  public copy of the Llama 3.2 Vision config.json was found (docs/research/vlm-configs.md).

Videos (Qwen2-VL / Qwen2.5-VL only: :func:`video_tokens`), as transformers 5.24's
``Qwen2VLVideoProcessor`` and ``Qwen2_5_VLProcessor`` make them:

* the frames given are all kept (``do_sample_frames`` is off by default,
  ``video_processing_qwen2_vl.py:130``; a caller samples them, e.g. qwen-vl-utils at 2 fps) and
  padded to a multiple of ``temporal_patch_size`` (2) by repeating the last frame (``patchify``,
  ``:286-289``): ``grid_t = ceil(frames / 2)``;
* every frame is resized by the same ``smart_resize`` as an image (``:262-268``, ``:44-70``) within
  the processor's ``size`` bounds; the Qwen2.5-VL checkpoints ship no
  ``video_preprocessor_config.json``, so ``AutoVideoProcessor`` reads ``preprocessor_config.json``
  (``video_processing_utils.py:349-368`` tries both names), whose ``min_pixels`` / ``max_pixels``
  become ``size`` (``:140-145``): frames take the images' bounds, 3136 … 12845056; the per-frame cap
  of qwen-vl-utils (``cap_pixels_per_frame``) is off unless asked (``:333-342``);
* ``pixel_values_videos`` is ``[grid_t · grid_h · grid_w, 3 · 2 · 14 · 14]`` per video (``:291-311``),
  ``video_grid_thw`` ``[grid_t, grid_h, grid_w]`` (``:376-382``; the patch count is
  ``get_num_of_video_patches``, ``:389-415``);
* the text holds ``<|vision_start|>`` + ``grid_t · grid_h · grid_w / merge²`` ``<|video_pad|>`` +
  ``<|vision_end|>`` (``Qwen2_5_VLProcessor.replace_video_token``, ``processing_qwen2_5_vl.py:56-59``);
* ``second_per_grid_ts`` is ``temporal_patch_size / fps`` per video (``:129-145``); it only spaces the
  temporal RoPE positions (``modeling_qwen2_5_vl.py:1031-1036``), taken here at qwen-vl-utils' 2 fps
  (1.0 s per temporal patch);
* the processor also returns ``mm_token_type_ids`` (0 text, 1 image, 2 video;
  ``processing_qwen2_5_vl.py:33``), from which the model computes the multimodal RoPE positions
  (``compute_3d_position_ids``, ``modeling_qwen2_5_vl.py:1136-1150``). The batch here leaves it
  out, for images as for videos: ``get_rope_index`` builds its position offsets with
  ``torch.tensor`` of 0-d results (``:1047-1048``) whose values the trace does not follow, so the
  model takes its fallback positions (an ``arange`` expanded to ``[3, batch, sequence]``,
  ``:801-804``, where the processor's batch makes a full int64 table of that shape: 24 bytes a
  token, against the activations' kilobytes a token). The real runs the tests compare against are
  made without it too.

The batch (:func:`inputs`): each sequence holds ``images`` images, ``videos`` videos and then
``seq`` text tokens, so a sequence is ``seq + images × (tokens per image + markers) + videos ×
(tokens per video + markers)`` long; token ids, the image and video grids and the token types
carry their values into the trace (the model reads them: where the image tokens sit, the
multimodal RoPE positions, the image blocks of the mask), the pixels do not.
"""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vramplan.errors import WorkloadError

from ._params_vlm import QWEN_VL_TEXT, qwen_text_config
from .spec import ModelSpec

if TYPE_CHECKING:  # (torch is imported where a batch is made: the sizing rules need none)
    import torch


@dataclass(frozen=True)
class Processor:
    family: str
    """qwen (dynamic resize) | gemma3 | llava (resized to the tower's square)."""
    source: str
    before: tuple[str, ...] = ()
    """Config keys of the marker tokens before an image's tokens ('' = a text token: ``\\n\\n``)."""
    after: tuple[str, ...] = ()
    min_pixels: int = 0
    max_pixels: int = 0

    @property
    def markers(self) -> int:
        return len(self.before) + len(self.after)


_QWEN_SOURCE = ("Qwen/Qwen2.5-VL-*-Instruct preprocessor_config.json: min_pixels 3136, max_pixels 12845056 "
                "(transformers' class default is 1003520)")


def _qwen(source: str) -> Processor:
    return Processor("qwen", source, before=("vision_start_token_id",), after=("vision_end_token_id",),
                     min_pixels=3136, max_pixels=12845056)


PROCESSORS: dict[str, Processor] = {
    "qwen2_5_vl": _qwen(_QWEN_SOURCE),
    "qwen2_vl": _qwen(_QWEN_SOURCE.replace("Qwen2.5-VL", "Qwen2-VL")),
    "gemma3": Processor(
        "gemma3", "Gemma3Processor: every image resized to the vision tower's square, pooled to mm_tokens_per_image "
        "soft tokens between \\n\\n<start_of_image> and <end_of_image>\\n\\n; pan-and-scan (off by default) not "
        "modelled", before=("", "boi_token_index"), after=("eoi_token_index", "")),
    "llava": Processor(
        "llava", "LlavaProcessor: resized and centre-cropped to the CLIP tower's square, one <image> token per "
        "patch (the CLS position dropped by the 'default' feature strategy)"),
    "mllama": Processor(
        "mllama", "MllamaProcessor: the image fitted to a canvas of up to max_num_tiles tiles of the tower's size "
        "(get_optimal_tiled_canvas), one <|image|> token in the text; the tower encodes every tile slot (padded to "
        "max_num_tiles) and the cross-attention layers attend to them"),
}


def is_vlm(spec: ModelSpec) -> bool:
    return spec.model_type in PROCESSORS


@dataclass(frozen=True)
class ImageTokens:
    width: int
    height: int
    """The size the processor resizes the image to."""
    patches: int
    """Patches the vision tower sees (Qwen: rows of ``pixel_values``)."""
    tokens: int
    """Image tokens in the text (Qwen: patches / merge²; Gemma 3: ``mm_tokens_per_image``)."""
    markers: int
    """Marker tokens around each image's tokens."""


def _vision(spec: ModelSpec) -> Mapping[str, Any]:
    v = spec.config.get("vision_config")
    return v if isinstance(v, Mapping) else {}


def _patch(vision: Mapping[str, Any]) -> int:
    return int(vision.get("patch_size", vision.get("spatial_patch_size", 14)))


def _square(spec: ModelSpec) -> int:
    """The vision tower's input size (Gemma 3, LLaVA): the config's, else the class default."""
    size = _vision(spec).get("image_size")
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    return int(_hf_config(spec).vision_config.image_size)


def patch_size(spec: ModelSpec) -> int:
    """The vision tower's patch side in pixels."""
    return _patch(_vision(spec))


def _channels(spec: ModelSpec) -> int:
    vision = _vision(spec)
    return int(vision.get("in_channels", vision.get("in_chans", vision.get("num_channels", 3))))


def pixel_shape(spec: ModelSpec, *, images: int, patches: int, height: int, width: int) -> tuple[int, ...]:
    """``pixel_values``' shape for ``images`` images of ``height × width`` (``patches`` in all):
    Qwen-VL's rows of flattened patches (each ``temporal_patch_size`` frames deep), the others'
    ``[images, channels, height, width]``."""
    if PROCESSORS[spec.model_type].family == "qwen":
        temporal = int(_vision(spec).get("temporal_patch_size", 2))
        return (patches, _channels(spec) * temporal * patch_size(spec) ** 2)
    return (images, _channels(spec), height, width)


def _hf_config(spec: ModelSpec) -> Any:
    from .build import _hf_config as make
    from .hf_import import import_transformers

    return make(import_transformers(), spec)


def no_images(spec: ModelSpec) -> WorkloadError:
    """The refusal of ``images`` for a model that takes none."""
    return WorkloadError(f"`images` applies to vision-language models; {spec.name} takes no images",
                         hint="drop `images`", field="images")


def _token_id(spec: ModelSpec, key: str) -> int:
    keys = (key, key.replace("_index", "_id"), key.replace("_id", "_index"))
    for where in (spec.config, spec.config.get("text_config") or {}):
        for k in keys:
            v = where.get(k) if isinstance(where, Mapping) else None
            if isinstance(v, int) and not isinstance(v, bool):
                return v
    try:  # a key the Hub config leaves to the class default (Gemma 3, LLaVA)
        config = _hf_config(spec)
    except Exception:  # noqa: BLE001 (no transformers, or a config it refuses: the error below)
        config = None
    for k in keys:
        v = getattr(config, k, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    raise WorkloadError(f"{spec.name}: the config has no `{key}`", hint="check the config.json")


@contextlib.contextmanager
def _image_processing(spec: ModelSpec) -> Iterator[None]:
    """transformers' image processors (their sizing functions) import Pillow: without it, one line."""
    try:
        yield
    except ImportError as e:
        raise WorkloadError(f"sizing {spec.name}'s images uses transformers' image processing, which does not import "
                            f"here ({str(e).splitlines()[0][:120]})",
                            hint="pip install pillow (the models extra, 'vramplan[models]', brings it)") from None


def qwen_resize(height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) Qwen-VL's image processor resizes an image to: each side rounded to the
    nearest multiple of ``factor`` (Python's ``round``: halves to even); where that area exceeds
    ``max_pixels`` both sides are scaled by ``sqrt(area / max_pixels)`` and floored to a multiple
    (at least one ``factor``), where it is under ``min_pixels`` scaled up by ``sqrt(min_pixels /
    area)`` and ceiled; aspect ratios over 200 are refused. The rule of transformers 5.24.0's
    ``smart_resize`` (``models/qwen2_vl/image_processing_pil_qwen2_vl.py:58-84``), in pure Python so
    that the analytic method needs no image processing (tests/test_vlm.py checks it against the
    processor and against ``smart_resize`` itself)."""
    if min(height, width) < 1:
        raise WorkloadError(f"an image must be at least 1 pixel a side, got {width}x{height}", field="image_size")
    if max(height, width) / min(height, width) > 200:
        raise WorkloadError(f"Qwen-VL's processor refuses an aspect ratio over 200 ({width}x{height})",
                            field="image_size")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def image_tokens(spec: ModelSpec, width: int, height: int, *, min_pixels: int | None = None,
                 max_pixels: int | None = None) -> ImageTokens:
    """What one ``width × height`` image becomes for ``spec``'s processor (Qwen-VL: within
    ``min_pixels`` … ``max_pixels``, default the checkpoints')."""
    if not is_vlm(spec):
        raise no_images(spec)
    proc = PROCESSORS[spec.model_type]
    vision = _vision(spec)
    patch = _patch(vision)
    if proc.family == "qwen":
        merge = int(vision.get("spatial_merge_size", 2))
        h, w = qwen_resize(height, width, factor=patch * merge,
                           min_pixels=proc.min_pixels if min_pixels is None else min_pixels,
                           max_pixels=proc.max_pixels if max_pixels is None else max_pixels)
        patches = (h // patch) * (w // patch)
        return ImageTokens(width=w, height=h, patches=patches, tokens=patches // (merge * merge),
                           markers=proc.markers)
    side = _square(spec)
    patches = (side // patch) ** 2
    if proc.family == "mllama":
        th, tw = _tiles(spec, width, height)
        slots = _max_tiles(spec)  # (every slot is encoded: pixel_values are padded to max_num_tiles)
        return ImageTokens(width=tw * side, height=th * side, patches=slots * (patches + 1), tokens=1, markers=0)
    if proc.family == "gemma3":
        tokens = int(spec.config.get("mm_tokens_per_image") or _hf_config(spec).mm_tokens_per_image)
    else:  # llava: the CLS position is dropped by the "default" strategy, kept by "full"
        strategy = spec.config.get("vision_feature_select_strategy", "default")
        tokens = patches + (0 if strategy == "default" else 1)
    return ImageTokens(width=side, height=side, patches=patches, tokens=tokens, markers=proc.markers)


@dataclass(frozen=True)
class VideoTokens:
    frames: int
    """Frames the vision tower sees (the given ones, padded to a multiple of ``temporal_patch_size``)."""
    width: int
    height: int
    """The size the processor resizes every frame to."""
    grid: tuple[int, int, int]
    """``video_grid_thw``: (temporal patches, patch rows, patch columns)."""
    patches: int
    """Rows of ``pixel_values_videos``."""
    tokens: int
    """``<|video_pad|>`` tokens in the text (patches / merge²)."""
    markers: int
    """``<|vision_start|>`` and ``<|vision_end|>``."""


def no_videos(spec: ModelSpec) -> WorkloadError:
    """The refusal of ``videos`` for a model whose processor takes none (modelled: Qwen-VL)."""
    what = "takes images only" if is_vlm(spec) else "takes no images or videos"
    return WorkloadError(f"`videos` applies to Qwen2-VL / Qwen2.5-VL (their video processor); {spec.name} {what}",
                         hint="drop `videos`", field="videos")


def video_tokens(spec: ModelSpec, width: int, height: int, frames: int) -> VideoTokens:
    """What one video of ``frames`` frames of ``width × height`` becomes for a Qwen-VL processor."""
    if not is_vlm(spec) or PROCESSORS[spec.model_type].family != "qwen":
        raise no_videos(spec)
    if frames < 1:
        raise WorkloadError(f"`video_frames` must be >= 1, got {frames}", field="video_frames")
    one = image_tokens(spec, width, height)  # (the same smart_resize and bounds)
    vision = _vision(spec)
    temporal = int(vision.get("temporal_patch_size", 2))
    merge = int(vision.get("spatial_merge_size", 2))
    patch = _patch(vision)
    grid = (-(-frames // temporal), one.height // patch, one.width // patch)
    patches = grid[0] * grid[1] * grid[2]
    return VideoTokens(frames=grid[0] * temporal, width=one.width, height=one.height, grid=grid, patches=patches,
                       tokens=patches // (merge * merge), markers=one.markers)


def _max_tiles(spec: ModelSpec) -> int:
    v = _vision(spec).get("max_num_tiles")
    return int(v) if isinstance(v, int) and v > 0 else int(_hf_config(spec).vision_config.max_num_tiles)


def _tiles(spec: ModelSpec, width: int, height: int) -> tuple[int, int]:
    """(tiles high, tiles wide) of Llama 3.2 Vision's canvas for a ``width × height`` image
    (transformers' ``get_optimal_tiled_canvas``)."""
    from .build import quiet
    from .hf_import import import_transformers

    side = _square(spec)
    with quiet(), _image_processing(spec):
        import_transformers()
        mod = importlib.import_module("transformers.models.mllama.image_processing_pil_mllama")
        h, w = mod.get_optimal_tiled_canvas(image_height=height, image_width=width,
                                            max_image_tiles=_max_tiles(spec), tile_size=side)
    return h // side, w // side


def _mllama_extras(spec: ModelSpec, ids: torch.Tensor, images: int, width: int, height: int,
                   image_id: int) -> dict[str, torch.Tensor]:
    """Llama 3.2 Vision's aspect-ratio ids and mask and its cross-attention mask, as
    ``MllamaImageProcessor`` and ``MllamaProcessor`` make them (transformers' own functions)."""
    import torch

    from .build import quiet

    slots = _max_tiles(spec)
    th, tw = _tiles(spec, width, height)
    batch, length = ids.shape
    with quiet():
        image = importlib.import_module("transformers.models.mllama.image_processing_pil_mllama")
        text = importlib.import_module("transformers.models.mllama.processing_mllama")
        ratios = [[(th, tw)] * images for _ in range(batch)]
        sparse = [text.get_cross_attention_token_mask(row.tolist(), image_id) for row in ids]
        cross = text.convert_sparse_cross_attention_mask_to_dense(sparse, [[th * tw] * images] * batch, slots, length)
        return {"aspect_ratio_ids": torch.from_numpy(image.convert_aspect_ratios_to_ids_np(ratios, slots)).long(),
                "aspect_ratio_mask": torch.from_numpy(image.build_aspect_ratio_mask_np(ratios, slots)).long(),
                "cross_attention_mask": torch.from_numpy(cross).long()}


def text_spec(spec: ModelSpec) -> ModelSpec:
    """The language model alone (its KV cache and forward, as an engine sizes them), named as
    ``spec``; its parameter count is the language model's."""
    from .normalize import spec_from_config, text_defaults

    if not is_vlm(spec):
        return spec
    text = spec.config.get("text_config")
    config: dict[str, Any]
    if spec.model_type in QWEN_VL_TEXT:
        config = qwen_text_config(spec.config)
    elif isinstance(text, Mapping):
        config = dict(text_defaults(text))
        if "tie_word_embeddings" in spec.config:  # (else the language model class's default)
            config["tie_word_embeddings"] = spec.config["tie_word_embeddings"]
    else:
        raise WorkloadError(f"{spec.name}: the config has no text_config", hint="check the config.json")
    config["architectures"] = []
    return spec_from_config(config, name=spec.name, source=spec.source, hub_id=spec.hub_id,
                            origin=f"{spec.name} (language model)")


def inputs(spec: ModelSpec, *, batch: int, seq: int, images: int, width: int, height: int,
           device: str | torch.device = "meta", labels: bool = True, dtype: torch.dtype | None = None,
           videos: int = 0, frames: int = 0) -> tuple[dict[str, Any], list[tuple[torch.Tensor, torch.Tensor]]]:
    """(keyword arguments of the model's forward, (meta tensor, its values) pairs) for a batch
    of ``batch`` sequences of ``images`` images, ``videos`` videos of ``frames`` frames (Qwen-VL;
    frames of the images' ``width × height``) and ``seq`` text tokens each (floats in ``dtype``,
    default float32)."""
    import torch

    dtype = dtype or torch.float32
    if images < 0:
        raise WorkloadError(f"`images` must be >= 0, got {images}", field="images")
    if videos < 0:
        raise WorkloadError(f"`videos` must be >= 0, got {videos}", field="videos")
    if not is_vlm(spec):
        raise no_images(spec) if images or not videos else no_videos(spec)
    proc = PROCESSORS[spec.model_type]
    dev = torch.device(device)
    image_id = _token_id(spec, "image_token_id")
    before = [_token_id(spec, k) if k else -1 for k in proc.before]
    after = [_token_id(spec, k) if k else -1 for k in proc.after]
    text_top = max(1, min([spec.vocab, image_id, *(t for t in before + after if t >= 0)]))  # below the specials
    g = torch.Generator().manual_seed(0)

    def marks(ids: list[int]) -> torch.Tensor:  # -1: a text token (Gemma 3's "\n\n")
        return torch.tensor([t if t >= 0 else int(torch.randint(0, text_top, (), generator=g)) for t in ids],
                            dtype=torch.long)

    one = image_tokens(spec, width, height) if images else None
    clip = video_tokens(spec, width, height, frames) if videos else None
    video_id = _token_id(spec, "video_token_id") if videos else -1
    items = [(image_id, 1, one.tokens) for _ in range(images)] if one else []
    items += [(video_id, 2, clip.tokens) for _ in range(videos)] if clip else []
    rows, types = [], []
    for _ in range(batch):
        row: list[torch.Tensor] = []
        kind: list[torch.Tensor] = []
        for token, modality, count in items:  # (each item: its markers around its tokens)
            row += [marks(before), torch.full((count,), token), marks(after)]
            kind += [torch.zeros(len(before)), torch.full((count,), float(modality)), torch.zeros(len(after))]
        row.append(torch.randint(0, text_top, (seq,), generator=g))
        kind.append(torch.zeros(seq))
        rows.append(torch.cat(row))
        types.append(torch.cat(kind))
    ids = torch.stack(rows).to(torch.long)
    real = dev.type != "meta"  # (a measured run on a GPU: the values themselves)

    def carry(values: torch.Tensor) -> torch.Tensor:
        if real:
            return values.to(dev)
        meta = torch.empty(values.shape, dtype=values.dtype, device=dev)
        shadows.append((meta, values))
        return meta

    def floats(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, dtype=dtype, device=dev) if real else torch.empty(shape, dtype=dtype, device=dev)

    shadows: list[tuple[torch.Tensor, torch.Tensor]] = []
    # the processor's attention mask (all ones: no padding) comes with every batch
    out: dict[str, Any] = {"input_ids": carry(ids), "attention_mask": carry(torch.ones_like(ids))}
    if one is not None:
        patch = patch_size(spec)
        n = batch * images
        if proc.family == "mllama":
            side = _square(spec)
            shape: tuple[int, ...] = (batch, images, _max_tiles(spec), _channels(spec), side, side)
        else:
            shape = pixel_shape(spec, images=n, patches=n * one.patches, height=one.height, width=one.width)
        out["pixel_values"] = floats(shape)
        if proc.family == "qwen":
            out["image_grid_thw"] = carry(torch.tensor([[1, one.height // patch, one.width // patch]] * n))
        if proc.family == "mllama":
            for k, v in _mllama_extras(spec, ids, images, width, height, image_id).items():
                out[k] = carry(v)
    if clip is not None:
        n = batch * videos
        out["pixel_values_videos"] = floats(pixel_shape(spec, images=n, patches=n * clip.patches, height=clip.height,
                                                        width=clip.width))
        out["video_grid_thw"] = carry(torch.tensor([list(clip.grid)] * n))
        if spec.model_type == "qwen2_5_vl":  # (Qwen2-VL's positions take no time scale)
            out["second_per_grid_ts"] = carry(torch.full((n,), SECONDS_PER_GRID))
    if proc.family == "gemma3":  # the processor returns them with every batch
        out["token_type_ids"] = carry(torch.stack(types).to(torch.long))
    if labels:
        out["labels"] = torch.randint(0, text_top, tuple(ids.shape), dtype=torch.long, device=dev)
    return out, shadows


SECONDS_PER_GRID = 1.0
"""``second_per_grid_ts`` of a video: ``temporal_patch_size / fps`` (``Qwen2_5_VLProcessor.
_process_videos``) at qwen-vl-utils' default sampling of 2 frames per second. It spaces the
temporal RoPE positions only (no memory)."""


def describe(spec: ModelSpec, images: int, width: int, height: int, seq: int, videos: int = 0,
             frames: int = 0) -> str:
    """One line for the report: what the images (and videos) became."""
    parts, total = [], seq
    if images:
        one = image_tokens(spec, width, height)
        total += images * (one.tokens + one.markers)
        parts.append(f"{images} image(s) of {width}x{height} per sequence, each resized to {one.width}x{one.height} "
                     f"by the processor ({PROCESSORS[spec.model_type].source}): {one.patches:,} patches, "
                     f"{one.tokens:,} image tokens + {one.markers} markers")
    if videos:
        clip = video_tokens(spec, width, height, frames)
        total += videos * (clip.tokens + clip.markers)
        t, h, w = clip.grid
        parts.append(f"{videos} video(s) of {frames} frames of {width}x{height} per sequence, each resized to "
                     f"{clip.width}x{clip.height} by the video processor (the images' pixel bounds), "
                     f"{clip.frames} frames in {t} temporal patches: video_grid_thw [{t}, {h}, {w}], "
                     f"{clip.patches:,} patches, {clip.tokens:,} video tokens + {clip.markers} markers")
    items = [f"{images} × {one.tokens + one.markers:,}"] if images else []
    items += [f"{videos} × {clip.tokens + clip.markers:,}"] if videos else []
    return "; ".join(parts) + f"; sequence {total:,} tokens = {seq:,} text + " + " + ".join(items)


__all__ = ["PROCESSORS", "ImageTokens", "VideoTokens", "describe", "image_tokens", "inputs", "is_vlm", "patch_size",
           "pixel_shape", "text_spec", "video_tokens"]
