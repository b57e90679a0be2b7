"""``nn.DataParallel`` on the emulated GPUs: what GPU 0 holds (the figure real runs report).

A real ``DataParallel.forward`` (torch/nn/parallel/data_parallel.py) scatters the batch over its
devices (``tensor.chunk(n, dim)``), replicates the module (``Broadcast``: on the source device the
replica's parameters are the module's own, as aliases), runs each replica on its chunk in a
thread, and gathers the outputs on ``output_device``. In backward, ``Broadcast.backward``
reduce-adds every replica's gradients onto the source device (``comm.reduce_add_coalesced``) while
replica 0's own gradients are still alive. GPU 0 of a real run therefore holds the module, the
whole input batch, replica 0's activations (its chunk), the gathered output, and in backward both
replica 0's gradients and their sum.

The emulation runs that share on the emulated GPU 0 through DataParallel's own hooks
(``scatter``, ``replicate``, ``parallel_apply``, ``gather``): chunk 0 is a view of the batch,
replica 0 runs on it with aliases of the parameters whose backward makes the summed gradient (a
copy per parameter: the coalesced buckets' flattening is left out), the other replicas run on the
other GPUs and are not run here, and the gathered output is allocated whole on GPU 0 with chunk 0
copied in (the other chunks' sizes taken in proportion to their inputs').
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn


class _Broadcast0(torch.autograd.Function):
    """Replica 0's parameters: aliases of the module's; backward returns their reduce-add sum."""

    @staticmethod
    def forward(ctx: Any, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return tuple(None if g is None else g.clone() for g in grads)


class _Gather0(torch.autograd.Function):
    """The gathered output on GPU 0: allocated whole, chunk 0 copied in; backward scatters."""

    @staticmethod
    def forward(ctx: Any, out0: torch.Tensor, dim: int, total: int) -> torch.Tensor:
        ctx.dim, ctx.n0 = dim, out0.shape[dim]
        shape = list(out0.shape)
        shape[dim] = total
        full = out0.new_empty(shape)
        full.narrow(dim, 0, out0.shape[dim]).copy_(out0)
        return full

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad.narrow(ctx.dim, 0, ctx.n0), None, None


def _first_chunks(obj: Any, n: int, dim: int, sizes: list[int]) -> Any:
    if isinstance(obj, torch.Tensor):
        chunks = obj.chunk(n, dim)
        if not sizes:
            sizes.extend(c.shape[dim] for c in chunks)
        return chunks[0]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_first_chunks(x, n, dim, sizes) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_first_chunks(x, n, dim, sizes) for x in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _first_chunks(v, n, dim, sizes)) for k, v in obj.items())
    return obj


def _gathered(obj: Any, dim: int, sizes: list[int]) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0 or not sizes:
            return obj
        total = sum(max(1, round(obj.shape[dim] * s / sizes[0])) for s in sizes)
        return _Gather0.apply(obj, dim, total)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_gathered(x, dim, sizes) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_gathered(x, dim, sizes) for x in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _gathered(v, dim, sizes)) for k, v in obj.items())
    return obj


def _replica0(module: nn.Module, detach: bool) -> nn.Module:
    """``torch.nn.parallel.replicate(module, [0])[0]``'s structure, parameters through
    :class:`_Broadcast0` (their copies on the source device are the module's own)."""
    params = list(module.parameters())
    index = {p: i for i, p in enumerate(params)}
    copies = [p.detach() for p in params] if detach else list(_Broadcast0.apply(*params))
    modules = list(module.modules())
    replicas = {m: m._replicate_for_data_parallel() for m in modules}
    for m in modules:
        r = replicas[m]
        r._former_parameters = {}  # (as torch's replicate: DDP reads it)
        for key, child in m._modules.items():
            if child is None:
                r._modules[key] = None
            else:
                setattr(r, key, replicas[child])
        for key, p in m._parameters.items():
            if p is None:
                r._parameters[key] = None
            else:
                setattr(r, key, copies[index[p]])
                r._former_parameters[key] = copies[index[p]]
        for key, b in m._buffers.items():
            r._buffers[key] = b
    return replicas[module]


@contextlib.contextmanager
def data_parallel() -> Iterator[None]:
    """``nn.DataParallel`` runs GPU 0's share (see the module docstring)."""
    dp = nn.DataParallel
    saved = {k: dp.__dict__[k] for k in ("scatter", "replicate", "parallel_apply", "gather")}

    def scatter(self: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None,
                device_ids: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        sizes: list[int] = []
        first = _first_chunks((tuple(inputs), dict(kwargs or {})), len(device_ids), self.dim, sizes)
        self._vramplan_sizes = sizes
        n = len(sizes) or 1
        return [first[0]] * n, [first[1]] * n

    def replicate(self: Any, module: nn.Module, device_ids: Sequence[Any]) -> list[Any]:
        return [_replica0(module, not torch.is_grad_enabled())] + [None] * (len(device_ids) - 1)

    def parallel_apply(self: Any, replicas: Sequence[Any], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
        return [replicas[0](*inputs[0], **kwargs[0])]

    def gather(self: Any, outputs: list[Any], output_device: Any) -> Any:
        return _gathered(outputs[0], self.dim, getattr(self, "_vramplan_sizes", []))

    dp.scatter, dp.replicate, dp.parallel_apply, dp.gather = scatter, replicate, parallel_apply, gather  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(dp, k, v)
