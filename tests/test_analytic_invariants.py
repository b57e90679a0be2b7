"""Invariants of the analytic estimate over random workloads (hypothesis)."""

from __future__ import annotations

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from test_analytic_specs import (
    bert_base,
    deepseek_v3,
    gpt2,
    llama_8b,
    mistral_7b,
    mixtral_8x7b,
    vit_base,
)
from vramplan.analytic import estimate
from vramplan.analytic.estimate import build_arch
from vramplan.analytic.parallel import stages
from vramplan.analytic.regime import regime, trainable
from vramplan.analytic.states import replicated_embedding_grad
from vramplan.errors import WorkloadError
from vramplan.results import BREAKDOWN_KEYS
from vramplan.workload import Parallel, Workload

MODELS = [llama_8b(), mistral_7b(), gpt2(), bert_base(), vit_base(), mixtral_8x7b(), deepseek_v3()]
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def workloads(draw, task=None):
    spec = draw(st.sampled_from(MODELS))
    task = task or draw(st.sampled_from(["train", "infer", "generate"]))
    kw = dict(
        task=task,
        batch=draw(st.integers(1, 8)),
        seq=draw(st.sampled_from([64, 128, 256, 512, 1000])),
        precision=draw(st.sampled_from(["bf16-mixed", "fp16-mixed", "bf16", "fp32"])),
        optimizer=draw(st.sampled_from(["adamw", "adam", "sgd", "sgd-momentum", "adamw-8bit", "adafactor", "lion"])),
        optimizer_impl=draw(st.sampled_from(["foreach", "fused", "for-loop"])),
        checkpointing=draw(st.sampled_from(["none", "full", "selective"])),
        attention=draw(st.sampled_from(["sdpa", "eager", "flash"])),
        peft=draw(st.sampled_from(["none", "none", "lora", "qlora"])) if task == "train" else "none",
        quant=draw(st.sampled_from(["none", "int8", "nf4", "fp8"])) if task != "train" else "none",
        kv_dtype=draw(st.sampled_from(["auto", "fp8", "int4"])),
        new_tokens=draw(st.integers(1, 64)) if task == "generate" else 0,
        grad_accum=draw(st.sampled_from([1, 2])),
    )
    if task == "train":
        zero = draw(st.sampled_from([0, 1, 2, 3]))
        kw["parallel"] = Parallel(dp=draw(st.sampled_from([1, 2, 8])), zero=zero,
                                  tp=draw(st.sampled_from([1, 2])))
    try:
        w = Workload(**kw)
    except WorkloadError:
        assume(False)
    return spec, w


def _est(spec, w):
    try:
        return estimate(spec, w)
    except WorkloadError:
        assume(False)


@SETTINGS
@given(workloads())
def test_breakdowns_sum_and_the_peak_is_the_highest_phase(case):
    spec, w = case
    est = _est(spec, w)
    for p in est.phases:
        parts = p.breakdown.as_dict()
        assert set(parts) == set(BREAKDOWN_KEYS)
        assert all(v >= 0 for v in parts.values())
        assert sum(parts.values()) == p.allocated
    assert est.peak.allocated == max(p.allocated for p in est.phases)
    assert est.peak in est.phases
    assert est.flops_per_step > 0


@SETTINGS
@given(workloads(), st.integers(1, 4))
def test_monotone_in_batch(case, more):
    spec, w = case
    a = _est(spec, w)
    b = _est(spec, w.replace(batch=w.batch + more))
    assert b.peak.allocated >= a.peak.allocated
    assert b.flops_per_step >= a.flops_per_step


@SETTINGS
@given(workloads(), st.sampled_from([64, 256, 448]))
def test_monotone_in_sequence(case, more):
    spec, w = case
    a = _est(spec, w)
    b = _est(spec, w.replace(seq=w.seq + more))
    assert b.peak.allocated >= a.peak.allocated
    for pa, pb in zip(a.phases, b.phases, strict=True):
        assert pb.allocated >= pa.allocated


@SETTINGS
@given(workloads(task="train"), st.sampled_from([2, 4, 8, 16]))
def test_zero3_times_world_size_is_the_unsharded_states(case, dp):
    spec, w = case
    base = w.replace(parallel=Parallel(dp=1, zero=0, tp=w.parallel.tp))
    unsharded = _est(spec, base).states.total
    sharded = _est(spec, base.replace(parallel=Parallel(dp=dp, zero=3, tp=w.parallel.tp))).states.total
    # less the embedding gradient's replicated part under TP (vramplan.analytic.states.replicated_embedding_grad)
    arch = build_arch(spec)
    unsharded -= replicated_embedding_grad(arch, stages(arch, base)[0], base, regime(base), trainable(arch, base))
    # FSDP2 pads dim 0 of each tensor to a multiple of dp: fewer than dp rows of each matrix
    # (weight, gradient and states: at most 4 + 4 + 12 B per element; a routed-expert stack's
    # row is one expert's matrix); integer division per tensor class otherwise
    matrices = [(lin.matrix, g.count) if lin.expert and lin.count > 1 else (lin.d_in, g.count * lin.count)
                for g in arch.groups for lin in g.linears]
    matrices += [(arch.hidden, 2)]  # token embedding, output head
    padding = 20 * (dp - 1) * sum(cols * n for cols, n in matrices)
    assert -8 * dp * 64 <= sharded * dp - unsharded <= 8 * dp * 64 + padding


@SETTINGS
@given(workloads(task="train"), st.sampled_from(["full", "selective"]))
def test_checkpointing_never_increases_activations(case, mode):
    spec, w = case
    none = _est(spec, w.replace(checkpointing="none"))
    ckpt = _est(spec, w.replace(checkpointing=mode, checkpoint_fraction=1.0))
    assert max(p.breakdown.activations for p in ckpt.phases) <= max(p.breakdown.activations for p in none.phases)
    assert ckpt.peak.allocated <= none.peak.allocated
    assert ckpt.flops_per_step >= none.flops_per_step  # recompute costs FLOPs


@SETTINGS
@given(workloads(task="train"))
def test_states_do_not_depend_on_batch_or_sequence(case):
    spec, w = case
    a = _est(spec, w).states
    b = _est(spec, w.replace(batch=w.batch + 3, seq=w.seq + 128)).states
    assert a == b
