"""Gradient-accumulation fast path (:mod:`vramplan.trace.microsteps`): trace time with the
micro-steps written from two that repeat vs tracing every micro-step, in one run, and whether
the two traces agree (events, peak, FLOPs).

Cases: GPT-2 (124M) at batch 1 × 24 micro-steps of 1,024 tokens (the fix ``fit`` tries for
``--batch 24`` on a 16 GB card) and Llama-3.2-1B at batch 1 × 16 micro-steps of 512 tokens,
bf16-mixed, AdamW, 2 iterations; each timed best of ``--repeat`` (default 2), the two options
alternating so neither gets a warm start the other does not.

Run: ``python bench/accum_speed.py``.
"""

from __future__ import annotations

import argparse
import time

from vramplan.models.catalog import resolve
from vramplan.trace.run import TraceOptions, trace_workload
from vramplan.workload import Workload

CASES = (("gpt2", 24, 1024), ("llama-3.2-1b", 16, 512))


def _same(a, b) -> bool:  # noqa: ANN001
    cols = ("action", "size", "stream", "category", "phase", "iteration")
    return (a.peak_allocated, a.flops, len(a.events)) == (b.peak_allocated, b.flops, len(b.events)) and all(
        getattr(a.events, c) == getattr(b.events, c) for c in cols)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    print(f"{'case':<40} {'every micro-step':>17} {'written':>9} {'speed-up':>9}  same events/peak/FLOPs")
    for name, accum, seq in CASES:
        w = Workload(task="train", batch=1, seq=seq, grad_accum=accum, precision="bf16-mixed", optimizer="adamw")
        best: dict[bool, float] = {True: float("inf"), False: float("inf")}
        results = {}
        for _ in range(args.repeat):
            for fast in (False, True):
                t = time.perf_counter()
                results[fast] = trace_workload(resolve(name), w, options=TraceOptions(extrapolate_accum=fast))
                best[fast] = min(best[fast], time.perf_counter() - t)
        label = f"{name}, 1 x {accum} micro-steps of {seq}"
        print(f"{label:<40} {best[False]:>15.1f} s {best[True]:>7.1f} s {best[False] / best[True]:>8.1f}x  "
              f"{_same(results[True], results[False])}")


if __name__ == "__main__":
    main()
