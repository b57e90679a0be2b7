"""Async tensor parallelism (Inductor's micro-pipeline TP on symmetric memory): refused, with its cause.

torchtitan's ``--compile.enable_async_tensor_parallel`` (``_maybe_enable_async_tp``,
torchtitan 0.3.0 ``torchtitan/distributed/compile.py:75-96``) enables symmetric memory on the TP
group and sets ``torch._inductor.config._micro_pipeline_tp``, then compiles each block. Inductor's
post-grad pass (torch 2.13 ``torch/_inductor/fx_passes/post_grad.py:241-242``) rewrites the
compiled graph's all-gather → matmul and matmul → reduce-scatter into
``symm_mem.fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``, whose workspace is mapped
with ``cuMemCreate`` outside the caching allocator and whose matmuls run partly on a second
stream. A trace runs the eager step (``torch.compile`` is the identity, :mod:`.session`), so it
cannot know which collectives the pass fuses: the run is refused with that cause, and the fix
(plain TP) with what it leaves out. The facts and their sources: docs/research/async-tp.md.
"""

from __future__ import annotations

from typing import Any

from ..errors import TraceError

WORKSPACE_RULE = ("max(a fused all-gather's input shard, 2 × a fused reduce-scatter's output shard) + a 9,216-byte "
                  "signal pad, rounded up to the driver's VMM granularity")
"""The symmetric-memory workspace one TP group keeps (``get_symm_mem_workspace``, grown to the
largest request and kept): docs/research/async-tp.md."""


def check_compile(backend: Any, options: Any) -> None:
    """Raise when this ``torch.compile`` would run Inductor's micro-pipeline TP pass on a process
    group with symmetric memory; return otherwise (the pass fuses nothing without it)."""
    if backend != "inductor":
        return  # the pass is one of Inductor's post-grad passes
    import torch._inductor.config as inductor_config

    on = getattr(inductor_config, "_micro_pipeline_tp", False)
    if isinstance(options, dict) and "_micro_pipeline_tp" in options:
        on = options["_micro_pipeline_tp"]
    if not on or not symm_mem_groups():
        return
    raise TraceError(
        "async tensor parallelism is not traced: with `torch._inductor.config._micro_pipeline_tp` on and symmetric "
        "memory on a process group (torchtitan's compile.enable_async_tensor_parallel), Inductor rewrites the compiled "
        "graph's all-gather→matmul and matmul→reduce-scatter into symmetric-memory fused ops, and a trace runs the "
        "eager step",
        hint="turn it off to trace plain TP (torchtitan: `compile.enable_async_tensor_parallel=false`; its llama3_405b "
             "config turns it on): the fused ops allocate the same gathered inputs and matmul outputs, but plain TP "
             f"leaves out their workspace, device memory outside the caching allocator ({WORKSPACE_RULE}), and the "
             "side stream's cuBLAS workspace")


def symm_mem_groups() -> bool:
    """Whether symmetric memory is on for some process group, as the pass asks it
    (``is_symm_mem_enabled_for_group``: the group's store registered); True where torch keeps no
    such registry. (torch's test mode is not counted: there the fused ops run their plain-TP
    fallbacks, which a trace counts as it is.)"""
    try:
        import torch.distributed._symmetric_memory as symm
    except ImportError:  # a torch built without distributed: no process group at all
        return False
    stores = getattr(symm, "_group_name_to_store", None)
    if stores is None:
        return True
    return bool(stores)
