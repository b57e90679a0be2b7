"""Serving a vision-language model with vLLM: the multimodal profile's rules (vLLM 0.10.1.1, read
from its code: ``vramplan.pools.mm``), the vision tower's weights and traced encode, and the
start-up figures against public logs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import vramplan
from vllm_pinned import serve_plan  # noqa: E402
from vramplan.cli.main import main
from vramplan.engine import encoder as enc
from vramplan.hardware.catalog import get_gpu
from vramplan.models.build import build_model
from vramplan.models.catalog import resolve
from vramplan.models.vlm import text_spec
from vramplan.pools.mm import MmSettings, profile
from vramplan.trace.testing import real_peak
from vramplan.units import GiB

pytest.importorskip("transformers")
from test_vlm import GEMMA3, TINY  # noqa: E402


@pytest.mark.parametrize(("max_model_len", "batched", "mm", "expected"), [
    # (budget, items, modality, patches encoded)
    (128000, 8192, MmSettings(), (98304, 1, "video", 65536)),  # one temporal patch: sized against the batched tokens
    (128000, 32768, MmSettings(), (98304, 1, "video", 131072)),
    (32768, 8192, MmSettings(), (16384, 1, "image", 65536)),  # a video no longer than one image: ties go to image
    (128000, 32768, MmSettings(limit_video=0), (32768, 2, "image", 131072)),
    (8192, 2048, MmSettings(limit_video=0, max_pixels=1003520), (2048, 1, "image", 4900)),  # 980 x 980, 1,225 tokens
    (32768, 8192, MmSettings(limit_video=0, limit_image=2, max_pixels=1003520), (8192, 6, "image", 6 * 4900)),
])
def test_the_profile_follows_vllms_rules(max_model_len: int, batched: int, mm: MmSettings,
                                         expected: tuple[int, int, str, int]) -> None:
    p = profile(resolve("qwen2.5-vl-7b"), max_model_len=max_model_len, max_num_batched_tokens=batched,
                max_num_seqs=1024, mm=mm)
    assert p is not None
    assert (p.budget, p.items, p.modality, p.patches) == expected
    assert p.tokens == p.patches // 4 and p.pixel_values == (p.patches, 1176)


def test_no_profile_without_modalities_or_when_skipped() -> None:
    spec = resolve("qwen2.5-vl-7b")
    for mm in (MmSettings(limit_image=0, limit_video=0), MmSettings(skip_mm_profiling=True)):
        assert profile(spec, max_model_len=32768, max_num_batched_tokens=8192, max_num_seqs=256, mm=mm) is None
    assert profile(resolve("llama-3.1-8b"), max_model_len=32768, max_num_batched_tokens=8192, max_num_seqs=256,
                   mm=MmSettings()) is None


def test_default_budget_is_the_logged_one() -> None:
    """vllm-project/vllm#15264 (Qwen2.5-VL-7B, default max_model_len 128000): "Encoder cache will be
    initialized with a budget of 98304 tokens, and profiled with 1 video items of the maximum
    feature size." (also #17263)."""
    p = serve_plan("qwen2.5-vl-7b", "h100-sxm")
    assert ("Encoder cache will be initialized with a budget of 98304 tokens, and profiled with 1 video items of the "
            "maximum feature size.") in p.log


def test_the_l4_log_of_the_ray_example() -> None:
    """ray-project/ray doc/source/data/examples/llm-batch-inference-vision (vLLM 0.11.0, an L4,
    Qwen2.5-VL-3B-Instruct, max_model_len 8192, max_num_batched_tokens 2048): "Model loading took
    7.1550 GiB", "budget of 16384 tokens, and profiled with 1 image items", "Available KV cache
    memory: 9.26 GiB", "GPU KV cache size: 269,568 tokens" (gpu_memory_utilization not shown: the
    default 0.9 assumed). vLLM 0.11 profiles an image of this size as 0.10.1.1 does."""
    p = serve_plan("qwen2.5-vl-3b", "l4", max_model_len=8192, max_num_batched_tokens=2048)
    assert any("budget of 16384 tokens, and profiled with 1 image items" in line for line in p.log)
    assert p.weights / GiB == pytest.approx(7.1550, rel=0.03)
    assert p.kv_available / GiB == pytest.approx(9.26, rel=0.07)
    assert p.tokens == pytest.approx(269568, rel=0.07)


def test_the_plan_adds_the_tower_and_the_larger_profile_phase() -> None:
    spec = resolve("qwen2.5-vl-7b")
    text = text_spec(spec)
    p = serve_plan("qwen2.5-vl-7b", "h100-sxm", max_model_len=32768)
    assert p.vision_weights == 2 * (spec.params - text.params) == 2 * 676_550_144
    assert p.encoder_held > 0 and p.encoder_peak > p.encoder_held
    skipped = serve_plan("qwen2.5-vl-7b", "h100-sxm", max_model_len=32768, skip_mm_profiling=True)
    assert skipped.encoder_peak == skipped.encoder_held == 0 and skipped.vision_weights == p.vision_weights
    lm_phase = skipped.profile_peak
    assert p.profile_peak == max(p.encoder_peak, p.encoder_held + lm_phase)
    # the language model's KV cache and forward are the text model's own
    assert p.bytes_per_token == 28 * 2 * 4 * 128 * 2
    assert any("Skipping memory profiling for multimodal encoder" in line for line in skipped.log)


