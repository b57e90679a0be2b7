"""Triton kernels launched on the emulated GPU run as no-ops.

Code that sees a CUDA device takes its GPU path, and a GPU path is often a Triton kernel (TRL's
chunked log-probabilities, Liger's fused losses, Unsloth's and FlashAttention's Triton
backends). A Triton launch allocates nothing through PyTorch's caching allocator: its outputs
and scratch buffers are tensors the Python wrapper allocated before the launch (what the
trace records), so on the emulated GPU the launch itself does nothing. The tensors it writes
lose any values the trace knew (``on_launch(tensors)``), and the launches are counted for the
report's notes. Autotuning (which times candidate configurations with CUDA events) is skipped:
the first configuration stands for all of them, as their buffers are the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .imports import patched_on_import, replace

Launched = Callable[[list[torch.Tensor]], None]


def _patch_jit(module: Any, undo: contextlib.ExitStack, on_launch: Launched) -> None:
    def run(self: Any, *args: Any, **kwargs: Any) -> None:
        on_launch([a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)])
        return None

    for cls_name in ("JITFunction",):
        cls = getattr(module, cls_name, None)
        if cls is not None:
            replace(undo, cls, "run", run)


def _patch_autotuner(module: Any, undo: contextlib.ExitStack, on_launch: Launched) -> None:
    def run(self: Any, *args: Any, **kwargs: Any) -> None:
        on_launch([a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)])
        return None

    for cls_name in ("Autotuner", "Heuristics"):
        cls = getattr(module, cls_name, None)
        if cls is not None:
            replace(undo, cls, "run", run)


@contextlib.contextmanager
def triton_launches(on_launch: Launched) -> Iterator[None]:
    """Triton launches are no-ops within the block (see the module docstring)."""
    with patched_on_import({
        "triton.runtime.jit": lambda m, undo: _patch_jit(m, undo, on_launch),
        "triton.runtime.autotuner": lambda m, undo: _patch_autotuner(m, undo, on_launch),
    }):
        yield
