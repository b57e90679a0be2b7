"""Build a catalog model as a real ``nn.Module`` (on ``meta`` by default) and make its inputs.

``build_model`` instantiates the transformers / diffusers class from the spec's config with
``from_config`` — never a download — under ``torch.device(device)``. Use it to trace the real
forward/backward on fake tensors, or to count parameters exactly.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from vramplan._dataclass import dataclass
from vramplan.errors import ConfigError, TraceError, WorkloadError
from vramplan.workload import Task, as_enum

from .arch import (
    BASE,
    CAUSAL_LM,
    DENOISE,
    HEADS,
    IMAGE_CLS,
    IMAGE_TEXT,
    MASKED_LM,
    SEQ_CLS,
    arch_of,
    check_head,
    default_head,
    head_from_architectures,
)
from .hf_import import import_transformers
from .spec import Family, ModelSpec

_EXTRA_HINT = "pip install 'vramplan[models]' adds model tracing; --method analytic works without it"

_ATTENTION = {"eager": "eager", "sdpa": "sdpa", "flash": "flash_attention_2"}
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
# Keys of a published config.json that must not reach ``from_config``: remote code we never
# run, and the checkpoint's weight quantisation (vramplan models quantisation itself).
_DROP_KEYS = ("auto_map", "quantization_config")
_UNET_TEXT_TOKENS = 77
"""CLIP text encoder length that Stable Diffusion's cross-attention attends to."""


def resolve_head(spec: ModelSpec, head: str | None) -> str:
    arch = arch_of(spec.config)
    if arch is None:
        if head is not None and head not in HEADS:
            raise TraceError(f"unknown head '{head}'", hint=f"choose one of {', '.join(HEADS)}")
        return head or head_from_architectures(spec.config) or BASE
    if head is None:
        return default_head(spec.config, arch)
    try:
        return check_head(head, arch, spec.name)
    except ConfigError as e:  # at build time an unsupported head is a trace error
        raise TraceError(e.message, hint=e.hint) from None


def build_model(
    spec: ModelSpec,
    *,
    task: Task | str = Task.TRAIN,
    attention: str = "sdpa",
    device: str | torch.device = "meta",
    dtype: torch.dtype | str | None = None,
    head: str | None = None,
) -> nn.Module:
    """The spec's model with ``head`` on top, built from its config under ``torch.device(device)``.

    ``dtype=None`` keeps the checkpoint's dtype (``spec.dtype``), as transformers 5 does; pass
    ``torch.float32`` for fp32 master weights. ``attention`` is eager | sdpa | flash (or any
    transformers ``attn_implementation``); an architecture without an SDPA path in this
    transformers (Gemma 2) is built eager when sdpa is asked, as transformers does —
    :func:`attention_used` tells. The module is in train mode for task=train, else eval.
    """
    task = as_enum(Task, task, "task")
    chosen = resolve_head(spec, head)
    torch_dtype = _torch_dtype(dtype if dtype is not None else spec.dtype)
    with torch.device(device):
        if chosen == DENOISE:
            model = _build_unet(spec, attention, torch_dtype)
        else:
            model = _build_transformers(spec, chosen, attention, torch_dtype)
    model.train(task is Task.TRAIN)
    return model


