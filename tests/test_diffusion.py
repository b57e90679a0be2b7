"""Diffusion transformers from the catalog: FLUX.1-dev's transformer built from its published
config, a denoising step's inputs as FluxPipeline makes them, the traced step against a real CPU
run, diffusers' own checkpointing switch and LoRA targets."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import vramplan
from vramplan.models.build import build_model, example_inputs
from vramplan.models.catalog import resolve
from vramplan.models.normalize import spec_from_config
from vramplan.trace.run import TraceOptions, trace_model
from vramplan.trace.testing import real_peak
from vramplan.workload import Workload

pytest.importorskip("diffusers")

SMALL = {"num_layers": 1, "num_single_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2,
         "joint_attention_dim": 32, "pooled_projection_dim": 16, "axes_dims_rope": [4, 6, 6]}


def small() -> Any:
    cfg = copy.deepcopy(dict(resolve("flux.1-dev").config))
    cfg.update(SMALL)
    return spec_from_config(cfg, name="small-flux", source="test")


def test_the_step_is_fluxpipelines() -> None:
    spec = resolve("flux.1-dev")
    assert spec.params == 11_901_408_320 and spec.layers == 19 + 38
    x = example_inputs(spec, batch=2, image_size=1024, image_height=768)
    assert x["hidden_states"].shape == (2, 64 * 48, 64)  # a token per 16 x 16 pixels, 2 x 2 patches of 16 channels
    assert x["encoder_hidden_states"].shape == (2, 512, 4096) and x["txt_ids"].shape == (512, 3)
    assert x["img_ids"].shape == (64 * 48, 3) and x["guidance"].shape == (2,)
    with pytest.raises(vramplan.VramplanError, match="multiples of 16"):
        example_inputs(spec, batch=1, image_size=1000)


@pytest.mark.parametrize("task", ["train", "infer"])
def test_a_traced_flux_step_matches_a_real_cpu_run(task: str) -> None:
    spec = small()

    def make() -> Any:
        return build_model(spec, task=task, device="cpu", dtype=torch.float32)

    def batch() -> dict[str, Any]:
        return example_inputs(spec, batch=2, image_size=128, device="cpu")

    ref = real_peak(make, batch, task=task)
    w = Workload(task=task, precision="fp32", optimizer="adamw")
    r = trace_model(make, batch(), workload=w, options=TraceOptions(workspaces=False))
    assert abs(r.peak_allocated - ref) / ref < 0.01, (r.peak_allocated, ref)


def test_lora_training_of_flux_uses_diffusers_own_switches() -> None:
    r = vramplan.estimate("flux.1-dev", task="train", peft="lora", checkpointing="full", image_size=1024, method="trace",
                          gpu="h100-sxm")
    assert any("diffusers enable_gradient_checkpointing: transformer_blocks (19), single_transformer_blocks (38)" in n
               for n in r.notes)
    assert any("LoRA r=16 on to_k, to_out.0, to_q, to_v" in n for n in r.notes)
    assert r.model_states is not None and r.model_states.weights >= 11_901_408_320 * 2
    infer = vramplan.estimate("flux.1-dev", task="infer", precision="bf16", image_size=1024, method="trace",
                              gpu="h100-sxm")
    assert infer.breakdown.weights >= 11_901_408_320 * 2 and infer.peak.allocated < r.peak.allocated


def _lora_step_matches_a_real_cpu_run(spec: Any) -> None:
    """A LoRA training step of the denoiser as diffusers' LoRA training scripts set it up (peft
    adapters on to_k, to_q, to_v, to_out.0; the base frozen), traced and run for real."""
    from peft import LoraConfig, get_peft_model

    from vramplan.trace.features import DIFFUSERS_LORA_TARGETS

    def make() -> Any:
        model = build_model(spec, task="train", device="cpu", dtype=torch.float32)
        return get_peft_model(model, LoraConfig(r=4, lora_alpha=4, target_modules=list(DIFFUSERS_LORA_TARGETS)))

    def batch() -> dict[str, Any]:
        return example_inputs(spec, batch=2, image_size=128, device="cpu")

    ref = real_peak(make, batch, task="train")
    w = Workload(task="train", precision="fp32", optimizer="adamw")
    r = trace_model(make, batch(), workload=w, options=TraceOptions(workspaces=False))
    assert 0 < r.trainable_params < r.params // 10
    assert abs(r.peak_allocated - ref) / ref < 0.01, (r.peak_allocated, ref)


def test_a_traced_flux_lora_step_matches_a_real_cpu_run() -> None:
    """train_dreambooth_lora_flux.py's adapters on the FLUX transformer."""
    _lora_step_matches_a_real_cpu_run(small())


def test_a_traced_unet_lora_step_matches_a_real_cpu_run() -> None:
    """DreamBooth-LoRA of a Stable Diffusion UNet (train_dreambooth_lora.py's adapters)."""
    cfg = copy.deepcopy(dict(resolve("sd15-unet").config))
    cfg.update({"block_out_channels": [32, 64, 64, 64], "layers_per_block": 1, "norm_num_groups": 8,
                "cross_attention_dim": 16, "attention_head_dim": 4, "sample_size": 8})
    _lora_step_matches_a_real_cpu_run(spec_from_config(cfg, name="small-unet", source="test"))


# --- Wan 2.1 T2V 1.3B's transformer: a video denoiser's step --------------------------------

WAN_SMALL = {"num_attention_heads": 2, "attention_head_dim": 16, "text_dim": 32, "freq_dim": 16, "ffn_dim": 64,
             "num_layers": 2, "rope_max_seq_len": 64}


