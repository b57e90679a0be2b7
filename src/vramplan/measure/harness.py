"""Run steps on a real CUDA GPU and read what PyTorch and the driver say about memory.

The sequence (one fresh process per workload gives the cleanest numbers):

1. NVML *baseline* used memory (other processes), before this process makes a CUDA context;
2. create the context; *context* = NVML used − baseline − reserved;
3. start ``_record_memory_history`` when a snapshot is asked;
4. build the workload (model, inputs, optimizer), ``empty_cache()`` and reset the peak
   counters, so that build-time temporaries that the prediction does not model are gone;
5. run warm-up + timed steps, synchronising and sampling NVML after each;
6. read ``torch.cuda.memory_stats()`` peaks; dump the snapshot.

CUDA out-of-memory is a result, not a failure: ``Measured.oom`` is set and the peaks reached
before it are kept. All device access goes through a :class:`CudaProbe` so that the loop is
tested with a fake one.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from vramplan.errors import NoGPUError
from vramplan.measure.env import nvml_used
from vramplan.measure.record import Measured

NO_GPU = "no CUDA GPU found: `vramplan measure` needs one; use `vramplan estimate` to predict"
DEFAULT_MAX_ENTRIES = 100_000

Step = Callable[[], None]


class CudaProbe(Protocol):
    def available(self) -> bool: ...
    def start(self) -> None: ...
    def sync(self) -> None: ...
    def empty_cache(self) -> None: ...
    def reset_peaks(self) -> None: ...
    def reserved(self) -> int: ...
    def stats(self) -> Mapping[str, Any]: ...
    def used(self) -> int | None: ...
    def record_history(self, max_entries: int | None) -> None: ...
    def dump_snapshot(self, path: str) -> None: ...
    def is_oom(self, exc: BaseException) -> bool: ...


class TorchCuda:
    """The real probe: torch.cuda on device ``index`` and NVML."""

    def __init__(self, index: int = 0) -> None:
        import torch

        self.torch = torch
        self.index = index

    def available(self) -> bool:
        return bool(self.torch.cuda.is_available())

    def start(self) -> None:
        self.torch.cuda.set_device(self.index)
        self.torch.zeros(1, device="cuda")
        self.torch.cuda.synchronize()

    def sync(self) -> None:
        self.torch.cuda.synchronize()

    def empty_cache(self) -> None:
        self.torch.cuda.empty_cache()

    def reset_peaks(self) -> None:
        self.torch.cuda.reset_peak_memory_stats()

    def reserved(self) -> int:
        return int(self.torch.cuda.memory_reserved())

    def stats(self) -> Mapping[str, Any]:
        return dict(self.torch.cuda.memory_stats())

    def used(self) -> int | None:
        return nvml_used(self.index)

    def record_history(self, max_entries: int | None) -> None:
        mem = self.torch.cuda.memory
        if max_entries is None:
            mem._record_memory_history(enabled=None)
        else:
            mem._record_memory_history(max_entries=max_entries)

    def dump_snapshot(self, path: str) -> None:
        self.torch.cuda.memory._dump_snapshot(path)

    def is_oom(self, exc: BaseException) -> bool:
        return isinstance(exc, self.torch.cuda.OutOfMemoryError)


def require_gpu(cuda: CudaProbe) -> None:
    if not cuda.available():
        raise NoGPUError(NO_GPU)


def run_steps(
    build: Callable[[], Step], *, iterations: int = 3, warmup: int = 1, snapshot: str | Path | None = None,
    max_entries: int = DEFAULT_MAX_ENTRIES, cuda: CudaProbe | None = None,
) -> Measured:
    """Build the workload with ``build()`` and time ``warmup + iterations`` calls of the step it returns."""
    if iterations < 1 or warmup < 0:
        raise ValueError("iterations must be >= 1 and warmup >= 0")
    probe = cuda if cuda is not None else TorchCuda()
    require_gpu(probe)
    baseline = probe.used()
    probe.start()
    after_init = probe.used()
    context = after_init - baseline - probe.reserved() if after_init is not None and baseline is not None else None
    if snapshot is not None:
        probe.record_history(max_entries)
    times: list[float] = []
    used: list[int] = []
    oom = False
    try:
        step = build()
        probe.sync()
        probe.empty_cache()
        probe.reset_peaks()
        for i in range(warmup + iterations):
            t0 = time.perf_counter()
            step()
            probe.sync()
            dt = time.perf_counter() - t0
            u = probe.used()
            if u is not None:
                used.append(u)
            if i >= warmup:
                times.append(dt)
    except BaseException as e:
        if not probe.is_oom(e):
            raise
        oom = True
    finally:
        if snapshot is not None:
            probe.dump_snapshot(str(snapshot))
            probe.record_history(None)
    u = probe.used()
    if u is not None:
        used.append(u)
    st = probe.stats()
    return Measured(
        allocated=int(st.get("allocated_bytes.all.peak", 0)),
        reserved=int(st.get("reserved_bytes.all.peak", 0)),
        device_used=max(used) - baseline if used and baseline is not None else None,
        device_used_baseline=baseline,
        context=context,
        active=int(st.get("active_bytes.all.peak", 0)),
        requested=int(st.get("requested_bytes.all.peak", 0)),
        alloc_retries=int(st.get("num_alloc_retries", 0)),
        ooms=int(st.get("num_ooms", 0)),
        step_time_s=statistics.median(times) if times else None,
        step_times_s=tuple(times),
        iterations=iterations,
        warmup=warmup,
        oom=oom,
        snapshot=str(snapshot) if snapshot is not None else None,
    )
