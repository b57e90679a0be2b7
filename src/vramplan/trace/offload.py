"""Activation offloading to CPU memory, as torchtune's ``OffloadActivations`` does it.

Emulates torchtune 0.6.1 ``torchtune/training/_activation_offloading.py`` with its defaults
(``use_pin_memory=True, use_streams=True, max_fwd_stash_size=5, min_offload_size=1024``),
through the same ``torch.autograd.graph.saved_tensors_hooks`` under the trace:

- pack (forward): a saved tensor of at least 1024 bytes (``element_size × nelement``) that is
  not an ``nn.Parameter`` is copied into a new pinned CPU tensor; the GPU tensor stays in a
  *forward stash* until five more tensors have been packed (then the compute stream waits for
  its copy and drops it), so it dies as soon as the forward no longer uses it. Smaller tensors
  and parameters stay saved on the GPU.
- unpack (backward): a tensor still in the forward stash is used as is; otherwise a new GPU
  tensor of the same size is allocated (the copy back on the side stream) and kept in a
  *backward stash*. When its autograd node has run, it is dropped if nothing else holds it
  (torchtune's ``record_stream``), else it stays until the next node that unpacks an
  offloaded tensor has run; the forward stash is emptied after the first such node; the
  backward stash is emptied when backward ends. The CPU copy is freed once unpacked.
- what is excluded: torchtune's recipes wrap the output head in ``NoOpManager`` (via hooks on
  ``model.output``) and compute the loss outside the context; here the model's output
  embedding (``get_output_embeddings()``, else a module named ``output``/``lm_head``) and
  everything after it in the forward (a transformers model's own loss) stay on the GPU.

Host RAM: the pinned copies live in PyTorch's ``CachingHostAllocator``, which rounds each
request up to a power of two and keeps freed blocks cached for requests of the same class
(``c10/core/CachingHostAllocator.h``, ``allocate``: ``roundSize = PowerOf2Ceil(size)``); the
figure reported is what it then holds: per size class, the most blocks live at once.

Not modelled: the side stream's own pool in the allocator (copies back are recorded on the
default stream), the copy/compute overlap (the runtime model charges the PCIe time).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

MIN_OFFLOAD_BYTES = 1024
"""torchtune's ``min_offload_size`` default."""
MAX_FWD_STASH = 5
"""torchtune's ``max_fwd_stash_size`` default."""


def pinned_bytes(n: int) -> int:
    """Bytes the CachingHostAllocator reserves for a request of ``n`` (next power of two)."""
    return 1 << (n - 1).bit_length() if n > 1 else n


