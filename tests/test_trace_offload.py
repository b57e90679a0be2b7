"""Activation offloading (torchtune ``OffloadActivations`` emulated): host RAM, what stays on the
GPU, analytic agreement, the report's host figure and the runtime cost.

A real CPU run cannot check it: torchtune's offloading moves CUDA tensors to pinned CPU memory
(``torch.cuda.Stream``, ``pin_memory``), which a CPU-only torch does not have, and torchtune
0.6.1 does not import beside torchao 0.18 (``torchao.dtypes.nf4tensor`` is gone) — so the
checks are hand-computed deltas on models whose saved tensors are known exactly.
"""

from __future__ import annotations

import torch
from torch import nn

from vramplan.analytic import estimate
from vramplan.trace import analysis
from vramplan.trace.offload import HostLedger, pinned_bytes
from vramplan.trace.run import TraceOptions, trace_model, trace_workload
from vramplan.trace.testing import tiny_config
from vramplan.workload import Phase, Workload

NO_WS = TraceOptions(workspaces=False)


class Stack(nn.Module):
    """Linear → ReLU blocks: each block saves its input (for the weight gradient) and the
    ReLU output, both ``tokens × 64`` fp32."""

    def __init__(self, n: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(64, 64, bias=False) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.relu(b(x))
        return x


def _forward_end(r) -> int:
    log = r.events
    fwd = [k for k in range(len(log)) if log.phase[k] == list(Phase).index(Phase.FORWARD) and log.iteration[k] == 2]
    return analysis.breakdown_at(analysis.arrays(log), fwd[-1]).activations


def test_pinned_blocks_are_powers_of_two_cached_per_class() -> None:
    assert [pinned_bytes(n) for n in (1, 1024, 1025, 3000, 65536)] == [1, 1024, 2048, 4096, 65536]
    led = HostLedger()
    for n in (1000, 1000, 3000):
        led.alloc(n)
    led.free(1000)
    led.free(1000)
    led.alloc(900)  # reuses a cached 1024 block
    assert led.reserved == 2 * 1024 + 4096


def test_every_saved_tensor_goes_to_host_and_leaves_the_gpu() -> None:
    n, tokens = 6, 256
    t = tokens * 64 * 4  # 65,536 B each: a power of two
    w = Workload(task="train", precision="fp32", optimizer="sgd")
    base = trace_model(lambda: Stack(n), lambda: torch.randn(tokens, 64), workload=w, options=NO_WS)
    off = trace_model(lambda: Stack(n), lambda: torch.randn(tokens, 64), workload=w.replace(activation_offload=True),
                      options=NO_WS)
    # each block's Linear saves its input and ReLU its output: 2 copies per block; the mm also
    # saves weight.t() (16,384 B; no nn.Parameter, so torchtune offloads it) except in the first
    # block, whose input needs no gradient
    assert off.host_memory == 2 * n * t + (n - 1) * 64 * 64 * 4
    assert base.host_memory == 0
    # at the forward's end: without offload every block's ReLU output (the next block's saved
    # input) plus the last one; with it, the five stashed tensors at most
    assert _forward_end(base) >= n * t
    assert _forward_end(off) <= 5 * t < _forward_end(base)
    assert any("pinned" in note for note in off.notes)


def test_each_save_is_its_own_copy() -> None:
    """torchtune copies per save, not per tensor: an input read by two linears goes twice."""
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x) + self.b(x)

    w = Workload(task="train", precision="fp32", optimizer="sgd", activation_offload=True)
    x = torch.randn(256, 64, requires_grad=False)
    r = trace_model(Two, lambda: x * 1, workload=w, options=NO_WS)
    assert r.host_memory == 2 * 256 * 64 * 4


def _mid_spec():
    from vramplan.models.catalog import resolve
    from vramplan.models.normalize import spec_from_config

    cfg = tiny_config(dict(resolve("llama-3.1-8b").config), 4)
    cfg.update(hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=4, vocab_size=1024)
    cfg.pop("head_dim", None)
    return spec_from_config(cfg, name="mid-llama", source="test")


def test_analytic_host_ram_and_peak_agree_with_the_trace() -> None:
    spec = _mid_spec()
    for precision in ("bf16-mixed", "bf16"):
        w = Workload(task="train", batch=2, seq=512, precision=precision, activation_offload=True)
        r = trace_workload(spec, w, options=NO_WS)
        a = estimate(spec, w, workspace_bytes=0)
        assert abs(a.host_memory - r.host_memory) / r.host_memory < 0.05, (precision, a.host_memory, r.host_memory)
        assert abs(a.peak.allocated - r.peak_allocated) / r.peak_allocated < 0.06, (precision, a.peak.allocated,
                                                                                     r.peak_allocated)
        plain = estimate(spec, w.replace(activation_offload=False), workspace_bytes=0)
        assert plain.host_memory == 0 and plain.peak.allocated > a.peak.allocated


def test_report_carries_host_ram_and_runtime_charges_pcie() -> None:
    import vramplan
    from vramplan.report.estimate import to_doc
    from vramplan.runtime import step_time

    rep = vramplan.estimate("llama-3.1-8b", gpu="a100-80gb", method="analytic", task="train", batch=1, seq=2048,
                            precision="bf16-mixed", peft="lora", activation_offload=True, checkpointing="full")
    assert rep.host_memory > 0 and rep.to_dict()["host_memory"] == rep.host_memory
    assert "host RAM" in str(to_doc(rep).__dict__)
    off = step_time(vramplan.models.catalog.resolve("llama-3.1-8b"), rep.workload, vramplan.hardware.catalog.get_gpu("a100-80gb"))
    on = step_time(vramplan.models.catalog.resolve("llama-3.1-8b"), rep.workload.replace(activation_offload=False),
                   vramplan.hardware.catalog.get_gpu("a100-80gb"))
    assert off.offload_total > 0 and on.offload_total == 0


def test_offload_composes_with_compile_and_checkpointing() -> None:
    """Tensors come back with the strides torchtune's ``empty_like`` + ``.to("cuda")`` give them,
    so compiled graphs that view them run (a contiguous copy of a permuted tensor did not)."""
    from vramplan.trace.testing import tiny_spec

    spec = tiny_spec("llama-3.1-8b", layers=2)
    base = Workload(task="train", batch=1, seq=64, precision="bf16-mixed", activation_offload=True)
    for kw in (dict(compile=True), dict(checkpointing="op"), dict(checkpointing="full", checkpoint_every=2, compile=True)):
        r = trace_workload(spec, base.replace(**kw), options=NO_WS)
        assert r.host_memory > 0
