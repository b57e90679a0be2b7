"""The trace's own knobs (torch-free: a cache key is built from them before torch is imported)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

FULL_TRACE_ENV = "VRAMPLAN_FULL_TRACE"


@dataclass(frozen=True)
class TraceOptions:
    """Knobs of the CUDA emulation (defaults follow a stock PyTorch on the target GPU)."""

    workspaces: bool = True
    """cuBLAS / cuDNN workspaces and flash-attention backward buffers."""
    cache: str = "dynamic"
    """KV cache class for generation: ``dynamic`` (transformers' default) or ``static``."""
    count_flops: bool = True
    meta_cache: bool = True
    """Reuse meta-kernel results for ops repeated on the same shapes (every layer of a
    transformer): the events are identical, tracing is ~3x faster (see :mod:`.metacache`)."""
    extrapolate_decode: bool = True
    """Generation: trace the first decode steps, write the rest from their exact progression
    (see :mod:`.decode`); False traces every step."""
    extrapolate_accum: bool = True
    """Training with gradient accumulation: trace micro-steps until two repeat exactly, write
    the rest of the iteration's as copies (see :mod:`.microsteps`); single-GPU traces only (a
    sharded layout's collectives are counted per call). False traces every micro-step."""
    rank: int = 0
    """Which rank of a parallel layout's world is traced (every rank of an even FSDP/DDP layout
    holds the same; the last one may hold less of a weight whose rows do not divide). 0, the
    default, of a forward-only step under context parallelism traces the heaviest cp rank, the
    last (``trace.context_parallel.heaviest_rank``), as a pipeline trace does."""
    replicate_layers: bool = dataclasses.field(default_factory=lambda: os.environ.get(FULL_TRACE_ENV, "") in ("", "0"))
    """Catalog models: trace the model with 2, 3 and 4 of its identical decoder layers (after a
    dense prefix) and write the other layers' events from their exact progression (see
    :mod:`.replicate`); where that does not verify, or False, every layer is traced. The
    environment variable ``VRAMPLAN_FULL_TRACE=1`` turns it off for every trace (debugging)."""


__all__ = ["TraceOptions", "FULL_TRACE_ENV"]
