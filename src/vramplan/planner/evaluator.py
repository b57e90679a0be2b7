"""Counted, cached memory estimates for the searches (fit, plan, GPU ranking).

:class:`Evaluator` wraps :func:`vramplan.engine.estimate`: each distinct
(workload, GPU, method) is estimated once, and the number of analytic and traced
estimates is kept (the searches report it). :class:`Screen` checks one GPU-agnostic
estimate of a workload against any GPU by adding that GPU's overhead, so that ranking
forty GPUs does not cost forty estimates per candidate.
"""

from __future__ import annotations

from collections.abc import Callable

from vramplan.errors import VramplanError
from vramplan.hardware.gpu import GPU
from vramplan.models.spec import ModelSpec
from vramplan.results import Fallback, MemoryReport
from vramplan.workload import Method, Workload

from .results import Evaluations

Estimator = Callable[..., MemoryReport]
"""Same signature as :func:`vramplan.engine.estimate`."""


def default_estimator() -> Estimator:
    from vramplan.engine import estimate

    return estimate


class Evaluator:
    def __init__(self, spec: ModelSpec, *, alloc_conf: str | None = None,
                 estimator: Estimator | None = None) -> None:
        self.spec = spec
        self.alloc_conf = alloc_conf
        self._estimate = estimator or default_estimator()
        self._cache: dict[tuple[Workload, str | None, Method], MemoryReport] = {}
        self.traces = 0
        self.analytic = 0
        self.trace_failed = False
        """An ``auto`` estimate fell back to analytic once: later ``auto`` calls go straight there."""
        self.fallback: Fallback | None = None
        """The first fallback (why ``auto`` could not trace), when there was one."""

    def report(self, w: Workload, *, gpu: GPU | None, method: Method) -> MemoryReport:
        if method is Method.AUTO and self.trace_failed:
            method = Method.ANALYTIC
        key = (w, gpu.key if gpu else None, method)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        r = self._estimate(self.spec, w, gpu=gpu, method=str(method), alloc_conf=self.alloc_conf,
                           num_gpus=w.parallel.world_size, search_max_batch=False)
        if r.method is Method.TRACE:
            self.traces += 1
            self._cache[(w, key[1], Method.TRACE)] = r
        else:
            self.analytic += 1
            self._cache[(w, key[1], Method.ANALYTIC)] = r
            if method is Method.AUTO:
                self.trace_failed = True
                if self.fallback is None:
                    self.fallback = r.fallback
        self._cache[key] = r
        return r

    def has_analytic(self, w: Workload) -> bool:
        """Whether the analytic method can estimate this model (tried once per workload)."""
        try:
            self.report(w, gpu=None, method=Method.ANALYTIC)
        except VramplanError:
            return False
        return True

    def counts(self) -> Evaluations:
        return Evaluations(self.traces + self.analytic, self.traces, self.analytic)


class Screen:
    """GPU-agnostic memory of workload variants, checked against any GPU.

    device_used on a GPU = the estimate's reserved bytes + that GPU's overhead outside the
    allocator (CUDA context, NCCL), as the estimate pipeline computes it.
    """

    def __init__(self, evaluator: Evaluator, method: Method = Method.ANALYTIC, *,
                 overhead: Callable[[GPU, Workload], int] | None = None,
                 usable: Callable[[GPU], int] | None = None) -> None:
        self.ev = evaluator
        self.method = method
        self._overhead_fn = overhead or _default_overhead
        self._usable_fn = usable or _default_usable
        self._oh: dict[tuple[str, int, int, int, int, int, int], int] = {}
        self._us: dict[str, int] = {}

    def report(self, w: Workload) -> MemoryReport:
        return self.ev.report(w, gpu=None, method=self.method)

    def device_used(self, w: Workload, gpu: GPU) -> int:
        return self.report(w).peak.reserved + self.overhead(gpu, w)

    def overhead(self, gpu: GPU, w: Workload) -> int:
        p = w.parallel
        key = (gpu.key, p.dp, p.tp, p.pp, p.cp, p.ep, p.dp_shard)
        if key not in self._oh:
            self._oh[key] = self._overhead_fn(gpu, w)
        return self._oh[key]

    def usable(self, gpu: GPU) -> int:
        if gpu.key not in self._us:
            self._us[gpu.key] = self._usable_fn(gpu)
        return self._us[gpu.key]


def _default_overhead(gpu: GPU, w: Workload) -> int:
    from vramplan.engine import overhead_items

    return sum(o.bytes for o in overhead_items(gpu, w))


def _default_usable(gpu: GPU) -> int:
    from vramplan.hardware.catalog import usable_capacity

    return int(usable_capacity(gpu)[0])


def report_usable(r: MemoryReport) -> int:
    if r.verdict is None:
        raise ValueError("estimate without a GPU verdict")
    return r.verdict.usable


__all__ = ["Evaluator", "Screen", "Estimator", "default_estimator", "report_usable"]
