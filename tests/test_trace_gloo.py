"""Real-run agreement: FSDP2 and DDP run for real on the CPU with the gloo backend (2
processes) and the trace of the same layout agree within 1 % on each rank's storage peak."""

from __future__ import annotations

import pytest
import torch

from vramplan.trace.testing import dist_agreement

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


def test_gloo_run_agrees_with_trace() -> None:
    rows = dist_agreement(world=2)
    assert {(layout, rank) for layout, rank, _, _ in rows} == {("fsdp2", 0), ("fsdp2", 1), ("ddp", 0), ("ddp", 1)}
    for layout, rank, real, traced in rows:
        assert abs(traced - real) / real < 0.01, (layout, rank, traced, real)
