"""The largest micro-batch and the longest sequence that fit a GPU, with few traces.

Memory is affine in batch (fixed sequence) and affine (flash/SDPA) or quadratic (eager
attention) in sequence length. Both searches are the engine's one boundary search
(:class:`vramplan.engine.boundary.BoundarySearch`: the analytic curve shapes it, the requested
method confirms the boundary and the step above it), so ``fit``'s largest batch is the
one ``estimate``'s verdict reports.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from vramplan.errors import PlanError
from vramplan.hardware.gpu import GPU
from vramplan.models.spec import Family, ModelSpec
from vramplan.results import MemoryReport
from vramplan.units import fmt_bytes
from vramplan.workload import Attention, Method, Rollout, Task, Workload, as_enum

from ..engine.boundary import MAX_BATCH, BoundarySearch
from ..engine.margin import Margin, describe, margin_limit, margin_of
from .evaluator import Estimator, Evaluator, report_usable
from .results import Boundary, FitResult

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
        raise PlanError("fit needs a GPU", hint="add `gpu=NAME` (see `vramplan gpus`)")
    w = workload or Workload()
    m = as_enum(Method, method, "method")
    ev = Evaluator(spec, alloc_conf=alloc_conf, estimator=estimator)
    return _Fit(spec, w, g, m, ev, seq_step, max_batch).run()


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
        self.limit = self.usable
        """What a step may use: the usable bytes, less a margin when ``auto`` fell back to the formulas."""
        self.margin: Margin | None = None
        self.search = BoundarySearch(self._confirm, self._analytic if self.shaped else None, self.usable)

    def _confirm(self, w: Workload) -> MemoryReport:
        return self.ev.report(w, gpu=self.g, method=self.m)

    def _analytic(self, w: Workload) -> int:
        return self.ev.report(w, gpu=self.g, method=Method.ANALYTIC).peak.device_used

    # -- the two searches ------------------------------------------------------------
    def run(self) -> FitResult:
        batch = self._batch()
        seq = None if self.spec.family in NO_SEQ_FAMILIES else self._seq()
        fallback = self.ev.fallback if self.m is Method.AUTO else None
        if fallback is not None:  # every answer came from the formulas: search again, with a margin
            self.margin = margin_of(self.spec, self.w)
            self.limit = margin_limit(self.usable, self.margin)
            self.search = BoundarySearch(self._confirm, self._analytic, self.limit)
            batch = self._batch()
            seq = None if self.spec.family in NO_SEQ_FAMILIES else self._seq()
            self.notes.append(
                f"`method=auto` could not trace {self.spec.name} ({fallback.reason}): every figure is analytic, and "
                f"the boundaries keep {describe(self.margin)}: {fmt_bytes(self.limit)} of {fmt_bytes(self.usable)}; "
                "a job unlike those measured may still need more under a trace")
        if self.spec.family in NO_SEQ_FAMILIES:
            self.notes.append(f"{self.spec.name} has no sequence axis; only the batch was searched")
        if batch.value == 0 and (seq is None or seq.value == 0):
            self._nothing_fits(batch, seq)
        if self.search.ahead:
            self.notes.append(f"{self.search.ahead} confirmation(s) of the step above a point ran in a forked process "
                              "while this one confirmed the point; their traces were read back from the on-disk store "
                              "(`--no-cache`: one after another)")
        if self.shaped and self.m is not Method.ANALYTIC and fallback is None:
            self.notes.append("the analytic curve shaped the search; each boundary was confirmed "
                              f"with the {self.m} method at the boundary and one step above")
        return FitResult(
            model=self.spec.name, gpu=self.g.key, gpu_name=self.g.name, usable=self.usable,
            num_gpus=self.w.parallel.world_size, workload=self.w, method=self.m, batch=batch,
            seq=seq, evaluations=self.ev.counts(), notes=tuple(self.notes), fallback=fallback,
            suggestion=self._suggest() if batch.value == 0 else None,
        )

    def _suggest(self) -> str | None:
        """The cheapest change that makes batch 1 at the asked sequence fit (analytic screen)."""
        from .nextstep import cheapest_fix

        fix = cheapest_fix(self.spec, self.w.replace(batch=self.w.batch_step), self.g, method=self.m)
        return fix.sentence() if fix is not None else None

    def _batch(self) -> Boundary:
        w = self.w

        def make(b: int) -> Workload:
            return w.replace(batch=b)

        res = self.search.largest_batch(w, self.max_batch)
        limited = "search limit" if res.above is None else self._memory()
        return self._boundary("batch", res.value, w.seq, w.batch_step, limited, make, res.above)

    def _seq(self) -> Boundary:
        w = self.w
        cap = self.spec.max_positions or (1 << 20)
        if w.task is Task.GENERATE:
            cap -= w.new_tokens
        bound = "max_positions"
        if w.rl and w.rollout is Rollout.VLLM and w.vllm_max_len and w.vllm_max_len < cap:
            cap, bound = w.vllm_max_len, "vllm_max_len"  # (vLLM's context holds the prompt and the completion)
        quadratic = w.attention is Attention.EAGER

        def make(s: int) -> Workload:
            return w.replace(seq=s)

        step = self.seq_step or MIN_SEQ_STEP
        if cap < 1 or (self.seq_step is None and cap < MIN_SEQ_STEP):
            total = self.spec.max_positions or (1 << 20)
            raise PlanError(
                f"{self.spec.name} has {total} positions; `new_tokens={w.new_tokens}` leaves {max(cap, 0)} for the prompt",
                hint="lower `new_tokens`" + (f", or pass `seq_step={cap}` or less" if cap >= 1 else ""),
            )
        if self.seq_step is None:
            rough = self.search.predictor(make, MIN_SEQ_STEP, cap, MIN_SEQ_STEP, quadratic, w.seq)({})
            around = rough if rough and rough > 0 else w.seq
            step = max(MIN_SEQ_STEP, 2 ** int(math.log2(max(around, 1))) // 16)
        if cap < step:
            if self.seq_step is not None and step > cap:
                raise PlanError(f"`seq_step={step}` exceeds the {cap} positions {self.spec.name} allows",
                                hint=f"use `seq_step={cap}` or less", field="seq_step")
            raise PlanError(f"{self.spec.name} allows only {cap} positions", hint="lower `new_tokens`")
        hi = cap // step * step
        lo = (w.prompt // step + 1) * step if w.rl else step  # (GRPO, PPO: past the prompt)
        if lo > hi:
            raise PlanError(f"{self.spec.name} allows {cap} positions: no room after the {w.prompt}-token prompt",
                            hint="lower `prompt`", field="prompt")
        res = self.search.search(make, lo=lo, hi=hi, step=step, quadratic=quadratic, start=max(w.seq, lo))
        limited = bound if res.above is None else self._memory()
        return self._boundary("seq", max(res.value, 0), w.batch, step, limited, make, res.above)

    def _memory(self) -> str:
        return "memory" if self.margin is None else f"memory less {self.margin.margin:.0%}"

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
        fix = self._suggest()
        raise PlanError(
            f"{self.spec.name} does not fit on {self.w.parallel.world_size}× {self.g.key}: "
            f"{where} needs {need}, usable {fmt_bytes(self.usable)}",
            hint=(f"{fix}; " if fix else "") + "the planner searches checkpointing, 8-bit optimizers, PEFT and "
            f"more GPUs: `vramplan plan {self.spec.name} --gpu {self.g.key} --allow-peft --gpus 8`",
        )
