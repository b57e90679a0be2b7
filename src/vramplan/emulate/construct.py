"""Running a user's model-building code as it is written, without a GPU and without RAM.

A factory such as ``def make(): return LlamaForCausalLM(config).cuda(), inputs`` would, run
plainly on a laptop, allocate every weight in CPU memory (32 GB for an 8B model in fp32) and
fail on ``.cuda()`` ("Torch not compiled with CUDA enabled"). :func:`fake_construction` runs it
under ``torch.device("meta")`` (PyTorch's device context manager, torch >= 2.0: factory
functions without an explicit device create meta tensors, so modules take no memory) and a
small ``TorchFunctionMode`` that turns ``device="cuda"``, ``.cuda()`` and ``.to("cuda")`` into
meta, as the trace itself does for the step (:mod:`.functions`). Tensors created with an
explicit ``device="cpu"`` stay real CPU tensors (their values reach the trace).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .facts import DeviceFacts
from .tensors import on_meta

_META = torch.device("meta")


def _is_cuda(d: Any) -> bool:
    if isinstance(d, torch.device):
        return d.type == "cuda"
    if isinstance(d, str):
        return d.split(":")[0] == "cuda"
    return isinstance(d, int) and not isinstance(d, bool)  # .to(0): a CUDA ordinal


class _FakeCudaConstruction(TorchFunctionMode):
    """``device="cuda"`` / ``.cuda()`` / ``.to("cuda")`` → meta while a model is built."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": _META}
        name = getattr(func, "__name__", "")
        if name == "cuda" and args and isinstance(args[0], torch.Tensor):
            return args[0].to(_META)
        if name == "to" and args and isinstance(args[0], torch.Tensor):
            src = args[0]
            rest = args[1:]
            if rest and (_is_cuda(rest[0]) or (on_meta(src) and _is_cpu(rest[0]))):
                rest = (_META, *rest[1:])
            if on_meta(src) and _is_cpu(kwargs.get("device")):
                kwargs = {**kwargs, "device": _META}  # a meta tensor has no values to copy to the CPU
            return func(src, *rest, **kwargs)
        return func(*args, **kwargs)


def _is_cpu(d: Any) -> bool:
    if isinstance(d, torch.device):
        return d.type == "cpu"
    return isinstance(d, str) and d == "cpu"


@contextlib.contextmanager
def fake_construction(facts: DeviceFacts | None = None) -> Iterator[None]:
    """Build models on ``meta`` with CUDA device requests emulated (see the module docstring).

    With ``facts``, ``torch.cuda`` and ``torch.accelerator`` answer as that GPU while the
    factory runs (the emulated GPU's own answers, :func:`.cuda.patched`), so a factory that
    picks its device (``torch.accelerator.current_accelerator()``, ``"cuda" if
    torch.cuda.is_available() else "cpu"``) picks the GPU as it would on one; its memory
    queries read an empty allocator (nothing of the step has run yet). What it builds still
    reports ``meta`` (module conversion reads a parameter's device to allocate its copy, which
    only ``vramplan run``'s dispatch maps back to meta): a factory that asserts ``x.is_cuda``
    runs under ``vramplan run`` as a script."""
    with contextlib.ExitStack() as stack:
        if facts is not None:
            from ..events import EventLog
            from .cuda import patched
            from .live import LiveAllocator

            stack.enter_context(patched(facts, LiveAllocator(EventLog()), lambda kind: None))
        stack.enter_context(torch.device(_META))
        stack.enter_context(_FakeCudaConstruction())
        yield
