"""MoE expert loops run for a few experts only, for :mod:`.replicate` to write the others.

transformers 5's eager experts (``@use_experts_implementation`` classes: DeepSeek-V3,
Mixtral, Qwen-MoE and some seventy others; transformers/models/deepseek_v3/
modeling_deepseek_v3.py ``DeepseekV3Experts.forward``, 5.x) loop over the experts that
received tokens::

    expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == self.num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        ...

On fake tensors every expert gets the same tokens (the routing rule of :mod:`.datadep`:
the mask's density ``1/n`` answers each ``torch.where``), so each iteration records the
same events; with 256 experts per layer they are most of DeepSeek-V3's trace. Under an
:class:`ExpertLoops` limit ``k`` the iteration over ``expert_hit`` (``Tensor.__iter__`` →
``unbind(0)``, seen by the function mode) yields only the first ``k`` experts (and the rows
past the last expert, which the loop skips); :mod:`.replicate` traces ``k = 2, 3, 4``, proves
that each more expert inserts the same blocks (forward, recompute, backward) and writes the
log for every expert that the loop would have run.

The limit is refused (:attr:`ExpertLoops.unsafe`) when an iteration's shapes could depend on
which expert it is: a data-dependent op inside the loop answered from real values (a mask
with known contents) or by per-bin counts (``bincount``/``histc``, whose remainder and
routing skew differ by expert), or loops of one trace that would run different numbers of
experts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..emulate.tensors import on_meta
from .values import Values

EXACT_RULES = frozenset({"nonzero", "index_bool", "masked_select"})
"""Data-dependent rules that answer every expert alike (by the mask's density)."""


def experts_count(mod: nn.Module) -> int | None:
    """The number of experts of a transformers experts module (stacked 3-D expert weights,
    an integer ``num_experts``), else None."""
    n = getattr(mod, "num_experts", None)
    if not isinstance(n, int) or isinstance(n, bool) or n < 2:
        return None
    stacked = any(p.dim() == 3 and p.shape[0] == n for p in mod.parameters(recurse=False))
    return n if stacked else None


class ExpertLoops:
    """Limits each eager experts loop of one trace to its first ``limit`` experts."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.experts: dict[int, int] = {}
        """Interned module path → number of experts, for the model's experts modules."""
        self.loops = 0
        """Loops cut short."""
        self.runs: set[int] = set()
        """Experts each cut loop would have run."""
        self.in_loop = False
        self.unsafe: str | None = None
        self._handles: list[Any] = []

    def attach(self, model: nn.Module, name_of: Any) -> None:
        """Find ``model``'s experts modules (``name_of``: module → interned path)."""
        for mod in model.modules():
            n = experts_count(mod)
            if n is not None:
                self.experts[name_of(mod)] = n
                self._handles.append(mod.register_forward_hook(self._leave, always_call=True))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _leave(self, mod: nn.Module, args: Any, out: Any) -> None:
        self.in_loop = False

    def unbind(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], module: int,
               values: Values) -> tuple[torch.Tensor, ...] | None:
        """The rows of ``expert_hit`` the loop runs under the limit (None: not an experts loop,
        or not cut)."""
        n = self.experts.get(module)
        if n is None or not args or not isinstance(args[0], torch.Tensor):
            return None
        x = args[0]
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        if dim != 0 or not on_meta(x) or x.dim() != 2 or x.shape[1] != 1 or x.is_floating_point():
            return None
        known = values.cpu_view(x)
        if known is None:
            return None
        rows = known[:, 0].tolist()
        ran = sum(1 for r in rows if 0 <= r < n)
        if ran <= self.limit:
            return None
        if any(not 0 <= r < n for r in rows[:ran]) or any(0 <= r < n for r in rows[ran:]) \
                or rows[:ran] != sorted(set(rows[:ran])):
            self.unsafe = "experts loop over unsorted expert indices"
            return None
        out = func(*args, **kwargs)
        self.loops += 1
        self.runs.add(ran)
        if len(self.runs) > 1:
            self.unsafe = "experts loops run different numbers of experts"
        self.in_loop = True
        return (*out[:self.limit], *out[ran:])

    def rule(self, name: str, exact: bool) -> None:
        """A data-dependent op answered inside a cut loop."""
        if exact:
            self.unsafe = f"data-dependent `{name}` inside an experts loop answered from known values"
        elif name not in EXACT_RULES:
            self.unsafe = f"data-dependent `{name}` inside an experts loop (its answer may differ by expert)"
