"""Flags shared by several subcommands, and their mapping to library keywords."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections import defaultdict
from contextvars import ContextVar
from enum import Enum
from typing import Any

from ..errors import VramplanError
from ..units import parse_bytes
from ..workload import (
    Checkpointing,
    Method,
    Parallel,
    Precision,
    Task,
    Workload,
    auto_checkpointing,
    field_docs,
)


def _choices(cls: Any) -> list[str]:
    return [m.value for m in cls]


class _FormatAction(argparse.Action):
    """--format X / --json: given twice with different formats is a contradiction, not last-wins."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        value = self.const if self.const is not None else values
        given = getattr(namespace, "_format_given", None)
        if given is not None and given[1] != value:
            parser.error(f"{option_string} {'' if self.const else value} contradicts {given[0]}".replace("  ", " "))
        namespace._format_given = (f"{option_string}{'' if self.const else ' ' + str(value)}", value)
        setattr(namespace, self.dest, value)


def add_cache_arg(p: argparse.ArgumentParser) -> None:
    """``--no-cache``: neither read nor write the on-disk store of traces (``vramplan cache``)."""
    p.add_argument("--no-cache", action="store_true",
                   help="trace again instead of reading the on-disk store, and store nothing (see `vramplan cache`)")


def add_output_args(p: argparse.ArgumentParser, plot: bool = True, plot_help: str | None = None) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--format", choices=["table", "json", "markdown"], default="table", action=_FormatAction,
                   help="report format (default: table)")
    g.add_argument("--json", action=_FormatAction, const="json", dest="format", nargs=0,
                   help="same as --format json (integer bytes)")
    if plot:
        g.add_argument("--plot", metavar="FILE", help=plot_help or "write a plot (.png, .svg or .html)")


