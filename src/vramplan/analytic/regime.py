"""Which dtype each tensor class has, and which weights train — decided once per workload.

Precision semantics (stated in the estimate's notes):

- ``fp32``: everything fp32.
- ``bf16`` / ``fp16`` (pure): weights, gradients, optimizer states and activations 16-bit.
- ``*-mixed`` without ZeRO: **PyTorch AMP** — fp32 parameters (they are the master weights),
  fp32 gradients, fp32 optimizer states, ``torch.autocast`` computing matmuls in 16-bit. The
  residual stream stays fp32 (the embedding weight is fp32), so every linear fed from it
  saves its own 16-bit cast of the input, and autocast keeps a 16-bit copy of every weight.
  4Ψ + 4Ψ + 8Ψ (Adam) = 16Ψ.
- ``*-mixed`` with ZeRO ≥ 1: **DeepSpeed / FSDP mixed precision** — 16-bit working weights
  (2Ψ) and gradients (2Ψ), fp32 master weights + Adam moments in the optimizer states
  (12Ψ): the same 16Ψ, split so that ZeRO-1 = 4Ψ + 12Ψ/N, ZeRO-2 = 2Ψ + 14Ψ/N,
  ZeRO-3 = 16Ψ/N. The model runs in 16-bit (no autocast cast copies).
- LoRA / QLoRA: the frozen base is 16-bit (QLoRA: NF4); PEFT keeps adapters in fp32
  (``autocast_adapter_dtype=True``), so adapter gradients and states are fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramplan.errors import WorkloadError
from vramplan.workload import ALL_LINEAR, LORA_DEFAULT_TARGETS, Peft, Precision, Task, Workload

from .arch import Arch, Linear


@dataclass(frozen=True)
class Regime:
    weight: int
    """Bytes per stored, unquantised parameter of the model (not adapters)."""
    stream: int
    """Bytes per element of the residual stream (the embedding output's dtype)."""
    compute: int
    """Bytes per element of matmul outputs."""
    autocast: bool
    master: bool
    """fp32 master weights live in the optimizer states (DeepSpeed/FSDP semantics)."""
    grad: int
    state: int
    """Bytes per optimizer-state element (Adam moments, momentum)."""
    adapter: int = 4

    @property
    def label(self) -> str:
        if self.autocast and self.weight == 4:
            return "PyTorch AMP (fp32 params, autocast 16-bit)"
        if self.master:
            return "16-bit params/grads with fp32 master + states in the optimizer (DeepSpeed/FSDP)"
        return f"{self.weight * 8}-bit params"


def regime(w: Workload) -> Regime:
    p = w.precision
    if p is Precision.FP32:
        return Regime(weight=4, stream=4, compute=4, autocast=False, master=False, grad=4, state=4)
    if w.peft is not Peft.NONE:
        return Regime(weight=2, stream=2, compute=2, autocast=w.mixed, master=False, grad=4, state=4)
    if not w.mixed:
        return Regime(weight=2, stream=2, compute=2, autocast=False, master=False, grad=2, state=2)
    if w.training and w.parallel.zero >= 1:
        return Regime(weight=2, stream=2, compute=2, autocast=False, master=True, grad=2, state=4)
    if w.quant.value != "none":
        return Regime(weight=2, stream=2, compute=2, autocast=True, master=False, grad=2, state=2)
    return Regime(weight=4, stream=4, compute=2, autocast=True, master=False, grad=4, state=4)


@dataclass(frozen=True)
class Trainable:
    full: bool
    targets: frozenset[tuple[str, str]] = frozenset()
    """(name, role) of the linears LoRA wraps."""
    rank: int = 0

    def lora_on(self, lin: Linear) -> bool:
        return not self.full and (lin.name, lin.role) in self.targets

    def adapter_params(self, lin: Linear) -> int:
        return self.rank * (lin.d_in + lin.d_out) * lin.count if self.lora_on(lin) else 0


def trainable(arch: Arch, w: Workload) -> Trainable:
    """Resolve LoRA target names against the model's linears (PEFT's suffix match)."""
    if w.task is not Task.TRAIN:
        return Trainable(full=False)
    if w.peft is Peft.NONE:
        return Trainable(full=True)
    lins = [lin for g in arch.groups for lin in g.linears if lin.lora]
    wanted = tuple(w.lora_targets)
    if wanted == (ALL_LINEAR,):
        chosen = {(lin.name, lin.role) for lin in lins}
    elif wanted == LORA_DEFAULT_TARGETS and not any(lin.name in wanted for lin in lins):
        chosen = {(lin.name, lin.role) for lin in lins if lin.attn}  # the model's attention projections
    else:
        chosen = {(lin.name, lin.role) for lin in lins
                  if any(lin.name == t or lin.name.endswith("." + t) for t in wanted)}
    if not chosen:
        names = ", ".join(arch.linear_names())
        raise WorkloadError(
            f"LoRA targets {', '.join(wanted)} match no linear layer of {arch.name}",
            hint=f"use `lora_targets` with some of: {names}, or all-linear",
        )
    return Trainable(full=False, targets=frozenset(chosen), rank=w.lora_rank)
