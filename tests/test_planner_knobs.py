"""The plan's search over the loop's memory savings, their step-time costs, and fit's next step."""

from __future__ import annotations

import dataclasses

import pytest

from test_planner_fakes import H100, LLAMA, RTX4090, FakeEstimator, GiB, formula, screen_for
from vramplan import recipes
from vramplan.models.flops import layout_of, train_flops
from vramplan.models.shape import model_shape
from vramplan.planner.evaluator import Evaluator
from vramplan.planner.knobs import KNOBS, saving_knobs
from vramplan.planner.space import candidates, describe
from vramplan.results import MemoryReport
from vramplan.runtime import step_time
from vramplan.workload import Checkpointing, Loss, Workload

ALL_KNOBS = frozenset(KNOBS)


def test_space_has_each_knob_only_when_asked() -> None:
    w = Workload(batch=4, seq=2048)
    plain = candidates(w, H100, max_gpus=2)
    full = candidates(w, H100, max_gpus=2, knobs=ALL_KNOBS)
    assert len(full) > len(plain)
    for c in plain:
        cw = c.workload
        assert cw.loss is Loss.FULL and not cw.optimizer_in_backward and not cw.activation_offload
        assert cw.checkpointing is not Checkpointing.OP and cw.checkpoint_every == 1
    ws = [c.workload for c in full]
    assert any(x.loss is Loss.CHUNKED for x in ws)
    assert any(x.activation_offload for x in ws)
    assert any(x.checkpointing is Checkpointing.OP for x in ws)
    assert any(x.checkpointing is Checkpointing.FULL and x.checkpoint_every == 2 for x in ws)
    inbwd = [x for x in ws if x.optimizer_in_backward]
    assert inbwd and all(x.grad_accum == 1 and x.parallel.dp == 1 and x.parallel.zero == 0 for x in inbwd)


def test_space_keeps_to_what_the_recipe_can_run() -> None:
    w = recipes.apply("hf-trainer", batch=4, seq=2048)
    ws = [c.workload for c in candidates(w, H100, max_gpus=2, knobs=ALL_KNOBS)]
    assert ws and all(recipes.allows(x) for x in ws)
    assert not any(x.optimizer_in_backward or x.checkpointing is Checkpointing.OP for x in ws)
    assert not any(x.loss is Loss.CHUNKED for x in ws)  # the Trainer has no chunked loss


def test_describe_names_the_knobs() -> None:
    w = Workload(checkpointing="full", checkpoint_every=2, loss="chunked", optimizer_in_backward=True,
                 activation_offload=True)
    text = describe(w, 1)
    assert "every 2nd layer" in text and "chunked loss (8)" in text
    assert "optimizer in backward" in text and "activation offload" in text
    assert "op-level" in describe(Workload(checkpointing="op"), 1)


class _KnobEstimator(FakeEstimator):
    """The fake formula, where chunked loss drops 7/8 of the logit temporaries and the other
    knobs lower activations or gradients (the directions the real knobs have)."""

    def __call__(self, spec, w, **kw) -> MemoryReport:  # type: ignore[no-untyped-def, override]
        r = super().__call__(spec, w, **kw)
        b = formula(spec, w)
        cut = 0
        if w.loss is Loss.CHUNKED:
            cut += b.temporaries * 7 // 8
        if w.optimizer_in_backward:
            cut += b.gradients * 9 // 10
        if w.activation_offload:
            cut += b.activations // 2
        if w.checkpointing is Checkpointing.FULL and w.checkpoint_every == 2:
            cut -= formula(spec, w.replace(checkpointing="none")).activations // 2 - b.activations // 2
        if not cut:
            return r
        peak = dataclasses.replace(r.peak, allocated=r.peak.allocated - cut, reserved=r.peak.reserved - cut,
                                   device_used=r.peak.device_used - cut)
        verdict = r.verdict and dataclasses.replace(r.verdict, fits=r.verdict.usable >= peak.device_used)
        return r.replace(peak=peak, verdict=verdict)


def test_only_knobs_that_lower_the_peak_are_searched() -> None:
    w = Workload(batch=2, seq=2048)
    assert saving_knobs(Evaluator(LLAMA, estimator=FakeEstimator()), w) == {"op"}  # the fake knows op SAC only
    found = saving_knobs(Evaluator(LLAMA, estimator=_KnobEstimator()), w)
    assert found == ALL_KNOBS
    assert saving_knobs(Evaluator(LLAMA, estimator=_KnobEstimator()), w.replace(task="infer")) == frozenset()


def test_plan_ranks_knob_variants_by_step_time_and_says_what_it_searched() -> None:
    from vramplan.planner.plan import plan

    est = _KnobEstimator()
    r = plan(LLAMA, Workload(batch=2, seq=4096), gpu=H100, method="analytic", screen=screen_for(LLAMA, est),
             instances=[])
    assert any(n.startswith("loop savings searched: chunked cross-entropy") for n in r.notes)
    from vramplan.planner.pareto import sort_key

    assert list(r.plans) == sorted(r.plans, key=sort_key("speed"))  # ranked by step time like the others
    assert r.candidates > len(candidates(Workload(batch=2, seq=4096), H100, max_gpus=1))


def test_each_knob_has_a_step_time_cost() -> None:
    s = model_shape(LLAMA)
    lay = layout_of(s)
    base = Workload(batch=4, seq=2048)
    f = {k: train_flops(lay, base.replace(**ch), 4, 2048).recompute for k, ch in {
        "none": {}, "full": {"checkpointing": "full"}, "every2": {"checkpointing": "full", "checkpoint_every": 2},
        "op": {"checkpointing": "op"}, "cce": {"loss": "cce"}}.items()}
    assert f["none"] == 0 and f["full"] > f["op"] > 0
    assert f["every2"] == pytest.approx(f["full"] / 2)
    assert f["cce"] == pytest.approx(2.0 * lay.head * 4 * 2048)  # the head matmul again
    t0 = step_time(LLAMA, base, H100)
    t_off = step_time(LLAMA, base.replace(checkpointing="full", activation_offload=True), H100)
    t_ck = step_time(LLAMA, base.replace(checkpointing="full"), H100)
    assert t_off.offload_total > 0 and t_off.total >= t_ck.total > t0.total
    assert any("activation offload" in n for n in t_off.notes)


def test_fit_suggests_a_loop_saving_when_it_is_what_fits() -> None:
    from vramplan.planner.nextstep import cheapest_fix

    # a 1B-ish model whose only problem is its fp32 logits: chunked loss is the cheapest fix
    spec = dataclasses.replace(LLAMA, name="wide-vocab", hidden=1024, layers=4, intermediate=4096,
                               vocab=1_000_000, params=1_100_000_000, active_params=1_100_000_000)
    w = Workload(batch=1, seq=8192, optimizer="sgd")
    est = _KnobEstimator()
    assert not est(spec, w, gpu=RTX4090, method="analytic").verdict.fits
    fix = cheapest_fix(spec, w, RTX4090, estimator=est)
    assert fix is not None and fix.flags.startswith("--loss chunked"), fix
    assert fix.device_used <= 24 * GiB
    # a recipe that cannot run it is not offered it
    fix = cheapest_fix(spec, recipes.apply("hf-trainer", batch=1, seq=8192, optimizer="sgd"), RTX4090, estimator=est)
    assert fix is None or "--loss chunked" not in fix.flags
