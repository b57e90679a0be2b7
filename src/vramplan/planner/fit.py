"""The largest micro-batch and the longest sequence that fit a GPU, with few traces.

Memory is affine in batch (fixed sequence) and affine (flash/SDPA) or quadratic (eager
attention) in sequence length. When the analytic method knows the model, its curve —
milliseconds per point — gives the shape: we find its boundary, confirm it with the
requested method (one evaluation at the boundary, one a step above), and, if they
disagree, recalibrate the analytic curve to the confirmed points (``t ≈ α + β·a``) and
try again. Without an analytic curve, a secant (or parabola) through the evaluations
predicts the boundary. Either way :func:`boundary_search` keeps a bracket, so a bad
prediction costs one evaluation, never the search.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from vramplan.errors import PlanError
from vramplan.hardware.gpu import GPU
from vramplan.models.spec import Family, ModelSpec
from vramplan.results import MemoryReport
from vramplan.units import fmt_bytes
from vramplan.workload import Attention, Method, Task, Workload, as_enum

from .evaluator import Estimator, Evaluator, report_usable
from .results import Boundary, FitResult
from .search import Predictor, boundary_search, secant_predictor

MAX_BATCH = 1 << 16
MIN_SEQ_STEP = 64
NO_SEQ_FAMILIES = (Family.VIT, Family.OTHER)


def fit(
    model: str | ModelSpec, workload: Workload | None = None, *, gpu: str | GPU,
    method: str | Method = Method.AUTO, alloc_conf: str | None = None, seq_step: int | None = None,
    max_batch: int = MAX_BATCH, estimator: Estimator | None = None,
) -> FitResult:
    """Largest batch (at ``workload.seq``) and longest sequence (at ``workload.batch``).

    ``seq_step``: resolution of the sequence answer (default: 1/16 of the power of two
    below the boundary, at least 64 tokens). Raises :class:`PlanError` when not even
    batch 1 at the shortest sequence fits.
    """
    from vramplan.engine import resolve_gpu, resolve_model

    spec = resolve_model(model)
    g = resolve_gpu(gpu)
    if g is None:
        raise PlanError("fit needs a GPU", hint="add --gpu NAME (see `vramplan gpus`)")
    w = workload or Workload()
    m = as_enum(Method, method, "method")
    ev = Evaluator(spec, alloc_conf=alloc_conf, estimator=estimator)
    return _Fit(spec, w, g, m, ev, seq_step, max_batch).run()


def saturated(r: MemoryReport) -> bool:
    """The allocator simulation ran out of the GPU's memory: the figures are a lower bound."""
    return r.allocator is not None and r.allocator.ooms > 0


