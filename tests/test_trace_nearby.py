"""A trace written from three traces at other batches (``trace/nearby.py``) equals a fresh trace
of that batch: the same event log, event for event, and every figure read from it — on 20+
workloads of different models, tasks and knobs. Where the traces do not prove the progression
(batch 1's log is shorter than batch 2's; activation offload), it refuses and names why."""

from __future__ import annotations

import dataclasses
import os

import pytest

from vramplan.engine import cache
from vramplan.engine.device import profile
from vramplan.engine.resolve import resolve_gpu, resolve_model
from vramplan.trace.nearby import write_at
from vramplan.trace.options import TraceOptions
from vramplan.trace.replicate import _same_log
from vramplan.workload import Parallel, Workload

XS = (2, 4, 6)
"""Batches traced; the written batch lies between them (3 or 5)."""

CASES = [
    ("gpt2", dict(task="train", seq=32), None),
    ("gpt2", dict(task="infer", seq=32), None),
    ("gpt2", dict(task="generate", seq=16, new_tokens=6), None),
    ("gpt2", dict(task="train", seq=32, optimizer="sgd"), None),
    ("gpt2", dict(task="train", seq=32, precision="fp16-mixed"), "h100"),
    ("gpt2", dict(task="train", seq=32, keep_grads=True, optimizer_impl="fused"), None),
    ("gpt2", dict(task="train", seq=32, optimizer_in_backward=True), None),
    ("gpt2", dict(task="train", seq=32, attention="eager", checkpointing="full"), None),
    ("qwen2.5-0.5b", dict(task="train", seq=32, precision="bf16-mixed", checkpointing="full"), "h100"),
    ("qwen2.5-0.5b", dict(task="train", seq=32, peft="lora"), None),
    ("qwen2.5-0.5b", dict(task="infer", seq=48), "a100-80gb"),
    ("llama-3.2-1b", dict(task="train", seq=32, precision="bf16"), None),
    ("llama-3.2-1b", dict(task="train", seq=32, peft="qlora"), None),
    ("llama-3.2-1b", dict(task="generate", seq=16, new_tokens=6), "rtx-4090"),
    ("llama-3.2-1b", dict(task="train", seq=32, loss="chunked"), None),
    ("llama-3.2-1b", dict(task="train", seq=32, loss="trl"), None),
    ("llama-3.2-1b", dict(task="train", seq=32, optimizer="adamw-8bit"), None),
    ("llama-3.2-1b", dict(task="train", seq=32, attention="eager"), None),
    ("llama-3.2-1b", dict(task="train", seq=32, grad_accum=2), None),
    ("llama-3.2-1b", dict(task="train", seq=32, attention="flash", precision="bf16-mixed"), "h100"),
    ("llama-3.2-1b", dict(task="train", seq=32, parallel=Parallel(dp=2, zero=3)), None),
    ("bert-base", dict(task="train", seq=32), None),
    ("vit-base", dict(task="train", image_size=64), None),
]


def _traces(name: str, kw: dict, gpu: str | None, batches: tuple[int, ...]) -> dict[int, object]:
    from vramplan.trace.run import trace_workload

    spec = resolve_model(name)
    g = resolve_gpu(gpu) if gpu else None
    out = {}
    for b in batches:
        w = Workload(batch=b, **kw)
        out[b] = trace_workload(spec, w, device=profile(g, w), options=TraceOptions(), models=cache.MODELS)
    return out


FIGURES = ("peak_allocated", "peak_index", "breakdown_at_peak", "peak_phase", "peak_module", "phases", "iterations",
           "top_tensors", "top_modules", "params", "trainable_params", "flops", "timeline", "notes", "host_memory",
           "host_parts", "paths")


@pytest.mark.parametrize(("name", "kw", "gpu"), CASES, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(CASES)])
def test_written_trace_equals_a_fresh_one(name: str, kw: dict, gpu: str | None) -> None:
    x = 3 + 2 * (len(kw) % 2)  # 3 or 5: both gaps are exercised
    tr = _traces(name, kw, gpu, (*XS, x))
    got = write_at([tr[b] for b in XS], XS, x)
    assert not isinstance(got, str), got
    fresh = tr[x]
    assert _same_log(got.events, fresh.events)
    for f in FIGURES:
        assert getattr(got, f) == getattr(fresh, f), f


def test_batch_one_and_activation_offload_are_refused() -> None:
    tr = _traces("gpt2", dict(task="train", seq=32), None, (1, 2, 3))
    assert write_at([tr[1], tr[2], tr[3]], (1, 2, 3), 2) == "the logs differ in length"
    tr = _traces("gpt2", dict(task="train", seq=32, activation_offload=True, checkpointing="full"), None, (2, 3, 4))
    why = write_at([tr[2], tr[3], tr[4]], (2, 3, 4), 3)
    assert isinstance(why, str)
    assert write_at([tr[2], tr[3], tr[4]], (2, 3, 4), 5) == "batch 5 is outside the traced 2..4"


