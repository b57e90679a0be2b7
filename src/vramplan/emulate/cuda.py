"""The emulated CUDA device a script sees: ``torch.cuda`` answers for the target GPU.

A script run by :mod:`.runner` asks ``torch.cuda`` what it runs on before it builds anything
(``is_available()``, ``get_device_properties(0).total_memory``, ``is_bf16_supported()``) and
often prints memory figures as it goes. On a machine without a GPU (or without CUDA at
all) those calls fail or answer for no device. :func:`emulated_cuda` answers them for the
target GPU instead — properties from the catalog, memory figures from the caching-allocator
simulation fed with the events recorded so far (so ``torch.cuda.max_memory_allocated()`` in
the script prints the predicted figure) — and restores the real functions afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..allocator import CachingAllocator, parse_conf
from ..events import EventLog


@dataclass(frozen=True)
class DeviceFacts:
    """What the script may learn about the emulated GPU (handed in by the engine)."""

    name: str
    sm: tuple[int, int]
    total_memory: int
    """``get_device_properties().total_memory`` / ``mem_get_info()[1]``: what CUDA reports."""
    outside_allocator: int = 0
    """CUDA context and libraries: memory the allocator cannot get (``mem_get_info`` free)."""
    sm_count: int = 0
    count: int = 1
    """``device_count()``."""

    @property
    def bf16(self) -> bool:
        return self.sm >= (8, 0)


@dataclass(frozen=True)
class _Props:
    """Stands in for ``torch._C._CudaDeviceProperties``."""

    name: str
    major: int
    minor: int
    total_memory: int
    multi_processor_count: int
    is_integrated: int = 0
    is_multi_gpu_board: int = 0
    L2_cache_size: int = 0
    warp_size: int = 32
    gcnArchName: str = ""
    uuid: str = "00000000-0000-0000-0000-000000000000"


class LiveAllocator:
    """Replays the recorded events incrementally, so the script's memory queries get the
    simulation's figures at the moment it asks."""

    def __init__(self, log: EventLog, conf: str | None = None) -> None:
        self.log = log
        self.al = CachingAllocator(parse_conf(conf or ""))
        self._pos = 0
        self._live: dict[int, Any] = {}
        self.peak_allocated = 0
        self.peak_reserved = 0

    def sync(self) -> CachingAllocator:
        log, al, live = self.log, self.al, self._live
        n = len(log)
        for k in range(self._pos, n):
            act = log.action[k]
            if act == 0:
                size = log.size[k]
                live[log.id[k]] = al.malloc(size, log.stream[k]) if size > 0 else None
                self.peak_allocated = max(self.peak_allocated, al.allocated)
                self.peak_reserved = max(self.peak_reserved, al.reserved)
            elif act in (1, 2):
                b = live.pop(log.id[k], None)
                if b is not None:
                    al.free(b)
            elif act == 4:
                al.empty_cache()
        self._pos = n
        return al

    def reset_peaks(self) -> None:
        al = self.sync()
        self.peak_allocated, self.peak_reserved = al.allocated, al.reserved

    def stats(self) -> dict[str, int]:
        al = self.sync()
        return {
            "allocated_bytes.all.current": al.allocated, "allocated_bytes.all.peak": self.peak_allocated,
            "reserved_bytes.all.current": al.reserved, "reserved_bytes.all.peak": self.peak_reserved,
            "active_bytes.all.current": al.active, "active_bytes.all.peak": al.max_active,
            "requested_bytes.all.current": al.requested, "requested_bytes.all.peak": al.max_requested,
            "num_alloc_retries": al.num_alloc_retries, "num_ooms": al.num_ooms,
            "segment.all.current": al.num_segments,
        }


