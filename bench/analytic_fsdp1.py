"""The analytic method's FSDP1 formulas (``engine=fsdp1``, :mod:`vramplan.analytic.fsdp1`) against the trace.

The trace runs torch's own ``FullyShardedDataParallel`` on the fake process group (``trace/layout.py``
``_fsdp1``, checked against real gloo runs in ``tests/test_trace_gloo.py``): it is the truth here.
For each workload this prints rank 0's analytic ÷ traced peak bytes per phase (forward, backward,
optimizer: the traced tensor bytes), for the step in the same bytes (``peak``: the highest phase of
each), and against the trace's ``max_memory_allocated`` (``alloc``: it adds the caching allocator's
512-byte rounding and unsplit block remainders, ~8 MB at the small width, which no analytic path
models); it fails when a ``peak`` ratio is off by more than 2 % (and prints the worst phase).

Grid: a 4-layer Llama-like model at width 1024 (vocab 8192; the trace takes ~4 s a point) over dp
2/4/8 × ZeRO-3/2 × backward prefetch pre/post/none × bf16-mixed/fp32 × checkpointing none/full
(``--quick``: dp 2/4/8 at ZeRO-3, backward-pre, bf16-mixed, and each other knob once at dp 4), three
with 2 accumulation steps (``accum``), then Llama-3.2-1B's widths (all 16 layers, seq 1024) at a few points.

Run: ``python bench/analytic_fsdp1.py [--quick] [--no-1b]`` (~3 min on 2 cores; ``trace s`` is 0 where the
result store already holds the trace: ``VRAMPLAN_NO_CACHE=1`` traces again).
"""

from __future__ import annotations

import itertools
import sys
import time

from vramplan import estimate
from vramplan.models.catalog import resolve
from vramplan.models.normalize import spec_from_config
from vramplan.models.spec import ModelSpec
from vramplan.workload import Phase, Workload

TOLERANCE = 0.02


def tiny() -> ModelSpec:
    """Llama-3.1-8B's layout at 4 layers, width 1024, vocab 8192."""
    c = dict(resolve("llama-3.1-8b").config)
    c.update(num_hidden_layers=4, hidden_size=1024, intermediate_size=2816, vocab_size=8192,
             num_attention_heads=8, num_key_value_heads=4, head_dim=128)
    return spec_from_config(c, name="tiny-llama-4x1024", source="bench")


def grid(quick: bool) -> list[tuple[int, int, str, str, str]]:
    """(dp, zero, prefetch, precision, checkpointing)."""
    base = [(dp, 3, "backward-pre", "bf16-mixed", "none") for dp in (2, 4, 8)]
    if quick:
        return base + [(4, 2, "backward-pre", "bf16-mixed", "none"), (4, 3, "backward-post", "bf16-mixed", "none"),
                       (4, 3, "none", "bf16-mixed", "none"), (4, 3, "backward-pre", "fp32", "none"),
                       (4, 3, "backward-pre", "bf16-mixed", "full")]
    full = list(itertools.product((2, 4, 8), (3, 2), ("backward-pre", "backward-post", "none"), ("bf16-mixed", "fp32"),
                                  ("none", "full")))
    return full


def row(spec: ModelSpec, w: Workload) -> tuple[dict[Phase, tuple[int, int]], float, float]:
    t0 = time.perf_counter()
    tr = estimate(spec, w, method="trace", search_max_batch=False)
    secs = time.perf_counter() - t0
    an = estimate(spec, w, method="analytic", search_max_batch=False)
    traced = {p.phase: p.allocated for p in tr.phases}
    phases = {p.phase: (p.allocated, traced[p.phase]) for p in an.phases if p.phase in traced}
    return phases, an.peak.allocated / tr.peak.allocated, secs


def peak_ratio(phases: dict[Phase, tuple[int, int]]) -> float:
    """The highest analytic phase ÷ the highest traced phase (tensor bytes)."""
    return max(a for a, _ in phases.values()) / max(t for _, t in phases.values())


def main(argv: list[str]) -> int:
    quick, with_1b = "--quick" in argv, "--no-1b" not in argv
    cases: list[tuple[ModelSpec, Workload]] = []
    small = tiny()
    for dp, zero, prefetch, precision, ckpt in grid(quick):
        w = Workload(task="train", batch=1, seq=256, precision=precision, checkpointing=ckpt)
        cases.append((small, w.replace(dp=dp, zero=zero, engine="fsdp1", fsdp1_prefetch=prefetch)))
    for dp, zero, prefetch, precision, ckpt in ((2, 3, "backward-pre", "bf16-mixed", "none"),
                                                (4, 2, "backward-pre", "bf16-mixed", "full"),
                                                (4, 3, "none", "fp32", "none")):
        w = Workload(task="train", batch=1, seq=256, precision=precision, checkpointing=ckpt, grad_accum=2)
        cases.append((small, w.replace(dp=dp, zero=zero, engine="fsdp1", fsdp1_prefetch=prefetch)))
    if with_1b:
        one_b = resolve("llama-3.2-1b")
        for dp, zero, precision, ckpt in ((8, 3, "bf16-mixed", "none"), (8, 3, "bf16-mixed", "full"),
                                          (4, 2, "bf16-mixed", "full"), (2, 3, "fp32", "full")):
            w = Workload(task="train", batch=1, seq=1024, precision=precision, checkpointing=ckpt)
            cases.append((one_b, w.replace(dp=dp, zero=zero, engine="fsdp1")))
    print(f"{'model':18} {'dp':>2} {'zero':>4} {'prefetch':13} {'precision':10} {'ckpt':4} {'accum':>5} "
          f"{'forward':>8} {'backward':>8} {'optimizer':>9} {'peak':>7} {'alloc':>7} {'trace s':>7}")
    worst = worst_phase = 0.0
    for spec, w in cases:
        p = w.parallel
        phases, step, secs = row(spec, w)
        cells = [f"{phases[ph][0] / phases[ph][1]:.4f}" if ph in phases else "-"
                 for ph in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)]
        worst = max(worst, abs(peak_ratio(phases) - 1))
        worst_phase = max([worst_phase, *(abs(a / t - 1) for a, t in phases.values())])
        print(f"{spec.name:18} {p.dp:>2} {p.zero:>4} {p.fsdp1_prefetch.value:13} {w.precision.value:10} "
              f"{w.checkpointing.value:4} {w.grad_accum:>5} {cells[0]:>8} {cells[1]:>8} {cells[2]:>9} {peak_ratio(phases):7.4f} {step:7.4f} "
              f"{secs:7.1f}",
              flush=True)
    print(f"worst peak |analytic / trace - 1|: {worst:.4f} (tolerance {TOLERANCE}); worst phase: {worst_phase:.4f}")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
