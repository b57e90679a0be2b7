"""``vramplan measure MODEL``: run the workload on this machine's CUDA GPU, beside the prediction."""

from __future__ import annotations

import argparse
import sys

from vramplan.cli.common import (
    add_output_args,
    add_workload_args,
    hint,
    note_settings,
    workload_from_args,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "measure", help="measure a workload's GPU memory on this machine's CUDA GPU, beside the prediction",
        description="Build the workload for real on the local CUDA GPU (random weights, synthetic batch), "
        "run warm-up + timed steps, and record max_memory_allocated, max_memory_reserved, NVML used "
        "memory, step time and (optionally) a memory snapshot, with vramplan's trace and analytic "
        "predictions beside them. Use a fresh process per measurement.",
    )
    p.add_argument("model", help="catalog alias (llama-3.2-1b), Hub id, or path to a config.json")
    add_workload_args(p)
    m = p.add_argument_group("measurement")
    m.add_argument("--iterations", type=int, default=3, help="timed steps (default 3)")
    m.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    m.add_argument("--out", metavar="FILE.jsonl", help="append the record as one JSON line")
    m.add_argument("--snapshot", metavar="FILE.pickle",
                   help="record the allocator history and dump a memory snapshot (slows the steps)")
    m.add_argument("--max-entries", type=int, default=100_000,
                   help="trace entries the snapshot keeps (default 100000)")
    m.add_argument("--no-predict", action="store_true", help="measure only (no trace/analytic prediction)")
    m.add_argument("--label", default="", help="an id stored with the record (default: none)")
    add_output_args(p, plot=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from vramplan.measure import measure
    from vramplan.report.measure import to_doc
    from vramplan.report.render import emit

    w = workload_from_args(args)
    note_settings(w, args)
    methods: tuple[str, ...] = ()
    if not args.no_predict:
        methods = ("trace", "analytic") if args.method == "auto" else (args.method,)
    rec = measure(args.model, w, gpu=args.gpu, alloc_conf=args.alloc_conf, iterations=args.iterations,
                  warmup=args.warmup, snapshot=args.snapshot, max_entries=args.max_entries, out=args.out,
                  methods=methods, label=args.label)
    emit(to_doc(rec), args.format, sys.stdout, rec.to_json())
    if args.out:
        hint(f"record appended to {args.out}")
    return 0
