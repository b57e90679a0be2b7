"""Prepared models borrowed across traces (``vramplan.trace.reuse``, ``engine.cache.MODELS``):
a trace on a borrowed model records the same log as a fresh build, models are keyed by every
workload field but batch and sequence, lent to one trace at a time, bounded, and never given
back changed."""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from test_engine_cache import _workload
from vramplan.engine import cache
from vramplan.engine.cache import ModelPool
from vramplan.engine.pipeline import profile
from vramplan.engine.resolve import resolve_gpu
from vramplan.errors import TraceError
from vramplan.trace import reuse
from vramplan.trace.replicate import _same_log
from vramplan.trace.testing import tiny_spec
from vramplan.workload import Parallel, Workload

run_mod = importlib.import_module("vramplan.trace.run")


@pytest.fixture(autouse=True)
def _one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store's counts here are one process's: a reduced trace that takes ≥ 0.2 s (a loaded
    machine, a long sequence) would otherwise run in a forked child and keep its model there
    (``tests/test_trace_forked.py`` pins that case)."""
    monkeypatch.setenv("VRAMPLAN_TRACE_WORKERS", "1")
trace_workload = run_mod.trace_workload

TRAIN = Workload(task="train", batch=1, seq=64, precision="bf16-mixed", optimizer="adamw", optimizer_impl="foreach")
DEV = profile(resolve_gpu("rtx-4090"), TRAIN)


def _assert_same(a, b) -> None:  # type: ignore[no-untyped-def]
    assert _same_log(a.events, b.events)
    assert list(a.events.rows()) == list(b.events.rows())
    assert a.peak_allocated == b.peak_allocated and a.breakdown_at_peak == b.breakdown_at_peak
    assert a.phases == b.phases and a.iterations == b.iterations
    assert a.top_modules == b.top_modules and a.top_tensors == b.top_tensors and a.peak_module == b.peak_module
    assert (a.flops, a.params, a.trainable_params) == (b.flops, b.params, b.trainable_params)
    assert a.notes == b.notes


# (model, layers, workload, the other batch and sequence): 6 layers are traced replicated
# (three reduced models, each borrowed), 2 layers in full
CASES = {
    "llama LoRA, full checkpointing": ("llama-3.1-8b", 6, TRAIN.replace(peft="lora", checkpointing="full"), (3, 64)),
    "llama LoRA, longer sequence": ("llama-3.1-8b", 6, TRAIN.replace(peft="lora", checkpointing="full"), (1, 96)),
    "llama QLoRA": ("llama-3.1-8b", 6, TRAIN.replace(peft="qlora", precision="bf16"), (2, 48)),
    "llama full fine-tune, op-level SAC": ("llama-3.1-8b", 6, TRAIN.replace(checkpointing="op"), (2, 64)),
    "llama fp32 SGD, 2 layers (traced in full)": (
        "llama-3.1-8b", 2, TRAIN.replace(precision="fp32", optimizer="sgd", optimizer_impl="for-loop"), (2, 32)),
    "llama generate": ("llama-3.1-8b", 6, Workload(task="generate", batch=1, seq=32, new_tokens=8, precision="bf16"),
                       (2, 40)),
    "llama infer, eager attention": ("llama-3.1-8b", 2, Workload(task="infer", batch=1, seq=32, precision="bf16",
                                                                  attention="eager"), (3, 32)),
    "mixtral": ("mixtral-8x7b", 6, TRAIN, (2, 64)),
    # the step keeps its gradients: the model comes back only after settle() drops them
    "llama keep_grads, 2 layers": ("llama-3.1-8b", 2, TRAIN.replace(keep_grads=True), (2, 32)),
    # what `plan` varies, 2 layers
    "llama chunked loss, fused AdamW, selective": (
        "llama-3.1-8b", 2, TRAIN.replace(loss="chunked", optimizer_impl="fused", checkpointing="selective"), (2, 32)),
    "llama fp16-mixed (grad scaler), 8-bit AdamW": (
        "llama-3.1-8b", 2, TRAIN.replace(precision="fp16-mixed", optimizer="adamw-8bit"), (2, 48)),
    "bert": ("bert-base", 2, TRAIN, (2, 32)),
    "vit": ("vit-base", 2, TRAIN, (3, 64)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_borrowed_model_traces_as_a_fresh_build(case: str) -> None:
    name, layers, w, (batch, seq) = CASES[case]
    spec = tiny_spec(name, layers=layers)
    other = w.replace(batch=batch, seq=seq)
    pool = ModelPool()
    first = trace_workload(spec, w, device=DEV, models=pool)
    built = len(pool.cache)
    assert built >= 1 and pool.cache.hits == 0  # every model built once and given back
    borrowed = trace_workload(spec, other, device=DEV, models=pool)
    assert pool.cache.hits == built and len(pool.cache) == built  # each borrowed, each given back
    _assert_same(borrowed, trace_workload(spec, other, device=DEV))
    again = trace_workload(spec, w, device=DEV, models=pool)  # the first workload on models traced twice since
    _assert_same(again, first)
    _assert_same(first, trace_workload(spec, w, device=DEV))


def test_the_estimate_borrows_from_the_process_store() -> None:
    from vramplan.engine import estimate

    spec = tiny_spec("llama-3.1-8b", layers=6)
    w = TRAIN.replace(peft="lora", checkpointing="full")
    a = estimate(spec, w, gpu="rtx-4090", method="trace", search_max_batch=False)
    assert len(cache.MODELS.cache) == 3 and cache.MODELS.cache.hits == 0
    b = estimate(spec, w.replace(batch=2), gpu="rtx-4090", method="trace", search_max_batch=False)
    assert cache.MODELS.cache.hits == 3
    cache.MODELS.cache.enabled = False
    try:
        fresh = estimate(spec, w.replace(batch=2), gpu="rtx-4090", method="trace", search_max_batch=False)
    finally:
        cache.MODELS.cache.enabled = True
    assert list(b.events.rows()) == list(fresh.events.rows())
    assert b.peak == fresh.peak and b.breakdown == fresh.breakdown and b.notes == fresh.notes
    assert b.peak.allocated > a.peak.allocated
    cache.clear()
    assert len(cache.MODELS.cache) == 0


# --------------------------------------------------------------------------- keys
_FIELDS = st.fixed_dictionaries({
    "task": st.sampled_from(["train", "infer", "generate"]),
    "batch": st.integers(1, 64),
    "seq": st.sampled_from([128, 256, 2048]),
    "new_tokens": st.sampled_from([1, 128]),
    "precision": st.sampled_from(["bf16-mixed", "bf16", "fp32"]),
    "peft": st.sampled_from(["none", "lora", "qlora"]),
    "lora_rank": st.sampled_from([8, 16]),
    "checkpointing": st.sampled_from(["none", "full"]),
    "optimizer": st.sampled_from(["adamw", "sgd"]),
    "attention": st.sampled_from(["sdpa", "eager", "flash"]),
    "keep_grads": st.booleans(),
    "image_size": st.sampled_from([224, 256]),
})


@given(_FIELDS, _FIELDS, st.sampled_from(["sdpa", "eager"]), st.sampled_from(["sdpa", "eager"]))
def test_models_share_a_key_only_when_all_but_batch_and_seq_are_equal(a: dict, b: dict, att_a: str,
                                                                      att_b: str) -> None:
    wa, wb = _workload(a), _workload(b)
    same = {k: v for k, v in a.items() if k not in ("batch", "seq")} == {
        k: v for k, v in b.items() if k not in ("batch", "seq")}
    assert (reuse.key(wa, att_a, DEV) == reuse.key(wb, att_b, DEV)) == (same and att_a == att_b)


def test_devices_and_specs_are_part_of_the_key() -> None:
    w = TRAIN
    devs = [profile(resolve_gpu(g), w) for g in ("h100-sxm", "rtx-4090", "t4")] + [None]
    assert len({reuse.key(w, "sdpa", d) for d in devs}) == len(devs)
    pool = ModelPool()
    pool.give(tiny_spec("llama-3.1-8b", layers=3), "k", _Fake(1))
    assert pool.take(tiny_spec("llama-3.1-8b", layers=4), "k") is None
    assert pool.take(tiny_spec("qwen2.5-0.5b", layers=3), "k") is None
    assert pool.take(tiny_spec("llama-3.1-8b", layers=3), "k") is not None


# --------------------------------------------------------------------------- the store
class _Fake:
    def __init__(self, modules: int) -> None:
        self.modules = modules


def test_a_model_is_lent_to_one_trace_at_a_time() -> None:
    pool = ModelPool()
    spec = tiny_spec("llama-3.1-8b")
    m = _Fake(10)
    pool.give(spec, "k", m)
    assert pool.take(spec, "k") is m
    assert pool.take(spec, "k") is None  # lent: not in the store until given back
    pool.give(spec, "k", m)
    assert pool.take(spec, "k") is m


@given(st.lists(st.tuples(st.integers(0, 12), st.integers(1, 40)), max_size=50), st.integers(1, 6),
       st.integers(40, 120))
def test_the_store_is_bounded(ops: list[tuple[int, int]], entries: int, modules: int) -> None:
    pool = ModelPool(entries, modules)
    spec = tiny_spec("llama-3.1-8b")
    for k, n in ops:
        pool.give(spec, k, _Fake(n))
        assert len(pool.cache) <= entries and pool.cache.weight <= modules
        assert pool.take(spec, k) is not None  # the newest always stays (each weighs at most 40)
        pool.give(spec, k, _Fake(n))


def test_a_disabled_store_lends_nothing() -> None:
    pool = ModelPool()
    pool.cache.enabled = False
    spec = tiny_spec("llama-3.1-8b")
    pool.give(spec, "k", _Fake(1))
    assert pool.take(spec, "k") is None and len(pool.cache) == 0


# --------------------------------------------------------------------------- what comes back
def test_a_model_left_changed_is_not_given_back(monkeypatch: pytest.MonkeyPatch) -> None:
    real = run_mod._trace

    def leaves_a_hook(p, *a, **k):  # type: ignore[no-untyped-def]
        out = real(p, *a, **k)
        p.model.register_forward_hook(lambda *_: None)
        return out

    monkeypatch.setattr(run_mod, "_trace", leaves_a_hook)
    pool = ModelPool()
    trace_workload(tiny_spec("llama-3.1-8b"), TRAIN, device=DEV, models=pool)
    assert len(pool.cache) == 0


def test_a_trace_that_fails_keeps_its_model(monkeypatch: pytest.MonkeyPatch) -> None:
    def fails(*a, **k):  # type: ignore[no-untyped-def]
        raise TraceError("tracing failed")

    monkeypatch.setattr(run_mod, "_trace", fails)
    pool = ModelPool()
    with pytest.raises(TraceError):
        trace_workload(tiny_spec("llama-3.1-8b"), TRAIN, device=DEV, models=pool)
    assert len(pool.cache) == 0


def test_state_sees_what_a_trace_could_leave() -> None:
    from vramplan.models.build import build_model

    changes = [
        lambda m, p: setattr(p, "grad", p.detach().clone()),
        lambda m, p: p.requires_grad_(False),
        lambda m, p: p.register_hook(lambda g: g),
        lambda m, p: m.register_forward_pre_hook(lambda *_: None),
        lambda m, p: m.eval(),
        lambda m, p: setattr(next(iter(m.children())), "cached", 1),
        lambda m, p: setattr(next(iter(m.children())), "extra", torch.nn.Linear(2, 2, device="meta")),
    ]
    for change in changes:
        m = build_model(tiny_spec("llama-3.1-8b"), device="meta")
        base = reuse.state(m)
        assert reuse.state(m) == base
        change(m, next(m.parameters()))
        assert reuse.state(m) != base
        reuse.settle(m)
    m = build_model(tiny_spec("llama-3.1-8b"), device="meta")
    base = reuse.state(m)
    next(m.parameters()).grad = next(m.parameters()).detach().clone()
    reuse.settle(m)  # gradients are what a trace leaves, and settle undoes
    assert reuse.state(m) == base


@pytest.mark.parametrize("w", [
    TRAIN.replace(parallel=Parallel(dp=2, zero=3)),
    TRAIN.replace(optimizer_in_backward=True),
    TRAIN.replace(activation_offload=True, checkpointing="none"),
    TRAIN.replace(compile=True),
])
def test_layouts_that_change_the_model_never_borrow(w: Workload) -> None:
    assert not reuse.reusable(w, model_parallel=run_mod._model_parallel(w), layout=run_mod.data_layout(w),
                              checkpoint_policy=None)


def test_a_checkpoint_policy_never_borrows() -> None:
    assert not reuse.reusable(TRAIN, model_parallel=False, layout=None, checkpoint_policy=lambda *a: None)
    assert reuse.reusable(TRAIN, model_parallel=False, layout=None, checkpoint_policy=None)


# --------------------------------------------------------------------------- answers
def _cli_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    import json

    from vramplan.cli.main import main

    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


LORA_4090 = ("llama-3.1-8b", "--gpu", "rtx-4090", "--task", "train", "--peft", "lora", "--json")


@pytest.mark.slow
def test_fit_of_the_bench_case_answers_as_before(capsys: pytest.CaptureFixture[str]) -> None:
    """``bench/plan_speed.py``'s fit (Llama-3.1-8B / RTX 4090 / LoRA): the figures recorded on
    commit db406fd, before models were borrowed; 9 of its 12 reduced-model traces borrow."""
    d = _cli_json(capsys, "fit", *LORA_4090)

    def point(p: dict) -> list:
        return [p["batch"], p["seq"], p["allocated"], p["reserved"], p["device_used"], p["method"]]

    b, s = d["boundary"]["batch"], d["boundary"]["seq"]
    assert [d["max_batch"], d["max_seq"], point(b["at"]), point(b["above"]), point(s["at"]), point(s["above"])] == [
        1, 3840,
        [1, 2048, 19964692480, 21078474752, 21622979297, "trace"],
        [2, 2048, 23687178240, 25602031616, 26146536161, "trace"],
        [1, 3840, 23222799360, 25050480640, 25594985185, "trace"],
        [1, 3968, 23460633088, 25344081920, 25888586465, "trace"],
    ]
    assert d["evaluations"] == {"total": 13, "traces": 4, "analytic": 9}
    assert cache.MODELS.cache.hits == 9


@pytest.mark.slow
def test_plan_of_the_bench_case_answers_as_before(capsys: pytest.CaptureFixture[str]) -> None:
    d = _cli_json(capsys, "plan", *LORA_4090)
    # (the analytic ZeRO-3 figures count FSDP2's prefetched all-gather of the last block since session 53; since
    # session 54 FSDP2's LoRA adapters are gathered in param_dtype, so peft's input casts copy nothing: without
    # checkpointing, three [T, h] bf16 copies per layer fewer, 16,940,487,393 -> 15,220,726,497; the same
    # session's FSDP2 root-unit terms (gathered once beside the running block, its reduce-scatter instants) move
    # the two checkpointed plans: 11,660,137,185 -> 11,659,251,220, 5,648,031,661 -> 5,619,414,138)
    assert [[p["label"], p["memory"], p["method"], p["confirmed"]] for p in d["plans"]] == [
        ["bf16-mixed + full checkpointing + fused adamw + LoRA r16, batch 1", 21570550497, "trace", True],
        ["bf16 + full checkpointing + chunked loss (8) + LoRA r16, batch 1", 19794262753, "trace", True],
        ["bf16-mixed + full checkpointing + chunked loss (8) + LoRA r16, batch 1", 19802651361, "trace", True],
        ["bf16-mixed + chunked loss (8) + LoRA r16 + ZeRO-3 + param + optimizer offload, batch 1", 15220726497,
         "analytic", False],
        ["bf16-mixed + op-level selective checkpointing + LoRA r16 + ZeRO-3 + param + optimizer offload, batch 1",
         11659251220, "analytic", False],
        ["bf16-mixed + full checkpointing + chunked loss (8) + LoRA r16 + ZeRO-3 + param + optimizer offload, batch 1",
         5619414138, "analytic", False],
    ]
    assert d["evaluations"] == {"total": 92, "traces": 3, "analytic": 89} and d["candidates"] == 88
