"""Speed of per-rank traces on the fake process group (issue 12), as ratios to the
single-GPU trace of the same step, in one run:

1. Llama-3.1-8B, FSDP2 over 8 ranks (ZeRO-3), bf16-mixed, batch 1, seq 4096, 2 iterations
   (target ≤ 15 s); the same step unsharded on one GPU is the reference.
2. Llama-3.1-70B, FSDP2 over 64 ranks (target ≤ 30 s), against its one-GPU trace.
3. TP × FSDP2 (2-D mesh, torchtitan's layout: tensor + sequence parallel over tp=8, FSDP2
   ZeRO-3 over dp): Llama-3.1-8B tp 8 × dp 8 and Llama-3.1-70B tp 8 × dp 64, against the same
   one-GPU traces.
4. World size costs nothing: rank 0 of 8 vs rank 0 of 1,024 in CPU seconds (target: ratio ≤ 1.1).
5. Real-run agreement: FSDP2 and DDP run for real over 2 gloo CPU processes vs the trace of
   each rank (``trace.testing.dist_agreement``; target: within 1 %), and every pipeline
   schedule over 2 processes (``trace.testing.pipeline_agreement``).

Checkpointing: torchtitan's op-level selective checkpointing (``checkpointing=op``) once the
trace implements it (``vramplan.trace.sac``); until then full checkpointing, and the run says
which it used.

Run: ``python bench/dist_speed.py`` (``--quick`` skips the 70B pair).
"""

from __future__ import annotations

import argparse
import importlib.util
import time
import warnings

from vramplan.models.catalog import resolve
from vramplan.trace.run import trace_workload
from vramplan.trace.testing import tiny_spec
from vramplan.workload import Workload

GiB = 2**30


def checkpointing() -> str:
    return "op" if importlib.util.find_spec("vramplan.trace.sac") is not None else "full"


def step() -> Workload:
    return Workload(task="train", batch=1, seq=4096, precision="bf16-mixed", checkpointing=checkpointing())


def line(what: str, value: str, target: str, ok: bool | None) -> None:
    mark = "    " if ok is None else ("PASS" if ok else "MISS")
    print(f"{mark}  {what:<58} {value:<30} {target}")


def timed(name: str, w: Workload) -> tuple[float, int]:
    t = time.perf_counter()
    r = trace_workload(resolve(name), w)
    return time.perf_counter() - t, r.peak_allocated


def warm_up() -> None:
    w = step().replace(seq=64)
    trace_workload(tiny_spec("llama-3.1-8b"), w)
    trace_workload(tiny_spec("llama-3.1-8b"), w.replace(dp=8, zero=3))
    trace_workload(tiny_spec("llama-3.1-8b"), w.replace(dp=8, zero=3, tp=2, sp=True))


def pair(name: str, dp: int, target: float) -> float:
    """Returns the one-GPU trace's seconds (the reference of the TP × FSDP row)."""
    w = step()
    t1, p1 = timed(name, w)
    tn, pn = timed(name, w.replace(dp=dp, zero=3))
    line(f"{name} one GPU (reference)", f"{t1:6.1f} s  peak {p1 / GiB:6.1f} GiB", "", None)
    line(f"{name} FSDP2 x {dp}, rank 0", f"{tn:6.1f} s  peak {pn / GiB:6.1f} GiB", f"<= {target:g} s", tn <= target)
    line(f"{name} FSDP2 x {dp} / one GPU", f"{tn / t1:6.2f}x", "", None)
    return t1