def _build_transformers(spec: ModelSpec, head: str, attention: str, dtype: torch.dtype) -> nn.Module:
    try:
        transformers = import_transformers()
    except ImportError:  # a plain `pip install vramplan` without the models extra
        raise TraceError(f"building {spec.name} needs transformers, which is not installed",
                         hint=_EXTRA_HINT if spec.family is not Family.OTHER
                         else "pip install 'vramplan[models]' to trace it") from None

    model_type = spec.config.get("model_type")
    try:
        config = _hf_config(transformers, spec)
    except (ValueError, KeyError) as e:
        raise TraceError(
            f"{spec.name}: transformers {transformers.__version__} cannot build model_type "
            f"'{model_type}' ({_first_line(e)})",
            hint="pass your own nn.Module to `vramplan trace`",
        ) from None
    except Exception as e:  # transformers' own config validation (huggingface_hub strict dataclasses)
        raise ConfigError(f"{spec.name}: transformers rejects this config ({type(e).__name__}: {_first_line(e)})",
                          hint="fix the config.json") from None
    if head == SEQ_CLS and getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = 0  # decoders refuse batch > 1 without one; no effect on memory
    auto = {
        CAUSAL_LM: transformers.AutoModelForCausalLM,
        MASKED_LM: transformers.AutoModelForMaskedLM,
        SEQ_CLS: transformers.AutoModelForSequenceClassification,
        IMAGE_CLS: transformers.AutoModelForImageClassification,
        IMAGE_TEXT: transformers.AutoModelForImageTextToText,
        BASE: transformers.AutoModel,
    }[head]
    kwargs: dict[str, Any] = {"dtype": dtype}
    if _has_attention(spec):
        kwargs["attn_implementation"] = _ATTENTION.get(attention, attention)
    try:
        return _from_config(auto, config, kwargs)
    except (ValueError, ImportError, AssertionError, TypeError, KeyError, AttributeError, IndexError) as e:
        unsupported = "does not support" in str(e)
        if kwargs.get("attn_implementation") == "sdpa" and unsupported:
            # No SDPA path for this architecture (Gemma 2): transformers itself runs eager.
            # attention_used(model) reports it.
            return _from_config(auto, config, {**kwargs, "attn_implementation": "eager"})
        if "attn_implementation" in kwargs and (unsupported or "flash" in str(e).lower()):
            raise TraceError(
                f"{spec.name}: attention '{attention}' is not available here ({_first_line(e)})",
                hint="use `attention=sdpa` (vramplan emulates the flash kernels' memory)",
            ) from None
        raise TraceError(f"{spec.name}: cannot build {head} model ({type(e).__name__}: {_first_line(e)})",
                         hint="check the config.json values, or use `method=analytic`") from None


def import_code(spec: ModelSpec) -> None:
    """Import what a first :func:`build_model` of ``spec`` imports (transformers and the model's
    modeling file), building nothing, so that the first build is timed as a build. Errors
    are left to the build (nothing is raised here)."""
    try:
        if resolve_head(spec, None) == DENOISE:
            return
        transformers = import_transformers()
        transformers.AutoModel._model_mapping[type(_hf_config(transformers, spec))]  # noqa: B018 (imports the modeling file)
    except Exception:  # noqa: BLE001 (the build reports it)
        pass


def _hf_config(transformers: Any, spec: ModelSpec) -> Any:
    """transformers' config object of ``spec``."""
    # a deep copy: transformers edits nested entries in place (it adds rope_theta to rope_scaling),
    # which changed the catalog spec itself at its first build
    cfg = copy.deepcopy({k: v for k, v in spec.config.items() if k not in _DROP_KEYS})
    with quiet():
        return transformers.AutoConfig.for_model(cfg.pop("model_type", None), **cfg)


def _from_config(auto: Any, config: Any, kwargs: dict[str, Any]) -> nn.Module:
    with quiet():
        model: nn.Module = auto.from_config(config, **kwargs)
    return model


