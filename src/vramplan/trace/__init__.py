"""Trace a PyTorch step on fake tensors: every allocation and free the GPU would see.

Entry points: :func:`vramplan.trace.run.trace_workload` (catalog models) and
:func:`vramplan.trace.run.trace_model` (any ``nn.Module``) return a
:class:`~vramplan.trace.result.TraceResult`. The user-facing ``vramplan.trace(...)``, which
adds the allocator simulation and the GPU verdict, is :func:`vramplan.engine.trace`.
"""
