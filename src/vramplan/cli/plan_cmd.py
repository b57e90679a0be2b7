"""``vramplan plan MODEL --gpu NAME``: plans that make a workload fit, fastest / cheapest first.

``--rank-gpus`` instead ranks every catalog GPU and cloud instance on which it fits.
``--emit FORMAT`` prints what to paste for the chosen plan (stdout) and a summary (stderr).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .common import (
    add_cache_arg,
    add_output_args,
    add_workload_args,
    hint,
    note_settings,
    workload_from_args,
)

EMIT_FORMATS = ("deepspeed", "accelerate", "fsdp", "torchtitan", "trainer", "alloc-conf")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", help="search precision, checkpointing, optimizer, sharding and GPUs for plans that fit",
        description="Search precision, activation checkpointing, optimizer, PEFT (with --allow-peft), "
        "ZeRO/FSDP sharding, offload and micro-batching for plans that fit --gpu (up to --gpus of "
        "them), screened with the analytic estimate and confirmed with --method. Shows the Pareto "
        "front of memory, step time and cost. --rank-gpus ranks catalog GPUs and cloud instances.",
    )
    p.add_argument("model", help="catalog alias (llama-3.1-8b), Hub id, or path to a config.json")
    add_workload_args(p)
    s = p.add_argument_group("search")
    s.add_argument("--gpus", dest="max_gpus", type=int, default=None, metavar="N",
                   help="use up to N GPUs (default: the workload's world size; with --rank-gpus 8)")
    s.add_argument("--budget", type=float, default=None, metavar="USD_PER_HOUR",
                   help="on-demand dollars per hour for all GPUs of a plan")
    s.add_argument("--global-batch", type=int, default=None, metavar="N",
                   help="keep micro-batch × accumulation × data-parallel GPUs = N")
    s.add_argument("--allow-peft", action="store_true",
                   help="also consider LoRA/QLoRA (changes what is trained: not full fine-tuning)")
    s.add_argument("--sort", choices=["speed", "cost", "memory"], default=None,
                   help="order of the plans (default: speed; cost with --rank-gpus)")
    s.add_argument("--confirm", type=int, default=3, metavar="K",
                   help="re-estimate the best K finalists with --method (default 3; 0: screen only)")
    s.add_argument("--top", type=int, default=None, metavar="N", help="rows to show (default 10; 15 ranked)")
    s.add_argument("--rank-gpus", action="store_true",
                   help="rank every catalog GPU and cloud instance on which the workload fits")
    o = p.add_argument_group("runnable output")
    o.add_argument("--emit", choices=EMIT_FORMATS, default=None,
                   help="print the config to paste for the chosen plan instead of the table")
    o.add_argument("--pick", type=int, default=1, metavar="N", help="which plan (row) to emit (default 1)")
    add_cache_arg(p)
    add_output_args(p, plot_help=("write memory against micro-batch (.png, .svg or .html) for the top plans, "
                      "or with --rank-gpus for the top GPU types, with each GPU's usable capacity"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from vramplan.errors import PlanError
    from vramplan.planner.pricing import check_budget
    from vramplan.report.progress import progress_bar

    check_budget(args.budget)  # before any work: NaN, inf and negatives
    w = workload_from_args(args)
    note_settings(w, args)
    for name in ("max_gpus", "global_batch", "confirm", "top", "pick"):
        v = getattr(args, name)
        if v is not None and (v < 1 if name != "confirm" else v < 0):
            raise PlanError(f"`{name}` must be {'≥ 0' if name == 'confirm' else 'positive'}, got {v}", field=name)
    if args.plot:
        from vramplan.report.plot import check_plot_path

        check_plot_path(args.plot)
    if args.rank_gpus:
        return _rank(args, w)
    if not args.gpu:
        raise PlanError("plan needs a GPU", hint="add `gpu=NAME`, or use `rank_gpus` to compare GPUs", field="gpu")
    from vramplan.planner.plan import plan
    from vramplan.report.plan import plan_doc
    from vramplan.report.render import emit

    with progress_bar() as progress:
        result = plan(args.model, w, gpu=args.gpu, max_gpus=args.max_gpus or w.parallel.world_size,
                      budget=args.budget, allow_peft=args.allow_peft, global_batch=args.global_batch,
                      method=args.method, alloc_conf=args.alloc_conf, sort=args.sort or "speed",
                      confirm=args.confirm, progress=progress)
    if args.emit:
        code = _emit(args, result.plans, result.to_dict())
    else:
        emit(plan_doc(result, top=args.top or 10), args.format, sys.stdout, result.to_dict)
        code = 0
    if args.plot:
        from vramplan.planner.sweep import plan_sweep, short_gpu

        from .fit_cmd import draw

        n = max(p.num_gpus for p in result.plans)
        on = ("up to " if n > 1 else "") + f"{n}× {short_gpu(result.plans[0].gpu_name)}"
        draw(plan_sweep(args.model, result), args.plot,
             f"{result.model}: top plans on {on}, memory per GPU vs batch size")
    return code


def _rank(args: argparse.Namespace, w: Any) -> int:
    from vramplan.planner.rank import rank_gpus
    from vramplan.report.plan import ranking_doc
    from vramplan.report.progress import progress_bar
    from vramplan.report.render import emit

    gpus = None
    if args.gpu:
        from vramplan.hardware.catalog import get_gpu

        gpus = [get_gpu(args.gpu)]
    with progress_bar() as progress:
        result = rank_gpus(args.model, w, gpus=gpus, max_gpus=args.max_gpus or 8, allow_peft=args.allow_peft,
                           global_batch=args.global_batch, budget=args.budget, method=args.method,
                           alloc_conf=args.alloc_conf, sort=args.sort or "cost", confirm=args.confirm,
                           progress=progress)
    if args.emit:
        code = _emit(args, [r.plan for r in result.ranked], result.to_dict())
    else:
        emit(ranking_doc(result, top=args.top or 15), args.format, sys.stdout, result.to_dict)
        code = 0
    if args.plot:
        from vramplan.planner.sweep import rank_sweep

        from .fit_cmd import draw

        draw(rank_sweep(args.model, result), args.plot,
             f"{result.model}: memory per GPU vs batch size, best plan per GPU type")
    return code


def _emit(args: argparse.Namespace, plans: Any, obj: dict[str, Any]) -> int:
    import json

    from vramplan.errors import PlanError
    from vramplan.planner.emit import emit as make

    if args.pick > len(plans):
        raise PlanError(f"`pick={args.pick}`: there are only {len(plans)} plan(s)", field="pick")
    chosen = plans[args.pick - 1]
    out = make(chosen, args.emit)
    if args.format == "json":
        obj = {**obj, "emitted": {"plan": args.pick, "format": out.format, "filename": out.filename,
                                  "text": out.text, "notes": list(out.notes)}}
        sys.stdout.write(json.dumps(obj, indent=2) + "\n")
        return 0
    hint(f"plan {args.pick}: {chosen.explanation}")
    for n in out.notes[1:]:
        hint(f"note: {n}")
    sys.stdout.write(out.text)
    return 0
