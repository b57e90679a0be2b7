"""Trace time of tensor / sequence, pipeline and context parallel layouts (issue 12), as ratios
to the single-GPU trace of the same step.

Llama-3.1-8B training step (bf16-mixed, AdamW foreach, full checkpointing, batch 1, seq 4096,
2 iterations), each layout traced in a fresh process:

- one GPU (the reference);
- TP=8 with sequence parallelism (DTensor ``parallelize_module``, torchtitan's plan): rank 0;
- PP=4, 1F1B over 4 micro-batches (``torch.distributed.pipelining``): the first and the last
  stage, each a trace (the time is both);
- CP=4 (``context_parallel`` ring attention): rank 0;
- Llama-3.1-70B TP=8 (``--quick`` skips it).

Each row also prints the traced peak allocated and the analytic one for the same layout.
Run: ``python bench/parallel_speed.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

GiB = 2**30
STEP = {"task": "train", "batch": 1, "seq": 4096, "precision": "bf16-mixed", "optimizer": "adamw",
        "optimizer_impl": "foreach", "checkpointing": "full"}

_CHILD = """
import json, sys, time
from vramplan import Parallel, Workload, estimate
from vramplan.models.catalog import resolve
from vramplan.trace.run import trace_workload
from vramplan.trace.testing import tiny_spec
args = json.loads(sys.argv[2])
par = Parallel(**args.pop("parallel"))
w = Workload(**args, parallel=par)
small = Parallel(tp=min(par.tp, 2), sp=par.sp, pp=min(par.pp, 2), cp=min(par.cp, 2))
trace_workload(tiny_spec("llama-3.1-8b", layers=4), w.replace(seq=128, parallel=small))  # imports, first calls
t = time.perf_counter()
r = trace_workload(resolve(sys.argv[1]), w)
dt = time.perf_counter() - t
a = estimate(sys.argv[1], w, method="analytic", search_max_batch=False)
print(json.dumps({"seconds": dt, "peak": r.peak_allocated, "analytic": a.peak.allocated}))
"""


def run(model: str, parallel: dict[str, object], **extra: object) -> dict[str, float]:
    args = {**STEP, **extra, "parallel": parallel}
    out = subprocess.run([sys.executable, "-c", _CHILD, model, json.dumps(args)], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="skip Llama-3.1-70B TP=8")
    opts = ap.parse_args()
    rows = [
        ("Llama-3.1-8B, one GPU", "llama-3.1-8b", {}, {}),
        ("Llama-3.1-8B, TP=8 + SP (rank 0)", "llama-3.1-8b", {"tp": 8, "sp": True}, {}),
        ("Llama-3.1-8B, PP=4 1F1B x4 (stages 0 and 3)", "llama-3.1-8b", {"pp": 4}, {"grad_accum": 4}),
        ("Llama-3.1-8B, CP=4 ring attention (rank 0)", "llama-3.1-8b", {"cp": 4}, {}),
    ]
    if not opts.quick:
        rows.append(("Llama-3.1-70B, TP=8 + SP (rank 0)", "llama-3.1-70b", {"tp": 8, "sp": True}, {}))
    base: float | None = None
    print(f"{'layout':<46} {'trace s':>8} {'x 1-GPU':>8} {'trace GiB':>10} {'analytic GiB':>13}")
    for label, model, par, extra in rows:
        r = run(model, par, **extra)
        if base is None:
            base = r["seconds"]
        print(f"{label:<46} {r['seconds']:>8.1f} {r['seconds'] / base:>8.2f} {r['peak'] / GiB:>10.2f} "
              f"{r['analytic'] / GiB:>13.2f}")


if __name__ == "__main__":
    main()
