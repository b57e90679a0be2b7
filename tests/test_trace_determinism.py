"""The same trace gives the same event log, byte for byte: within one process (caches,
lazy initialisation, module hooks), whatever the garbage collector did before, and for
data-dependent routing (MoE)."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from torch import nn

from vramplan.trace.run import trace_model, trace_workload
from vramplan.trace.testing import tiny_spec
from vramplan.workload import Workload


def _log(r: Any) -> list[tuple[Any, ...]]:
    log = r.events
    s = log.strings
    return [(log.action[i], log.id[i], log.size[i], log.stream[i], log.category[i], log.phase[i], log.iteration[i],
             s[log.module[i]], s[log.op[i]], s[log.desc[i]]) for i in range(len(log))]


CASES = {
    "dense-train": ("llama-3.1-8b", {"task": "train"}),
    "moe-train": ("mixtral-8x7b", {"task": "train"}),
    "moe-infer": ("qwen3-30b-a3b", {"task": "infer"}),
    "generate": ("llama-3.1-8b", {"task": "generate", "new_tokens": 4}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_traces_in_one_process_give_identical_event_logs(case: str) -> None:
    name, kw = CASES[case]
    spec = tiny_spec(name)
    w = Workload(batch=2, seq=32, **kw)
    first = _log(trace_workload(spec, w))
    second = _log(trace_workload(spec, w))
    assert len(first) > 100
    assert first == second


class _Cycle:
    def __init__(self, t: torch.Tensor) -> None:
        self.me = self
        self.t = t


class CycleKeeper(nn.Module):
    """Keeps each layer's activation in a reference cycle: it dies when the garbage
    collector runs, not when the last reference goes."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.layers:
            x = torch.relu(lin(x))
            _Cycle(x * 2)
        return x


@pytest.mark.parametrize("threshold", [1, 700, 100_000])
def test_garbage_collector_timing_does_not_change_the_log(threshold: int) -> None:
    w = Workload(task="train", precision="fp32")
    reference = _log(trace_model(CycleKeeper, torch.randn(8, 64), workload=w))
    old = gc.get_threshold()
    gc.set_threshold(threshold)
    try:
        again = _log(trace_model(CycleKeeper, torch.randn(8, 64), workload=w))
    finally:
        gc.set_threshold(*old)
    assert again == reference


def test_hand_written_moe_is_deterministic() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_trace_zoo import TopKMoE

    w = Workload(task="train", precision="fp32")
    logs = [_log(trace_model(TopKMoE, torch.randn(4, 32, 64), workload=w)) for _ in range(2)]
    assert logs[0] == logs[1]
