"""FSDP2 collectives on symmetric memory (``FSDPModule.set_symm_mem_for_comm``): refused, with its cause.

torchtitan's ``--parallelism.enable_fsdp_symm_mem`` (torchtitan 0.3.0
``torchtitan/distributed/fsdp.py:44-51``) calls ``set_force_sum_reduction_for_comms(True)`` and
``set_symm_mem_for_comm()`` on every FSDP module. torch 2.13's FSDP2 then allocates each
all-gather output and each reduce-scatter input and output (``_fsdp_collectives.py:351``,
``597``, ``612``) inside ``torch.cuda.use_mem_pool(symm_mem.get_mem_pool(device))``
(``_fsdp_collectives.py:97-107``): a ``torch.cuda.MemPool`` with ``no_split=True`` whose
segments come from NCCL's symmetric allocator (``ncclMemAlloc``) instead of ``cudaMalloc``.
They stay caching-allocator blocks, but in their own pool, one segment each and never split,
and every segment rendezvoused with a group adds a signal pad from ``ncclMemAlloc`` outside
the caching allocator. The trace's allocator replay keeps no user MemPools
(:mod:`vramplan.allocator.native`), so it would book these buffers in the default pools, where
they share segments with everything else: the run is refused with that cause, and the fix (plain
FSDP2) with what it leaves out. The facts and their sources: docs/research/fsdp-symm-mem.md.
"""

from __future__ import annotations

from typing import Any

from ..errors import TraceError

LEFT_OUT = ("FSDP2 puts each all-gather output and reduce-scatter input/output in a symmetric-memory MemPool "
            "(NCCL's ncclMemAlloc segments, never split, not shared with other tensors) and adds a signal pad "
            "per rendezvoused segment outside the caching allocator")
"""What a plain-FSDP2 figure leaves out (docs/research/fsdp-symm-mem.md)."""


def refuse_symm_mem(*_: Any, **__: Any) -> None:
    """Stands in for ``FSDPParamGroup.set_symm_mem`` under a trace: raise the refusal."""
    raise TraceError(
        "FSDP2 on symmetric memory is not traced: `set_symm_mem_for_comm` (torchtitan's "
        "parallelism.enable_fsdp_symm_mem) allocates FSDP's collective buffers from a NCCL symmetric-memory "
        "torch.cuda.MemPool, and the trace's allocator keeps no MemPools",
        hint="turn it off to trace plain FSDP2 (torchtitan: `parallelism.enable_fsdp_symm_mem=false`); the plain "
             f"figure has the same buffers in the default pools, but {LEFT_OUT}")
