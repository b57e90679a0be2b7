"""``torch.load`` of a real checkpoint onto the emulated GPU.

A checkpoint saved on a GPU names each storage's device (``"cuda:0"``); loading it with
``map_location="cuda"`` (or with none, which restores the saved devices) makes CUDA storages,
which a CPU build of torch cannot ("Attempting to deserialize object on a CUDA device but
torch.cuda.is_available() is False", or "compiled without CUDA support"). Here the file is
read for real onto the host, each storage's destination is decided as torch decides it
(``map_location`` as None, a device or string, a dict of locations, or a function), and the
storages bound for a GPU become emulated device tensors — one device allocation per storage,
the tensors on it views as in the file (a tied weight saved once loads once).

``torch.save`` of emulated device tensors (a checkpoint, Lightning's batch-size finder saving the
model before its trials) writes a real file whose device tensors carry their shape, dtype,
strides, device and storage but no values (there are none): each is pickled as a call of
:func:`_rebuild_device_tensor`. Loading that file within the run makes one device allocation per
saved storage, where ``map_location`` puts it, as a CUDA checkpoint would; loading it anywhere
else fails with a message saying what the file is. Host tensors are saved as torch saves them.
A file that no emulated run wrote is never overwritten: the run stops with an error naming it.

safetensors (``save_file``, ``save``; what ``save_pretrained`` writes) has no such form: its file
holds every value, which a run could only write as zeros, the whole model's size on disk. Saving
device tensors with it stops the run with an error that says so, not the library's own
("invalid shape, data type, or offset", which a real GPU never raises).
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import TraceError
from .imports import patched_on_import, replace
from .signatures import like
from .tensors import on_meta, reported_device


def _destination(map_location: Any, storage: Any, location: str) -> Any:
    """Where torch.load would put a storage saved at ``location`` (a location string or a
    storage from a map function)."""
    if map_location is None:
        return location
    if isinstance(map_location, (str, torch.device)):
        return str(map_location)
    if isinstance(map_location, dict):
        return map_location.get(location, location)
    if callable(map_location):
        out = map_location(storage, location)
        return location if out is None else out
    return location


def _on_gpu(dest: Any) -> int | None:
    """The ordinal of a GPU destination (None: the host or a storage kept as it is)."""
    if isinstance(dest, (str, torch.device)):
        d = torch.device(dest) if not isinstance(dest, torch.device) else dest
        if d.type == "cuda":
            return d.index or 0
        return None
    if isinstance(dest, int) and not isinstance(dest, bool):
        return dest
    return None


_LOADING = [0]


def loading() -> bool:
    """True while ``torch.load`` reads a file: the tensors it rebuilds (a pickled module's
    parameters among them) are the file's own, real host storages, moved afterwards by where
    they are bound; the run's host-parameter rule leaves them real until then."""
    return _LOADING[0] > 0


@dataclass
class _Load:
    """One ``torch.load`` in progress: its ``map_location`` and the device storages it made."""

    map_location: Any
    made: dict[int, torch.Tensor] = field(default_factory=dict)


_LOADS: list[_Load] = []


def _rebuild_device_tensor(key: int, nbytes: int, location: str, dtype: torch.dtype, size: tuple[int, ...],
                           stride: tuple[int, ...], offset: int, requires_grad: bool) -> torch.Tensor:
    """A device tensor saved by the emulated GPU (see the module docstring), made again on the
    device ``map_location`` picks; tensors of one saved storage share one allocation."""
    if not _LOADS:
        raise RuntimeError("this file was written by `vramplan run` from its emulated GPU: its device tensors "
                           "have shapes but no values; load a checkpoint saved by a real run instead")
    ld = _LOADS[-1]
    dev = ld.made.get(key)
    if dev is None:
        dest = _destination(ld.map_location, torch.UntypedStorage(nbytes, device="meta"), location)
        if not isinstance(dest, (str, torch.device, int)):
            dest = location  # a map function's own storage: where it was saved
        idx = _on_gpu(dest)
        if idx is None:
            raise TraceError(f"a checkpoint this run saved from its emulated GPU was loaded to {dest!r}: its "
                             "tensors have no values off the emulated GPU",
                             hint="load it to the GPU (map_location='cuda'), or load a checkpoint saved by a real run")
        dev = ld.made[key] = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", idx))
    flat = dev if dtype == torch.uint8 else dev.view(dtype)
    out = torch.as_strided(flat, size, stride, offset)
    return out.requires_grad_() if requires_grad else out


def _reduce_device_tensor(t: torch.Tensor) -> tuple[Any, tuple[Any, ...]] | None:
    """How ``torch.save`` pickles an emulated device tensor (None: as torch does)."""
    if type(t) is not torch.Tensor or not on_meta(t):
        return None
    where = reported_device(t)
    if where.type != "cuda":
        return None
    with torch._C.DisableTorchFunction():
        st = t.untyped_storage()
        key, nbytes = int(st._cdata), int(st.nbytes())
        size, stride, offset = tuple(t.shape), tuple(t.stride()), int(t.storage_offset())
        grad = bool(t.requires_grad and t.is_leaf)
    return _rebuild_device_tensor, (key, nbytes, str(where), t.dtype, size, stride, offset, grad)


