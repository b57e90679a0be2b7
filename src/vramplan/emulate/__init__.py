"""The emulated GPU: what real code sees of a GPU it does not have.

One entry, :func:`emulated_gpu`, used by ``vramplan run`` (a whole script), the factories of
``vramplan trace`` and everything else that runs user code against the target GPU:

- ``torch.cuda`` / ``torch.accelerator`` / ``torch.version.cuda`` answer for the target GPU,
  with torch's own signatures (:mod:`.cuda`); memory queries read the allocator simulation
  (:mod:`.live`);
- tensors on it report ``cuda:N`` (:mod:`.tensors`), and tensors that live elsewhere in the
  real run (host tensors without values, the script's own meta tensors) report that place;
- module conversion keeps every Parameter object (:mod:`.modules`): tied weights stay tied,
  optimizers built before ``.to("cuda")`` step the right tensors;
- ``torch.load`` of a real checkpoint to the device, and ``torch.save`` of device tensors
  (shapes without values) (:mod:`.checkpoints`);
- Triton kernel launches run as no-ops (:mod:`.kernels`: their buffers are allocated by PyTorch);
- ``nn.DataParallel`` runs GPU 0's share (:mod:`.parallel`), the per-GPU figure real runs report;
- models built by a factory take no memory and no GPU (:mod:`.construct`).

It knows nothing of memory accounting: the trace records what the emulated device allocates,
and tells this package where tensors live (:class:`.tensors.Place`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .checkpoints import checkpoints_on_device
from .cuda import CudaState, patched
from .facts import DeviceFacts
from .kernels import triton_launches
from .live import LiveAllocator
from .modules import checkpoint_metadata_on_storage, keeping_identity
from .parallel import data_parallel
from .tensors import Place, Values, View, device_view, on_meta, raw_device


@dataclass
class Emulated:
    """The emulated GPU while it is up."""

    state: CudaState
    view: View
    optimizers: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)
    kernels: int = 0
    """Triton kernel launches run as no-ops."""
    saved: list[str] = field(default_factory=list)
    """The files ``torch.save`` wrote (device tensors as shapes without values)."""


@contextlib.contextmanager
def emulated_gpu(facts: DeviceFacts, live: LiveAllocator, *, on_sync: Callable[[str], None],
                 values: Values, places: Sequence[Place] = (),
                 optimizers: weakref.WeakSet[Any] | None = None,
                 on_launch: Callable[[list[Any]], None] | None = None,
                 on_gpu: Callable[[int], bool] | None = None,
                 on_capture: Callable[[int | None], None] | None = None,
                 on_stream: Callable[[int, int], None] | None = None) -> Iterator[Emulated]:
    """The target GPU emulated until the block ends (see the package docstring).

    ``on_sync(kind)`` receives ``synchronize`` / ``empty_cache``; ``values(t, what)`` gives the
    host values of a meta tensor the code reads (``.tolist()``, ``.numpy()``) or raises;
    ``places`` say where off-device meta tensors live; ``optimizers`` are re-pointed when a
    conversion cannot keep a Parameter object; ``on_launch(tensors)`` hears of each Triton launch
    (the tensors it was given, which it writes); ``on_gpu(key)`` says whether a meta storage is
    device memory (None: every meta storage off the ``places`` is); ``on_capture(pool)`` hears a
    CUDA graph's capture start in its private pool and end (``None``; without it CUDA graphs stop
    the run: :mod:`.graphs`); ``on_stream(device, stream)`` hears a device's current stream change
    (``torch.cuda.stream(s)``, ``set_stream``: :attr:`.cuda.CudaState.on_stream`)."""
    # torch's Python kernels (``_prims_common.wrappers``' ``_disable_dynamo``) import torch._dynamo
    # on their first call; inside a traced op that import runs on the script's stack and some of
    # its module-level code leaves a frame cycle (``inspect.currentframe()`` kept in a local) that
    # pins every frame below it — the script's locals with it (FSDP1's per-parameter copies: a
    # whole model) — until the next cyclic collection. A real GPU run never takes that path.
    import torch._dynamo  # noqa: F401

    state = CudaState(facts, on_stream=on_stream)
    view = View(current=lambda: state.current, on_gpu=on_gpu)
    view.places.extend(places)
    em = Emulated(state, view, optimizers if optimizers is not None else weakref.WeakSet())

    def launched(tensors: list[Any]) -> None:
        em.kernels += 1
        if on_launch is not None:
            on_launch(tensors)

    others = {p.device.index: p for p in places if p.device.type == "cuda" and p.device.index}
    with patched(facts, live, on_sync, state, on_capture, others), device_view(view, values), \
            keeping_identity(em.optimizers), checkpoint_metadata_on_storage(), checkpoints_on_device(em.saved), \
            triton_launches(launched), data_parallel(), \
            _fresh_deepspeed_accelerator(), _no_cudnn_rnn_flatten():
        yield em


@contextlib.contextmanager
def _no_cudnn_rnn_flatten() -> Iterator[None]:
    """An RNN's ``flatten_parameters`` (on ``.cuda()`` and each call) copies its weights into one
    cuDNN buffer with a CUDA-only kernel, which a CUDA build of torch would run for real; torch's own
    switch (``torch._use_cudnn_rnn_flatten_weight``) turns it off, and the weights stay as they are
    (the buffer would hold the same bytes: memory is the same after the copy)."""
    real = getattr(torch, "_use_cudnn_rnn_flatten_weight", None)
    if real is None:
        yield
        return
    torch._use_cudnn_rnn_flatten_weight = lambda: False
    try:
        yield
    finally:
        torch._use_cudnn_rnn_flatten_weight = real


@contextlib.contextmanager
def _fresh_deepspeed_accelerator() -> Iterator[None]:
    """DeepSpeed picks its accelerator once, at its first ``get_accelerator()`` (its import calls
    it), and keeps it: imported before the emulated GPU came up, it chose the CPU, and its buckets
    would be host tensors beside device gradients. The choice is made again inside the block
    (where it finds CUDA, as on a GPU) and put back afterwards."""
    import sys

    mod = sys.modules.get("deepspeed.accelerator.real_accelerator")
    if mod is None or not hasattr(mod, "ds_accelerator"):
        yield
        return
    saved = mod.ds_accelerator
    setattr(mod, "ds_accelerator", None)  # noqa: B010 (a module of an optional package)
    try:
        yield
    finally:
        setattr(mod, "ds_accelerator", saved)  # noqa: B010


__all__ = ["DeviceFacts", "Emulated", "LiveAllocator", "Place", "View", "emulated_gpu", "on_meta", "raw_device"]
