"""Re-using a built and prepared catalog model across traces that differ only in batch or sequence.

Building a catalog model (transformers' ``from_config`` on ``meta``) and preparing it for a
workload (precision, PEFT adapters, quantisation, activation checkpointing) depend on the
model spec and on the workload's fields, but not on the batch size nor on the sequence length:
those reach the trace only through the inputs (:func:`vramplan.models.build.example_inputs`).
A search (``fit``, ``plan``, the estimate verdict's largest batch) traces the same model at
several batches and lengths; with a *model store* (``vramplan.engine.cache.MODELS``) each
trace borrows the prepared model the previous one gave back instead of building it again.

What a trace leaves on a model it ran: gradients (set to None again here) and nothing else
for the layouts admitted (:func:`reusable`: one GPU, no layout that wraps or shards the
model in place, no optimizer hooks on parameters, no compile, no checkpoint policy). A
model is lent to one trace at a time (the store removes it while lent) and given back only
when its :func:`state` — every module's hooks, mode, attributes and children, every
parameter's identity, shape, dtype, ``requires_grad``, gradient and hooks — is what it was
before the trace; a trace that raised never gives its model back. ``tests/test_trace_reuse.py``
checks that a trace on a borrowed model records the same event log as a fresh build.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from torch import nn

from ..workload import Workload

if TYPE_CHECKING:
    from ..models.spec import ModelSpec
    from ..target import DeviceProfile

_INPUT_ONLY = frozenset({"batch", "seq"})
"""Workload fields that reach a catalog trace only through its inputs."""


class ModelStore(Protocol):
    """Where prepared models wait between traces (``vramplan.engine.cache.ModelPool``)."""

    def take(self, spec: ModelSpec, key: Hashable) -> Any:
        """The model stored under (spec, key), removed from the store; None if there is none."""

    def give(self, spec: ModelSpec, key: Hashable, value: Any) -> None:
        """Store ``value`` under (spec, key) for a later :meth:`take`."""


@dataclass(frozen=True)
class Lent:
    """A prepared model (its batch left empty) and its :func:`state` before its first trace."""

    prepared: Any
    """A ``vramplan.trace.run.Prepared`` whose ``batch`` is empty."""
    state: tuple[Any, ...]
    modules: int
    """How many modules it has (what the store weighs it by)."""


def key(w: Workload, attention: str, device: DeviceProfile | None) -> Hashable:
    """Everything a prepared model depends on besides its spec: every workload field but the
    batch and the sequence length, the attention it was built with and the device profile
    (MoE experts pick their kernel by the GPU's compute capability)."""
    fields = tuple((f.name, getattr(w, f.name)) for f in dataclasses.fields(w) if f.name not in _INPUT_ONLY)
    return (fields, attention, device)


def reusable(w: Workload, *, model_parallel: bool, layout: Any, checkpoint_policy: Any) -> bool:
    """Whether a model prepared for ``w`` may serve another trace: nothing in the trace of
    ``w`` wraps, shards or hooks the model beyond what :func:`state` sees come back."""
    return (not model_parallel and layout is None and checkpoint_policy is None and not w.compile
            and not w.optimizer_in_backward and not w.activation_offload)


def state(model: nn.Module) -> tuple[Any, ...]:
    """What a trace must leave unchanged on a model for it to be traced again (see the module
    docstring); cheap: a walk over modules and parameters."""
    out: list[Any] = []
    for m in model.modules():
        out.append((id(m), m.training, len(vars(m)), tuple(m._parameters), tuple(m._buffers), tuple(m._modules),
                    len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks),
                    len(m._backward_pre_hooks)))
        for b in m._buffers.values():
            if b is not None:
                out.append((id(b), tuple(b.shape), b.dtype, b.device.type))
    for p in model.parameters():
        out.append((id(p), tuple(p.shape), p.dtype, p.device.type, p.requires_grad, p.grad is None,
                    len(p._backward_hooks or ()), len(getattr(p, "_post_accumulate_grad_hooks", None) or ())))
    return tuple(out)


def settle(model: nn.Module) -> None:
    """Undo what a trace leaves on its model: the last step's gradients."""
    for p in model.parameters():
        p.grad = None


__all__ = ["ModelStore", "Lent", "key", "reusable", "state", "settle"]
