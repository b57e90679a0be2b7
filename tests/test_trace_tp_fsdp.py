"""TP × FSDP2 (2-D) traced as rank 0 of a fake ``(dp, tp)`` world, against the analytic figures.

The layout is torchtitan's ``parallelize_llama``: ``parallelize_module`` with the Llama plan on
``mesh["tp"]`` first, then ``fully_shard`` over ``mesh["dp"]`` (HSDP: ``mesh["dp_replicate",
"dp"]``). Exact: each rank's parameters, gradients and optimizer states at the optimizer step,
including FSDP2's padding of dim 0 of each TP-local tensor (Llama's embedding: 128,256 / 8 =
16,032 rows do not divide 64 ranks). Within a tolerance: the peak.
"""

from __future__ import annotations

import pytest

from test_trace_agreement import _optimizer_states, _small, estimate
from vramplan.analytic.parallel import fsdp_rows
from vramplan.errors import TraceError
from vramplan.models.catalog import resolve
from vramplan.trace.run import TraceOptions, trace_workload
from vramplan.workload import Method, Workload

FAST = TraceOptions(count_flops=False)


def _w(**parallel: object) -> Workload:
    return Workload(task="train", batch=1, seq=64, precision="bf16-mixed").replace(**parallel)


SMALL = [
    {"dp": 4, "zero": 3, "tp": 2},
    {"dp": 4, "zero": 3, "tp": 2, "sp": True},
    {"dp": 4, "zero": 2, "tp": 2, "sp": True, "engine": "fsdp"},
    {"dp": 8, "zero": 3, "tp": 2, "dp_shard": 4, "sp": True},
]


@pytest.mark.parametrize("parallel", SMALL, ids=["fsdp3", "fsdp3-sp", "fsdp2-sp", "hsdp-sp"])
def test_small_llama_states_exact_peak_close(parallel: dict[str, object]) -> None:
    spec = _small("llama-3.1-8b")
    w = _w(**parallel).replace(batch=2, seq=256)
    r = trace_workload(spec, w)
    a = estimate(spec, w)
    assert _optimizer_states(r) == (a.states.weights, a.states.gradients, a.states.optimizer)
    assert abs(r.peak_allocated - a.peak.allocated) / a.peak.allocated < 0.15, (r.peak_allocated, a.peak.allocated)
    tp, dp = w.parallel.tp, w.parallel.shard_group
    assert any(f"rank 0 of tp={tp}" in n for n in r.notes)
    assert any(n.startswith("FSDP2 (") and f"over dp={dp}" in n or f"shards over {dp}" in n for n in r.notes)


def test_the_2d_world_holds_a_quarter_of_the_tp_shard() -> None:
    """tp=2 × dp=4: rank 0 holds 1/8 of every weight matrix, and its norms are 1/4 of the whole."""
    spec = _small("llama-3.1-8b")
    one = _optimizer_states(trace_workload(spec, _w(), iterations=1, options=FAST))
    tp = _optimizer_states(trace_workload(spec, _w(tp=2), iterations=1, options=FAST))
    two_d = _optimizer_states(trace_workload(spec, _w(tp=2, dp=4, zero=3), iterations=1, options=FAST))
    assert two_d[2] * 4 == tp[2]  # optimizer states: the TP shard's, divided by dp
    assert one[2] / 8 < two_d[2] < one[2] / 8 * 1.01  # (replicated norms)


def test_zero2_shards_the_parameters_and_keeps_them_gathered_until_backward() -> None:
    spec = _small("llama-3.1-8b")
    z3 = trace_workload(spec, _w(tp=2, dp=4, zero=3), iterations=1, options=FAST)
    z2 = trace_workload(spec, _w(tp=2, dp=4, zero=2, engine="fsdp"), iterations=1, options=FAST)
    assert _optimizer_states(z2) == _optimizer_states(z3)
    weights = {p.phase.value: p.breakdown.weights for p in z2.phases}
    weights3 = {p.phase.value: p.breakdown.weights for p in z3.phases}
    assert weights["forward"] > weights3["forward"]
    assert weights["optimizer"] == weights3["optimizer"]


def test_auto_traces_the_2d_layout_and_the_world_is_gone() -> None:
    import torch.distributed as dist

    from vramplan import estimate as public_estimate

    spec = _small("llama-3.1-8b")
    r = public_estimate(spec, _w(tp=2, dp=4, zero=3, sp=True), method="auto", search_max_batch=False)
    assert r.method is Method.TRACE and r.fallback is None
    assert not dist.is_initialized()


def test_untraced_2d_layouts_are_refused_with_the_reason() -> None:
    spec = _small("llama-3.1-8b")
    with pytest.raises(TraceError, match="DeepSpeed ZeRO-2 is not traced"):
        trace_workload(spec, _w(tp=2, dp=4, zero=2), iterations=1)
    with pytest.raises(TraceError, match="offload"):
        trace_workload(spec, _w(tp=2, dp=4, zero=3, offload_params=True), iterations=1)


CATALOG = [
    ("llama-3.1-8b", {"dp": 8, "zero": 3, "tp": 8, "sp": True}),
    ("llama-3.1-8b", {"dp": 64, "zero": 3, "tp": 8, "sp": True}),
    ("llama-3.1-8b", {"dp": 64, "zero": 2, "tp": 8, "sp": True, "engine": "fsdp"}),
    ("llama-3.1-70b", {"dp": 8, "zero": 3, "tp": 8, "sp": True}),
    ("llama-3.1-70b", {"dp": 64, "zero": 3, "tp": 8, "sp": True}),
    ("llama-3.1-70b", {"dp": 64, "zero": 2, "tp": 8, "sp": True, "engine": "fsdp"}),
    ("llama-3.1-8b", {"dp": 16, "dp_shard": 8, "zero": 3, "tp": 8, "sp": True}),  # HSDP 2 × 8, × TP 8
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "parallel"), CATALOG,
                         ids=[f"{n}-tp{p['tp']}-dp{p['dp']}-z{p['zero']}{'-hsdp' if 'dp_shard' in p else ''}"
                              for n, p in CATALOG])
