"""``torch.load`` of a real checkpoint onto the emulated GPU.

A checkpoint saved on a GPU names each storage's device (``"cuda:0"``); loading it with
``map_location="cuda"`` (or with none, which restores the saved devices) makes CUDA storages,
which a CPU build of torch cannot ("Attempting to deserialize object on a CUDA device but
torch.cuda.is_available() is False", or "compiled without CUDA support"). Here the file is
read for real onto the host, each storage's destination is decided as torch decides it
(``map_location`` as None, a device or string, a dict of locations, or a function), and the
storages bound for a GPU become emulated device tensors — one device allocation per storage,
the tensors on it views as in the file (a tied weight saved once loads once).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .signatures import like


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


@contextlib.contextmanager
def loading_to_device() -> Iterator[None]:
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
        try:
            obj = real(f, map_location=restore, **kwargs, **extra)
        finally:
            _LOADING[0] -= 1
        if not gpu:
            return obj
        return _to_device(obj, gpu, {})

    torch.load = like(real, load)
    try:
        yield
    finally:
        torch.load = real


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
