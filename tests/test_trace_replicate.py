"""Identical layers traced once (trace.replicate): the replicated log is the full trace's.

Each case traces a small catalog model twice, with replication (the default) and with
``replicate_layers=False``, and compares every column of the event logs (ids, sizes,
streams, categories, phases, module paths, ops, shapes, iterations), the peak, FLOPs,
parameter counts, per-module attribution and notes.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vramplan.trace import replicate
from vramplan.trace.replicate import _note, _same_log, align
from vramplan.trace.run import TraceOptions, trace_workload
from vramplan.trace.testing import tiny_spec
from vramplan.workload import Parallel, Workload

TRAIN = Workload(task="train", batch=1, seq=64, precision="bf16-mixed", optimizer="adamw", optimizer_impl="foreach")
REPLICATED = "identical layers traced once"


def _both(name: str, layers: int, w: Workload):  # type: ignore[no-untyped-def]
    spec = tiny_spec(name, layers=layers)
    return trace_workload(spec, w), trace_workload(spec, w, options=TraceOptions(replicate_layers=False))


def _assert_same(fast, full) -> None:  # type: ignore[no-untyped-def]
    assert _same_log(fast.events, full.events)
    assert fast.peak_allocated == full.peak_allocated
    assert fast.breakdown_at_peak == full.breakdown_at_peak
    assert fast.phases == full.phases and fast.iterations == full.iterations
    assert fast.top_modules == full.top_modules and fast.top_tensors == full.top_tensors
    assert fast.peak_module == full.peak_module
    assert (fast.flops, fast.params, fast.trainable_params) == (full.flops, full.params, full.trainable_params)
    assert fast.notes[:-1] == full.notes


CASES = {
    "llama, no checkpointing": ("llama-3.1-8b", 7, TRAIN),
    "llama, full checkpointing": ("llama-3.1-8b", 7, TRAIN.replace(checkpointing="full")),
    "llama, op-level SAC": ("llama-3.1-8b", 6, TRAIN.replace(checkpointing="op")),
    "llama, selective": ("llama-3.1-8b", 6, TRAIN.replace(checkpointing="selective")),
    "llama, LoRA": ("llama-3.1-8b", 6, TRAIN.replace(peft="lora", checkpointing="full")),
    "llama, QLoRA": ("llama-3.1-8b", 6, TRAIN.replace(peft="qlora", precision="bf16")),
    "llama, fp32 SGD for-loop": ("llama-3.1-8b", 6, TRAIN.replace(precision="fp32", optimizer="sgd",
                                                                  optimizer_impl="for-loop")),
    "llama, generate": ("llama-3.1-8b", 6, Workload(task="generate", batch=2, seq=32, new_tokens=12,
                                                     precision="bf16")),
    "llama, infer": ("llama-3.1-8b", 6, Workload(task="infer", batch=2, seq=32, precision="bf16")),
    "mixtral": ("mixtral-8x7b", 6, TRAIN),
    "deepseek-v3 (dense prefix, shared experts, MLA)": ("deepseek-v3", 7, TRAIN.replace(checkpointing="full")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_replicated_log_is_the_full_trace(case: str) -> None:
    name, layers, w = CASES[case]
    fast, full = _both(name, layers, w)
    assert fast.notes[-1].startswith(REPLICATED), fast.notes[-1]
    _assert_same(fast, full)


@pytest.mark.parametrize("w, why", [
    (TRAIN.replace(checkpointing="full", checkpoint_every=2), "checkpointing only some layers"),
    (TRAIN.replace(checkpointing="full", checkpoint_fraction=0.5), "checkpointing only some layers"),
    (TRAIN.replace(parallel=Parallel(dp=2, zero=3)), "parallel layouts are traced in full"),
])
def test_refused_up_front(w: Workload, why: str) -> None:
    spec = tiny_spec("llama-3.1-8b", layers=6)
    from vramplan.trace.layout import layout_of

    assert replicate.refusal(spec, w, model_parallel=False, layout=layout_of(w), checkpoint_policy=None) == why
    fast = trace_workload(spec, w)
    assert not any(REPLICATED in n for n in fast.notes)


def test_per_layer_patterns_are_traced_in_full() -> None:
    """Gemma-2 alternates sliding and global layers: its config's layer_types differ per layer."""
    spec = tiny_spec("gemma-2-9b", layers=6)
    assert replicate.refusal(spec, TRAIN, model_parallel=False, layout=None, checkpoint_policy=None) is not None
    fast, full = _both("gemma-2-9b", 6, TRAIN)
    assert not any(REPLICATED in n for n in fast.notes)
    assert _same_log(fast.events, full.events)


