"""`vramplan run` on an unmodified HF Trainer script vs `vramplan estimate` of the same model and
workload, end to end (fresh processes, wall seconds), side by side in one run.

Target: run ≤ 2× estimate. The script is tests/examples/hf_trainer.py (a 4-layer Llama built from
its config, bf16, batch 4, seq 128, 2 optimizer steps); the estimate gets the same config as a
local config.json with --task train --precision bf16-mixed --batch 4 --seq 128 --method trace.

    python bench/run_speed.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
          "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 4096,
          "max_position_embeddings": 1024, "torch_dtype": "float32"}


def wall(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cli = [sys.executable, "-m", "vramplan.cli.main"]
    with tempfile.TemporaryDirectory() as d:
        cfg = Path(d) / "config.json"
        cfg.write_text(json.dumps(CONFIG))
        run = cli + ["run", "--gpu", "h100-sxm", "--json", "--", "python", "tests/examples/hf_trainer.py",
                     "--bf16", "--batch", "4", "--seq", "128"]
        est = cli + ["estimate", str(cfg), "--task", "train", "--precision", "bf16-mixed", "--batch", "4",
                     "--seq", "128", "--method", "trace", "--gpu", "h100-sxm", "--json"]
        runs, ests = [], []
        for _ in range(args.repeats):
            runs.append(wall(run))
            ests.append(wall(est))
    r, e = statistics.median(runs), statistics.median(ests)
    print(f"vramplan run -- python tests/examples/hf_trainer.py: {r:.2f} s (median of {args.repeats})")
    print(f"vramplan estimate <same config> --method trace:     {e:.2f} s (median of {args.repeats})")
    print(f"ratio run / estimate: {r / e:.2f} (target ≤ 2.00: {'met' if r / e <= 2 else 'MISSED'})")


if __name__ == "__main__":
    main()