def tp_fsdp(name: str, tp: int, dp: int, one_gpu: float) -> None:
    """The 2-D trace against the one-GPU trace and against TP alone (what DTensor's dispatch of
    the TP plan costs is in both; what FSDP2 adds on top is the second ratio)."""
    ta, pa = timed(name, step().replace(tp=tp, sp=True))
    tn, pn = timed(name, step().replace(tp=tp, sp=True, dp=dp, zero=3))
    line(f"{name} TP {tp} (sp) alone, rank 0", f"{ta:6.1f} s  peak {pa / GiB:6.1f} GiB", "", None)
    line(f"{name} TP {tp} x FSDP2 {dp} (sp), rank 0", f"{tn:6.1f} s  peak {pn / GiB:6.1f} GiB", "", None)
    line(f"{name} TP {tp} x FSDP2 {dp} / one GPU; / TP alone", f"{tn / one_gpu:6.2f}x; {tn / ta:.2f}x", "", None)


def cpu_seconds(name: str, w: Workload) -> float:
    t = time.process_time()
    trace_workload(resolve(name), w)
    return time.process_time() - t


def world_size() -> None:
    """CPU seconds (the steadier figure on a shared machine), the lower of two runs each."""
    w = step()
    t8 = min(cpu_seconds("llama-3.1-8b", w.replace(dp=8, zero=3)) for _ in range(2))
    t1024 = min(cpu_seconds("llama-3.1-8b", w.replace(dp=1024, zero=3)) for _ in range(2))
    line("llama-3.1-8b rank 0 of 1,024 / rank 0 of 8 (CPU s)", f"{t1024 / t8:6.2f}x ({t1024:.1f} s / {t8:.1f} s)",
         "<= 1.1x", t1024 / t8 <= 1.1)


def agreement() -> None:
    from vramplan.trace.testing import dist_agreement

    for layout, rank, real, traced in dist_agreement(world=2):
        err = (traced - real) / real
        line(f"{layout} over 2 gloo processes, rank {rank}: trace vs real",
             f"{err:+.4%} ({traced:,} / {real:,} B)", "within 1 %", abs(err) < 0.01)
    from vramplan.trace.run import TraceOptions, trace_model
    from vramplan.trace.testing import block_inputs, block_model, real_dist_peaks
    from vramplan.workload import Precision, Task, Workload

    for strategy, zero in (("FULL_SHARD", 3), ("SHARD_GRAD_OP", 2), ("NO_SHARD", 0)):
        real = real_dist_peaks(block_model, block_inputs, world=2, layout=f"fsdp1-{strategy}-BACKWARD_PRE")
        w = Workload(task=Task.TRAIN, precision=Precision.FP32).replace(dp=2, zero=zero, engine="fsdp1")
        for rank, peak in enumerate(real):
            traced = trace_model(block_model, block_inputs(), workload=w,
                                 options=TraceOptions(workspaces=False, count_flops=False, rank=rank)).peak_allocated
            err = (traced - peak) / peak
            line(f"fsdp1 {strategy} over 2 gloo processes, rank {rank}: trace vs real",
                 f"{err:+.4%} ({traced:,} / {peak:,} B)", "within 0.01 %", abs(err) < 1e-4)
    from vramplan.trace.testing import pipeline_agreement
    from vramplan.workload import PP_SCHEDULES

    for schedule, rank, real, traced in pipeline_agreement(PP_SCHEDULES):
        err = (traced - real) / real
        line(f"pp=2 {schedule} over 2 gloo processes, rank {rank}: trace vs real",
             f"{err:+.4%} ({traced:,} / {real:,} B)", "within 1 %", abs(err) < 0.01)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="skip the Llama-3.1-70B pair")
    ap.add_argument("--agreement-only", action="store_true", help="only the real gloo run agreement")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    if args.agreement_only:
        agreement()
        return
    ck = checkpointing()
    print(f"checkpointing={ck}" + ("" if ck == "op" else " (op-level selective checkpointing is not in this tree)"))
    warm_up()
    t8 = pair("llama-3.1-8b", 8, 15.0)
    t70 = 0.0 if args.quick else pair("llama-3.1-70b", 64, 30.0)
    tp_fsdp("llama-3.1-8b", 8, 8, t8)
    if not args.quick:
        tp_fsdp("llama-3.1-70b", 8, 64, t70)
    world_size()
    agreement()


if __name__ == "__main__":
    main()
