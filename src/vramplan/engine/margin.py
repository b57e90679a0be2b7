"""How far below the usable memory a boundary must stay when ``method=auto`` falls back to the
formulas (the model cannot be traced here, e.g. without ``vramplan[models]``).

The formulas are not a trace: on the reference workloads the traced device memory lies above
theirs by a different amount for each kind of job. A fallback boundary search keeps the largest
excess measured for the job's kind below the usable bytes (``analytic × (1 + margin) ≤ usable``),
and says so; where the formulas lie far below the trace (mixture of experts) the margin is as
large as the measurement, not a guess. ``bench/analytic_margin.py`` re-measures every case and
fails when a margin here no longer covers it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..models.spec import Family, ModelSpec
from ..precision import dp_engine
from ..workload import Peft, Quant, Task, Workload


@dataclass(frozen=True)
class Margin:
    kind: str
    margin: float
    """Fraction of the analytic device memory the trace exceeded it by, rounded up."""
    measured: str
    """The reference workload with the largest excess (bench/analytic_margin.py, torch 2.13, 2026-12-03)."""


MOE = Margin("mixture-of-experts", 2.17, "Mixtral-8x7B QLoRA training, checkpointing, on an H100, batch 1: "
             "trace 87.78 GiB, formulas 27.75 GiB (+216.3 %)")
ENCODER = Margin("encoder", 0.31, "BERT-base training at seq 512 on a T4, batch 20: trace 19.14 GiB, "
                 "formulas 14.67 GiB (+30.4 %)")
SHARDED = Margin("sharded (ZeRO / FSDP)", 0.42, "Llama-3.1-8B training, checkpointing, dp 8 ZeRO-3 on H100s, "
                 "batch 1: trace 29.42 GiB, formulas 20.81 GiB (+41.4 %)")
QUANTISED = Margin("4-bit (QLoRA)", 0.12, "Llama-3.1-8B QLoRA, checkpointing, seq 4096 on an L4, batch 2: "
                   "trace 23.00 GiB, formulas 20.72 GiB (+11.0 %)")
INFER = Margin("inference", 0.14, "Mistral-7B inference at seq 4096 on an A10G, batch 7: trace 24.01 GiB, "
               "formulas 21.15 GiB (+13.5 %)")
GENERATE = Margin("generation", 0.04, "Llama-3.1-8B generating 512 tokens after 1024 on an L4, batch 25: "
                  "trace 22.82 GiB, formulas 21.96 GiB (+3.9 %)")
TRAIN = Margin("training", 0.06, "Qwen2.5-0.5B training on an RTX 4060, batch 1: trace 14.77 GiB, "
               "formulas 13.99 GiB (+5.6 %)")


def margin_of(spec: ModelSpec, w: Workload) -> Margin:
    """The measured margin for this job's kind (the first that applies, in the order above)."""
    if spec.n_experts or spec.family in (Family.MOE, Family.MLA):
        return MOE
    if spec.family is Family.ENCODER:
        return ENCODER
    if w.parallel.dp > 1 and dp_engine(w) in ("fsdp", "fsdp1", "deepspeed"):
        return SHARDED
    if w.peft is Peft.QLORA or w.quant is not Quant.NONE:
        return QUANTISED
    if w.task is Task.INFER:
        return INFER
    if w.task is Task.GENERATE:
        return GENERATE
    return TRAIN


def margin_limit(usable: int, m: Margin) -> int:
    """The usable bytes less the margin: what a fallback search may let the formulas fill."""
    return int(usable / (1 + m.margin))


def describe(m: Margin) -> str:
    return (f"{m.margin:.0%} below the usable memory, the most a trace has exceeded the formulas by for "
            f"{m.kind} jobs ({m.measured}; bench/analytic_margin.py)")