def test_catalog_llama_tp_fsdp_states_equal_analytic(name: str, parallel: dict[str, object]) -> None:
    spec = resolve(name)
    w = _w(**parallel)
    r = trace_workload(spec, w, iterations=1, options=FAST)
    a = estimate(spec, w)
    assert _optimizer_states(r) == (a.states.weights, a.states.gradients, a.states.optimizer)
    if w.parallel.dp == 64:
        # the vocabulary-sharded embedding and head (16,032 rows) are padded to 251 rows per rank
        rows = spec.vocab // 8
        assert rows % 64 and fsdp_rows(rows, 64) == 251
        h, i, layers = spec.hidden, spec.intermediate, spec.layers
        kv = spec.kv_heads * h // spec.heads
        # by hand: fp32 shards of q/k/v/o/gate/up/down over 8 × 64, the norms over 64 (replicated
        # over tp), the embedding and the head 251 rows each
        linears = layers * (2 * h * h + 2 * h * kv + 3 * h * i) // 512
        assert a.states.weights == 4 * (linears + (2 * layers + 1) * h // 64 + 2 * 251 * h)


def test_catalog_8b_tp8_dp8_states_and_peak() -> None:
    """Not marked slow: one 2-D trace of the catalog 8B (two iterations: the peak holds optimizer states)."""
    spec = resolve("llama-3.1-8b")
    w = _w(dp=8, zero=3, tp=8, sp=True)
    r = trace_workload(spec, w, options=FAST)
    a = estimate(spec, w)
    assert _optimizer_states(r) == (a.states.weights, a.states.gradients, a.states.optimizer)
    assert abs(r.peak_allocated - a.peak.allocated) / a.peak.allocated < 0.03, (r.peak_allocated, a.peak.allocated)


@pytest.mark.parametrize("parallel", [{"dp": 4, "tp": 2}, {"dp": 4, "tp": 2, "sp": True},
                                      {"dp": 4, "tp": 2, "sp": True, "gradient_as_bucket_view": True}],
                         ids=["ddp", "ddp-sp", "ddp-sp-view"])
def test_tp_times_ddp_states_exact(parallel: dict[str, object]) -> None:
    """DDP given the dp slice of the 2-D mesh (PyTorch's ``_pre_dp_module_transform``): DDP holds
    the TP-local parameters, so the embedding's gradient is its vocabulary shard (the whole
    Replicate table lives only during its backward), unlike TP alone."""
    spec = _small("llama-3.1-8b")
    w = _w(**parallel).replace(batch=2, seq=256)
    r = trace_workload(spec, w)
    a = estimate(spec, w)
    assert _optimizer_states(r) == (a.states.weights, a.states.gradients, a.states.optimizer)
    assert abs(r.peak_allocated - a.peak.allocated) / a.peak.allocated < 0.08, (r.peak_allocated, a.peak.allocated)
    assert any("DDP over dp=4" in n for n in r.notes) and any("rank 0 of tp=2" in n for n in r.notes)
    alone = estimate(spec, w.replace(dp=1))
    assert alone.states.gradients > a.states.gradients  # TP alone keeps the whole embedding gradient


@pytest.mark.slow
def test_catalog_8b_tp8_ddp8_states_equal_analytic() -> None:
    spec = resolve("llama-3.1-8b")
    w = _w(dp=8, tp=8, sp=True)
    r = trace_workload(spec, w, options=FAST)
    a = estimate(spec, w)
    assert _optimizer_states(r) == (a.states.weights, a.states.gradients, a.states.optimizer)
    assert abs(r.peak_allocated - a.peak.allocated) / a.peak.allocated < 0.02, (r.peak_allocated, a.peak.allocated)


def test_a_user_built_llama_is_laid_out_in_2d_too() -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from vramplan.trace.run import trace_model
    from vramplan.workload import Parallel

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=2, vocab_size=256)
    ids = torch.zeros(1, 32, dtype=torch.long)

    def optimizer(parallel: Parallel) -> int:
        r = trace_model(lambda: LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids},
                        workload=Workload(task="train", parallel=parallel), iterations=1)
        return [p for p in r.phases if p.phase == "optimizer"][0].breakdown.optimizer

    assert optimizer(Parallel(tp=2, dp=4, zero=3)) * 4 == optimizer(Parallel(tp=2))


def test_fsdp2_pads_an_expert_stack_when_dp_exceeds_the_experts() -> None:
    """8 experts in one [8, …] parameter over 16 ranks: torch.chunk gives ranks 0–7 one expert
    each and pads ranks 8–15 to one; rank 0 holds 1/8 of the stack, not 1/16."""
    spec = _small("mixtral-8x7b")
    w = _w(dp=16, zero=3).replace(batch=2, seq=128)
    r = trace_workload(spec, w, iterations=1, options=FAST)
    a = estimate(spec, w)
    assert _optimizer_states(r) == (a.states.weights, a.states.gradients, a.states.optimizer)
    half = estimate(spec, w.replace(dp=8))
    assert a.states.optimizer > 0.9 * half.states.optimizer  # the experts dominate and do not shrink
    # the all-gather and reduce-scatter buffers are padded too (16 experts' worth gathered)
    two = trace_workload(spec, w, options=FAST)
    assert abs(two.peak_allocated - a.peak.allocated) / a.peak.allocated < 0.05, (two.peak_allocated, a.peak.allocated)
