"""build_model / example_inputs: heads, dtype, attention, modes, and inputs the real forward accepts.

Forward passes run on CPU with shrunken copies of catalog configs (same architecture, tiny
sizes), so that the inputs are checked against the actual model code.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from vramplan.errors import TraceError, WorkloadError
from vramplan.models import build_model, example_inputs, resolve
from vramplan.models.build import attention_used
from vramplan.models.normalize import spec_from_config
from vramplan.models.spec import ModelSpec

TINY: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {"hidden_size": 32, "head_dim": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "num_hidden_layers": 2, "intermediate_size": 48, "vocab_size": 64},
    "mixtral-8x7b": {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "num_hidden_layers": 2, "intermediate_size": 24, "vocab_size": 64},
    "deepseek-v2-lite": {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 4,
                         "num_hidden_layers": 2, "intermediate_size": 24, "moe_intermediate_size": 8,
                         "n_routed_experts": 4, "num_experts_per_tok": 2, "kv_lora_rank": 8,
                         "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "v_head_dim": 8, "vocab_size": 64},
    "gpt2": {"n_embd": 32, "n_head": 4, "n_layer": 2, "vocab_size": 64, "n_positions": 32},
    "bert-base": {"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2,
                  "intermediate_size": 48, "vocab_size": 64, "max_position_embeddings": 32},
    "vit-base": {"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2,
                 "intermediate_size": 48, "image_size": 32, "patch_size": 8},
    "resnet-50": {"embedding_size": 8, "hidden_sizes": [8, 16, 16, 32], "depths": [1, 1, 1, 1]},
    "sd15-unet": {"block_out_channels": [32, 64, 64, 64], "layers_per_block": 1,
                  "norm_num_groups": 8, "cross_attention_dim": 16, "attention_head_dim": 4,
                  "sample_size": 8},
    "flux1-dev-transformer": {"num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
                              "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 16,
                              "axes_dims_rope": [4, 6, 6]},
}


def tiny(alias: str) -> ModelSpec:
    cfg = copy.deepcopy(dict(resolve(alias).config))
    cfg.update(TINY[alias])
    return spec_from_config(cfg, name=f"tiny-{alias}", source="test")


def _loss(out: Any) -> torch.Tensor:
    if getattr(out, "loss", None) is not None:
        return out.loss
    sample = out.sample if hasattr(out, "sample") else out.last_hidden_state
    return sample.float().pow(2).mean()


@pytest.mark.parametrize(("alias", "head"), [
    ("llama-3.2-1b", None), ("llama-3.2-1b", "sequence-classification"), ("mixtral-8x7b", None),
    ("deepseek-v2-lite", None), ("gpt2", None), ("bert-base", None),
    ("bert-base", "sequence-classification"), ("vit-base", None), ("resnet-50", None),
    ("sd15-unet", None), ("flux1-dev-transformer", None),
])
def test_example_inputs_run_forward_and_backward_on_cpu(alias: str, head: str | None) -> None:
    spec = tiny(alias)
    torch.manual_seed(0)
    model = build_model(spec, device="cpu", dtype=torch.float32, head=head)
    inputs = example_inputs(spec, batch=2, seq=8, device="cpu", head=head,
                            image_size=64 if alias == "flux1-dev-transformer" else None)
    loss = _loss(model(**inputs))
    loss.backward()
    assert torch.isfinite(loss)
    assert any(p.grad is not None for p in model.parameters())


def test_vit_other_resolution_interpolates_positions() -> None:
    spec = tiny("vit-base")
    model = build_model(spec, device="cpu", dtype="float32")
    inputs = example_inputs(spec, batch=1, image_size=48, device="cpu")
    assert inputs["interpolate_pos_encoding"] is True
    assert model(**inputs).logits.shape == (1, 1000)


def test_example_input_shapes_on_meta() -> None:
    llama = example_inputs(resolve("llama-3.1-8b"), batch=4, seq=2048)
    assert llama["input_ids"].shape == llama["labels"].shape == (4, 2048)
    assert llama["input_ids"].device.type == "meta"
    vit = example_inputs(resolve("vit-base"), batch=3)
    assert vit["pixel_values"].shape == (3, 3, 224, 224) and vit["labels"].shape == (3,)
    unet = example_inputs(resolve("sd15-unet"), batch=2, dtype="bf16")
    assert unet["sample"].shape == (2, 4, 64, 64) and unet["sample"].dtype == torch.bfloat16
    assert unet["encoder_hidden_states"].shape == (2, 77, 768)
    assert "labels" not in example_inputs(resolve("gpt2"), batch=1, seq=8, labels=False)


def test_learned_positions_limit_seq() -> None:
    with pytest.raises(WorkloadError, match="exceeds gpt2's 1024 learned positions"):
        example_inputs(resolve("gpt2"), batch=1, seq=2048)
    example_inputs(resolve("llama-3.1-8b"), batch=1, seq=200_000)  # RoPE: no table to overflow


def test_patch_multiple_enforced() -> None:
    with pytest.raises(WorkloadError, match="not a multiple of vit-base's patch size 16"):
        example_inputs(resolve("vit-base"), batch=1, image_size=100)


def test_dtype_defaults_to_checkpoint_and_can_be_overridden() -> None:
    spec = resolve("llama-3.2-1b")
    assert next(build_model(spec).parameters()).dtype == torch.bfloat16
    assert next(build_model(spec, dtype=torch.float32).parameters()).dtype == torch.float32
    assert next(build_model(resolve("gemma-2-2b")).parameters()).dtype == torch.float32
    with pytest.raises(WorkloadError, match="unknown dtype"):
        build_model(spec, dtype="float8")


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_attention_implementation_passes_through(attention: str) -> None:
    assert attention_used(build_model(resolve("llama-3.2-1b"), attention=attention)) == attention
    assert attention_used(build_model(resolve("sd15-unet"), attention=attention)) == attention


def test_architecture_without_sdpa_runs_eager() -> None:
    assert attention_used(build_model(resolve("gemma-2-2b"), attention="sdpa")) == "eager"


def test_flash_without_flash_attn_is_trace_error() -> None:
    pytest.importorskip("torch")
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        with pytest.raises(TraceError, match="attention 'flash' is not available"):
            build_model(resolve("llama-3.2-1b"), attention="flash")
    else:  # pragma: no cover - only where flash_attn is installed
        pytest.skip("flash_attn installed")


def test_task_sets_mode() -> None:
    spec = resolve("bert-base")
    assert build_model(spec, task="train").training
    assert not build_model(spec, task="infer").training


def test_unsupported_head_is_trace_error() -> None:
    with pytest.raises(TraceError, match="head 'masked-lm' is not available"):
        build_model(resolve("llama-3.1-8b"), head="masked-lm")


def test_unknown_model_type_is_trace_error() -> None:
    spec = spec_from_config({"model_type": "not-a-model", "hidden_size": 8}, name="x", source="test")
    with pytest.raises(TraceError, match="cannot build model_type 'not-a-model'"):
        build_model(spec)


def test_quantization_config_and_remote_code_are_ignored() -> None:
    spec = resolve("deepseek-v2-lite")  # auto_map (remote code) in the published config
    model = build_model(spec)
    assert type(model).__module__.startswith("transformers.")
