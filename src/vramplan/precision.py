"""The one precision model: what each tensor class is stored and computed in, per workload.

Decided once from ``precision × PEFT × quantisation × ZeRO`` and read by the analytic
formulas (:mod:`vramplan.analytic`), the trace's set-up (:mod:`vramplan.trace.features`) and the
step-time model (:mod:`vramplan.runtime`), so that they cannot disagree:

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
- ``*-mixed`` under FSDP (ZeRO-3 by default, ZeRO-2 with ``engine=fsdp``): **FSDP2's
  ``MixedPrecisionPolicy(param_dtype=16-bit, reduce_dtype=fp32)``** — fp32 sharded parameters
  (4Ψ/N), fp32 sharded gradients (4Ψ/N, reduce-scattered in fp32), fp32 Adam moments (8Ψ/N,
  no separate master copy); parameters all-gathered and computed in 16-bit, no autocast
  (torch/distributed/fsdp/_fully_shard/_fsdp_api.py). The same 16Ψ/N as DeepSpeed's ZeRO-3,
  split differently.
- LoRA / QLoRA: the frozen base is 16-bit (QLoRA: NF4); PEFT keeps adapters in fp32
  (``autocast_adapter_dtype=True``), so adapter gradients and states are fp32.
  ``peft_base_dtype=fp32`` (a base loaded in fp32, run under autocast): the base and its
  residual stream are fp32 and autocast caches a 16-bit copy of every base weight, as under
  AMP; ``bf16``/``fp16`` must be the compute dtype (the base's matmuls run in it).
- bitsandbytes 4-bit compute dtype (``bnb_compute_dtype``, auto: the compute dtype):
  ``Linear4bit`` casts its input to it and ``MatMul4Bit`` dequantises the weight to the
  dtype it was loaded in, then ``.to(compute dtype)`` (bitsandbytes
  ``autograd/_functions.py``); transformers' ``BitsAndBytesConfig`` defaults it to fp32.
- Quantised base without PEFT under ``*-mixed``: the unquantised rest is 16-bit.
"""

from __future__ import annotations

import dataclasses

from vramplan._dataclass import dataclass

from .workload import DtypeChoice, Peft, Precision, Quant, Workload

FP32, BF16, FP16 = "float32", "bfloat16", "float16"


@dataclass(frozen=True)
class PrecisionModel:
    """Bytes per element of each kind of tensor under a workload's precision."""

    weight: int
    """Bytes per stored, unquantised parameter of the model (not adapters)."""
    stream: int
    """Bytes per element of the residual stream (the embedding output's dtype)."""
    compute: int
    """Bytes per element of matmul outputs (and of activations in general)."""
    autocast: bool
    master: bool
    """fp32 master weights live in the optimizer states (DeepSpeed/FSDP semantics)."""
    grad: int
    """Bytes per gradient element of a fully trained parameter."""
    state: int
    """Bytes per optimizer-state element (Adam moments, momentum)."""
    adapter: int = 4
    """Bytes per LoRA adapter parameter (and its gradient)."""
    compute_dtype: str = FP32
    """torch dtype name of the compute (autocast's target under ``*-mixed``)."""
    peft: bool = False
    bnb_compute_dtype: str = ""
    """bitsandbytes 4-bit compute dtype name ("" = the compute dtype)."""
    param_cast: bool = False
    """FSDP's mixed precision runs the forward and backward on 16-bit copies of the fp32 stored
    parameters: FSDP2's unsharded parameter is made in ``MixedPrecisionPolicy.param_dtype``
    (torch 2.13 ``fsdp/_fully_shard/_fsdp_param.py:630-655`` ``init_unsharded_param``, ``:901`` the
    all-gather input cast), FSDP1's ``MixedPrecision(param_dtype)`` all-gathers a low-precision shard
    (``fsdp/_flat_param.py:1342-1358`` ``_use_low_precision_shard``). Autocast (FSDP1 under accelerate)
    casts only its matmuls' operands; element-wise ops with a weight (an RMSNorm's ``weight * x``) read
    this copy too. Under PEFT (a 16-bit base) it is the fp32 adapters that FSDP2 gathers in
    ``param_dtype``: PEFT's cast of a LoRA input to ``lora_A``'s dtype is then a no-op, and autocast
    has no adapter weight to cast."""

    @property
    def forward_weight(self) -> int:
        """Bytes per element of an (unquantised) parameter as the forward reads it outside autocast's
        casts: FSDP's ``param_dtype`` copy under its mixed precision, else the stored weight."""
        return self.compute if self.param_cast else self.weight

    @property
    def weight_dtype(self) -> str:
        """torch dtype name the (unquantised) weights are stored in."""
        return FP32 if self.weight == 4 else self.compute_dtype

    @property
    def bnb_dtype(self) -> str:
        """torch dtype name bitsandbytes' 4-bit layers compute in."""
        return self.bnb_compute_dtype or self.compute_dtype

    @property
    def bnb_bytes(self) -> int:
        return 4 if self.bnb_dtype == FP32 else 2

    @property
    def autocast_dtype(self) -> str | None:
        return self.compute_dtype if self.autocast else None

    @property
    def trainable_bytes(self) -> int:
        """Bytes per trainable parameter and per element of its gradient (adapters under PEFT)."""
        return self.adapter if self.peft else self.grad

    @property
    def cast_bytes(self) -> int:
        """Bytes moved per weight to make autocast's compute-dtype copy (read + write); 0 when
        the weights are stored in the compute dtype already (pure 16-bit, PEFT's base, fp32)."""
        return self.weight + self.compute if self.autocast and self.weight != self.compute else 0

    @property
    def label(self) -> str:
        if self.autocast and self.weight == 4:
            return "PyTorch AMP (fp32 params, autocast 16-bit)"
        if self.weight == 4 and self.compute == 2 and not self.autocast:
            return "FSDP2 mixed precision (fp32 shards, 16-bit all-gathers and compute)"
        if self.master:
            return "16-bit params/grads with fp32 master + states in the optimizer (DeepSpeed/FSDP)"
        return f"{self.weight * 8}-bit params"


