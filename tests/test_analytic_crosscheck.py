"""The analytic estimator against formulas the literature agrees on.

ZeRO (Rajbhandari et al. 2020), Korthikanti et al. 2022 (activations of GPT-3 175B),
KV-cache sizes, QLoRA's double quantisation (Dettmers et al. 2023).
"""

from __future__ import annotations

import pytest

from test_analytic_specs import (
    LLAMA_8B_PARAMS,
    deepseek_v3,
    gpt3_175b,
    llama_8b,
    llama_70b,
    mistral_7b,
)
from vramplan.analytic import estimate
from vramplan.analytic.activations import TokenShape, size
from vramplan.analytic.blocks import Ctx, block_input, block_saved
from vramplan.analytic.estimate import build_arch
from vramplan.analytic.regime import regime, trainable
from vramplan.analytic.states import quantised_bytes
from vramplan.workload import Parallel, Quant, Workload

PSI = LLAMA_8B_PARAMS


def _train(**kw):
    return Workload(task="train", precision="bf16-mixed", optimizer="adamw", batch=1, seq=2048, **kw)


def test_mixed_precision_adam_is_16_bytes_per_parameter():
    est = estimate(llama_8b(), _train())
    assert est.states.total == pytest.approx(16 * PSI, rel=1e-3)
    # PyTorch AMP: fp32 params (4Ψ), fp32 grads (4Ψ), two fp32 Adam moments (8Ψ)
    assert est.states.weights == pytest.approx(4 * PSI, rel=1e-3)
    assert est.states.gradients == pytest.approx(4 * PSI, rel=1e-3)
    assert est.states.optimizer == pytest.approx(8 * PSI, rel=1e-3)
    assert est.params == PSI and est.trainable_params == PSI


@pytest.mark.parametrize("dp", [2, 8, 64])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_match_the_paper(stage, dp):
    est = estimate(llama_8b(), _train(parallel=Parallel(dp=dp, zero=stage)))
    s = est.states
    if stage == 1:  # 4Ψ + 12Ψ/N
        assert s.weights + s.gradients == pytest.approx(4 * PSI, rel=1e-3)
        assert s.optimizer == pytest.approx(12 * PSI / dp, rel=1e-3)
    elif stage == 2:  # 2Ψ + 14Ψ/N
        assert s.weights == pytest.approx(2 * PSI, rel=1e-3)
        assert s.gradients + s.optimizer == pytest.approx(14 * PSI / dp, rel=1e-3)
    else:  # 16Ψ/N
        assert s.total == pytest.approx(16 * PSI / dp, rel=1e-3)


def test_zero3_over_8_ranks_holds_an_eighth_of_the_states():
    full = estimate(llama_8b(), _train()).states.total
    sharded = estimate(llama_8b(), _train(parallel=Parallel(dp=8, zero=3)))
    assert sharded.states.total == pytest.approx(full / 8, rel=1e-3)
    # the gathered layers are extra weights at the forward's peak, not persistent states
    fwd = sharded.phases[0].breakdown
    assert fwd.weights > sharded.states.weights


def _korthikanti(tp: int = 1, sp: bool = False, selective: bool = False) -> tuple[int, float]:
    """(analytic per-layer bytes, Korthikanti's) for GPT-3 175B, s=2048, b=1, fp16, eager."""
    spec = gpt3_175b()
    s, b, h, a = 2048, 1, 12288, 96
    w = Workload(task="train", precision="fp16", attention="eager", batch=b, seq=s,
                 parallel=Parallel(tp=tp, sp=sp), checkpointing="selective" if selective else "none")
    arch = build_arch(spec)
    ctx = Ctx(regime(w), trainable(arch, w), w.attention)
    got = size(block_saved(arch.groups[0], ctx, h), TokenShape(s * b, s, tp, sp), core=not selective)
    core = 0.0 if selective else 5 * a * s / h
    if sp:
        want = s * b * h * (34 + core) / tp
    else:
        want = s * b * h * (10 + 24 / tp + core / tp)
    return got, want


@pytest.mark.parametrize("tp,sp,selective", [
    (1, False, False), (8, False, False), (8, True, False), (8, False, True), (8, True, True), (4, True, False),
])
def test_gpt3_activations_match_korthikanti(tp, sp, selective):
    got, want = _korthikanti(tp, sp, selective)
    assert got == pytest.approx(want, rel=1e-3)  # LayerNorm mean/rstd (16 B/token) are the difference


def test_gpt3_per_layer_activations_through_the_public_api():
    s, h, a = 2048, 12288, 96
    est = estimate(gpt3_175b(), Workload(task="train", precision="fp16", attention="eager", batch=1, seq=s))
    assert est.activations_per_layer == pytest.approx(s * h * (34 + 5 * a * s / h), rel=1e-3)


