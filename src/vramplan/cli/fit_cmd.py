"""``vramplan fit MODEL --gpu NAME``: the largest batch and the longest sequence that fit.

``--plot out.png`` draws memory against batch size (``out.png``) and against sequence length
(``out-seq.png``), with the GPU's usable capacity and the boundaries found.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .common import (
    add_cache_arg,
    add_output_args,
    add_workload_args,
    hint,
    note_settings,
    workload_from_args,
)

if TYPE_CHECKING:
    from vramplan.planner.sweep import Sweep
    from vramplan.results import MemoryReport


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
    add_cache_arg(p)
    add_output_args(p, plot_help=("write memory against batch size to FILE (.png, .svg or .html) and against "
                      "sequence length to FILE-seq (e.g. out.png and out-seq.png)"))
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
    note_settings(w, args)
    paths = plot_paths(args.plot) if args.plot else None
    recorder = ReportLog() if paths else None
    result = fit(args.model, w, gpu=args.gpu, method=args.method, alloc_conf=args.alloc_conf,
                 seq_step=args.seq_step, estimator=recorder)
    if result.fallback is not None:
        hint(f"note: the model could not be traced; the boundaries are {result.fallback.used}, with a margin "
             f"({result.fallback.reason})")
    emit(fit_doc(result), args.format, sys.stdout, result.to_dict)
    if paths and recorder is not None:
        from vramplan.planner.sweep import fit_sweeps

        batch, seq = fit_sweeps(args.model, result, reports=recorder.reports)
        where = f"on {result.gpu_name}" + (f" (×{result.num_gpus}, per GPU)" if result.num_gpus > 1 else "")
        draw(batch, paths[0], f"{result.model} {where}: memory vs batch size")
        if seq is not None:
            draw(seq, paths[1], f"{result.model} {where}: memory vs sequence length")
    return 0


def plot_paths(path: str) -> tuple[Path, Path]:
    """The batch plot at ``path`` and the sequence plot beside it (``out.png`` → ``out-seq.png``),
    both checked before any work."""
    from vramplan.report.plot import check_plot_path

    p = check_plot_path(path)
    return p, check_plot_path(p.with_name(f"{p.stem}-seq{p.suffix}"))


class ReportLog:
    """The default estimator, keeping every report it makes (the plot marks the traced ones)."""

    def __init__(self) -> None:
        from vramplan.planner.evaluator import default_estimator

        self._estimate = default_estimator()
        self.reports: list[MemoryReport] = []

    def __call__(self, *args: Any, **kwargs: Any) -> MemoryReport:
        r = self._estimate(*args, **kwargs)
        self.reports.append(r)
        return r


def draw(s: Sweep, path: Path | str, title: str) -> None:
    """Plot a sweep (memory against batch or sequence, capacity lines, markers) and say where."""
    from vramplan.report.plot import plot_sweep

    plot_sweep(s.series, path, x_label=s.x_label, capacities=s.capacities, title=title,
               y_label="predicted device used per GPU", markers=s.markers, paired=s.paired)
    hint(f"plot written to {path}")
    for n in s.notes:
        hint(f"plot: {n}")
