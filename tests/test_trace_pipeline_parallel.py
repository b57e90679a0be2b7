"""Pipeline parallelism traced per stage with torch.distributed.pipelining (issue 12)."""

from __future__ import annotations

import pytest

from vramplan import Parallel, Workload, estimate
from vramplan.analytic.estimate import build_arch
from vramplan.analytic.parallel import stages
from vramplan.analytic.regime import regime, trainable
from vramplan.analytic.states import stage_states
from vramplan.errors import TraceError
from vramplan.trace.run import trace_pipeline_stages
from vramplan.trace.testing import tiny_spec
from vramplan.workload import Method, Phase


def _states(t):
    b = [p for p in t.phases if p.phase is Phase.OPTIMIZER][0].breakdown
    return b.weights, b.gradients, b.optimizer


@pytest.fixture(scope="module")
def two_stages():
    spec = tiny_spec("llama-3.1-8b", layers=4)
    w = Workload(task="train", batch=2, seq=128, grad_accum=4, parallel=Parallel(pp=2))
    return spec, w, dict(trace_pipeline_stages(spec, w))


def test_each_stage_holds_the_analytic_states(two_stages):
    spec, w, traced = two_stages
    arch = build_arch(spec)
    rg, tr = regime(w), trainable(arch, w)
    assert sorted(traced) == [0, 1]
    for st in stages(arch, w):
        a = stage_states(arch, st, w, rg, tr)
        weights, grads, opt = _states(traced[st.index])
        assert (grads, opt) == (a.gradients, a.optimizer)
        assert 0 <= weights - a.weights <= 1024  # + the rotary buffers every stage keeps


def test_first_stage_keeps_pp_micro_batches_in_flight(two_stages):
    spec, w, traced = two_stages
    # one micro-batch alone, unsplit model: activations of all 4 layers for one micro-batch
    one = estimate(spec, Workload(task="train", batch=2, seq=128), method="trace", search_max_batch=False)
    fwd_one = [p for p in one.phases if p.phase is Phase.FORWARD][0].breakdown.activations
    fwd0 = [p for p in traced[0].phases if p.phase is Phase.FORWARD][0].breakdown.activations
    # stage 0 runs 2 of the 4 layers with 2 micro-batches in flight under 1F1B: about one
    # micro-batch of the whole model (logits and loss excepted), clearly more than half of it
    assert 0.6 * fwd_one < fwd0 < 1.6 * fwd_one


def test_estimate_reports_the_worst_stage_and_every_stage_peak(two_stages):
    spec, w, traced = two_stages
    r = estimate(spec, w, method="trace", search_max_batch=False)
    assert r.method is Method.TRACE and r.fallback is None
    note = next(n for n in r.notes if n.startswith("pipeline parallelism traced per rank"))
    for rank, t in traced.items():
        assert f"rank {rank} (" in note and f"{t.peak_allocated:,} B" in note
    worst = max(t.peak_allocated for t in traced.values())
    assert r.peak.allocated >= worst


def test_a_tied_head_is_a_copy_on_the_last_stage():
    spec = tiny_spec("qwen2.5-0.5b", layers=2)
    w = Workload(task="train", batch=1, seq=32, grad_accum=2, parallel=Parallel(pp=2))
    traced = dict(trace_pipeline_stages(spec, w, iterations=1))
    arch = build_arch(spec)
    assert arch.head.tied
    rg, tr = regime(w), trainable(arch, w)
    for st in stages(arch, w):
        a = stage_states(arch, st, w, rg, tr)
        assert _states(traced[st.index])[1:] == (a.gradients, a.optimizer)


def test_pipeline_with_tensor_parallelism_falls_back_with_a_reason():
    spec = tiny_spec("llama-3.1-8b", layers=4)
    w = Workload(task="train", batch=1, seq=32, grad_accum=2, parallel=Parallel(pp=2, tp=2))
    with pytest.raises(TraceError, match="pipeline parallelism is traced"):
        estimate(spec, w, method="trace", search_max_batch=False)
    assert estimate(spec, w, search_max_batch=False).method is Method.ANALYTIC
