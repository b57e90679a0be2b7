"""Search workload variants for plans that fit, and return their Pareto front.

1. Enumerate the variants (:mod:`.space`) on 1…``max_gpus`` GPUs.
2. Screen each with the analytic estimate (milliseconds; GPU-agnostic, so each variant
   is estimated once) and the runtime model; drop what does not fit or costs more than
   the budget.
3. Keep the Pareto front over memory per GPU, time per token and cost per token.
4. Confirm the best ``confirm`` finalists with the requested method (a trace), replacing
   their memory figures; a finalist the trace finds too large is dropped.

Impossible targets raise :class:`PlanError` naming the nearest option.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vramplan.errors import PlanError, VramplanError
from vramplan.hardware.gpu import GPU
from vramplan.models.shape import SEQUENCE_FAMILIES, samples_per_rank
from vramplan.models.spec import ModelSpec
from vramplan.results import MemoryReport
from vramplan.runtime import StepTime, step_time
from vramplan.units import GiB, fmt_bytes
from vramplan.workload import Method, Peft, Precision, Workload, as_enum

from .evaluator import Estimator, Evaluator, Screen
from .knobs import KNOBS, saving_knobs
from .pareto import (
    SORTS,
    complexity,
    cost_metric,
    objectives,
    pareto_front,
    sort_key,
    time_per_work,
)
from .pricing import check_budget, load_instances, plan_price, priced_gpus
from .results import Plan, PlanResult, Price
from .space import Candidate, candidates, changes_from, describe, for_gpu

Progress = Callable[[str, int, int], None]
"""progress(stage, done, total): called as the search advances (the CLI draws a bar)."""


def plan(
    model: str | ModelSpec, workload: Workload | None = None, *, gpu: str | GPU, max_gpus: int = 1,
    budget: float | None = None, allow_peft: bool = False, global_batch: int | None = None,
    method: str | Method = Method.AUTO, alloc_conf: str | None = None, sort: str = "speed",
    confirm: int = 3, estimator: Estimator | None = None, instances: Sequence[Any] | None = None,
    progress: Progress | None = None, screen: Screen | None = None,
) -> PlanResult:
    """Plans that make ``workload`` fit on up to ``max_gpus`` × ``gpu``, best first by ``sort``.

    ``budget``: dollars per hour for all GPUs of a plan (needs a listed price for the GPU).
    ``global_batch``: keep micro-batch × accumulation × data-parallel size equal to it.
    ``confirm``: how many finalists to re-estimate with ``method`` (0: none).
    """
    from vramplan.engine import resolve_gpu, resolve_model

    spec = resolve_model(model)
    g = resolve_gpu(gpu)
    if g is None:
        raise PlanError("plan needs a GPU", hint="add `gpu=NAME`, or use `rank_gpus`")
    if sort not in SORTS:
        raise PlanError(f"unknown sort {sort!r}", hint=f"choose one of {', '.join(SORTS)}")
    w = workload or Workload()
    check_layout(w, max_gpus)
    check_budget(budget)
    m = as_enum(Method, method, "method")
    insts = list(instances) if instances is not None else load_instances()
    ev = screen.ev if screen is not None else Evaluator(spec, alloc_conf=alloc_conf, estimator=estimator)
    sc = screen or Screen(ev, screen_method(ev, w, m))
    knobs = saving_knobs(ev, w)
    cands = candidates(w, g, max_gpus=max_gpus, allow_peft=allow_peft, global_batch=global_batch,
                       compact=sc.method is not Method.ANALYTIC, knobs=knobs)
    if budget is not None and plan_price(g, 1, insts) is None:
        raise PlanError(
            f"no on-demand price is listed for {g.key}, so `budget` cannot be checked",
            hint=f"drop `budget`, or choose a priced GPU: {', '.join(priced_gpus(insts)[:8])}",
        )
    search = PlanBuilder(spec, w, g, m, sc, insts, progress)
    baseline = search.baseline(global_batch)
    screened = search.screen_all(cands)
    fitting = [p for p in screened if p.fits]
    if not fitting:
        raise _nothing_fits(spec, g, max_gpus, screened, allow_peft)
    affordable = _within_budget(fitting, budget, g)
    front = sorted(pareto_front(affordable, lambda p: objectives(p, w), complexity), key=sort_key(sort))
    finals = search.confirm(front, confirm)
    if not finals:
        raise PlanError(f"every plan that fit by the analytic screen is too large when traced on {g.key}",
                        hint="use `method=analytic` to see the screened plans, or a larger `max_gpus`")
    finals = [explain(p, baseline) for p in sorted(finals, key=sort_key(sort))]
    notes = _notes(w, m, sc, global_batch, len(cands), len(fitting)) + refusal_notes(search.refused, sc.method) \
        + caveats(w, finals) + knob_notes(w, knobs)
    if search.ahead:
        notes.append(f"{search.ahead} finalist(s) confirmed in forked processes while this one confirmed the others; "
                     "their traces were read back from the on-disk store (`--no-cache`: one after another)")
    counts = sorted({c.num_gpus for c in cands})
    if global_batch is not None and max(counts) < max_gpus:
        notes.append(f"global batch {global_batch} splits evenly over {counts} GPU(s) only")
    return PlanResult(
        model=spec.name, gpu=g.key, baseline=explain(baseline, baseline), plans=tuple(finals),
        candidates=len(cands), evaluations=ev.counts(), sort=sort, global_batch=global_batch,
        budget=budget, notes=tuple(notes),
    )


def check_layout(w: Workload, gpus: int) -> None:
    """The workload's mesh must fit the GPU count: tp × pp × cp divides it, dp × tp × pp × cp
    does not exceed it."""
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise PlanError(f"`max_gpus` must be at least 1, got {gpus!r}", field="max_gpus")
    p = w.parallel
    model = p.tp * p.pp * p.cp
    if gpus % model:
        ok = ", ".join(str(model * k) for k in range(1, 4))
        raise PlanError(f"tp × pp × cp = {p.tp} × {p.pp} × {p.cp} = {model} GPUs does not divide `max_gpus={gpus}`",
                        hint=f"use `max_gpus` of {ok}…, or a tp/pp/cp whose product divides {gpus}",
                        field="max_gpus")
    if p.world_size > gpus:
        raise PlanError(f"the mesh dp × tp × pp × cp = {p.dp} × {p.tp} × {p.pp} × {p.cp} = {p.world_size} GPUs "
                        f"exceeds `max_gpus={gpus}`",
                        hint=f"use `max_gpus={p.world_size}`, or `dp={max(1, gpus // model)}`", field="max_gpus")


def _within_budget(fitting: list[Plan], budget: float | None, g: GPU) -> list[Plan]:
    if budget is None:
        return fitting
    ok = [p for p in fitting if p.price is not None and p.price.usd_per_hour <= budget]
    if not ok:
        cheapest = min(fitting, key=lambda p: p.price.usd_per_hour if p.price else float("inf"))
        price = f"${cheapest.price.usd_per_hour:.2f}/h" if cheapest.price else "an unknown price"
        raise PlanError(
            f"no plan fits within ${budget:.2f}/h: the cheapest that fits is {cheapest.label} "
            f"on {cheapest.num_gpus}× {g.key} at {price}",
            hint="raise `budget`, or try `rank_gpus` for cheaper GPUs",
        )
    return ok


def screen_method(ev: Evaluator, w: Workload, m: Method) -> Method:
    if m is Method.ANALYTIC or ev.has_analytic(w):
        return Method.ANALYTIC
    return Method.TRACE


@dataclass
class PlanBuilder:
    """Turns screened (or confirmed) estimates of candidates into priced, timed plans."""

    spec: ModelSpec
    w: Workload
    gpu: GPU
    method: Method
    screen: Screen
    instances: Sequence[Any]
    progress: Progress | None
    ahead: int = 0
    """Finalists confirmed ahead in forked processes (their traces read back from the store)."""
    refused: dict[str, int] = field(default_factory=dict)
    """The screen's refusals: each one-line error and how many candidates it refused."""

    def baseline(self, global_batch: int | None) -> Plan:
        """The user's workload (at the global batch, when one is given)."""
        w = for_gpu(self.w, self.gpu)
        per_rank = samples_per_rank(global_batch, w.parallel.dp) if global_batch is not None else None
        if per_rank is not None and per_rank % w.batch == 0:
            w = w.replace(grad_accum=per_rank // w.batch)
        r = self.screen.report(w)
        return self.make(Candidate(w, w.parallel.world_size), r)

    def screen_all(self, cands: list[Candidate]) -> list[Plan]:
        out: list[Plan] = []
        total = len(cands)
        for i, c in enumerate(cands):
            try:
                r = self.screen.report(c.workload)
            except VramplanError as e:  # a combination this model or the screen's method does not allow
                self.refused[e.message] = self.refused.get(e.message, 0) + 1
                continue
            out.append(self.make(c, r))
            if self.progress is not None and (i % 8 == 7 or i == total - 1):
                self.progress("screen", i + 1, total)
        return out

    def make(self, c: Candidate, r: MemoryReport, *, confirmed: bool = False,
             price: Price | None | str = "listed") -> Plan:
        """A plan from an estimate; ``price`` is the listed price of the GPU count by default."""
        w = c.workload
        used = r.peak.device_used if r.verdict is not None else r.peak.reserved + self.screen.overhead(self.gpu, w)
        usable = r.verdict.usable if r.verdict is not None else self.screen.usable(self.gpu)
        step = _runtime(self.spec, w, self.gpu, r, traced_flops=self.screen.method is not Method.ANALYTIC)
        frag = r.allocator.fragmentation_at_peak if r.allocator is not None else 0.0
        if isinstance(price, str):
            price = plan_price(self.gpu, c.num_gpus, self.instances)
        return Plan(
            workload=w, gpu=self.gpu.key, gpu_name=self.gpu.name, num_gpus=c.num_gpus,
            changes=changes_from(self.w, w), label=describe(w, c.num_gpus), memory=used,
            allocated=r.peak.allocated, reserved=r.peak.reserved, usable=usable, method=r.method,
            confirmed=confirmed or self.method is Method.ANALYTIC, fragmentation=frag, step=step,
            price=price,
        )

    def confirm(self, front: list[Plan], k: int) -> list[Plan]:
        """Re-estimate up to ``k`` plans (trying at most 2k) with the requested method.

        Plans not re-estimated are kept only if they would still fit when scaled by the
        largest confirmed/screened memory ratio seen (the screen's bias on this model).
        """
        if self.method is Method.ANALYTIC or k <= 0:
            return front
        out: list[Plan] = []
        rest: list[Plan] = []
        ratios: list[float] = []
        tried = done = 0
        ahead, ahead_from = self._ahead(front[:k])
        for i, p in enumerate(front):
            if done >= k or tried >= 2 * k:
                rest.append(p)
                continue
            if i == ahead_from and ahead is not None:
                ahead.wait()  # (the rest of the first k are confirmed in children: their traces are stored)
            tried += 1
            if self.progress is not None:
                self.progress("confirm", tried, min(2 * k, len(front)))
            r = self.screen.ev.report(p.workload, gpu=self.gpu, method=self.method)
            q = self.make(Candidate(p.workload, p.num_gpus), r, confirmed=True, price=p.price)
            ratios.append(q.memory / max(p.memory, 1))
            if q.fits:
                out.append(q)
                done += 1
        if ahead is not None:
            ahead.wait()  # (reaped whatever the loop did)
        worst = max([1.0, *ratios])
        return out + [p for p in rest if p.memory * worst <= p.usable]


    def _ahead(self, first: list[Plan]) -> tuple[Any, int]:
        """The last of the ``first`` finalists confirmed in forked children while this process
        confirms the others (:class:`vramplan.trace.forked.Ahead`), and the index from which the
        loop waits for them; (None, -1) where nothing runs ahead (the store is off, a single CPU)."""
        from ..engine import store

        if store.default() is None or len(first) < 2:
            return None, -1
        from ..trace.forked import Ahead, workers

        n = workers()
        if n < 2:
            return None, -1
        here = -(-len(first) // n)  # (this process's share, first)
        ahead = Ahead(lambda p: self.screen.ev.report(p.workload, gpu=self.gpu, method=self.method), first[here:])
        if not ahead.forked:
            return None, -1
        self.ahead = len(first) - here
        return ahead, here


def _runtime(spec: ModelSpec, w: Workload, gpu: GPU, r: MemoryReport, *, traced_flops: bool) -> StepTime:
    """Step time; traced FLOPs only when every plan has them (no analytic model), so that
    plans are compared under one FLOP model. A model the runtime formulas do not know but the
    analytic method does (Qwen2.5-VL: its language model's and vision tower's FLOPs,
    :mod:`vramplan.analytic.vlm`) takes the analytic report's count."""
    flops = r.flops_per_step if traced_flops and r.method is Method.TRACE else None
    if flops is None and r.method is Method.ANALYTIC and spec.family not in SEQUENCE_FAMILIES:
        flops = r.flops_per_step or None
    return step_time(spec, w, gpu, flops=float(flops) if flops else None,
                     trainable_params=r.trainable_params or None)


def explain(p: Plan, base: Plan) -> Plan:
    from dataclasses import replace

    rel = time_per_work(p) / time_per_work(base) - 1.0
    same = p.step.tokens_per_step == base.step.tokens_per_step and p.step.samples_per_step == base.step.samples_per_step
    what = "step time" if same else "time per token"
    sign = "+" if rel >= 0.005 else ("−" if rel <= -0.005 else "±")
    relative = f"{sign}{abs(rel) * 100:.0f} % {what}"
    text = f"{p.label}: {p.memory / GiB:.1f} GiB, {relative}"
    changed = job_words(base.workload, p.workload)
    if changed:
        text += f" ({'; '.join(changed)})"
    if p.num_gpus > 1:
        text += f" on {p.num_gpus} GPUs"
    if p.usd_per_mtok is not None:
        text += f", ${p.usd_per_mtok:.2f}/M tokens" if p.step.tokens_per_step else f", ${p.usd_per_mtok:.2f}/M samples"
    return replace(p, explanation=text, relative=relative)


def job_words(base: Workload, w: Workload) -> list[str]:
    """What a plan changes in the job itself (not only how it runs), said in words."""
    out = []
    if w.precision is not base.precision:
        extra = ": no fp32 master weights" if w.training and base.mixed and not w.mixed else ""
        out.append(f"precision {base.precision} → {w.precision}{extra}")
    if w.training and w.optimizer is not base.optimizer:
        out.append(f"optimizer {base.optimizer} → {w.optimizer}")
    if w.peft is not base.peft:
        out.append(f"trains {w.peft} adapters" + (" on 4-bit base weights" if w.quant.value != "none" else ""))
    return out


def _nothing_fits(spec: ModelSpec, g: GPU, max_gpus: int, screened: list[Plan], allow_peft: bool) -> PlanError:
    if not screened:
        return PlanError(f"no valid variant of this workload for {spec.name}",
                         hint="check `tp` and `pp` against the model's heads and layers")
    nearest = min(screened, key=lambda p: p.memory - p.usable)
    where = f" on {nearest.num_gpus} GPUs" if nearest.num_gpus > 1 else ""
    tips = []
    if not allow_peft and nearest.workload.training and nearest.workload.peft.value == "none":
        tips.append("`allow_peft=True`")
    tips.append(f"`max_gpus={max(2, max_gpus * 2)}`")
    tips.append("a larger GPU (`rank_gpus`)")
    return PlanError(
        f"no plan fits on {max_gpus}× {g.key} (usable {fmt_bytes(nearest.usable)}) — nearest: "
        f"{nearest.label}{where} needs {fmt_bytes(nearest.memory)} per GPU",
        hint="try " + ", ".join(tips),
    )


def knob_notes(w: Workload, knobs: frozenset[str]) -> list[str]:
    """Which of the loop's memory savings were searched, and which were not."""
    if not w.training:
        return []
    words = {"loss": "chunked cross-entropy", "optimizer_in_backward": "optimizer step in backward",
             "activation_offload": "activation offload", "op": "op-level selective checkpointing",
             "every": "checkpointing every 2nd layer"}
    left = [words[k] for k in KNOBS if k not in knobs]
    searched = [words[k] for k in KNOBS if k in knobs]
    out = []
    if searched:
        out.append("loop savings searched: " + ", ".join(searched))
    if left:
        out.append("not searched (no lower predicted peak for this workload by the analytic screen): " + ", ".join(left))
    return out


def refusal_notes(refused: dict[str, int], method: Method, shown: int = 3) -> list[str]:
    """The candidates the screen could not estimate, by cause (the most frequent ``shown``): a plan
    missing from the table (no multi-GPU plan at all, say) is then explained, not silent."""
    if not refused:
        return []
    total = sum(refused.values())
    top = sorted(refused.items(), key=lambda kv: (-kv[1], kv[0]))[:shown]
    causes = "; ".join(f"{n:,}× {msg}" for msg, n in top)
    more = f"; {len(refused) - shown} other cause(s)" if len(refused) > shown else ""
    return [f"{total:,} candidate(s) not screened: the {method} method refuses them — {causes}{more}"]


def caveats(w: Workload, plans: Sequence[Plan]) -> list[str]:
    """What a plan changes about the job itself, beyond memory and speed."""
    out = []
    pure = {Precision.BF16, Precision.FP16}
    if w.precision not in pure and any(p.workload.precision in pure for p in plans):
        out.append("pure bf16/fp16 plans keep no fp32 master weights: updates below 16-bit resolution are "
                   f"lost; the {w.precision} rows keep them (prefer those when convergence matters)")
    if w.peft is Peft.NONE and any(p.workload.peft is not Peft.NONE for p in plans):
        out.append("LoRA/QLoRA plans train adapters only: a different job from full fine-tuning")
    return out


def _notes(w: Workload, m: Method, sc: Screen, global_batch: int | None, n: int, fit: int) -> list[str]:
    notes = [f"{n} candidate configurations screened with the {sc.method} method; {fit} fit"]
    if sc.method is not Method.ANALYTIC:
        notes.append("the analytic method does not cover this model or workload: every candidate was traced, so the space was "
                     "kept compact (no selective/partial checkpointing, fused/Adafactor optimizers, ZeRO-1/2)")
    if m is not Method.ANALYTIC and sc.method is Method.ANALYTIC:
        notes.append(f"finalists re-estimated with the {m} method on the target GPU (confirmed = yes)")
    if global_batch is not None:
        notes.append(f"global batch kept at {global_batch} (micro-batch × accumulation × data-parallel GPUs)")
    elif w.training:
        notes.append(f"samples per GPU per step kept at {w.batch * w.grad_accum}; more GPUs raise the global batch")
    notes.append("memory = predicted nvidia-smi used per GPU (GiB = 2^30 B); step time from the roofline "
                 "runtime model (vramplan.runtime: assumptions in its notes)")
    return notes


__all__ = ["plan", "PlanBuilder", "caveats", "explain", "cost_metric", "Progress"]
