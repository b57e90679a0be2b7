"""Tensors on the emulated GPU report ``cuda:N``, as tensors on a real one do.

The trace runs every device tensor on ``meta`` storage (fake CUDA tensors cannot run autograd
on a CPU-only torch: its engine asks for the CUDA device guard, which only a CUDA build
registers). Code reads the device back all the time — ``x.is_cuda``, ``x.device.type ==
"cuda"``, ``nn.DataParallel``'s device check, ``f"{loss:.2f}"`` — and a ``meta`` answer sends it
down a CPU path or into an error. While :func:`device_view` is active, a tensor on ``meta``
storage answers for where it lives in the real run:

- on the emulated GPU (the default): ``device`` is ``cuda:N``, ``is_cuda`` true, ``is_meta``
  false, ``get_device()`` N, ``type()`` ``torch.cuda.FloatTensor``, and ``repr`` names the device;
- somewhere else, as a *place* says (:class:`Place`: host tensors without values — a large
  parameter built on the CPU, a ``.cpu()`` copy of device data —, the script's own ``meta``
  tensors, other GPUs): that place's device.

vramplan's own code reads the storage's real device (:func:`raw_device`, :func:`on_meta`); the
trace's modes run with the view switched off (:data:`RAW`), so torch's kernels and meta
functions below them see ``meta`` as before, while torch's Python above them (optimizers,
``nn.functional``, ``nn.DataParallel``) and the script see the GPU.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

_GET_DEVICE = torch._C.TensorBase.__dict__["device"].__get__
_GET_IS_META = torch._C.TensorBase.__dict__["is_meta"].__get__
_STORAGE = torch._C.TensorBase.untyped_storage
_NO_TORCH_FUNCTION = torch._C.DisableTorchFunction
"""Tensor attributes are answered by active torch function modes (``handle_torch_function_getter``),
which would hand the question back to the view: vramplan's own reads go around them (and are
cheaper that way: ~0.8 µs instead of ~3 µs under a mode)."""

class _Raw(threading.local):
    depth = 0


RAW = _Raw()
"""While ``RAW.depth`` is positive, tensors report their storage's device (the trace's modes set
it around the kernels they run). Per thread: another thread's kernel must not change what a
tensor reports here."""


def raw_device(t: torch.Tensor) -> torch.device:
    """The device of ``t``'s storage, whatever the view says."""
    with _NO_TORCH_FUNCTION():
        return _GET_DEVICE(t)


def on_meta(t: Any) -> bool:
    """``t`` is a tensor on meta storage (a fake device or off-device tensor of the trace)."""
    if not isinstance(t, torch.Tensor):
        return False
    with _NO_TORCH_FUNCTION():
        return bool(_GET_IS_META(t))


def _storage_key(t: torch.Tensor) -> int:
    with _NO_TORCH_FUNCTION():
        return int(_STORAGE(t)._cdata)


class Place(Protocol):
    """Storages that live elsewhere than the emulated GPU in the real run."""

    device: torch.device

    def holds(self, key: int) -> bool: ...


class View:
    """Where the meta tensors of one emulated run live (see the module docstring)."""

    def __init__(self, current: Callable[[], int], on_gpu: Callable[[int], bool] | None = None) -> None:
        self.current = current
        self.places: list[Place] = []
        self.on_gpu = on_gpu
        """Whether a meta storage (by key) is device memory the trace recorded; others (torch's
        own fake tensors, e.g. DTensor's sharding propagation) report ``meta``. None: all are."""

    def device_of(self, t: torch.Tensor) -> torch.device:
        d = raw_device(t)
        if d.type != "meta" or RAW.depth:
            return d
        local = getattr(t, "_local_tensor", None) if type(t) is not torch.Tensor else None
        if isinstance(local, torch.Tensor):  # a DTensor lives where its local shard does
            return self.device_of(local)
        try:
            key: int | None = _storage_key(t)
        except (RuntimeError, NotImplementedError, TypeError):  # a wrapper subclass (DTensor)
            key = None
        if key is not None:
            for p in self.places:
                if p.holds(key):
                    return p.device
            if self.on_gpu is not None and not self.on_gpu(key):
                return d
        return torch.device("cuda", self.current())


_ACTIVE: list[View] = []


def _view(t: torch.Tensor) -> torch.device:
    return _ACTIVE[-1].device_of(t) if _ACTIVE else raw_device(t)


def reported_device(t: torch.Tensor) -> torch.device:
    """Where ``t`` says it lives (the view's answer: ``cuda:N`` for a device tensor)."""
    return _view(t)


def _device(self: torch.Tensor) -> torch.device:
    return _view(self)


def _is_cuda(self: torch.Tensor) -> bool:
    return _view(self).type == "cuda"


def _is_cpu(self: torch.Tensor) -> bool:
    return _view(self).type == "cpu"


def _is_meta(self: torch.Tensor) -> bool:
    return _view(self).type == "meta"


def _get_device(self: torch.Tensor) -> int:
    d = _view(self)
    return -1 if d.type == "cpu" else (d.index if d.index is not None else 0)


_TYPE = torch._C.TensorBase.type
LEGACY_TYPES: dict[str, torch.dtype] = {
    "FloatTensor": torch.float32, "DoubleTensor": torch.float64, "HalfTensor": torch.float16,
    "BFloat16Tensor": torch.bfloat16, "LongTensor": torch.int64, "IntTensor": torch.int32,
    "ShortTensor": torch.int16, "CharTensor": torch.int8, "ByteTensor": torch.uint8, "BoolTensor": torch.bool}
