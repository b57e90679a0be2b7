"""fit, plan and the verdict's largest batch answer what they answered before the speed work
of issue 13 (the process caches, confirmations without the replay within capacity).

The expected figures were recorded on commit 3ab52b8 (before that work) with the same calls,
on tiny models and a 1 GiB GPU so that the boundaries fall at small batches. A boundary on a
traced curve can depend on which points the search visits (device_used is not always monotone
in batch: the allocator's segments jump), so these pin the visited points' figures too.
"""

from __future__ import annotations

import pytest

from vramplan.engine import estimate
from vramplan.hardware.gpu import GPU
from vramplan.planner.fit import fit
from vramplan.planner.plan import plan
from vramplan.trace.testing import tiny_spec
from vramplan.workload import Workload

G = GPU(key="test-1g", name="test 1 GiB", vendor="nvidia", arch="ada", compute_capability="8.9",
        capacity=1 << 30, bandwidth=1e12, bf16_tflops=100.0, fp16_tflops=100.0, fp32_tflops=20.0)
LLAMA = tiny_spec("llama-3.1-8b")


def _report(r):  # type: ignore[no-untyped-def]
    return [r.peak.allocated, r.peak.reserved, r.peak.device_used, r.verdict.max_batch, r.allocator.ooms,
            r.allocator.alloc_retries]


def test_generate_verdict_largest_batch() -> None:
    r = estimate(LLAMA, task="generate", seq=64, new_tokens=8, gpu=G)
    assert _report(r) == [8840192, 23068672, 592739041, 3711, 0, 0]


def test_generate_above_capacity_keeps_its_retries_and_ooms() -> None:
    """The estimate's own report still replays within the GPU's capacity, up to the first
    allocation that fails (PyTorch raises there: 1 OOM, after 2 retries; the replay that went on
    past it counted 26 and 27); only the search's confirmations skip that replay."""
    r = estimate(LLAMA, task="generate", seq=64, new_tokens=8, batch=6000, gpu=G)
    assert _report(r) == [603537920, 796917760, 1366588129, 3711, 1, 2]
    assert any("would raise CUDA out of memory at event 127 of 3,643 (prefill, asking for 98,304,000 B)" in n
               for n in r.notes)


def test_train_verdict_sliding_window_model() -> None:
    r = estimate(tiny_spec("mistral-7b"), task="train", seq=256, gpu=G)
    assert _report(r) == [21446656, 27262976, 596933345, 128, 0, 0]


def test_plan_finalists() -> None:
    r = plan(LLAMA, Workload(task="train", seq=256), gpu=G)
    assert [[p.label, p.memory, str(p.method), p.confirmed] for p in r.plans] == [
        ["bf16 + adamw-8bit, batch 1", 594836193, "trace", True],
        ["bf16-mixed + adamw-8bit, batch 1", 594836193, "trace", True],
    ]


@pytest.mark.slow
def test_fit_lora_boundaries() -> None:
    r = fit(tiny_spec("qwen2.5-0.5b"), Workload(task="train", peft="lora", seq=256), gpu=G)

    def point(x):  # type: ignore[no-untyped-def]
        return None if x is None else [x.workload.batch, x.workload.seq, x.peak.device_used, str(x.method)]

    assert r.seq is not None
    got = [r.max_batch, r.max_seq, point(r.batch.at), point(r.batch.above), point(r.seq.at), point(r.seq.above),
           [r.evaluations.total, r.evaluations.traces]]
    assert got == [192, 512, [192, 256, 1037335265, "trace"], [193, 256, 1068792545, "trace"],
                   [1, 512, 596933345, "trace"], None, [31, 9]]
