"""Typed results that cross module boundaries. Plain data; rendering lives in ``report``.

Invariants (tested): the breakdown's categories sum to ``peak.allocated``;
``peak.reserved >= peak.allocated``; ``peak.device_used = peak.reserved + overhead``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import field
from typing import TYPE_CHECKING, Any

from vramplan._dataclass import dataclass

from ._json import jsonable
from .workload import Method, Phase, Workload

HOST_PARAMETERS = "parameters (pinned)"
HOST_GRADIENTS = "gradients (pinned)"
HOST_STATES = "optimizer states"
HOST_STEP = "optimizer step temporaries"
HOST_FLAT_SHARDS = "flat shards and lazy-init copies before the first all-gather (pageable)"
HOST_ACTIVATIONS = "offloaded activations (pinned)"
"""Names of the parts of ``MemoryReport.host_parts`` (the trace and the formulas use the same)."""

if TYPE_CHECKING:
    from .events import EventLog

BREAKDOWN_KEYS: tuple[str, ...] = (
    "weights", "gradients", "optimizer", "activations", "temporaries", "kv_cache",
)


@dataclass(frozen=True)
class Breakdown:
    """Bytes allocated at one instant, by category. Sums to the allocated total."""

    weights: int = 0
    """Parameters and buffers (incl. quantised storage and its scales)."""
    gradients: int = 0
    optimizer: int = 0
    """Optimizer states (and fp32 master copies where they are separate from the weights)."""
    activations: int = 0
    """Tensors saved for backward, inputs, and live forward outputs."""
    temporaries: int = 0
    """Short-lived buffers: op workspaces, foreach temporaries, autocast weight copies, logits upcasts."""
    kv_cache: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, k) for k in BREAKDOWN_KEYS)

    def as_dict(self) -> dict[str, int]:
        return {k: int(getattr(self, k)) for k in BREAKDOWN_KEYS}

    def __add__(self, other: Breakdown) -> Breakdown:
        return Breakdown(**{k: getattr(self, k) + getattr(other, k) for k in BREAKDOWN_KEYS})

    @classmethod
    def from_mapping(cls, m: Mapping[str, int]) -> Breakdown:
        unknown = set(m) - set(BREAKDOWN_KEYS)
        if unknown:
            raise ValueError(f"unknown breakdown categories {sorted(unknown)}")
        return cls(**{k: int(v) for k, v in m.items()})


@dataclass(frozen=True)
class OverheadItem:
    """Memory outside PyTorch's allocator (CUDA context, kernels, NCCL, ...)."""

    name: str
    bytes: int
    source: str
    """Where the figure comes from (measurement, document, or formula)."""


@dataclass(frozen=True)
class Peak:
    """The predicted peak, as the three figures people see."""

    allocated: int
    """Predicted ``torch.cuda.max_memory_allocated()``."""
    reserved: int
    """Predicted ``torch.cuda.max_memory_reserved()``."""
    device_used: int
    """Predicted nvidia-smi / NVML used memory at the peak (reserved + overhead)."""


@dataclass(frozen=True)
class GpuPeak:
    """One GPU's predicted peak where a run spreads a model over several GPUs (a device map):
    each GPU's own allocations replayed through the allocator simulation."""

    gpu: int
    """The GPU's index (``cuda:N``)."""
    allocated: int
    """Predicted ``torch.cuda.max_memory_allocated(N)``."""
    reserved: int
    """Predicted ``torch.cuda.max_memory_reserved(N)``."""
    device_used: int
    """Predicted nvidia-smi used memory of that GPU (reserved + its CUDA context and workspaces
    outside the allocator, as on GPU 0)."""


@dataclass(frozen=True)
class PhasePeak:
    """The allocated peak of one phase, with its breakdown."""

    phase: Phase
    allocated: int
    breakdown: Breakdown


@dataclass(frozen=True)
class Verdict:
    """Whether the workload fits on a GPU, and with what headroom."""

    gpu: str
    """Catalog key of the GPU."""
    gpu_name: str
    capacity: int
    usable: int
    """Capacity minus the driver/firmware reserve (what a process can get)."""
    fits: bool
    headroom: int
    """usable − predicted device_used (negative: short by that much)."""
    max_batch: int | None
    """Largest micro-batch that fits (None when not searched / not batch-dependent)."""
    num_gpus: int = 1
    capacity_source: str = ""
    refused: str = ""
    """A framework's own refusal to start the job on this GPU (a colocated vLLM's start-up
    error, verbatim): then it does not fit, whatever the bytes."""


