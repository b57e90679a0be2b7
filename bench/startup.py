"""Start-up speed of the command line, against references measured in the same run.

Prints, for each command, the median wall time of fresh processes, its target and its
ratio to ``python -c pass`` / ``python -c "import torch"`` run alongside, and the CPU
seconds of each (user + system: on a shared machine the steadier figure):

1. ``vramplan --help`` (target ≤ 0.1 s);
2. ``vramplan estimate llama-3.1-8b --method analytic`` (target ≤ 0.12 s);
3. ``vramplan estimate llama-3.1-8b --task train`` (auto → trace; target ≤ 2.5 s and
   ≤ 1.7 × ``import torch``), and the same with ``VRAMPLAN_TRACE_WORKERS=1`` (never a forked
   reduced trace; by default they fork only where the first takes ≥ 0.2 s);

then where the trace's start-up goes: ``import torch``, then transformers' Llama modeling
file, and which of ``torch._dynamo``, ``torch.distributed.tensor``, ``torchao``,
``accelerate`` that import pulls in, with the chain of modules that pulls each
(``python -X importtime``), and what ``torch.distributed.tensor`` and ``torch._dynamo`` cost imported
on their own before the rest of transformers; whether torch's own first meta-tensor op (one ``nn.Linear``
forward on ``meta``, no transformers) imports ``torch._dynamo`` regardless, and what it costs;
and the interpreter's teardown after ``import torch`` that the ``vramplan`` entry point skips
(``os._exit`` after ``atexit``); then the **floor** of the 8B train estimate: a process that only
imports what it cannot do without (torch, transformers' Llama modeling file as vramplan imports
it, torch's first meta op), with the entry point's GC pause and ``os._exit``, against the
estimate and ``import torch`` of the same run: what is left is vramplan's own share (its
modules, the trace, the replay, the report).

Every process runs with bytecode caching on, in a private cache (``PYTHONPYCACHEPREFIX``):
an installed package has its ``.pyc`` files, while a checkout run with
``PYTHONDONTWRITEBYTECODE=1`` recompiles every module of vramplan on each start (~0.1 s).
One untimed run of each command fills that cache first.

With ``--baseline SRC`` (another checkout's ``src/``), each command also runs from it,
alternating with this one, and the ratio new / baseline is printed: on a shared machine the
only comparison that holds.

With ``--instructions``, the two quick commands also run once under ``valgrind --tool=cachegrind``
and their instruction counts are printed (and the baseline's, with ``--baseline``): on a shared
machine the figure that does not move with the load.

    .venv/bin/python bench/startup.py [--runs N] [--baseline SRC] [--instructions]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HEAVY = ("torch._dynamo", "torch.distributed.tensor", "torchao", "accelerate")


def _env(cache: str, src: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = cache
    src = src or str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _vramplan() -> list[str]:
    """The installed ``vramplan`` script, if it calls the console entry point
    (``vramplan.cli.main:entry``); an install from before that change calls ``main`` and would
    time the interpreter's teardown: then ``python -m vramplan.cli.main``, which calls ``entry``."""
    exe = shutil.which("vramplan", path=str(Path(sys.executable).parent))
    if exe and "import entry" in Path(exe).read_text(errors="replace"):
        return [exe]
    return [sys.executable, "-m", "vramplan.cli.main"]


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def median_wall(cmd: list[str], env: dict[str, str], runs: int, warm: bool = True) -> tuple[float, float]:
    """Median wall seconds and median CPU seconds (user + system) of ``runs`` fresh processes.
    On a shared machine the CPU time is the steadier figure: it does not count waiting for a core."""
    if warm:
        subprocess.run(cmd, env=env, check=True, capture_output=True)  # fills the bytecode cache
    times, cpu = [], []
    for _ in range(runs):
        t, c = time.perf_counter(), _children_cpu()
        subprocess.run(cmd, env=env, check=True, capture_output=True)
        times.append(time.perf_counter() - t)
        cpu.append(_children_cpu() - c)
    return statistics.median(times), statistics.median(cpu)


