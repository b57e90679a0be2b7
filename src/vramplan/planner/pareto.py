"""Pareto front over objectives to minimise, and the orders plans are shown in."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeVar

from vramplan.workload import Peft, Precision, Quant, Workload

from .results import Plan

T = TypeVar("T")

SORTS = ("speed", "cost", "memory")


def pareto_front(items: Sequence[T], key: Callable[[T], tuple[float, ...]],
                 tiebreak: Callable[[T], float] | None = None) -> list[T]:
    """Items not dominated by another (≤ in every objective, < in one). Keeps input order.

    Of items with equal objectives only one is kept: the least by ``tiebreak``.
    """
    keys = [key(i) for i in items]
    tb = [tiebreak(i) if tiebreak else 0.0 for i in items]
    order = sorted(range(len(items)), key=lambda i: (keys[i], tb[i]))
    front: list[int] = []
    for i in order:
        ki = keys[i]
        dominated = any(
            all(a <= b for a, b in zip(keys[j], ki, strict=True)) and keys[j] != ki for j in front
        )
        if not dominated and all(keys[j] != ki for j in front):
            front.append(i)
    keep = set(front)
    return [items[i] for i in range(len(items)) if i in keep]


def time_per_work(p: Plan) -> float:
    """Seconds per token (or sample) over all GPUs: step time at a fixed global batch."""
    return 1.0 / max(p.work_per_s, 1e-30)


def cost_metric(p: Plan) -> float:
    """Dollars per million tokens, or GPU-seconds per million when no price is known."""
    c = p.usd_per_mtok
    return c if c is not None else p.gpu_seconds_per_mtok


def objectives(p: Plan, base: Workload | None = None) -> tuple[float, ...]:
    """Memory per GPU (to 1/4 GiB), time per token and cost per token (to 1 %): differences
    below the resolution of the models are not worth a more complex plan. With ``base``,
    also how much the plan changes the job itself (:func:`job_changes`), so that a plan
    that keeps the user's precision is not hidden by a faster pure-bf16 one."""
    core = (round(p.memory / 2**28), _pct_bucket(time_per_work(p)), _pct_bucket(cost_metric(p)))
    return core if base is None else (*core, float(job_changes(base, p.workload)))


def job_changes(base: Workload, w: Workload) -> int:
    """Changes that alter what is trained, not only how: dropping fp32 master weights
    (pure 16-bit), training adapters instead of the model (PEFT), and quantising the base
    weights (QLoRA computes with 4-bit approximations of them: one more change than LoRA)."""
    pure = (Precision.BF16, Precision.FP16)
    n = int(w.training and base.precision not in pure and w.precision in pure)
    n += int(base.quant is Quant.NONE and w.quant is not Quant.NONE)
    return n + int(base.peft is Peft.NONE and w.peft is not Peft.NONE)


def complexity(p: Plan) -> float:
    """How many settings a plan changes: the tie-break between plans with equal objectives."""
    return float(len(p.changes))


def _pct_bucket(x: float) -> float:
    return round(math.log(x) / math.log(1.01)) if x > 0 else -math.inf


def sort_key(sort: str) -> Callable[[Plan], tuple[float, ...]]:
    if sort == "speed":
        return lambda p: (time_per_work(p), cost_metric(p), p.memory)
    if sort == "cost":
        return lambda p: (p.usd_per_mtok if p.usd_per_mtok is not None else float("inf"),
                          p.gpu_seconds_per_mtok, time_per_work(p), p.memory)
    if sort == "memory":
        return lambda p: (p.memory, time_per_work(p))
    raise ValueError(f"unknown sort {sort!r}; choose one of {', '.join(SORTS)}")
