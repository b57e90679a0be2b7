"""Optimizers as CUDA runs them.

- ``torch.optim`` optimizers get ``foreach=True`` (CUDA's default: whole-list temporaries
  such as AdamW's ``exp_avg_sq.sqrt()`` for every parameter at once), ``fused=True``
  (in-place kernels, device ``step`` counters; fused kernels without a meta kernel are
  skipped as in-place no-ops) or the for-loop, as the workload says.
- Lion (not in ``torch.optim``): one momentum state, foreach update (lucidrains/lion-pytorch).
- bitsandbytes 8-bit AdamW: emulated storage — parameters of at least 4,096 elements keep
  two ``uint8`` states plus one fp32 ``absmax`` per block each (256 elements from bitsandbytes
  0.44, 2,048 before: ``workload.bnb_optim_block``, the workload's ``bnb_version``); smaller ones
  keep fp32 states; the update is one fused in-place kernel (no temporaries). The *paged*
  variant (bitsandbytes ``optim/optimizer.py`` ``get_state_buffer``) allocates the two
  state buffers of parameters of at least 100,000 elements with ``F.get_paged``
  (``cudaMallocManaged``: CUDA unified memory, outside PyTorch's caching allocator); those
  are left out of the events and stated in the notes. Smaller parameters' states and every
  ``absmax`` are ordinary ``torch.zeros`` allocations, traced as such.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ..workload import Optimizer, OptimizerImpl, Workload, bnb_optim_block

BNB_MIN_8BIT_SIZE = 4096
BNB_PAGED_MIN = 100_000
"""bitsandbytes pages a state buffer only for parameters of at least 1e5 elements."""


def _impl_kwargs(impl: OptimizerImpl) -> dict[str, Any]:
    if impl is OptimizerImpl.FUSED:
        return {"fused": True}
    if impl is OptimizerImpl.FOR_LOOP:
        return {"foreach": False}
    return {"foreach": True}


def make_optimizer(w: Workload, params: list[nn.Parameter]) -> tuple[Any, list[str]]:
    """The workload's optimizer over ``params``; returns (optimizer, notes)."""
    notes: list[str] = []
    if not params:
        return None, ["no trainable parameters: no optimizer step"]
    kw = _impl_kwargs(w.optimizer_impl)
    opt = w.optimizer
    if opt is Optimizer.ADAMW:
        return torch.optim.AdamW(params, lr=1e-4, **kw), notes
    if opt is Optimizer.ADAM:
        return torch.optim.Adam(params, lr=1e-4, **kw), notes
    if opt is Optimizer.SGD:
        return torch.optim.SGD(params, lr=1e-3, **kw), notes
    if opt is Optimizer.SGD_MOMENTUM:
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, **kw), notes
    if opt is Optimizer.ADAFACTOR:
        ada = getattr(torch.optim, "Adafactor", None)
        if ada is None:
            raise ImportError("torch.optim.Adafactor needs torch >= 2.5")
        return ada(params, lr=1e-2, foreach=kw.get("foreach", False) or None), notes
    if opt is Optimizer.LION:
        return Lion(params, foreach=kw.get("foreach", True)), notes
    if opt in (Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW_8BIT):
        paged = opt is Optimizer.PAGED_ADAMW_8BIT
        block = bnb_optim_block(w.bnb_version)
        o = AdamW8bit(params, paged=paged, block=block)
        notes.append(f"8-bit AdamW emulated (bitsandbytes {w.bnb_version} storage: uint8 states + fp32 absmax "
                     f"per {block:,}-block)")
        if paged:
            notes.append(f"paged optimizer states ({o.paged_bytes():,} B) live in CUDA unified memory "
                         "(cudaMallocManaged), outside the caching allocator: not in these figures; they take "
                         "GPU memory while resident and page to host memory under pressure")
        return o, notes
    raise ValueError(f"unsupported optimizer {opt}")


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023): ``update = sign(β1·m + (1−β1)·g)``; ``m ← β2·m + (1−β2)·g``."""

    def __init__(self, params: Iterable[nn.Parameter], lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, foreach: bool = True) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay, "foreach": foreach})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            ps = [p for p in group["params"] if p.grad is not None]
            if not ps:
                continue
            grads = [p.grad for p in ps]
            for p in ps:
                if "exp_avg" not in self.state[p]:
                    self.state[p]["exp_avg"] = torch.zeros_like(p)
            ms = [self.state[p]["exp_avg"] for p in ps]
            b1, b2 = group["betas"]
            if group["foreach"]:
                upd = torch._foreach_mul(ms, b1)
                torch._foreach_add_(upd, grads, alpha=1 - b1)
                torch._foreach_sign_(upd)
                torch._foreach_add_(ps, upd, alpha=-group["lr"])
                del upd
                torch._foreach_mul_(ms, b2)
                torch._foreach_add_(ms, grads, alpha=1 - b2)
            else:
                for p, g, m in zip(ps, grads, ms, strict=True):
                    u = (m * b1).add_(g, alpha=1 - b1).sign_()
                    p.add_(u, alpha=-group["lr"])
                    m.mul_(b2).add_(g, alpha=1 - b2)


def _bnb_paged_bytes(n: int) -> int:
    """Bytes of a parameter's two state buffers that bitsandbytes pages (0 below 1e5 elements)."""
    if n < BNB_PAGED_MIN:
        return 0
    return 2 * (4 * n if n < BNB_MIN_8BIT_SIZE else n)


class AdamW8bit(torch.optim.Optimizer):
    """Storage-faithful stand-in for ``bitsandbytes.optim.AdamW8bit`` / ``PagedAdamW8bit``."""

    def __init__(self, params: Iterable[nn.Parameter], lr: float = 1e-4, paged: bool = False,
                 block: int = 256) -> None:
        super().__init__(params, {"lr": lr})
        self.paged = paged
        self.block = block
        self.qmaps: list[torch.Tensor] = []
        """bitsandbytes' ``name2qmap["dynamic"]`` / ``["udynamic"]``: 256 fp32 codes each, moved to
        the device at the first 8-bit state and shared by every parameter's ``qmap1``/``qmap2``."""

    def paged_bytes(self) -> int:
        return sum(_bnb_paged_bytes(p.numel()) for g in self.param_groups for p in g["params"])

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "step" not in st:
                    st["step"] = 0
                    if p.numel() >= BNB_MIN_8BIT_SIZE and not self.qmaps:
                        self.qmaps = [torch.zeros(256, dtype=torch.float32, device=p.device) for _ in range(2)]
                    self._init_state(st, p, self.block, paged=self.paged and p.numel() >= BNB_PAGED_MIN)
                    if p.numel() >= BNB_MIN_8BIT_SIZE:
                        st["qmap1"], st["qmap2"] = self.qmaps
                st["step"] += 1

    @staticmethod
    def _init_state(st: dict[str, Any], p: torch.Tensor, block: int, *, paged: bool = False) -> None:
        n = p.numel()
        if n < BNB_MIN_8BIT_SIZE:
            st["state1"] = torch.zeros_like(p, dtype=torch.float32)
            st["state2"] = torch.zeros_like(p, dtype=torch.float32)
            return
        blocks = -(-n // block)
        if not paged:  # paged buffers live in unified memory, outside the allocator
            st["state1"] = torch.zeros_like(p, dtype=torch.uint8)
            st["state2"] = torch.zeros_like(p, dtype=torch.uint8)
        st["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
        st["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
