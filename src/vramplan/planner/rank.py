"""Rank every catalog GPU and cloud instance on which the workload fits.

Each offer (an instance with its GPU count, or a bare catalog GPU) gets its best plan from
the same search space as :func:`vramplan.planner.plan.plan`, restricted to its GPU count.
Memory is screened once per workload variant (GPU-agnostic analytic estimate + each
GPU's own overhead), so forty GPUs cost little more than one; the top offers are then
confirmed with the requested method on their GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from vramplan.errors import PlanError, VramplanError
from vramplan.hardware.gpu import GPU
from vramplan.models.spec import ModelSpec
from vramplan.units import GiB
from vramplan.workload import Method, Workload, as_enum

from .evaluator import Estimator, Evaluator, Screen
from .pareto import SORTS, complexity, job_changes, sort_key
from .plan import PlanBuilder, Progress, caveats, screen_method
from .pricing import check_budget, load_instances, offers, source_lines
from .results import Offer, Plan, RankedOffer, Ranking
from .space import Candidate, candidates


def rank_gpus(
    model: str | ModelSpec, workload: Workload | None = None, *, gpus: Sequence[GPU] | None = None,
    instances: Sequence[Any] | None = None, max_gpus: int = 8, allow_peft: bool = False,
    global_batch: int | None = None, budget: float | None = None, method: str | Method = Method.AUTO,
    alloc_conf: str | None = None, sort: str = "cost", confirm: int = 3,
    estimator: Estimator | None = None, progress: Progress | None = None, screen: Screen | None = None,
) -> Ranking:
    """Offers on which some plan fits, best first by ``sort`` (cost: $/M tokens; speed; memory)."""
    from vramplan.engine import resolve_model

    if sort not in SORTS:
        raise PlanError(f"unknown sort {sort!r}", hint=f"choose one of {', '.join(SORTS)}")
    spec = resolve_model(model)
    w = workload or Workload()
    m = as_enum(Method, method, "method")
    check_budget(budget)
    insts = list(instances) if instances is not None else load_instances()
    pool = list(gpus) if gpus is not None else _catalog()
    by_key = {g.key: g for g in pool}
    ev = screen.ev if screen is not None else Evaluator(spec, alloc_conf=alloc_conf, estimator=estimator)
    sc = screen or Screen(ev, screen_method(ev, w, m))
    notes: list[str] = []
    todo = [o for o in offers(pool, insts) if o.count <= max_gpus]
    skipped = len(offers(pool, insts)) - len(todo)
    if skipped:
        notes.append(f"{skipped} offer(s) with more than {max_gpus} GPUs left out (raise `max_gpus`)")
    if budget is not None:
        before = len(todo)
        todo = [o for o in todo if o.price is not None and o.price.usd_per_hour <= budget]
        notes.append(f"{before - len(todo)} offer(s) above ${budget:.2f}/h or without a price left out")
        if not todo:
            cheapest = min((o for o in offers(pool, insts) if o.price), key=lambda o: o.price.usd_per_hour, default=None)  # type: ignore[union-attr]
            raise PlanError(f"no offer costs at most ${budget:.2f}/h",
                            hint=f"the cheapest listed is {cheapest.label} at ${cheapest.price.usd_per_hour:.2f}/h"  # type: ignore[union-attr]
                            if cheapest else "no prices are listed")

    ranked: list[RankedOffer] = []
    misses: list[tuple[str, int, int]] = []
    n_cands = 0
    for i, o in enumerate(todo):
        g = by_key[o.gpu]
        builder = PlanBuilder(spec, w, g, m, sc, insts, None)
        try:
            cands = candidates(w, g, counts=[o.count], allow_peft=allow_peft, global_batch=global_batch,
                               compact=sc.method is not Method.ANALYTIC)
        except PlanError:
            continue
        n_cands += len(cands)
        best, least = _best(builder, cands, o, sort)
        if best is not None:
            ranked.append(RankedOffer(offer=o, plan=best))
        elif least is not None:
            misses.append((o.label, least[0], least[1]))
        if progress is not None:
            progress("screen", i + 1, len(todo))
    ranked.sort(key=lambda r: sort_key(sort)(r.plan))
    ranked = _confirm(ranked, by_key, spec, w, m, sc, insts, confirm, progress)
    if not ranked:
        need = min(misses, key=lambda x: x[1] - x[2]) if misses else None
        raise PlanError(
            "the workload fits on no catalog GPU or instance"
            + (f" — nearest: {need[0]} needs {need[1] / GiB:.1f} GiB per GPU of {need[2] / GiB:.1f}" if need else ""),
            hint="add `allow_peft`, raise `max_gpus`, or shorten `seq`",
        )
    ranked = [RankedOffer(offer=r.offer, plan=replace(r.plan, explanation=_line(r.plan))) for r in ranked]
    notes += caveats(w, [r.plan for r in ranked])
    notes.append("prices are on-demand list prices; a bare GPU has none (own hardware) and ranks by speed")
    return Ranking(
        model=spec.name, workload=w, ranked=tuple(ranked), not_fitting=tuple(misses), sort=sort,
        candidates=n_cands, evaluations=ev.counts(), price_sources=source_lines(insts), notes=tuple(notes),
    )


def _catalog() -> list[GPU]:
    from vramplan.hardware.catalog import list_gpus

    return list(list_gpus())


def _best(builder: PlanBuilder, cands: list[Candidate], o: Offer, sort: str) -> tuple[Plan | None, tuple[int, int] | None]:
    """The best fitting plan on one offer (one that keeps the job as given when any does),
    or the least memory needed when none fits."""
    sc, g = builder.screen, builder.gpu
    usable = sc.usable(g)
    fitting: list[Candidate] = []
    least: int | None = None
    for c in cands:
        try:
            used = sc.device_used(c.workload, g)
        except VramplanError:
            continue
        if used <= usable:
            fitting.append(c)
        least = used if least is None else min(least, used)
    if not fitting:
        return None, (least, usable) if least is not None else None
    plans = [builder.make(c, sc.report(c.workload), price=o.price) for c in fitting]
    key = sort_key(sort)
    # the user's own job where it fits (mixed precision stays mixed, no PEFT unless given)
    return min(plans, key=lambda p: (job_changes(builder.w, p.workload), key(p), complexity(p))), None


def _confirm(ranked: list[RankedOffer], by_key: dict[str, GPU], spec: ModelSpec, w: Workload, m: Method, sc: Screen,
             insts: Sequence[Any], k: int, progress: Progress | None) -> list[RankedOffer]:
    if m is Method.ANALYTIC or k <= 0:
        return ranked
    out: list[RankedOffer] = []
    done = 0
    for r in ranked:
        if done >= k:
            out.append(r)
            continue
        done += 1
        if progress is not None:
            progress("confirm", done, min(k, len(ranked)))
        g = by_key[r.offer.gpu]
        builder = PlanBuilder(spec, w, g, m, sc, insts, None)
        rep = sc.ev.report(r.plan.workload, gpu=g, method=m)
        q = builder.make(Candidate(r.plan.workload, r.plan.num_gpus), rep, confirmed=True, price=r.plan.price)
        if q.fits:
            out.append(RankedOffer(offer=r.offer, plan=q))
    return out


def _line(p: Plan) -> str:
    return f"{p.label}: {p.memory / GiB:.1f} GiB per GPU"
