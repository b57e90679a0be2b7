"""Out-of-memory errors for scripts that recover from them (``vramplan run``).

A script that wraps its training in accelerate's ``find_executable_batch_size`` (HF Trainer's
``auto_find_batch_size=True`` goes through it) catches CUDA's out-of-memory error and runs again
with a smaller batch. Lightning's batch-size finder (``Tuner.scale_batch_size``, the
``BatchSizeFinder`` callback) runs a few steps at each batch size it tries, doubling it until
one raises that error, then trains with the largest that ran (its "power" mode; "binsearch"
then searches between the two). The emulated GPU has no capacity of its own: without an error the script
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

from ..emulate.imports import patched_on_import, replace

_MODULES = ("accelerate.utils.memory", "accelerate.utils", "accelerate")
"""Where accelerate's ``find_executable_batch_size`` is importable from (accelerate 1.x)."""

_LIGHTNING = ("lightning.pytorch.tuner.batch_size_scaling", "pytorch_lightning.tuner.batch_size_scaling")
"""Lightning's batch-size finder (both package names; lightning 2.x): ``_try_loop_run`` runs one
trial, ``_adjust_batch_size`` sets the next size, and ``__scale_batch_reset_params`` /
``__scale_batch_restore_params`` open and close the search (batch_size_scaling.py, lightning 2.6.6)."""


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
        self.handler = "accelerate's find_executable_batch_size"
        self.searching = 0
        """Lightning's batch-size finder is running: its trials' steps do not end the run."""
        self.found: int | None = None
        """The batch size Lightning's finder settled on."""
        self.failed = False
        """The last call ended in an emulated error (the next call is a retry)."""
        self.released = 0
        """Allocations that fitted only once the allocator freed its cache."""
        self.on_raise: Callable[[], None] | None = None
        self.on_release: Callable[[], None] | None = None
        """Called where the allocator freed its cache: an allocation fitted only then, or did not fit
        even then (before the error)."""
        self.on_retry: Callable[[], None] | None = None
        """Called as the handler runs its function again after an error (the failed call's tensors
        are gone by then)."""
        self.current: Any = None
        """The batch size Lightning's finder set last."""
        self.on_search_end: Callable[[], None] | None = None
        """Called as Lightning's finder ends (the run's steps are the training's after it)."""

    def __call__(self, nbytes: int) -> None:
        if self.depth == 0 or nbytes == 0:
            return
        al = self.replay.sync()
        retries = al.num_alloc_retries
        block = al.malloc(nbytes, self.stream())
        if block is not None:  # (it fits: handed back; the event itself is replayed with the others)
            al.free(block)
            if al.num_alloc_retries > retries:
                # it fitted once the allocator freed its cache, as CUDA's does before an out-of-memory
                # error: the run's own (uncapped) replay frees it there too
                self.released += 1
                if self.on_release is not None:
                    self.on_release()
            return
        in_use = al.allocated
        self.raised.append(in_use)
        self.failed = True
        if self.on_release is not None:  # (CUDA's allocator freed its cache before it gave up)
            self.on_release()
        if self.on_raise is not None:
            self.on_raise()
        gib = 2**30
        raise _oom_error()(
            f"CUDA out of memory. Tried to allocate {_mib(nbytes)}. GPU 0 has a total capacity of "
            f"{self.total / gib:.2f} GiB of which {max(0, self.capacity - in_use) / gib:.2f} GiB is free. "
            f"Of the allocated memory {in_use / gib:.2f} GiB is allocated by PyTorch "
            "(emulated by vramplan run inside the script's out-of-memory handler)")

    @contextlib.contextmanager
    def handling(self, batch_size: Any) -> Iterator[None]:
        """The handled function (or a finder's trial) runs with ``batch_size``."""
        if self.failed and self.on_retry is not None:
            self.on_retry()
        self.failed = False
        self.depth += 1
        self.tried.append(batch_size)
        try:
            yield
        finally:
            self.depth -= 1

    def note(self) -> str | None:
        if not self.tried or (not self.raised and not self.searching and self.found is None):
            return None
        sizes = ", ".join(f"{b:,}" if isinstance(b, int) else str(b) for b in self.tried)
        errors = (f"{len(self.raised)} emulated CUDA out-of-memory error(s) (the caching allocator replayed within "
                  f"the GPU's free memory, {self.capacity / 2**30:.2f} GiB)")
        peaks = ("the peaks include the failed calls up to their errors, as torch.cuda.max_memory_allocated() would")
        if self.released:
            errors += (f"; {self.released} allocation(s) fitted only once the allocator freed its cache, as CUDA's "
                       "does before raising")
        errors += " (the report's replay frees the cache where the allocator did, before each error too)"
        if self.found is not None:
            return (f"the script's batch-size search ({self.handler}) tried batch sizes {sizes}: {errors}; it settled "
                    f"on {self.found:,} and the steps are the training's after it; {peaks}")
        return (f"the script's out-of-memory handler ({self.handler}) ran its function with batch sizes {sizes}: "
                f"{errors}, then retried as on a GPU; the steps are the last call's, and {peaks}")


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
            with guard.handling(batch_size):
                return function(batch_size, *a, **k)

        return orig(handled, *args, **kwargs)

    saved = {}
    for name in _MODULES:
        mod = importlib.import_module(name)
        if getattr(mod, "find_executable_batch_size", None) is orig:
            saved[name] = mod
            mod.find_executable_batch_size = find_executable_batch_size  # type: ignore[attr-defined]
    try:
        with _lightning_finder(guard):
            yield
    finally:
        for mod in saved.values():
            mod.find_executable_batch_size = orig  # type: ignore[attr-defined]


def _lightning_finder(guard: OomGuard) -> contextlib.AbstractContextManager[None]:
    """Lightning's batch-size finder with each trial counted as a handler's call and its sizes
    recorded; the search itself (its doubling, its retries, its cache clearing) is Lightning's.
    Patched when the script imports it (importing Lightning takes seconds)."""

    def patch(mod: Any, undo: contextlib.ExitStack) -> None:
        names = ("_try_loop_run", "_adjust_batch_size", "__scale_batch_reset_params", "__scale_batch_restore_params")
        found = [getattr(mod, n, None) for n in names]
        if not all(callable(f) for f in found):  # (another Lightning: its finder is left as it is)
            return
        run, adjust, reset, restore = (f for f in found if f is not None)
        for name, new in zip(names, (_trial(guard, run), _sized(guard, adjust), _opened(guard, reset),
                                     _closed(guard, restore)), strict=True):
            replace(undo, mod, name, new)

    return patched_on_import(dict.fromkeys(_LIGHTNING, patch))


def _trial(guard: OomGuard, run: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(run)
    def trial(*args: Any, **kwargs: Any) -> Any:
        with guard.handling(guard.current):
            return run(*args, **kwargs)
    return trial


def _sized(guard: OomGuard, adjust: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(adjust)
    def sized(*args: Any, **kwargs: Any) -> Any:
        out = adjust(*args, **kwargs)
        guard.current = out[0]
        return out
    return sized


def _opened(guard: OomGuard, reset: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(reset)
    def opened(*args: Any, **kwargs: Any) -> Any:
        guard.handler = "Lightning's batch-size finder"
        guard.searching += 1
        return reset(*args, **kwargs)
    return opened


def _closed(guard: OomGuard, restore: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(restore)
    def closed(*args: Any, **kwargs: Any) -> Any:
        guard.searching = max(0, guard.searching - 1)
        guard.found = guard.current
        if guard.on_search_end is not None:
            guard.on_search_end()
        return restore(*args, **kwargs)
    return closed
