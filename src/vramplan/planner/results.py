"""Frozen results of the planner: fit boundaries, plans, GPU/instance rankings.

Plain data with ``to_dict()`` (integer bytes, seconds, dollars); rendering lives in
:mod:`vramplan.report.plan`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vramplan.results import Fallback, MemoryReport
from vramplan.runtime import StepTime
from vramplan.workload import Method, Workload


@dataclass(frozen=True)
class Evaluations:
    """How many memory estimates a search ran, and how many of them were traces."""

    total: int
    traces: int
    analytic: int

    def to_dict(self) -> dict[str, int]:
        return {"total": self.total, "traces": self.traces, "analytic": self.analytic}


def _mem(r: MemoryReport | None) -> dict[str, Any] | None:
    if r is None:
        return None
    w = r.workload
    return {"batch": w.batch, "seq": w.seq, "method": str(r.method), "allocated": r.peak.allocated,
            "reserved": r.peak.reserved, "device_used": r.peak.device_used,
            "fits": bool(r.verdict and r.verdict.fits)}


@dataclass(frozen=True, kw_only=True)
class Boundary:
    """The largest value of one axis (batch or seq) that fits, the other held fixed."""

    axis: str
    """``batch`` or ``seq``."""
    value: int
    """Largest value that fits (0: none does)."""
    fixed: int
    """The other axis's value during this search."""
    step: int
    """Resolution: ``value + step`` was checked not to fit (unless ``limited_by`` says otherwise)."""
    limited_by: str
    """``memory``, ``max_positions`` or ``search limit``."""
    at: MemoryReport | None = None
    """The estimate at ``value`` (fits)."""
    above: MemoryReport | None = None
    """The estimate at ``value + step`` (does not fit)."""

    def to_dict(self) -> dict[str, Any]:
        return {"axis": self.axis, "value": self.value, "fixed": self.fixed, "step": self.step,
                "limited_by": self.limited_by, "at": _mem(self.at), "above": _mem(self.above)}


@dataclass(frozen=True, kw_only=True)
class FitResult:
    model: str
    gpu: str
    gpu_name: str
    usable: int
    """Bytes a process can use on one GPU."""
    num_gpus: int
    workload: Workload
    method: Method
    """The method requested (confirmations); analytic also shapes the search when it can."""
    batch: Boundary
    seq: Boundary | None
    """None for models without a sequence axis (CNNs, ViTs)."""
    evaluations: Evaluations
    notes: tuple[str, ...] = ()
    fallback: Fallback | None = None
    """``method=auto`` could not trace: the boundaries are analytic, with a margin (see notes)."""
    suggestion: str | None = None
    """When not even batch 1 fits at the sequence asked: the cheapest change that fits
    (:mod:`vramplan.planner.nextstep`), as flags and a figure."""

    @property
    def max_batch(self) -> int:
        return self.batch.value

    @property
    def max_seq(self) -> int | None:
        return self.seq.value if self.seq is not None else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "gpu": self.gpu, "gpu_name": self.gpu_name, "usable": self.usable,
            "num_gpus": self.num_gpus, "method": str(self.method), "workload": self.workload.to_dict(),
            "max_batch": self.max_batch, "max_seq": self.max_seq,
            "evaluations": self.evaluations.to_dict(),
            "boundary": {"batch": self.batch.to_dict(), "seq": self.seq.to_dict() if self.seq else None},
            "notes": list(self.notes), "suggestion": self.suggestion,
            "fallback": None if self.fallback is None else {
                "requested": str(self.fallback.requested), "used": str(self.fallback.used),
                "reason": self.fallback.reason},
        }


