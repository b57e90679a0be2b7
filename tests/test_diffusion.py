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
