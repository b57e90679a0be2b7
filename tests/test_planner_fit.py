"""Boundary search and `fit`: exact answers with few expensive evaluations."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from test_planner_fakes import (
    CNN,
    H100,
    LLAMA,
    RTX4060,
    RTX4090,
    SMALL,
    FakeEstimator,
    device_used,
    usable,
)
from vramplan.engine.boundary import boundary_search, secant_predictor
from vramplan.errors import PlanError
from vramplan.planner.fit import fit
from vramplan.workload import Workload


def _brute(f, limit, lo, hi, step):
    best = lo - step
    x = lo
    while x <= hi:
        if f(x) <= limit:
            best = x
        x += step
    return best


@settings(max_examples=200, deadline=None)
@given(a=st.integers(0, 10_000), b=st.integers(1, 500), c=st.integers(0, 3), limit=st.integers(0, 200_000),
       step=st.sampled_from([1, 7, 64]), saturate=st.booleans(),
       predictor=st.sampled_from(["none", "secant", "quad", "wrong", "creep-down", "creep-up"]))
def test_boundary_search_finds_the_exact_boundary(a, b, c, limit, step, saturate, predictor):
    def f(x):
        return a + b * x + c * x * x // 50

    lo, hi = step, step * 400
    calls = []

    def evaluate(x):
        calls.append(x)
        over = f(x) > limit
        return (None if saturate and over else f(x)), not over

    pred = {"none": None, "secant": secant_predictor(limit), "quad": secant_predictor(limit, quadratic=True),
            "wrong": lambda s: 3.0 * max(s) if s else None,
            # a badly calibrated curve: always "just one step below/above the last point"
            "creep-down": lambda s: float(calls[-1] - step), "creep-up": lambda s: float(calls[-1] + step)}[predictor]
    res = boundary_search(evaluate, first=step * 3, lo=lo, hi=hi, step=step, predict=pred)
    assert res.value == _brute(f, limit, lo, hi, step)
    if res.above is not None:
        assert res.above == res.value + step and f(res.above) > limit
    assert len(calls) == len(set(calls))  # never evaluates a point twice
    assert len(calls) <= 2 * math.ceil(math.log2(400)) + 4


def test_boundary_search_with_an_exact_predictor_needs_two_evaluations():
    def evaluate(x):
        return 100 + 10 * x, 100 + 10 * x <= 1000

    res = boundary_search(evaluate, first=90, lo=1, hi=1000, predict=lambda s: 90.0)
    assert res.value == 90 and res.above == 91 and len(res.samples) == 2


def _expected_batch(spec, w, g):
    return _brute(lambda b: device_used(spec, w.replace(batch=b), traced=True), usable(g), 1, 4096, 1)


def _expected_seq(spec, w, g, step):
    return _brute(lambda s: device_used(spec, w.replace(seq=s), traced=True), usable(g), step, 131072 // step * step, step)


@pytest.mark.parametrize("spec,w,g", [
    (LLAMA, Workload(peft="lora", precision="bf16", checkpointing="full"), RTX4090),
    (SMALL, Workload(seq=2048), H100),
    (SMALL, Workload(seq=2048, attention="eager"), H100),
    (SMALL, Workload(seq=1024, checkpointing="selective", optimizer="adamw-8bit"), RTX4090),
])
def test_fit_matches_brute_force_with_at_most_four_traces(spec, w, g):
    est = FakeEstimator()
    r = fit(spec, w, gpu=g, method="trace", estimator=est)
    assert r.max_batch == _expected_batch(spec, w, g)
    assert r.max_seq == _expected_seq(spec, w, g, r.seq.step)
    assert r.evaluations.traces == est.traces <= 4
    assert r.batch.at.peak.device_used <= r.usable < r.batch.above.peak.device_used
    assert r.seq.at.peak.device_used <= r.usable < r.seq.above.peak.device_used
    d = r.to_dict()
    assert d["max_batch"] == r.max_batch and d["evaluations"]["traces"] == r.evaluations.traces
    assert d["boundary"]["batch"]["at"]["device_used"] == r.batch.at.peak.device_used


def test_fit_analytic_runs_no_trace():
    est = FakeEstimator()
    r = fit(SMALL, Workload(), gpu=H100, method="analytic", estimator=est)
    assert est.traces == 0 and r.evaluations.traces == 0 and r.max_batch > 0


def test_fit_without_analytic_uses_traces_only_and_skips_seq():
    est = FakeEstimator()
    r = fit(CNN, Workload(batch=1), gpu=RTX4090, method="auto", estimator=est, max_batch=256)
    assert r.seq is None and r.max_seq is None
    assert r.evaluations.analytic == 0
    assert r.max_batch == 256 and r.batch.limited_by == "search limit"


def test_nothing_fits_is_a_plan_error_naming_the_need():
    with pytest.raises(PlanError, match=r"does not fit on 1× rtx-4060: batch 1 at seq \d+ needs [\d.]+ GiB"):
        fit(LLAMA, Workload(), gpu=RTX4060, method="analytic", estimator=FakeEstimator())


def test_fit_needs_a_gpu():
    with pytest.raises(PlanError, match="needs a GPU"):
        fit(SMALL, Workload(), gpu=None, estimator=FakeEstimator())  # type: ignore[arg-type]


def test_seq_capped_by_max_positions():
    import dataclasses

    short = dataclasses.replace(SMALL, max_positions=4096)
    r = fit(short, Workload(seq=512, peft="qlora", checkpointing="full"), gpu=H100, method="analytic",
            estimator=FakeEstimator())
    assert r.max_seq == 4096 and r.seq.limited_by == "max_positions"
