"""Workload features: checkpointing, LoRA/QLoRA, quantised storage, optimizers, precision."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vramplan.errors import TraceError
from vramplan.events import Action, Category
from vramplan.trace import analysis
from vramplan.trace.quant import QuantLinear
from vramplan.trace.run import TraceOptions, trace_model, trace_workload
from vramplan.trace.testing import tiny_spec
from vramplan.workload import Phase, Quant, Workload

NO_WS = TraceOptions(workspaces=False)
BASE = dict(task="train", batch=2, seq=128, precision="bf16-mixed")


@pytest.fixture(scope="module")
def llama():
    return tiny_spec("llama-3.1-8b", layers=4)


def _forward_end_activations(r) -> int:
    log = r.events
    fwd = [k for k in range(len(log)) if log.phase[k] == list(Phase).index(Phase.FORWARD) and log.iteration[k] == 1]
    a = analysis.arrays(log)
    return analysis.breakdown_at(a, fwd[-1]).activations


def _phase_names(r) -> set[str]:
    return {str(p.phase) for p in r.phases}


def test_checkpointing_trades_activations_for_recompute(llama) -> None:
    runs = {c: trace_workload(llama, Workload(**BASE, checkpointing=c), options=NO_WS)
            for c in ("none", "selective", "full")}
    acts = {c: _forward_end_activations(r) for c, r in runs.items()}
    assert acts["full"] < acts["selective"] < acts["none"]
    assert "recompute" not in _phase_names(runs["none"])
    assert "recompute" in _phase_names(runs["full"]) and "recompute" in _phase_names(runs["selective"])
    half = trace_workload(llama, Workload(**BASE, checkpointing="full", checkpoint_fraction=0.5), options=NO_WS)
    assert acts["full"] < _forward_end_activations(half) < acts["none"]
    assert any("2 layers" in n for n in half.notes)


def test_recompute_runs_under_autocast_and_fused_attention(llama) -> None:
    r = trace_workload(llama, Workload(**BASE, checkpointing="full"), options=NO_WS)
    log = r.events
    rec = [log.strings[log.op[k]] for k in range(len(log)) if log.phase[k] == list(Phase).index(Phase.RECOMPUTE)]
    assert any("flash_attention" in o for o in rec)
    descs = [log.strings[log.desc[k]] for k in range(len(log)) if log.phase[k] == list(Phase).index(Phase.RECOMPUTE)
             and "mm" in log.strings[log.op[k]] and log.action[k] == Action.ALLOC]
    assert descs and all(d.startswith("bf16") for d in descs)


def test_lora_trains_only_the_adapters(llama) -> None:
    r = trace_workload(llama, Workload(**BASE, peft="lora", lora_rank=8), options=NO_WS)
    h, layers = 64, 4
    # q_proj, k_proj, v_proj, o_proj: A[r,in] + B[out,r]; kv heads 2 of dim 16 -> k/v out = 32
    per_layer = sum(8 * (i + o) for i, o in ((h, h), (h, 32), (h, 32), (h, h)))
    assert r.trainable_params == layers * per_layer
    grads = max(p.breakdown.gradients for p in r.phases)
    assert grads == r.trainable_params * 4  # fp32 adapters
    opt = [p for p in r.phases if p.phase is Phase.OPTIMIZER][0]
    assert opt.breakdown.optimizer == 2 * r.trainable_params * 4
    assert any("LoRA r=8" in n for n in r.notes)


def test_lora_on_the_head_and_embedding_is_traced(llama) -> None:
    """peft wraps ``lm_head`` and ``embed_tokens`` when asked: their adapters train too (the
    analytic method refuses these targets rather than leave them out)."""
    h, layers, vocab, r = 64, 4, 256, 8
    q = layers * r * (h + h)
    for target, extra in (("lm_head", r * (h + vocab)), ("embed_tokens", r * (vocab + h))):
        got = trace_workload(llama, Workload(**BASE, peft="lora", lora_rank=r, lora_targets=("q_proj", target)),
                             options=NO_WS)
        assert got.trainable_params == q + extra, target
        assert any(target in n for n in got.notes if "LoRA" in n)


def test_dora_trains_a_magnitude_per_output_feature_and_rebuilds_each_weight(llama) -> None:
    """peft's DoRA: one fp32 magnitude per output feature of each adapted layer (trained, with its
    gradient and AdamW states), and in every forward the adapted weight rebuilt at full size
    (``lora_B @ lora_A`` through an identity, plus the base weight) to take its row norms."""
    w = Workload(**BASE, peft="lora", lora_rank=8)
    lora = trace_workload(llama, w, options=NO_WS)
    dora = trace_workload(llama, w.replace(lora_dora=True), options=NO_WS)
    layers, outs = 4, 64 + 32 + 32 + 64  # q, k, v, o output features
    assert dora.trainable_params == lora.trainable_params + layers * outs
    assert max(p.breakdown.gradients for p in dora.phases) == 4 * dora.trainable_params
    opt = [p for p in dora.phases if p.phase is Phase.OPTIMIZER][0]
    assert opt.breakdown.optimizer == 2 * 4 * dora.trainable_params
    log = dora.events
    rebuilt = {log.strings[log.desc[k]] for k in range(len(log))
               if log.action[k] == Action.ALLOC and "lora_magnitude_vector" in log.strings[log.module[k]]}
    assert {"f32[64,64]", "f32[32,64]"} <= rebuilt  # q/o and k/v weights, rebuilt in fp32 (the adapters' dtype)
    assert dora.peak_allocated > lora.peak_allocated
    assert any(n.startswith("DoRA r=8") for n in dora.notes)


def test_rslora_changes_no_memory(llama) -> None:
    w = Workload(**BASE, peft="lora", lora_rank=8)
    lora = trace_workload(llama, w, options=NO_WS)
    rs = trace_workload(llama, w.replace(lora_rslora=True), options=NO_WS)
    assert list(rs.events.size) == list(lora.events.size) and rs.peak_allocated == lora.peak_allocated
    assert any("rsLoRA" in n for n in rs.notes)


def test_modules_to_save_train_a_copy_of_each_module(llama) -> None:
    """peft's ``modules_to_save``: a trainable copy of each named module beside the frozen
    original (weights, gradients and AdamW states of the copy, in the base's bf16)."""
    w = Workload(**BASE, peft="lora", lora_rank=8)
    lora = trace_workload(llama, w, options=NO_WS)
    head = 256 * 64  # vocab × hidden
    for save, n in ((("lm_head",), 1), (("embed_tokens", "lm_head"), 2)):
        got = trace_workload(llama, w.replace(lora_modules_to_save=save), options=NO_WS)
        assert got.trainable_params == lora.trainable_params + n * head
        assert got.breakdown_at_peak.weights - lora.breakdown_at_peak.weights == n * head * 2
        assert max(p.breakdown.gradients for p in got.phases) - max(p.breakdown.gradients for p in lora.phases) == n * head * 2
        assert any("trained in full" in note for note in got.notes)
    with pytest.raises(TraceError, match="no module named nope") as e:
        trace_workload(llama, w.replace(lora_modules_to_save="nope"), options=NO_WS)
    assert "lm_head" in e.value.hint


def test_dora_over_quantised_weights_is_refused_with_the_reason() -> None:
    from vramplan.errors import WorkloadError

    with pytest.raises(WorkloadError, match="QDoRA") as e:
        Workload(**BASE, peft="qlora", lora_dora=True)
    assert e.value.field == "lora_dora"


def test_lora_adapters_built_on_meta_match_peft_on_the_cpu(llama) -> None:
    """apply_peft builds a meta model's adapters on meta (no real init): same parameters, names,
    shapes, dtypes and trainability as peft's own CPU-built adapters after the move to meta."""
    from vramplan.models.build import build_model
    from vramplan.trace import features

    def params(m: nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype, bool, str]]:
        return [(n, tuple(p.shape), p.dtype, p.requires_grad, p.device.type) for n, p in m.named_parameters()]

    for dora in (False, True):  # (DoRA: the magnitude vectors too)
        w = Workload(**BASE, peft="lora", lora_rank=8, lora_dora=dora)
        fast, _ = features.apply_peft(build_model(llama, device="meta"), w)
        assert all(p.device.type == "meta" for p in fast.parameters())
        cpu_built, _ = features.apply_peft(build_model(llama, device="cpu"), w)
        features.to_trace_device(cpu_built)
        assert params(fast) == params(cpu_built)
        assert any("lora_magnitude_vector" in n for n, *_ in params(fast)) == dora


