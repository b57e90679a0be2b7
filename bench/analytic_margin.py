"""How far the trace's device memory lies above the analytic formulas', where ``fit`` searches.

When ``auto`` cannot trace (no ``vramplan[models]``), ``fit`` and the estimate's largest batch
answer from the formulas and keep a margin below the usable memory, one per kind of job
(:mod:`vramplan.engine.margin`). This script measures what each margin must cover: for the
workloads of ``tests/test_engine_agreement.py`` (each kind the planner meets), the analytic and
the traced device used at batch 1 and at the analytic largest batch (the point a fallback
``fit`` would answer), and the ratio trace / analytic − 1; it fails when a ratio exceeds its
kind's margin.

Run: ``python bench/analytic_margin.py`` (traces 8B-70B models: minutes on 2 cores).
"""

from __future__ import annotations

import sys
import time

from vramplan.engine import estimate
from vramplan.engine.margin import margin_of
from vramplan.engine.resolve import resolve_model
from vramplan.errors import VramplanError
from vramplan.planner.fit import fit
from vramplan.workload import Workload

CASES = [  # tests/test_engine_agreement.py ANALYTIC (model, workload, GPU)
    ("llama-3.1-8b", Workload(task="train", peft="lora", checkpointing="full"), "rtx-4090"),
    ("llama-3.1-8b", Workload(task="train", peft="qlora"), "rtx-4090"),
    ("llama-3.1-8b", Workload(task="train", peft="qlora", checkpointing="full", seq=4096), "l4"),
    ("llama-3.1-8b", Workload(task="train", checkpointing="full").replace(dp=8, zero=3), "h100-sxm"),
    ("llama-3.1-8b", Workload(task="train", optimizer="adamw-8bit").replace(dp=4, zero=2), "a100-sxm4-80gb"),
    ("llama-3.1-8b", Workload(task="generate", seq=1024, new_tokens=512), "l4"),
    ("mistral-7b", Workload(task="infer", seq=4096), "a10g"),
    ("qwen2.5-0.5b", Workload(task="train", precision="bf16-mixed"), "rtx-4060"),
    ("gpt2", Workload(task="train", precision="fp16-mixed", seq=1024, attention="eager"), "t4"),
    ("bert-base", Workload(task="train", seq=512), "t4"),
    ("mixtral-8x7b", Workload(task="train", peft="qlora", checkpointing="full"), "h100-sxm"),
    ("llama-3.1-70b", Workload(task="train", peft="lora", checkpointing="full"), "h100-sxm"),
]


def _used(model: str, w: Workload, gpu: str, method: str) -> int:
    return estimate(model, w, gpu=gpu, method=method, search_max_batch=False).peak.device_used


def main() -> int:
    short = []
    print(f"{'model':14} {'workload':44} {'gpu':15} {'batch':>5} {'analytic GiB':>12} {'trace GiB':>10} "
          f"{'trace/analytic-1':>17} {'margin':>7}")
    for model, w, gpu in CASES:
        m = margin_of(resolve_model(model), w)
        try:
            top = fit(model, w, gpu=gpu, method="analytic").max_batch
        except VramplanError:
            top = 0
        for b in sorted({1, max(top, 1)}):
            wb = w.replace(batch=b)
            t0 = time.perf_counter()
            label = f"{w.task} {w.peft} ckpt={w.checkpointing} seq={w.seq} dp={w.parallel.dp} z={w.parallel.zero}"
            try:
                a, t = _used(model, wb, gpu, "analytic"), _used(model, wb, gpu, "trace")
            except VramplanError as e:
                print(f"{model:14} {label:44} {gpu:15} {b:>5}  not traced: {e}")
                continue
            r = t / a - 1
            if r > m.margin:
                short.append(f"{model} {label} batch {b}: {r:+.2%} > {m.kind} margin {m.margin:.0%}")
            print(f"{model:14} {label:44} {gpu:15} {b:>5} {a / 2**30:12.2f} {t / 2**30:10.2f} {r:+17.2%} "
                  f"{m.margin:>7.0%}   {m.kind} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print("\n" + ("\n".join(["margins too small:", *short]) if short else "every margin covers its kind's cases"))
    return 1 if short else 0


if __name__ == "__main__":
    sys.exit(main())