_DTYPE_NAMES = {DtypeChoice.FP32: FP32, DtypeChoice.BF16: BF16, DtypeChoice.FP16: FP16}


def precision_model(w: Workload) -> PrecisionModel:
    pm = _precision_model(w)
    if w.quant in (Quant.NF4, Quant.INT4) and w.bnb_compute_dtype is not DtypeChoice.AUTO:
        pm = dataclasses.replace(pm, bnb_compute_dtype=_DTYPE_NAMES[w.bnb_compute_dtype])
    return pm


def _precision_model(w: Workload) -> PrecisionModel:
    p = w.precision
    half = BF16 if p in (Precision.BF16, Precision.BF16_MIXED) else FP16
    peft = w.peft is not Peft.NONE
    if p is Precision.FP32:
        return PrecisionModel(weight=4, stream=4, compute=4, autocast=False, master=False, grad=4, state=4,
                              compute_dtype=FP32, peft=peft)
    if peft and w.peft_base_dtype is DtypeChoice.FP32:  # validated: only under *-mixed
        return PrecisionModel(weight=4, stream=4, compute=2, autocast=True, master=False, grad=4, state=4,
                              compute_dtype=half, peft=True)
    if peft:
        # FSDP2's MixedPrecisionPolicy gathers the fp32 adapters in param_dtype (param_cast)
        fsdp_mp = w.mixed and w.training and dp_engine(w) == "fsdp" and w.quant is Quant.NONE
        return PrecisionModel(weight=2, stream=2, compute=2, autocast=w.mixed, master=False, grad=4, state=4,
                              compute_dtype=half, peft=True, param_cast=fsdp_mp)
    if not w.mixed:
        return PrecisionModel(weight=2, stream=2, compute=2, autocast=False, master=False, grad=2, state=2,
                              compute_dtype=half)
    if w.training and dp_engine(w) in ("fsdp", "fsdp1") and w.quant is Quant.NONE:
        # FSDP1 as accelerate runs it: its MixedPrecision and, around the forward, CUDA autocast
        return PrecisionModel(weight=4, stream=2, compute=2, autocast=dp_engine(w) == "fsdp1", master=False,
                              grad=4, state=4, compute_dtype=half, param_cast=True)
    if w.training and w.parallel.zero >= 1:
        return PrecisionModel(weight=2, stream=2, compute=2, autocast=False, master=True, grad=2, state=4,
                              compute_dtype=half)
    if w.quant is not Quant.NONE:
        return PrecisionModel(weight=2, stream=2, compute=2, autocast=True, master=False, grad=2, state=2,
                              compute_dtype=half)
    return PrecisionModel(weight=4, stream=4, compute=2, autocast=True, master=False, grad=4, state=4,
                          compute_dtype=half)


def dp_engine(w: Workload) -> str:
    """The data-parallel engine whose semantics apply: ``ddp`` (no ZeRO), ``fsdp`` (FSDP2) or
    ``deepspeed`` (``fsdp1``: FSDP1, set explicitly). ``Parallel.engine`` when set; by default DDP without ZeRO, DeepSpeed for
    ZeRO-1/2 and FSDP for ZeRO-3 (with one data-parallel rank nothing is distributed: ``none``)."""
    p = w.parallel
    e = str(getattr(p, "engine", "auto"))
    if e != "auto":
        return e
    if p.zero == 0:
        return "ddp" if p.dp > 1 else "none"
    return "fsdp" if p.zero == 3 else "deepspeed"


def fsdp_cpu_offload(w: Workload) -> bool:
    """FSDP2's ``CPUOffloadPolicy``: ``offload_params`` under the FSDP engine. FSDP2 has one
    policy (accelerate's ``cpu_offload``, torchtitan's ``enable_cpu_offload``): sharded
    parameters, gradients and the optimizer step all on the host, ``offload_optimizer`` or not."""
    return w.parallel.offload_params and dp_engine(w) == "fsdp"


def fsdp_shards_quantised(w: Workload) -> bool:
    """FSDP2 shards this 4-bit quantised model's parameters (FSDP-QLoRA): the packed weights are
    ``Params4bit`` parameters (``bnb_4bit_quant_storage`` = the dtype FSDP all-gathers in) and are
    sharded; their quant state is not a parameter and stays whole on every rank."""
    p = w.parallel
    return (w.quant.value in ("nf4", "int4") and p.dp > 1 and p.zero == 3 and dp_engine(w) == "fsdp"
            and not (p.tp > 1 or p.pp > 1 or p.cp > 1))


__all__ = ["PrecisionModel", "precision_model", "dp_engine", "fsdp_cpu_offload", "fsdp_shards_quantised"]
