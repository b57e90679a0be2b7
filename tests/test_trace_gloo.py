"""Real-run agreement: FSDP2 and DDP run for real on the CPU with the gloo backend (2
processes) and the trace of the same layout agree within 1 % on each rank's storage peak."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vramplan.trace.run import TraceOptions, trace_model
from vramplan.trace.testing import real_dist_peaks
from vramplan.workload import Workload

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

D, ROWS = 128, 128


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 4 * D)
        self.down = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for blk in self.layers:
            h = blk(h)
        return self.out(h)


def make_model() -> nn.Module:
    return Net()


def make_inputs() -> torch.Tensor:
    return torch.randn(8, ROWS, D)


NO_WS = TraceOptions(workspaces=False, count_flops=False)


@pytest.mark.parametrize(("layout", "parallel"), [("fsdp2", {"dp": 2, "zero": 3}), ("ddp", {"dp": 2})])
def test_gloo_run_agrees_with_trace(layout: str, parallel: dict[str, int]) -> None:
    real = real_dist_peaks(make_model, make_inputs, world=2, layout=layout, iterations=2, bucket_cap_mb=0.25)
    w = Workload(task="train", precision="fp32").replace(**parallel)
    for rank, peak in enumerate(real):
        opts = TraceOptions(workspaces=False, count_flops=False, rank=rank)
        traced = trace_model(make_model, make_inputs(), workload=w, options=opts).peak_allocated
        assert abs(traced - peak) / peak < 0.01, (layout, rank, traced, peak)
