"""Trim a PyTorch memory snapshot into a small test fixture: every trace entry and segment kept,
stack frames dropped; written as gzip pickle (``.pickle.gz``) or JSON (``.json`` / ``.json.gz``).

The input is read with vramplan's restricted unpickler (no code in it runs). The fixtures in
tests/data/snapshots/ were made with it, e.g.

    PYTHONPATH=src .venv/bin/python bench/trim_snapshot.py memory.pickle \
        tests/data/snapshots/decomfl_memory.pickle.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import pickle
import sys
from pathlib import Path

from vramplan.errors import VramplanError
from vramplan.snapshot import compare_with_recorded, load_snapshot, strip_frames


def write(snap: dict, out: Path) -> None:
    name = out.name
    if name.endswith((".json", ".json.gz")):
        data = json.dumps(snap, separators=(",", ":")).encode()
    elif name.endswith((".pickle", ".pickle.gz")):
        data = pickle.dumps(snap, protocol=4)
    else:
        raise VramplanError(f"{out}: name it .pickle(.gz) or .json(.gz)")
    if name.endswith(".gz"):
        data = gzip.compress(data, compresslevel=9, mtime=0)
    out.write_bytes(data)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    try:
        snap = strip_frames(load_snapshot(args.src))
        write(snap, args.out)
        again = load_snapshot(args.out)
    except VramplanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    entries = sum(len(t) for t in again["device_traces"])
    print(f"{args.out}: {args.out.stat().st_size:,} B, {entries:,} trace entries, "
          f"{len(again['segments'])} segments")
    for dev, trace in enumerate(again["device_traces"]):
        if trace:
            c = compare_with_recorded(again, device=dev)
            print(f"  device {dev}: {c.verdict}; {c.matching} of {c.recorded_segment_events} segment "
                  f"events; peak reserved recorded {c.recorded_peak_reserved:,} B, predicted "
                  f"{c.simulated_peak_reserved:,} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