def _written_by_a_run(path: str) -> bool:
    """``path`` is a file an emulated run saved (an earlier ``vramplan run`` of the same script)."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            pkl = next((n for n in z.namelist() if n.endswith("data.pkl")), None)
            return pkl is not None and _rebuild_device_tensor.__name__.encode() in z.read(pkl)
    except (OSError, zipfile.BadZipFile, KeyError):
        return False


def _target(f: Any) -> str | None:
    """The path ``torch.save`` writes (None: a file object)."""
    return os.path.abspath(os.fspath(f)) if isinstance(f, (str, os.PathLike)) else None


@contextlib.contextmanager
def checkpoints_on_device(written: list[str] | None = None) -> Iterator[None]:
    """Patch ``torch.load`` and ``torch.save`` (see the module docstring); ``written`` receives
    each path saved."""
    real_save = torch.save
    real_reduce = torch.Tensor.__reduce_ex__
    mine: set[str] = set()

    def reduce_ex(self: torch.Tensor, proto: Any) -> Any:
        out = _reduce_device_tensor(self)
        return real_reduce(self, proto) if out is None else out

    def save(obj: Any, f: Any, *rest: Any, **kwargs: Any) -> Any:
        path = _target(f)
        if path is not None and os.path.exists(path) and path not in mine and not _written_by_a_run(path):
            raise TraceError(f"the script saves a checkpoint over an existing file, {path}: `vramplan run` would "
                             "replace it with one holding shapes but no values",
                             hint="point the script's output somewhere new for the run")
        torch.Tensor.__reduce_ex__ = reduce_ex  # type: ignore[method-assign]
        try:
            out = real_save(obj, f, *rest, **kwargs)
        finally:
            torch.Tensor.__reduce_ex__ = real_reduce  # type: ignore[method-assign]
        if path is not None:
            mine.add(path)
            if written is not None:
                written.append(path)
        return out

    torch.save = like(real_save, save)
    try:
        with _loading_to_device(), patched_on_import({"safetensors.torch": _refuse_device_safetensors}):
            yield
    finally:
        torch.save = real_save


def _refuse_device_safetensors(mod: Any, undo: contextlib.ExitStack) -> None:
    """safetensors' ``_flatten_as_ptr`` (every save goes through it, safetensors/torch.py 0.x)
    refuses emulated device tensors (see the module docstring)."""
    flatten = getattr(mod, "_flatten_as_ptr", None)
    if flatten is None:
        return

    def flatten_as_ptr(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(tensors, dict):
            on_device = [k for k, v in tensors.items() if isinstance(v, torch.Tensor) and _reduce_device_tensor(v)]
            if on_device:
                raise TraceError(
                    f"the script saves {len(on_device)} device tensor(s) with safetensors ({on_device[0]!r}…): the "
                    "emulated GPU has no values to write, and a safetensors file holds every value",
                    hint="stop the run before the script saves (fewer steps), or save with torch.save")
        return flatten(tensors, *args, **kwargs)

    replace(undo, mod, "_flatten_as_ptr", flatten_as_ptr)


@contextlib.contextmanager
def _loading_to_device() -> Iterator[None]:
    """Patch ``torch.load`` (see the module docstring)."""
    real = torch.load

    def load(f: Any, map_location: Any, pickle_module: Any, *rest: Any) -> Any:
        gpu: dict[int, int] = {}

        def restore(storage: Any, location: str) -> Any:
            dest = _destination(map_location, storage, location)
            if not isinstance(dest, (str, torch.device, int)):
                return dest  # a map function's own storage
            idx = _on_gpu(dest)
            if idx is not None:
                gpu[storage._cdata] = idx
            return storage

        kwargs: dict[str, Any] = {}
        names = ("weights_only", "mmap")
        for name, value in zip(names, rest[:2], strict=False):
            if value is not None:
                kwargs[name] = value
        extra = rest[2] if len(rest) > 2 and isinstance(rest[2], dict) else {}
        if pickle_module is not None:
            kwargs["pickle_module"] = pickle_module
        _LOADING[0] += 1
        _LOADS.append(_Load(map_location))
        try:
            with _rebuild_allowed():
                obj = real(f, map_location=restore, **kwargs, **extra)
        finally:
            _LOADS.pop()
            _LOADING[0] -= 1
        if not gpu:
            return obj
        return _to_device(obj, gpu, {})

    torch.load = like(real, load)
    try:
        yield
    finally:
        torch.load = real


@contextlib.contextmanager
def _rebuild_allowed() -> Iterator[None]:
    """:func:`_rebuild_device_tensor` among the globals a ``weights_only`` load may call."""
    safe = getattr(torch.serialization, "safe_globals", None)
    if safe is None:  # (torch 2.4: no scoped form)
        torch.serialization.add_safe_globals([_rebuild_device_tensor])
        yield
        return
    with safe([_rebuild_device_tensor]):
        yield


def _to_device(obj: Any, gpu: dict[int, int], moved: dict[int, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return _move(obj, gpu, moved)
    if isinstance(obj, nn.Module):
        return obj._apply(lambda t: _move(t, gpu, moved))
    if isinstance(obj, OrderedDict):
        return type(obj)((k, _to_device(v, gpu, moved)) for k, v in obj.items())
    if isinstance(obj, dict):
        return {k: _to_device(v, gpu, moved) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_device(v, gpu, moved) for v in obj]
    if isinstance(obj, tuple):
        items = [_to_device(v, gpu, moved) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    return obj


def _move(t: torch.Tensor, gpu: dict[int, int], moved: dict[int, torch.Tensor]) -> torch.Tensor:
    st = t.untyped_storage()
    idx = gpu.get(st._cdata)
    if idx is None:
        return t
    dev = moved.get(st._cdata)
    if dev is None:
        host = torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,))
        dev = moved[st._cdata] = host.to(torch.device("cuda", idx))
    flat = dev if t.dtype == torch.uint8 else dev.view(t.dtype)
    out = torch.as_strided(flat, t.shape, t.stride(), t.storage_offset())
    if isinstance(t, nn.Parameter):
        return nn.Parameter(out, requires_grad=t.requires_grad)
    return out.requires_grad_(t.requires_grad) if t.is_leaf and t.requires_grad else out
