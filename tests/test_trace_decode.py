"""The generation fast path writes decode steps from their exact progression: the event log
must equal the step-by-step trace's, event for event (ids, sizes, shapes, categories)."""

from __future__ import annotations

import pytest

from vramplan.hardware.catalog import get_gpu
from vramplan.models.catalog import resolve
from vramplan.trace.decode import _affine
from vramplan.trace.run import TraceOptions, trace_workload
from vramplan.trace.testing import tiny_spec
from vramplan.workload import Workload

FAST, FULL = TraceOptions(extrapolate_decode=True), TraceOptions(extrapolate_decode=False)


def _both(spec, w, gpu="h100-sxm", iterations=2):
    g = get_gpu(gpu)
    fast = trace_workload(spec, w, gpu=g, options=FAST, iterations=iterations)
    full = trace_workload(spec, w, gpu=g, options=FULL, iterations=iterations)
    return fast, full


def _extrapolated(r) -> bool:
    return any("written from the exact progression" in n for n in r.notes)


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen2.5-7b", "mixtral-8x7b", "gpt2"])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_fast_decode_gives_the_same_event_log(name: str, precision: str) -> None:
    spec = tiny_spec(name)
    w = Workload(task="generate", precision=precision, batch=2, seq=16, new_tokens=24)
    fast, full = _both(spec, w)
    assert _extrapolated(fast) and not _extrapolated(full)
    assert list(fast.events.rows()) == list(full.events.rows())
    assert fast.peak_allocated == full.peak_allocated
    assert fast.flops == full.flops
    assert fast.breakdown_at_peak == full.breakdown_at_peak


def test_static_cache_decode_is_extrapolated_exactly() -> None:
    spec = tiny_spec("llama-3.1-8b")
    w = Workload(task="generate", precision="bf16", batch=1, seq=8, new_tokens=20)
    g = get_gpu("a100-80gb")
    fast = trace_workload(spec, w, gpu=g, options=TraceOptions(cache="static"), iterations=1)
    full = trace_workload(spec, w, gpu=g, options=TraceOptions(cache="static", extrapolate_decode=False),
                          iterations=1)
    assert _extrapolated(fast)
    assert list(fast.events.rows()) == list(full.events.rows())


def test_a_cache_that_is_not_affine_is_traced_step_by_step() -> None:
    # a sliding window (16 in the tiny config) that the generation outgrows: no extrapolation
    spec = tiny_spec("mistral-7b")
    w = Workload(task="generate", precision="bf16", batch=1, seq=12, new_tokens=20)
    fast, full = _both(spec, w, iterations=1)
    assert not _extrapolated(fast)
    assert list(fast.events.rows()) == list(full.events.rows())
    # a quantised cache re-quantises in blocks: not affine either
    w8 = Workload(task="generate", precision="bf16", batch=1, seq=8, new_tokens=12, kv_dtype="int8")
    assert not _extrapolated(trace_workload(tiny_spec("llama-3.1-8b"), w8, options=FAST, iterations=1))


def test_too_few_steps_are_all_traced() -> None:
    spec = tiny_spec("llama-3.1-8b")
    w = Workload(task="generate", precision="bf16", batch=1, seq=8, new_tokens=6)
    fast, full = _both(spec, w, iterations=1)
    assert not _extrapolated(fast)
    assert list(fast.events.rows()) == list(full.events.rows())


def test_affine() -> None:
    assert _affine([3, 5, 7, 9]) == 2
    assert _affine([4, 4, 4]) == 0
    assert _affine([1, 2, 4]) is None


@pytest.mark.slow
def test_llama_8b_64_tokens_same_peak_as_the_full_trace() -> None:
    spec = resolve("llama-3.1-8b")
    w = Workload(task="generate", precision="bf16", batch=1, seq=512, new_tokens=64)
    fast, full = _both(spec, w, iterations=1)
    assert _extrapolated(fast)
    assert fast.peak_allocated == full.peak_allocated
    assert len(fast.events) == len(full.events)
    assert fast.flops == full.flops