def test_qlora_stores_nf4_with_double_quantisation(llama) -> None:
    r = trace_workload(llama, Workload(**BASE, peft="qlora"), options=NO_WS)
    full = trace_workload(llama, Workload(**BASE, peft="lora"), options=NO_WS)
    assert r.breakdown_at_peak.weights < full.breakdown_at_peak.weights
    q = QuantLinear(64, 128, bias=False, kind=Quant.NF4, compute_dtype=torch.bfloat16, double_quant=True)
    n = 64 * 128
    blocks = n // 64
    assert sum(b.numel() * b.element_size() for b in q.buffers()) == n // 2 + blocks + 4 * 1 + 256 * 4 + 4 + 16 * 4
    # the base layer dequantises into a bf16 [out, in] temporary in forward and backward
    log = r.events
    assert any(log.strings[log.desc[k]] == "bf16[64,64]" and log.category[k] == Category.TEMPORARY
               for k in range(len(log)) if log.action[k] == Action.ALLOC)


def test_int8_and_fp8_weights_are_one_byte(llama) -> None:
    for quant in ("int8", "fp8"):
        r = trace_workload(llama, Workload(task="infer", batch=1, seq=16, precision="bf16", quant=quant), options=NO_WS)
        bf16 = trace_workload(llama, Workload(task="infer", batch=1, seq=16, precision="bf16"), options=NO_WS)
        params = 4 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128)  # q,o + k,v + mlp, ×4 layers
        rows = 4 * (64 * 2 + 32 * 2 + 128 * 2 + 64)  # output features: one fp32 scale each
        saved = bf16.breakdown_at_peak.weights - r.breakdown_at_peak.weights
        assert saved == params * (2 - 1) - rows * 4