def test_a_size_off_the_line_is_refused() -> None:
    tr = _traces("gpt2", dict(task="infer", seq=32), None, (2, 3, 4))
    bent = tr[4].events
    k = next(i for i in range(len(bent)) if bent.size[i] > 0)
    bent.size[k] += 512
    assert write_at([tr[2], tr[3], tr[4]], (2, 3, 4), 3) == "a size is not linear in the batch"


def test_quadratic_sizes_do_not_pass_as_lines() -> None:
    """Attention scores grow with seq²: three sequence lengths are never collinear for them, so a
    trace is never written across sequence lengths by the batch rule's arithmetic."""
    spec = resolve_model("gpt2")
    from vramplan.trace.run import trace_workload

    tr = [trace_workload(spec, w, device=profile(None, w), options=TraceOptions())
          for w in (Workload(task="infer", batch=2, seq=s, attention="eager") for s in (16, 32, 48))]
    assert write_at(tr, (16, 32, 48), 24) == "a size is not linear in the batch"


def test_the_catalog_spec_is_not_changed_by_a_trace() -> None:
    """A trace must not edit the spec's config (transformers adds rope_theta to rope_scaling in
    place): the disk key read before the trace would differ from the one after it."""
    spec = resolve_model("llama-3.2-1b")
    before = cache.disk_key(spec, Workload(), profile(None, Workload()), TraceOptions())
    os.environ.pop("VRAMPLAN_FULL_TRACE", None)
    _traces("llama-3.2-1b", dict(task="infer", seq=16), None, (2,))
    after = cache.disk_key(spec, Workload(), profile(None, Workload()), TraceOptions())
    assert dataclasses.asdict(before) == dataclasses.asdict(after)  # type: ignore[arg-type]


SEQ_CASES = [
    ("gpt2", dict(task="train", batch=2)),
    ("qwen2.5-0.5b", dict(task="train", batch=2, peft="lora", precision="bf16-mixed")),
    ("llama-3.2-1b", dict(task="infer", batch=3)),
]


@pytest.mark.parametrize(("name", "kw"), SEQ_CASES, ids=[n for n, _ in SEQ_CASES])
def test_a_sequence_length_written_from_congruent_ones_equals_a_fresh_trace(name: str, kw: dict) -> None:
    from vramplan.trace.run import trace_workload

    spec = resolve_model(name)
    tr = {s: trace_workload(spec, w, device=profile(None, w), options=TraceOptions(), models=cache.MODELS)
          for s, w in ((s, Workload(seq=s, **kw)) for s in (128, 256, 384, 512, 640))}
    xs = (128, 256, 512, 640)
    three = write_at([tr[v] for v in xs[:3]], xs[:3], 384, "seq")
    assert three == "FLOPs are not linear in the seq"  # (attention's seq²: a parabola needs a fourth trace)
    got = write_at([tr[v] for v in xs], xs, 384, "seq")
    assert not isinstance(got, str), got
    assert _same_log(got.events, tr[384].events)
    for f in FIGURES:
        assert getattr(got, f) == getattr(tr[384], f), f
    assert write_at([tr[v] for v in xs], xs, 320, "seq") == "the lengths are not congruent modulo 128"


from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@given(st.lists(st.integers(-5, 5), min_size=1, max_size=200), st.data())
def test_window_argmax_is_argmax_per_window(values: list[int], data) -> None:
    import numpy as np

    from vramplan.trace.analysis import window_argmax

    n = len(values)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(n - 1, 1)), max_size=20)) if n > 1 else []) | {0})
    cuts = [c for c in cuts if c < n]
    starts = np.asarray(cuts, np.int64)
    ends = np.append(starts[1:], n)
    v = np.asarray(values, np.int64)
    want = [s + int(np.argmax(v[s:e])) for s, e in zip(starts, ends, strict=True)]
    assert window_argmax(v, starts, ends).tolist() == want


@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=100))
def test_combinations_are_the_distinct_rows(rows: list[tuple[int, int, int]]) -> None:
    import numpy as np

    from vramplan.trace.nearby import _combinations

    cols = [np.asarray(c, np.int64) for c in zip(*rows, strict=True)]
    got, inverse = _combinations(cols)
    assert sorted(map(tuple, got.tolist())) == sorted(set(rows))
    assert [tuple(got[k]) for k in inverse.tolist()] == rows