def ab_wall(cmd: list[str], env: dict[str, str], base_env: dict[str, str], runs: int
            ) -> tuple[tuple[float, float], tuple[float, float]]:
    """``median_wall`` of ``cmd`` under ``env`` and under ``base_env`` (another checkout), the two
    alternating so that both see the same load."""
    for e in (env, base_env):
        subprocess.run(cmd, env=e, check=True, capture_output=True)
    got: tuple[list[tuple[float, float]], list[tuple[float, float]]] = ([], [])
    for _ in range(runs):
        for e, out in zip((env, base_env), got, strict=True):
            out.append(median_wall(cmd, e, 1, warm=False))
    a, b = got
    return ((statistics.median(x for x, _ in a), statistics.median(c for _, c in a)),
            (statistics.median(x for x, _ in b), statistics.median(c for _, c in b)))


def _importers(lines: list[str], name: str) -> list[str]:
    """The chain of modules whose import first pulled ``name`` (from ``-X importtime``
    output: children are listed before their parent, one indentation level deeper)."""
    rows = []
    for line in lines:
        if not line.startswith("import time:") or "|" not in line:
            continue
        field = line.split("|")[2]
        depth = (len(field) - len(field.lstrip(" "))) // 2
        rows.append((depth, field.strip()))
    at = next((i for i, (_, mod) in enumerate(rows) if mod == name), None)
    if at is None:
        return []
    chain, depth = [name], rows[at][0]
    for d, mod in rows[at + 1:]:
        if d < depth:
            chain.append(mod)
            depth = d
    return chain


def import_breakdown(env: dict[str, str]) -> None:
    probe = ("import sys, time; t = time.perf_counter(); import torch; a = time.perf_counter() - t; "
             "t = time.perf_counter(); from vramplan.models.hf_import import import_transformers; "
             "import_transformers(); import transformers.models.llama.modeling_llama; "
             "b = time.perf_counter() - t; "
             f"print(a, b, *[m in sys.modules for m in {HEAVY!r}])")
    subprocess.run([sys.executable, "-c", probe], env=env, check=True, capture_output=True)
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", probe], env=env, check=True,
                         capture_output=True, text=True)
    a, b, *present = out.stdout.split()
    print(f"  import torch {float(a):.2f} s, then transformers' Llama modeling file {float(b):.2f} s "
          "(as vramplan imports it: models.hf_import; one run, under -X importtime)")
    lines = out.stderr.splitlines()
    for name, there in zip(HEAVY, present, strict=True):
        if there != "True":
            print(f"  {name}: not imported")
            continue
        chain = _importers(lines, name)
        via = chain[1:]
        shown = " <- ".join(via if len(via) <= 6 else [*via[:5], "…", via[-1]])
        print(f"  {name}: pulled by {shown}" if shown else f"  {name}: imported")


def dynamo_by_torch(env: dict[str, str]) -> None:
    """torch imports ``torch._dynamo`` on the first call of a ``torch._disable_dynamo``-wrapped
    function: its meta kernels' type-promotion wrappers (torch/_prims_common/wrappers.py) and
    ``Optimizer``; so a meta trace pays for it whoever imports it first."""
    probe = ("import sys, time; import torch; had = 'torch._dynamo' in sys.modules; t = time.perf_counter(); "
             "torch.nn.Linear(8, 8, device='meta')(torch.empty(2, 8, device='meta')); "
             "print(had, 'torch._dynamo' in sys.modules, time.perf_counter() - t)")
    subprocess.run([sys.executable, "-c", probe], env=env, check=True, capture_output=True)
    had, has, dt = subprocess.run([sys.executable, "-c", probe], env=env, check=True, capture_output=True,
                                  text=True).stdout.split()
    print(f"  torch's first meta op (nn.Linear forward on meta, no transformers): torch._dynamo imported "
          f"before {had}, after {has}; that op took {float(dt):.2f} s")


HEAVY_COST = ("import gc; gc.disable(); import sys, time; import torch; t0 = time.perf_counter(); "
              "import torch.distributed.tensor; t1 = time.perf_counter(); import torch._dynamo; "
              "t2 = time.perf_counter(); from vramplan.models.hf_import import import_transformers; "
              "import_transformers(); import transformers.models.llama.modeling_llama; t3 = time.perf_counter(); "
              "print(t1 - t0, t2 - t1, t3 - t2); sys.stdout.flush(); import os; os._exit(0)")