def small_wan() -> Any:
    cfg = copy.deepcopy(dict(resolve("wan2.1-t2v-1.3b").config))
    cfg.update(WAN_SMALL)
    return spec_from_config(cfg, name="small-wan", source="test")


def test_the_wan_step_is_wanpipelines_denoiser_call(tmp_path: Any) -> None:
    """The inputs ``example_inputs`` makes for the catalog's Wan transformer are the ones
    WanPipeline itself passes it (a real tiny pipeline, its transformer the catalog config at a
    small width, run on the CPU: 10 frames rounded to 9, 3 latent frames), and the 1.3B's
    defaults are the pipeline's 832 x 480, 81 frames, 512 UMT5 states."""
    import json

    from vramplan.models.pipelines import build_pipeline, read_pipeline

    spec = resolve("wan2.1-t2v-1.3b")
    assert (spec.params, spec.layers, spec.hidden, spec.intermediate) == (1_418_996_800, 30, 1536, 8960)
    x = example_inputs(spec, batch=2)
    assert x["hidden_states"].shape == (2, 16, 21, 60, 104) and x["encoder_hidden_states"].shape == (2, 512, 4096)
    assert x["timestep"].shape == (2,)

    small = small_wan()
    files = {"model_index.json": {"_class_name": "WanPipeline",
                                  "scheduler": ["diffusers", "UniPCMultistepScheduler"],
                                  "text_encoder": ["transformers", "UMT5EncoderModel"],
                                  "tokenizer": ["transformers", "T5TokenizerFast"],
                                  "transformer": ["diffusers", "WanTransformer3DModel"],
                                  "vae": ["diffusers", "AutoencoderKLWan"]},
             "scheduler/scheduler_config.json": {"_class_name": "UniPCMultistepScheduler", "flow_shift": 3.0,
                                                 "prediction_type": "flow_prediction", "use_flow_sigmas": True},
             "text_encoder/config.json": {"model_type": "umt5", "vocab_size": 303, "d_model": 32, "d_kv": 8,
                                          "d_ff": 64, "num_layers": 1, "num_heads": 4, "pad_token_id": 0,
                                          "eos_token_id": 1, "decoder_start_token_id": 0,
                                          "feed_forward_proj": "gated-gelu"},
             "transformer/config.json": dict(small.config),
             "vae/config.json": {"_class_name": "AutoencoderKLWan", "base_dim": 16, "z_dim": 16,
                                 "dim_mult": [1, 2, 4, 4], "num_res_blocks": 1,
                                 "temperal_downsample": [False, True, True]}}
    for name, data in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(json.dumps(data))
    pipe = build_pipeline(read_pipeline(tmp_path), torch.float32)
    seen: dict[str, Any] = {}

    def hook(_m: Any, _a: Any, kw: dict[str, Any]) -> None:
        seen.setdefault("kw", {k: v for k, v in kw.items() if isinstance(v, torch.Tensor)})

    pipe.transformer.register_forward_pre_hook(hook, with_kwargs=True)
    torch.manual_seed(0)
    pipe(prompt="a cat", height=64, width=96, num_frames=10, num_inference_steps=1, guidance_scale=1.0,
         output_type="latent")
    ours = example_inputs(small, batch=1, image_size=96, image_height=64, frames=10, device="cpu")
    assert {k: (tuple(v.shape), v.dtype) for k, v in seen["kw"].items()} == \
        {k: (tuple(v.shape), v.dtype) for k, v in ours.items()}
    assert ours["hidden_states"].shape == (1, 16, 3, 8, 12)
    with pytest.raises(vramplan.VramplanError, match="multiples of 16"):
        example_inputs(small, batch=1, image_size=100, frames=9)


@pytest.mark.parametrize("task", ["train", "infer"])
def test_a_traced_wan_step_matches_a_real_cpu_run(task: str) -> None:
    spec = small_wan()

    def make() -> Any:
        return build_model(spec, task=task, device="cpu", dtype=torch.float32)

    def batch() -> dict[str, Any]:
        return example_inputs(spec, batch=2, image_size=64, image_height=48, frames=9, device="cpu")

    ref = real_peak(make, batch, task=task)
    w = Workload(task=task, precision="fp32", optimizer="adamw")
    r = trace_model(make, batch(), workload=w, options=TraceOptions(workspaces=False))
    assert abs(r.peak_allocated - ref) / ref < 0.01, (r.peak_allocated, ref)


def test_wan_estimate_takes_frames_and_wanpipelines_own_size() -> None:
    r = vramplan.estimate("wan2.1-t2v-1.3b", task="infer", frames=10, image_size=480, image_height=320,
                          method="trace")
    assert r.params == 1_418_996_800
    note = next(n for n in r.notes if n.startswith("one WanPipeline denoiser call"))
    assert "9 frames (`frames=10` rounded as WanPipeline rounds it" in note and "480 x 320" in note
    assert "[16, 3, 40, 60], 1,800 tokens" in note
    assert "the denoiser alone: WanPipeline's UMT5 text encoding and its VAE decode" in note
    own = vramplan.estimate("wan2.1-t2v-1.3b", task="infer", method="trace")
    assert any("81 frames (WanPipeline's default), 832 x 480 (WanPipeline's default)" in n for n in own.notes)
    assert own.peak.allocated > r.peak.allocated
    with pytest.raises(vramplan.VramplanError, match="applies to a whole diffusers pipeline"):
        vramplan.estimate("flux.1-dev", task="infer", frames=9, method="trace")
