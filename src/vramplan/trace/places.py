"""Where a script's meta tensors live in its real run, when that is not the emulated GPU.

Under ``vramplan run`` every tensor without real values is a ``meta`` tensor; most stand for
device memory, and the trace records them. Some stand for memory elsewhere, kept off the GPU's
event log (:meth:`Recorder.ignore`) and reporting their own device
(:mod:`vramplan.emulate.tensors`):

- ``cpu``: host tensors without values — a large tensor the script builds on the CPU (a
  model's parameters before ``.to("cuda")``, a synthetic data set), a ``.cpu()`` copy of
  device data the trace has no values for — and everything computed from them on the host;
- ``meta``: the script's own meta tensors (``with torch.device("meta")``: a model built to be
  sharded or loaded, then ``to_empty``), which take no memory anywhere.

A place is a :class:`~.host.HostMemory` (not counted: host RAM is not what ``vramplan run``
reports); :class:`Places` answers the recorder's host interface for all of them: an op whose
meta inputs all live in one place makes its outputs there, and a copy to the device
(``.to("cuda")``) makes device memory again.

A GPU other than 0 (``cuda:N``, a model spread over the GPUs by a device map) is a
:class:`GpuPlace`: its storages are also that GPU's own event stream, replayed through the same
caching-allocator simulation as GPU 0's — live for what the script reads about that device, and
again for the report.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from ..emulate.live import LiveAllocator
from ..emulate.tensors import on_meta
from ..emulate.threads import PerThread
from ..events import Action, EventLog
from .host import HostMemory, _flat
from .recorder import Recorder, local_tensor


class GpuPlace(HostMemory):
    """A GPU other than 0 (see the module docstring): its storages are logged as that GPU's
    allocations and frees (:attr:`log`, each allocation on that GPU's current :attr:`stream`, as
    GPU 0's are on the recorder's) and :attr:`live` answers its memory figures from the allocator
    simulation, as GPU 0's are."""

    def __init__(self, rec: Recorder, device: str, alloc_conf: str | None = None) -> None:
        super().__init__(rec, counted=False, device=device)
        self.log = EventLog()
        self.live = LiveAllocator(self.log, alloc_conf)
        self._lock = threading.Lock()  # (a storage may die on another thread: autograd's, gloo's)
        self._workspaces: set[tuple[int, int]] = set()
        self.stream = 0
        """This GPU's current stream (``vramplan run``: ``torch.cuda.stream(s)`` of a stream of this
        device; each GPU has a current stream of its own); 0 is its default stream."""

    def _booked(self, key: int, n: int) -> None:
        with self._lock:
            self.log.alloc(key, n, stream=self.stream)

    def _dropped(self, key: int) -> None:
        with self._lock:
            self.log.free(key)

    def blas_workspace(self, size: int, key: tuple[int, int]) -> None:
        """A GEMM on this GPU: the cuBLAS workspace of its handle (one per thread and stream, as GPU
        0's: :meth:`~.dispatch.TraceMode._blas_workspace`; ``key`` is (thread, GPU 0's stream): the
        stream here is this GPU's own), allocated once and kept."""
        with self._lock:
            key = (key[0], self.stream)
            if key in self._workspaces:
                return
            self._workspaces.add(key)
            self.log.alloc(-len(self._workspaces), size, stream=self.stream)  # (ids apart from the storages' keys)

    @property
    def used(self) -> bool:
        """Whether anything was ever allocated on this GPU."""
        return len(self.log) > 0

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()`` releases every GPU's cached blocks (PyTorch's
        ``NativeCachingAllocator::emptyCache`` loops over its per-device allocators:
        c10/cuda/CUDACachingAllocator.cpp at commit 001074d2)."""
        with self._lock:
            if len(self.log):
                self.log.append(Action.EMPTY_CACHE)


class Places:
    """The off-GPU places of one run (see the module docstring)."""

    counted = False
    host_copies = True
    """A device-to-host copy without known values (``.cpu()``) is a host tensor without values."""
    device_copy = PerThread(False)
    _scope = PerThread(None)
    """(Per thread: a scope one thread opens places that thread's outputs only.)"""

    def __init__(self, rec: Recorder, devices: tuple[str, ...] = ("cpu", "meta"), alloc_conf: str | None = None) -> None:
        self.rec = rec
        self.by_device = {d: GpuPlace(rec, d, alloc_conf) if d.startswith("cuda:") else
                          HostMemory(rec, counted=False, device=d) for d in devices}
        self.gpus_apart = False
        """Whether a ``cuda:N`` place (a GPU other than 0) is in use (``vramplan run``: a model spread
        over the GPUs by a device map); until then every GPU's tensors are the emulated GPU's."""

    @property
    def all(self) -> tuple[HostMemory, ...]:
        return tuple(self.by_device.values())

    @property
    def gpus(self) -> dict[int, GpuPlace]:
        """The GPUs other than 0, by index."""
        return {p.device.index or 0: p for p in self.by_device.values() if isinstance(p, GpuPlace)}

    def place_of(self, t: torch.Tensor) -> HostMemory | None:
        t = local_tensor(t)
        if not on_meta(t):
            return None
        key = t.untyped_storage()._cdata
        for p in self.by_device.values():
            if key in p.keys:
                return p
        return None

    def is_host(self, t: torch.Tensor) -> bool:
        return self.place_of(t) is not None

    def target(self, args: Any) -> HostMemory | None:
        """The place of an op's outputs: the active :meth:`scope`, or the one place every meta
        input lives in (None: the GPU)."""
        if self.device_copy:
            return None
        if self._scope is not None:
            return self._scope
        if not any(p.keys for p in self.by_device.values()):
            return None
        found: HostMemory | None = None
        for a in _flat(args):
            if on_meta(a):
                p = self.place_of(a)
                if p is None:
                    return None
                found = found or p
        return found

    @contextlib.contextmanager
    def scope(self, device: str) -> Iterator[HostMemory]:
        """New storages live in the place of ``device`` for the block."""
        saved, self._scope = self._scope, self.by_device[device]
        try:
            yield self._scope
        finally:
            self._scope = saved

    @contextlib.contextmanager
    def copying_to_device(self) -> Iterator[None]:
        saved, saved_scope = self.device_copy, self._scope
        self.device_copy, self._scope = True, None
        try:
            yield
        finally:
            self.device_copy, self._scope = saved, saved_scope

    def adopt(self, out: Any, device: str) -> None:
        self.by_device[device].adopt(out)

    def to_host(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        """``.to("cpu")`` / ``.cpu()`` of device data without known values: a host tensor of
        the same shape and dtype whose values are asked for only when the script reads them."""
        src = args[0]
        dtype = kwargs.get("dtype") or src.dtype
        out = torch.empty_strided(src.shape, src.stride(), dtype=dtype, device="meta") \
            if src.is_contiguous() else torch.empty(src.shape, dtype=dtype, device="meta")
        self.by_device["cpu"].adopt(out)
        return out
