"""Every catalog family traces (tiny configs: 2 layers, hidden 64), with exact weights."""

from __future__ import annotations

import pytest

from vramplan.trace.run import TraceOptions, trace_workload
from vramplan.trace.testing import tiny_spec
from vramplan.workload import Phase, Workload

NO_WS = TraceOptions(workspaces=False)
FAMILIES = [
    "llama-3.1-8b", "qwen2.5-7b", "gemma-2-2b", "gemma-3-1b", "phi-3-mini", "mistral-7b", "gpt2",
    "mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v2-lite", "deepseek-v3", "bert-base", "vit-base", "resnet-50",
    "sd15-unet",
]
DECODERS = ["llama-3.1-8b", "gemma-3-1b", "gpt2", "mixtral-8x7b", "deepseek-v3"]


def _workload(spec, **kw) -> Workload:
    image = 32 if spec.model_type in ("vit", "resnet") else 64
    return Workload(**{"task": "train", "batch": 2, "seq": 32, "image_size": image, "precision": "bf16", **kw})


@pytest.mark.parametrize("name", FAMILIES)
def test_family_trains_with_exact_weights_and_gradients(name: str) -> None:
    spec = tiny_spec(name)
    r = trace_workload(spec, _workload(spec), options=NO_WS, iterations=1)
    if spec.params:  # the catalog's parameter formula (UNet and ResNet are trace-only)
        assert r.params == spec.params
    opt = [p for p in r.phases if p.phase is Phase.OPTIMIZER][0].breakdown
    assert opt.weights >= r.params * 2  # bf16 weights (+ buffers)
    assert opt.optimizer == r.trainable_params * 2 * 2  # AdamW: two bf16 states
    assert max(p.breakdown.gradients for p in r.phases) == r.trainable_params * 2
    assert r.flops and r.flops > 2 * 3 * r.params  # forward + backward touch every weight at least once


@pytest.mark.parametrize("name", DECODERS)
def test_decoder_generation_fills_the_kv_cache(name: str) -> None:
    spec = tiny_spec(name)
    w = _workload(spec, task="generate", new_tokens=3)
    r = trace_workload(spec, w, options=NO_WS, iterations=1)
    phases = {p.phase: p for p in r.phases}
    assert phases[Phase.PREFILL].breakdown.kv_cache > 0
    assert phases[Phase.DECODE].breakdown.kv_cache > phases[Phase.PREFILL].breakdown.kv_cache * 0.9
    assert max(p.breakdown.gradients + p.breakdown.optimizer for p in r.phases) == 0


def test_dense_kv_cache_matches_its_formula() -> None:
    spec = tiny_spec("llama-3.1-8b")
    r = trace_workload(spec, _workload(spec, task="generate", new_tokens=1), options=NO_WS, iterations=1)
    prefill = [p for p in r.phases if p.phase is Phase.PREFILL][0]
    kv = 2 * spec.layers * spec.kv_heads * spec.head_dim * 32 * 2 * 2  # k+v, layers, heads, dim, seq, batch, bf16
    assert prefill.breakdown.kv_cache == kv


def test_moe_experts_follow_the_gpu_and_dtype() -> None:
    spec = tiny_spec("mixtral-8x7b")
    bf16 = trace_workload(spec, _workload(spec), options=NO_WS, iterations=1)
    assert any("'grouped_mm'" in n for n in bf16.notes)
    mixed = trace_workload(spec, _workload(spec, precision="bf16-mixed"), options=NO_WS, iterations=1)
    assert any("'eager'" in n for n in mixed.notes) and any("uniform expert load" in n for n in mixed.notes)
