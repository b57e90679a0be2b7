"""``vramplan run [--gpu G] [--steps N] [--timeout S] -- python train.py ARGS``.

Runs an unmodified training or inference script with the target GPU emulated (see
:mod:`vramplan.script`) and reports the same memory report as ``vramplan trace``.
"""

from __future__ import annotations

import argparse
import contextlib
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
        "the command: python SCRIPT.py ARGS, or torchrun / accelerate launch … SCRIPT.py ARGS "
        "(rank 0 of the world they declare is emulated, on PyTorch's fake process group).",
    )
    p.add_argument("--gpu", default="h100-sxm", help="GPU to emulate (default h100-sxm; see vramplan gpus)")
    p.add_argument("--gpus", type=int, default=None,
                   help="torch.cuda.device_count() the script sees (default 1; with torchrun / accelerate launch, "
                   "their processes per node)")
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


def script_and_args(command: list[str]) -> tuple[Path, list[str], str | None]:
    """The script, its arguments, and the module it is when run as ``python -m MODULE``."""
    from ..script.launch import module_file

    cmd = list(command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if cmd and Path(cmd[0]).name.startswith("python"):
        cmd = cmd[1:]
    if cmd and cmd[0] == "-m":
        if len(cmd) < 2:
            raise VramplanError("expected a module after python -m", hint="-- python -m package.train ARGS")
        return module_file(cmd[1]), cmd[2:], cmd[1]
    if not cmd or not cmd[0].endswith(".py"):
        raise VramplanError("expected a script after --", hint="vramplan run --gpu h100-sxm -- python train.py ARGS")
    path = Path(cmd[0])
    if path.is_dir():
        raise VramplanError(f"{path} is a directory", hint="name the script: -- python DIR/train.py")
    if not path.is_file():
        raise VramplanError(f"no such script: {path}", hint="check the path after -- python")
    return path, cmd[1:], None


def run(args: argparse.Namespace) -> int:
    from ..engine.script import run_script
    from ..report.estimate import to_doc
    from ..report.render import emit
    from ..script.launch import LAUNCHERS, parse_launch
    from .estimate_cmd import check_extras, hint, write_extras

    if args.gpus is not None and args.gpus < 1:
        raise VramplanError(f"`gpus` must be at least 1, got {args.gpus}", hint="use `gpus=1`", field="gpus")
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    world = 1
    env: dict[str, str] = {}
    launched = False
    if cmd and Path(cmd[0]).name in LAUNCHERS:
        launch = parse_launch(cmd, gpus=args.gpus)
        path, argv, world, gpus, module = launch.script, list(launch.argv), launch.world, launch.per_node, launch.module
        env = dict(launch.env)
        launched = True
        hint(f"vramplan run: {launch.launcher} declares {world} process(es), {gpus} per node: "
             "emulating rank 0 on PyTorch's fake process group")
    else:
        path, argv, module = script_and_args(args.command)
        gpus = args.gpus or 1
    if args.steps < 1:
        raise VramplanError(f"--steps must be >= 1, got {args.steps}")
    if args.timeout <= 0:
        raise VramplanError(f"--timeout must be positive seconds, got {args.timeout:g}")
    args.method = "trace"
    check_extras(args)
    # the script's own output goes to stderr when stdout carries JSON (it must parse)
    quiet = contextlib.redirect_stdout(sys.stderr) if args.format == "json" else contextlib.nullcontext()
    with quiet:
        report = run_script(path, argv, gpu=args.gpu, steps=args.steps, timeout=args.timeout, gpus=gpus, world=world,
                            alloc_conf=args.alloc_conf, online=args.online, env=env, module=module, launched=launched,
                            progress=lambda line: hint(f"vramplan run: {line}"))
    emit(to_doc(report), args.format, sys.stdout, report.to_dict)
    write_extras(report, args)
    return 0
