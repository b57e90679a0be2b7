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


@pytest.mark.parametrize("strategy, zero, world, shard, mixed, width, prefetch, lora", [
    ("FULL_SHARD", 3, 2, 0, False, 128, "backward-pre", ()),
    ("FULL_SHARD", 3, 2, 0, False, 128, "none", ("up", "down")),  # peft's LoRA, peft's wrap policy
    ("SHARD_GRAD_OP", 2, 2, 0, False, 128, "backward-post", ()),
    ("NO_SHARD", 0, 2, 0, False, 128, "none", ()),
    ("FULL_SHARD", 3, 2, 0, True, 100, "backward-pre", ()),  # bf16 MixedPrecision + autocast; padded flat params
    ("HYBRID_SHARD", 3, 4, 2, False, 128, "none", ()),  # 2 replicas × shard groups of 2
])
def test_fsdp1_gloo_run_agrees_with_trace(strategy, zero, world, shard, mixed, width, prefetch, lora) -> None:  # noqa: ANN001
    """FSDP1 (``FullyShardedDataParallel``: flat parameters per unit, ``use_orig_params``) run for
    real on ``world`` gloo processes and traced as ``engine=fsdp1`` on the fake process group:
    each rank's storage peak within 0.01 % (issue 34's bar; what is left, tens of bytes, is not
    itemised)."""
    from functools import partial

    from vramplan.trace.run import TraceOptions, trace_model
    from vramplan.trace.testing import block_inputs, block_model, real_dist_peaks
    from vramplan.workload import Precision, Task, Workload

    make, inputs = partial(block_model, width), partial(block_inputs, width)
    torch_prefetch = "" if prefetch == "none" else "-" + prefetch.upper().replace("-", "_")
    real = real_dist_peaks(make, inputs, world=world, layout=f"fsdp1-{strategy}{torch_prefetch}", mixed=mixed,
                           lora=lora)
    peft = {"peft": "lora", "lora_targets": lora} if lora else {}
    w = Workload(task=Task.TRAIN, precision=Precision.BF16_MIXED if mixed else Precision.FP32, **peft).replace(
        dp=world, zero=zero, engine="fsdp1", dp_shard=shard, fsdp1_prefetch=prefetch)
    for rank, peak in enumerate(real):
        r = trace_model(make, inputs(), workload=w, options=TraceOptions(workspaces=False, count_flops=False, rank=rank))
        assert abs(r.peak_allocated - peak) / peak < 1e-4, (rank, r.peak_allocated, peak)
        assert any(f"FSDP1 ({strategy})" in n for n in r.notes)