def heavy_cost(env: dict[str, str], runs: int) -> None:
    """What the two heavy torch packages that transformers' Llama modeling file imports at
    module level (``torch.distributed.tensor`` with sympy, ``torch._dynamo`` with triton where
    installed) cost, imported first on their own after ``import torch`` (GC paused), against the
    rest of transformers' import: the part of the floor that no choice of vramplan's removes."""
    subprocess.run([sys.executable, "-c", HEAVY_COST], env=env, check=True, capture_output=True)
    got = [tuple(map(float, subprocess.run([sys.executable, "-c", HEAVY_COST], env=env, check=True,
                                           capture_output=True, text=True).stdout.split())) for _ in range(runs)]
    dt, dyn, rest = (statistics.median(x[i] for x in got) for i in range(3))
    print(f"  of that, imported first on their own after import torch (GC paused; medians of {runs}): "
          f"torch.distributed.tensor {dt:.2f} s, torch._dynamo {dyn:.2f} s, then transformers and its Llama "
          f"modeling file {rest:.2f} s: transformers imports the first two at module level "
          "(core_model_loading, masking_utils), whatever the model runs")


FLOOR = ("import gc; gc.disable(); import os, torch; "
         "from vramplan.models.hf_import import import_transformers; import_transformers(); "
         "import transformers.models.llama.modeling_llama; "
         "torch.nn.Linear(8, 8, device='meta')(torch.empty(2, 8, device='meta')); os._exit(0)")
"""What any traced estimate of a transformers model imports and runs before vramplan's own work."""


def floor(env: dict[str, str], runs: int, torch_s: float, torch_cpu: float, estimate: tuple[float, float]) -> None:
    """The 8B train estimate's floor (:data:`FLOOR`) and vramplan's share above it."""
    f, f_cpu = median_wall([sys.executable, "-c", FLOOR], env, runs)
    e, e_cpu = estimate
    print(f"  floor: import torch + transformers' Llama modeling file + the first meta op, GC paused, os._exit: "
          f"{f:.2f} s ({f_cpu:.2f} s CPU) = {f / torch_s:.2f}× import torch ({f_cpu / torch_cpu:.2f}× in CPU time; "
          f"median of {runs}); the 8B train estimate {e:.2f} s ({e_cpu:.2f} s CPU) is the floor + {e - f:.2f} s "
          f"({e_cpu - f_cpu:.2f} s CPU) of vramplan's own work (modules, trace, replay, report)")
    print(f"  targets: ≤ 2.5 s and ≤ 1.7× import torch = {1.7 * torch_s:.2f} s; the floor alone is "
          f"{'below' if f <= min(2.5, 1.7 * torch_s) else 'above'} the tighter target ({min(2.5, 1.7 * torch_s):.2f} s)")


def instructions(cmd: list[str], env: dict[str, str]) -> int | None:
    """Instructions the process executes (valgrind cachegrind's ``I refs``); None without valgrind."""
    exe = shutil.which("valgrind")
    if exe is None:
        return None
    out = subprocess.run([exe, "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null", *cmd],
                         env=env, capture_output=True, text=True, check=True)
    line = next(x for x in out.stderr.splitlines() if "I   refs:" in x or "I refs:" in x)
    return int(line.rsplit(":", 1)[1].strip().replace(",", ""))


