"""Core of the trace: the event log, categories, frees, and the figures read from it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from vramplan.errors import WorkloadError
from vramplan.events import Action, Category
from vramplan.results import BREAKDOWN_KEYS
from vramplan.trace import analysis
from vramplan.trace.run import TraceOptions, trace_model, trace_workload
from vramplan.trace.testing import tiny_spec
from vramplan.workload import Phase, Workload

NO_WS = TraceOptions(workspaces=False)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _param_bytes(m: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in m.parameters())


def _live_by_category(r, k: int) -> dict[str, int]:
    a = analysis.arrays(r.events)
    out: dict[str, int] = {}
    for i in analysis.live_at(a, k):
        label = Category(int(a.cat[i])).label
        out[label] = out.get(label, 0) + int(a.delta[i])
    return out


def _last_index_of_phase(r, phase: Phase, iteration: int = 1) -> int:
    log = r.events
    idx = [k for k in range(len(log)) if log.phase[k] == list(Phase).index(phase) and log.iteration[k] == iteration]
    return idx[-1]


@pytest.fixture(scope="module")
def mlp_trace():
    w = Workload(task="train", precision="fp32", optimizer="sgd", batch=4)
    return trace_model(MLP(), torch.randn(4, 32), workload=w, options=NO_WS)


def test_mlp_weights_inputs_and_saved_activations_are_exact(mlp_trace) -> None:
    r = mlp_trace
    params = _param_bytes(MLP())
    assert r.params == sum(p.numel() for p in MLP().parameters())
    end_fwd = _last_index_of_phase(r, Phase.FORWARD)
    live = _live_by_category(r, end_fwd)
    assert live["parameter"] == params
    assert live["input"] == 4 * 32 * 4
    # ReLU's output (saved by ReLU and by fc2) and the scalar loss outlive the forward;
    # fc1's pre-activation and fc2's output die inside it.
    assert live["activation"] == 4 * 64 * 4 + 4
    assert "temporary" not in live


def test_mlp_gradients_live_until_zero_grad(mlp_trace) -> None:
    r = mlp_trace
    params = _param_bytes(MLP())
    end_bwd = _last_index_of_phase(r, Phase.BACKWARD)
    live = _live_by_category(r, end_bwd)
    assert live["gradient"] == params
    assert "activation" not in live  # every saved tensor was released by backward
    end = _last_index_of_phase(r, Phase.OPTIMIZER)
    assert "gradient" not in _live_by_category(r, end)  # zero_grad(set_to_none=True)
    assert r.peak_phase is Phase.BACKWARD


def test_event_log_invariants() -> None:
    spec = tiny_spec("llama-3.1-8b")
    w = Workload(task="train", batch=2, seq=64, checkpointing="full", precision="bf16-mixed")
    r = trace_workload(spec, w)
    log = r.events
    a = analysis.arrays(log)
    assert (a.total >= 0).all()
    # every ALLOC id is unique; each FREE matches an earlier ALLOC, once
    alloc_ids = [log.id[k] for k in range(len(log)) if log.action[k] == Action.ALLOC]
    assert len(alloc_ids) == len(set(alloc_ids))
    seen: set[int] = set()
    freed: set[int] = set()
    for k in range(len(log)):
        if log.action[k] == Action.ALLOC:
            seen.add(log.id[k])
        elif log.action[k] == Action.FREE:
            assert log.id[k] in seen and log.id[k] not in freed
            freed.add(log.id[k])
            assert log.category[k] != Category.OTHER
    # the breakdown at the peak sums to the peak; no instant exceeds it
    assert r.breakdown_at_peak.total == r.peak_allocated == int(a.total.max())
    for p in r.phases:
        assert p.breakdown.total == p.allocated <= r.peak_allocated
    assert [i.iteration for i in r.iterations] == [1, 2]
    assert max(i.allocated for i in r.iterations) == r.peak_allocated
    # the timeline is decimated, keeps the peak, and its series sum to the running total
    tl = r.timeline
    assert len(tl.index) <= 5000 and r.peak_index in tl.index
    total = np.sum([np.array(tl.series[k]) for k in BREAKDOWN_KEYS], axis=0)
    assert (total == a.total[list(tl.index)]).all()
    assert {p for _, _, p in tl.phases} >= {"setup", "forward", "backward", "recompute", "optimizer"}


def test_views_and_inplace_ops_allocate_nothing() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(16, 16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x @ self.w
            y.mul_(2.0)
            z = y.view(4, 64).t().reshape(64, 4)  # views (reshape of a transpose copies)
            return z.sum()

    r = trace_model(M(), torch.randn(16, 16), workload=Workload(task="infer", precision="fp32"), options=NO_WS)
    log = r.events
    ops = [log.strings[log.op[k]] for k in range(len(log)) if log.action[k] == Action.ALLOC and log.phase[k] == 1]
    assert not any("mul_" in o or "view" in o or o.endswith(".t.default") for o in ops)
    assert any("mm" in o or "matmul" in o for o in ops)


def test_user_model_is_not_touched() -> None:
    model = MLP()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trace_model(model, torch.randn(4, 32), workload=Workload(task="train", precision="bf16", optimizer="adamw"),
                options=NO_WS)
    for n, p in model.named_parameters():
        assert p.device.type == "cpu" and p.dtype == torch.float32 and p.grad is None
        assert torch.equal(p, before[n])


def test_meta_kernel_cache_gives_identical_events() -> None:
    spec = tiny_spec("llama-3.1-8b", layers=4)
    w = Workload(task="train", batch=2, seq=32, checkpointing="full")
    fast = trace_workload(spec, w, options=TraceOptions(meta_cache=True))
    slow = trace_workload(spec, w, options=TraceOptions(meta_cache=False))
    for col in ("action", "size", "category", "phase", "iteration"):
        assert getattr(fast.events, col) == getattr(slow.events, col), col
    assert fast.peak_allocated == slow.peak_allocated and fast.flops == slow.flops


def test_top_tensors_and_modules_describe_the_peak() -> None:
    spec = tiny_spec("llama-3.1-8b")
    r = trace_workload(spec, Workload(task="train", batch=2, seq=128, precision="bf16"), options=NO_WS)
    sizes = [t.nbytes for t in r.top_tensors]
    assert sizes == sorted(sizes, reverse=True) and sum(sizes) <= r.peak_allocated
    assert all(t.category in {c.label for c in Category} for t in r.top_tensors)
    assert r.top_modules[0].peak == r.peak_allocated  # the root module ran at the peak
    assert all(m.peak <= r.peak_allocated for m in r.top_modules)
    assert any(m.module.startswith("model.layers.") for m in r.top_modules)


def test_flops_match_flop_counter_formula_for_a_linear() -> None:
    model = nn.Linear(64, 32, bias=False)
    r = trace_model(model, torch.randn(8, 64), workload=Workload(task="train", precision="fp32", optimizer="sgd"),
                    options=NO_WS, iterations=1)
    # forward 2·8·64·32, backward: grad weight only (input needs no grad)
    assert r.flops == 2 * 8 * 64 * 32 * 2


def test_iterations_must_be_positive() -> None:
    with pytest.raises(WorkloadError):
        trace_model(MLP(), torch.randn(4, 32), workload=Workload(task="infer"), iterations=0)
