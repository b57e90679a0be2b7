"""``vramplan estimate MODEL``: predict a catalog (or config.json / Hub) model's GPU memory."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from .common import add_output_args, add_workload_args, hint, note_settings, workload_from_args

if TYPE_CHECKING:
    from ..results import MemoryReport


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
    add_output_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..engine import estimate
    from ..report.estimate import to_doc
    from ..report.render import emit

    check_extras(args)
    w = workload_from_args(args)
    note_settings(w, args)
    report = estimate(args.model, w, gpu=args.gpu, method=args.method, alloc_conf=args.alloc_conf)
    if report.fallback is not None:
        hint(f"note: the model could not be traced; showing the {report.fallback.used} estimate "
             f"({report.fallback.reason})")
    emit(to_doc(report), args.format, sys.stdout, report.to_dict)
    write_extras(report, args)
    suggest_fix(args.model, w, report)
    return 0


def suggest_fix(model: str, w, report) -> None:  # type: ignore[no-untyped-def]
    """It does not fit: name the cheapest change that does (from the planner), on stderr."""
    v = report.verdict
    if v is None or v.fits:
        return
    from ..engine.resolve import resolve_gpu, resolve_model
    from ..planner.nextstep import cheapest_fix

    gpu = resolve_gpu(v.gpu)
    fix = cheapest_fix(resolve_model(model), w, gpu) if gpu is not None else None
    if fix is not None:
        hint(f"to fit on {v.gpu_name or v.gpu}: {fix.sentence()}")
    else:
        hint(f"no single change makes it fit on {v.gpu_name or v.gpu}: "
             f"try `vramplan plan {model} --gpu {v.gpu} --allow-peft --gpus 8`")


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