def test_too_few_layers_traces_in_full() -> None:
    spec = tiny_spec("llama-3.1-8b", layers=4)
    assert replicate.refusal(spec, TRAIN, model_parallel=False, layout=None,
                             checkpoint_policy=None) == "too few layers to gain"


def test_a_failed_check_falls_back_and_says_why() -> None:
    """Three traces that are not one layer apart in structure: the extrapolation refuses."""
    spec = tiny_spec("llama-3.1-8b", layers=3)
    traces = []
    for n, w in ((2, TRAIN), (3, TRAIN.replace(checkpointing="full")), (4, TRAIN)):
        paths: set[str] = set()
        from vramplan.trace.run import _trace_catalog

        r = _trace_catalog(replicate.reduced_spec(spec, n), w, None, 2, TraceOptions(replicate_layers=False),
                           None, paths)
        traces.append(replicate.Traced(result=r, paths=frozenset(paths), layers=n))
    assert isinstance(replicate.extrapolate(traces, 9), str)


def test_notes_extrapolate_affine_integers() -> None:
    assert _note(("a 1,000 b 7", "a 1,500 b 7", "a 2,000 b 7"), 10) == "a 6,000 b 7"
    assert _note(("x 2 layers", "x 3 layers", "x 4 layers"), 30) == "x 32 layers"
    assert _note(("x 2", "x 3", "x 5"), 3) is None  # not affine
    assert _note(("x 1.5", "x 2.5", "x 3.5"), 3) is None  # decimals are not extrapolated
    assert _note(("same", "same", "same"), 5) == "same"


def _inserted(data: st.DataObject, block_tokens: st.SearchStrategy[int]
              ) -> tuple[list[int], list[int], list[int]]:
    """A base sequence, it with blocks inserted once, and twice at the same points."""
    a = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=40))
    points = sorted(set(data.draw(st.lists(st.integers(0, len(a)), min_size=1, max_size=4))))
    blocks = [data.draw(st.lists(block_tokens, min_size=1, max_size=6)) for _ in points]

    def build(copies: int) -> list[int]:
        out, prev = [], 0
        for x, blk in zip(points, blocks, strict=True):
            out += a[prev:x] + blk * copies
            prev = x
        return out + a[prev:]

    return a, build(1), build(2)


def _rebuilds(a: list[int], b: list[int], c: list[int]) -> bool | None:
    none = np.full(len(b), -1, np.int64)
    pts = align(a, b, c, none[:len(a)], none)
    if pts is None:
        return None
    rebuilt_b, rebuilt_c, prev = [], [], 0
    for x, s, ln in pts:
        rebuilt_b += a[prev:x] + b[s:s + ln]
        rebuilt_c += a[prev:x] + b[s:s + ln] * 2
        prev = x
    return rebuilt_b + a[prev:] == b and rebuilt_c + a[prev:] == c


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_align_is_sound(data: st.DataObject) -> None:
    """Whatever blocks the alignment finds rebuild both longer sequences exactly. (With blocks
    made of the base's own tokens the greedy split can miss one that exists: the extrapolation
    then refuses and every layer is traced.)"""
    assert _rebuilds(*_inserted(data, st.integers(0, 3))) in (True, None)


def test_align_checks_the_twice_inserted_log_everywhere() -> None:
    """Found by hypothesis: a = 0 0 1 0 with [0] inserted at 0 and [1] at 1. The greedy walk
    matches all of a in b and takes b's tail [1, 0] as one block at the end, which c's tail
    repeats; c's head (0 0 0 1) is not a's: that alignment rebuilds b, not c, and is refused."""
    assert _rebuilds([0, 0, 1, 0], [0, 0, 1, 0, 1, 0], [0, 0, 0, 1, 1, 0, 1, 0]) is None


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_align_finds_blocks_of_new_tokens(data: st.DataObject) -> None:
    assert _rebuilds(*_inserted(data, st.integers(10, 13))) is True


# --------------------------------------------------------------------------- experts (trace.experts)
EXPERTS_NOTE = "identical experts traced once"


