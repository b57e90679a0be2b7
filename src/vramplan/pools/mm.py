"""vLLM V1's multimodal start-up profile, following vLLM **0.10.1.1** (the version
:mod:`.vllm` follows; files cited per rule).

Before its dummy language-model forward, ``GPUModelRunner.profile_run``
(``vllm/v1/worker/gpu_model_runner.py``) encodes dummy images or videos of the maximum size:

1. **Tokens per item** (``MultiModalRegistry.get_max_tokens_per_item_by_modality``, with
   ``seq_len = max_model_len`` and one item of each modality whose ``limit_mm_per_prompt`` is
   above 0). Qwen2-VL / Qwen2.5-VL (``vllm/model_executor/models/qwen2_vl.py``
   ``Qwen2VLProcessingInfo``): the largest image is ``smart_resize(9999999, 9999999, factor=28,
   min_pixels, max_pixels)`` — a square (3584 × 3584 at the checkpoints' ``max_pixels`` 12,845,056:
   65,536 patches, 16,384 tokens); a video is as many frames of that size as fit in
   ``max_model_len`` minus one image, at most ``_MAX_FRAMES_PER_VIDEO`` = 16, two frames a
   temporal patch (98,304 tokens at 128,000). Gemma 3 and LLaVA take images only, of the
   processor's fixed token count (:func:`vramplan.models.vlm.image_tokens`).
2. **The dummy modality** is the one with the most tokens per item, ties to image
   (``vllm/v1/worker/utils.py`` ``get_modality_with_max_tokens``); the **encoder budget** is
   ``max(max_num_batched_tokens, its tokens)`` (``encoder_cache_manager.compute_encoder_budget``:
   a scheduler token count, nothing allocated ahead).
3. **Items** (``MultiModalBudget.get_max_items``): ``max(1, min(budget // tokens,
   max_num_seqs × max(1, min(limit, max_model_len // tokens))))``, all of them encoded in one
   vision-tower forward; the dummy item itself is sized against ``max_num_batched_tokens``,
   not ``max_model_len`` (``_get_mm_dummy_batch(…, seq_len=self.max_num_tokens)``), so a video
   profiled below 32,768 batched tokens is one temporal patch: the budget line says 98,304
   tokens while 16,384 are encoded (vLLM 0.11 changed both: 14 full frames at ``max_model_len``).
4. The encoder outputs (``encoder_cache["tmp"]``) and the dummy pixel tensor stay allocated
   through the dummy language-model forward and the sampler; the forward itself reads a
   zero ``inputs_embeds`` buffer, not the outputs. So the profile's torch peak is
   ``max(vision forward peak, outputs + pixels + language-model phase)``.

``limit_mm_per_prompt`` defaults to 999 per modality; 0 drops a modality (both 0: no
encoder profile, and vLLM does not load the vision tower); ``skip_mm_profiling`` (new in
0.10.1) skips steps 2–4: the encoder's memory is then the user's to leave room for.

The reading behind these rules (vLLM's files and lines per version, and what changed later):
``docs/research/vllm-multimodal-profile.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramplan.errors import WorkloadError
from vramplan.models import vlm
from vramplan.models.spec import ModelSpec

from .vllm_release import Release

LIMIT_DEFAULT = 999
"""``MultiModalConfig.get_limit_per_prompt``'s default per modality in V1."""
MAX_FRAMES_PER_VIDEO = 16
"""``_MAX_FRAMES_PER_VIDEO`` of ``qwen2_vl.py`` in vLLM 0.10.x (14 from 0.11)."""
PIXEL_BYTES = 4
"""The dummy ``pixel_values`` as the HF processor makes them (float32), moved to the GPU as is."""


@dataclass(frozen=True, kw_only=True)
class MmSettings:
    limit_image: int = LIMIT_DEFAULT
    limit_video: int = LIMIT_DEFAULT
    max_pixels: int | None = None
    """``--mm-processor-kwargs '{"max_pixels": …}'`` (Qwen-VL)."""
    min_pixels: int | None = None
    skip_mm_profiling: bool = False


@dataclass(frozen=True)
class MmProfile:
    """What the profile run encodes."""

    modality: str
    """image | video (the dummy modality)."""
    budget: int
    """The encoder cache budget in tokens (the start-up log's figure)."""
    items: int
    max_tokens: int
    """Tokens of one item of the maximum size (scheduling)."""
    grid: tuple[int, int, int]
    """(temporal, height, width) patches of one dummy item as encoded."""
    patches: int
    """Patches the vision tower encodes in all (``items`` dummy items)."""
    tokens: int
    """Rows of the encoder outputs (what the tower computes)."""
    pixel_values: tuple[int, ...]
    """Shape of the dummy pixel tensor."""
    held_tokens: int = 0
    """Rows held through the language-model phase (0: ``tokens``; vLLM 0.11.0 pads each output to the budget)."""

    @property
    def pixel_bytes(self) -> int:
        n = 1
        for d in self.pixel_values:
            n *= d
        return n * PIXEL_BYTES

    def log(self) -> str:
        return (f"Encoder cache will be initialized with a budget of {self.budget} tokens, and profiled with "
                f"{self.items} {self.modality} items of the maximum feature size.")


@dataclass(frozen=True)
class Encoder:
    """The vision tower on one rank: its weights and what encoding the profile's items costs."""

    weights: int
    profile: MmProfile | None
    peak: int = 0
    """Allocated above the weights at the vision forward's peak (the dummy pixels included)."""
    outputs: int = 0
    """Bytes of the encoder outputs held through the language-model phase."""
    method: str = ""


