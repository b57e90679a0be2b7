"""Which module an op belongs to, in forward, recompute and backward.

Forward (and checkpoint recompute): global forward pre/post hooks keep a stack of module
paths. Backward: every autograd node gets a sequence number when the forward creates it;
the post hook records the range of numbers created inside each module, so the node running
in backward (``torch._C._current_autograd_node()``) maps back to the innermost module that
created it — no per-tensor hooks needed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

_seq_nr: Callable[[], int] = torch._C._autograd._get_sequence_nr
_current_node: Callable[[], Any] = torch._C._current_autograd_node


class ModuleTracker:
    """Module-path bookkeeping for one trace; ``intern`` maps a path to an event-log id."""

    def __init__(self, intern: Callable[[str], int]) -> None:
        self._intern = intern
        self.names: dict[int, int] = {}
        """id(module) → interned path."""
        self.paths: set[str] = set()
        self.stack: list[int] = [0]
        self._starts: list[int] = []
        self.owner: dict[int, int] = {}
        """autograd sequence number → interned path of the module that created the node."""
        self.param_owner: dict[int, int] = {}
        """id(parameter) → interned path of its module (for AccumulateGrad)."""
        self._handles: list[RemovableHandle] = []

    def add_root(self, model: nn.Module, root_name: str | None = None, *, prefix: bool = False) -> None:
        """Name ``model``'s modules by their paths in it; ``prefix``: after ``root_name`` (a second
        model of a script: a pipeline's VAE after its denoiser, whose paths could be the same)."""
        root = root_name or type(model).__name__
        for name, mod in model.named_modules(remove_duplicate=False):
            path = (f"{root}.{name}" if prefix else name) if name else root
            if id(mod) not in self.names:
                self.names[id(mod)] = self._intern(path)
                self.paths.add(path)
            mid = self.names[id(mod)]
            for p in mod.parameters(recurse=False):
                self.param_owner.setdefault(id(p), mid)

    def name_of(self, mod: nn.Module) -> int:
        mid = self.names.get(id(mod))
        if mid is None:
            path = type(mod).__name__
            mid = self._intern(path)
            self.names[id(mod)] = mid
            self.paths.add(path)
        return mid

    # --- hooks ------------------------------------------------------------------------
    def install(self) -> None:
        reg_pre = nn.modules.module.register_module_forward_pre_hook
        reg_post = nn.modules.module.register_module_forward_hook
        self._handles = [reg_pre(self._pre), reg_post(self._post, always_call=True)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _pre(self, mod: nn.Module, args: Any) -> None:
        self.stack.append(self.name_of(mod))
        self._starts.append(_seq_nr())

    def _post(self, mod: nn.Module, args: Any, out: Any) -> None:
        if len(self.stack) > 1:
            mid = self.stack.pop()
            start = self._starts.pop()
            end = _seq_nr()
            owner = self.owner
            for s in range(start, end):
                if s not in owner:
                    owner[s] = mid

    @property
    def current(self) -> int:
        return self.stack[-1]

    def backward_owner(self) -> int:
        """Module path of the autograd node now running in backward (0 if unknown)."""
        node = _current_node()
        if node is None:
            return 0
        mid = self.owner.get(node._sequence_nr())
        if mid is not None:
            return mid
        var = getattr(node, "variable", None)  # AccumulateGrad
        if var is not None:
            return self.param_owner.get(id(var), 0)
        return 0
