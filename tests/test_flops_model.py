"""The one FLOPs model (vramplan.models.flops): its attention rules against brute-force sums, and
the analytic method and the runtime model agreeing through it on every catalog transformer."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vramplan.analytic.estimate import estimate
from vramplan.errors import WorkloadError
from vramplan.hardware.catalog import get_gpu
from vramplan.models.catalog import list_models, resolve
from vramplan.models.flops import decode_keys, generate_flops, keys_per_query, layout_of, step_flops
from vramplan.models.shape import SEQUENCE_FAMILIES, model_shape
from vramplan.runtime import step_time
from vramplan.workload import Workload

SDPA, EAGER = Workload(), Workload(attention="eager")


@settings(max_examples=200, deadline=None)
@given(seq=st.integers(1, 3000), window=st.one_of(st.none(), st.integers(1, 4000)))
def test_causal_keys_per_query_is_the_mean_over_queries(seq: int, window: int | None) -> None:
    brute = sum(min(i, window) if window else i for i in range(1, seq + 1)) / seq
    assert keys_per_query(seq, True, SDPA, window) == pytest.approx(brute)
    assert keys_per_query(seq, True, EAGER, window) == seq  # eager computes the whole square
    assert keys_per_query(seq, False, SDPA, window) == seq


@settings(max_examples=200, deadline=None)
@given(prompt=st.integers(1, 2000), steps=st.integers(0, 500), window=st.one_of(st.none(), st.integers(1, 3000)))
def test_decode_keys_sum_every_step(prompt: int, steps: int, window: int | None) -> None:
    brute = sum(min(prompt + j, window) if window else prompt + j for j in range(1, steps + 1))
    assert decode_keys(prompt, steps, window) == brute


def test_generation_is_prefill_plus_decode_steps() -> None:
    s = model_shape(resolve("llama-3.1-8b"))
    f = layout_of(s)
    w = Workload(task="generate", batch=2, seq=100, new_tokens=11)
    prefill, decode = generate_flops(f, w)
    one = Workload(task="generate", batch=2, seq=100, new_tokens=1)
    assert generate_flops(f, one) == (prefill, 0.0)  # one new token: the prefill's last logits
    # ten decode forwards of one token each (the 11th token is not fed back), each with its logits
    matmul = 2 * 2 * 10 * (f.matmul + f.head)
    assert decode == pytest.approx(matmul + sum(g.layers * 2 * decode_keys(100, 10, g.window) * g.core
                                                for g in f.attention))
    assert step_flops(f, w) == pytest.approx(prefill + decode)


WORKLOADS = [
    {"task": "train", "batch": 2, "seq": 1024},
    {"task": "train", "batch": 1, "seq": 1024, "peft": "lora"},
    {"task": "train", "batch": 1, "seq": 1024, "checkpointing": "full", "grad_accum": 2, "tp": 2},
    {"task": "train", "batch": 1, "seq": 8192, "attention": "eager"},
    {"task": "infer", "batch": 2, "seq": 512},
    {"task": "generate", "batch": 2, "seq": 512, "new_tokens": 64},
]


@pytest.mark.parametrize("fields", WORKLOADS, ids=lambda f: "-".join(str(v) for v in f.values()))
def test_analytic_and_runtime_count_the_same_flops(fields: dict[str, object]) -> None:
    """One formula, two sources of weight counts (the analytic method's linears, the published
    active parameters): within 2 % on every catalog transformer the analytic method takes."""
    gpu, checked = get_gpu("h100-sxm"), 0
    for entry in list_models():
        spec = resolve(entry.name)
        if spec.family not in SEQUENCE_FAMILIES:
            continue
        try:
            w = Workload().replace(**fields)
            analytic = estimate(spec, w).flops_per_step
        except WorkloadError:  # a workload this model refuses (generation on an encoder, seq > positions)
            continue
        runtime = step_time(spec, w, gpu).flops
        assert runtime == pytest.approx(analytic, rel=0.02), spec.name
        checked += 1
    assert checked >= 20
