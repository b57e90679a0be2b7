"""Checkpointing policies, activation offload and torch.compile on one workload: allocated peak
and pinned host RAM by both methods, step time from the runtime model.

Llama-3.1-8B, LoRA r=16, bf16-mixed, batch 1, seq 4096, on an H100 SXM (both methods on the
same device profile; the trace runs 2 iterations on fake tensors):

    PYTHONPATH=src .venv/bin/python bench/loop_policies.py
"""

from __future__ import annotations

import time

BASE = dict(task="train", batch=1, seq=4096, precision="bf16-mixed", peft="lora")
ROWS = [
    ("none", dict(checkpointing="none")),
    ("full", dict(checkpointing="full")),
    ("full, every 2nd layer", dict(checkpointing="full", checkpoint_every=2)),
    ("op (torchtitan SAC)", dict(checkpointing="op")),
    ("selective (Megatron-style)", dict(checkpointing="selective")),
    ("none + activation offload", dict(checkpointing="none", activation_offload=True)),
    ("full + activation offload", dict(checkpointing="full", activation_offload=True)),
    ("none + compile", dict(checkpointing="none", compile=True)),
    ("full + compile", dict(checkpointing="full", compile=True)),
    ("op + compile", dict(checkpointing="op", compile=True)),
]
GIB = 2**30


def main() -> None:
    import vramplan
    from vramplan.hardware.catalog import get_gpu
    from vramplan.models.catalog import resolve
    from vramplan.runtime import step_time

    spec, gpu = resolve("llama-3.1-8b"), get_gpu("h100-sxm")
    print("| loop | analytic GiB | trace GiB | host RAM GiB (analytic / trace) | step s | trace s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    import sys

    only = sys.argv[1:]  # row names to run (default: all)
    for name, kw in ROWS:
        if only and name not in only:
            continue
        a = vramplan.estimate(spec, gpu="h100-sxm", method="analytic", search_max_batch=False, **BASE, **kw)
        t0 = time.perf_counter()
        t = vramplan.estimate(spec, gpu="h100-sxm", method="trace", search_max_batch=False, **BASE, **kw)
        dt = time.perf_counter() - t0
        st = step_time(spec, a.workload, gpu)
        print(f"| {name} | {a.peak.allocated / GIB:.2f} | {t.peak.allocated / GIB:.2f} | "
              f"{a.host_memory / GIB:.2f} / {t.host_memory / GIB:.2f} | {st.total:.2f} | {dt:.1f} |")


if __name__ == "__main__":
    main()