@dataclass(frozen=True)
class AllocatorSummary:
    """What the caching-allocator simulation adds on top of allocated bytes."""

    backend: str
    """``native`` or ``cudaMallocAsync (approximation)`` or ``none (allocated + estimate)``."""
    conf: str
    segments: int
    fragmentation_at_peak: float
    """1 − allocated/reserved at the reserved peak."""
    alloc_retries: int = 0
    ooms: int = 0


@dataclass(frozen=True)
class ModuleStat:
    """Memory attributed to one module of a trace."""

    module: str
    peak: int
    """Bytes allocated while this module was running, at its highest."""
    own: int = 0
    """Bytes allocated by this module's own ops that are live at the global peak."""


@dataclass(frozen=True)
class TensorStat:
    """One of the largest tensors live at the traced peak."""

    nbytes: int
    category: str
    module: str
    op: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class IterationPeak:
    """The allocated peak of one traced iteration and its phase."""

    iteration: int
    allocated: int
    phase: Phase


@dataclass(frozen=True)
class Timeline:
    """Allocated bytes by category after each event (or a decimated subset of events)."""

    index: tuple[int, ...]
    series: Mapping[str, tuple[int, ...]]
    phases: tuple[tuple[int, int, str], ...] = ()
    """(first index, last index, phase name) spans."""
    reserved: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Fallback:
    """The method tried could not run on this workload and another answered (data, not a note)."""

    requested: Method
    used: Method
    reason: str
    """Why the requested method failed (the one-line error it raised)."""

    def sentence(self) -> str:
        return f"{self.requested} method failed ({self.reason}); {self.used} estimate instead"


@dataclass(frozen=True)
class Ran:
    """What a script did when ``vramplan run`` ran it (the report's header for a script), read
    off the run itself: the parameters' dtypes and autocast regions, the optimizers it built,
    the shape of its first batch on the GPU."""

    precision: str
    """e.g. ``fp32 weights + autocast bf16`` (``bf16-mixed``)."""
    optimizers: tuple[str, ...] = ()
    """Each optimizer built: class and implementation, e.g. ``AdamW (fused)``."""
    batch: int | None = None
    seq: int | None = None
    image: int | None = None
    steps: int = 0
    forwards: int = 0

    def line(self) -> str:
        parts = [f"task {'train' if self.steps else 'infer'}"]
        if self.batch is not None:
            parts.append(f"batch {self.batch}")
        if self.seq is not None:
            parts.append(f"seq {self.seq}")
        elif self.image is not None:
            parts.append(f"image {self.image}")
        parts.append(self.precision)
        parts += list(self.optimizers)
        return " · ".join(parts)


