"""Record ground-truth memory snapshots on a CUDA GPU, for tests/test_snapshot_reader_recorded.py.

Each workload runs in a fresh subprocess (so its trace starts at the allocator's birth and the
allocator configuration is set before torch loads), with
``torch.cuda.memory._record_memory_history(max_entries=...)`` switched on before the first CUDA
allocation. It writes ``<workload>.pickle.gz`` (the ``torch.cuda.memory._snapshot()`` dict,
gzip-compressed, no stack frames) and ``summary.json`` (torch/CUDA versions, GPU,
max_memory_allocated/reserved per workload, whether the ring buffer overflowed). When
vramplan is importable it then replays every snapshot and prints whether it matches.

    .venv/bin/python bench/record_snapshots.py --out tests/data/snapshots      # all, ~1-2 min
    .venv/bin/python bench/record_snapshots.py --only cnn_train --out /tmp/snaps

Workloads (all small; each fits in well under 1 GiB and 100k trace entries):
  cnn_train          a small CNN, SGD with momentum, 4 steps (cuDNN workspaces, small pool)
  transformer_amp    transformer encoder, AdamW, torch.autocast fp16 + GradScaler, 3 steps
  inference          transformer encoder under inference_mode, growing batches
  varlen_fragment    variable sequence lengths through an MLP, keeps a few outputs alive
  varlen_expandable  the same loop with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  streams_empty      side-stream work with record_stream (deferred frees) and empty_cache
  oversize_roundup   max_split_size_mb:64,roundup_power2_divisions:4 with large odd sizes
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MAX_ENTRIES = 100_000

WORKLOADS: dict[str, str] = {  # name -> PYTORCH_CUDA_ALLOC_CONF ("" = defaults)
    "cnn_train": "",
    "transformer_amp": "",
    "inference": "",
    "varlen_fragment": "",
    "varlen_expandable": "expandable_segments:True",
    "streams_empty": "",
    "oversize_roundup": "max_split_size_mb:64,roundup_power2_divisions:4",
}


# ---------------------------------------------------------------------------- workloads
def cnn_train(torch: Any) -> None:
    nn = torch.nn
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10),
    ).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(4):
        x = torch.randn(32, 3, 64, 64, device="cuda")
        y = torch.randint(0, 10, (32,), device="cuda")
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def _encoder(torch: Any, d: int = 256, layers: int = 4) -> Any:
    nn = torch.nn
    layer = nn.TransformerEncoderLayer(d, 8, 4 * d, dropout=0.1, batch_first=True)
    return nn.TransformerEncoder(layer, layers).cuda()


def transformer_amp(torch: Any) -> None:
    model = _encoder(torch)
    head = torch.nn.Linear(256, 1000).cuda()
    params = list(model.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    amp = getattr(torch, "amp", None)
    scaler = amp.GradScaler("cuda") if hasattr(amp, "GradScaler") else torch.cuda.amp.GradScaler()
    for _ in range(3):
        x = torch.randn(16, 128, 256, device="cuda")
        y = torch.randint(0, 1000, (16, 128), device="cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            logits = head(model(x))
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def inference(torch: Any) -> None:
    model = _encoder(torch).eval()
    with torch.inference_mode():
        for batch in (1, 4, 8, 3, 16, 2, 12):
            model(torch.randn(batch, 200, 256, device="cuda"))


def varlen(torch: Any) -> None:
    import random

    rng = random.Random(0)
    nn = torch.nn
    mlp = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)).cuda()
    kept = []
    for step in range(60):
        seq = rng.randint(50, 2000)
        with torch.no_grad():
            out = mlp(torch.randn(seq, 512, device="cuda"))
        if step % 7 == 0:
            kept.append(out)  # long-lived tensors pin parts of segments
        if len(kept) > 4:
            kept.pop(0)


def streams_empty(torch: Any) -> None:
    side = torch.cuda.Stream()
    keep = []
    for i in range(10):
        x = torch.randn(1024, 1024 + 64 * i, device="cuda")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y = x * 2
        x.record_stream(side)  # x's block stays active until side's work completes
        del x
        torch.cuda.current_stream().wait_stream(side)
        keep.append(y.sum())
        if i % 4 == 3:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    torch.cuda.synchronize()


def oversize_roundup(torch: Any) -> None:
    live = []
    for i, mb in enumerate((70, 30, 130, 65, 20, 90, 66, 140, 3, 33)):
        live.append(torch.empty(mb * 1024 * 1024 + 12345 * i, dtype=torch.uint8, device="cuda"))
        if i % 3 == 2:
            live.pop(0)
    del live


def run_worker(name: str, out: Path, max_entries: int) -> dict[str, Any]:
    import torch

    record = torch.cuda.memory._record_memory_history
    try:
        record(enabled="all", context=None, stacks="python", max_entries=max_entries)
    except TypeError:  # older signature
        record(True, trace_alloc_max_entries=max_entries, trace_alloc_record_context=False)
    torch.manual_seed(0)
    t = time.perf_counter()
    fn = {"varlen_fragment": varlen, "varlen_expandable": varlen}.get(name) or globals()[name]
    fn(torch)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    seconds = time.perf_counter() - t
    path = out / f"{name}.pickle.gz"
    with gzip.open(path, "wb") as f:
        pickle.dump(snap, f)
    entries = sum(len(tr) for tr in snap.get("device_traces", []))
    return {
        "file": path.name,
        "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
        "trace_entries": entries,
        "ring_buffer_full": entries >= max_entries,
        "seconds": round(seconds, 2),
    }


# ---------------------------------------------------------------------------- driver
def check_with_vramplan(out: Path, names: list[str]) -> None:
    try:
        from vramplan.snapshot import compare_with_recorded, load_snapshot
    except ImportError:
        print("vramplan not importable: skipping the replay check")
        return
    for name in names:
        c = compare_with_recorded(load_snapshot(out / f"{name}.pickle.gz"))
        verdict = "MATCH" if c.match and c.layout_match else ("INCOMPLETE" if not c.complete else "MISMATCH")
        print(f"  {name:<20} {verdict:<10} segment events {c.matching}/{c.recorded_segment_events} "
              f"peak reserved recorded {c.recorded_peak_reserved:,} simulated "
              f"{c.simulated_peak_reserved:,} layout {'ok' if c.layout_match else 'differs'}"
              f"{'  ' + c.first_mismatch if c.first_mismatch else ''}{'  ' + c.reason if c.reason else ''}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("tests/data/snapshots"))
    ap.add_argument("--only", nargs="*", choices=list(WORKLOADS), help="workloads to record")
    ap.add_argument("--max-entries", type=int, default=MAX_ENTRIES)
    ap.add_argument("--timeout", type=int, default=300, help="seconds per workload")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        info = run_worker(args.worker, args.out, args.max_entries)
        print("RESULT " + json.dumps(info))
        return 0

    import torch  # only for the summary; the workloads run in subprocesses

    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing recorded", file=sys.stderr)
        return 1
    props = torch.cuda.get_device_properties(0)
    summary: dict[str, Any] = {
        "torch": torch.__version__, "cuda": torch.version.cuda, "gpu": props.name,
        "total_memory": props.total_memory, "max_entries": args.max_entries, "workloads": {},
    }
    names = args.only or list(WORKLOADS)
    for name in names:
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
        if WORKLOADS[name]:
            env["PYTORCH_CUDA_ALLOC_CONF"] = WORKLOADS[name]
        cmd = [sys.executable, __file__, "--worker", name, "--out", str(args.out),
               "--max-entries", str(args.max_entries)]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"{name}: timed out after {args.timeout} s", file=sys.stderr)
            continue
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            print(f"{name}: failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}", file=sys.stderr)
            continue
        info = json.loads(line[len("RESULT "):])
        summary["workloads"][name] = info
        flag = "  RING BUFFER FULL: raise --max-entries" if info["ring_buffer_full"] else ""
        print(f"{name:<20} reserved {info['max_memory_reserved'] / 2**20:8.1f} MiB  "
              f"{info['trace_entries']:>6} entries  {info['seconds']:.1f} s{flag}")
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {len(summary['workloads'])} snapshots and summary.json to {args.out}")
    check_with_vramplan(args.out, list(summary["workloads"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
