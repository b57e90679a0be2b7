"""A launcher command line (``torchrun …`` / ``accelerate launch …``) → the script, its
arguments and the world it declares; ``vramplan run`` then emulates rank 0 of that world.

torchrun (torch/distributed/run.py): ``--nproc-per-node`` / ``--nproc_per_node`` N (default
1; ``gpu``/``auto`` = the GPUs of the node), ``--nnodes`` M or ``MIN:MAX`` (world = N × M).
accelerate launch (accelerate/commands/launch.py): ``--num_processes`` / ``--num-processes``
N is the total over ``--num_machines``; without it, ``num_processes`` of the
``--config_file`` YAML, else 1. Other options are accepted and ignored (they do not change
memory) unless they take a value, which is skipped with them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from vramplan.errors import VramplanError

LAUNCHERS = ("torchrun", "accelerate")

_TORCHRUN_FLAGS = {"--standalone", "--no-python", "--no_python", "--run-path", "--run_path", "-m", "--module",
                   "--no-ddp", "--no_ddp", "--virtual-local-rank", "--virtual_local_rank"}
"""torchrun options that take no value."""
_ACCELERATE_FLAGS = {"--multi_gpu", "--multi-gpu", "--cpu", "--use_deepspeed", "--use-deepspeed", "--use_fsdp",
                     "--use-fsdp", "--use_megatron_lm", "--use-megatron-lm", "--tpu", "--debug", "-q", "--quiet",
                     "--same_network", "--same-network", "--no_python", "--no-python", "-m", "--module",
                     "--fsdp_activation_checkpointing", "--enable_cpu_affinity"}


@dataclass(frozen=True)
class Launch:
    script: Path
    argv: tuple[str, ...]
    world: int
    """Processes (ranks) in the job."""
    per_node: int
    """Processes per node (GPUs each node's script sees)."""
    launcher: str = "python"
    env: tuple[tuple[str, str], ...] = ()
    module: str | None = None
    """``-m MODULE``: the script is that module (``script`` is its file), run as ``python -m`` runs it."""
    """Environment the launcher gives the script beside the ranks' (``accelerate launch``: its
    ``ACCELERATE_*`` / ``FSDP_*`` variables from the config file and flags — distributed type,
    mixed precision, the FSDP plugin's settings — which ``Accelerator()`` reads)."""


def _int(flag: str, value: str, launcher: str) -> int:
    if value in ("gpu", "auto"):
        raise VramplanError(f"{launcher} {flag} {value} counts the GPUs of the machine it runs on",
                            hint=f"give the number: {flag} 8")
    m = re.fullmatch(r"(\d+)(?::(\d+))?", value)
    if not m or int(m.group(2) or m.group(1)) < 1:
        raise VramplanError(f"{launcher} {flag} must be a positive integer, got {value!r}", hint=f"e.g. {flag} 8")
    return int(m.group(2) or m.group(1))  # MIN:MAX node counts: the largest world


def _options(args: list[str], launcher: str, flags: set[str]) -> tuple[dict[str, str], list[str]]:
    """Split ``--opt value`` / ``--opt=value`` options from the script and its arguments."""
    opts: dict[str, str] = {}
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("-"):
            break
        if "=" in a:
            k, v = a.split("=", 1)
            opts[k.replace("_", "-")] = v
            i += 1
        elif a in flags:
            opts[a.replace("_", "-")] = ""
            i += 1
        else:
            if i + 1 >= len(args):
                raise VramplanError(f"{launcher} option {a} needs a value", hint="then the script: … train.py ARGS")
            opts[a.replace("_", "-")] = args[i + 1]
            i += 2
    return opts, args[i:]


def _accelerate_config_processes(path: str) -> tuple[int | None, int | None]:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise VramplanError(f"no such accelerate config: {p}", hint="check the path of accelerate's config file")
    try:
        cfg = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise VramplanError(f"{p} is not valid YAML ({str(e).splitlines()[0]})",
                            hint="give accelerate the file `accelerate config` wrote") from None
    if not isinstance(cfg, dict):
        raise VramplanError(f"{p} is not an accelerate config (a YAML mapping)",
                            hint="give accelerate the file `accelerate config` wrote")
    n, m = cfg.get("num_processes"), cfg.get("num_machines")
    return (n if isinstance(n, int) else None), (m if isinstance(m, int) else None)


def _accelerate_env(options: list[str]) -> tuple[tuple[str, str], ...]:
    """The ``ACCELERATE_*`` and ``FSDP_*`` variables ``accelerate launch options…`` sets for its
    processes, computed by accelerate's own launcher (``_validate_launch_command`` reads the config
    file and fills the defaults; ``prepare_*_env`` turns them into the environment). Nothing when
    accelerate is not installed (the script could not use it either)."""
    try:
        from accelerate.commands.launch import _validate_launch_command, launch_command_parser
        from accelerate.utils import launch as acl
    except ImportError:
        return ()
    import contextlib
    import io

    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            args = launch_command_parser().parse_args(options)
            args, defaults, mp_from_config = _validate_launch_command(args)[:3]
            # rank 0's node: the rendezvous of a multi-node launch is not the script's business here
            args.machine_rank = args.machine_rank or 0
            args.main_process_ip = args.main_process_ip or "127.0.0.1"
            args.main_process_port = args.main_process_port or 29500
            if args.use_deepspeed and not args.cpu:  # (as launch_command fills it before deepspeed_launcher)
                fields = list(defaults.deepspeed_config.keys()) if defaults else []
                args.deepspeed_fields_from_accelerate_config = ",".join(
                    [*fields, *(["mixed_precision"] if mp_from_config else [])])
                env = acl.prepare_deepspeed_cmd_env(args)[1]
            elif (args.use_fsdp or args.multi_gpu) and not args.cpu:
                env = acl.prepare_multi_gpu_env(args)
            else:
                env = acl.prepare_simple_launcher_cmd_env(args)[1]
    except (SystemExit, Exception) as e:  # noqa: BLE001 (accelerate's own refusal of the options)
        why = f"{type(e).__name__}: {e}" if not isinstance(e, SystemExit) else "its argument parser refused them"
        raise VramplanError(f"accelerate launch could not read its options ({why})",
                            hint="check the options and the config file as `accelerate launch` takes them") from None
    return tuple(sorted((k, str(v)) for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_"))))


def parse_launch(command: list[str], gpus: int | None = None) -> Launch:
    """The script, arguments and world of ``command`` (after ``--``); ``gpus``: the GPUs per
    node the user declared (``vramplan run --gpus``), checked against the launcher's count."""
    cmd = list(command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise VramplanError("expected a command after --", hint="vramplan run -- python train.py ARGS")
    launcher = Path(cmd[0]).name
    if launcher not in LAUNCHERS:
        raise VramplanError(f"not a launcher: {cmd[0]}", hint="torchrun … or accelerate launch …")
    rest = cmd[1:]
    env: tuple[tuple[str, str], ...] = ()
    if launcher == "torchrun":
        opts, tail = _options(rest, launcher, _TORCHRUN_FLAGS)
        per_node = _int("--nproc-per-node", opts.get("--nproc-per-node", "1"), launcher)
        nodes = _int("--nnodes", opts.get("--nnodes", "1"), launcher)
        world = per_node * nodes
    else:
        if not rest or rest[0] != "launch":
            raise VramplanError("accelerate: only `accelerate launch SCRIPT` runs a script",
                                hint="e.g. `vramplan run -- accelerate launch --num_processes 8 train.py`")
        opts, tail = _options(rest[1:], "accelerate launch", _ACCELERATE_FLAGS)
        n_cfg, m_cfg = (None, None)
        if "--config-file" in opts:
            n_cfg, m_cfg = _accelerate_config_processes(opts["--config-file"])
        world = _int("--num-processes", opts["--num-processes"], "accelerate launch") if "--num-processes" in opts \
            else (n_cfg or 1)
        nodes = _int("--num-machines", opts["--num-machines"], "accelerate launch") if "--num-machines" in opts \
            else (m_cfg or 1)
        if world % nodes:
            raise VramplanError(f"accelerate launch: {world} processes do not split over {nodes} machines",
                                hint="give accelerate launch machines × GPUs-per-machine processes")
        per_node = world // nodes
        env = _accelerate_env(rest[1:])
    as_module = "-m" in opts or "--module" in opts
    if as_module and not tail:
        raise VramplanError(f"expected a module after {launcher} -m", hint=f"{launcher} … -m package.train ARGS")
    module = tail[0] if as_module else None
    if module is None and (not tail or not tail[0].endswith(".py")):
        raise VramplanError(f"expected a script after {launcher}'s options", hint=f"{launcher} … train.py ARGS")
    if gpus is not None and gpus != per_node:
        raise VramplanError(f"`gpus={gpus}` contradicts {launcher}'s {per_node} process(es) per node",
                            hint=f"drop `gpus` (the launcher declares the world), or use `gpus={per_node}`",
                            field="gpus")
    path = module_file(module) if module is not None else Path(tail[0])
    if not path.is_file():
        raise VramplanError(f"no such script: {path}", hint=f"check the path after {launcher}")
    return Launch(path, tuple(tail[1:]), world, per_node, launcher, env, module)


def module_file(name: str) -> Path:
    """The file ``python -m NAME`` runs (a package's ``__main__``), found as Python's import system
    finds it — the working folder first, then ``sys.path`` — without running any package's
    ``__init__`` (that runs on the emulated GPU, as ``python -m`` runs it before the module)."""
    import os
    import sys
    from importlib.machinery import PathFinder

    if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", name):
        raise VramplanError(f"not a module name: {name!r}", hint="e.g. -m torchtitan.train")
    parts = name.split(".")
    search: list[str] = [os.getcwd(), *sys.path]
    spec = None
    for i, part in enumerate(parts):
        spec = PathFinder.find_spec(part, search)
        if spec is None:
            raise VramplanError(f"no module named {'.'.join(parts[:i + 1])!r}",
                                hint="install its package in this environment, or give the script's path")
        if i < len(parts) - 1:
            if spec.submodule_search_locations is None:
                raise VramplanError(f"{'.'.join(parts[:i + 1])!r} is not a package", hint="check the module name")
            search = list(spec.submodule_search_locations)
    assert spec is not None
    if spec.submodule_search_locations is not None:  # a package: python -m runs its __main__
        spec = PathFinder.find_spec("__main__", list(spec.submodule_search_locations))
        if spec is None:
            raise VramplanError(f"{name!r} is a package and has no __main__", hint="name the module inside it")
    if not spec.origin or not spec.origin.endswith(".py"):
        raise VramplanError(f"{name!r} has no Python source to run ({spec.origin})", hint="give the script's path")
    return Path(spec.origin)


__all__ = ["LAUNCHERS", "Launch", "module_file", "parse_launch"]