def teardown(env: dict[str, str], runs: int) -> None:
    """The interpreter's teardown after ``import torch``: a normal exit against ``os._exit``."""
    normal, normal_cpu = median_wall([sys.executable, "-c", "import torch"], env, runs)
    fast, fast_cpu = median_wall([sys.executable, "-c", "import os, torch; os._exit(0)"], env, runs)
    print(f"  teardown: python -c 'import torch' {normal:.2f} s ({normal_cpu:.2f} s CPU), ending with os._exit "
          f"{fast:.2f} s ({fast_cpu:.2f} s CPU) (medians of {runs}): {normal - fast:.2f} s ({normal_cpu - fast_cpu:.2f} s "
          "CPU) of interpreter teardown, which `vramplan` skips")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7, help="timed runs of each quick command (median)")
    ap.add_argument("--baseline", metavar="SRC", help="another checkout's src/ (e.g. `git archive REV src | tar -x "
                    "-C /tmp/base`): each command also runs from it, alternating, with the ratio new / baseline")
    ap.add_argument("--instructions", action="store_true",
                    help="also count the quick commands' instructions under valgrind (steady under load)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="vramplan-pyc-") as cache, \
            tempfile.TemporaryDirectory(prefix="vramplan-pyc-base-") as base_cache:
        env = _env(cache)
        base_env = _env(base_cache, str(Path(args.baseline).resolve())) if args.baseline else None
        vp = _vramplan()
        passing, passing_cpu = median_wall([sys.executable, "-c", "pass"], env, args.runs)
        torch_s, torch_cpu = median_wall([sys.executable, "-c", "import torch"], env, max(3, args.runs // 2))
        print(f"reference  python -c pass: {passing:.3f} s ({passing_cpu:.3f} s CPU)   python -c 'import torch': "
              f"{torch_s:.2f} s ({torch_cpu:.2f} s CPU) (medians, same run; load average "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
        rows = [
            ("vramplan --help", [*vp, "--help"], 0.10, args.runs),
            ("vramplan estimate llama-3.1-8b --method analytic",
             [*vp, "estimate", "llama-3.1-8b", "--method", "analytic"], 0.12, args.runs),
            ("vramplan estimate llama-3.1-8b --task train",
             [*vp, "estimate", "llama-3.1-8b", "--task", "train"], 2.5, 3),
        ]
        measured: dict[str, tuple[float, float]] = {}
        for label, cmd, target, runs in rows:
            if base_env is None:
                dt, cpu = median_wall(cmd, env, runs)
            else:  # the baseline's own script may call `main`: both run as `python -m vramplan.cli.main`
                cmd = [sys.executable, "-m", "vramplan.cli.main", *cmd[len(vp):]]
                (dt, cpu), (bdt, bcpu) = ab_wall(cmd, env, base_env, runs)
            measured[label] = (dt, cpu)
            ok = "PASS" if dt <= target else "MISS"
            print(f"{ok}  {label:<52} {dt:6.3f} s ({cpu:.3f} s CPU)  target ≤ {target:g} s (ratio {dt / target:.2f}); "
                  f"{dt / passing:5.1f}× python -c pass, {dt / torch_s:4.2f}× import torch "
                  f"({cpu / torch_cpu:4.2f}× in CPU time)")
            if base_env is not None:
                print(f"      baseline {bdt:6.3f} s ({bcpu:.3f} s CPU): new / baseline {dt / bdt:.2f} "
                      f"({cpu / bcpu:.2f} in CPU time), alternating runs")
            if args.instructions and target < 1:
                n = instructions(cmd, env)
                if n is None:
                    print("      instructions: valgrind not found")
                elif base_env is None:
                    print(f"      instructions: {n / 1e6:,.1f} M")
                else:
                    b = instructions(cmd, base_env)
                    print(f"      instructions: {n / 1e6:,.1f} M, baseline {b / 1e6:,.1f} M: new / baseline {n / b:.3f}")
        train = [*vp, "estimate", "llama-3.1-8b", "--task", "train"]
        one, one_cpu = median_wall(train, {**env, "VRAMPLAN_TRACE_WORKERS": "1"}, 3)
        print(f"      the same with VRAMPLAN_TRACE_WORKERS=1 (never a forked trace; by default the reduced traces fork "
              f"only where the first takes ≥ 0.2 s, and this model's take ~0.1 s): {one:.3f} s ({one_cpu:.3f} s CPU), "
              f"{one / torch_s:4.2f}× import torch")
        print("where the trace's start-up goes:")
        import_breakdown(env)
        heavy_cost(env, 3)
        dynamo_by_torch(env)
        teardown(env, max(3, args.runs // 2))
        floor(env, 3, torch_s, torch_cpu, measured["vramplan estimate llama-3.1-8b --task train"])


if __name__ == "__main__":
    main()
