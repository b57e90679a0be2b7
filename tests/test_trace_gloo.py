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


@pytest.mark.parametrize("strategy, zero, world, shard, mixed, width", [
    ("FULL_SHARD", 3, 2, 0, False, 128),
    ("SHARD_GRAD_OP", 2, 2, 0, False, 128),
    ("NO_SHARD", 0, 2, 0, False, 128),
    ("FULL_SHARD", 3, 2, 0, True, 100),  # bf16 MixedPrecision + autocast; flat parameters padded (odd sizes)
    ("HYBRID_SHARD", 3, 4, 2, False, 128),  # 2 replicas × shard groups of 2
])
def test_fsdp1_gloo_run_agrees_with_trace(strategy, zero, world, shard, mixed, width) -> None:  # noqa: ANN001
    """FSDP1 (``FullyShardedDataParallel``: flat parameters per unit, ``use_orig_params``) run for
    real on ``world`` gloo processes and traced as ``engine=fsdp1`` on the fake process group:
    each rank's storage peak within 0.01 % (issue 34's bar; what is left is the real run's
    host-side optimizer step counters and the like, tens of bytes)."""
    from functools import partial

    from vramplan.trace.run import TraceOptions, trace_model
    from vramplan.trace.testing import block_inputs, block_model, real_dist_peaks
    from vramplan.workload import Precision, Task, Workload

    make, inputs = partial(block_model, width), partial(block_inputs, width)
    real = real_dist_peaks(make, inputs, world=world, layout=f"fsdp1-{strategy}", mixed=mixed)
    w = Workload(task=Task.TRAIN, precision=Precision.BF16_MIXED if mixed else Precision.FP32).replace(
        dp=world, zero=zero, engine="fsdp1", dp_shard=shard)
    for rank, peak in enumerate(real):
        r = trace_model(make, inputs(), workload=w, options=TraceOptions(workspaces=False, count_flops=False, rank=rank))
        assert abs(r.peak_allocated - peak) / peak < 1e-4, (rank, r.peak_allocated, peak)
        assert any(f"FSDP1 ({strategy})" in n for n in r.notes)