def _default_text(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


HELP_TEXT: ContextVar[bool] = ContextVar("HELP_TEXT", default=True)
"""Whether the parser being built may print its help: the flags' help comes from the fields'
docstrings, read by parsing workload.py (~5 ms); a command line that asks no help
(``build_parser`` sets this) builds its flags with empty help."""

_EXPLICIT = "_explicit_fields"


def _mark(namespace: argparse.Namespace, dest: str) -> None:
    given = getattr(namespace, _EXPLICIT, None)
    if given is None:
        given = set()
        setattr(namespace, _EXPLICIT, given)
    given.add(dest)


class _Store(argparse._StoreAction):
    """A workload flag's value, remembering that it was given (a recipe's default must not
    be replaced by an argparse default, only by what the user typed)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        _mark(namespace, self.dest)
        super().__call__(parser, namespace, values, option_string)


class _ImageSize(_Store):
    """``--image-size 1024`` (square) or ``--image-size 1024x768`` (width x height: the height
    goes to ``image_height``)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        text = str(values).strip().lower()
        parts = text.split("x")
        if len(parts) not in (1, 2) or not all(p.isdigit() and int(p) > 0 for p in parts):
            parser.error(f"argument {option_string}: expected pixels, e.g. 1024 or 1024x768 (width x height), "
                         f"got {values!r}")
        if len(parts) == 2:
            _mark(namespace, "image_height")
            namespace.image_height = int(parts[1])
        super().__call__(parser, namespace, int(parts[0]), option_string)


class _Switch(argparse.Action):
    """``--keep-grads`` / ``--no-keep-grads``: on, or explicitly off (to turn off a recipe's default)."""

    def __init__(self, option_strings: list[str], dest: str, default: Any = False, help: str | None = None,
                 **kwargs: Any) -> None:
        longs = [*option_strings, *("--no-" + o[2:] for o in option_strings if o.startswith("--"))]
        super().__init__(longs, dest, nargs=0, default=default, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        _mark(namespace, self.dest)
        setattr(namespace, self.dest, not (option_string or "").startswith("--no-"))

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


def explicit_fields(args: argparse.Namespace) -> frozenset[str]:
    """The workload fields the user gave on the command line (not argparse defaults)."""
    return frozenset(getattr(args, _EXPLICIT, ()) or ())


def _add_field(g: argparse._ArgumentGroup, f: dataclasses.Field[Any], doc: str) -> None:
    """One flag from one dataclass field: name, type, choices, default and help all from the field."""
    flag = "--" + f.name.replace("_", "-")
    default = f.default
    if f.name in ("precision", "checkpointing"):  # "auto": resolved per task (and PEFT)
        default = "auto"
    text = f"{doc.replace('%', '%%')} (default: {_default_text(default)})"
    if f.name == "precision":
        g.add_argument(flag, choices=["auto", *_choices(Precision)], default=default, help=text, action=_Store)
    elif f.name == "checkpointing":
        auto = ("auto: the --recipe's default; with the plain recipe full with --peft (TRL's SFTConfig turns "
                "gradient checkpointing on), none otherwise")
        g.add_argument(flag, choices=["auto", *_choices(Checkpointing)], default=default,
                       help=f"{doc.replace('%', '%%')} {auto} (default: auto)", action=_Store)
    elif f.name == "image_size":
        g.add_argument(flag, default=default, metavar="W[xH]", help=text, action=_ImageSize)
    elif isinstance(default, bool):
        g.add_argument(flag, action=_Switch, default=False, help=text)
    elif isinstance(default, Enum):
        g.add_argument(flag, choices=_choices(type(default)), default=default.value, help=text, action=_Store)
    elif isinstance(default, tuple):
        g.add_argument(flag, default=_default_text(default), metavar="A,B,…", help=text, action=_Store)
    elif isinstance(default, (int, float, str)):
        g.add_argument(flag, type=type(default), default=default, help=text, action=_Store)
    else:  # a new kind of field: give it a flag here (and a test in test_cli_errors.py)
        raise TypeError(f"no flag rule for Workload field {f.name!r} (default {default!r})")


def add_workload_args(p: argparse.ArgumentParser, *, gpu: bool = True) -> None:
    """The workload flags: one per field of :class:`Workload` and :class:`Parallel`, with the
    field's docstring as help and its default (the one source of both)."""
    g = p.add_argument_group("workload")
    help_text = HELP_TEXT.get()
    docs = field_docs(Workload) if help_text else defaultdict(str)
    for f in dataclasses.fields(Workload):
        if f.name != "parallel":
            _add_field(g, f, docs[f.name])
    par = p.add_argument_group("parallelism (per-GPU memory is reported)")
    pdocs = field_docs(Parallel) if help_text else defaultdict(str)
    for f in dataclasses.fields(Parallel):
        _add_field(par, f, pdocs[f.name])
    par.add_argument("--layout", metavar="FILE", default=None,
                     help="take the layout (and what else it states) from a config `vramplan plan --emit` wrote: "
                     "DeepSpeed .json, Accelerate .yaml, torchtitan .toml or the FSDP2 .py; flags give the rest")
    if gpu:
        h = p.add_argument_group("target")
        h.add_argument("--gpu", help="catalog GPU to check the fit against (see `vramplan gpus`)")
        h.add_argument("--alloc-conf", default=None,
                       help="PYTORCH_CUDA_ALLOC_CONF string for the allocator simulation "
                       "(default: PyTorch's defaults)")
        h.add_argument("--method", choices=_choices(Method), default="auto",
                       help="trace the real model on fake tensors, or use closed-form formulas "
                       "(default: auto, a trace when the model can be built, else analytic)")


def checkpointing_arg(args: argparse.Namespace) -> str:
    """``--checkpointing auto``: full for PEFT fine-tuning (TRL's ``SFTConfig`` defaults
    ``gradient_checkpointing=True``, trl/trainer/sft_config.py, trl main 2026), none otherwise."""
    if args.checkpointing != "auto":
        return str(args.checkpointing)
    return str(auto_checkpointing(args.peft, args.task))


def workload_from_args(args: argparse.Namespace) -> Workload:
    """The Workload the flags describe (validated by Workload itself). With ``--recipe``, the
    recipe's defaults fill every knob whose flag was not given (``vramplan.recipes.apply``)."""
    if str(getattr(args, "recipe", "plain")) != "plain":
        from ..recipes import apply, defaults

        given = explicit_fields(args)
        names = [f.name for f in dataclasses.fields(Workload) if f.name not in ("parallel", "recipe")]
        names += [f.name for f in dataclasses.fields(Parallel)]
        by_recipe = {d.field for d in defaults(args.recipe, peft=args.peft, task=args.task, dp=args.dp)}
        fields = {n: getattr(args, n) for n in names if n in given or n not in by_recipe}
        if fields.get("checkpointing") == "auto":  # not given: the recipe's, else none
            del fields["checkpointing"]
        return _for_pipeline(args, _seq_for_model(args, apply(args.recipe, **fields)))
    parallel = Parallel(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Parallel)})
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(Workload) if f.name != "parallel"}
    fields["checkpointing"] = checkpointing_arg(args)
    w = Workload(**fields, parallel=parallel)
    if getattr(args, "layout", None):
        from ..planner.layout import read_file

        layout = read_file(args.layout, w)
        check_layout_flags(w, layout.workload, layout.format)
        for n in layout.notes:
            hint(f"note: {n}")
        w = layout.workload
    return _for_pipeline(args, _seq_for_model(args, w))


