"""Real-run agreement for pipeline schedules: torch.distributed.pipelining runs for real on the
CPU with the gloo backend (2 processes, a tiny Llama, fp32, eager attention) and the trace of
the same layout agree within 0.1 % on each rank's storage peak, for every schedule."""

from __future__ import annotations

import pytest
import torch

from vramplan.trace.testing import pipeline_agreement
from vramplan.workload import PP_SCHEDULES

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


@pytest.mark.parametrize("schedules", [("1F1B", "Interleaved1F1B", "ZBVZeroBubble"),
                                       pytest.param(("GPipe", "LoopedBFS", "InterleavedZeroBubble"),
                                                    marks=pytest.mark.slow)])
def test_gloo_pipeline_run_agrees_with_trace(schedules) -> None:
    assert set(schedules) <= set(PP_SCHEDULES)
    rows = pipeline_agreement(schedules)
    assert {(s, r) for s, r, _, _ in rows} == {(s, r) for s in schedules for r in (0, 1)}
    for schedule, rank, real, traced in rows:
        # sends and receives hold their tensors while the schedule keeps the work (trace.pipeline_parallel)
        assert abs(traced - real) / real < 0.001, (schedule, rank, traced, real)


def test_uneven_stages_agree_with_a_real_run() -> None:
    """Layers that do not divide by the stages (issue 34): torchtitan's split of 7 layers over 3
    stages (the embeddings and the head each count as a layer: 3, 3, 3 → 2, 3, 2 decoder layers),
    every rank traced, each within 0.1 % of the real gloo run of the same cut."""
    from vramplan.workload import Parallel

    assert Parallel(pp=3).stage_bounds(7) == ((0, 2), (2, 5), (5, 7))
    rows = pipeline_agreement(("1F1B",), pp=3, layers=7, microbatches=3)
    assert {r for _, r, _, _ in rows} == {0, 1, 2}
    for schedule, rank, real, traced in rows:
        assert abs(traced - real) / real < 0.001, (schedule, rank, traced, real)
