"""Doc builders for the planner: fit boundaries, plan tables and GPU/instance rankings.

Memory is shown in GiB (2^30 bytes) per GPU, predicted nvidia-smi used; JSON carries the
results' own ``to_dict()`` with integer bytes.
"""

from __future__ import annotations

from vramplan.planner.results import Boundary, FitResult, Plan, PlanResult, Ranking
from vramplan.units import GiB

from .doc import Doc, KeyValues, Notes, Table
from .estimate import loop_text

PLAN_COLUMNS = ["#", "plan", "GPUs", "GiB/GPU", "step time", "tokens/s", "$/h", "$/M tok",
                "bound", "vs. as given", "checked"]


def _gib(n: int | float) -> str:
    return f"{n / GiB:,.1f}"


def _secs(s: float) -> str:
    if s >= 100:
        return f"{s:,.0f} s"
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.1f} ms"


def _rate(p: Plan) -> str:
    v = p.work_per_s
    return f"{v:,.0f}" if v >= 10 else f"{v:.2f}"


def _columns(plans: tuple[Plan, ...] | list[Plan], cols: list[str]) -> list[str]:
    """Samples instead of tokens for models without a token axis (CNNs, ViTs)."""
    if plans and not plans[0].step.tokens_per_step:
        return [c.replace("tokens/s", "samples/s").replace("$/M tok", "$/M samples") for c in cols]
    return list(cols)


