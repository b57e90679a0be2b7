"""Vision-language models in ``estimate``: the image tokens a processor makes, the batch of a
step (token ids and image grid with their values), and the traced step against a real CPU run."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

import vramplan
from vramplan.cli.main import main
from vramplan.models.build import build_model
from vramplan.models.catalog import resolve
from vramplan.models.vlm import PROCESSORS, image_tokens, inputs, video_tokens
from vramplan.trace.run import TraceOptions, trace_model
from vramplan.trace.testing import real_peak
from vramplan.workload import Workload

transformers = pytest.importorskip("transformers")

TINY = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 400, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "tie_word_embeddings": False, "torch_dtype": "float32",
    "bos_token_id": 390, "eos_token_id": 391, "vision_start_token_id": 392, "vision_end_token_id": 393,
    "vision_token_id": 394, "image_token_id": 395, "video_token_id": 396,
    "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
    "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                      "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
                      "fullatt_block_indexes": [1], "in_chans": 3},
}

GEMMA3 = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "torch_dtype": "float32",
    "boi_token_index": 380, "eoi_token_index": 381, "image_token_index": 382, "mm_tokens_per_image": 4,
    "text_config": {"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 400,
                    "sliding_window": 8, "max_position_embeddings": 4096},
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                      "num_attention_heads": 2, "num_hidden_layers": 2, "image_size": 56, "patch_size": 14,
                      "vision_use_head": False},
}
LLAVA = {
    "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "torch_dtype": "float32",
    "image_token_index": 390, "vision_feature_select_strategy": "default", "vision_feature_layer": -2,
    "text_config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 400,
                    "max_position_embeddings": 4096},
    "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                      "num_attention_heads": 2, "num_hidden_layers": 3, "image_size": 56, "patch_size": 14,
                      "projection_dim": 64},
}
MLLAMA = {
    "architectures": ["MllamaForConditionalGeneration"], "model_type": "mllama", "image_token_index": 390,
    "torch_dtype": "float32",
    "text_config": {"model_type": "mllama_text_model", "hidden_size": 64, "intermediate_size": 128,
                    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 390,
                    "cross_attention_layers": [1, 3], "max_position_embeddings": 4096,
                    "rope_scaling": {"rope_type": "default"}, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    "vision_config": {"model_type": "mllama_vision_model", "hidden_size": 32, "intermediate_layers_indices": [1],
                      "num_hidden_layers": 2, "num_global_layers": 1, "attention_heads": 2, "intermediate_size": 64,
                      "image_size": 56, "patch_size": 14, "max_num_tiles": 4, "vision_output_dim": 64,
                      "supported_aspect_ratios": [[1, 1], [1, 2], [1, 3], [1, 4], [2, 1], [2, 2], [3, 1], [4, 1]]},
}
TINIES = {"qwen2_5_vl": TINY, "gemma3": GEMMA3, "llava": LLAVA, "mllama": MLLAMA}
# Gemma 3 4B's Hub config.json leaves heads, head size and vocabulary to Gemma3TextConfig's defaults
GEMMA3_SPARSE = {**GEMMA3, "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                                           "num_hidden_layers": 34, "sliding_window": 1024},
                 "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144,
                 "mm_tokens_per_image": 256,
                 "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                                   "model_type": "siglip_vision_model", "num_attention_heads": 16,
                                   "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}


def _write(tmp_path: Path, config: dict[str, Any]) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path / "config.json"


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    return tmp_path / "config.json"


@pytest.mark.parametrize(("width", "height"), [(1024, 768), (50, 50), (1920, 1080), (4000, 3000), (300, 2000)])
def test_image_tokens_are_the_processors(width: int, height: int) -> None:
    spec = resolve("qwen2.5-vl-7b")
    proc = PROCESSORS["qwen2_5_vl"]
    real = transformers.Qwen2VLImageProcessor(min_pixels=proc.min_pixels, max_pixels=proc.max_pixels)(
        images=[np.zeros((height, width, 3), dtype=np.uint8)], return_tensors="pt")
    t = image_tokens(spec, width, height)
    grid = real["image_grid_thw"][0].tolist()
    assert t.patches == real["pixel_values"].shape[0] == grid[0] * grid[1] * grid[2]
    assert (t.height // 14, t.width // 14) == (grid[1], grid[2])
    assert t.tokens == t.patches // 4


def test_the_batch_carries_the_values_the_model_reads(tiny: Path) -> None:
    spec = resolve(str(tiny))
    kw, shadows = inputs(spec, batch=2, seq=10, images=2, width=112, height=84)
    one = image_tokens(spec, 112, 84)
    assert kw["input_ids"].shape == (2, 10 + 2 * (one.tokens + 2)) and kw["input_ids"].is_meta
    assert kw["pixel_values"].shape == (4 * one.patches, 3 * 2 * 14 * 14)
    values = {id(m): v for m, v in shadows}
    ids = values[id(kw["input_ids"])]
    assert int((ids == TINY["image_token_id"]).sum()) == 2 * 2 * one.tokens
    assert values[id(kw["image_grid_thw"])].tolist() == [[1, one.height // 14, one.width // 14]] * 4
    assert int(ids[:, -10:].max()) < TINY["bos_token_id"]  # text ids stay below the special tokens


def test_square_processors_are_transformers_own(tmp_path: Path) -> None:
    """Gemma 3 and LLaVA resize every image to the tower's square: the image processors' output
    and LLaVA's own token rule (``LlavaProcessor.replace_image_token``)."""
    big = np.zeros((768, 1024, 3), dtype=np.uint8)
    gemma = resolve("gemma-3-4b")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pv = transformers.Gemma3ImageProcessor(size={"height": 896, "width": 896})(images=[big], return_tensors="pt")
        clip = transformers.CLIPImageProcessor(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
        lv = clip(images=[big], return_tensors="pt")
    g = image_tokens(gemma, 1024, 768)
    assert tuple(pv["pixel_values"].shape[-2:]) == (g.height, g.width) == (896, 896)
    assert (g.patches, g.tokens, g.markers) == (4096, 256, 4)
    assert image_tokens(resolve("gemma-3-27b"), 300, 2000) == g  # one SigLIP tower for every size
    assert image_tokens(resolve("gemma-3-12b"), 300, 2000) == g
    (tmp_path / "l").mkdir()
    for strategy in ("default", "full"):
        config = {**LLAVA, "vision_feature_select_strategy": strategy,
                  "vision_config": {**LLAVA["vision_config"], "image_size": 336}}
        llava = resolve(str(_write(tmp_path / "l", config)))
        own = SimpleNamespace(patch_size=14, num_additional_image_tokens=1, vision_feature_select_strategy=strategy,
                              image_token="<image>")
        t = image_tokens(llava, 1024, 768)
        assert t.tokens == transformers.LlavaProcessor.replace_image_token(own, lv, 0).count("<image>")
        assert (t.width, t.patches, t.markers) == (336, 576, 0)


@pytest.mark.parametrize(("width", "height"), [(1000, 500), (560, 560), (300, 2000), (4000, 3000), (100, 90)])
def test_llama_vision_tiles_are_the_processors(tmp_path: Path, width: int, height: int) -> None:
    """Llama 3.2 Vision: the canvas of up to 4 tiles of 560 pixels, the aspect-ratio id and mask, as
    ``MllamaImageProcessor`` makes them; every tile slot is encoded."""
    config = {**MLLAMA, "vision_config": {**MLLAMA["vision_config"], "image_size": 560}}
    spec = resolve(str(_write(tmp_path, config)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        real = transformers.MllamaImageProcessorPil(size={"height": 560, "width": 560}, max_image_tiles=4)(
            images=[[np.zeros((height, width, 3), dtype=np.uint8)]] * 2, return_tensors="pt")
    t = image_tokens(spec, width, height)
    assert (t.height // 560) * (t.width // 560) == real["num_tiles"][0][0] and (t.tokens, t.markers) == (1, 0)
    assert t.patches == 4 * (40 * 40 + 1)
    kw, shadows = inputs(spec, batch=2, seq=7, images=1, width=width, height=height)
    values = {id(m): v for m, v in shadows}
    assert kw["pixel_values"].shape == real["pixel_values"].shape == (2, 1, 4, 3, 560, 560)
    assert values[id(kw["aspect_ratio_ids"])].tolist() == real["aspect_ratio_ids"].tolist()
    assert values[id(kw["aspect_ratio_mask"])].tolist() == real["aspect_ratio_mask"].tolist()
    cross = values[id(kw["cross_attention_mask"])]
    assert cross.shape == (2, 8, 1, 4) and int(cross[0, :, 0].sum()) == 8 * real["num_tiles"][0][0]


def test_a_sparse_hub_config_takes_the_class_defaults(tmp_path: Path) -> None:
    spec = resolve(str(_write(tmp_path, GEMMA3_SPARSE)))
    text = transformers.Gemma3TextConfig()
    assert (spec.heads, spec.kv_heads, spec.head_dim, spec.vocab) == (
        text.num_attention_heads, text.num_key_value_heads, text.head_dim, text.vocab_size) == (8, 4, 256, 262208)
    assert (spec.hidden, spec.layers) == (2560, 34)


def test_the_gemma3_text_defaults_table_is_the_config_class() -> None:
    """The sizes a sparse Gemma 3 config leaves out are read from a table (resolving a catalog
    model imports no transformers): the table is ``Gemma3TextConfig``'s own defaults."""
    from vramplan.models.normalize import TEXT_CLASS_DEFAULTS

    for model_type, table in TEXT_CLASS_DEFAULTS.items():
        own = transformers.AutoConfig.for_model(model_type)
        assert table == {k: getattr(own, k) for k in table}, model_type


def test_gemma3_batches_carry_the_token_types(tmp_path: Path) -> None:
    spec = resolve(str(_write(tmp_path, GEMMA3)))
    kw, shadows = inputs(spec, batch=2, seq=5, images=2, width=300, height=200)
    values = {id(m): v for m, v in shadows}
    ids, types = values[id(kw["input_ids"])], values[id(kw["token_type_ids"])]
    assert ids.shape == types.shape == (2, 5 + 2 * (4 + 4)) and kw["pixel_values"].shape == (4, 3, 56, 56)
    assert ((ids == GEMMA3["image_token_index"]) == (types == 1)).all() and int(types.sum()) == 2 * 2 * 4
    assert int((ids == GEMMA3["boi_token_index"]).sum()) == int((ids == GEMMA3["eoi_token_index"]).sum()) == 4


@pytest.mark.parametrize("task", ["train", "infer"])
@pytest.mark.parametrize("kind", sorted(TINIES))
def test_a_traced_vlm_step_matches_a_real_cpu_run(tmp_path: Path, kind: str, task: str) -> None:
    spec = resolve(str(_write(tmp_path, TINIES[kind])))

    def make() -> Any:
        return build_model(spec, task=task, attention="eager", device="cpu", dtype=torch.float32)

    def batch() -> dict[str, Any]:
        return inputs(spec, batch=2, seq=12, images=2, width=140, height=112, device="cpu", labels=task == "train")[0]

    ref = real_peak(make, batch, task=task)
    w = Workload(task=task, precision="fp32", optimizer="adamw", attention="eager")
    r = trace_model(make, batch(), workload=w, options=TraceOptions(workspaces=False))
    assert abs(r.peak_allocated - ref) / ref < 0.01, (r.peak_allocated, ref)


def test_estimate_of_a_vlm_counts_its_image_tokens(tiny: Path) -> None:
    base = dict(task="train", precision="bf16-mixed", seq=32, method="trace", gpu="h100-sxm")
    text = vramplan.estimate(str(tiny), **base)
    one = vramplan.estimate(str(tiny), images=1, image_size=224, image_height=168, **base)
    two = vramplan.estimate(str(tiny), images=2, image_size=224, image_height=168, **base)
    t = image_tokens(resolve(str(tiny)), 224, 168)
    note = next(n for n in one.notes if "image tokens" in n)
    assert f"{t.tokens:,} image tokens" in note and f"sequence {32 + t.tokens + 2:,} tokens" in note
    assert text.peak.allocated < one.peak.allocated < two.peak.allocated
    gen = vramplan.estimate(str(tiny), task="generate", seq=16, new_tokens=8, images=1, image_size=224,
                            method="trace", gpu="h100-sxm")
    cache = {p.phase.value if hasattr(p.phase, "value") else p.phase: p.breakdown.kv_cache for p in gen.phases}
    assert set(cache) >= {"prefill", "decode"} and cache["decode"] > 0


@pytest.mark.parametrize("kind", ["gemma3", "mllama"])
def test_generate_of_gemma3_and_llama_vision_encodes_the_images_in_the_prefill(tmp_path: Path, kind: str) -> None:
    """``generate`` of the two image-token families: the prefill takes the image (its tokens, or
    Llama 3.2 Vision's tiles for the cross-attention layers), the decode steps grow the cache."""
    config = _write(tmp_path, TINIES[kind])
    base = dict(task="generate", seq=16, new_tokens=8, method="trace", gpu="h100-sxm")
    text = vramplan.estimate(str(config), **base)
    one = vramplan.estimate(str(config), images=1, image_size=140, image_height=112, **base)
    cache = {p.phase.value if hasattr(p.phase, "value") else p.phase: p.breakdown.kv_cache for p in one.phases}
    assert set(cache) >= {"prefill", "decode"} and cache["decode"] > 0
    assert one.peak.allocated > text.peak.allocated
    assert any("image" in n and "per sequence" in n for n in one.notes)


def test_images_on_a_text_model_and_bad_sizes_are_one_line(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for args, words in ((["llama-3.2-1b", "--images", "2"], "error: --images applies to vision-language models"),
                        ([str(tiny), "--images", "1", "--image-size", "12x"], "e.g. 1024 or 1024x768"),
                        (["qwen2.5-vl-3b", "--images", "2", "--method", "analytic", "--attention", "eager"],
                     "use --method trace")):
        try:
            code = main(["estimate", *args])
        except SystemExit as e:  # argparse's own errors
            code = e.code
        err = capsys.readouterr().err
        assert code == 2 and words in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1, err


def test_freeze_vision_trains_the_language_model_only(tiny: Path) -> None:
    base = dict(task="train", precision="bf16-mixed", seq=16, images=1, image_size=112, method="trace",
                gpu="h100-sxm")
    full = vramplan.estimate(str(tiny), **base)
    frozen = vramplan.estimate(str(tiny), freeze_vision=True, **base)
    visual = sum(p.numel() for p in build_model(resolve(str(tiny)), device="meta").model.visual.parameters())
    assert full.trainable_params - frozen.trainable_params == visual > 0
    assert any("vision tower frozen" in n for n in frozen.notes)
    assert frozen.model_states is not None and full.model_states is not None
    assert frozen.model_states.optimizer < full.model_states.optimizer
    with pytest.raises(vramplan.VramplanError, match="vision tower"):
        vramplan.estimate("llama-3.2-1b", task="train", freeze_vision=True, method="trace")


def test_run_reads_the_batch_from_the_token_ids_not_the_vision_towers_patches() -> None:
    """``generate`` of Qwen2.5-VL calls the vision tower first (pixel patches [N, 1176]): the
    header's batch and sequence are the token ids' the script moved to the device."""
    script = Path(__file__).parent / "zoo" / "scripts" / "transformers_qwen2_5_vl.py"
    r = vramplan.run_script(script, ["generate"], gpu="h100-sxm")
    assert r.ran is not None and r.ran.batch == 2 and r.ran.seq is not None and r.ran.seq > 16


def test_preference_and_rl_objectives_with_images() -> None:
    """DPO takes the images (the collator repeats them for the chosen and the rejected sequence:
    checked against TRL's own step in tests/test_preference.py); GRPO and KTO with images are
    refused in one line rather than traced without them."""
    r = vramplan.estimate("qwen2.5-vl-3b", task="train", objective="dpo", peft="lora", seq=128, batch=1, images=1,
                          image_size=224, method="trace", gpu="h100-sxm")
    assert any("DPO step" in n for n in r.notes) and any("image tokens" in n for n in r.notes)
    for objective in ("grpo", "kto"):
        with pytest.raises(vramplan.VramplanError, match="with images is not modelled"):
            Workload(task="train", objective=objective, images=1, prompt=64, seq=128)


# --- videos (Qwen-VL) -------------------------------------------------------------------------

@pytest.mark.parametrize("task", ["train", "infer"])
def test_a_traced_video_step_matches_a_real_cpu_run(tmp_path: Path, task: str) -> None:
    """An image and two videos of 5 frames per sequence: the model itself checks that its vision
    tower gives one feature per ``<|video_pad|>`` token (it raises otherwise), and the trace's peak
    is the real run's."""
    spec = resolve(str(_write(tmp_path, TINY)))

    def make() -> Any:
        return build_model(spec, task=task, attention="eager", device="cpu", dtype=torch.float32)

    def batch() -> dict[str, Any]:
        return inputs(spec, batch=2, seq=12, images=1, width=140, height=112, device="cpu", labels=task == "train",
                      videos=2, frames=5)[0]

    ref = real_peak(make, batch, task=task)
    w = Workload(task=task, precision="fp32", optimizer="adamw", attention="eager")
    r = trace_model(make, batch(), workload=w, options=TraceOptions(workspaces=False))
    assert abs(r.peak_allocated - ref) / ref < 0.01, (r.peak_allocated, ref)


def test_a_video_is_its_frames_in_pairs(tiny: Path) -> None:
    """Frames padded to pairs (``temporal_patch_size`` 2), each resized as an image; one
    ``<|video_pad|>`` per 2 × 2 patches of a pair; the batch's grid, pixels and token ids."""
    spec = resolve(str(tiny))
    one = image_tokens(spec, 140, 112)
    for frames, pairs in ((1, 1), (4, 2), (5, 3)):
        clip = video_tokens(spec, 140, 112, frames)
        assert (clip.frames, clip.grid) == (2 * pairs, (pairs, one.height // 14, one.width // 14))
        assert clip.patches == pairs * one.patches and clip.tokens == clip.patches // 4 and clip.markers == 2
    clip = video_tokens(spec, 140, 112, 5)
    kw, shadows = inputs(spec, batch=2, seq=7, images=0, width=140, height=112, videos=3, frames=5)
    values = {id(m): v for m, v in shadows}
    ids = values[id(kw["input_ids"])]
    assert ids.shape == (2, 7 + 3 * (clip.tokens + 2)) and "pixel_values" not in kw
    assert int((ids == TINY["video_token_id"]).sum()) == 2 * 3 * clip.tokens
    assert int((ids == TINY["vision_start_token_id"]).sum()) == 6
    assert kw["pixel_values_videos"].shape == (6 * clip.patches, 3 * 2 * 14 * 14)
    assert values[id(kw["video_grid_thw"])].tolist() == [list(clip.grid)] * 6
    assert values[id(kw["second_per_grid_ts"])].tolist() == [1.0] * 6


def test_estimate_of_videos_counts_their_tokens_and_refuses_other_models(
        tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = dict(task="train", precision="bf16-mixed", seq=32, method="trace", gpu="h100-sxm", image_size=112)
    four = vramplan.estimate(str(tiny), videos=1, video_frames=4, **base)
    eight = vramplan.estimate(str(tiny), videos=1, video_frames=8, **base)
    clip = video_tokens(resolve(str(tiny)), 112, 112, 8)
    note = next(n for n in eight.notes if "video tokens" in n)
    assert f"{clip.tokens:,} video tokens" in note and f"sequence {32 + clip.tokens + 2:,} tokens" in note
    assert four.peak.allocated < eight.peak.allocated
    assert not any("largest batch" in n for n in eight.notes)  # (traced: no search at other batches)
    analytic = vramplan.estimate(str(tiny), videos=1, video_frames=8, **{**base, "method": "analytic"})
    assert any("largest batch" in n and "analytic curve" in n for n in analytic.notes), analytic.notes
    gemma = _write(tmp_path, GEMMA3)
    for args, words in (([str(gemma), "--videos", "1"], "takes images only"),
                        (["llama-3.2-1b", "--videos", "1"], "--videos applies to vision-language models"),
                        ([str(tiny), "--videos", "1", "--video-frames", "0"], "video-frames must be a positive integer")):
        code = main(["estimate", *args])
        err = capsys.readouterr().err
        assert code == 2 and words in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1, err
