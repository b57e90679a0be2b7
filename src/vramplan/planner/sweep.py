"""Memory against batch size or sequence length: the data behind ``fit --plot`` and ``plan --plot``.

:func:`sweep` evaluates one workload at several batch sizes (or sequence lengths) with the
analytic method (milliseconds a point), on one or more GPUs. Where traced estimates of the
same workload are known (a fit's confirmations, a plan's confirmed finalist), the analytic
curve is calibrated to them — traced reserved ≈ α + β × analytic reserved, the GPU's
overhead outside the allocator on top — and the traced points are kept as markers, so a
plot shows the curve and the evidence it was fitted to. :func:`fit_sweeps`,
:func:`plan_sweep` and :func:`rank_sweep` build the sweeps of a fit, a plan and a GPU
ranking. Bytes are predicted device used per GPU (nvidia-smi), as in the rest of the planner.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from vramplan.errors import PlanError
from vramplan.hardware.gpu import GPU
from vramplan.models.spec import Family, ModelSpec
from vramplan.results import MemoryReport
from vramplan.workload import Method, Task, Workload, as_enum

from ..engine.boundary import MAX_BATCH, fits
from ..engine.calibration import line
from .evaluator import Estimator, default_estimator
from .fit import NO_SEQ_FAMILIES
from .results import Boundary, FitResult, Plan, PlanResult, Ranking

AXES = ("batch", "seq")
SEQ_START = 128
"""Shortest sequence of a default sequence sweep (fewer when the model allows fewer)."""
PLAN_SERIES = 5
RANK_SERIES = 6
TRACED = "traced"
"""Marker name of the traced points a sweep was calibrated to."""


@dataclass(frozen=True)
class Sweep:
    """Predicted device-used bytes per GPU against one axis, the other held fixed."""

    model: str
    axis: str
    """``batch`` (micro-batch per GPU) or ``seq`` (tokens)."""
    fixed: int
    """The other axis's value (the sequence length of a batch sweep, and vice versa); 0 where
    there is none (models without a sequence axis) or it differs between the series."""
    series: Mapping[str, tuple[tuple[int, int], ...]]
    """Label → (x, bytes), x increasing: one per workload, or per GPU where the GPU's
    overhead (CUDA context, NCCL) makes the curves differ."""
    capacities: Mapping[str, int]
    """``<GPU> usable`` → usable bytes per GPU (:func:`vramplan.hardware.catalog.usable_capacity`)."""
    markers: Mapping[str, tuple[tuple[int, int], ...]]
    """Points that are not on a computed curve: traced estimates, boundaries, plans. A role
    that has no point here has an empty entry, so that each role keeps its symbol."""
    method: Method
    """How the curve points were computed."""
    paired: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Series → the capacity it is measured against, where each curve has its own GPU."""
    calibration: tuple[float, float] | None = None
    """(α, β) of traced reserved ≈ α + β × analytic reserved, when the curve was calibrated."""
    notes: tuple[str, ...] = ()

    @property
    def x_label(self) -> str:
        if self.axis == "batch":
            return "micro-batch size per GPU" + (f" (sequence length {self.fixed:,})" if self.fixed else "")
        return "sequence length, tokens" + (f" (batch {self.fixed:,})" if self.fixed else "")


@dataclass(frozen=True)
class _Anchor:
    """A known (usually traced) estimate of one point of the curve."""

    workload: Workload
    reserved: int
    device_used: int


def _anchor(r: MemoryReport | Plan) -> _Anchor:
    if isinstance(r, Plan):
        return _Anchor(r.workload, r.reserved, r.memory)
    return _Anchor(r.workload, r.peak.reserved, r.peak.device_used)


