"""Generation speed: decode steps written from their exact progression vs traced one by one.

One run prints, side by side:

1. Llama-3.1-8B, bf16, batch 1, prompt 512, 64 new tokens: the fast trace and the
   step-by-step trace (``TraceOptions(extrapolate_decode=False)``) in this process — seconds,
   the ratio, and whether the two event logs are identical (so the peak is equal, not close).
2. Llama-3.1-70B (and Mistral-7B), bf16, prompt 512, 128 new tokens: ``vramplan estimate …
   --task generate`` end to end in fresh processes (70B: median of ``--runs``, after an untimed
   run; target ≤ 5 s), and the in-process
   trace times fast vs step by step (``--quick`` skips the slow step-by-step 70B/Mistral runs).
3. ``--breakdown`` (alone): the 70B estimate's trace and its two replays, CPU seconds in this
   process — where the end-to-end time goes.

Run: ``python bench/generate_speed.py [--quick] [--e2e-only] [--breakdown]``. Times are wall
seconds on this machine; on a shared machine compare the ratios, which are measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time

from vramplan.models.catalog import resolve
from vramplan.trace.run import TraceOptions, trace_workload
from vramplan.workload import Workload

FAST, FULL = TraceOptions(), TraceOptions(extrapolate_decode=False)


def timed(name: str, w: Workload, opts: TraceOptions):
    t = time.perf_counter()
    r = trace_workload(resolve(name), w, options=opts, iterations=1)
    return time.perf_counter() - t, r


def cli(args: list[str]) -> tuple[float, str]:
    """Wall seconds of one CLI run, and how many more estimates its verdict's largest-batch search made."""
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "vramplan.cli.main", *args, "--json"], capture_output=True, text=True)
    wall = time.perf_counter() - t
    if not out.stdout.strip():
        raise SystemExit(f"vramplan {' '.join(args)} failed: {out.stderr.strip()[-300:]}")
    d = json.loads(out.stdout)
    more = next((m.group(1) for n in d.get("notes", ()) if (m := re.search(r"\((\d+) more estimate", n))), "0")
    return wall, f"{d['peak']['device_used']:,} B device_used, largest batch {d['max_batch']}, {d['allocator']['ooms']} OOMs within the GPU ({more} more traces)"


def compare(name: str, new_tokens: int, full: bool) -> None:
    w = Workload(task="generate", precision="bf16", batch=1, seq=512, new_tokens=new_tokens)
    tf, fast = timed(name, w, FAST)
    line = f"{name:<14} {new_tokens:>4} tokens  fast {tf:6.2f} s  peak {fast.peak_allocated:,} B"
    if full:
        ts, slow = timed(name, w, FULL)
        same = list(fast.events.rows()) == list(slow.events.rows())
        line += (f" | step by step {ts:6.2f} s  peak {slow.peak_allocated:,} B"
                 f" | {ts / tf:5.1f}x faster, event logs {'identical' if same else 'DIFFER'}")
    print(line)


def breakdown(name: str = "llama-3.1-70b") -> None:
    """CPU seconds of the estimate's two big parts, in this process: the trace (the model's
    imports and builds included on a first call), and the replays the pipeline runs (without
    a limit, and within the H100's allocator capacity when the step exceeds it)."""
    import gc

    from vramplan.allocator import replay
    from vramplan.engine.device import profile
    from vramplan.engine.resolve import resolve_gpu

    gc.disable()  # as the CLI runs
    w = Workload(task="generate", precision="bf16", batch=1, seq=512, new_tokens=128)
    dev = profile(resolve_gpu("h100-sxm"), w)
    c = time.process_time()
    tr = trace_workload(resolve(name), w, device=dev)
    line = f"{name} generate 128 tokens, CPU s: trace {time.process_time() - c:.2f} ({len(tr.events):,} events)"
    c = time.process_time()
    res = replay(tr.events, segment_map=False)
    line += f", replay {time.process_time() - c:.2f}"
    cap = dev.allocator_capacity
    if cap is not None and res.max_reserved > cap:
        c = time.process_time()
        capped = replay(tr.events, capacity=cap, segment_map=False, first_oom=True)  # (as the pipeline runs it)
        line += f", replay within {cap:,} B to the first OOM {time.process_time() - c:.2f} ({capped.ooms:,} OOM)"
    print(line)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="skip the slow step-by-step 70B / Mistral runs")
    ap.add_argument("--e2e-only", action="store_true", help="only the end-to-end CLI rows (no in-process traces)")
    ap.add_argument("--runs", type=int, default=3, help="end-to-end runs of the 70B estimate (the median is printed)")
    ap.add_argument("--breakdown", action="store_true",
                    help="only the 70B estimate's trace and replays, CPU seconds in this process")
    args = ap.parse_args()
    if args.breakdown:
        breakdown()
        return
    if not args.e2e_only:
        timed("llama-3.1-8b", Workload(task="generate", precision="bf16", batch=1, seq=64, new_tokens=8), FAST)  # warm
        compare("llama-3.1-8b", 64, full=True)
        compare("mistral-7b", 128, full=not args.quick)
        compare("llama-3.1-70b", 128, full=not args.quick)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    torch_s = time.perf_counter() - t
    print(f"python -c 'import torch': {torch_s:.2f} s (same run, for scale)")
    for name, runs in (("llama-3.1-70b", args.runs), ("mistral-7b", 1)):
        cmd = ["estimate", name, "--task", "generate", "--seq", "512", "--new-tokens", "128", "--gpu", "h100-sxm"]
        if runs > 1:
            cli(cmd)  # (untimed: fills the bytecode cache)
        times = []
        for _ in range(runs):
            dt, what = cli(cmd)
            times.append(dt)
        dt = statistics.median(times)
        each = f" (median of {runs}: {', '.join(f'{t:.2f}' for t in times)})" if runs > 1 else ""
        target = f" vs target ≤ 5 s -> ratio {dt / 5:.2f} ({'OK' if dt <= 5 else 'MISSED'})" if "70b" in name else ""
        print(f"vramplan {' '.join(cmd)}: {dt:.2f} s end to end{each}, {dt / torch_s:.1f}× import torch; {what}{target}")


if __name__ == "__main__":
    main()
