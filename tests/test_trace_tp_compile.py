"""Tensor parallelism (torchtitan's Llama plan through ``parallelize_module``) with compiled blocks:
the real run of that stack fails in its first backward on torch 2.13.0 and 2.14.1, so the trace
refuses it with the cause (docs/research/fsdp-compile.md, "TP + compile";
``tensor_parallel.compile_refusal``)."""

from __future__ import annotations

import shutil

import pytest
import torch

from vramplan.errors import TraceError
from vramplan.trace.run import TraceOptions, trace_workload
from vramplan.trace.testing import real_tp_compile_run, tiny_spec
from vramplan.workload import Workload


@pytest.mark.parametrize("sp", [False, True])
def test_tp_with_compiled_blocks_is_refused_with_the_real_runs_failure(sp: bool) -> None:
    w = Workload(task="train", precision="fp32", batch=2, seq=64, compile=True).replace(tp=2, sp=sp)
    with pytest.raises(TraceError) as e:
        trace_workload(tiny_spec("llama-2-7b"), w, options=TraceOptions(workspaces=False, count_flops=False))
    msg = str(e.value)
    assert "tensor parallelism with compiled blocks is not traced" in msg, msg
    assert f"on torch {torch.__version__.split('+')[0]}" in msg and "AsyncCollectiveTensor" in msg, msg
    assert "without `compile`" in (e.value.hint or ""), e.value.hint


def test_aot_autograd_compiles_an_async_collective_view_as_needing_no_gradient() -> None:
    """The mechanism, in one process: ``DTensor.to_local()`` of an output redistributed with
    ``async_op=True`` is a view, made by a custom autograd function (``_ToTorchTensor``), of a
    funcol ``AsyncCollectiveTensor`` that needs no gradient itself. Handed to a compiled function,
    Dynamo's example input requires a gradient, but AOTAutograd's compiled function gives none
    back: here its output needs no gradient at all. Eager, and a waited (cloned) input, are right.
    When a torch version passes this with ``aot_eager`` the refusal is to be checked again
    (``real_tp_compile_run``)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    class ToLocal(torch.autograd.Function):  # as DTensor's _ToTorchTensor: a view of the local tensor
        @staticmethod
        def forward(ctx: object, x: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
            return local.view_as(local)

        @staticmethod
        def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
            return grad, None

    def twice(h: torch.Tensor) -> torch.Tensor:
        return h * 2

    def grad_of(backend: str | None, wait: bool) -> torch.Tensor | None:
        torch._dynamo.reset()
        f = twice if backend is None else torch.compile(twice, backend=backend, fullgraph=True)
        x = torch.ones(2, 8, requires_grad=True)
        with torch.no_grad():
            local = AsyncCollectiveTensor(x * 1)  # (the redistribute's output: needs no gradient)
        h = ToLocal.apply(x, local)
        assert type(h) is AsyncCollectiveTensor and h.requires_grad and h._base is local
        y = f(h.clone() if wait else h)
        if not y.requires_grad:
            return None
        y.sum().backward()
        return x.grad

    try:
        assert torch.equal(grad_of(None, wait=False), torch.full((2, 8), 2.0))  # eager
        assert grad_of("aot_eager", wait=False) is None  # the gradient the compiled block drops
        assert torch.equal(grad_of("aot_eager", wait=True), torch.full((2, 8), 2.0))
    finally:
        torch._dynamo.reset()


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="Inductor on CPU needs a C compiler")
@pytest.mark.parametrize("sp", [False, True])
def test_real_tp_with_compiled_blocks_fails_in_its_first_backward_and_runs_with_the_input_waited(sp: bool) -> None:
    """The configuration the refusal is about, run for real (2 gloo processes, Inductor on the
    CPU, tiny Llama-2, fp32, batch 2 × 64): the first backward fails in DTensor's
    ``NestedRedistribute.forward``; the first compiled layer's input is an
    ``AsyncCollectiveTensor``; cloning that input (which waits it) is the one change that lets
    both steps run."""
    spec = tiny_spec("llama-2-7b")
    failed = real_tp_compile_run(spec, tp=2, batch=2, seq=64, sp=sp)
    for r in failed:
        assert not r["ok"] and r["steps"] == 0, r
        assert r["first_input"] == "AsyncCollectiveTensor", r
        assert r["error"] == "AttributeError: 'Tensor' object has no attribute '_local_tensor'", r
        assert r["where"].endswith("torch/distributed/tensor/_redistribute.py:forward"), r
    waited = real_tp_compile_run(spec, tp=2, batch=2, seq=64, sp=sp, wait_first_input=True)
    for r in waited:
        assert r["ok"] and r["steps"] == 2, r