# --------------------------------------------------------------------------- the sweep
def sweep(
    model: str | ModelSpec, w: Workload, *, gpus: Sequence[GPU | str], axis: str,
    values: Sequence[int] | None = None, method: str | Method = Method.ANALYTIC, label: str | None = None,
    traced: Sequence[MemoryReport | Plan] = (), boundary: int | None = None, also: Sequence[int] = (),
    estimator: Estimator | None = None,
) -> Sweep:
    """``w``'s memory per GPU at each of ``values`` of ``axis`` (``batch`` or ``seq``) on ``gpus``.

    ``values``: default powers of two (batch from 1, sequence from 128) up to twice the
    largest that fits the largest GPU (``boundary`` when known), plus the boundary, the one
    above it, ``w``'s own value and ``also``. ``traced``: estimates of ``w`` at values of the axis,
    made with the trace method (others are ignored): the analytic curve is calibrated to
    them and they become the ``traced`` markers. Without analytic formulas for the model,
    the curve joins them.
    """
    from vramplan.engine import resolve_gpu, resolve_model

    if axis not in AXES:
        raise PlanError(f"unknown sweep axis {axis!r}", hint="use batch or seq")
    spec = resolve_model(model)
    if axis == "seq" and spec.family in NO_SEQ_FAMILIES:
        raise PlanError(f"{spec.name} has no sequence axis", hint="sweep the batch instead")
    gs = [g for g in (resolve_gpu(x) for x in gpus) if g is not None]
    if not gs:
        raise PlanError("a sweep needs at least one GPU")
    m = as_enum(Method, method, "method")
    est = estimator or default_estimator()
    run = _Runner(spec, w, axis, m, est)
    fixed = (0 if spec.family in NO_SEQ_FAMILIES else w.seq) if axis == "batch" else w.batch
    on_axis = [r for r in traced if r.method is Method.TRACE and _on_axis(r.workload, w, axis)]
    kept = [_anchor(r) for r in on_axis]  # a traced report is what the step needs, even over capacity
    notes: list[str] = []
    capacities = {f"{short_gpu(g.name)} usable": _usable(g) for g in gs}
    markers = {TRACED: _points(kept, axis)} if kept else {}

    if not run.has_curve():
        if not kept:
            raise PlanError(f"no analytic formulas for {spec.name}, and no traced points to plot",
                            hint="sweep with method='trace'")
        notes.append(f"no analytic formulas for {spec.name}: the line joins the traced points")
        return Sweep(model=spec.name, axis=axis, fixed=fixed, series={"traced (no analytic formulas)": _points(kept, axis)},
                     capacities=capacities, markers=markers, method=Method.TRACE, notes=tuple(notes))

    xs = _values(run, spec, w, axis, values, boundary, gs, [*also, *(getattr(a.workload, axis) for a in kept)])
    cal = _calibration(run, kept) if run.method is Method.ANALYTIC else None
    per_gpu: dict[str, tuple[tuple[int, int], ...]] = {}
    paired: dict[str, str] = {}
    for g in gs:
        pts = []
        for x in xs:
            r = run.report(x, g)
            over = r.peak.device_used - r.peak.reserved
            reserved = r.peak.reserved if cal is None else round(cal[0] + cal[1] * r.peak.reserved)
            pts.append((x, int(reserved) + over))
        per_gpu[short_gpu(g.name)] = tuple(pts)
    name = label or spec.name
    curves = list(per_gpu.values())
    if all(c == curves[0] for c in curves):
        series = {name: curves[0]}
    else:
        series = {f"{name} on {gname}": c for gname, c in per_gpu.items()}
        paired = {f"{name} on {gname}": f"{gname} usable" for gname in per_gpu}
        notes.append("one curve per GPU: their CUDA context and library overheads differ")
    if cal is not None:
        notes.append(f"analytic curve calibrated to {len(markers[TRACED])} traced point(s): "
                     f"reserved ≈ {cal[0] / 2**30:+.3f} GiB + {cal[1]:.3f} × analytic reserved")
    return Sweep(model=spec.name, axis=axis, fixed=fixed, series=series, capacities=capacities,
                 markers=markers, method=run.method, paired=paired, calibration=cal, notes=tuple(notes))


def _on_axis(x: Workload, w: Workload, axis: str) -> bool:
    """``x`` is ``w`` but for the swept field."""
    return x.replace(**{axis: getattr(w, axis)}) == w


def _points(anchors: Sequence[_Anchor], axis: str) -> tuple[tuple[int, int], ...]:
    by_x = {getattr(a.workload, axis): a.device_used for a in anchors}
    return tuple(sorted(by_x.items()))


class _Runner:
    """Cached estimates of ``w`` along the axis, with the sweep's method."""

    def __init__(self, spec: ModelSpec, w: Workload, axis: str, method: Method, est: Estimator) -> None:
        self.spec, self.w, self.axis, self.method, self.est = spec, w, axis, method, est
        self._cache: dict[tuple[int, str], MemoryReport] = {}

    def workload(self, x: int) -> Workload:
        return self.w.replace(**{self.axis: x})

    def report(self, x: int, g: GPU) -> MemoryReport:
        key = (x, g.key)
        if key not in self._cache:
            self._cache[key] = self.est(self.spec, self.workload(x), gpu=g, method=str(self.method),
                                        num_gpus=self.w.parallel.world_size, search_max_batch=False)
        return self._cache[key]

    def analytic_reserved(self, w: Workload) -> int:
        r = self.est(self.spec, w, gpu=None, method=str(Method.ANALYTIC), num_gpus=w.parallel.world_size,
                     search_max_batch=False)
        return r.peak.reserved

    def has_curve(self) -> bool:
        """Whether the method can estimate this model (a workload it rejects is the user's to fix)."""
        return self.method is not Method.ANALYTIC or self.spec.family is not Family.OTHER


