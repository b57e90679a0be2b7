"""What every inference engine's sizing reads from vramplan's own estimate: weights per rank and
the activation peak of a forward over a flat batch of tokens (:func:`forward`).

- **Weights** per TP rank (first pipeline stage) and the **forward peak** come from
  vramplan's own estimate (:func:`vramplan.engine.estimate`) of a prefill of ``tokens`` positions at
  batch 1 (``task="generate"``, so logits are computed for the last position only, as an
  engine's profile run does), analytic by default, traced when ``method="trace"``. The
  activation peak is that phase's allocated peak minus the weights and minus the KV cache
  transformers builds during the prefill (engines profile without a KV pool).
- **Quantisation**: ``fp8`` weights 1 B (+ a scale per output row), ``bitsandbytes`` NF4
  (vramplan's bitsandbytes rules), ``awq``/``gptq`` 4-bit packed + one fp16 scale and one
  4-bit zero point per group of 128 (AutoAWQ / GPTQ ``group_size=128`` layout:
  0.5 + 2/128 + 0.5/128 B per weight) on the linear layers; embeddings and norms stay 16 bit.
  The linear-layer element count is the difference of the 16-bit and fp8 estimates.
  AWQ/GPTQ/fp8 kernels do not dequantise whole matrices, so their forward peak is the
  16-bit model's. ``mxfp4`` (gpt-oss in vLLM): the routed experts are held as vLLM's MXFP4 MoE
  method holds them (:func:`vramplan.pools.mxfp4.expert_bytes`, padded to ``mxfp4_align``), the
  rest 16 bit.
"""

from __future__ import annotations

from vramplan.errors import WorkloadError
from vramplan.models.spec import Family, ModelSpec
from vramplan.pools.base import AWQ_BYTES_PER_WEIGHT, Forward


def forward(spec: ModelSpec, *, tokens: int, tp: int, pp: int, quant: str, dtype: str,
            method: str = "analytic", mxfp4_align: tuple[int, int] | None = None) -> Forward:
    """Weights on one rank and the activation peak of a forward over ``tokens`` tokens.

    Above the model's maximum positions the peak is scaled linearly from a forward at
    that length (a flat batch of several requests costs about what one long one does)."""
    if tokens < 1:
        raise WorkloadError(f"token budget must be >= 1, got {tokens}")
    limit = spec.max_positions - 1 if spec.max_positions > 1 else tokens  # + 1 generated position
    run = min(tokens, limit)
    # TP above the KV heads: engines replicate K/V; vramplan's estimators split by heads, so
    # estimate at tp = kv_heads and scale by kv_heads / tp (the replicated K/V projections,
    # a few % of the weights, are under-counted).
    etp, scale = tp, 1.0
    if spec.kv_heads and tp > spec.kv_heads and spec.family is not Family.MLA:
        etp, scale = spec.kv_heads, spec.kv_heads / tp
    w16, act, used = _estimate(spec.name, spec, run, etp, pp,
                               "none" if quant in ("awq", "gptq", "fp8", "mxfp4") else quant, dtype, method)
    if tokens > run:
        act = act * tokens // run
    w16, act = int(w16 * scale), int(act * scale)
    weights = w16
    if quant in ("fp8", "awq", "gptq"):
        w8, _, _ = _estimate(spec.name, spec, min(run, 16), etp, pp, "fp8", dtype, "analytic")
        w8 = int(w8 * scale)
        if quant == "fp8":
            weights = w8
        else:
            linear = max(0, w16 - w8)
            weights = int(w16 - 2 * linear + AWQ_BYTES_PER_WEIGHT * linear)
    elif quant == "mxfp4":
        weights = w16 - _mxfp4_saving(spec, tp, pp, mxfp4_align)
    return Forward(weights=weights, activation_peak=act, tokens=tokens, method=used, expert_elems=expert_elems(spec))


def _mxfp4_saving(spec: ModelSpec, tp: int, pp: int, align: tuple[int, int] | None) -> int:
    """The 16-bit estimate's routed experts on one rank (linear weights split over TP, their biases
    whole, as the analytic estimate counts them) less what vLLM holds for them in MXFP4."""
    from vramplan.pools.mxfp4 import expert_bytes

    if align is None or spec.model_type != "gpt_oss" or pp != 1:
        raise WorkloadError(f"`quantization=mxfp4` is modelled for gpt-oss in vLLM on one pipeline stage, not {spec.name}"
                            + (f" with pp={pp}" if pp != 1 else ""), hint="use quantization none", field="quantization")
    e, i, h = spec.n_experts, spec.moe_intermediate, spec.hidden
    layers = spec.layers
    held16 = 2 * expert_elems(spec) // tp + 2 * layers * e * (2 * i + h)
    return held16 - layers * e * expert_bytes(i, h, tp, align)


def expert_elems(spec: ModelSpec) -> int:
    """The routed experts' elements in the whole model (0 for a dense one): the analytic
    architecture's expert stacks, what vLLM's ``FusedMoE`` holds as ``w13``/``w2``."""
    if not spec.is_moe:
        return 0
    from vramplan.analytic.estimate import build_arch

    arch = build_arch(spec)
    return sum(lin.params * g.count for g in arch.groups for lin in g.linears if lin.expert)


_CACHE: dict[tuple[object, ...], tuple[int, int, str]] = {}


def _estimate(key: str, spec: ModelSpec, tokens: int, tp: int, pp: int, quant: str, dtype: str,
              method: str) -> tuple[int, int, str]:
    """One estimate, memoised on the model's name and the inputs (searches repeat them)."""
    k = (key, spec.hub_id, spec.source, tokens, tp, pp, quant, dtype, method)
    if k not in _CACHE:
        if len(_CACHE) > 512:
            _CACHE.clear()
        _CACHE[k] = _run_estimate(spec, tokens, tp, pp, quant, dtype, method)
    return _CACHE[k]


def _run_estimate(spec: ModelSpec, tokens: int, tp: int, pp: int, quant: str, dtype: str,
                  method: str) -> tuple[int, int, str]:
    from vramplan.workload import Parallel, Precision, Quant, Task, Workload

    from .pipeline import estimate

    wq = {"none": Quant.NONE, "fp8": Quant.FP8, "bitsandbytes": Quant.NF4}[quant]
    w = Workload(task=Task.GENERATE, batch=1, seq=tokens, new_tokens=1, precision=Precision(dtype), quant=wq,
                 parallel=Parallel(tp=tp, pp=pp))
    report = estimate(spec, w, method=method, search_max_batch=False)
    prefill = [p for p in report.phases if str(getattr(p.phase, "value", p.phase)) == "prefill"]
    if prefill:
        b = prefill[0].breakdown
        act = prefill[0].allocated - b.weights - b.kv_cache
    else:
        b = report.breakdown
        act = report.peak.allocated - b.weights - b.kv_cache
    return report.breakdown.weights, max(0, act), str(getattr(report.method, "value", report.method))


__all__ = ["forward"]