def _moe(name: str, layers: int, experts: int, top_k: int | None = None, **extra: object):  # type: ignore[no-untyped-def]
    """A tiny catalog MoE model with ``experts`` routed experts (``top_k`` per token)."""
    import dataclasses

    from vramplan.models.normalize import spec_from_config

    spec = tiny_spec(name, layers=layers)
    cfg = dict(spec.config)
    for k in ("num_local_experts", "num_experts", "n_routed_experts"):
        if cfg.get(k) is not None:
            cfg[k] = experts
    if top_k is not None:
        cfg["num_experts_per_tok"] = top_k
    cfg.update(extra)
    got = spec_from_config(cfg, name=spec.name, source=spec.source)
    assert got.n_experts == experts
    return dataclasses.replace(got, layers=layers)


@pytest.fixture
def cut_from_6(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cut loops of tiny expert counts (the default threshold is a cost choice, not a rule)."""
    monkeypatch.setattr(replicate, "CUT_FROM", 6)


EXPERT_CASES = {
    "deepseek-v3: dense prefix, shared experts, MLA, 16 experts top-2, full checkpointing":
        ("deepseek-v3", 2, 16, 2, TRAIN.replace(checkpointing="full")),
    "deepseek-v3: 12 experts top-3, no checkpointing": ("deepseek-v3", 2, 12, 3, TRAIN),
    "deepseek-v3: tokens x top-k not a multiple of the experts (seq 50, 7 experts top-3)":
        ("deepseek-v3", 2, 7, 3, TRAIN.replace(seq=50, checkpointing="full")),
    "deepseek-v3: routing skew 2": ("deepseek-v3", 2, 10, 2, TRAIN.replace(routing_skew=2.0)),
    "mixtral: 9 experts top-2, full checkpointing": ("mixtral-8x7b", 2, 9, 2, TRAIN.replace(checkpointing="full")),
    "qwen3-moe: 10 experts top-4, LoRA in fp32 (bf16 bases run grouped_mm)":
        ("qwen3-30b-a3b", 2, 10, 4, TRAIN.replace(peft="lora", precision="fp32")),
    "gpt-oss: expert biases, 8 experts top-4 (layers differ: only experts cut)":
        ("gpt-oss-20b", 2, 8, 4, TRAIN.replace(checkpointing="full")),
    "deepseek-v3: SGD for-loop fp32": ("deepseek-v3", 2, 8, 2, TRAIN.replace(precision="fp32", optimizer="sgd",
                                                                            optimizer_impl="for-loop")),
    "deepseek-v3: generate (prefill and extrapolated decode steps)":
        ("deepseek-v3", 2, 10, 2, Workload(task="generate", batch=2, seq=32, new_tokens=12, precision="fp32")),
    "qwen3-moe: infer": ("qwen3-30b-a3b", 2, 8, 2, Workload(task="infer", batch=2, seq=32, precision="fp32")),
}


@pytest.mark.parametrize("case", list(EXPERT_CASES))
def test_cut_expert_loops_write_the_full_trace(case: str, cut_from_6: None) -> None:
    """Every loop run for 2, 3 and 4 experts; the written log is the full trace's, column for column."""
    name, layers, experts, top_k, w = EXPERT_CASES[case]
    spec = _moe(name, layers, experts, top_k)
    fast = trace_workload(spec, w)
    full = trace_workload(spec, w, options=TraceOptions(replicate_layers=False))
    assert fast.notes[-1].startswith(EXPERTS_NOTE) and f"of its {experts} experts" in fast.notes[-1], fast.notes
    assert not any(EXPERTS_NOTE in n for n in full.notes)
    _assert_same(fast, full)


def test_experts_and_layers_replicated_together(cut_from_6: None) -> None:
    """DeepSeek-V3's shape: a dense prefix, then MoE layers traced 2, 3, 4 times, each with its
    loops cut to 2, 3, 4 experts: nine small traces give the full trace of every layer and expert."""
    spec = _moe("deepseek-v3", 6, 12, 2)
    w = TRAIN.replace(checkpointing="full")
    fast = trace_workload(spec, w)
    full = trace_workload(spec, w, options=TraceOptions(replicate_layers=False))
    assert fast.notes[-1].startswith(REPLICATED) and fast.notes[-2].startswith(EXPERTS_NOTE), fast.notes[-2:]
    assert _same_log(fast.events, full.events)
    assert fast.peak_allocated == full.peak_allocated and fast.phases == full.phases
    assert fast.top_modules == full.top_modules and fast.top_tensors == full.top_tensors
    assert (fast.flops, fast.params, fast.trainable_params) == (full.flops, full.params, full.trainable_params)
    assert fast.notes[:-2] == full.notes


def test_a_failed_expert_check_traces_every_expert(cut_from_6: None, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _moe("deepseek-v3", 2, 8, 2)
    monkeypatch.setattr(replicate, "extrapolate_experts", lambda results, runs: "the check failed")
    fast = trace_workload(spec, TRAIN)
    full = trace_workload(spec, TRAIN, options=TraceOptions(replicate_layers=False))
    assert fast.notes[-1] == "identical experts not replicated (the check failed): every expert traced"
    _assert_same(fast, full)


@pytest.mark.parametrize("w, experts, why", [
    (TRAIN, 5, "fewer than 6 experts per layer"),
    (TRAIN.replace(parallel=Parallel(dp=2, zero=3)), 8, "parallel layouts are traced in full"),
    (TRAIN.replace(compile=True), 8, "activation offload / compile"),
])
def test_expert_cut_refused(w: Workload, experts: int, why: str, cut_from_6: None) -> None:
    from vramplan.trace.layout import layout_of

    spec = _moe("deepseek-v3", 2, experts, 2)
    assert replicate.experts_refusal(spec, w, model_parallel=False, layout=layout_of(w)) == why


def test_the_default_threshold_leaves_mixtral_whole() -> None:
    """Mixtral's 8 experts trace faster whole than in three cut traces."""
    spec = tiny_spec("mixtral-8x7b", layers=2)
    assert replicate.experts_refusal(spec, TRAIN, model_parallel=False, layout=None) is not None
    assert replicate.experts_refusal(_moe("deepseek-v3", 2, 256, 8), TRAIN, model_parallel=False,
                                     layout=None) is None


def test_grouped_mm_experts_have_no_loop_to_cut(cut_from_6: None) -> None:
    """bf16 weights on sm80+ run transformers' grouped_mm: no loop is cut, the first trace is the answer."""
    spec = _moe("deepseek-v3", 2, 8, 2)
    w = TRAIN.replace(precision="bf16")
    fast = trace_workload(spec, w)
    assert any("grouped_mm" in n for n in fast.notes), fast.notes
    assert not any(EXPERTS_NOTE in n for n in fast.notes)
    assert _same_log(fast.events, trace_workload(spec, w, options=TraceOptions(replicate_layers=False)).events)


def test_expert_loops_cut_rows_and_refuse_answers_that_differ_by_expert() -> None:
    import torch

    from vramplan.trace.experts import ExpertLoops
    from vramplan.trace.values import Values

    values = Values()
    hit = torch.empty((9, 1), dtype=torch.int64, device="meta")
    values.set_shadow(hit, torch.arange(9).reshape(9, 1))  # experts 0..7, then the "no expert" class 8
    loops = ExpertLoops(3)
    loops.experts[7] = 8
    unbind = torch.Tensor.unbind
    rows = loops.unbind(unbind, (hit, 0), {}, 7, values)
    assert rows is not None and len(rows) == 4  # experts 0, 1, 2 and the skipped class
    assert loops.runs == {8} and loops.loops == 1 and loops.in_loop and loops.unsafe is None
    assert loops.unbind(unbind, (hit, 0), {}, 6, values) is None  # not an experts module
    assert loops.unbind(unbind, (hit, 1), {}, 7, values) is None  # not the loop's dimension
    assert ExpertLoops(8).unbind(unbind, (hit, 0), {}, 7, values) is None  # nothing to cut
    loops.rule("nonzero", exact=False)
    assert loops.unsafe is None  # answered by the mask's density: every expert alike
    loops.rule("bincount", exact=False)
    assert loops.unsafe is not None and "bincount" in loops.unsafe
    exact = ExpertLoops(3)
    exact.rule("nonzero", exact=True)
    assert exact.unsafe is not None and "known values" in exact.unsafe
    unsorted = Values()
    unsorted.set_shadow(hit, torch.tensor([3, 1, 2, 0, 4, 5, 6, 7, 8]).reshape(9, 1))
    cut = ExpertLoops(3)
    cut.experts[7] = 8
    assert cut.unbind(unbind, (hit, 0), {}, 7, unsorted) is None and cut.unsafe is not None
