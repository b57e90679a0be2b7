"""Which weights train, decided once per workload; which dtype each tensor class has comes
from the one precision model (:mod:`vramplan.precision`), shared with the trace and runtime.
"""

from __future__ import annotations

from vramplan._dataclass import dataclass
from vramplan.errors import WorkloadError
from vramplan.precision import PrecisionModel, precision_model
from vramplan.workload import ALL_LINEAR, LORA_DEFAULT_TARGETS, Peft, Task, Workload

from .arch import Arch, Linear
from .parallel import local_adapters

Regime = PrecisionModel
"""The analytic formulas' name for the precision model."""


def regime(w: Workload) -> Regime:
    return precision_model(w)


@dataclass(frozen=True)
class Trainable:
    """Which parameters train: all of them, or the LoRA targets with their rank."""

    full: bool
    targets: frozenset[tuple[str, str]] = frozenset()
    """(name, role) of the linears LoRA wraps."""
    rank: int = 0

    def lora_on(self, lin: Linear) -> bool:
        return not self.full and (lin.name, lin.role) in self.targets

    def adapter_params(self, lin: Linear) -> int:
        return self.rank * (lin.d_in + lin.d_out) * lin.count if self.lora_on(lin) else 0

    def local_adapter_params(self, lin: Linear, w: Workload) -> int:
        """Adapter elements of ``lin`` on one tensor-parallel rank (:func:`.parallel.local_adapters`)."""
        return sum(local_adapters(lin, self.rank, w)) * lin.count if self.lora_on(lin) else 0


def trainable(arch: Arch, w: Workload) -> Trainable:
    """Resolve LoRA target names against the model's linears (PEFT's suffix match)."""
    if w.task is not Task.TRAIN:
        return Trainable(full=False)
    if w.peft is Peft.NONE:
        return Trainable(full=True)
    if w.lora_dora:
        raise WorkloadError(
            "DoRA: the analytic method does not model its weight-norm path (each adapted weight rebuilt "
            "and normed in every forward, and the base and adapter outputs it saves)",
            hint="use `method=trace` (auto traces catalog models), which runs peft's own DoRA code",
            field="lora_dora")
    if w.lora_modules_to_save:
        raise WorkloadError(
            f"`lora_modules_to_save` ({', '.join(w.lora_modules_to_save)}): the analytic method does not model "
            "peft's trainable copies of whole modules",
            hint="use `method=trace` (auto traces catalog models)", field="lora_modules_to_save")
    lins = [lin for g in arch.groups for lin in g.linears if lin.lora]
    wanted = tuple(w.lora_targets)
    if wanted == (ALL_LINEAR,):
        chosen = {(lin.name, lin.role) for lin in lins}
    elif wanted == LORA_DEFAULT_TARGETS and not any(lin.name in wanted for lin in lins):
        chosen = {(lin.name, lin.role) for lin in lins if lin.attn}  # the model's attention projections
    else:
        chosen = {(lin.name, lin.role) for lin in lins
                  if any(lin.name == t or lin.name.endswith("." + t) for t in wanted)}
        missed = [t for t in wanted if not any(lin.name == t or lin.name.endswith("." + t) for lin in lins)]
        if chosen and missed and wanted != LORA_DEFAULT_TARGETS:  # (peft would wrap what it finds: lm_head, embed_tokens)
            raise WorkloadError(
                f"LoRA target {', '.join(missed)}: the analytic method puts adapters on the layers' linear "
                f"layers only ({', '.join(arch.linear_names())}), and would leave {'it' if len(missed) == 1 else 'them'} out",
                hint="use `method=trace` (auto traces catalog models), which wraps every module peft does; "
                     "or drop it from `lora_targets`", field="lora_targets")
    if not chosen:
        names = ", ".join(arch.linear_names())
        raise WorkloadError(
            f"LoRA targets {', '.join(wanted)} match no linear layer of {arch.name}",
            hint=f"use `lora_targets` with some of: {names}, or all-linear",
        )
    return Trainable(full=False, targets=frozenset(chosen), rank=w.lora_rank)
