"""``vramplan`` entry point: builds the parser from one module per subcommand.

Each module in :data:`SUBCOMMANDS` defines ``register(subparsers)`` which adds its parser
and sets ``func`` to a ``run(args) -> int``. Modules are imported only to build the
parser; heavy imports (torch, transformers) happen inside ``run`` so that
``vramplan estimate`` stays fast.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib
import os
import re
import sys
import threading
from collections.abc import Sequence
from typing import Any, NoReturn

from ..errors import VramplanError

SUBCOMMANDS = (
    "estimate", "trace", "fit", "plan", "models", "gpus", "gpu", "replay", "snapshot",
    "measure", "rules", "run", "serve", "web", "cache",
)
GC_KEPT = frozenset({"measure", "run", "web"})
"""Commands that keep automatic garbage collection (:func:`entry` pauses it for the others,
vramplan's own code, which ends in seconds to minutes): ``web`` (a server), ``run`` and
``measure`` (a user's script, a real GPU step)."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line on stderr and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"error: {message} (see `{self.prog} --help`)\n")
        raise SystemExit(2)


class _VersionAction(argparse.Action):
    """``--version``, looked up only when asked for (``importlib.metadata`` alone costs ~30 ms
    of every command's start-up)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0,
                         help=help or "show program's version number and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        from vramplan.allocator import core

        parts = "; ".join(f"{p.name} {p.state}" for p in core.parts())
        parser._print_message(f"{parser.prog} {_version()} (allocator replay core: {parts})\n", sys.stdout)
        parser.exit()


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The whole parser; given the command line, only the subcommand it names is built (each
    subcommand's flags cost a few ms; ``vramplan estimate`` need not build ``plan``'s)."""
    parser = _Parser(
        prog="vramplan",
        description="How much GPU memory will this PyTorch workload take, does it fit, "
        "and what is the cheapest, fastest way to make it fit?",
    )
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    named = _named_command(argv)
    from .common import HELP_TEXT

    token = HELP_TEXT.set(argv is None or _asks_help(argv))
    try:
        for name in SUBCOMMANDS if named is None else (named,):
            try:
                mod = importlib.import_module(f"vramplan.cli.{name}_cmd")
            except ModuleNotFoundError as e:  # a subcommand not built yet
                if e.name != f"vramplan.cli.{name}_cmd":
                    raise
                continue
            mod.register(sub)
    finally:
        HELP_TEXT.reset(token)
    return parser


def _asks_help(argv: Sequence[str]) -> bool:
    """Whether the command line may print help: ``-h`` or ``--help`` (or an abbreviation that
    argparse would take for it)."""
    return any(w == "-h" or (len(w) > 2 and "--help".startswith(w)) for w in argv)


def flag_names(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> dict[str, str]:
    """Library field name → command-line flag (``max_gpus`` → ``--gpus``) for the command
    ``argv`` names: the one mapping core messages are rewritten with. It is read off the
    parser: each option's ``dest`` is the library keyword it is passed as."""
    words = list(sys.argv[1:] if argv is None else argv)
    out: dict[str, str] = {}
    p: argparse.ArgumentParser | None = parser
    while p is not None:
        nxt = None
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                nxt = next((a.choices[w] for w in words if w in a.choices), None)
            elif a.option_strings and a.help != argparse.SUPPRESS:
                longs = [o for o in a.option_strings if o.startswith("--")]
                out.setdefault(a.dest, longs[0] if longs else a.option_strings[0])
        p = nxt
    return out


def _named_command(argv: Sequence[str] | None) -> str | None:
    """The subcommand ``argv`` starts with, or None (no command line, or it starts with an
    option such as ``--help``: the top-level help lists every subcommand)."""
    if not argv:
        return None
    return argv[0] if argv[0] in SUBCOMMANDS else None


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("vramplan")
    except Exception:  # pragma: no cover - not installed
        return "0+unknown"


def _glue_negative_values(argv: Sequence[str]) -> list[str]:
    """``--min-memory -5GB`` → ``--min-memory=-5GB``: argparse takes a value that starts with
    ``-`` for an option and says "expected one argument"; glued, the flag's own check names
    what is wrong with the value."""
    out: list[str] = []
    for tok in argv:
        if (out and re.match(r"^-(\.?\d|inf|nan)", tok, re.IGNORECASE) and out[-1].startswith("--") and "=" not in out[-1]
                and len(out[-1]) > 2):
            out[-1] = f"{out[-1]}={tok}"
        else:
            out.append(tok)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    words = _glue_negative_values(sys.argv[1:] if argv is None else argv)
    parser = build_parser(words)
    args = parser.parse_args(words)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    from ..report.render import FLAG_OF

    if getattr(args, "no_cache", False):  # (the store reads it wherever a trace is looked up)
        os.environ["VRAMPLAN_NO_CACHE"] = "1"
    flags = flag_names(parser, argv)
    token = FLAG_OF.set(flags.get)
    try:
        return int(args.func(args) or 0)
    except VramplanError as e:
        sys.stderr.write(f"error: {e.render(flags.get)}\n")
        return e.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
    except BrokenPipeError:  # e.g. `vramplan gpus | head`: not an error
        _silence_stdout()
        return 0
    finally:
        FLAG_OF.reset(token)


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush does not fail again
    (https://docs.python.org/3/library/signal.html#note-on-sigpipe)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real file descriptor (tests capture stdout)
        pass


def entry() -> NoReturn:
    """The ``vramplan`` command (console script): :func:`main`, with a short-lived process's
    two start-up costs removed; what it prints and its exit status are :func:`main`'s.

    - Automatic garbage collection is paused, except for the commands in :data:`GC_KEPT`. Importing
      torch and transformers creates ~10^6 long-lived objects, and CPython's collector scans
      all of them again each time the heap grows by a quarter: ~0.9 s of an 8B train estimate,
      which finds no garbage. A trace still collects at the end of each iteration
      (:mod:`vramplan.trace.run`), so its FREE events do not depend on this.
    - The process ends with ``os._exit`` once ``atexit`` handlers have run and output is
      flushed, skipping the interpreter's teardown (its final collections and the release of
      every module object: ~1 s after a trace, ~0.4 s after a bare ``import torch``). Only
      when no other thread is alive; otherwise Python's normal exit waits for them.
    """
    words = sys.argv[1:]
    if not (words and words[0] in GC_KEPT):
        gc.disable()
    try:
        code = main(words)
    except SystemExit as e:  # argparse: --help, --version, a usage error
        if not isinstance(e.code, int):
            raise
        code = e.code
    _exit(code)


def _exit(code: int) -> NoReturn:
    if threading.active_count() > 1:  # let non-daemon threads finish as Python's own exit does
        sys.exit(code)
    atexit._run_exitfuncs()  # noqa: SLF001 - what Python's exit runs first (typeshed declares it)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed pipe (`vramplan gpus | head`) or closed stream
            if stream is sys.stdout:
                _silence_stdout()
    os._exit(code)


if __name__ == "__main__":  # pragma: no cover
    entry()