def _calibration(run: _Runner, anchors: Sequence[_Anchor]) -> tuple[float, float] | None:
    """(α, β) of traced reserved ≈ α + β × analytic reserved: the engine's one calibration
    (:func:`vramplan.engine.calibration.line`) through the traced points."""
    return line([(float(run.analytic_reserved(a.workload)), float(a.reserved)) for a in anchors])


# --------------------------------------------------------------------------- default values
def _limit(spec: ModelSpec, w: Workload, axis: str) -> int:
    if axis == "batch":
        return MAX_BATCH
    cap = spec.max_positions or (1 << 20)
    if w.task is Task.GENERATE:
        cap -= w.new_tokens
    return max(cap, 1)


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _values(run: _Runner, spec: ModelSpec, w: Workload, axis: str, values: Sequence[int] | None,
            boundary: int | None, gs: Sequence[GPU], extra: Sequence[int]) -> list[int]:
    limit = _limit(spec, w, axis)
    if values is not None:
        bad = [v for v in values if not isinstance(v, int) or v < 1]
        if bad or not values:
            raise PlanError(f"sweep values must be positive integers, got {list(values)!r}")
        if max(values) > limit:
            raise PlanError(f"{axis} {max(values):,} is above the limit of {limit:,} for {spec.name}")
        return sorted(set(values) | set(extra))
    start = 1 if axis == "batch" else min(SEQ_START, _pow2_floor(limit), _pow2_floor(boundary or SEQ_START))
    if boundary is None:
        boundary = _largest_fitting(run, start, limit, gs, exact=axis == "batch" and run.method is Method.ANALYTIC)
    top = min(limit, max(2 * boundary, 2 * start))
    xs = {start << k for k in range(64) if start << k <= top}
    xs |= {v for v in (boundary, boundary + 1 if axis == "batch" else None, getattr(w, axis), top)
           if v is not None and 1 <= v <= limit}
    xs |= {v for v in extra if v <= limit}
    return sorted(xs)


def _largest_fitting(run: _Runner, start: int, limit: int, gs: Sequence[GPU], *, exact: bool) -> int:
    """The largest value that fits the largest GPU: doubling until the curve is over, then
    (``exact``) bisection; else the power of two below."""
    g = max(gs, key=_usable)
    usable = _usable(g)

    def fits_at(x: int) -> bool:
        return fits(run.report(x, g), usable)

    lo, hi = start, start
    while hi < limit and fits_at(hi):
        lo, hi = hi, min(hi * 2, limit)
    if hi >= limit and fits_at(limit):
        return limit
    if not exact:
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits_at(mid) else (lo, mid)
    return lo


def _usable(g: GPU) -> int:
    from vramplan.hardware.catalog import usable_capacity

    return int(usable_capacity(g)[0])


def short_gpu(name: str) -> str:
    """``NVIDIA GeForce RTX 4090`` → ``RTX 4090``, ``NVIDIA GH200 Grace Hopper (144GB HBM3e)``
    → ``GH200 Grace Hopper`` (legends)."""
    for word in ("NVIDIA ", "GeForce ", "Tesla "):
        name = name.replace(word, "")
    return re.sub(r"\s*\([^)]*\)", "", name).strip() or name


# --------------------------------------------------------------------------- fit, plan, ranking
def fit_sweeps(
    model: str | ModelSpec, result: FitResult, *, reports: Sequence[MemoryReport] = (),
    gpu: GPU | None = None, estimator: Estimator | None = None,
) -> tuple[Sweep, Sweep | None]:
    """The batch sweep (at the fit's sequence length) and the sequence sweep (at its batch; None
    for models without one) of a fit, calibrated to its traced estimates (``reports``: every
    estimate the search made, when the caller recorded them; the boundaries' own are always
    used), with the boundary found and the step above it marked. ``gpu``: the fit's GPU
    (default: the catalog's ``result.gpu``)."""
    from vramplan.engine import resolve_gpu

    g = gpu or resolve_gpu(result.gpu)
    if g is None:
        raise PlanError("a fit result without a GPU")

    def one(b: Boundary) -> Sweep:
        w = result.workload.replace(**{"seq" if b.axis == "batch" else "batch": b.fixed})
        known = [r for r in (*reports, b.at, b.above) if r is not None and r.method is Method.TRACE]
        label = "predicted (analytic, calibrated to the traces)" if known else "predicted (analytic)"
        s = sweep(model, w, gpus=[g], axis=b.axis, traced=known, boundary=max(b.value, 1), label=label,
                  also=[b.value + b.step] if b.limited_by == "memory" else [], estimator=estimator)
        return _mark_boundary(s, b)

    return one(result.batch), (one(result.seq) if result.seq is not None else None)