def attention_used(model: nn.Module) -> str:
    """The attention implementation a built model runs (eager | sdpa | flash_attention_2 | …)."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl:
        return str(impl)
    processors = getattr(model, "attn_processors", None)  # diffusers
    if isinstance(processors, dict) and processors:
        names = {type(p).__name__ for p in processors.values()}
        return "eager" if names == {"AttnProcessor"} else "sdpa"
    return "none"


def _build_unet(spec: ModelSpec, attention: str, dtype: torch.dtype) -> nn.Module:
    """A diffusers denoiser (``UNet2DConditionModel``, ``FluxTransformer2DModel``) from its config."""
    try:
        import diffusers
        from diffusers.models.attention_processor import AttnProcessor
    except ImportError:  # diffusers is in the models extra
        raise TraceError(f"building {spec.name} (a diffusion model) needs diffusers, which is not installed",
                         hint="pip install 'vramplan[models]' to trace it") from None
    if attention not in ("eager", "sdpa"):
        raise TraceError(f"{spec.name}: diffusers' models support attention eager or sdpa, not {attention!r}")
    name = str(spec.config.get("_class_name"))
    config = {k: v for k, v in spec.config.items() if not k.startswith("_")}
    with quiet():
        model: nn.Module = getattr(diffusers, name).from_config(config)
        if dtype != torch.float32:
            model.to(dtype)
        if attention == "eager":
            if name != "UNet2DConditionModel":
                raise TraceError(f"{spec.name}: {name} has no eager attention processor in diffusers",
                                 hint="use `attention=sdpa`")
            model.set_attn_processor(AttnProcessor())  # type: ignore[operator]
    return model


def example_inputs(
    spec: ModelSpec,
    *,
    batch: int,
    seq: int = 2048,
    image_size: int | None = None,
    device: str | torch.device = "meta",
    head: str | None = None,
    labels: bool = True,
    dtype: torch.dtype | str | None = None,
    images: int = 0,
    image_height: int = 0,
    videos: int = 0,
    video_frames: int = 0,
    frames: int = 0,
) -> dict[str, Any]:
    """Keyword arguments for the model's forward: token ids (+ labels) for language models,
    ``pixel_values`` (+ labels) for vision models, noisy latents, timestep and text states for a
    UNet (``image_size`` is the pixel size; latents are 8x smaller), token ids with ``images``
    images of ``image_size`` × ``image_height`` (and ``videos`` of ``video_frames`` such frames, Qwen-VL)
    (+ labels) for a vision-language model
    (:mod:`.vlm`; on ``meta`` without the values the model reads: :func:`.vlm.inputs` gives them),
    a denoising step's inputs for a diffusion transformer (FLUX.1: an image; Wan: a video of
    ``frames`` frames, :func:`wan_video`). Floats use ``dtype`` (default float32)."""
    if batch < 1 or seq < 1:
        raise WorkloadError(f"batch and seq must be positive, got batch={batch}, seq={seq}")
    chosen = resolve_head(spec, head)
    float_dtype = _torch_dtype(dtype) if dtype is not None else torch.float32
    dev = torch.device(device)
    if chosen == IMAGE_TEXT:
        from .vlm import inputs

        size = image_size or 224
        return inputs(spec, batch=batch, seq=seq, images=images, width=size, height=image_height or size,
                      device=dev, labels=labels, dtype=float_dtype, videos=videos, frames=video_frames)[0]
    if images or videos:
        from .vlm import no_images, no_videos

        raise no_images(spec) if images else no_videos(spec)
    if chosen == DENOISE and spec.config.get("_class_name") == "FluxTransformer2DModel":
        return _flux_inputs(spec, batch, image_size, image_height, dev, float_dtype)
    if chosen == DENOISE and is_video_denoiser(spec):
        return _wan_inputs(spec, batch, wan_video(image_size, image_height, frames), dev, float_dtype)
    if chosen == DENOISE:
        return _unet_inputs(spec, batch, image_size, dev, float_dtype)
    if spec.patch_size or spec.model_type == "resnet":
        return _image_inputs(spec, chosen, batch, image_size, dev, float_dtype, labels)
    return _token_inputs(spec, chosen, batch, seq, dev, labels)


def _token_inputs(spec: ModelSpec, head: str, batch: int, seq: int, dev: torch.device,
                  labels: bool) -> dict[str, Any]:
    if not spec.vocab:
        raise TraceError(f"{spec.name}: no example inputs for this model", hint="pass your own inputs")
    learned = spec.model_type in ("gpt2", "gpt_bigcode", "bert")
    if learned and spec.max_positions and seq > spec.max_positions:
        raise WorkloadError(
            f"`seq={seq}` exceeds {spec.name}'s {spec.max_positions} learned positions",
            hint=f"use `seq={spec.max_positions}` or less",
            field="seq")
    ids = torch.randint(0, spec.vocab, (batch, seq), dtype=torch.long, device=dev)
    out: dict[str, Any] = {"input_ids": ids}
    if labels and head in (CAUSAL_LM, MASKED_LM):
        out["labels"] = torch.randint(0, spec.vocab, (batch, seq), dtype=torch.long, device=dev)
    elif labels and head == SEQ_CLS:
        out["labels"] = torch.zeros(batch, dtype=torch.long, device=dev)
    return out


def _image_inputs(spec: ModelSpec, head: str, batch: int, image_size: int | None, dev: torch.device,
                  dtype: torch.dtype, labels: bool) -> dict[str, Any]:
    size = image_size or spec.image_size or 224
    if spec.patch_size and size % spec.patch_size:
        raise WorkloadError(
            f"`image_size={size}` is not a multiple of {spec.name}'s patch size {spec.patch_size}",
            field="image_size")
    out: dict[str, Any] = {
        "pixel_values": torch.randn(batch, spec.num_channels, size, size, dtype=dtype, device=dev),
    }
    if spec.patch_size and size != spec.image_size:
        out["interpolate_pos_encoding"] = True
    if labels and head == IMAGE_CLS:
        out["labels"] = torch.zeros(batch, dtype=torch.long, device=dev)
    return out


FLUX_TEXT_TOKENS = 512
"""T5 tokens FluxPipeline encodes a prompt to (``max_sequence_length`` default 512)."""


def _flux_inputs(spec: ModelSpec, batch: int, image_size: int | None, image_height: int, dev: torch.device,
                 dtype: torch.dtype) -> dict[str, Any]:
    """One denoising step of FluxPipeline: latents 8x smaller than the image, packed in 2 x 2
    patches (a token per 16 x 16 pixels, 64 channels), the T5 states, CLIP's pooled vector, the
    timestep, the guidance scale (FLUX.1-dev) and the position ids (diffusers' 2-D ``img_ids``)."""
    width = image_size or spec.image_size or 1024
    height = image_height or width
    if width % 16 or height % 16:
        raise WorkloadError(f"image {width}x{height}: FLUX's sides are multiples of 16 pixels "
                            "(8x latents in 2 x 2 patches)", field="image_size")
    tokens = (width // 16) * (height // 16)
    cfg = spec.config
    out: dict[str, Any] = {
        "hidden_states": torch.randn(batch, tokens, int(cfg.get("in_channels", 64)), dtype=dtype, device=dev),
        "encoder_hidden_states": torch.randn(batch, FLUX_TEXT_TOKENS, int(cfg.get("joint_attention_dim", 4096)),
                                             dtype=dtype, device=dev),
        "pooled_projections": torch.randn(batch, int(cfg.get("pooled_projection_dim", 768)), dtype=dtype, device=dev),
        "timestep": torch.full((batch,), 0.5, dtype=dtype, device=dev),
        "img_ids": torch.zeros(tokens, 3, dtype=dtype, device=dev),
        "txt_ids": torch.zeros(FLUX_TEXT_TOKENS, 3, dtype=dtype, device=dev),
    }
    if cfg.get("guidance_embeds"):
        out["guidance"] = torch.full((batch,), 3.5, dtype=dtype, device=dev)
    return out


def is_video_denoiser(spec: ModelSpec) -> bool:
    """A text-to-video diffusion transformer (Wan's ``WanTransformer3DModel``): its step takes a
    video (``frames``)."""
    return spec.config.get("_class_name") == "WanTransformer3DModel"


@dataclass(frozen=True)
class WanVideo:
    """The video one WanPipeline denoiser call works on: its pixels and frames as the pipeline
    makes them, and the latents (8x smaller sides, 4x fewer frames)."""

    width: int
    height: int
    frames: int
    latent_frames: int
    given_frames: int
    """``frames`` as asked (0: the pipeline's default); differs from ``frames`` where WanPipeline rounds it."""
    own_size: bool
    """The size is WanPipeline's own default (none was given)."""
    text_tokens: int

    def describe(self) -> str:
        size = f"{self.width} x {self.height}" + (" (WanPipeline's default)" if self.own_size else "")
        made = f"{self.frames} frames" + ("" if self.given_frames else " (WanPipeline's default)")
        if self.given_frames and self.given_frames != self.frames:
            made += (f" (`frames={self.given_frames}` rounded as WanPipeline rounds it: num_frames - 1 a "
                     f"multiple of {_WAN_TEMPORAL})")
        tokens = self.latent_frames * (self.height // 16) * (self.width // 16)
        return (f"one WanPipeline denoiser call on videos of {made}, {size}: per video latents "
                f"[16, {self.latent_frames}, {self.height // 8}, {self.width // 8}], {tokens:,} tokens of 1 x 2 x 2 "
                f"patches, the prompt's {self.text_tokens} UMT5 states (guidance_scale > 1 calls the transformer for "
                "the prompt, then for the negative prompt, in turn: a step's peak is one call's); the denoiser "
                "alone: WanPipeline's UMT5 text encoding and its VAE decode, where a whole Wan pipeline peaks, are "
                "not in it (a local folder with the repository's configs, given as the model, traces the whole "
                "pipeline)")


_WAN_TEMPORAL = 4
"""AutoencoderKLWan's ``scale_factor_temporal`` (diffusers 0.42 autoencoder_kl_wan.py; WanPipeline's
own default without a VAE, pipeline_wan.py line 154) — frames per latent frame after the first."""


def wan_video(image_size: int | None, image_height: int, frames: int) -> WanVideo:
    """The video of a WanPipeline call with ``width=image_size``, ``height=image_height`` (None /
    0: the call's defaults, read from the installed ``WanPipeline.__call__``: 832 x 480, 81 frames,
    512 text tokens in diffusers 0.42) and ``num_frames=frames``, rounded as the call rounds it
    (pipeline_wan.py ``__call__``: ``num_frames - 1`` not a multiple of 4 becomes
    ``num_frames // 4 * 4 + 1``); sides must be multiples of 16 (its ``check_inputs``)."""
    import inspect

    try:
        import diffusers
    except ImportError:
        raise TraceError("a Wan video step needs diffusers, which is not installed",
                         hint="pip install 'vramplan[models]' to trace it") from None
    call = {k: p.default for k, p in inspect.signature(diffusers.WanPipeline.__call__).parameters.items()}
    own = image_size is None
    width = int(call["width"]) if image_size is None else image_size
    height = int(call["height"]) if image_size is None else image_height or width
    if width % 16 or height % 16:
        raise WorkloadError(f"video {width}x{height}: WanPipeline's sides are multiples of 16 pixels "
                            "(8x the VAE's latents, 2 x 2 patches)", hint="e.g. `image_size=832, image_height=480`",
                            field="image_size")
    made = frames or int(call["num_frames"])
    if made % _WAN_TEMPORAL != 1:
        made = max(made // _WAN_TEMPORAL * _WAN_TEMPORAL + 1, 1)
    return WanVideo(width=width, height=height, frames=made, latent_frames=(made - 1) // _WAN_TEMPORAL + 1,
                    given_frames=frames, own_size=own, text_tokens=int(call["max_sequence_length"]))


def _wan_inputs(spec: ModelSpec, batch: int, video: WanVideo, dev: torch.device,
                dtype: torch.dtype) -> dict[str, Any]:
    """One denoiser call of WanPipeline (diffusers 0.42 pipeline_wan.py ``__call__``): the video
    latents, the scheduler's timestep for each video, the prompt's UMT5 states padded to
    ``max_sequence_length``."""
    cfg = spec.config
    shape = (batch, int(cfg.get("in_channels", 16)), video.latent_frames, video.height // 8, video.width // 8)
    return {
        "hidden_states": torch.randn(*shape, dtype=dtype, device=dev),
        "timestep": torch.full((batch,), 999, dtype=torch.long, device=dev),
        "encoder_hidden_states": torch.randn(batch, video.text_tokens, int(cfg.get("text_dim", 4096)),
                                             dtype=dtype, device=dev),
    }


def _unet_inputs(spec: ModelSpec, batch: int, image_size: int | None, dev: torch.device,
                 dtype: torch.dtype) -> dict[str, Any]:
    size = image_size or spec.image_size or 512
    if size % 8:
        raise WorkloadError(f"`image_size={size}` must be a multiple of 8 for a latent-diffusion UNet", field="image_size")
    latent = size // 8
    cross = int(spec.config.get("cross_attention_dim") or 768)
    return {
        "sample": torch.randn(batch, spec.num_channels, latent, latent, dtype=dtype, device=dev),
        "timestep": torch.zeros(batch, dtype=torch.long, device=dev),
        "encoder_hidden_states": torch.randn(batch, _UNET_TEXT_TOKENS, cross, dtype=dtype, device=dev),
    }


def _torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).strip().lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise WorkloadError(f"unknown dtype {dtype!r}", hint="use float32, bfloat16 or float16")
    return _DTYPES[key]


def _has_attention(spec: ModelSpec) -> bool:
    return spec.model_type not in ("resnet",)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else e.__class__.__name__


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence transformers/peft/diffusers warnings and loggers: the core never prints.

    Enter it after importing them: importing resets their library logger's level."""
    import logging

    loggers = [logging.getLogger(n) for n in ("transformers", "peft", "diffusers")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
