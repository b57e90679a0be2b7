"""``vramplan gpus``: list the GPU catalog, or the GPUs of this machine (``--local``)."""

from __future__ import annotations

import argparse
import sys

from vramplan.cli.common import add_output_args, size_arg


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "gpus", help="list the GPU catalog (memory, bandwidth, rates, prices) or this machine's GPUs",
        description="List the embedded GPU catalog: memory (GiB = 2^30 B), memory type, stated "
        "bandwidth (GB/s = 10^9 B/s), dense BF16 TFLOPS, interconnect, TDP and launch price. "
        "`vramplan gpu NAME` shows one card with the source of every figure. With --local, read "
        "the GPUs of this machine through NVML instead.",
    )
    p.add_argument("--min-memory", type=size_arg, metavar="SIZE",
                   help="only GPUs with at least this much memory, e.g. 24GB or 80GiB")
    p.add_argument("--vendor", choices=["nvidia", "amd", "intel"], help="only one vendor's GPUs")
    p.add_argument("--local", action="store_true",
                   help="read this machine's GPUs through NVML (needs nvidia-ml-py and a driver)")
    add_output_args(p, plot=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from vramplan.report.gpu import catalog_doc, catalog_json, local_doc, local_json
    from vramplan.report.render import emit

    if args.local:
        from vramplan.hardware.nvml import local_gpus

        devices = local_gpus()
        emit(local_doc(devices), args.format, sys.stdout, local_json(devices))
        return 0
    from vramplan.hardware.catalog import list_gpus, usable_capacity

    gpus = list_gpus(min_memory=args.min_memory, vendor=args.vendor)
    emit(catalog_doc(gpus, min_memory=args.min_memory, vendor=args.vendor), args.format, sys.stdout,
         catalog_json(gpus, [usable_capacity(g)[0] for g in gpus]))
    return 0