class HostLedger:
    """Pinned host memory of the offloaded copies, as the CachingHostAllocator holds it: blocks
    are power-of-two size classes, a freed block is cached for a request of its class, so the
    RAM held is, per class, the most blocks live at once (``reserved``)."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.most: dict[int, int] = {}
        self.tensors = 0

    def alloc(self, n: int) -> None:
        b = pinned_bytes(n)
        self.live[b] = self.live.get(b, 0) + 1
        self.most[b] = max(self.most.get(b, 0), self.live[b])
        self.tensors += 1

    def free(self, n: int) -> None:
        b = pinned_bytes(n)
        self.live[b] -= 1

    @property
    def reserved(self) -> int:
        return sum(b * k for b, k in self.most.items())


class _Copy:
    """Stands for the pinned CPU copy of an offloaded activation."""

    __slots__ = ("dtype", "nbytes", "shape", "stride")

    def __init__(self, t: torch.Tensor) -> None:
        self.shape = tuple(t.shape)
        self.dtype = t.dtype
        self.nbytes = t.element_size() * t.nelement()
        # torchtune's torch.empty_like(activation, device="cpu") then .to("cuda"): the strides
        # empty_like gives (a dense tensor's own, else dense ones in the same dimension order)
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            self.stride = tuple(torch.empty_like(t, device="meta").stride())


class OffloadActivations(saved_tensors_hooks):
    """torchtune's ``OffloadActivations`` (streams on), with the CPU side kept as a ledger."""

    def __init__(self, ledger: HostLedger, label: Callable[[torch.Tensor], None] | None = None) -> None:
        self.ledger = ledger
        self.label = label
        self.tracker: dict[int, tuple[Any, bool]] = {}
        self.tensor_id = 0
        self.is_first_forward_call = True
        self.is_first_backward_call = True
        self.fwd_stash: dict[int, torch.Tensor] = {}
        self.bwd_tensor_stash: dict[int, torch.Tensor] = {}
        self.curr_graph_id: Any = None
        self.curr_autograd_node: Any = None
        super().__init__(self._pack, self._unpack)

    def _pack(self, activation: torch.Tensor) -> int:
        if self.is_first_forward_call:
            self.is_first_forward_call = False
            self.is_first_backward_call = True
        num_bytes = activation.element_size() * activation.nelement()
        self.tensor_id += 1
        tid = self.tensor_id
        if num_bytes >= MIN_OFFLOAD_BYTES and not isinstance(activation, nn.Parameter):
            for k in list(self.fwd_stash):
                if k <= tid - MAX_FWD_STASH:
                    del self.fwd_stash[k]
                else:
                    break
            copy = _Copy(activation)
            self.ledger.alloc(copy.nbytes)
            self.tracker[tid] = (copy, True)
            self.fwd_stash[tid] = activation
        else:
            self.tracker[tid] = (activation, False)
        return tid

    def _unpack(self, tid: int) -> torch.Tensor:
        if self.is_first_backward_call:
            self.curr_graph_id = torch._C._current_graph_task_id()

            def wait_and_del_remaining_references() -> None:
                self.bwd_tensor_stash.clear()

            torch.autograd.Variable._execution_engine.queue_callback(wait_and_del_remaining_references)
            self.is_first_backward_call = False
            self.is_first_forward_call = True
        held, modified = self.tracker.pop(tid)
        if not modified:
            return held  # type: ignore[no-any-return]
        graph_id = torch._C._current_graph_task_id()
        node = torch._C._current_autograd_node()
        prev_ids: list[int] = []
        if graph_id == self.curr_graph_id and self.curr_autograd_node != node:
            self.curr_autograd_node = node
            prev_ids = list(self.bwd_tensor_stash)
        copy: _Copy = held
        self.ledger.free(copy.nbytes)  # the tracker's CPU copy dies here, used or not
        brought_back = tid not in self.fwd_stash
        if not brought_back:
            gpu = self.fwd_stash[tid]
            refcount = 0
        else:
            gpu = torch.empty_strided(copy.shape, copy.stride, dtype=copy.dtype, device="meta")
            if self.label is not None:
                self.label(gpu)
            self.bwd_tensor_stash[tid] = gpu
            refcount = torch._C._storage_Use_Count(gpu.untyped_storage()._cdata)

        def hook(outputs: Any, inputs: Any) -> Any:
            if brought_back:
                t = self.bwd_tensor_stash.get(tid)
                if t is not None and torch._C._storage_Use_Count(t.untyped_storage()._cdata) > refcount:
                    del self.bwd_tensor_stash[tid]  # record_stream: freed when its last user is done
            self.fwd_stash.clear()
            for k in prev_ids:
                self.bwd_tensor_stash.pop(k, None)
            return outputs

        if node is not None:
            node.register_hook(hook)
        return gpu


class NoOp(saved_tensors_hooks):
    """torchtune's ``NoOpManager``: tensors saved inside stay where they are."""

    def __init__(self) -> None:
        super().__init__(lambda t: t, lambda t: t)


def output_head(model: nn.Module) -> nn.Module | None:
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if isinstance(head, nn.Module):
        return head
    for name in ("output", "lm_head"):
        m = getattr(model, name, None)
        if isinstance(m, nn.Module):
            return m
    return None


@contextlib.contextmanager
def offloading(model: nn.Module, ledger: HostLedger,
               label: Callable[[torch.Tensor], None] | None = None) -> Iterator[None]:
    """Install offloading around every forward of ``model`` (hooks; removed on exit): the
    model's forward runs under :class:`OffloadActivations`, its output head and what follows
    under :class:`NoOp`."""
    ctx = OffloadActivations(ledger, label)
    noop = NoOp()
    head = output_head(model)
    state = {"noop": False}

    def enter(module: nn.Module, args: Any) -> None:
        ctx.__enter__()

    def leave(module: nn.Module, args: Any, out: Any) -> Any:
        if state["noop"]:
            noop.__exit__(None, None, None)
            state["noop"] = False
        ctx.__exit__(None, None, None)
        return out

    def head_enter(module: nn.Module, args: Any) -> None:
        if not state["noop"] and torch.is_grad_enabled():
            noop.__enter__()
            state["noop"] = True

    handles = [model.register_forward_pre_hook(enter), model.register_forward_hook(leave, always_call=True)]
    if head is not None and head is not model:
        handles.append(head.register_forward_pre_hook(head_enter))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
