"""Host (CPU) memory of a traced rank: the tensors FSDP2's ``CPUOffloadPolicy`` keeps on the CPU.

Under ``fully_shard(..., offload_policy=CPUOffloadPolicy(pin_memory=True))`` (torch 2.13,
``torch/distributed/fsdp/_fully_shard/_fsdp_param.py`` and ``_fsdp_collectives.py``):

- the **sharded parameters** live on the host, pinned (``_init_sharded_param``: the padded
  shard ``.cpu().pin_memory()``); before each all-gather the shard is copied to the GPU
  (``all_gather_inputs``: ``.to(self.device, non_blocking=True)``, then cast to
  ``param_dtype``), on the all-gather copy-in stream;
- the **sharded gradients** are reduce-scattered on the GPU, then copied to the host
  (``foreach_reduce``: ``.to("cpu", non_blocking=True)``, which lands in pinned memory —
  ``_to_copy`` pins a non-blocking device-to-host copy's output); the GPU shard dies with
  the reduce-scatter output. With gradient accumulation the next micro-batches' copies are
  blocking (pageable) and added into the pinned gradient;
- the **optimizer step** runs on the CPU over the host parameters and gradients: its states
  and temporaries are ordinary (pageable) host memory.

In the trace every tensor is ``meta``; this module keeps the ones that are on the host in
the real run out of the GPU's event log (:meth:`Recorder.ignore`) and books them here instead:
pinned blocks the way PyTorch's ``CachingHostAllocator`` holds them (each request rounded up
to a power of two, ``aten/src/ATen/core/CachingHostAllocator.h`` ``PowerOf2Ceil``; a freed
block is cached for its size class, so what is held is, per class, the most blocks live at
once), pageable bytes as live bytes (their peak).

Which tensors are on the host: the parameters FSDP2 shards while :meth:`HostMemory.scope`
is active, device-to-host copies (:meth:`HostMemory.to_host`), and every output of an op
whose device inputs are all host tensors (the CPU optimizer step); a copy to the GPU
(``.to("cuda")``) is a device tensor again.

FSDP1's ``CPUOffload(offload_params=True)`` books the same parts (docs/research/fsdp1-cpu-offload.md):
the pinned ``_local_shard`` and ``_cpu_grad`` of each flat parameter (:meth:`HostMemory.pinning`),
its pageable shards from construction to the first all-gather (:data:`FLAT_SHARDS`), the step;
FSDP1 chooses its copies by comparing devices, which :meth:`HostMemory.reporting` answers.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch

from ..emulate.tensors import View, device_view, on_meta
from ..emulate.threads import PerThread
from ..errors import TraceError
from ..results import HOST_FLAT_SHARDS, HOST_GRADIENTS, HOST_PARAMETERS, HOST_STATES, HOST_STEP
from .offload import pinned_bytes
from .recorder import Recorder, local_tensor

PARAMETERS, GRADIENTS, STATES, STEP = HOST_PARAMETERS, HOST_GRADIENTS, HOST_STATES, HOST_STEP
FLAT_SHARDS = HOST_FLAT_SHARDS


class HostMemory:
    """The host side of one traced rank (see the module docstring)."""

    device_copy = PerThread(False)
    """While set in a thread, that thread's outputs are device tensors (a host-to-device copy)."""

    def __init__(self, rec: Recorder, *, counted: bool = True, device: str = "cpu") -> None:
        self.rec = rec
        self.counted = counted
        self.host_copies = counted
        """Device-to-host copies land here (FSDP2's gradient offload)."""
        self.device = torch.device(device)
        """Where these tensors are in the real run (what they report under ``vramplan run``)."""
        self.in_use = True
        """False: a place kept for later (a GPU other than 0 before a device map spreads a model
        over it: until then every GPU's tensors are the emulated GPU's)."""
        """False: the tensors are nowhere in the real run (a script's own ``meta`` model), not host
        RAM — kept off the GPU's log and not counted."""
        self.keys: dict[int, tuple[str, int, bool]] = {}
        """storage key → (part, bytes, pinned) of every live host storage."""
        self._live: dict[tuple[str, int], int] = {}
        self._most: dict[tuple[str, int], int] = {}
        self.pageable = 0
        self.pageable_peak = 0
        self.flat_shards = 0
        """Pageable bytes of :data:`FLAT_SHARDS` live now (FSDP1's construction copies)."""
        self.peak_of_shards = False
        """Whether the pageable peak was reached while such copies were live."""
        self.constructing = False
        """While set, a blocking device-to-host copy is one of FSDP1's flat shards (:meth:`construction`)."""
        self.part: str | None = None
        """While set, every new storage is a pinned host tensor of this part."""
        self._pins: list[str] = []
        """The parts of the next pinned copies (:meth:`pinning`)."""
        self.scope_pinned = True
        """Whether the storages :meth:`scope` books are pinned."""
        self.reported = False
        """While :meth:`reporting`: host tensors report ``cpu``, and an op given ``device="meta"``
        (FSDP1's compute device) makes device memory whatever its inputs."""
        self.cpu_factories = False
        """While set, a factory given ``device="cpu"`` makes a (pageable) host tensor of the
        trace (FSDP1's flat-parameter code: :meth:`factories`)."""

    # --- what is on the host -----------------------------------------------------------
    def holds(self, key: int) -> bool:
        return key in self.keys

    def is_host(self, t: torch.Tensor) -> bool:
        t = local_tensor(t)
        return on_meta(t) and t.untyped_storage()._cdata in self.keys

    def target(self, args: Any) -> HostMemory | None:
        """Where an op's new storages go: here when :meth:`takes` says so, else None (the GPU)."""
        return self if self.takes(args) else None

    def takes(self, args: Any) -> bool:
        """Whether an op's outputs are host tensors: inside :meth:`scope`, or every meta
        tensor among its arguments is a host tensor (and there is one)."""
        if self.device_copy:
            return False
        if self.part is not None:
            return True
        if not self.keys:
            return False
        seen = False
        for a in _flat(args):
            if on_meta(a):
                if a.untyped_storage()._cdata not in self.keys:
                    return False
                seen = True
        return seen

    # --- booking -----------------------------------------------------------------------
    def adopt(self, out: Any, *, part: str | None = None, pinned: bool | None = None) -> None:
        """Book the new storages of ``out`` (a tensor or nested list of them) on the host."""
        part = part or self.part or STEP
        pin = pinned if pinned is not None else self.part is not None and self.scope_pinned
        for t in _flat(out):
            t = local_tensor(t)
            if not on_meta(t):
                continue
            st = t.untyped_storage()
            key = st._cdata
            if key in self.rec.live or key in self.keys:
                continue  # a view, or an in-place result: already booked
            self.rec.ignore(t)
            n = st.nbytes()
            self.keys[key] = (part, n, pin)
            weakref.finalize(st, partial(self._freed, key))
            if pin:
                k = (part, pinned_bytes(n))
                self._live[k] = self._live.get(k, 0) + 1
                self._most[k] = max(self._most.get(k, 0), self._live[k])
            else:
                self.pageable += n
                if part == FLAT_SHARDS:
                    self.flat_shards += n
                if self.pageable > self.pageable_peak:
                    self.pageable_peak, self.peak_of_shards = self.pageable, self.flat_shards > 0
            self._booked(key, n)

    def _booked(self, key: int, n: int) -> None:
        """A storage of ``n`` bytes was booked here (a GPU's place logs it: :class:`~.places.GpuPlace`)."""

    def _dropped(self, key: int) -> None:
        """A booked storage died."""

    def _freed(self, key: int) -> None:
        entry = self.keys.pop(key, None)
        if entry is None:
            return
        part, n, pin = entry
        if pin:
            self._live[(part, pinned_bytes(n))] -= 1
        else:
            self.pageable -= n
            if part == FLAT_SHARDS:
                self.flat_shards -= n
        self._dropped(key)

    @contextlib.contextmanager
    def scope(self, part: str, *, pinned: bool = True) -> Iterator[None]:
        """New storages are host tensors of ``part``, pinned unless told (FSDP2 sharding the model)."""
        saved = self.part, self.scope_pinned
        self.part, self.scope_pinned = part, pinned
        try:
            yield
        finally:
            self.part, self.scope_pinned = saved

    @contextlib.contextmanager
    def factories(self) -> Iterator[None]:
        """Factories given ``device="cpu"`` make host tensors of the trace for the block."""
        saved, self.cpu_factories = self.cpu_factories, True
        try:
            yield
        finally:
            self.cpu_factories = saved

    @contextlib.contextmanager
    def copying_to_device(self) -> Iterator[None]:
        saved = self.device_copy
        self.device_copy = True
        try:
            yield
        finally:
            self.device_copy = saved

    def to_host(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        """A device-to-host copy (``.to("cpu", non_blocking=…)``): a new host tensor, pinned
        when the copy is non-blocking (``_to_copy``'s ``pin_out``)."""
        src = args[0]
        dtype = kwargs.get("dtype") or src.dtype
        out = torch.empty_strided(src.shape, src.stride(), dtype=dtype, device="meta") \
            if src.is_contiguous() else torch.empty(src.shape, dtype=dtype, device="meta")
        self.adopt(out, part=GRADIENTS if kwargs.get("non_blocking") else FLAT_SHARDS if self.constructing else STEP,
                   pinned=bool(kwargs.get("non_blocking")))
        return out

    # --- FSDP1's CPUOffload ---------------------------------------------------------------
    @contextlib.contextmanager
    def reporting(self) -> Iterator[None]:
        """FSDP1's CPUOffload on the trace device, whose compute device is the trace's ``meta``:

        - host tensors report ``cpu`` (where they are in the real run), every other meta tensor
          ``meta``: FSDP1 decides where to copy by comparing devices (``flat_param.device !=
          self.device`` before each all-gather, its ``== cpu`` checks);
        - ``.to(<meta>)`` of a host tensor is a copy to the GPU (the all-gather input), where a
          meta tensor moved to ``meta`` would be returned unchanged — in every thread (FSDP1
          unshards from backward hooks, in autograd's thread, where no function mode runs)."""
        view = View(current=lambda: 0, on_gpu=lambda key: False)
        view.places.append(self)
        T = torch.Tensor  # noqa: N806
        saved = T.__dict__.get("to")
        orig = T.to
        host = self

        def to(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if host.is_host(t) and any(_is_meta(a) for a in (*args, kwargs.get("device"))):
                with host.copying_to_device():
                    return orig(t, *args, **{**kwargs, "copy": True})
            return orig(t, *args, **kwargs)

        T.to = to  # type: ignore[method-assign,assignment]
        self.reported = True
        try:
            with device_view(view, _no_values):
                yield
        finally:
            self.reported = False
            if saved is None:
                del T.to
            else:
                T.to = saved  # type: ignore[method-assign]

    @contextlib.contextmanager
    def construction(self) -> Iterator[None]:
        """FSDP1 being built with CPUOffload: each unit's flat shard is moved to pageable host
        memory (``_init_utils.py`` ``_init_param_handle_from_params``), where it stays until
        the unit's first all-gather (:data:`FLAT_SHARDS`)."""
        saved, self.constructing = self.constructing, True
        try:
            yield
        finally:
            self.constructing = saved

    @contextlib.contextmanager
    def pinning(self, *parts: str) -> Iterator[None]:
        """The next ``pin_memory()`` calls on host tensors (:meth:`pin`) book their copies as
        ``parts``, in order (FSDP1's lazy init pins the local shard, then the gradient buffer);
        a different count is a torch release that pins otherwise: refused, not guessed."""
        saved, self._pins = self._pins, list(parts)
        try:
            yield
            left = len(self._pins)
        finally:
            self._pins = saved
        if left:
            raise TraceError(f"torch {torch.__version__} pinned {len(parts) - left} host tensors where "
                             f"{len(parts)} ({', '.join(parts)}) were expected",
                             hint="use `engine=fsdp` (FSDP2's CPUOffloadPolicy), or `method=analytic`")

    def pin(self, t: torch.Tensor) -> torch.Tensor | None:
        """``t.pin_memory()`` of a host tensor while :meth:`pinning`: a copy in a pinned block (a
        power-of-two class) of the next part; None outside (FSDP2 pins inside :meth:`scope`)."""
        if not self._pins:
            return None
        with self.scope(self._pins.pop(0)):
            return torch.empty_like(t)

    # --- figures -----------------------------------------------------------------------
    def pinned(self, part: str) -> int:
        """Bytes of pinned host memory ``part`` holds (size class × most blocks live)."""
        return sum(b * n for (p, b), n in self._most.items() if p == part)

    def parts(self) -> tuple[tuple[str, int], ...]:
        """(part, bytes) of the host memory: pinned parameters and gradients, the pageable
        bytes live now (the optimizer's states, read after the last step) and the rest of the
        pageable peak (the step's temporaries)."""
        states = self.pageable
        if not self.counted:
            return ()
        rest = FLAT_SHARDS if self.peak_of_shards else STEP  # (FSDP1 with little optimizer state: LoRA)
        out = [(PARAMETERS, self.pinned(PARAMETERS)), (GRADIENTS, self.pinned(GRADIENTS)),
               (STATES, states), (rest, max(0, self.pageable_peak - states))]
        return tuple((name, n) for name, n in out if n)


def _is_meta(d: Any) -> bool:
    return (isinstance(d, torch.device) and d.type == "meta") or (isinstance(d, str) and d == "meta")


def _no_values(t: torch.Tensor, what: str, exact: bool = False) -> torch.Tensor | None:
    """The host tensors of an offloaded trace have no values to read."""
    if exact:
        return None
    raise TraceError(f"{what} reads the values of an offloaded host tensor, which the trace does not have",
                     hint="use `method=analytic`, or drop `offload_params`")


def _flat(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _flat(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _flat(x)
