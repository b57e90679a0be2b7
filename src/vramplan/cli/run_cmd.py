"""``vramplan run [--gpu G] [--steps N] [--timeout S] -- python train.py ARGS``.

Runs an unmodified training or inference script with the target GPU emulated (see
:mod:`vramplan.script`) and reports the same memory report as ``vramplan trace``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import VramplanError
from .common import add_output_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run", help="run your unmodified script on an emulated GPU: vramplan run -- python train.py …",
        description="Run a training or inference script as written, with the target GPU emulated "
        "(no GPU, no weights read), until N optimizer steps (or N forward calls for inference), and "
        "predict its memory: breakdown, phases, allocator replay, verdict. Everything after -- is "
        "the command: python SCRIPT.py ARGS.",
    )
    p.add_argument("--gpu", default="h100-sxm", help="GPU to emulate (default h100-sxm; see vramplan gpus)")
    p.add_argument("--gpus", type=int, default=1, help="torch.cuda.device_count() the script sees (default 1)")
    p.add_argument("--steps", type=int, default=2,
                   help="optimizer steps to run (default 2: the first builds optimizer states); "
                   "for an inference script, forward calls")
    p.add_argument("--timeout", type=float, default=300.0, help="give up after this many seconds (default 300)")
    p.add_argument("--online", action="store_true",
                   help="let the script's Hugging Face libraries reach the Hub (default: offline)")
    p.add_argument("--alloc-conf", default=None, metavar="CONF", help="PYTORCH_CUDA_ALLOC_CONF to simulate")
    p.add_argument("--snapshot", metavar="FILE.pickle", help="write the predicted trace in PyTorch's snapshot format")
    add_output_args(p)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- python SCRIPT.py ARGS")
    p.set_defaults(func=run)


def script_and_args(command: list[str]) -> tuple[Path, list[str]]:
    cmd = list(command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if cmd and Path(cmd[0]).name.startswith("python"):
        cmd = cmd[1:]
    if cmd and cmd[0] == "-m":
        raise VramplanError("python -m MODULE is not supported yet", hint="give the script's path: -- python path/to/train.py")
    if not cmd or not cmd[0].endswith(".py"):
        raise VramplanError("expected a script after --", hint="vramplan run --gpu h100-sxm -- python train.py ARGS")
    if cmd[0] in ("torchrun", "accelerate"):
        raise VramplanError(f"{cmd[0]} launches several processes; vramplan run emulates one",
                            hint="-- python train.py (one GPU)")
    path = Path(cmd[0])
    if path.is_dir():
        raise VramplanError(f"{path} is a directory", hint="name the script: -- python DIR/train.py")
    if not path.is_file():
        raise VramplanError(f"no such script: {path}", hint="check the path after -- python")
    return path, cmd[1:]


def run(args: argparse.Namespace) -> int:
    from ..engine.script import run_script
    from ..report.estimate import to_doc
    from ..report.render import emit
    from .estimate_cmd import check_extras, hint, write_extras

    if args.command and args.command[0] in ("torchrun", "accelerate") or \
            (len(args.command) > 1 and args.command[0] == "--" and args.command[1] in ("torchrun", "accelerate")):
        launcher = args.command[0] if args.command[0] != "--" else args.command[1]
        raise VramplanError(f"{launcher} launches several processes; vramplan run emulates one GPU process",
                            hint="-- python train.py (multi-GPU scripts are not emulated yet)")
    path, argv = script_and_args(args.command)
    if args.steps < 1:
        raise VramplanError(f"--steps must be >= 1, got {args.steps}")
    if args.timeout <= 0:
        raise VramplanError(f"--timeout must be positive seconds, got {args.timeout:g}")
    args.method = "trace"
    check_extras(args)
    report = run_script(path, argv, gpu=args.gpu, steps=args.steps, timeout=args.timeout, gpus=args.gpus,
                        alloc_conf=args.alloc_conf, online=args.online,
                        progress=lambda line: hint(f"vramplan run: {line}"))
    emit(to_doc(report), args.format, sys.stdout, report.to_dict())
    write_extras(report, args)
    return 0