@contextlib.contextmanager
def emulated_cuda(facts: DeviceFacts, live: LiveAllocator,
                  on_sync: Callable[[str], None]) -> Iterator[None]:
    """Patch ``torch.cuda`` (see the module docstring); ``on_sync(kind)`` receives
    ``synchronize`` / ``empty_cache`` calls (the trace turns them into events)."""
    cuda = torch.cuda
    props = _Props(name=facts.name, major=facts.sm[0], minor=facts.sm[1], total_memory=facts.total_memory,
                   multi_processor_count=facts.sm_count)
    current = [0]

    def _check(device: Any = None) -> None:
        idx = device.index if isinstance(device, torch.device) else device
        if isinstance(idx, int) and not 0 <= idx < facts.count:
            raise RuntimeError(f"CUDA error: invalid device ordinal {idx} (the emulated machine has "
                               f"{facts.count} GPU{'s' if facts.count != 1 else ''}; vramplan run --gpus)")

    def set_device(device: Any) -> None:
        _check(device)
        idx = device.index if isinstance(device, torch.device) else device
        if isinstance(idx, int):
            current[0] = idx

    def get_device_properties(device: Any = None) -> _Props:
        _check(device)
        return props

    def mem_get_info(device: Any = None) -> tuple[int, int]:
        al = live.sync()
        return max(0, facts.total_memory - facts.outside_allocator - al.reserved), facts.total_memory

    def stat(key: str) -> Callable[..., int]:
        return lambda device=None: live.stats()[key]

    class _Stream:
        def __init__(self, device: Any = None, priority: int = 0, **kw: Any) -> None:
            self.device = torch.device("cuda", current[0])

        def synchronize(self) -> None:
            on_sync("synchronize")

        def wait_stream(self, other: Any) -> None: ...
        def wait_event(self, event: Any) -> None: ...
        def record_event(self, event: Any = None) -> Any:
            return event if event is not None else _Event()

        def query(self) -> bool:
            return True

        def is_capturing(self) -> bool:
            return False

        def __enter__(self) -> _Stream:
            return self

        def __exit__(self, *exc: Any) -> None: ...

    class _Event:
        def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
            pass

        def record(self, stream: Any = None) -> None: ...
        def wait(self, stream: Any = None) -> None: ...
        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            on_sync("synchronize")

        def elapsed_time(self, end: Any) -> float:
            return 0.0

    default_stream = _Stream()

    @contextlib.contextmanager
    def stream(s: Any = None) -> Iterator[None]:
        yield

    patches: dict[str, Any] = {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "init": lambda: None,
        "device_count": lambda: facts.count,
        "current_device": lambda: current[0],
        "set_device": set_device,
        "get_device_properties": get_device_properties,
        "get_device_capability": lambda device=None: facts.sm,
        "get_device_name": lambda device=None: facts.name,
        "is_bf16_supported": lambda including_emulation=True: facts.bf16,
        "get_arch_list": lambda: [f"sm_{facts.sm[0]}{facts.sm[1]}"],
        "mem_get_info": mem_get_info,
        "memory_allocated": stat("allocated_bytes.all.current"),
        "max_memory_allocated": stat("allocated_bytes.all.peak"),
        "memory_reserved": stat("reserved_bytes.all.current"),
        "max_memory_reserved": stat("reserved_bytes.all.peak"),
        "memory_stats": lambda device=None: live.stats(),
        "reset_peak_memory_stats": lambda device=None: live.reset_peaks(),
        "reset_max_memory_allocated": lambda device=None: live.reset_peaks(),
        "synchronize": lambda device=None: on_sync("synchronize"),
        "empty_cache": lambda: on_sync("empty_cache"),
        "manual_seed": lambda seed: None,
        "manual_seed_all": lambda seed: None,
        "seed": lambda: None,
        "seed_all": lambda: None,
        "Stream": _Stream,
        "Event": _Event,
        "current_stream": lambda device=None: default_stream,
        "default_stream": lambda device=None: default_stream,
        "stream": stream,
        "set_per_process_memory_fraction": lambda fraction, device=None: None,
    }
    saved = {k: getattr(cuda, k) for k in patches if hasattr(cuda, k)}
    saved_lazy = getattr(cuda, "_lazy_init", None)
    for k, v in patches.items():
        setattr(cuda, k, v)
    cuda._lazy_init = lambda: None  # type: ignore[attr-defined]
    # On a CUDA build of torch (no driver here) ``torch.accelerator`` reports CUDA, and the
    # optimizers' graph-capture check (torch/optim/optimizer.py, 2.13/2.14) then asks it for
    # the current stream, which would reach the real CUDA runtime. Answer from the emulation.
    acc = getattr(torch, "accelerator", None)
    acc_patches: dict[str, Any] = {
        "current_stream": lambda device=None: default_stream,
        "current_device_index": lambda: current[0],
        "synchronize": lambda device=None: on_sync("synchronize"),
    }
    acc_saved = {k: getattr(acc, k) for k in acc_patches if acc is not None and hasattr(acc, k)}
    for k in acc_saved:
        setattr(acc, k, acc_patches[k])
    try:
        yield
    finally:
        for k, v in acc_saved.items():
            setattr(acc, k, v)
        for k in patches:
            if k in saved:
                setattr(cuda, k, saved[k])
            else:
                delattr(cuda, k)
        if saved_lazy is not None:
            cuda._lazy_init = saved_lazy  # type: ignore[attr-defined]
