"""On-demand prices for plans and offers, from :mod:`vramplan.hardware.prices`.

A plan on ``n`` GPUs is priced by an instance with exactly ``n`` of them when one is
listed (the cheapest), else as ``n`` × the cheapest per-GPU price of any instance with
that GPU (and says so). Every price carries its instance, region, source and read date.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from vramplan.errors import PlanError
from vramplan.hardware.gpu import GPU

from .results import Offer, Price


def check_budget(budget: float | None) -> None:
    """``budget`` is None or a finite positive number of dollars per hour (NaN compares false
    with every price, so it would leave every plan out without saying why)."""
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                               or not math.isfinite(budget) or budget <= 0):
        raise PlanError(f"`budget` must be a positive, finite number of dollars per hour, got {budget}",
                        hint="e.g. `budget=10` for $10/h", field="budget")


def load_instances() -> list[Any]:
    from vramplan.hardware.prices import list_instances

    return list(list_instances())


def _source(i: Any) -> str:
    return f"{i.provider} {i.name} ({i.region}), {i.source}, read {i.date_read}"


def plan_price(gpu: GPU, n: int, instances: Sequence[Any]) -> Price | None:
    rows = [i for i in instances if i.gpu == gpu.key]
    if not rows:
        return None
    exact = [i for i in rows if i.count == n]
    if exact:
        best = min(exact, key=lambda i: i.usd_per_hour)
        return Price(float(best.usd_per_hour), f"{best.provider} {best.name} at ${best.usd_per_hour:g}/h",
                     _source(best))
    best = min(rows, key=lambda i: i.usd_per_hour / i.count)
    per = best.usd_per_hour / best.count
    return Price(per * n, f"{n} × ${per:.3g}/GPU-h, the per-GPU share of {best.provider} {best.name}",
                 _source(best))


def priced_gpus(instances: Sequence[Any]) -> list[str]:
    return sorted({i.gpu for i in instances})


def offers(gpus: Sequence[GPU], instances: Sequence[Any]) -> list[Offer]:
    """Every instance, plus each catalog GPU ×1 that no single-GPU instance offers (unpriced)."""
    by_key = {g.key: g for g in gpus}
    out = [
        Offer(label=f"{i.provider} {i.name}", gpu=i.gpu, count=int(i.count),
              price=Price(float(i.usd_per_hour), f"{i.provider} {i.name} at ${i.usd_per_hour:g}/h", _source(i)),
              provider=i.provider, region=i.region)
        for i in instances if i.gpu in by_key
    ]
    single = {i.gpu for i in instances if i.count == 1}
    out += [Offer(label=f"{g.key} ×1 (no listed price)", gpu=g.key, count=1, price=None)
            for g in gpus if g.key not in single]
    return out


def source_lines(instances: Sequence[Any]) -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for i in instances:
        seen.setdefault(f"{i.provider}: {i.source}, read {i.date_read}")
    return tuple(seen)
