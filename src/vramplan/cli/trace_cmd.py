"""``vramplan trace FILE.py:FUNC``: trace a user's own model factory on fake tensors.

``FUNC()`` returns ``(model, example_inputs)`` or ``(model, example_inputs, loss_fn)``;
``example_inputs`` is a tensor, a tuple of positional tensors or a dict of keyword tensors,
built for the batch you want to measure.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

from ..errors import TraceError, VramplanError
from ..units import fmt_bytes
from .common import (
    add_output_args,
    add_workload_args,
    hint,
    note_settings,
    size_arg,
    workload_from_args,
)

DEFAULT_TIMEOUT_S = 900.0
MAX_ITERATIONS = 100
"""More steps than a trace needs: the peak repeats from the second step on."""
PROGRESS_EVERY_S = 5.0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "trace", help="trace your own model factory (file.py:make) on fake tensors",
        description="Run your model's real step on fake tensors (no GPU) and replay it through "
        "the caching-allocator simulation. FILE.py:FUNC must return (model, example_inputs) "
        "or (model, example_inputs, loss_fn).",
    )
    p.add_argument("target", metavar="FILE.py:FUNC", help="python file and factory function")
    add_workload_args(p)
    p.add_argument("--iterations", type=int, default=2,
                   help=f"steps to trace (default 2: first and steady state; at most {MAX_ITERATIONS})")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help=f"stop your code after this long, e.g. a forward that loops forever "
                   f"(default {DEFAULT_TIMEOUT_S:g}; 0 = no limit)")
    p.add_argument("--max-memory", type=size_arg, default=None, metavar="SIZE",
                   help="stop your code when this process's memory (RSS) grows past SIZE, e.g. a forward that "
                   "keeps tensors alive (default: half of this machine's RAM; 0 = no limit)")
    p.add_argument("--snapshot", metavar="FILE.pickle", help="write the predicted trace in PyTorch's snapshot format")
    add_output_args(p)
    p.set_defaults(func=run)


def load_factory(target: str) -> Any:
    path, sep, func = target.rpartition(":")
    if not sep or not path or not func:
        raise VramplanError(f"expected FILE.py:FUNC, got {target!r}", hint="e.g. vramplan trace model.py:make")
    file = Path(path)
    if file.is_dir():
        raise VramplanError(f"{path} is a directory", hint="name the python file: DIR/model.py:FUNC")
    if not file.is_file():
        raise VramplanError(f"no such file: {path}", hint="check the path of FILE.py in FILE.py:FUNC")
    spec = importlib.util.spec_from_file_location(f"vramplan_user_{file.stem}", file)
    if spec is None or spec.loader is None:
        raise VramplanError(f"cannot import {path} as a python module")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(file.parent.resolve()))
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # user code: report in one line
        raise TraceError(f"importing {path} failed: {type(e).__name__}: {e}",
                         hint="the file must import without side effects such as sys.exit()"
                         if isinstance(e, SystemExit) else None) from None
    finally:
        sys.path.pop(0)
    fn = getattr(module, func, None)
    if not callable(fn):
        names = sorted(n for n, v in vars(module).items()
                       if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module.__name__)
        raise VramplanError(f"{path} has no function {func!r}",
                            hint=f"functions defined there: {', '.join(names[:8])}" if names else None)
    return fn


def run(args: argparse.Namespace) -> int:
    from ..emulate.construct import fake_construction
    from ..engine import trace
    from ..engine.user_model import construction_facts
    from ..report.estimate import to_doc
    from ..report.render import emit
    from ..trace.deadline import deadline
    from .estimate_cmd import check_extras, write_extras

    if not 1 <= args.iterations <= MAX_ITERATIONS:
        raise VramplanError(f"--iterations must be 1 to {MAX_ITERATIONS}, got {args.iterations}",
                            hint="the peak repeats from the second step on: 2 (the default) measures it")
    if not args.timeout >= 0:  # also NaN
        raise VramplanError(f"--timeout must be >= 0 seconds, got {args.timeout}", hint="0 means no limit")
    max_rss = memory_budget(args.max_memory)
    _check_unused(args)
    check_extras(args)
    w = workload_from_args(args)
    note_settings(w, args)
    factory = load_factory(args.target)
    limits = ", ".join(part for part in (
        f"--timeout {args.timeout:g} s" if args.timeout else "", f"--max-memory {fmt_bytes(max_rss)}" if max_rss else "")
        if part)

    def progress(elapsed: float) -> None:
        from ..trace.deadline import current_rss

        rss = current_rss()
        hint(f"vramplan trace: {args.target} · {elapsed:.0f} s" + (f" · {fmt_bytes(rss)} RAM" if rss else "")
             + (f" (stops at {limits})" if limits else ""))

    with deadline(args.timeout, what=f"tracing {args.target}", on_progress=progress, every=PROGRESS_EVERY_S,
                  max_rss=max_rss):
        try:
            # weights on meta, .cuda() and torch.cuda/torch.accelerator emulated: no RAM, no GPU
            with fake_construction(construction_facts(args.gpu)):
                made = factory()
        except VramplanError:
            raise
        except (Exception, SystemExit) as e:
            raise TraceError(f"{args.target}() raised {type(e).__name__}: {e}") from None
        if not isinstance(made, tuple) or len(made) not in (2, 3):
            raise VramplanError(f"{args.target}() must return (model, example_inputs[, loss_fn])")
        model, inputs, *rest = made
        try:
            report = trace(model, inputs, workload=w, loss_fn=rest[0] if rest else None, gpu=args.gpu,
                           alloc_conf=args.alloc_conf, iterations=args.iterations, name=args.target)
        except TraceError as e:
            raise _plain_mistake(e, args.target) from None
    emit(to_doc(report), args.format, sys.stdout, report.to_dict)
    write_extras(report, args)
    return 0


def memory_budget(given: int | None) -> int | None:
    """``--max-memory`` in bytes (None: no limit); not given: half of this machine's RAM."""
    from ..trace.deadline import physical_memory

    if given is not None:
        return given or None
    ram = physical_memory()
    return ram // 2 if ram else None


def _plain_mistake(e: TraceError, target: str) -> TraceError:
    """A trace error whose cause is a plain shape mismatch (a GPU run raises it too) loses the
    advice about fake tensors, which does not apply to it."""
    from ..trace.usererror import SHAPE_HINT, shape_mismatch

    cause = e.__cause__
    if cause is None or not shape_mismatch(cause) or e.hint == SHAPE_HINT:
        return e
    return TraceError(e.message, hint=SHAPE_HINT.replace("the factory", f"{target}()"), field=e.field)


def _check_unused(args: argparse.Namespace) -> None:
    """The shapes come from FUNC's example inputs, and the method is always a trace: say so
    rather than silently ignore flags that would change the answer of `vramplan estimate`."""
    from ..workload import Workload

    defaults = Workload()
    shapes = [f"--{name.replace('_', '-')} {getattr(args, name)}"
              for name in ("batch", "seq", "image_size") if getattr(args, name) != getattr(defaults, name)]
    if shapes:
        raise VramplanError(
            f"{', '.join(shapes)} {'does' if len(shapes) == 1 else 'do'} not apply to `vramplan trace`: the shapes are those of the "
            f"example inputs {args.target}() returns",
            hint="build the inputs at the size you want in the factory, and drop the flag",
        )
    if args.method == "analytic":
        raise VramplanError("`vramplan trace` always traces; there is no analytic formula for your own model",
                            hint="drop --method, or use `vramplan estimate MODEL --method analytic` for a catalog model")
