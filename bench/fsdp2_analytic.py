"""The analytic method against the trace under FSDP2 (``engine=fsdp``): peak allocated bytes, analytic ÷ trace.

The grid: ZeRO-3 (``reshard_after_forward=True``) and ZeRO-2 (``False``), dp 2/4/8, full training or
LoRA (rank 16 on the attention projections, the default targets), no checkpointing or full, on a
tied model (Llama-3.2-1B) and an untied one (Llama-3.1-8B's width with 4 layers: the trace of all 32
takes minutes on 2 cores; the per-layer terms are the same), bf16-mixed, batch 1, seq 512, AdamW.
With ``--preference`` it adds the DPO (reference model / precomputed) and GRPO rows of
docs/research/trl-reference-fsdp.md (Llama-3.2-1B, ZeRO-2, dp 2 and 4).

Each row prints both peaks, the ratio and the phase each method peaks in; the summary the lowest
and the highest ratio. The trace is torch's real FSDP2 on a fake process group (checked against real
gloo runs, tests/test_rl_fsdp1.py, tests/test_dist_*). Figures are allocated bytes for an H100
(its cuBLAS workspaces).

Run: ``python bench/fsdp2_analytic.py`` (about 48 traces: minutes on 2 cores; ``--quick`` runs dp 2
and 8 only).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from vramplan.engine import estimate
from vramplan.errors import VramplanError
from vramplan.models.catalog import resolve
from vramplan.models.normalize import spec_from_config
from vramplan.workload import Parallel, Workload


def _few_layers(name: str, layers: int) -> Any:
    c = dict(resolve(name).config)
    c["num_hidden_layers"] = layers
    return spec_from_config(c, name=f"{name}-{layers}-layers", source="bench")


def _peak(spec: Any, w: Workload, method: str) -> tuple[int, str]:
    r = estimate(spec, w, gpu="h100", method=method, search_max_batch=False)
    top = max(r.phases, key=lambda ph: ph.allocated)
    return r.peak.allocated, top.phase.value


def _row(label: str, spec: Any, w: Workload) -> float | None:
    t0 = time.perf_counter()
    try:
        (a, pa), (t, pt) = _peak(spec, w, "analytic"), _peak(spec, w, "trace")
    except VramplanError as e:
        print(f"{label:58} not estimated: {e}")
        return None
    print(f"{label:58} {a:>15,} {t:>15,} {a / t:8.4f}  {pa:>9} {pt:>9}  ({time.perf_counter() - t0:.0f} s)",
          flush=True)
    return a / t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="dp 2 and 8 only")
    ap.add_argument("--preference", action="store_true", help="add the DPO and GRPO rows (ZeRO-2)")
    ap.add_argument("--zero", type=int, choices=(2, 3), help="one ZeRO stage only")
    args = ap.parse_args(argv)
    models = [("llama-3.2-1b", resolve("llama-3.2-1b")), ("8b-width-4L", _few_layers("llama-3.1-8b", 4))]
    print(f"{'case':58} {'analytic':>15} {'trace':>15} {'a / t':>8}  {'a peak':>9} {'t peak':>9}")
    ratios = []
    for label, spec in models:
        for zero in (args.zero,) if args.zero else (3, 2):
            for dp in (2, 8) if args.quick else (2, 4, 8):
                for peft in ("none", "lora"):
                    for ckpt in ("none", "full"):
                        w = Workload(task="train", batch=1, seq=512, precision="bf16-mixed", peft=peft,
                                     checkpointing=ckpt, parallel=Parallel(dp=dp, zero=zero, engine="fsdp"))
                        r = _row(f"{label} zero={zero} dp={dp} peft={peft} ckpt={ckpt}", spec, w)
                        if r is not None:
                            ratios.append(r)
    if args.preference:
        spec = resolve("llama-3.2-1b")
        for dp in (2, 4):
            for ref in ("model", "precomputed"):
                w = Workload(task="train", batch=1, seq=512, objective="dpo", reference=ref,
                             parallel=Parallel(dp=dp, zero=2, engine="fsdp"))
                r = _row(f"llama-3.2-1b dpo reference={ref} zero=2 dp={dp}", spec, w)
                if r is not None:
                    ratios.append(r)
        for ref in ("model", "none"):
            w = Workload(task="train", objective="grpo", prompt=256, seq=288, generations=8, batch=8, reference=ref,
                         parallel=Parallel(dp=2, zero=2, engine="fsdp"))
            r = _row(f"llama-3.2-1b grpo reference={ref} zero=2 dp=2", spec, w)
            if r is not None:
                ratios.append(r)
    if ratios:
        print(f"\n{len(ratios)} cases: analytic / trace from {min(ratios):.4f} to {max(ratios):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
