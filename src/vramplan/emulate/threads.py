"""Threads the script starts see the emulated GPU as the thread that started them does.

PyTorch keeps its mode stacks per thread: the ``TorchFunctionMode`` and ``TorchDispatchMode``
objects that make a meta tensor a ``cuda`` one and record its memory are on the stack of the
thread that entered them. A real GPU is the same device for every thread, so a thread the script
starts while it runs (a loader's thread pool moving weights to the device, a prefetching
thread) starts with the modes its parent had when it called ``Thread.start``, and with the
context variables named (the running trace session). Everything else a new thread starts
without on a GPU too — grad mode, autocast, the script's own context variables — is left as
torch and Python make it.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from typing import Any

from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack


@contextlib.contextmanager
def modes_follow_threads(*carried: contextvars.ContextVar[Any]) -> Iterator[None]:
    """Within the block, ``threading.Thread.start`` hands the starting thread's torch function
    and dispatch modes (and the values of ``carried``) to the new thread for its whole run."""
    real_start = threading.Thread.start

    def start(self: threading.Thread) -> None:
        functions = _get_current_function_mode_stack()
        dispatch = _get_current_dispatch_mode_stack()
        values = [(v, v.get()) for v in carried]
        run = self.run

        def run_with_modes() -> None:
            import torch

            tokens = [(v, v.set(x)) for v, x in values]
            for m in functions:
                torch._C._push_on_torch_function_stack(m)
            for m in dispatch:
                torch._C._push_on_torch_dispatch_stack(m)
            try:
                run()
            finally:
                for m in reversed(dispatch):
                    torch._C._pop_torch_dispatch_stack(getattr(m, "_mode_key", None))
                for _ in functions:
                    torch._C._pop_torch_function_stack()
                for v, token in reversed(tokens):
                    v.reset(token)

        self.run = run_with_modes  # type: ignore[method-assign]
        real_start(self)

    threading.Thread.start = start  # type: ignore[method-assign]
    try:
        yield
    finally:
        threading.Thread.start = real_start  # type: ignore[method-assign]


class PerThread:
    """An instance attribute whose value is per thread (``default`` until set in that thread): the
    emulation's state that says where an op's outputs go (a host scope, a copy to the device, a
    module conversion) belongs to the thread running the op, not to every thread of the script."""

    def __init__(self, default: Any) -> None:
        self.default = default
        self.slot = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = f"_per_thread_{name}"

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self
        local = obj.__dict__.get(self.slot)
        return self.default if local is None else getattr(local, "value", self.default)

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__.setdefault(self.slot, threading.local()).value = value


class Counter(threading.local):
    """A per-thread ``[0]`` counter (the emulation's depth flags, read as ``FLAG[0]``)."""

    value = 0

    def __getitem__(self, index: int) -> int:
        return self.value

    def __setitem__(self, index: int, value: int) -> None:
        self.value = value
