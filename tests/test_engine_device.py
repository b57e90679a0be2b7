"""One device profile per estimate: the analytic path and the trace read the same workspace,
capability and precision facts (issue 9), for each GPU generation."""

import pytest
import torch

from vramplan.engine import estimate
from vramplan.engine.device import kernel_workload
from vramplan.engine.methods import analytic_core
from vramplan.hardware.catalog import get_gpu
from vramplan.hardware.target import device_profile
from vramplan.target import CUBLAS_WORKSPACE_HOPPER, CUBLAS_WORKSPACE_PRE_HOPPER
from vramplan.trace.sdpa import choose_backend
from vramplan.trace.testing import tiny_spec
from vramplan.workload import Attention, Phase, Workload

# GPU generation: (catalog GPU, cuBLAS/hipBLAS workspace, native bf16)
GENERATIONS = {
    "volta": ("v100-sxm2-16gb", CUBLAS_WORKSPACE_PRE_HOPPER, False),
    "turing": ("t4", CUBLAS_WORKSPACE_PRE_HOPPER, False),
    "ampere": ("a100-sxm4-80gb", CUBLAS_WORKSPACE_PRE_HOPPER, True),
    "ada": ("l4", CUBLAS_WORKSPACE_PRE_HOPPER, True),
    "hopper": ("h100-sxm", CUBLAS_WORKSPACE_HOPPER, True),
    "blackwell": ("b200", CUBLAS_WORKSPACE_HOPPER, True),
    "blackwell-consumer": ("rtx-5090", CUBLAS_WORKSPACE_HOPPER, True),
    "cdna3": ("mi300x", 128 << 20, True),
}
W = Workload(task="train", batch=2, seq=64, precision="bf16-mixed", optimizer="adamw")


def _workspaces(report) -> list[int]:
    return [r["size"] for r in report.events.rows() if r["action"] == "alloc" and r.get("op") == "cublas.workspace"]


def _optimizer_temporaries(report) -> int:
    (p,) = [p for p in report.phases if p.phase is Phase.OPTIMIZER]
    return p.breakdown.temporaries


@pytest.mark.parametrize("gen", GENERATIONS)
def test_analytic_and_trace_take_the_same_workspace(gen):
    key, ws, _ = GENERATIONS[gen]
    dev = device_profile(get_gpu(key))
    assert dev.cublas_workspace == ws
    spec = tiny_spec("llama-3.1-8b")
    traced = estimate(spec, W, gpu=key, method="trace", search_max_batch=False)
    assert _workspaces(traced) == [ws, ws]  # forward thread and autograd's backward thread
    # the analytic formulas count the same two workspaces at the optimizer step
    with_ws = analytic_core(spec, W, dev)
    without = analytic_core(spec, W, dev.without_workspaces())
    delta = _optimizer_temporaries(with_ws) - _optimizer_temporaries(without)
    assert delta == 2 * ws == sum(_workspaces(traced))


@pytest.mark.parametrize("gen", GENERATIONS)
def test_analytic_and_trace_agree_on_bf16_attention_kernels(gen):
    key, _, bf16 = GENERATIONS[gen]
    dev = device_profile(get_gpu(key))
    assert dev.bf16 is bf16
    q = torch.empty(2, 8, 128, 64, dtype=torch.bfloat16, device="meta")
    kernel = choose_backend(dev, q, q, q, None, causal=True, gqa=False, grad=True)
    analytic_attention = kernel_workload(Workload(precision="bf16-mixed", attention="sdpa"), dev).attention
    # no bf16 kernel on the GPU ⇔ the trace takes SDPA's math path ⇔ the formulas count eager scores
    assert (kernel == "math") is (not bf16) is (analytic_attention is Attention.EAGER)


def test_one_profile_is_built_per_estimate(monkeypatch):
    import vramplan.hardware.target as target

    calls = []
    real = target.device_profile

    def counting(*a, **k):
        calls.append(a)
        return real(*a, **k)

    monkeypatch.setattr(target, "device_profile", counting)
    estimate("llama-3.1-8b", W.replace(seq=2048), gpu="h100-sxm", method="analytic")  # incl. the batch search
    assert len(calls) == 1
