"""Module conversion keeps every Parameter object, as it does on a real GPU.

``model.to("cuda")`` on a GPU changes each parameter in place (``param.data = moved``:
CPU and CUDA tensors are "shallow-copy compatible", ``Module._apply``), so tied weights stay
one Parameter and an optimizer built before the move still steps the model's parameters. On
the emulated GPU the moved tensor is ``meta``, which is not compatible with a CPU tensor, and
``_apply`` would make a new Parameter per module: a tied embedding and head counted twice, with
their gradients and optimizer states. PyTorch's own answer is
``torch.__future__.set_swap_module_params_on_conversion(True)``: ``_apply`` swaps the moved
tensor into the existing Parameter object (``torch.utils.swap_tensors``). It is switched on for
the duration of each top-level conversion (``.to``, ``.cuda``, ``.half``/``.bfloat16``,
``to_empty``) and put back afterwards.

Where a swap is impossible (a parameter that something holds a weak reference to), the
conversion runs as torch would run it without the flag, and optimizers built so far are
pointed at the new Parameters, as the real move would have left them.

``model.to(0)`` — an int is a CUDA ordinal, which a CPU build of torch cannot parse — becomes
``model.to("cuda:0")``. ``param.data = moved`` across the host and the emulated GPU (FSDP1's own
move) swaps the moved contents into the same object (:func:`_set_data`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .threads import Counter

CONVERTING = Counter()
"""Positive while a module conversion (``Module._apply``) runs in this thread: its copies move a
model, not data."""


@contextlib.contextmanager
def keeping_identity(optimizers: weakref.WeakSet[Any]) -> Iterator[None]:
    """Patch ``nn.Module._apply`` and ``nn.Module.to`` (see the module docstring)."""
    orig_apply, orig_to = nn.Module._apply, nn.Module.to
    future = torch.__future__
    depth = CONVERTING

    def _apply(self: nn.Module, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if depth[0]:
            return orig_apply(self, fn, *args, **kwargs)
        params = [(m, name, p) for m in self.modules() for name, p in m._parameters.items() if p is not None]
        swap = all(weakref.getweakrefcount(p) == 0 for _, _, p in params)
        before = future.get_swap_module_params_on_conversion()
        depth[0] += 1
        try:
            if swap:
                future.set_swap_module_params_on_conversion(True)
                try:
                    return orig_apply(self, fn, *args, **kwargs)
                except RuntimeError as e:
                    if "Couldn't swap" not in str(e):
                        raise
                    future.set_swap_module_params_on_conversion(before)  # convert the rest without swapping
            out = orig_apply(self, fn, *args, **kwargs)
        finally:
            depth[0] -= 1
            future.set_swap_module_params_on_conversion(before)
        _repoint(optimizers, {id(p): m._parameters[name] for m, name, p in params if m._parameters.get(name) is not p})
        return out

    def to(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if args and isinstance(args[0], int) and not isinstance(args[0], bool):
            args = (f"cuda:{args[0]}", *args[1:])
        if isinstance(kwargs.get("device"), int) and not isinstance(kwargs["device"], bool):
            kwargs = {**kwargs, "device": f"cuda:{kwargs['device']}"}
        return orig_to(self, *args, **kwargs)

    nn.Module._apply = _apply  # type: ignore[method-assign]
    nn.Module.to = to  # type: ignore[method-assign]
    had_data = "data" in torch.Tensor.__dict__
    saved_data = torch.Tensor.__dict__.get("data")
    torch.Tensor.data = property(_DATA.__get__, _set_data)  # type: ignore[assignment,method-assign]
    try:
        yield
    finally:
        nn.Module._apply = orig_apply  # type: ignore[method-assign]
        nn.Module.to = orig_to  # type: ignore[method-assign]
        if had_data:
            torch.Tensor.data = saved_data  # type: ignore[assignment,method-assign]
        else:
            del torch.Tensor.data


_DATA = torch._C.TensorBase.__dict__["data"]


def _set_data(self: torch.Tensor, value: Any) -> None:
    """``t.data = moved`` where one side is on the emulated GPU (``meta`` storage) and the other a
    real host tensor: on a GPU CPU and CUDA tensors are shallow-copy compatible and the object
    keeps its identity (FSDP1 moves each parameter with ``param.data = param.to(device)``); here
    the moved contents are swapped into the same object (``torch.utils.swap_tensors``), which
    keeps its class, attributes, ``requires_grad`` and gradient."""
    try:
        _DATA.__set__(self, value)
        return
    except RuntimeError as e:
        if "incompatible tensor type" not in str(e) or not isinstance(value, torch.Tensor) or not self.is_leaf:
            raise
        refused = e
    attrs = dict(self.__dict__)
    grad = self.grad
    new = value.detach()
    new = type(self)(new, requires_grad=self.requires_grad) if isinstance(self, nn.Parameter) else \
        new.requires_grad_(self.requires_grad)
    try:
        torch.utils.swap_tensors(self, new)
    except RuntimeError:  # (held elsewhere or in an autograd graph: torch's own refusal stands)
        raise refused from None
    self.__dict__.update(attrs)
    if grad is not None and self.grad is None:
        try:
            self.grad = grad
        except RuntimeError:  # (a host gradient beside a device parameter: its own `.data =` moves it)
            pass


def _repoint(optimizers: weakref.WeakSet[Any], moved: dict[int, Any]) -> None:
    """Optimizers built before a conversion that made new Parameters step the new ones."""
    if not moved:
        return
    for opt in list(optimizers):
        for group in opt.param_groups:
            group["params"] = [moved.get(id(p), p) for p in group["params"]]
        state = opt.state
        items = [(moved.get(id(k), k), v) for k, v in state.items()]
        state.clear()
        state.update(items)


@contextlib.contextmanager
def checkpoint_metadata_on_storage() -> Iterator[None]:
    """Activation checkpointing compares each tensor its recompute saves with the forward's
    (shape, dtype, device: ``torch.utils.checkpoint._default_meta_extractor``). A tensor saved
    from inside the trace's emulation reads its storage's device, one saved from the model's
    own code the emulated device; the check compares the storage's device on both sides."""
    import torch.utils.checkpoint as ckpt

    table = getattr(ckpt, "_allowed_determinism_checks_to_fns", None)
    if not isinstance(table, dict) or "default" not in table:
        yield
        return
    from .tensors import raw_device

    def meta(x: torch.Tensor) -> dict[str, Any]:
        return {"shape": x.shape, "dtype": x.dtype, "device": raw_device(x)}

    saved = table["default"]
    table["default"] = meta
    try:
        yield
    finally:
        table["default"] = saved
