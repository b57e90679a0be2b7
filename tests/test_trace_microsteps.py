"""Gradient-accumulation micro-steps written from two that repeat (:mod:`vramplan.trace.microsteps`):
the events, peaks and FLOPs equal a trace of every micro-step; micro-steps that differ, and
sharded layouts, are traced one by one."""

from __future__ import annotations

from array import array

import pytest
import torch
from torch import nn

from vramplan.events import Action, EventLog
from vramplan.models.catalog import resolve
from vramplan.trace.microsteps import _relative_ids
from vramplan.trace.run import TraceOptions, trace_model, trace_workload
from vramplan.trace.testing import tiny_spec
from vramplan.workload import Workload

_COLUMNS = ("action", "size", "stream", "category", "phase", "iteration")
_STRINGS = ("module", "op", "desc")


def _rows(log: EventLog) -> list[tuple]:
    """Every event but its id; ids as the order of their allocations (the same storages)."""
    order: dict[int, int] = {}
    rows = []
    for k in range(len(log)):
        eid = log.id[k]
        if log.action[k] == int(Action.ALLOC):
            order[eid] = len(order)
        rows.append((*(getattr(log, c)[k] for c in _COLUMNS), *(log.strings[getattr(log, c)[k]] for c in _STRINGS),
                     order.get(eid, -1) if eid else None))
    return rows


def _both(trace) -> tuple:  # noqa: ANN001
    fast, full = trace(TraceOptions(extrapolate_accum=True)), trace(TraceOptions(extrapolate_accum=False))
    return fast, full


def _written(result) -> bool:  # noqa: ANN001
    return any(n.startswith("gradient accumulation: micro-steps") for n in result.notes)


@pytest.mark.parametrize("knobs", [
    {},
    {"precision": "fp16-mixed", "keep_grads": True},  # the loss scale made once, gradients zeroed in place
    {"peft": "lora", "checkpointing": "full"},
    {"loss": "chunked", "keep_outputs": True},
    {"objective": "grpo", "prompt": 16, "generations": 6},  # each micro-step on its own buffered batch
], ids=["plain", "fp16-keep-grads", "lora-checkpointed", "chunked-loss", "grpo"])
def test_written_micro_steps_equal_traced_ones(knobs: dict) -> None:
    spec = tiny_spec("llama-3.2-1b")
    w = Workload(task="train", batch=2, seq=64, precision="bf16-mixed", grad_accum=6).replace(**knobs)
    fast, full = _both(lambda o: trace_workload(spec, w, options=o))
    assert _written(fast) and not _written(full)
    assert _rows(fast.events) == _rows(full.events)
    assert (fast.peak_allocated, fast.peak_index, fast.flops) == (full.peak_allocated, full.peak_index, full.flops)
    assert fast.phases == full.phases and fast.iterations == full.iterations


def test_a_catalog_model_writes_its_micro_steps_too() -> None:
    """With the layer replication of catalog models (each 2/3/4-layer trace writes its micro-steps)."""
    w = Workload(task="train", batch=1, seq=64, precision="bf16-mixed", grad_accum=5)
    fast, full = _both(lambda o: trace_workload(resolve("gpt2"), w, options=o))
    assert _written(fast)
    assert (fast.peak_allocated, fast.flops, len(fast.events)) == (full.peak_allocated, full.flops, len(full.events))


class _Remembers(nn.Module):
    """A model that keeps every output of a forward (a metric buffer that grows each micro-step)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.kept: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.kept.append(y.detach().clone())
        return y


def test_micro_steps_that_keep_memory_are_each_traced() -> None:
    w = Workload(task="train", batch=1, seq=1, precision="fp32", grad_accum=6)
    fast, full = _both(lambda o: trace_model(_Remembers, torch.zeros(8, 64), workload=w, options=o))
    assert not _written(fast)
    assert _rows(fast.events) == _rows(full.events)


def test_sharded_layouts_trace_every_micro_step() -> None:
    """FSDP2's collectives and hooks are per call: nothing is written under a data-parallel layout."""
    w = Workload(task="train", batch=1, seq=64, precision="bf16-mixed", grad_accum=4).replace(dp=2, zero=3)
    result = trace_workload(tiny_spec("llama-3.2-1b"), w)
    assert not _written(result)


def _log(rows: list[tuple[Action, int]]) -> EventLog:
    log = EventLog()
    for action, eid in rows:
        log.append(action, eid, 512 if action is Action.ALLOC else 0)
    return log


def test_a_span_is_self_contained_or_refused() -> None:
    a, f, m = Action.ALLOC, Action.FREE, Action.MARK
    log = _log([(a, 1), (m, 0), (a, 2), (a, 3), (f, 3), (f, 1), (Action.FREE_DEFERRED, 2)])
    assert _relative_ids(log, 0, len(log)).tolist() == [0, -1, 1, 2, 2, 0, 1]
    assert _relative_ids(log, 2, len(log)) is None  # frees 1, allocated before the span
    assert _relative_ids(log, 0, 4) is None  # leaves 1, 2 and 3 alive
    assert _relative_ids(log, 0, 0) is None
    again = _log([(a, 5), (f, 5), (a, 5), (f, 5)])
    assert _relative_ids(again, 0, 4) is None  # an id allocated twice
    assert isinstance(again.id, array)