@dataclass(frozen=True, kw_only=True)
class MemoryReport:
    """A prediction of one workload's GPU memory, per GPU (per rank)."""

    model: str
    params: int
    trainable_params: int
    workload: Workload
    method: Method
    breakdown: Breakdown
    """By category at the allocated peak."""
    overhead: tuple[OverheadItem, ...]
    peak: Peak
    peak_phase: Phase
    phases: tuple[PhasePeak, ...] = ()
    verdict: Verdict | None = None
    allocator: AllocatorSummary | None = None
    notes: tuple[str, ...] = ()
    """Assumptions, fallbacks and caveats, one sentence each."""
    top_modules: tuple[ModuleStat, ...] = ()
    top_tensors: tuple[TensorStat, ...] = ()
    iterations: tuple[IterationPeak, ...] = ()
    timeline: Timeline | None = None
    model_states: Breakdown | None = None
    """Persistent per-GPU model states (weights, gradients, optimizer states) as sharded —
    what ZeRO's 16Ψ formulas describe; the peak breakdown may add transients (gathered layers)."""
    flops_per_step: float | None = None
    """FLOPs of one training/inference step per GPU, as the method counted them."""
    fallback: Fallback | None = None
    """Set when the requested method could not run and another one answered."""
    user_model: bool = False
    """A user's own model (``vramplan.trace``) rather than a catalog model or config."""
    has_sequence: bool = True
    """The model takes a token sequence (the report's header shows ``seq``; a CNN shows the image size)."""
    has_attention: bool = True
    """The model has attention (the header shows the attention implementation)."""
    events: EventLog | None = field(default=None, repr=False, compare=False)
    """The trace's allocation/free log (trace method only); not part of the JSON."""
    host_memory: int = 0
    """Host (CPU) RAM the step holds on this rank beyond the process itself: activations
    offloaded with ``activation_offload`` (pinned), FSDP2 CPU offload's parameters and
    gradients (pinned) and its CPU optimizer step (0 when nothing is offloaded)."""
    host_parts: tuple[tuple[str, int], ...] = ()
    """(part, bytes) of ``host_memory``."""
    ran: Ran | None = None
    """A script's run (``vramplan run``): what it did, as seen while it ran."""
    gpus: tuple[GpuPeak, ...] = ()
    """Each GPU's peak, GPU 0 first (whose figures are also :attr:`peak`), when the run spread a
    model over several GPUs (a device map); empty otherwise. The verdict is the fullest GPU's."""
    gpu_events: tuple[tuple[int, EventLog], ...] = field(default=(), repr=False, compare=False)
    """(index, event log) of each GPU other than 0 in :attr:`gpus` (:attr:`events` is GPU 0's): what a
    saved trace (``--snapshot``) writes as that device's trace; not part of the JSON."""

    @property
    def worst_gpu(self) -> GpuPeak | None:
        """The GPU with the highest device used (the first of equals), None without :attr:`gpus`."""
        return max(self.gpus, key=lambda g: g.device_used) if self.gpus else None

    @property
    def device_used_worst(self) -> int:
        """The device used that decides the verdict: the fullest GPU's, else :attr:`peak`'s."""
        w = self.worst_gpu
        return self.peak.device_used if w is None else max(w.device_used, self.peak.device_used)

    @property
    def overhead_total(self) -> int:
        return sum(o.bytes for o in self.overhead)

    @property
    def predicts(self) -> str:
        return (
            f"method={self.method}: allocated = torch.cuda.max_memory_allocated(), "
            "reserved = torch.cuda.max_memory_reserved(), device_used = nvidia-smi used"
        )

    def replace(self, **changes: Any) -> MemoryReport:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; all sizes are integer bytes."""
        d: dict[str, Any] = {
            "model": self.model,
            "params": self.params,
            "trainable_params": self.trainable_params,
            "method": str(self.method),
            "predicts": self.predicts,
            "workload": self.workload.to_dict(),
            "loop": _loop(self.workload),
            "breakdown": {**self.breakdown.as_dict(), "overhead": self.overhead_total},
            "overhead": [dataclasses.asdict(o) for o in self.overhead],
            "peak": dataclasses.asdict(self.peak),
            "peak_phase": str(self.peak_phase),
            "phases": [
                {"phase": str(p.phase), "allocated": p.allocated, "breakdown": p.breakdown.as_dict()}
                for p in self.phases
            ],
            "notes": list(self.notes),
        }
        if self.ran is not None:
            d["ran"] = dataclasses.asdict(self.ran)
        if self.gpus:
            d["gpus"] = [dataclasses.asdict(g) for g in self.gpus]
            d["worst_gpu"] = self.worst_gpu.gpu if self.worst_gpu is not None else 0
        if self.flops_per_step is not None:
            d["flops_per_step"] = self.flops_per_step
        if self.host_memory:
            d["host_memory"] = self.host_memory
            d["host_memory_parts"] = {name: n for name, n in self.host_parts}
        if self.fallback is not None:
            f = self.fallback
            d["fallback"] = {"requested": str(f.requested), "used": str(f.used), "reason": f.reason}
        if self.model_states is not None:
            ms = self.model_states
            d["model_states"] = {"weights": ms.weights, "gradients": ms.gradients,
                                 "optimizer": ms.optimizer, "total": ms.total}
        if self.allocator is not None:
            d["allocator"] = dataclasses.asdict(self.allocator)
        if self.verdict is not None:
            v = self.verdict
            d["gpu"] = {"name": v.gpu, "full_name": v.gpu_name, "capacity": v.capacity,
                        "usable": v.usable, "count": v.num_gpus, "source": v.capacity_source}
            d["fits"] = v.fits
            d["headroom"] = v.headroom
            d["max_batch"] = v.max_batch
            if v.refused:
                d["refused"] = v.refused
        if self.top_modules:
            d["top_modules"] = [dataclasses.asdict(m) for m in self.top_modules]
        if self.top_tensors:
            d["top_tensors"] = [dataclasses.asdict(t) for t in self.top_tensors]
        if self.iterations:
            d["iterations"] = [
                {"iteration": i.iteration, "allocated": i.allocated, "phase": str(i.phase)}
                for i in self.iterations
            ]
        return jsonable(d)


def _loop(w: Workload) -> dict[str, Any]:
    """The report header's loop account (recipe, defaults applied, values given instead)."""
    from .recipes import summary

    return summary(w).to_dict()
