"""The process's trace and replay caches (``vramplan.engine.cache``): keyed by everything a
result depends on, bounded, and invisible in the answers."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from vramplan.engine import cache, estimate
from vramplan.engine.cache import BoundedCache, spec_key, trace_key
from vramplan.engine.pipeline import profile
from vramplan.engine.resolve import resolve_gpu
from vramplan.errors import VramplanError
from vramplan.trace.testing import tiny_spec
from vramplan.workload import Workload

run_mod = importlib.import_module("vramplan.trace.run")


# --------------------------------------------------------------------------- the bounded cache
def test_bounded_by_entries_least_recently_used_out() -> None:
    c: BoundedCache[int] = BoundedCache(3, 10**9, lambda v: 1)
    for k in "abc":
        c.put(k, ord(k))
    assert c.get("a") == ord("a")  # a is now the most recent
    c.put("d", 4)
    assert len(c) == 3 and "b" not in c and {"a", "c", "d"} <= {k for k in "abcd" if k in c}


def test_bounded_by_weight_and_oversize_not_kept() -> None:
    c: BoundedCache[int] = BoundedCache(100, 10, lambda v: v)
    c.put("a", 4)
    c.put("b", 4)
    c.put("c", 4)  # 12 > 10: a goes
    assert "a" not in c and c.weight == 8
    c.put("big", 11)  # larger than the whole cache: not kept, nothing evicted for it
    assert "big" not in c and len(c) == 2 and c.weight == 8
    c.put("b", 1)  # replacing an entry re-weighs it
    assert c.weight == 5 and c.get("b") == 1


@given(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 7)), max_size=60),
       st.integers(1, 6), st.integers(7, 30))
def test_bounds_always_hold(ops: list[tuple[int, int]], entries: int, weight: int) -> None:
    c: BoundedCache[int] = BoundedCache(entries, weight, lambda v: v)
    last: dict[int, int] = {}
    for k, v in ops:
        c.put(k, v)
        last[k] = v
        assert len(c) <= entries and c.weight <= weight
        assert c.get(k) == v  # the newest entry always stays (each weighs at most 7 ≤ weight)
    for k in last:
        got = c.get(k)
        assert got is None or got == last[k]


def test_disabled_cache_keeps_nothing() -> None:
    c: BoundedCache[int] = BoundedCache(4, 100, lambda v: 1)
    c.enabled = False
    c.put("a", 1)
    assert c.get("a") is None and len(c) == 0


# --------------------------------------------------------------------------- keys
_FIELDS = st.fixed_dictionaries({
    "task": st.sampled_from(["train", "infer", "generate"]),
    "batch": st.integers(1, 64),
    "seq": st.sampled_from([128, 256, 512, 2048]),
    "new_tokens": st.sampled_from([1, 8, 128]),
    "precision": st.sampled_from(["bf16-mixed", "bf16", "fp16-mixed", "fp32"]),
    "peft": st.sampled_from(["none", "lora"]),
    "checkpointing": st.sampled_from(["none", "full"]),
    "optimizer": st.sampled_from(["adamw", "sgd"]),
    "attention": st.sampled_from(["sdpa", "eager"]),
    "keep_grads": st.booleans(),
    "loss": st.sampled_from(["full", "chunked"]),
})

_SPEC = tiny_spec("llama-3.1-8b")
_DEV = profile(resolve_gpu("h100-sxm"), Workload())


def _workload(fields: dict) -> Workload:
    try:
        return Workload(**fields)
    except VramplanError:
        assume(False)
        raise


@given(_FIELDS, _FIELDS)
def test_workloads_share_a_key_only_when_equal(a: dict, b: dict) -> None:
    wa, wb = _workload(a), _workload(b)
    ka, kb = trace_key(_SPEC, wa, _DEV), trace_key(_SPEC, wb, _DEV)
    assert (ka == kb) == (wa == wb)
    assert trace_key(_SPEC, Workload(**a), _DEV) == ka  # built again: the same key


@given(_FIELDS, st.sampled_from(["batch", "seq", "new_tokens", "keep_grads", "attention"]))
def test_one_changed_field_changes_the_key(a: dict, field: str) -> None:
    w = _workload(a)
    other = {"batch": w.batch + 1, "seq": w.seq * 2, "new_tokens": w.new_tokens + 1,
             "keep_grads": not w.keep_grads, "attention": "eager" if str(w.attention) != "eager" else "sdpa"}[field]
    try:
        w2 = w.replace(**{field: other})
    except VramplanError:
        assume(False)
        raise
    assert trace_key(_SPEC, w2, _DEV) != trace_key(_SPEC, w, _DEV)


def test_specs_and_devices_are_part_of_the_key() -> None:
    w = Workload()
    assert spec_key(tiny_spec("llama-3.1-8b")) == spec_key(tiny_spec("llama-3.1-8b"))
    others = [
        tiny_spec("llama-3.1-8b", layers=3),
        tiny_spec("qwen2.5-0.5b"),
        dataclasses.replace(_SPEC, config={**_SPEC.config, "rope_theta": 1.0}),  # only the config differs
        dataclasses.replace(_SPEC, name="other"),
    ]
    keys = {spec_key(s) for s in others}
    assert len(keys) == len(others) and spec_key(_SPEC) not in keys
    devs = [profile(resolve_gpu(g), w) for g in ("h100-sxm", "a100-sxm4-80gb", "rtx-4090", "t4")]
    devs.append(profile(None, w))
    devs.append(profile(resolve_gpu("h100-sxm"), w.replace(parallel=dataclasses.replace(w.parallel, dp=8))))
    assert len({trace_key(_SPEC, w, d) for d in devs}) == len(devs)


# --------------------------------------------------------------------------- in the estimate
@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[Workload]:
    calls: list[Workload] = []
    real = run_mod.trace_workload

    def trace_workload(spec, w, **kw):  # type: ignore[no-untyped-def]
        calls.append(w)
        return real(spec, w, **kw)

    monkeypatch.setattr(run_mod, "trace_workload", trace_workload)
    return calls


def test_a_second_estimate_reuses_the_trace_and_answers_the_same(counted: list[Workload]) -> None:
    w = Workload(task="train", batch=2, seq=64)
    first = estimate(_SPEC, w, gpu="h100-sxm", method="trace", search_max_batch=False)
    again = estimate(_SPEC, w, gpu="h100-sxm", method="trace", search_max_batch=False)
    assert len(counted) == 1
    cache.TRACES.enabled = False
    try:
        fresh = estimate(_SPEC, w, gpu="h100-sxm", method="trace", search_max_batch=False)
    finally:
        cache.TRACES.enabled = True
    assert len(counted) == 2
    for r in (again, fresh):
        assert r.peak == first.peak and r.breakdown == first.breakdown and r.phases == first.phases
        assert r.allocator == first.allocator and r.notes == first.notes
    assert list(fresh.events.rows()) == list(first.events.rows())  # traces are deterministic


def test_different_workloads_and_gpus_trace_again(counted: list[Workload]) -> None:
    w = Workload(task="train", batch=1, seq=64)
    a = estimate(_SPEC, w, gpu="h100-sxm", method="trace", search_max_batch=False)
    b = estimate(_SPEC, w.replace(batch=3), gpu="h100-sxm", method="trace", search_max_batch=False)
    c = estimate(_SPEC, w, gpu="t4", method="trace", search_max_batch=False)  # another cuBLAS workspace
    assert len(counted) == 3
    assert b.peak.allocated > a.peak.allocated
    assert c.peak.allocated != a.peak.allocated


def test_a_checkpoint_policy_is_never_cached(counted: list[Workload]) -> None:
    w = Workload(task="train", batch=1, seq=64, checkpointing="full")
    for _ in range(2):
        estimate(_SPEC, w, gpu="h100-sxm", method="trace", search_max_batch=False,
                 checkpoint_policy=lambda ctx, op, *a, **k: None)
    assert len(counted) == 2


def test_replays_are_keyed_by_trace_conf_and_capacity() -> None:
    from vramplan.engine.methods import replay_trace, trace_catalog_model

    dev = profile(resolve_gpu("h100-sxm"), Workload(task="train", seq=64))
    tr = trace_catalog_model(_SPEC, Workload(task="train", seq=64), dev)
    r1 = replay_trace(tr, None)
    assert replay_trace(tr, None) is r1
    capped = replay_trace(tr, None, r1.max_reserved - 1)
    assert capped is not r1 and capped.alloc_retries + capped.ooms > 0
    expandable = replay_trace(tr, "expandable_segments:True")
    assert expandable is not r1 and expandable.conf != r1.conf
    other = trace_catalog_model(_SPEC, Workload(task="train", seq=64, batch=2), dev)
    assert replay_trace(other, None).max_allocated > r1.max_allocated


def test_building_a_model_leaves_its_spec_alone() -> None:
    """transformers edits a config's nested entries in place (rope_scaling gains rope_theta);
    the build hands it a copy, so the spec, and the trace cache's key, stay what they were."""
    from vramplan.models.build import build_model

    spec = tiny_spec("llama-3.1-8b")
    before = spec_key(spec)
    build_model(spec, device="meta")
    assert spec_key(spec) == before
