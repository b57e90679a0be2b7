"""Speed of the analytic estimate: in process (target ≤ 50 ms) and the CLI end to end
(target ≤ 1.5 s, median of several runs). Prints each figure and its ratio to the target.

    .venv/bin/python bench/estimate_speed.py
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ARGS = ["llama-3.1-8b", "--task", "train", "--precision", "bf16-mixed", "--optimizer", "adamw",
        "--batch", "4", "--seq", "2048", "--checkpointing", "full", "--gpu", "h100-sxm",
        "--method", "analytic", "--json"]


def in_process(runs: int = 20) -> float:
    from vramplan.engine import estimate
    from vramplan.models.catalog import resolve
    from vramplan.workload import Workload

    w = Workload(task="train", batch=4, seq=2048, checkpointing="full")
    resolve("llama-3.1-8b")  # warm the config cache, as a long-lived process would have
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        estimate("llama-3.1-8b", w, method="analytic", search_max_batch=False)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def in_process_with_verdict(runs: int = 10) -> float:
    from vramplan.engine import estimate
    from vramplan.workload import Workload

    w = Workload(task="train", batch=4, seq=2048, checkpointing="full")
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        estimate("llama-3.1-8b", w, method="analytic", gpu="h100-sxm")
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def cli(runs: int = 7) -> float:
    exe = shutil.which("vramplan", path=str(Path(sys.executable).parent)) or "vramplan"
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run([exe, "estimate", *ARGS], check=True, capture_output=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    one = in_process()
    print(f"analytic estimate in process (no GPU verdict): {one * 1e3:8.2f} ms  "
          f"target ≤ 50 ms  ratio {one / 0.050:.3f}")
    full = in_process_with_verdict()
    print(f"analytic estimate + verdict + max-batch search: {full * 1e3:7.2f} ms  (informational)")
    e2e = cli()
    print(f"CLI end to end (median of 7):                  {e2e:8.3f} s   "
          f"target ≤ 1.5 s  ratio {e2e / 1.5:.3f}")


if __name__ == "__main__":
    main()
