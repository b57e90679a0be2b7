"""``vramplan.trace``: a user's own model (an ``nn.Module`` or a factory) → MemoryReport."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..results import MemoryReport
from ..workload import Task, Workload, as_enum
from .device import profile
from .methods import trace_core
from .pipeline import finish
from .resolve import resolve_gpu

if TYPE_CHECKING:
    from vramplan.hardware.gpu import GPU


def construction_facts(gpu: str | GPU | None) -> Any:
    """What ``torch.cuda`` / ``torch.accelerator`` say while a user's factory builds its model
    (:func:`vramplan.emulate.construct.fake_construction`): the target GPU, or the default
    device profile without one."""
    from ..emulate.facts import facts_of

    g = resolve_gpu(gpu)
    dev = profile(g, Workload())
    return facts_of(g.name if g else dev.name, dev.sm, dev.usable, dev.overhead_bytes,
                    sm_count=(g.sm_count or 0) if g else 0)


def trace(
    build_model: Callable[[], Any] | Any,
    inputs: Any = None,
    *,
    workload: Workload | None = None,
    task: str = "train",
    optimizer: Callable[[Any], Any] | str | None = None,
    loss_fn: Callable[..., Any] | None = None,
    gpu: str | GPU | None = None,
    alloc_conf: str | None = None,
    iterations: int = 2,
    name: str | None = None,
    checkpoint_policy: Any = None,
    **workload_fields: Any,
) -> MemoryReport:
    """Trace a user's own model (an ``nn.Module`` or a factory returning one) on fake tensors.

    ``inputs``: a tensor, tuple of tensors or dict of keyword tensors for ``model(...)``.
    ``optimizer``: a factory such as ``lambda params: torch.optim.AdamW(params, lr=1e-4)``, or
    the name of a workload optimizer (``"adamw-8bit"``); default: the workload's optimizer.
    ``workload`` or keywords: :class:`~vramplan.workload.Workload` fields (precision,
    checkpointing, ...).
    ``checkpoint_policy``: a selective activation checkpointing policy for PyTorch's
    ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` — a function
    ``(ctx, op, *args, **kwargs) -> CheckpointPolicy`` or a list of ops whose outputs are saved —
    applied to every ``checkpoint_every``-th layer (it implies checkpointing).
    """
    from ..trace.run import trace_model

    factory = optimizer if callable(optimizer) else None
    if isinstance(optimizer, str):
        workload_fields["optimizer"] = optimizer
    if workload is not None:
        w = workload.replace(**workload_fields) if workload_fields else workload
    elif "recipe" in workload_fields:  # the recipe fills the knobs not given
        from ..recipes import apply

        w = apply(workload_fields.pop("recipe"), task=as_enum(Task, task, "task"), **workload_fields)
    else:
        w = Workload(task=as_enum(Task, task, "task"), **workload_fields)
    from ..recipes import check

    check(w)
    g = resolve_gpu(gpu)
    if alloc_conf:
        from ..allocator import parse_conf

        parse_conf(alloc_conf)
    dev = profile(g, w)
    tr = trace_model(build_model, inputs, workload=w, optimizer=factory, loss_fn=loss_fn, device=dev,
                     iterations=iterations, checkpoint_policy=checkpoint_policy, facts=construction_facts(g))
    core = trace_core(tr, w, alloc_conf, dev.allocator_capacity)
    label = name or getattr(build_model, "__name__", None) or type(build_model).__name__
    return finish(core, label, w, g, dev, notes=[], user_model=True)


__all__ = ["trace"]