def _seq_for_model(args: argparse.Namespace, w: Workload) -> Workload:
    """``--seq`` not given and the default longer than the model's positions (gpt2's 1,024,
    BERT's 512): the model's own maximum (less ``--new-tokens`` when generating), with a note.
    A model that does not resolve is left to the command, which says why."""
    model = getattr(args, "model", None)
    if not isinstance(model, str) or "seq" in explicit_fields(args) or w.seq != Workload().seq:
        return w
    from ..engine.resolve import resolve_model
    from ..models.spec import Family

    try:
        spec = resolve_model(model)
    except VramplanError:
        return w
    if spec.family in (Family.VIT, Family.OTHER) or not spec.max_positions:
        return w
    room = spec.max_positions - (w.new_tokens if w.task.value == "generate" else 0)
    if room >= w.seq or room < 1:
        return w
    hint(f"note: `seq` not given: {room:,} tokens, {spec.name}'s {spec.max_positions:,} positions"
         + (f" less `new_tokens={w.new_tokens}`" if room != spec.max_positions else "")
         + f" (the default {w.seq:,} exceeds them)")
    return w.replace(seq=room)


def _for_pipeline(args: argparse.Namespace, w: Workload) -> Workload:
    """A whole diffusers pipeline (``flux.1-dev-pipeline``) runs inference: ``--task`` not given is
    infer, and ``--precision`` not given its default for inference (bf16)."""
    model = getattr(args, "model", None)
    given = explicit_fields(args)
    if not isinstance(model, str) or "task" in given or w.task is Task.INFER:
        return w
    from ..models.pipelines import pipeline_folder

    if pipeline_folder(model) is None:
        return w
    infer = {} if "precision" in given else {"precision": Workload(task=Task.INFER).precision}
    return w.replace(task=Task.INFER, **infer)


def check_layout_flags(given: Workload, read: Workload, fmt: str) -> None:
    """A flag set away from its default that the layout file contradicts is an error, not a
    silent override."""
    from ..errors import WorkloadError
    from ..planner.layout import CARRIES

    dw, dp = Workload(task=given.task), Parallel()
    for name in sorted(CARRIES[fmt]):
        par = name in Parallel.__dataclass_fields__
        mine = getattr(given.parallel if par else given, name)
        theirs = getattr(read.parallel if par else read, name)
        default = getattr(dp if par else dw, name)
        if mine != default and mine != theirs:
            raise WorkloadError(f"`{name}={mine}` contradicts the {fmt} layout file, which says {theirs}",
                                hint=f"drop `{name}`, or edit the file", field=name)


def note_settings(w: Workload, args: argparse.Namespace | None = None) -> None:
    """Settings given but without effect on this workload: a note each on stderr. With ``args``,
    a flag typed at its default value counts as given (``--optimizer adamw --task infer``)."""
    given = () if args is None else {n for n in explicit_fields(args) if str(getattr(args, n, "")) != "auto"}
    for n in w.setting_notes(given):
        hint(f"note: {n}")


def size_arg(text: str) -> int:
    """A memory size with its unit. A bare number (bytes to parse_bytes) is nearly always a
    forgotten unit on the command line (``--min-memory 24``), so it is refused, except 0."""
    try:
        n = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(n):
            raise argparse.ArgumentTypeError(f"invalid size {text!r} (write e.g. 80GiB, 24GB or 512MiB)")
        if n != 0:
            raise argparse.ArgumentTypeError(f"size {text!r} has no unit (write e.g. {text}GiB or {text}GB)")
    try:
        return parse_bytes(text)
    except VramplanError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def hint(msg: str) -> None:
    """Hints and progress go to stderr; data goes to stdout. Core field references in ``msg``
    (`` `max_gpus` ``) are written as this command's flags."""
    from ..errors import with_flags
    from ..report.render import FLAG_OF

    flag_of = FLAG_OF.get()
    sys.stderr.write((with_flags(msg, flag_of) if flag_of else msg).rstrip() + "\n")
