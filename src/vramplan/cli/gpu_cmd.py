"""``vramplan gpu NAME``: one catalog GPU, every figure with its source."""

from __future__ import annotations

import argparse
import sys

from vramplan.cli.common import add_output_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "gpu", help="show one GPU: every figure with its source, bandwidth derivation, usable memory",
        description="Show one catalog GPU (key, alias or name: h100, a100-80gb, rtx-4090, 4090): "
        "every figure with its source, the bandwidth derived from bus width and per-pin rate "
        "next to the stated one, the usable capacity with its source, the memory the CUDA "
        "context and libraries take, and cloud instances that carry it.",
    )
    p.add_argument("name", metavar="NAME", help="GPU key or alias (see `vramplan gpus`)")
    p.add_argument("--world-size", type=int, default=1,
                   help="ranks for the NCCL part of the overhead (default 1: none)")
    add_output_args(p, plot=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from vramplan.hardware.catalog import get_gpu, usable_capacity
    from vramplan.hardware.overhead import cublas_workspace_bytes, device_overhead
    from vramplan.hardware.prices import list_instances
    from vramplan.report.gpu import gpu_doc, gpu_json
    from vramplan.report.render import emit

    g = get_gpu(args.name)
    usable, usable_src = usable_capacity(g)
    overhead = device_overhead(g, world_size=args.world_size)
    instances = list_instances(gpu=g.key)
    emit(gpu_doc(g, usable, usable_src, overhead, instances), args.format, sys.stdout,
         gpu_json(g, usable, usable_src, overhead, cublas_workspace_bytes(g), instances))
    return 0
