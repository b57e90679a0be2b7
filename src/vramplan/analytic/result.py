"""The analytic estimator's result: per-phase peak instants of one rank, plus context."""

from __future__ import annotations

from vramplan._dataclass import dataclass
from vramplan.results import PhasePeak


@dataclass(frozen=True)
class ModelStates:
    """Persistent per-rank model states — what ZeRO shards (bytes)."""

    weights: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


@dataclass(frozen=True)
class AnalyticEstimate:
    """Closed-form prediction of one rank's allocated memory (``max_memory_allocated``)."""

    phases: tuple[PhasePeak, ...]
    """Each phase's peak instant with its breakdown by category."""
    peak: PhasePeak
    """The phase whose peak is highest (the step's peak is a maximum over phases, not a sum)."""
    params: int
    """Total parameters of the model (exact, from the spec)."""
    trainable_params: int
    """Parameters that train (LoRA: the adapters), whole model."""
    flops_per_step: float
    """FLOPs one rank performs per optimizer step (training), forward (infer) or generate call."""
    notes: tuple[str, ...]
    """Assumptions, one sentence each."""
    states: ModelStates
    """Persistent weights/gradients/optimizer states of the peak rank (sharded as ZeRO shards)."""
    activations_per_layer: int = 0
    """Bytes one layer saves for backward for one micro-batch on this rank (no checkpointing)."""
    kv_cache: int = 0
    """KV cache bytes on this rank at the end of generation (generate / infer)."""
    stage: int = 0
    """Pipeline stage whose peak is reported (the highest)."""
    host_memory: int = 0
    """Host RAM of this rank: offloaded activations (``activation_offload``) and FSDP2 CPU
    offload's parameters, gradients and optimizer (``offload_params``)."""
    host_parts: tuple[tuple[str, int], ...] = ()
    """(part, bytes) of ``host_memory``."""
    forward_end: PhasePeak | None = None
    """Training under FSDP2 where the forward phase's peak is its first gathers (the first block's
    unshard beside the root's all-gather output, ``phases.with_forward_start``): the end of the
    forward, which what runs after the forward builds on (a preference step's reference forwards,
    a VLM's tower); None where the forward phase is that instant already."""
    step_parts: tuple[tuple[str, int], ...] = ()
    """PPO (a critic or a reward model beside the policy): (part, peak allocated bytes) of the step's
    parts, ``generation`` (and scoring), ``critic`` (its update, PPO) and ``actor``, as the trace's
    ``TraceResult.step_parts``; empty otherwise."""
