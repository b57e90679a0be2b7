"""``vramplan.run_script``: a user's unmodified script → MemoryReport (see :mod:`vramplan.script`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import VramplanError
from ..hardware.gpu import GPU
from ..results import MemoryReport, Ran
from ..workload import Optimizer, OptimizerImpl, Parallel, Precision, Task, Workload
from .device import profile

if TYPE_CHECKING:
    from ..script.runner import ScriptRun
from .methods import replay_gpus, trace_core
from .pipeline import finish
from .resolve import resolve_gpu


def run_script(
    path: str | Path,
    argv: Sequence[str] = (),
    *,
    gpu: str | GPU | None = "h100-sxm",
    steps: int = 2,
    timeout: float | None = 300.0,
    gpus: int = 1,
    alloc_conf: str | None = None,
    progress: Callable[[str], None] | None = None,
    workspaces: bool = True,
    online: bool = False,
    world: int = 1,
    env: dict[str, str] | None = None,
    module: str | None = None,
    launched: bool = False,
) -> MemoryReport:
    """Run the script at ``path`` (with ``argv``) on an emulated ``gpu`` until ``steps``
    optimizer steps (or forward calls, for inference) and predict its memory. ``online``: let
    Hugging Face libraries in the script reach the Hub (off by default: no network).

    The script sees ``torch.cuda`` of the target GPU (``gpus`` of them); its memory queries
    are answered by the allocator simulation. Weights are never read. ``workspaces=False``
    leaves out the CUDA-only library workspaces (cuBLAS, cuDNN), e.g. to compare with a CPU run.
    ``world`` > 1: the script is rank 0 of that many processes (``gpus`` per node), as
    ``torchrun`` / ``accelerate launch`` start it; the report is that rank's memory, with the
    NCCL communicator of the world. ``env``: the launcher's variables for the script
    (``accelerate launch``'s: :attr:`vramplan.script.launch.Launch.env`). ``module``: the script is
    that module, run as ``python -m MODULE`` runs it (``path`` is its file:
    :func:`vramplan.script.launch.module_file`). ``launched``: a launcher started the script (torchrun's
    rank variables and a process group even for one process).
    """
    from ..emulate.facts import facts_of
    from ..script.runner import trace_script

    if gpus < 1:
        raise VramplanError(f"`gpus` must be at least 1, got {gpus}", hint="use `gpus=1`", field="gpus")
    g = resolve_gpu(gpu)
    if g is None:
        raise VramplanError("running a script needs a target GPU to emulate", hint="e.g. `gpu=h100-sxm`", field="gpu")
    if not isinstance(world, int) or world < 1:
        raise VramplanError(f"the world must be a positive number of processes, got {world!r}")
    if world > 1 and world % gpus:
        raise VramplanError(f"a world of {world} processes does not fill nodes of {gpus} GPU(s)",
                            hint=f"declare nodes × {gpus} processes")
    base = Workload(task=Task.TRAIN, parallel=Parallel(dp=world))
    dev = profile(g, base)  # the one device profile: the emulation, torch.cuda's answers, the verdict
    if not workspaces:
        dev = dev.without_workspaces()
    assert dev.usable is not None
    facts = facts_of(g.name, dev.sm, dev.usable, dev.overhead_bytes, sm_count=g.sm_count or 0, count=gpus)
    tr, run = trace_script(path, argv, profile=dev, facts=facts, steps=steps, timeout=timeout,
                           alloc_conf=alloc_conf, progress=progress, online=online, world=world, env=env,
                           module=module, launched=launched or world > 1)
    w, ran, notes = what_ran(run, world)
    core = trace_core(tr, w, alloc_conf, dev.allocator_capacity)
    per_gpu, capped = replay_gpus(tr, alloc_conf, dev.allocator_capacity)  # (every GPU capped as GPU 0 is)
    return finish(core, Path(path).name, w, g, dev, notes=[*notes, *capped], user_model=True,
                  gpus=per_gpu).replace(ran=ran, gpu_events=tr.gpu_events)


_OPTIMIZERS = {
    "SGD": Optimizer.SGD, "SGD-momentum": Optimizer.SGD_MOMENTUM, "Adam": Optimizer.ADAM, "AdamW": Optimizer.ADAMW,
    "AdamW8bit": Optimizer.ADAMW_8BIT, "Adam8bit": Optimizer.ADAMW_8BIT, "PagedAdamW8bit": Optimizer.PAGED_ADAMW_8BIT,
    "Adafactor": Optimizer.ADAFACTOR, "Lion": Optimizer.LION,
}
_IMPLS = {"foreach": OptimizerImpl.FOREACH, "fused": OptimizerImpl.FUSED, "for-loop": OptimizerImpl.FOR_LOOP}
_SHORT = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float64": "fp64"}


def what_ran(run: ScriptRun, world: int = 1) -> tuple[Workload, Ran, list[str]]:
    """The workload a script ran, read off the run (parameter dtypes, autocast regions,
    optimizers, first batch): the report's header and JSON say what the script did."""
    notes: list[str] = []
    dtype = max(run.param_dtypes, key=lambda k: run.param_dtypes[k]) if run.param_dtypes else "torch.float32"
    weights = _SHORT.get(dtype, dtype.removeprefix("torch."))
    auto = [_SHORT.get(d, d) for d in run.autocast]
    lower = [a for a in auto if a in ("fp16", "bf16")]  # (autocast to fp32 lowers nothing)
    fsdp = _SHORT.get(run.fsdp_compute, "") if run.fsdp_compute else ""
    if weights == "fp32" and (lower or fsdp):
        half = lower[0] if lower else fsdp
        precision = Precision.FP16_MIXED if half == "fp16" else Precision.BF16_MIXED
        how = [f"autocast {'/'.join(auto)}"] if auto else []
        how += [f"FSDP mixed precision {fsdp}"] if fsdp else []
        text = f"{precision} (fp32 weights, {', '.join(how)})"
    elif weights in ("bf16", "fp16"):
        precision = Precision(weights)
        text = f"{precision} weights" + (f", autocast {'/'.join(auto)}" if auto else "")
    else:
        precision = Precision.FP32
        text = f"{weights} weights" + (f", autocast {'/'.join(auto)}" if auto else "")
    fields: dict[str, object] = {"precision": precision}
    if run.optimizer_kinds:
        name, impl = run.optimizer_kinds[0]
        if name in _OPTIMIZERS:
            fields["optimizer"] = _OPTIMIZERS[name]
            fields["optimizer_impl"] = _IMPLS[impl]
        else:
            notes.append(f"optimizer {name}: not one of vramplan's modelled optimizers; the trace ran it as written "
                         "(the workload's optimizer field keeps vramplan's default)")
    if run.batch:
        fields["batch"] = run.batch
    if run.seq:
        fields["seq"] = run.seq
    if run.image:
        fields["image_size"] = run.image
    task = Task.TRAIN if run.steps > 0 or run.backwards > 0 else Task.INFER
    w = Workload(task=task, parallel=Parallel(dp=world), **fields)  # type: ignore[arg-type]
    kinds: dict[str, int] = {}
    for n, i in run.optimizer_kinds:
        kinds[f"{n} ({i})"] = kinds.get(f"{n} ({i})", 0) + 1
    optimizers = tuple(k if c == 1 else f"{k} ×{c}" for k, c in kinds.items())
    ran = Ran(precision=text, optimizers=optimizers, batch=run.batch,
              seq=run.seq, image=run.image, steps=run.steps, forwards=run.forwards)
    return w, ran, notes


__all__ = ["run_script"]