def _mark_boundary(s: Sweep, b: Boundary) -> Sweep:
    """The traced points of the search, the largest value that fits and the step above it."""
    ends = {b.value if b.at is not None else None,
            getattr(b.above.workload, s.axis) if b.above is not None else None}
    markers: dict[str, tuple[tuple[int, int], ...]] = {}
    markers["traced (search)"] = tuple(p for p in s.markers.get(TRACED, ()) if p[0] not in ends)
    why = {"max_positions": ", the model's max positions", "search limit": ", the search limit"}
    fits = f"largest that fits: {b.axis} {b.value:,}{why.get(b.limited_by, '')}"
    markers[fits + (f" ({b.at.method})" if b.at is not None else "")] = (
        ((b.value, b.at.peak.device_used),) if b.at is not None else ())
    x = getattr(b.above.workload, s.axis) if b.above is not None else b.value + b.step
    markers[f"does not fit: {b.axis} {x:,}" + (f" ({b.above.method})" if b.above is not None else "")] = (
        ((x, b.above.peak.device_used),) if b.above is not None else ())
    return dataclasses.replace(s, markers=markers)


def _short_plan(p: Plan) -> str:
    return p.label.rsplit(", batch ", 1)[0]


def plan_sweep(model: str | ModelSpec, result: PlanResult, *, top: int = PLAN_SERIES, gpu: GPU | None = None,
               estimator: Estimator | None = None) -> Sweep:
    """Memory against micro-batch for the best ``top`` plans of the front (one curve per
    configuration, numbered as in the table), each plan's own batch marked. ``gpu``: the
    plan's GPU (default: the catalog's ``result.gpu``)."""
    from vramplan.engine import resolve_gpu

    g = gpu or resolve_gpu(result.gpu)
    if g is None:
        raise PlanError("a plan result without a GPU")
    chosen: list[tuple[int, Plan]] = []
    seen: set[Workload] = set()
    for i, p in enumerate(result.plans, 1):
        key = p.workload.replace(batch=1, grad_accum=1, objective="sft", generations=8)
        if key in seen:
            continue
        seen.add(key)
        chosen.append((i, p))
        if len(chosen) >= top:
            break
    return _merge(model, [(f"{i}. {_short_plan(p)}", p, g) for i, p in chosen], "each plan's micro-batch",
                  estimator, pair=False)


def rank_sweep(model: str | ModelSpec, ranking: Ranking, *, top: int = RANK_SERIES,
               gpus: Sequence[GPU] = (), estimator: Estimator | None = None) -> Sweep:
    """Memory against micro-batch on the best ``top`` GPU types of a ranking: each one's best
    plan, with that GPU's usable capacity. ``gpus``: the GPUs ranked, where not the catalog's."""
    from vramplan.hardware.catalog import get_gpu

    by_key = {g.key: g for g in gpus}
    chosen: list[tuple[str, Plan, GPU]] = []
    seen: set[str] = set()
    for r in ranking.ranked:
        p = r.plan
        if p.gpu in seen:
            continue
        seen.add(p.gpu)
        n = f" ×{p.num_gpus}" if p.num_gpus > 1 else ""
        chosen.append((f"{short_gpu(p.gpu_name)}{n}: {_short_plan(p)}", p, by_key.get(p.gpu) or get_gpu(p.gpu)))
        if len(chosen) >= top:
            break
    if not chosen:
        raise PlanError("nothing to plot: no GPU in the ranking")
    return _merge(model, chosen, "each GPU's plan", estimator, pair=True)


def _merge(model: str | ModelSpec, items: Sequence[tuple[str, Plan, GPU]], mark: str,
           estimator: Estimator | None, *, pair: bool) -> Sweep:
    """One batch sweep per (label, plan, GPU), merged into one figure's data (``pair``: each
    curve with its own GPU's capacity)."""
    series: dict[str, tuple[tuple[int, int], ...]] = {}
    capacities: dict[str, int] = {}
    paired: dict[str, str] = {}
    points: list[tuple[int, int]] = []
    notes: list[str] = []
    method = Method.ANALYTIC
    sweeps = []
    for label, p, g in items:
        known = [p] if p.method is Method.TRACE else []
        s = sweep(model, p.workload, gpus=[g], axis="batch", label=label, traced=known, estimator=estimator)
        sweeps.append(s)
        series.update(s.series)
        capacities.update(s.capacities)
        if pair:
            paired.update({name: cap for name in s.series for cap in s.capacities})
        points.append((p.workload.batch, p.memory))
        method = s.method
        notes += [n for n in s.notes if n not in notes]
    seqs = {s.fixed for s in sweeps}
    return Sweep(model=sweeps[0].model, axis="batch", fixed=sweeps[0].fixed if len(seqs) == 1 else 0,
                 series=series, capacities=capacities, markers={mark: tuple(points)}, method=method,
                 paired=paired, notes=tuple(notes))


__all__ = ["Sweep", "sweep", "fit_sweeps", "plan_sweep", "rank_sweep", "short_gpu"]
