"""``vramplan.measure``: run a workload on the local CUDA GPU and predict it beside the numbers."""

from __future__ import annotations

import datetime as _dt
import os
from collections.abc import Sequence
from pathlib import Path

from vramplan.errors import VramplanError
from vramplan.measure.harness import (
    DEFAULT_MAX_ENTRIES,
    CudaProbe,
    TorchCuda,
    require_gpu,
    run_steps,
)
from vramplan.measure.record import MeasureRecord, Prediction, append_jsonl
from vramplan.models.spec import ModelSpec
from vramplan.workload import Workload


def measure(
    model: str | ModelSpec, w: Workload, *, gpu: str | None = None, alloc_conf: str | None = None,
    iterations: int = 3, warmup: int = 1, snapshot: str | Path | None = None,
    max_entries: int = DEFAULT_MAX_ENTRIES, out: str | Path | None = None,
    methods: Sequence[str] = ("trace", "analytic"), label: str = "", cuda: CudaProbe | None = None,
) -> MeasureRecord:
    """Run ``w`` for real on the current CUDA GPU; predict it with each of ``methods``.

    ``gpu`` names the catalog GPU the predictions use (default: the one detected);
    ``alloc_conf`` is set as ``PYTORCH_CUDA_ALLOC_CONF`` before CUDA starts and given to the
    predictions; ``out`` appends the record as one JSON line. Raises NoGPUError without a GPU.
    """
    if iterations < 1:
        raise VramplanError(f"--iterations must be >= 1, got {iterations}")
    if warmup < 0:
        raise VramplanError(f"--warmup must be >= 0, got {warmup}")
    if max_entries < 1:
        raise VramplanError(f"--max-entries must be >= 1, got {max_entries}")
    if snapshot is not None and not Path(snapshot).parent.exists():
        raise VramplanError(f"cannot write the snapshot to '{snapshot}': its folder does not exist")
    if alloc_conf is not None:
        from vramplan.allocator import parse_conf

        parse_conf(alloc_conf)  # PyTorch's own error messages, before any GPU work
    probe = cuda if cuda is not None else TorchCuda()
    require_gpu(probe)
    _set_alloc_conf(alloc_conf)
    from vramplan.engine import resolve_model
    from vramplan.measure.env import environment
    from vramplan.measure.predict import catalog_gpu, predict
    from vramplan.measure.step import build_step, check_measurable

    spec = resolve_model(model)
    check_measurable(w)
    measured = run_steps(lambda: build_step(spec, w), iterations=iterations, warmup=warmup,
                         snapshot=snapshot, max_entries=max_entries, cuda=probe)
    env = environment(alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    target = gpu or catalog_gpu(env.gpu_name, env.gpu_memory)
    preds: tuple[Prediction, ...] = predict(spec, w, gpu=target, alloc_conf=alloc_conf, methods=methods) if methods else ()
    rec = MeasureRecord(
        model=spec.name, workload=w, env=env, measured=measured, predicted=preds, id=label,
        time=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        extra={"gpu": target} if target else {},
    )
    if out is not None:
        append_jsonl(rec, out)
    return rec


def _set_alloc_conf(conf: str | None) -> None:
    if conf is None:
        return
    import torch

    current = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    if torch.cuda.is_initialized() and current != conf:
        raise VramplanError("--alloc-conf must be set before CUDA starts in this process",
                            hint="run the measurement in a fresh process")
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf

__all__ = ["measure"]