@dataclass(frozen=True)
class Price:
    usd_per_hour: float
    """For all the GPUs of the plan."""
    source: str
    """How the price is made: the instance, or ``n × per-GPU share of`` an instance."""
    basis: str = ""
    """The listing it rests on: provider, instance, region, source and date read."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """One way to run the workload: a Workload on ``num_gpus`` × ``gpu``, with its cost."""

    workload: Workload
    gpu: str
    gpu_name: str
    num_gpus: int
    changes: tuple[str, ...]
    """What differs from the user's workload, in words (``full checkpointing``)."""
    label: str
    """The configuration in one phrase (``bf16-mixed + full checkpointing, batch 8``)."""
    memory: int
    """Predicted device-used bytes per GPU (nvidia-smi)."""
    allocated: int
    reserved: int
    usable: int
    method: Method
    confirmed: bool
    """True when the memory comes from the requested method (a trace), not the screen."""
    fragmentation: float
    step: StepTime
    price: Price | None = None
    explanation: str = ""
    """One line: the configuration, its memory and its speed against the workload as given."""
    relative: str = ""
    """The speed part alone: ``+31 % step time``."""

    @property
    def fits(self) -> bool:
        return self.memory <= self.usable

    @property
    def headroom(self) -> int:
        return self.usable - self.memory

    @property
    def work_per_s(self) -> float:
        """Tokens/s for sequence models, samples/s otherwise."""
        return self.step.tokens_per_s if self.step.tokens_per_step else self.step.samples_per_s

    @property
    def usd_per_step(self) -> float | None:
        return self.price.usd_per_hour * self.step.total / 3600 if self.price else None

    @property
    def usd_per_mtok(self) -> float | None:
        """Dollars per million tokens (or samples, for non-sequence models)."""
        if not self.price or self.work_per_s <= 0:
            return None
        return self.price.usd_per_hour / 3600 / self.work_per_s * 1e6

    @property
    def gpu_seconds_per_mtok(self) -> float:
        return self.num_gpus / max(self.work_per_s, 1e-30) * 1e6

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label, "explanation": self.explanation, "relative": self.relative,
            "changes": list(self.changes),
            "gpu": self.gpu, "gpu_name": self.gpu_name, "num_gpus": self.num_gpus,
            "memory": self.memory, "allocated": self.allocated, "reserved": self.reserved,
            "usable": self.usable, "fits": self.fits, "headroom": self.headroom,
            "method": str(self.method), "confirmed": self.confirmed,
            "fragmentation": self.fragmentation,
            "step_time": self.step.total, "tokens_per_s": self.step.tokens_per_s,
            "samples_per_s": self.step.samples_per_s, "bound": str(self.step.bound),
            "usd_per_hour": self.price.usd_per_hour if self.price else None,
            "price_source": self.price.source if self.price else None,
            "price_basis": self.price.basis if self.price else None,
            "usd_per_step": self.usd_per_step, "usd_per_mtok": self.usd_per_mtok,
            "workload": self.workload.to_dict(), "runtime": self.step.to_dict(),
        }


@dataclass(frozen=True, kw_only=True)
class PlanResult:
    model: str
    gpu: str
    baseline: Plan
    """The user's workload as given (it may not fit)."""
    plans: tuple[Plan, ...]
    """The Pareto front over memory, time per token and cost, best first by ``sort``."""
    candidates: int
    evaluations: Evaluations
    sort: str
    global_batch: int | None = None
    budget: float | None = None
    notes: tuple[str, ...] = ()

    @property
    def best(self) -> Plan:
        return self.plans[0]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "gpu": self.gpu, "sort": self.sort, "candidates": self.candidates,
            "evaluations": self.evaluations.to_dict(), "global_batch": self.global_batch,
            "budget": self.budget, "baseline": self.baseline.to_dict(),
            "plans": [p.to_dict() for p in self.plans], "notes": list(self.notes),
        }


@dataclass(frozen=True, kw_only=True)
class Offer:
    """Somewhere to run: a cloud instance, or bare catalog GPUs (no price)."""

    label: str
    gpu: str
    count: int
    price: Price | None
    provider: str = ""
    region: str = ""


@dataclass(frozen=True, kw_only=True)
class RankedOffer:
    offer: Offer
    plan: Plan


@dataclass(frozen=True, kw_only=True)
class Ranking:
    model: str
    workload: Workload
    ranked: tuple[RankedOffer, ...]
    """Offers on which some plan fits, best first by ``sort``."""
    not_fitting: tuple[tuple[str, int, int], ...]
    """(offer label, least memory needed per GPU, usable per GPU) where nothing fits."""
    sort: str
    candidates: int
    evaluations: Evaluations
    price_sources: tuple[str, ...]
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "sort": self.sort, "candidates": self.candidates,
            "evaluations": self.evaluations.to_dict(), "workload": self.workload.to_dict(),
            "ranked": [
                {"offer": r.offer.label, "gpu": r.offer.gpu, "count": r.offer.count,
                 "provider": r.offer.provider, "region": r.offer.region, **r.plan.to_dict()}
                for r in self.ranked
            ],
            "not_fitting": [{"offer": o, "needs": n, "usable": u} for o, n, u in self.not_fitting],
            "price_sources": list(self.price_sources), "notes": list(self.notes),
        }
