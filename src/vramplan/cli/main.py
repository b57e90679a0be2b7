"""``vramplan`` entry point: builds the parser from one module per subcommand.

Each module in :data:`SUBCOMMANDS` defines ``register(subparsers)`` which adds its parser
and sets ``func`` to a ``run(args) -> int``. Modules are imported only to build the
parser; heavy imports (torch, transformers) happen inside ``run`` so that
``vramplan estimate`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from ..errors import VramplanError

SUBCOMMANDS = (
    "estimate", "trace", "fit", "plan", "models", "gpus", "gpu", "replay", "snapshot",
    "measure", "rules", "run",
)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line on stderr and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"error: {message} (see `{self.prog} --help`)\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="vramplan",
        description="How much GPU memory will this PyTorch workload take, does it fit, "
        "and what is the cheapest, fastest way to make it fit?",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in SUBCOMMANDS:
        try:
            mod = importlib.import_module(f"vramplan.cli.{name}_cmd")
        except ModuleNotFoundError as e:  # a subcommand not built yet
            if e.name != f"vramplan.cli.{name}_cmd":
                raise
            continue
        mod.register(sub)
    return parser


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("vramplan")
    except Exception:  # pragma: no cover - not installed
        return "0+unknown"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except VramplanError as e:
        sys.stderr.write(f"error: {e}\n")
        return e.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
    except BrokenPipeError:  # e.g. `vramplan gpus | head`: not an error
        _silence_stdout()
        return 0


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush does not fail again
    (https://docs.python.org/3/library/signal.html#note-on-sigpipe)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real file descriptor (tests capture stdout)
        pass


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
