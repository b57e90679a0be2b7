"""The zoo table of the README: each real public script (tests/zoo) under ``vramplan run`` against a
real CPU run of the same script, every difference itemised.

    python bench/zoo.py [--markdown] [--only NAME]

Columns: the CPU run's storage peak from the first forward on (truth); ``vramplan run``'s
allocated peak with CUDA-only workspaces left out (predicted) and its error; the caching
allocator's rounding (512-byte blocks, a large block's unsplit tail); code-path differences
(storages only one side has because CUDA and the CPU run different code, predicted - truth); the
residual, ``requested - truth`` once both are set aside (0 B: the two peaks hold the same
storages). Sizes in MiB (2^20 bytes).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from zoo import ZOO, fixtures, run  # noqa: E402

MiB = 2**20


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--only", help="the entries whose name contains this (one row of the table)")
    args = ap.parse_args()
    import torch

    root = fixtures(Path(tempfile.mkdtemp(prefix="vramplan-zoo-")))
    print(f"torch {torch.__version__}; vramplan run --gpu h100-sxm (workspaces left out) vs the script on the CPU")
    if args.markdown:
        print("| script | covers | truth MiB | predicted MiB | error | rounding MiB | code paths MiB | residual |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for e in ZOO:
        if args.only and args.only not in e.name:
            continue
        c = run(e, root)  # in its own process, as tests/test_zoo.py runs it
        if "skip" in c:
            print(f"| {e.name} | skipped: {c['skip']} |" if args.markdown else f"{e.name}: skipped ({c['skip']})")
            continue
        paths = sum(p - t for _, p, t in c["paths"])
        row = (e.name, e.covers.split(";")[0], f"{c['truth'] / MiB:,.2f}", f"{c['predicted'] / MiB:,.2f}",
               f"{c['error'] * 100:+.2f} %", f"{c['rounding'] / MiB:+.2f}",
               f"{paths / MiB:+.2f}" if c["paths"] else "–",
               f"{c['residual']:+,} B ({c['residual'] / c['truth'] * 100:+.2f} %)")
        if args.markdown:
            print("| " + " | ".join(row) + " |")
        else:
            print(f"{row[0]}: truth {row[2]} MiB, predicted {row[3]} MiB ({row[4]}); rounding {row[5]}, code paths "
                  f"{row[6]}, residual {row[7]}  [vramplan run {c['run_s']:.1f} s]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
