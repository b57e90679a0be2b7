"""``vramplan snapshot FILE``: analyse a recorded PyTorch memory snapshot (pickle or JSON)."""

from __future__ import annotations

import argparse
import sys

from vramplan.cli.common import add_output_args, hint


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "snapshot", help="analyse a PyTorch memory snapshot (peaks, fragmentation, largest blocks, OOMs)",
        description="Read a snapshot written by torch.cuda.memory._dump_snapshot(), or the same dict "
        "as JSON, plain or gzip (the format is read from the content; no code in it is run) and report its peaks, fragmentation over time, the largest "
        "allocations with their stack frames, the segments at the peak, OOM events and a "
        "best-effort category for every allocation.",
    )
    p.add_argument("file", metavar="FILE", help="the snapshot: pickle or JSON, plain or gzip")
    p.add_argument("--device", type=int, default=None,
                   help="CUDA device index in the snapshot (default: the one with the most entries)")
    p.add_argument("--top", type=int, default=10, help="rows in the largest-allocation tables (default 10)")
    add_output_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from vramplan.errors import VramplanError
    from vramplan.report.render import emit
    from vramplan.report.snapshot import to_doc
    from vramplan.snapshot.analyze import analyze
    from vramplan.snapshot.reader import load_snapshot

    if args.top < 1:
        raise VramplanError(f"--top must be a positive integer, got {args.top}")
    if args.plot:
        from vramplan.report.plot import check_plot_path

        check_plot_path(args.plot)
    snap = load_snapshot(args.file)
    if not snap.get("segments") and not any(snap.get("device_traces") or ()):
        raise VramplanError(f"{args.file}: the snapshot holds no segments and no allocation history",
                            hint="dump it after the workload allocated, with torch.cuda.memory._record_memory_history() on")
    analysis = analyze(snap, device=args.device, top=args.top)
    emit(to_doc(analysis, args.file), args.format, sys.stdout, {"file": args.file, **analysis.to_dict()})
    if args.plot:
        from vramplan.report.plot import plot_snapshot

        plot_snapshot(analysis, args.plot)
        hint(f"plot written to {args.plot}")
    return 0