def test_8bit_and_paged_optimizer_states(llama) -> None:
    w = Workload(**BASE, optimizer="adamw-8bit")
    r = trace_workload(llama, w, options=NO_WS)
    opt = [p for p in r.phases if p.phase is Phase.OPTIMIZER][0].breakdown.optimizer
    assert opt < r.trainable_params * 8 / 3  # far below AdamW's 8 bytes/param
    paged = trace_workload(llama, w.replace(optimizer="paged-adamw-8bit"), options=NO_WS)
    # bitsandbytes pages the state buffers of tensors of >= 1e5 elements only: none here
    # (tests/test_loop_knobs.py covers a model with paged states)
    assert [p.breakdown.optimizer for p in paged.phases] == [p.breakdown.optimizer for p in r.phases]
    assert any("unified memory" in n for n in paged.notes)


def test_gradient_accumulation_keeps_one_set_of_gradients(llama) -> None:
    one = trace_workload(llama, Workload(**BASE), options=NO_WS)
    two = trace_workload(llama, Workload(**BASE, grad_accum=2), options=NO_WS)
    g1 = max(p.breakdown.gradients for p in one.phases)
    g2 = max(p.breakdown.gradients for p in two.phases)
    assert g1 == g2
    fwd = sum(1 for k in range(len(two.events)) if two.events.strings[two.events.op[k]] == "forward")
    assert fwd == 2 * 2  # two micro-batches per iteration, two iterations


def test_pure_bf16_halves_weights_and_fp16_mixed_scales_the_loss(llama) -> None:
    mixed = trace_workload(llama, Workload(**BASE), options=NO_WS)
    pure = trace_workload(llama, Workload(**{**BASE, "precision": "bf16"}), options=NO_WS)
    assert pure.breakdown_at_peak.weights * 2 == mixed.breakdown_at_peak.weights
    fp16 = trace_workload(llama, Workload(**{**BASE, "precision": "fp16-mixed"}), options=NO_WS)
    assert any("float16" in n for n in fp16.notes)


def test_static_cache_preallocates_the_kv_cache(llama) -> None:
    w = Workload(task="generate", batch=2, seq=16, new_tokens=8, precision="bf16")
    dyn = trace_workload(llama, w, options=NO_WS, iterations=1)
    static = trace_workload(llama, w, options=TraceOptions(workspaces=False, cache="static"), iterations=1)
    # 4 layers × (k, v) × 2 kv heads × head dim 16 × (16 + 8) tokens × batch 2 × 2 bytes
    full = 4 * 2 * 2 * 16 * 24 * 2 * 2
    kv_static = max(p.breakdown.kv_cache for p in static.phases)
    assert full <= kv_static <= full + 4 * 16  # plus a few per-layer bookkeeping scalars
    last_dyn = [p for p in dyn.phases if p.phase is Phase.DECODE][0].breakdown.kv_cache
    # DynamicCache grows by torch.cat: 23 tokens at the last step, plus the old copy of one
    # layer's keys while its new copy is made
    per_token = full // 24
    assert last_dyn == 23 * per_token + 22 * per_token // 8
    assert {str(p.phase) for p in dyn.phases} >= {"prefill", "decode"}


def test_torch_compile_is_ignored_with_a_note() -> None:
    model = nn.Sequential(nn.Linear(8, 8))

    def make() -> nn.Module:
        return torch.compile(model)

    r = trace_model(make, torch.randn(2, 8), workload=Workload(task="infer", precision="fp32"), options=NO_WS)
    assert any("torch.compile ignored" in n for n in r.notes)


@pytest.mark.parametrize(("kv", "factor"), [("fp8", 0.5), ("int8", 0.5), ("int4", 0.25), ("fp32", 2.0)])
def test_kv_dtype_changes_the_cache_storage(llama, kv: str, factor: float) -> None:
    w = Workload(task="generate", batch=2, seq=512, new_tokens=2, precision="bf16")
    base = trace_workload(llama, w, options=NO_WS, iterations=1)
    quant = trace_workload(llama, w.replace(kv_dtype=kv), options=NO_WS, iterations=1)

    def kv_after_prefill(r) -> int:
        log = r.events
        last = max(k for k in range(len(log)) if log.phase[k] == list(Phase).index(Phase.PREFILL))
        return analysis.breakdown_at(analysis.arrays(log), last).kv_cache

    ratio = kv_after_prefill(quant) / kv_after_prefill(base)
    # group-wise int formats add a bf16 scale and zero point per 64 values: 4/64 B per value,
    # i.e. 1/32 of bf16; fp8 keeps one fp32 scale per tensor
    expected = factor + (1 / 32 if kv.startswith("int") else 0.0)
    assert abs(ratio - expected) < 1e-3, ratio
    assert any("KV cache" in n for n in quant.notes)