def _usd(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def _checked(p: Plan) -> str:
    return f"{p.method} ✓" if p.confirmed else f"{p.method} (screen)"


def plan_row(i: int | str, p: Plan) -> list[str]:
    return [str(i), p.label, str(p.num_gpus), _gib(p.memory), _secs(p.step.total), _rate(p),
            _usd(p.price.usd_per_hour if p.price else None), _usd(p.usd_per_mtok),
            str(p.step.bound), p.relative or "–", _checked(p)]


def fit_doc(r: FitResult) -> Doc:
    w = r.workload
    doc = Doc(title=f"Fit: {r.model} on {r.num_gpus}× {r.gpu_name}",
              subtitle=f"usable {_gib(r.usable)} GiB per GPU; memory = predicted nvidia-smi used (GiB = 2^30 B)")
    # no sequence axis (CNN, ViT, UNet): the batch is searched at the image size
    where = f"seq {r.batch.fixed}" if r.seq is not None else f"image size {w.image_size}"
    items = [("max batch", f"{r.max_batch}  (at {where})" if r.max_batch else
              f"0 — batch 1 does not fit at {where}")]
    if r.suggestion:
        items.append(("to fit", r.suggestion))
    if r.seq is not None:
        items.append(("max seq", f"{r.seq.value:,}  (at batch {r.seq.fixed}, resolution {r.seq.step} tokens)"
                      if r.seq.value else f"0 — nothing fits at batch {r.seq.fixed}"))
    e = r.evaluations
    items.append(("evaluations", f"{e.total} ({e.traces} traces, {e.analytic} analytic)"))
    items.append(("method", str(r.method) if r.fallback is None else
                  f"{r.method}: fell back to {r.fallback.used} (could not trace; see the notes)"))
    items.append(("task", f"{w.task}, {w.precision}, {w.optimizer}, checkpointing {w.checkpointing}"
                  + (f", {w.peft}" if w.peft.value != "none" else "")))
    loop = loop_text(w)
    if loop:
        items.append(("loop", loop))
    doc.add(KeyValues(items))
    rows = [_boundary_row(b) for b in (r.batch, r.seq) if b is not None]
    doc.add(Table(["axis", "largest that fits", "GiB there", "next step", "GiB there", "limited by"], rows,
                  title="Boundaries (confirmed at the boundary and one step above)"))
    doc.add(Notes(list(r.notes)))
    return doc


def _boundary_row(b: Boundary) -> list[str]:
    at = _gib(b.at.peak.device_used) if b.at else "–"
    above = _gib(b.above.peak.device_used) if b.above else "–"
    nxt = f"{b.value + b.step:,}" if b.above else "–"
    return [b.axis, f"{b.value:,}", at, nxt, above, b.limited_by]


def plan_doc(r: PlanResult, top: int = 10) -> Doc:
    b = r.baseline
    fits = "fits" if b.fits else f"does not fit (short by {_gib(-b.headroom)} GiB)"
    doc = Doc(title=f"Plans for {r.model} on {r.gpu}",
              subtitle=f"as given: {b.label} — {_gib(b.memory)} GiB per GPU, {fits}; "
                       f"usable {_gib(b.usable)} GiB; sorted by {r.sort}")
    rows = [plan_row(i + 1, p) for i, p in enumerate(r.plans[:top])]
    title = f"Pareto front: {len(r.plans)} plan(s) of {r.candidates} candidates"
    if len(r.plans) > top:
        title += f" (top {top} shown; --top N for more)"
    doc.add(Table(_columns(r.plans, PLAN_COLUMNS), rows, title=title, align=["r", "l"] + ["r"] * 9))
    e = r.evaluations
    kv = [("evaluations", f"{e.total} ({e.traces} traces, {e.analytic} analytic)")]
    loop = loop_text(b.workload)
    if loop:
        kv.append(("loop as given", loop))
    if r.budget is not None:
        kv.append(("budget", f"${r.budget:,.2f}/h"))
    bases = {p.price.basis for p in r.plans[:top] if p.price}
    shared = any(p.price and "per-GPU share" in p.price.source for p in r.plans[:top])
    doc.add(KeyValues(kv))
    notes = list(r.notes) + [f"price from {s}" for s in sorted(bases)]
    if shared:
        notes.append("where no instance has exactly that many GPUs, $/h is that many × the listed per-GPU share")
    prices = bases
    if not prices:
        notes.append(f"no on-demand price listed for {r.gpu}: cost columns are blank")
    doc.add(Notes(notes))
    return doc


def ranking_doc(r: Ranking, top: int = 15) -> Doc:
    w = r.workload
    doc = Doc(title=f"Where {r.model} runs: {len(r.ranked)} offer(s), best first by {r.sort}",
              subtitle=f"task {w.task}, batch {w.batch}, seq {w.seq}; memory = predicted nvidia-smi used per "
                       "GPU (GiB = 2^30 B)")
    cols = ["#", "offer", "GPUs", "best plan", "GiB/GPU", "step time", "tokens/s", "$/h", "$/M tok", "checked"]
    rows = []
    for i, ro in enumerate(r.ranked[:top]):
        p = ro.plan
        rows.append([str(i + 1), ro.offer.label, f"{ro.offer.count}× {ro.offer.gpu}", p.label, _gib(p.memory),
                     _secs(p.step.total), _rate(p), _usd(p.price.usd_per_hour if p.price else None),
                     _usd(p.usd_per_mtok), _checked(p)])
    title = "Offers on which the workload fits"
    if len(r.ranked) > top:
        title += f" (top {top} of {len(r.ranked)}; --top N for more)"
    plans = [ro.plan for ro in r.ranked]
    doc.add(Table(_columns(plans, cols), rows, title=title, align=["r", "l", "r", "l"] + ["r"] * 6))
    if r.not_fitting:
        near = sorted(r.not_fitting, key=lambda x: x[1] - x[2])[:5]
        doc.add(Notes([f"{o}: needs {_gib(n)} GiB per GPU, usable {_gib(u)}" for o, n, u in near],
                      title=f"Does not fit ({len(r.not_fitting)} offers; nearest shown)"))
    e = r.evaluations
    doc.add(Notes([f"{r.candidates} candidate configurations, {e.total} memory estimates "
                   f"({e.traces} traces)"] + list(r.notes), title="Notes"))
    doc.add(Notes(list(r.price_sources), title="Price sources (on-demand, as read)"))
    return doc