def check(spec: ModelSpec, mm: MmSettings) -> None:
    """Refusals of the multimodal settings (a text model, negative limits, pixels on a fixed-size
    processor)."""
    default = MmSettings()
    if not vlm.is_vlm(spec):
        if mm != default:
            raise WorkloadError(f"{spec.name} takes no images: the multimodal settings apply to vision-language "
                                "models", hint="drop limit_mm_per_prompt, mm_processor_kwargs and skip_mm_profiling")
        return
    for name, v in (("image", mm.limit_image), ("video", mm.limit_video)):
        if v < 0:
            raise WorkloadError(f"limit_mm_per_prompt {name} must be >= 0, got {v}", hint=f"e.g. {name}=1")
    family = vlm.PROCESSORS[spec.model_type].family
    if family != "qwen" and (mm.max_pixels is not None or mm.min_pixels is not None):
        raise WorkloadError(f"{spec.name}'s processor resizes every image to a fixed size: max_pixels/min_pixels "
                            "do not apply", hint="drop mm_processor_kwargs")
    lo = mm.min_pixels if mm.min_pixels is not None else vlm.PROCESSORS[spec.model_type].min_pixels
    hi = mm.max_pixels if mm.max_pixels is not None else vlm.PROCESSORS[spec.model_type].max_pixels
    if family == "qwen" and not 0 < lo <= hi:
        raise WorkloadError(f"mm_processor_kwargs needs 0 < min_pixels <= max_pixels, got {lo} and {hi}",
                            hint='e.g. {"max_pixels": 1003520}')


def profile(spec: ModelSpec, *, max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int,
            mm: MmSettings, version: str = "0.10.1.1") -> MmProfile | None:
    """The dummy items vLLM ``version`` encodes at start-up; None for a text model, with both limits
    0, or with ``skip_mm_profiling``. Up to 0.10.x the dummy item is built at
    ``seq_len=max_num_batched_tokens``; from 0.11.0 at ``max_model_len`` (0.11.0
    ``gpu_model_runner.py:2867-2894``; 0.19.1 and 0.34.0 through the registry / processor's
    ``get_dummy_mm_inputs``); 0.11.0 alone pads every output to the encoder budget's rows
    (``:3370-3385``; 0.12.0 pads to the modality's own maximum, later releases not at all;
    docs/research/vllm-multimodal-profile.md §2b)."""
    rel = Release.of(version)
    if not vlm.is_vlm(spec) or mm.skip_mm_profiling:
        return None
    family = vlm.PROCESSORS[spec.model_type].family
    limits = {"image": mm.limit_image, "video": mm.limit_video if family == "qwen" else 0}
    if not any(limits.values()):
        return None
    image = _largest_image(spec, mm)

    def video(seq_len: int, beside_image: bool) -> tuple[int, int]:
        """(tokens, temporal patches) of the largest video at ``seq_len``
        (``get_num_frames_with_most_features``: the frames that fit, beside one image when images
        count too, at most 16, padded to two a temporal patch; at least one frame)."""
        room = seq_len - (image.tokens if beside_image else 0)
        pairs = max(1, min(room // image.tokens if room > 0 else 0, MAX_FRAMES_PER_VIDEO // 2))
        return pairs * image.tokens, pairs

    # tokens per item: one item of each modality that counts (``mm_counts = {m: 1}``)
    tokens = {"image": image.tokens, "video": video(max_model_len, limits["image"] > 0)[0]}
    modality = max((m for m in ("image", "video") if limits[m]), key=lambda m: tokens[m])  # ties: image
    max_tok = tokens[modality]
    budget = max(max_num_batched_tokens, max_tok)
    per_prompt = max(1, min(limits[modality], max_model_len // max_tok))
    items = max(1, min(budget // max_tok, max_num_seqs * per_prompt))
    patch = vlm.patch_size(spec)
    side_h, side_w = image.height // patch, image.width // patch
    # the dummy item: ``mm_counts={modality: 1}`` at ``seq_len=max_num_tokens`` (from 0.11.0 max_model_len)
    dummy_len = max_model_len if rel.since("0.11.0") else max_num_batched_tokens
    temporal = video(dummy_len, False)[1] if modality == "video" else 1
    rows = temporal * side_h * side_w * items
    pixels = vlm.pixel_shape(spec, images=items, patches=rows, height=image.height, width=image.width)
    # encoder outputs: Qwen-VL's merged patches (a frame pair's tokens per temporal patch), else the tokens per image
    out_tokens = temporal * image.tokens * items
    held = items * budget if rel.since("0.11.0") and not rel.since("0.11.1") and budget > out_tokens // items else 0
    return MmProfile(modality=modality, budget=budget, items=items, max_tokens=max_tok,
                     grid=(temporal, side_h, side_w), patches=rows, tokens=out_tokens, pixel_values=pixels,
                     held_tokens=held)


def _largest_image(spec: ModelSpec, mm: MmSettings) -> vlm.ImageTokens:
    """``get_image_size_with_most_features``: Qwen's ``smart_resize`` of a 9,999,999-pixel square
    (a square within ``max_pixels``); a fixed-size processor's one size."""
    proc = vlm.PROCESSORS[spec.model_type]
    if proc.family != "qwen":
        return vlm.image_tokens(spec, 1, 1)
    return vlm.image_tokens(spec, 9999999, 9999999, min_pixels=mm.min_pixels, max_pixels=mm.max_pixels)


__all__ = ["LIMIT_DEFAULT", "Encoder", "MmProfile", "MmSettings", "check", "profile"]
