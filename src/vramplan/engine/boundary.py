"""The one boundary search: the largest batch (or sequence) that fits a GPU.

Used by :func:`vramplan.estimate`'s verdict, ``fit``, ``plan`` and the sweeps, so that the
same workload gets the same largest batch everywhere.

Memory is monotone in batch and sequence length. When the analytic method knows the model,
its curve — milliseconds per point — gives the shape: the search finds its boundary,
confirms it with the requested method (one evaluation at the boundary, one a step above),
and, if they disagree, recalibrates the analytic curve to the confirmed points
(:class:`~vramplan.engine.calibration.Calibration`) and tries again. Without an analytic
curve, a secant (or parabola) through the evaluations predicts the boundary. Either way
:func:`boundary_search` keeps a bracket, so a wrong prediction costs one more evaluation,
and a run of wrong ones falls back to bisection (never more than O(log range) evaluations).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..results import MemoryReport
from ..workload import Method, Workload
from .calibration import Calibration

MAX_BATCH = 1 << 16
"""The largest micro-batch any search considers."""

Predictor = Callable[[Mapping[int, int]], float | None]
"""Given {x: memory} so far, the predicted largest fitting x (None: no idea)."""


@dataclass(frozen=True)
class SearchResult:
    """The largest fitting grid point of a boundary search, with what was evaluated."""

    value: int
    """Largest grid point that fits; ``lo - step`` (normally 0) when none does."""
    above: int | None
    """The grid point above ``value`` that was evaluated and does not fit (None at ``hi``)."""
    samples: Mapping[int, int]
    """Evaluations with an exact memory figure: x → memory."""


def fits(r: MemoryReport, usable: int) -> bool:
    """The one rule for "this estimate fits", for the verdict and every search: what the step
    needs on the device (device_used; a traced step replayed without a memory limit) is
    within the GPU's usable bytes. A step that would run only by the allocator freeing its
    cache and retrying at the limit does not count as fitting, nor one a framework refuses to
    start on this GPU (the verdict's ``refused``). A run spread over several GPUs (a device map)
    fits when its fullest GPU does."""
    return r.device_used_worst <= usable and not (r.verdict is not None and r.verdict.refused)


class BoundarySearch:
    """Searches along one axis of a workload, confirming with one method.

    ``confirm(w)``: the method's report of ``w`` on the GPU (cached by the caller).
    ``analytic(w)``: the analytic device_used of ``w`` on the GPU (None where the formulas
    refuse it), or None for no analytic curve (the search then predicts by secant).
    """

    def __init__(self, confirm: Callable[[Workload], MemoryReport],
                 analytic: Callable[[Workload], int | None] | None, usable: int, *,
                 exact: bool = False) -> None:
        self.confirm = confirm
        self.analytic = _memo(analytic) if analytic is not None else None
        self.usable = usable
        self.exact = exact and analytic is not None
        """The confirming method is the analytic curve itself: search it, nothing to confirm."""
        self.cal = Calibration(usable)
        self.ahead = 0
        """Confirmations run ahead in forked processes (:class:`_Ahead`)."""

    @property
    def shaped(self) -> bool:
        return self.analytic is not None

    def _pair(self, w: Workload, r: MemoryReport) -> None:
        if r.method is Method.ANALYTIC or self.analytic is None:
            return
        a = self.analytic(w)
        if a is not None:
            self.cal.add(a, r.peak.device_used)

    def evaluator(self, make: Callable[[int], Workload], step: int = 1,
                  hi: int | None = None) -> Callable[[int], tuple[int | None, bool]]:
        ahead = _Ahead(self.confirm, self)

        def evaluate(x: int) -> tuple[int | None, bool]:
            wx = make(x)
            ahead.claim(wx)
            nxt = x + step  # (a search ends by confirming the step above its boundary)
            cancel = ahead.before_trace(make(nxt)) if hi is None or nxt <= hi else None
            try:
                r = self.confirm(wx)
            finally:
                if cancel is not None:
                    cancel()
            self._pair(wx, r)
            return r.peak.device_used, fits(r, self.usable)

        evaluate.close = ahead.close  # type: ignore[attr-defined]
        return evaluate

    def predictor(self, make: Callable[[int], Workload], lo: int, hi: int, step: int,
                  quadratic: bool, start: int) -> Predictor:
        analytic = self.analytic
        if analytic is None:
            return secant_predictor(self.usable, quadratic=quadratic)

        def predict(_samples: Mapping[int, int]) -> float | None:
            limit = self.cal.threshold()

            def on_curve(x: int) -> tuple[int | None, bool]:
                used = analytic(make(x))
                return used, used is not None and used <= limit

            res = boundary_search(on_curve, first=max(start, lo), lo=lo, hi=hi, step=step,
                                  predict=secant_predictor(int(limit), quadratic=quadratic))
            return float(res.value)

        return predict

    def search(self, make: Callable[[int], Workload], *, lo: int, hi: int, step: int = 1,
               quadratic: bool = False, start: int) -> SearchResult:
        """Largest ``x`` on the grid ``lo, lo+step, …, hi`` whose ``make(x)`` fits."""
        analytic = self.analytic
        if self.exact and analytic is not None:
            def on_curve(x: int) -> tuple[int | None, bool]:
                used = analytic(make(x))
                return used, used is not None and used <= self.usable

            return boundary_search(on_curve, first=min(max(start, lo), hi), lo=lo, hi=hi, step=step,
                                   predict=secant_predictor(self.usable, quadratic=quadratic))
        predict = self.predictor(make, lo, hi, step, quadratic, start)
        guess = predict({}) if self.shaped else None
        first = int(guess) if guess is not None and guess >= lo else start
        evaluate = self.evaluator(make, step, hi)
        try:
            return boundary_search(evaluate, first=first, lo=lo, hi=hi, step=step, predict=predict)
        finally:
            evaluate.close()  # type: ignore[attr-defined]

    def largest_batch(self, w: Workload, max_batch: int = MAX_BATCH) -> SearchResult:
        step = w.batch_step  # (GRPO: batches that hold whole groups of generations)
        hi = max(step, max_batch - max_batch % step)
        return self.search(lambda b: w.replace(batch=b), lo=step, hi=hi, step=step, start=min(w.batch, hi))


class _Ahead:
    """The step above a point confirmed in a forked child while this process confirms the point
    (a search that finds its boundary confirms both, one after the other): forked when this
    process first traces for the point (torch and the model's code imported, which the child
    inherits), its trace and replay written to the on-disk store, which this process's own
    confirmation of that step then reads. The search runs exactly as one after another; only
    sooner. Nothing is forked where the store is off, a single CPU is free, or the point is
    answered without a trace; a step never asked for is stopped at the end of the search."""

    def __init__(self, confirm: Callable[[Workload], MemoryReport], search: BoundarySearch) -> None:
        self.confirm = confirm
        self.search = search
        self.pending: dict[Workload, object] = {}

    def before_trace(self, w: Workload) -> Callable[[], None] | None:
        from . import cache, store

        if w in self.pending or store.default() is None:
            return None

        def fork() -> None:
            from ..trace.forked import Ahead

            a = Ahead(self.confirm, [w])
            if a.forked:
                self.pending[w] = a
                self.search.ahead += 1

        return cache.on_first_trace(fork)

    def claim(self, w: Workload) -> None:
        a = self.pending.pop(w, None)
        if a is not None:
            a.wait()  # type: ignore[attr-defined]

    def close(self) -> None:
        pending, self.pending = self.pending, {}
        for a in pending.values():
            a.cancel()  # type: ignore[attr-defined]


def _memo(f: Callable[[Workload], int | None]) -> Callable[[Workload], int | None]:
    seen: dict[Workload, int | None] = {}

    def cached(w: Workload) -> int | None:
        if w not in seen:
            seen[w] = f(w)
        return seen[w]

    return cached


def boundary_search(
    evaluate: Callable[[int], tuple[int | None, bool]], *, first: int, lo: int, hi: int, step: int = 1,
    predict: Predictor | None = None, max_evals: int = 64,
) -> SearchResult:
    """Largest ``x`` in ``{lo, lo+step, …} ∩ [lo, hi]`` with ``evaluate(x)`` fitting.

    ``evaluate(x)`` returns (memory, fits); memory is None when it is only a lower bound
    (e.g. the allocator simulation ran out of memory), and is then not used to predict.
    Stops when ``x`` fits and ``x + step`` does not (both evaluated), when ``lo`` does not
    fit, or when ``hi`` fits. Predictions are followed while they move; a run of
    evaluations on one side gallops (each move at least twice the last), and a bracket that
    predictions fail to close twice is bisected, so the count stays O(log range).
    """
    if step < 1 or lo < 1 or hi < lo:
        raise ValueError(f"bad search range lo={lo} hi={hi} step={step}")

    def snap(x: float) -> int:
        k = math.floor((x - lo) / step + 1e-9)
        return min(max(lo + k * step, lo), lo + (hi - lo) // step * step)

    top = snap(hi)
    samples: dict[int, int] = {}
    seen: set[int] = set()
    fit_x: int | None = None
    over_x: int | None = None
    misses = run = 0
    last_ok: bool | None = None
    x = snap(first)
    for _ in range(max_evals):
        used, ok = evaluate(x)
        seen.add(x)
        if used is not None:
            samples[x] = used
        run = run + 1 if ok == last_ok else 1
        last_ok = ok
        if ok:
            fit_x = x if fit_x is None else max(fit_x, x)
        else:
            over_x = x if over_x is None else min(over_x, x)
        if over_x == lo:
            return SearchResult(lo - step, lo, samples)
        if fit_x == top:
            return SearchResult(top, None, samples)
        if fit_x is not None and over_x is not None and over_x - fit_x <= step:
            return SearchResult(fit_x, over_x, samples)
        low = fit_x + step if fit_x is not None else lo
        high = over_x - step if over_x is not None else top
        bracketed = fit_x is not None and over_x is not None
        misses += 1 if bracketed else 0
        guess = predict(samples) if predict is not None else None
        if bracketed and (misses > 2 or guess is None or not math.isfinite(guess)):
            cand = snap((fit_x + over_x) / 2)  # type: ignore[operator]
        elif guess is None or not math.isfinite(guess):
            cand = snap(x * 2) if ok else snap(x / 2)
        else:
            cand = snap(guess)
            if not bracketed and run >= 2:  # gallop: move at least 2^(run-1) steps
                reach = step * 2 ** (run - 1)
                cand = max(cand, x + reach) if ok else min(cand, x - reach)
        x = min(max(cand, low), high)
        if x in seen:  # clamping can land on a known point only when the bracket is closed
            break
    return SearchResult(fit_x if fit_x is not None else lo - step, over_x, samples)


def secant_predictor(limit: int, *, quadratic: bool = False) -> Predictor:
    """Predict where memory crosses ``limit`` from the evaluations closest to it.

    Affine through two points (batch, or sequence with flash/SDPA attention); with
    ``quadratic`` and three points, a parabola (eager attention's s² scores).
    """

    def predict(samples: Mapping[int, int]) -> float | None:
        if len(samples) < 2:
            return None
        pts = sorted(samples.items(), key=lambda kv: abs(kv[1] - limit))
        if quadratic and len(pts) >= 3:
            q = _parabola_root(pts[:3], limit)
            if q is not None:
                return q
        (x1, y1), (x2, y2) = pts[0], pts[1]
        if x1 == x2 or y1 == y2:
            return None
        slope = (y2 - y1) / (x2 - x1)
        if slope <= 0:
            return None
        return x1 + (limit - y1) / slope

    return predict


def _parabola_root(pts: list[tuple[int, int]], limit: int) -> float | None:
    (x1, y1), (x2, y2), (x3, y3) = pts
    den = (x1 - x2) * (x1 - x3) * (x2 - x3)
    if den == 0:
        return None
    a = (x3 * (y2 - y1) + x2 * (y1 - y3) + x1 * (y3 - y2)) / den
    b = (x3 * x3 * (y1 - y2) + x2 * x2 * (y3 - y1) + x1 * x1 * (y2 - y3)) / den
    c = (x2 * x3 * (x2 - x3) * y1 + x3 * x1 * (x3 - x1) * y2 + x1 * x2 * (x1 - x2) * y3) / den
    if a <= 0:
        return None
    disc = b * b - 4 * a * (c - limit)
    if disc < 0:
        return None
    return (-b + math.sqrt(disc)) / (2 * a)


__all__ = ["MAX_BATCH", "BoundarySearch", "SearchResult", "Predictor", "boundary_search", "secant_predictor",
           "fits"]