"""``torch.cuda.FloatTensor`` & co.: the legacy tensor types (``Tensor = torch.cuda.FloatTensor if
cuda else torch.FloatTensor``, ``x.type(Tensor)`` in older GAN and RL code; made by :mod:`.cuda`)."""


def _type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    target = args[0] if args else kwargs.get("dtype")
    dtype = getattr(target, "_vramplan_dtype", None)  # torch.cuda.FloatTensor & co. (emulate.cuda)
    if dtype is None and isinstance(target, str) and target.startswith("torch.cuda."):
        dtype = LEGACY_TYPES.get(target.removeprefix("torch.cuda."))
    if dtype is not None:
        return self.to(device="cuda", dtype=dtype, non_blocking=bool(args[1:2] and args[1]) or
                       bool(kwargs.get("non_blocking", False)))
    if args or kwargs or not on_meta(self):
        return _TYPE(self, *args, **kwargs)
    d = _view(self)
    name = _TYPE(self).rsplit(".", 1)[-1]  # torch.meta.FloatTensor → FloatTensor
    return f"torch.{name}" if d.type == "cpu" else f"torch.{d.type}.{name}"


Values = Callable[..., "torch.Tensor | None"]
"""``values(t, what, exact=False)``: the host values of meta tensor ``t`` read by ``what``
(known values; with ``exact``, None where unknown; else the run's rule for a read without them)."""


def _record_stream_of(orig: Callable[..., Any]) -> Callable[..., Any]:
    def record_stream(self: torch.Tensor, stream: Any) -> None:
        """On the emulated GPU the trace is one serial order and a block is reusable as soon as
        it is freed: recording a stream changes nothing (emulated streams are not ``torch.Stream``,
        which torch's argument parser asks for). Elsewhere torch's own."""
        if on_meta(self):
            return None
        return orig(self, stream)

    return record_stream


def _repr_of(orig: Callable[..., str], values: Values) -> Callable[..., str]:
    def __repr__(self: torch.Tensor, *args: Any, **kwargs: Any) -> str:  # noqa: N807
        if not on_meta(self) or not _ACTIVE:
            return orig(self, *args, **kwargs)
        d = _view(self)
        known = values(self, "repr", True) if d.type != "meta" else None
        if known is not None:
            text = orig(known.detach(), *args, **kwargs)
            return text if d.type == "cpu" else text[:-1] + f", device='{d}')"
        RAW.depth += 1
        try:
            text = orig(self, *args, **kwargs)
        finally:
            RAW.depth -= 1
        if d.type == "meta":
            return text
        return text.replace("device='meta'", f"device='{d}'" if d.type != "cpu" else "device='cpu'")
    return __repr__


def _read_of(orig: Callable[..., Any], name: str, values: Values) -> Callable[..., Any]:
    """``numpy()`` / ``tolist()`` / ``__array__``: host values of a meta tensor come from
    ``values(t, what)`` (known values, or the run's rule for reads without them)."""
    def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not _ACTIVE or not on_meta(self):
            return orig(self, *args, **kwargs)
        d = _view(self)
        if d.type == "cuda" and name in ("numpy", "__array__"):
            raise TypeError(f"can't convert {d} device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                            "to host memory first.")
        if d.type == "meta":
            return orig(self, *args, **kwargs)
        host = values(self, f".{name}()")
        assert host is not None
        return getattr(host, name)(*args, **kwargs)
    return read


def _data_ptr_of(orig: Callable[..., int]) -> Callable[..., int]:
    def data_ptr(self: torch.Tensor) -> int:
        """A tensor on the emulated GPU (or a host tensor without values) has an address of its
        own, as on a real device: its storage's key plus its offset, where every ``meta`` storage
        answers 0 (accelerate's ``tied_params_map`` keys the weights it moves by ``data_ptr()``:
        with one key for all, every weight moved to a GPU would become the first one moved)."""
        if not _ACTIVE or type(self) not in (torch.Tensor, torch.nn.Parameter) or not on_meta(self) \
                or _view(self).type == "meta":  # (subclasses — FakeTensor, DTensor — answer for themselves)
            return orig(self)
        with _NO_TORCH_FUNCTION():
            try:
                return _storage_key(self) + int(self.storage_offset()) * self.element_size()
            except (RuntimeError, NotImplementedError, TypeError):
                return orig(self)
    return data_ptr


@contextlib.contextmanager
def device_view(view: View, values: Values) -> Iterator[View]:
    """Tensors report where they live (see the module docstring) until the block ends."""
    T = torch.Tensor  # noqa: N806
    patches: dict[str, Any] = {
        "device": property(_device),
        "is_cuda": property(_is_cuda),
        "is_cpu": property(_is_cpu),
        "is_meta": property(_is_meta),
        "get_device": _get_device,
        "type": _type,
        "__repr__": _repr_of(T.__repr__, values),
        "record_stream": _record_stream_of(T.record_stream),
        "data_ptr": _data_ptr_of(T.data_ptr),
        "numpy": _read_of(T.numpy, "numpy", values),
        "tolist": _read_of(T.tolist, "tolist", values),
        "__array__": _read_of(T.__array__, "__array__", values),
    }
    saved = {k: T.__dict__[k] for k in patches if k in T.__dict__}
    _ACTIVE.append(view)
    for k, v in patches.items():
        setattr(T, k, v)
    try:
        yield view
    finally:
        _ACTIVE.remove(view)
        for k in patches:
            if k in saved:
                setattr(T, k, saved[k])
            else:
                delattr(T, k)


@contextlib.contextmanager
def raw() -> Iterator[None]:
    """Tensors report their storage's device inside the block (vramplan's own code)."""
    RAW.depth += 1
    try:
        yield
    finally:
        RAW.depth -= 1
