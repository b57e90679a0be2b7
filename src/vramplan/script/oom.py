"""Out-of-memory errors for scripts that recover from them (``vramplan run``).

A script that wraps its training in accelerate's ``find_executable_batch_size`` (HF Trainer's
``auto_find_batch_size=True`` goes through it) catches CUDA's out-of-memory error and runs again
with a smaller batch. The emulated GPU has no capacity of its own: without an error the script
would keep its first batch size, and ``vramplan run`` would size a batch the real GPU never runs.
Inside such a handler (only there) an allocation that the caching allocator simulation cannot
make within the GPU's free memory, even after freeing its cache, raises ``torch.OutOfMemoryError``
with CUDA's message, as the real allocator would;
the handler then retries as it does on a GPU. Elsewhere the run goes on past the capacity, so its
report gives the whole need.

The run's events are replayed within the capacity for that decision (the report's own replay has
none, so that a run that does not fit shows its whole need). When the handler runs its function
again, the allocator's cache is emptied: the real allocator frees its cached blocks once an
allocation does not fit (``release_cached_blocks`` before its out-of-memory error), which the next
call's first large allocations would make it do.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

_MODULES = ("accelerate.utils.memory", "accelerate.utils", "accelerate")
"""Where accelerate's ``find_executable_batch_size`` is importable from (accelerate 1.x)."""


class OomGuard:
    """Raises CUDA's out-of-memory error for an allocation the caching allocator could not make
    within ``capacity`` bytes (after freeing its cache, as the real one does) while a recovering
    handler runs; counts the retries (:func:`recovering_handlers`). ``replay``: the run's events
    replayed within the capacity (a :class:`~vramplan.emulate.live.LiveAllocator` with one)."""

    def __init__(self, capacity: int, total: int, replay: Any, stream: Callable[[], int] = lambda: 0) -> None:
        self.capacity = capacity
        self.total = total
        self.replay = replay
        self.stream = stream
        self.depth = 0
        """Handlers running (nested calls count once each)."""
        self.raised: list[int] = []
        """The bytes allocated when each error was raised."""
        self.tried: list[int] = []
        """The batch size of each call of the handled function, in order."""
        self.on_raise: Callable[[], None] | None = None
        self.on_retry: Callable[[], None] | None = None
        """Called as the handler runs its function again after an error (the failed call's tensors
        are gone by then)."""

    def __call__(self, nbytes: int) -> None:
        if self.depth == 0 or nbytes == 0:
            return
        al = self.replay.sync()
        block = al.malloc(nbytes, self.stream())
        if block is not None:  # (it fits: handed back; the event itself is replayed with the others)
            al.free(block)
            return
        in_use = al.allocated
        self.raised.append(in_use)
        if self.on_raise is not None:
            self.on_raise()
        gib = 2**30
        raise _oom_error()(
            f"CUDA out of memory. Tried to allocate {_mib(nbytes)}. GPU 0 has a total capacity of "
            f"{self.total / gib:.2f} GiB of which {max(0, self.capacity - in_use) / gib:.2f} GiB is free. "
            f"Of the allocated memory {in_use / gib:.2f} GiB is allocated by PyTorch "
            "(emulated by vramplan run inside the script's out-of-memory handler)")

    def note(self) -> str | None:
        if not self.raised:
            return None
        sizes = ", ".join(f"{b:,}" for b in self.tried)
        return (f"the script's out-of-memory handler (accelerate's find_executable_batch_size) ran its function with "
                f"batch sizes {sizes}: {len(self.raised)} emulated CUDA out-of-memory error(s) (the caching allocator "
                f"replayed within the GPU's free memory, {self.capacity / 2**30:.2f} GiB), then retried "
                "as on a GPU; the steps are the last call's, and the peaks include the failed calls up to their "
                "errors, as torch.cuda.max_memory_allocated() would")


def _oom_error() -> type[RuntimeError]:
    return getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError  # type: ignore[no-any-return]


def _mib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


@contextlib.contextmanager
def recovering_handlers(guard: OomGuard) -> Iterator[None]:
    """accelerate's ``find_executable_batch_size`` with the function it wraps counted as a
    handler's (``guard.depth``) and its batch sizes recorded; the decorator itself is
    accelerate's own (its retry rule, its cache clearing)."""
    import importlib

    try:
        memory = importlib.import_module("accelerate.utils.memory")
    except ImportError:
        yield
        return
    orig = getattr(memory, "find_executable_batch_size", None)
    if orig is None:
        yield
        return

    def find_executable_batch_size(function: Any = None, *args: Any, **kwargs: Any) -> Any:
        if function is None:
            return functools.partial(find_executable_batch_size, *args, **kwargs)

        @functools.wraps(function)
        def handled(batch_size: Any, *a: Any, **k: Any) -> Any:
            if guard.raised and guard.on_retry is not None:
                guard.on_retry()
            guard.depth += 1
            guard.tried.append(batch_size)
            try:
                return function(batch_size, *a, **k)
            finally:
                guard.depth -= 1

        return orig(handled, *args, **kwargs)

    saved = {}
    for name in _MODULES:
        mod = importlib.import_module(name)
        if getattr(mod, "find_executable_batch_size", None) is orig:
            saved[name] = mod
            mod.find_executable_batch_size = find_executable_batch_size  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for mod in saved.values():
            mod.find_executable_batch_size = orig  # type: ignore[attr-defined]
