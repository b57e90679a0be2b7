"""``vramplan fit MODEL --gpu NAME``: the largest batch and the longest sequence that fit."""

from __future__ import annotations

import argparse
import sys

from .common import add_output_args, add_workload_args, workload_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "fit", help="largest batch size and longest sequence that fit a GPU",
        description="Find the largest micro-batch (at --seq) and the longest sequence (at --batch) "
        "that fit --gpu. The analytic curve shapes the search; each boundary is confirmed with "
        "--method (a trace by default) at the boundary and one step above.",
    )
    p.add_argument("model", help="catalog alias (llama-3.1-8b), Hub id, or path to a config.json")
    add_workload_args(p)
    p.add_argument("--seq-step", type=int, default=None,
                   help="resolution of the max-seq answer in tokens (default: automatic, ≥ 64)")
    add_output_args(p, plot=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from vramplan.errors import PlanError
    from vramplan.planner.fit import fit
    from vramplan.report.plan import fit_doc
    from vramplan.report.render import emit

    if not args.gpu:
        raise PlanError("fit needs a GPU", hint="add --gpu NAME (see `vramplan gpus`)")
    if args.seq_step is not None and args.seq_step < 1:
        raise PlanError(f"--seq-step must be a positive integer, got {args.seq_step}")
    w = workload_from_args(args)
    result = fit(args.model, w, gpu=args.gpu, method=args.method, alloc_conf=args.alloc_conf,
                 seq_step=args.seq_step)
    emit(fit_doc(result), args.format, sys.stdout, result.to_dict())
    return 0
