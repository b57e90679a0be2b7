"""What a trace returns: the event log plus the figures read from it."""

from __future__ import annotations

from dataclasses import dataclass

from ..events import EventLog
from ..results import Breakdown, IterationPeak, ModuleStat, PhasePeak, TensorStat, Timeline
from ..workload import Phase


@dataclass(frozen=True, kw_only=True)
class TraceResult:
    """One traced workload. Sizes are requested bytes (before the allocator's rounding)."""

    events: EventLog
    """Every allocation and free, in order (replay it with :func:`vramplan.allocator.replay`)."""
    peak_allocated: int
    """Highest sum of live tensor bytes (requested sizes)."""
    peak_index: int
    """Event index at which the peak is reached."""
    breakdown_at_peak: Breakdown
    peak_phase: Phase
    peak_module: str
    """Module whose op made the peak allocation ("" when outside any module)."""
    phases: tuple[PhasePeak, ...]
    iterations: tuple[IterationPeak, ...]
    """Peak of each traced iteration (the first builds optimizer states; later ones are the steady state)."""
    top_tensors: tuple[TensorStat, ...]
    """Largest storages live at the peak."""
    top_modules: tuple[ModuleStat, ...]
    params: int
    trainable_params: int
    flops: int | None
    """FLOPs of one step (forward + backward of all micro-batches), counted as FlopCounterMode does."""
    timeline: Timeline
    """Allocated bytes by breakdown category, decimated to at most 5,000 points (peaks kept)."""
    notes: tuple[str, ...] = ()
    host_memory: int = 0
    """Host (CPU) RAM the step holds: offloaded activations (``activation_offload``, pinned) and
    FSDP2 CPU offload's parameters, gradients and optimizer (``offload_params``)."""
    host_parts: tuple[tuple[str, int], ...] = ()
    """(part, bytes) of ``host_memory``."""
    step_parts: tuple[tuple[str, int], ...] = ()
    """PPO (a critic or a reward model beside the policy): (part, peak allocated bytes) of the
    last traced step's parts, ``generation`` (and scoring), ``critic`` (its update) and ``actor``
    (:func:`.ppo.parts_of`); empty otherwise."""
    gpu_events: tuple[tuple[int, EventLog], ...] = ()
    """(index, event log) of each GPU other than 0 that held tensors (``vramplan run`` of a model
    spread over the GPUs by a device map); :attr:`events` is GPU 0's. Empty otherwise."""
    paths: frozenset[str] = frozenset()
    """Module paths of the model traced (per-module attribution looks ancestors up in them): kept
    so that a log written from this one (:mod:`.nearby`) is summarised like a trace."""