def _write(tmp_path: Path, config: dict[str, Any]) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path / "config.json")


def test_the_scaled_encode_is_a_direct_trace(tmp_path: Path) -> None:
    """The encode is traced on one item of at most 4,096 patches and scaled: a tiny Qwen2.5-VL
    tower's activations at 128 x 128 patches are 4 times its 64 x 64 ones."""
    spec = resolve(_write(tmp_path, {**TINY, "max_position_embeddings": 200000}))
    p = profile(spec, max_model_len=200000, max_num_batched_tokens=4096, max_num_seqs=8,
                mm=MmSettings(limit_video=0, max_pixels=1792 * 1792))
    assert p is not None and p.grid == (1, 128, 128) and p.items == 1
    scaled = enc.encoder(spec, p, dtype="bf16", tp=1, gpu=get_gpu("h100-sxm"), out_hidden=64)
    _, (direct, patches) = enc._run(spec, (1, 128, 128), (128 * 128, 1176), "bf16", "h100-sxm")
    assert patches == 128 * 128
    assert abs((scaled.peak - p.pixel_bytes) - direct) <= 0.01 * direct


@pytest.mark.parametrize("config", [TINY, GEMMA3], ids=["qwen2_5_vl", "gemma3"])
def test_the_traced_encode_matches_a_real_cpu_run(tmp_path: Path, config: dict[str, Any]) -> None:
    spec = resolve(_write(tmp_path, config))
    family_qwen = config is TINY
    grid = (1, 16, 16) if family_qwen else (1, 1, 1)
    pixels = (256, 1176) if family_qwen else (1, 3, 56, 56)

    class Encode(torch.nn.Module):
        def __init__(self, m: torch.nn.Module) -> None:
            super().__init__()
            self.m = m

        def forward(self, **kw: Any) -> Any:
            return self.m.get_image_features(**kw)

    def make() -> torch.nn.Module:
        return Encode(build_model(spec, task="infer", attention="sdpa", device="cpu", dtype=torch.float32).model)

    def batch() -> dict[str, Any]:
        kw: dict[str, Any] = {"pixel_values": torch.randn(pixels)}
        if family_qwen:
            kw["image_grid_thw"] = torch.tensor([list(grid)])
        return kw

    ref = real_peak(make, batch, task="infer")
    params, (act, _) = enc._run(spec, grid, pixels, "fp32", None)
    weights = sum(p.numel() for p in make().parameters()) * 4
    assert abs(act + weights - ref) <= 0.01 * ref, (act + weights, ref)
    assert params > 0


def test_bad_multimodal_settings_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    cases = ((["qwen2.5-vl-7b", "--limit-mm-per-prompt", "audio=1"], "unknown modality 'audio'"),
             (["qwen2.5-vl-7b", "--limit-mm-per-prompt", "image=x"], "image=1,video=0"),
             (["qwen2.5-vl-7b", "--mm-processor-kwargs", '{"fps": 2}'], "'fps' is not modelled"),
             (["qwen2.5-vl-7b", "--mm-processor-kwargs", "max_pixels"], "JSON object"),
             (["qwen2.5-vl-7b", "--engine", "tgi"], "vLLM only"),
             (["qwen2.5-vl-7b", "--quantization", "fp8"], "quantised serving of a vision-language model"),
             (["llama-3.1-8b", "--skip-mm-profiling"], "takes no images"))
    for args, words in cases:
        try:
            code = main(["serve-plan", *args, "--gpu", "h100-sxm"])
        except SystemExit as e:  # argparse's own errors
            code = e.code
        err = capsys.readouterr().err
        assert code == 2 and words in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1, err


def test_the_cli_prints_the_encoder_line_and_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve-plan", "qwen2.5-vl-7b", "--gpu", "h100-sxm", "--max-model-len", "32768",
                 "--limit-mm-per-prompt", '{"video": 0}', "--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["vision_weights"] > 0 and d["encoder_peak"] > 0
    assert d["settings"]["limit_mm_per_prompt"] == {"video": 0}
    assert "--limit-mm-per-prompt '{\"video\": 0}'" in d["command"]
    assert vramplan.serve_plan is not None


def test_the_language_model_alone_traces_as_a_qwen2_decoder() -> None:
    """The profile forward traced (``method="trace"``): the language model without the tower, its
    multimodal RoPE as plain RoPE (the same tables)."""
    text = text_spec(resolve("qwen2.5-vl-3b"))
    assert text.model_type == "qwen2" and "rope_scaling" not in text.config and text.tie_embeddings
    p = serve_plan("qwen2.5-vl-3b", "l4", max_model_len=8192, max_num_batched_tokens=2048, method="trace")
    assert p.profile_method == "trace" and p.starts


def test_a_text_models_plan_still_imports_no_torch() -> None:
    """The multimodal and speculative rules are pure arithmetic: planning a text model stays
    torch-free (a fraction of a second), as before them."""
    import subprocess
    import sys

    code = ("import sys; from vramplan.serving.api import serve_plan; "
            "p = serve_plan('llama-3.1-8b', 'h100-sxm', speculative_config={'method': 'eagle', "
            "'num_speculative_tokens': 2}); print('torch' in sys.modules, p.draft_layers)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["False", "1"], out.stderr[-2000:]