def test_full_recompute_keeps_2sbh_per_layer():
    spec, s, h = gpt3_175b(), 2048, 12288
    w = Workload(task="train", precision="fp16", batch=1, seq=s, checkpointing="full")
    arch = build_arch(spec)
    ctx = Ctx(regime(w), trainable(arch, w), w.attention)
    assert size(block_input(ctx, h), TokenShape(s, s)) == 2 * s * h


def test_flash_removes_the_quadratic_term():
    s, h = 2048, 12288
    eager = estimate(gpt3_175b(), Workload(task="train", precision="fp16", attention="eager", seq=s))
    flash = estimate(gpt3_175b(), Workload(task="train", precision="fp16", attention="flash", seq=s))
    # flash keeps q, k, v, out (+ fp32 logsumexp) instead of the 5as² score tensors
    saved = eager.activations_per_layer - flash.activations_per_layer
    assert saved == pytest.approx(s * h * 5 * 96 * s / h - s * 96 * 4, rel=1e-3)


def test_llama_70b_kv_cache_is_320_kib_per_token():
    tokens = 1000 + 24
    est = estimate(llama_70b(), Workload(task="generate", precision="bf16", batch=1, seq=1000, new_tokens=24))
    assert est.kv_cache == 320 * 1024 * tokens
    assert est.phases[-1].breakdown.kv_cache == est.kv_cache


@pytest.mark.parametrize("kv_dtype,factor", [("fp8", 0.5), ("int8", 0.5), ("int4", 0.25), ("fp32", 2.0)])
def test_kv_dtype_scales_the_cache(kv_dtype, factor):
    w = Workload(task="generate", precision="bf16", batch=4, seq=512, new_tokens=512)
    base = estimate(llama_70b(), w).kv_cache
    assert estimate(llama_70b(), w.replace(kv_dtype=kv_dtype)).kv_cache == pytest.approx(base * factor)


def test_tensor_parallel_splits_kv_heads():
    w = Workload(task="generate", precision="bf16", batch=2, seq=4096, new_tokens=128)
    one = estimate(llama_70b(), w).kv_cache
    assert estimate(llama_70b(), w.replace(tp=8)).kv_cache == one // 8


def test_sliding_window_caps_the_cache():
    w = Workload(task="generate", precision="bf16", batch=1, seq=16000, new_tokens=384)
    per_token = 2 * 32 * 8 * 128 * 2  # Mistral 7B: layers, kv heads, head dim, bf16
    assert estimate(mistral_7b(), w).kv_cache == per_token * 4096


def test_mla_caches_the_compressed_latent():
    w = Workload(task="generate", precision="bf16", batch=2, seq=1000, new_tokens=24)
    est = estimate(deepseek_v3(), w)
    assert est.kv_cache == 61 * (512 + 64) * 2 * 1024 * 2


def test_qlora_double_quantisation_costs_0127_bits_per_parameter():
    elems = 4096 * 14336
    bits = quantised_bytes(elems, 14336, Quant.NF4, double=True) * 8 / elems
    assert bits - 4 == pytest.approx(0.127, abs=1e-3)
    single = quantised_bytes(elems, 14336, Quant.NF4) * 8 / elems
    assert single - 4 == pytest.approx(0.5, abs=1e-3)  # fp32 absmax per 64 values


def test_int8_keeps_a_scale_per_row():
    assert quantised_bytes(4096 * 1024, 1024, Quant.INT8) == 4096 * 1024 + 4 * 1024


def test_foreach_adamw_step_holds_one_state_sized_temporary():
    foreach = estimate(llama_8b(), _train()).phases[-1]
    fused = estimate(llama_8b(), _train(optimizer_impl="fused")).phases[-1]
    # torch's _multi_tensor_adam: exp_avg_sq_sqrt = _foreach_sqrt(exp_avg_sqs) for all params (fp32)
    assert foreach.breakdown.temporaries - fused.breakdown.temporaries == pytest.approx(4 * PSI, rel=1e-3)
    assert foreach.allocated > fused.allocated


def test_logits_of_every_position_dominate_a_checkpointed_forward():
    b, s, v = 8, 4096, 128256
    est = estimate(llama_8b(), _train(checkpointing="full").replace(batch=b, seq=s))
    fwd = est.phases[0].breakdown
    # checkpoints (fp32 hidden per layer) + 16-bit logits + fp32 log-softmax; fp32 upcast is temporary
    checkpoints = 32 * b * s * 4096 * 4
    assert fwd.activations >= checkpoints + b * s * v * (2 + 4)
    assert fwd.temporaries >= b * s * v * 4
