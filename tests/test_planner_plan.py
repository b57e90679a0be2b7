"""Plan search, candidate space, Pareto front, prices and GPU ranking (on fakes)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from test_planner_fakes import (
    A100,
    GPUS,
    H100,
    INSTANCES,
    LLAMA,
    RTX4060,
    RTX4090,
    SMALL,
    FakeEstimator,
    gpu,
    screen_for,
)
from vramplan.errors import PlanError
from vramplan.planner.pareto import objectives, pareto_front
from vramplan.planner.plan import plan
from vramplan.planner.pricing import offers, plan_price
from vramplan.planner.rank import rank_gpus
from vramplan.planner.space import candidates, describe, for_gpu, micro_batches
from vramplan.workload import Method, Parallel, Peft, Precision, Workload


def _plan(spec=SMALL, w=None, g=RTX4090, **kw):
    est = kw.pop("est", None) or FakeEstimator()
    return plan(spec, w or Workload(batch=2, seq=2048), gpu=g, screen=screen_for(spec, est),
                instances=kw.pop("instances", INSTANCES), **kw), est


def test_every_plan_fits_and_the_front_is_non_dominated():
    w = Workload(batch=2, seq=2048)
    r, _ = _plan(w=w, method="analytic")
    assert r.plans and all(p.fits for p in r.plans)
    keys = [objectives(p, w) for p in r.plans]
    for i, a in enumerate(keys):
        for j, b in enumerate(keys):
            if i != j:
                assert not (all(x <= y for x, y in zip(a, b, strict=True)) and a != b)
    # sorted by speed: time per token never decreases down the table
    tpt = [1 / p.work_per_s for p in r.plans]
    assert tpt == sorted(tpt)


def test_plan_space_is_large_and_explanations_are_one_line():
    r, _ = _plan(LLAMA, Workload(batch=1, seq=2048), max_gpus=8, allow_peft=True, global_batch=8, method="analytic")
    assert r.candidates >= 200
    for p in r.plans:
        assert "\n" not in p.explanation
        assert p.explanation.startswith(p.label)
        assert " GiB, " in p.explanation and ("step time" in p.explanation or "time per token" in p.explanation)
        w = p.workload
        assert w.batch * w.grad_accum * w.parallel.dp == 8  # global batch kept
    assert any("adapters only" in n for n in r.notes)


def test_confirmation_traces_finalists_only():
    r, est = _plan(confirm=2)
    assert est.traces == r.evaluations.traces <= 4
    assert sum(p.confirmed for p in r.plans) >= 1
    assert all(p.method is Method.TRACE for p in r.plans if p.confirmed)


def test_front_keeps_the_users_precision_next_to_faster_pure_bf16():
    r, _ = _plan(SMALL, Workload(batch=2, seq=2048), g=RTX4090, method="analytic")
    precisions = {p.workload.precision for p in r.plans}
    assert Precision.BF16_MIXED in precisions and Precision.BF16 in precisions
    assert any("fp32 master weights" in n for n in r.notes)


def test_no_peft_unless_allowed():
    r, _ = _plan(LLAMA, Workload(batch=1), g=H100, max_gpus=8, method="analytic")
    assert all(p.workload.peft is Peft.NONE for p in r.plans)


def test_budget_filters_and_too_low_budget_names_the_cheapest():
    r, _ = _plan(LLAMA, Workload(batch=1), g=H100, max_gpus=8, budget=10.0, method="analytic")
    assert all(p.price.usd_per_hour <= 10.0 for p in r.plans)
    with pytest.raises(PlanError, match=r"no plan fits within \$0\.50/h: the cheapest that fits is .* at \$\d"):
        _plan(LLAMA, Workload(batch=1), g=H100, max_gpus=8, budget=0.5, method="analytic")


def test_budget_without_a_price_is_a_clear_error():
    with pytest.raises(PlanError, match="no on-demand price is listed for rtx-4060.*`budget`"):
        _plan(SMALL, g=RTX4060, budget=1.0, method="analytic")


def test_impossible_target_names_the_nearest_option():
    with pytest.raises(PlanError) as e:
        _plan(LLAMA, Workload(batch=1), g=RTX4060, method="analytic")
    msg = str(e.value)
    assert msg.startswith("no plan fits on 1× rtx-4060") and "nearest:" in msg and "GiB per GPU" in msg
    assert "`allow_peft=True`" in msg and "\n" not in msg


def test_trace_finds_finalist_too_big_and_it_is_dropped():
    class Stingy(FakeEstimator):
        def __call__(self, spec, w, **kw):
            r = super().__call__(spec, w, **kw)
            if r.method is Method.TRACE and r.verdict is not None:  # the trace says: 20× bigger
                from dataclasses import replace

                from vramplan.results import Peak
                big = 20 * r.peak.device_used
                r = replace(r, peak=Peak(big, big, big), verdict=replace(r.verdict, fits=False))
            return r

    with pytest.raises(PlanError, match="too large when traced"):
        _plan(est=Stingy(), confirm=2)


def test_old_gpus_get_fp16_not_bf16():
    v100 = gpu("v100", 32, bf16=None)
    object.__setattr__(v100, "arch", "volta")
    assert for_gpu(Workload(), v100).precision is Precision.FP16_MIXED
    assert all(c.workload.precision not in (Precision.BF16, Precision.BF16_MIXED)
               for c in candidates(Workload(), v100))


def test_space_respects_model_parallel_and_valid_combinations():
    w = Workload(batch=4).replace(tp=2)
    cs = candidates(w, H100, max_gpus=8)
    assert all(c.workload.parallel.tp == 2 for c in cs)
    assert {c.num_gpus for c in cs} == {2, 4, 8}
    assert all(c.workload.parallel.world_size == c.num_gpus for c in cs)


def test_inference_space_varies_quantisation_and_tp():
    cs = candidates(Workload(task="generate", batch=8, seq=1024), H100, max_gpus=4)
    assert {c.workload.quant.value for c in cs} >= {"none", "int8", "nf4"}
    assert {c.workload.parallel.tp for c in cs} == {1, 2, 4}


@given(st.integers(1, 512))
def test_micro_batches_divide(per_rank):
    ms = micro_batches(per_rank)
    assert ms[0] == per_rank and 1 in ms and all(per_rank % m == 0 for m in ms)


def test_describe_reads_like_the_issue():
    w = Workload(batch=8, checkpointing="full")
    assert describe(w, 1) == "bf16-mixed + full checkpointing, batch 8"
    w2 = Workload(batch=2, grad_accum=4, optimizer="adamw-8bit").replace(dp=8, zero=3, offload_optimizer=True)
    assert describe(w2, 8) == "bf16-mixed + adamw-8bit + ZeRO-3/FSDP ×8 + optimizer offload, batch 2 × 4 accum"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9), st.integers(0, 9)), min_size=1, max_size=40))
def test_pareto_front_is_exactly_the_non_dominated_set(points):
    front = pareto_front(points, key=lambda p: p)

    def dominated(p):
        return any(all(a <= b for a, b in zip(q, p, strict=True)) and q != p for q in points)

    assert set(front) == {p for p in points if not dominated(p)}
    assert len(front) == len(set(front))


def test_prices_exact_instance_or_per_gpu_share():
    exact = plan_price(H100, 8, INSTANCES)
    assert exact.usd_per_hour == 20.0 and "h100x8" in exact.source and "read 2026-01" in exact.basis
    share = plan_price(H100, 4, INSTANCES)
    assert share.usd_per_hour == pytest.approx(4 * 20.0 / 8) and "per-GPU share" in share.source
    assert "cloud h100x8" in share.basis and "test price list" in share.basis
    assert plan_price(RTX4060, 1, INSTANCES) is None


def test_offers_list_instances_and_unpriced_bare_gpus():
    os_ = offers(list(GPUS.values()), INSTANCES)
    labels = {o.label for o in os_}
    assert "cloud h100x8" in labels and "rtx-4060 ×1 (no listed price)" in labels
    assert not any(o.gpu == "rtx-4090" and o.price is None for o in os_)  # it has a 1× instance


def test_rank_gpus_orders_by_cost_and_lists_what_does_not_fit():
    est = FakeEstimator()
    r = rank_gpus(LLAMA, Workload(batch=1, seq=2048), gpus=list(GPUS.values()), instances=INSTANCES,
                  screen=screen_for(LLAMA, est), method="analytic")
    costs = [x.plan.usd_per_mtok for x in r.ranked if x.plan.usd_per_mtok is not None]
    assert costs == sorted(costs)
    priced = [x.plan.price is not None for x in r.ranked]
    assert priced == sorted(priced, reverse=True)  # unpriced offers last when sorting by cost
    assert all(x.plan.fits and x.plan.num_gpus == x.offer.count for x in r.ranked)
    assert any(label.startswith("rtx-4060") for label, _, _ in r.not_fitting)
    assert r.price_sources and "read 2026-01" in r.price_sources[0]
    eight = [x.plan for x in r.ranked if x.offer.count == 8]
    assert eight and all(p.workload.precision is Precision.BF16_MIXED for p in eight)  # the job as given
    assert r.to_dict()["ranked"][0]["usd_per_mtok"] == pytest.approx(costs[0])


def test_rank_gpus_uses_one_estimate_per_variant_across_gpus():
    est = FakeEstimator()
    r = rank_gpus(SMALL, Workload(batch=1), gpus=[H100, A100, RTX4090], instances=INSTANCES,
                  screen=screen_for(SMALL, est), method="analytic")
    assert r.evaluations.total < r.candidates  # shared across GPUs


def test_plan_result_to_dict_is_json_ready():
    import json

    r, _ = _plan(method="analytic")
    d = json.loads(json.dumps(r.to_dict()))
    assert d["plans"][0]["memory"] == r.plans[0].memory and isinstance(d["plans"][0]["memory"], int)
    assert d["candidates"] == r.candidates and math.isfinite(d["plans"][0]["step_time"])


def test_searched_layouts_divide_the_gpu_count_and_keep_tp_in_a_node():
    from hypothesis import given
    from hypothesis import strategies as st

    from vramplan.planner.space import layouts

    @given(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 32, 64]))
    def check(n):
        out = layouts(Workload(), n)
        assert out[0] == (1, 1, 1) and len(set(out)) == len(out)
        for tp, pp, cp in out:
            assert n % (tp * pp * cp) == 0 and tp * cp <= 8

    check()
    assert layouts(Workload(parallel=Parallel(tp=4)), 8) == [(4, 1, 1)]
    assert layouts(Workload(parallel=Parallel(tp=4)), 6) == []


def test_candidates_the_screen_refuses_are_named_with_their_cause():
    # DPO with a frozen reference model: the analytic screen models the reference under DDP (a replica) and FSDP2
    # ZeRO-3 and refuses it under DeepSpeed ZeRO-1/2 (as the trace does); the notes say so, with counts, instead of
    # dropping them silently
    w = Workload(task="train", objective="dpo", reference="model", batch=1, seq=512)
    r = plan("llama-3.2-1b", w, gpu="h100-sxm", max_gpus=2, method="analytic", confirm=0)
    note = next(n for n in r.notes if "not screened" in n)
    assert "the analytic method refuses them" in note and "a preference reference model" in note
    count = int(note.split(" candidate(s)")[0].replace(",", ""))
    assert 0 < count < r.candidates
    two = [p.workload.parallel for p in r.plans if p.num_gpus == 2]
    assert two and all(par.zero in (0, 3) for par in two)  # (DDP, FSDP2 ZeRO-3: the layouts the screen models)