class _Calibration:
    """Maps analytic device_used to the confirming method's: ``t ≈ α + β·a``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.pairs: list[tuple[int, int]] = []
        self.min_offset: float | None = None
        """From saturated evaluations: confirmed − analytic is at least this."""

    def add(self, analytic: int, confirmed: int) -> None:
        if (analytic, confirmed) not in self.pairs:
            self.pairs.append((analytic, confirmed))

    def add_bound(self, analytic: int, confirmed_at_least: int) -> None:
        off = float(confirmed_at_least - analytic)
        self.min_offset = off if self.min_offset is None else max(self.min_offset, off)

    def threshold(self) -> float:
        """The analytic device_used that corresponds to the limit."""
        est = self._estimate()
        if self.min_offset is not None:
            est = min(est, self.limit - self.min_offset)
        return est

    def _estimate(self) -> float:
        if not self.pairs:
            return float(self.limit)
        near = sorted(self.pairs, key=lambda p: abs(p[1] - self.limit))
        a1, t1 = near[0]
        if len(near) >= 2:
            a2, t2 = near[1]
            if abs(a1 - a2) > 1 << 20:
                beta = (t1 - t2) / (a1 - a2)
                if 0.5 <= beta <= 2.0:
                    return a1 + (self.limit - t1) / beta
        return float(self.limit - (t1 - a1))


class _Fit:
    def __init__(self, spec: ModelSpec, w: Workload, g: GPU, m: Method, ev: Evaluator,
                 seq_step: int | None, max_batch: int) -> None:
        self.spec, self.w, self.g, self.m, self.ev = spec, w, g, m, ev
        self.seq_step = seq_step
        self.max_batch = max_batch
        self.notes: list[str] = []
        self.shaped = m is Method.ANALYTIC or ev.has_analytic(w)
        # The GPU's usable bytes: from a cheap analytic estimate when there is one.
        first = ev.report(w, gpu=g, method=Method.ANALYTIC if self.shaped else m)
        self.usable = report_usable(first)
        self.cal = _Calibration(self.usable)

    # -- evaluations ---------------------------------------------------------------
    def _confirm(self, w: Workload) -> MemoryReport:
        return self.ev.report(w, gpu=self.g, method=self.m)

    def _analytic(self, w: Workload) -> int:
        return self.ev.report(w, gpu=self.g, method=Method.ANALYTIC).peak.device_used

    def _pair(self, w: Workload, r: MemoryReport) -> None:
        if r.method is Method.ANALYTIC:
            return
        if saturated(r):
            self.cal.add_bound(self._analytic(w), r.peak.device_used)
        else:
            self.cal.add(self._analytic(w), r.peak.device_used)

    def _evaluator(self, make: Callable[[int], Workload]) -> Callable[[int], tuple[int | None, bool]]:
        def evaluate(x: int) -> tuple[int | None, bool]:
            wx = make(x)
            r = self._confirm(wx)
            if self.shaped:
                self._pair(wx, r)
            fits = r.peak.device_used <= self.usable and not saturated(r)
            return (None if saturated(r) else r.peak.device_used), fits

        return evaluate

    def _predictor(self, make: Callable[[int], Workload], lo: int, hi: int, step: int,
                   quadratic: bool, start: int) -> Predictor:
        if not self.shaped:
            return secant_predictor(self.usable, quadratic=quadratic)

        def predict(_samples: Mapping[int, int]) -> float | None:
            limit = self.cal.threshold()

            def on_curve(x: int) -> tuple[int | None, bool]:
                used = self._analytic(make(x))
                return used, used <= limit

            res = boundary_search(on_curve, first=max(start, lo), lo=lo, hi=hi, step=step,
                                  predict=secant_predictor(int(limit), quadratic=quadratic))
            return float(res.value)

        return predict

    # -- the two searches ------------------------------------------------------------
    def run(self) -> FitResult:
        batch = self._batch()
        seq = None if self.spec.family in NO_SEQ_FAMILIES else self._seq()
        if self.spec.family in NO_SEQ_FAMILIES:
            self.notes.append(f"{self.spec.name} has no sequence axis; only the batch was searched")
        if batch.value == 0 and (seq is None or seq.value == 0):
            self._nothing_fits(batch, seq)
        if self.shaped and self.m is not Method.ANALYTIC:
            self.notes.append("the analytic curve shaped the search; each boundary was confirmed "
                              f"with the {self.m} method at the boundary and one step above")
        return FitResult(
            model=self.spec.name, gpu=self.g.key, gpu_name=self.g.name, usable=self.usable,
            num_gpus=self.w.parallel.world_size, workload=self.w, method=self.m, batch=batch,
            seq=seq, evaluations=self.ev.counts(), notes=tuple(self.notes),
        )

    def _batch(self) -> Boundary:
        w = self.w

        def make(b: int) -> Workload:
            return w.replace(batch=b)

        hi = self.max_batch
        predict = self._predictor(make, 1, hi, 1, False, w.batch)
        guess = predict({}) if self.shaped else None
        first = int(guess) if guess is not None and guess >= 1 else w.batch
        res = boundary_search(self._evaluator(make), first=first, lo=1, hi=hi, step=1, predict=predict)
        limited = "search limit" if res.above is None else "memory"
        return self._boundary("batch", res.value, w.seq, 1, limited, make, res.above)

    def _seq(self) -> Boundary:
        w = self.w
        cap = self.spec.max_positions or (1 << 20)
        if w.task is Task.GENERATE:
            cap -= w.new_tokens
        quadratic = w.attention is Attention.EAGER

        def make(s: int) -> Workload:
            return w.replace(seq=s)

        step = self.seq_step or MIN_SEQ_STEP
        if cap < 1 or (self.seq_step is None and cap < MIN_SEQ_STEP):
            total = self.spec.max_positions or (1 << 20)
            raise PlanError(
                f"{self.spec.name} has {total} positions; --new-tokens {w.new_tokens} leaves {max(cap, 0)} for the prompt",
                hint="lower --new-tokens" + (f", or pass --seq-step {cap} or less" if cap >= 1 else ""),
            )
        if self.seq_step is None:
            rough = self._predictor(make, MIN_SEQ_STEP, cap, MIN_SEQ_STEP, quadratic, w.seq)({})
            around = rough if rough and rough > 0 else w.seq
            step = max(MIN_SEQ_STEP, 2 ** int(math.log2(max(around, 1))) // 16)
        if cap < step:
            if self.seq_step is not None and step > cap:
                raise PlanError(f"--seq-step {step} exceeds the {cap} positions {self.spec.name} allows",
                                hint=f"use --seq-step {cap} or less")
            raise PlanError(f"{self.spec.name} allows only {cap} positions", hint="lower --new-tokens")
        hi = cap // step * step
        predict = self._predictor(make, step, hi, step, quadratic, w.seq)
        guess = predict({}) if self.shaped else None
        first = int(guess) if guess is not None and guess >= step else w.seq
        res = boundary_search(self._evaluator(make), first=first, lo=step, hi=hi, step=step, predict=predict)
        limited = "max_positions" if res.above is None else "memory"
        return self._boundary("seq", max(res.value, 0), w.batch, step, limited, make, res.above)

    def _boundary(self, axis: str, value: int, fixed: int, step: int, limited: str,
                  make: Callable[[int], Workload], above: int | None) -> Boundary:
        at = self._confirm(make(value)) if value > 0 else None
        over = self._confirm(make(above)) if above is not None else None
        return Boundary(axis=axis, value=value, fixed=fixed, step=step, limited_by=limited,
                        at=at, above=over)

    def _nothing_fits(self, batch: Boundary, seq: Boundary | None) -> None:
        r = (seq.above if seq is not None and seq.above is not None else batch.above)
        need = fmt_bytes(r.peak.device_used) if r is not None else "?"
        where = f"batch {r.workload.batch}" + (f" at seq {r.workload.seq}" if seq is not None else "") if r else ""
        raise PlanError(
            f"{self.spec.name} does not fit on {self.w.parallel.world_size}× {self.g.key}: "
            f"{where} needs {need}, usable {fmt_bytes(self.usable)}",
            hint=f"try `vramplan plan {self.spec.name} --gpu {self.g.key}` for memory savings "
            "(checkpointing, 8-bit optimizer, --allow-peft, --gpus N)",
        )
