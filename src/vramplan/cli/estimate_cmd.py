"""``vramplan estimate MODEL``: predict a catalog (or config.json / Hub) model's GPU memory."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from .common import (
    add_cache_arg,
    add_output_args,
    add_workload_args,
    hint,
    note_settings,
    workload_from_args,
)

if TYPE_CHECKING:
    from ..planner.nextstep import Suggestion
    from ..results import MemoryReport
    from ..workload import Workload


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "estimate", help="predict the GPU memory of a model's training/inference step",
        description="Predict allocated / reserved / device-used memory per GPU for a catalog "
        "model (see `vramplan models`), a local config.json or a Hub id.",
    )
    p.add_argument("model", help="catalog alias (llama-3.1-8b), Hub id, or path to a config.json")
    add_workload_args(p)
    p.add_argument("--snapshot", metavar="FILE.pickle",
                   help="write the predicted trace in PyTorch's memory-snapshot format (needs --method trace)")
    add_cache_arg(p)
    add_output_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..engine import estimate
    from ..report.estimate import answer, to_doc
    from ..report.render import emit

    check_extras(args)
    w = workload_from_args(args)
    note_settings(w, args)
    report = estimate(args.model, w, gpu=args.gpu, method=args.method, alloc_conf=args.alloc_conf)
    if report.fallback is not None:
        hint(f"note: the model could not be traced; showing the {report.fallback.used} estimate "
             f"({report.fallback.reason})")
    fix = find_fix(args.model, w, report, args.method)
    doc = to_doc(report)
    end = answer(report, fix)
    if end is not None:
        doc.add(end)

    def json_obj() -> dict[str, object]:
        d = report.to_dict()
        if report.verdict is not None and not report.verdict.fits:
            d["to_fit"] = fix.to_dict() if fix is not None else None
        return d

    emit(doc, args.format, sys.stdout, json_obj)
    write_extras(report, args)
    return 0


def find_fix(model: str, w: Workload, report: MemoryReport, method: str) -> Suggestion | None:
    """It does not fit: the cheapest change that does (the planner's list, screened analytically),
    confirmed with the report's own method: a traced report gets a traced fix."""
    v = report.verdict
    if v is None or v.fits:
        return None
    from ..models.pipelines import pipeline_folder

    if pipeline_folder(model) is not None:  # (a pipeline's levers are its offload and tiling: the notes say)
        return None
    from ..engine.resolve import resolve_gpu, resolve_model
    from ..planner.nextstep import cheapest_fix
    from ..workload import Method

    gpu = resolve_gpu(v.gpu)
    if gpu is None:
        return None
    confirm = Method.ANALYTIC if report.method is Method.ANALYTIC else Method(method)
    if confirm is not Method.ANALYTIC:
        hint(f"{report.model} does not fit: confirming the cheapest change that fits with a trace …")
    return cheapest_fix(resolve_model(model), w, gpu, method=confirm)


def check_extras(args: argparse.Namespace) -> None:
    """Refuse unusable --plot / --snapshot paths before the (possibly long) estimate."""
    from ..errors import VramplanError

    if getattr(args, "plot", None):
        from ..report.plot import check_plot_path

        check_plot_path(args.plot)
    if getattr(args, "snapshot", None):
        if getattr(args, "method", None) == "analytic":
            raise VramplanError("--snapshot needs an event trace", hint="add --method trace")
        from ..snapshot.export import check_snapshot_path

        check_snapshot_path(args.snapshot)


def write_extras(report: MemoryReport, args: argparse.Namespace) -> None:
    """--plot and --snapshot, shared with `vramplan trace`."""
    from ..errors import VramplanError

    if getattr(args, "plot", None):
        from ..report.plot import plot_report

        plot_report(report, args.plot)
        hint(f"plot written to {args.plot}")
    if getattr(args, "snapshot", None):
        events = report.events
        if events is None:
            raise VramplanError("--snapshot needs an event trace", hint="add --method trace")
        from ..snapshot.export import write_predicted_snapshot

        write_predicted_snapshot(events, args.snapshot, conf=args.alloc_conf, report=report)
        hint(f"predicted snapshot written to {args.snapshot} (open it at pytorch.org/memory_viz)")
