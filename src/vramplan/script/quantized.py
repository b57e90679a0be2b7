"""``from_pretrained(quantization_config=…)`` under ``vramplan run``: the quantised layers each
library would load, built on the fake device in place of the model's linears.

Which library and kernel a config means follows transformers 5's quantizers: bitsandbytes
(``BitsAndBytesConfig``; the ``load_in_4bit``/``load_in_8bit`` keywords are gone in
transformers 5 and stop the run as they stop the real one), AWQ and GPTQ (GPTQModel's Marlin
kernels on sm80+; AWQ forces fp16), torchao (``TorchAoConfig`` by its config class),
compressed-tensors (by its config groups; ``dequantize=True`` loads dense weights) and
fine-grained fp8. A checkpoint's own ``quantization_config`` (config.json) counts as passed.
HQQ stops as transformers 5 stops (its quantizer has no loading ops); anything else stops with
the formats that are emulated. The layers are those of :mod:`vramplan.trace.quant` (bitsandbytes,
fp8) and :mod:`vramplan.trace.quantkernels` (the others); the LM head stays unquantised.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import TraceError
from ..quantformats import FORMATS
from ..target import DeviceProfile
from ..workload import Quant

SUPPORTED = "bitsandbytes, awq, gptq, torchao, compressed-tensors, fp8"
_TORCHAO = {
    "Int4WeightOnlyConfig": Quant.AO_INT4, "Int8WeightOnlyConfig": Quant.AO_INT8,
    "Int8DynamicActivationInt8WeightConfig": Quant.AO_INT8_DYN, "Float8WeightOnlyConfig": Quant.AO_FP8,
    "Float8DynamicActivationFloat8WeightConfig": Quant.AO_FP8_DYN,
}


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)


def method(qc: Any) -> str:
    m = _get(qc, "quant_method", "")
    return str(getattr(m, "value", m)).lower()


def requested(kwargs: dict[str, Any], config: Any) -> Any:
    """The quantisation a ``from_pretrained`` call asks for (None: none)."""
    qc = kwargs.get("quantization_config")
    for old in ("load_in_4bit", "load_in_8bit"):
        if old in kwargs:
            import transformers

            raise TraceError(f"from_pretrained({old}=…) is gone in transformers {transformers.__version__}: the "
                             f"model's __init__ gets it and raises TypeError — the real run stops here too",
                             hint=f"pass quantization_config=BitsAndBytesConfig({old}=True)")
    if qc is None:
        qc = getattr(config, "_vramplan_quantization_config", None)
    return qc


def load_dtype(qc: Any, dtype: torch.dtype | None) -> torch.dtype | None:
    """AWQ loads in fp16 on CUDA whatever was asked (transformers quantizer_awq.py ``update_dtype``)."""
    return torch.float16 if method(qc) == "awq" else dtype


def apply(model: nn.Module, qc: Any, device: DeviceProfile) -> list[str]:
    """Quantise ``model``'s linears as ``qc`` says; returns the notes."""
    how = method(qc)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.bfloat16)
    skip = ("lm_head", *(_get(qc, "modules_to_not_convert") or ()), *(_get(qc, "llm_int8_skip_modules") or ()))
    if how == "bitsandbytes":
        return _bnb(model, qc, dtype, skip)
    if how == "fp8":
        from ..trace.quant import quantize_linears

        n = quantize_linears(model, Quant.FP8, dtype, double_quant=False, skip=skip, storage_dtype=dtype)
        return [f"from_pretrained: {n} linear layers in fp8 (FineGrainedFP8Config; vramplan's fp8 layer: "
                "e4m3 weights, one fp32 scale per row, where transformers keeps one per 128×128 block)"]
    if how == "hqq":
        import transformers

        raise TraceError(f"transformers {transformers.__version__} cannot load HQQ models: its HqqHfQuantizer has no "
                         "loading ops (NotImplementedError: QuantizationMethod.HQQ is not available yet) — the real run "
                         "stops here too", hint="quantise with hqq's own API, or use `vramplan estimate MODEL --quant hqq`")
    kind = _kind(how, qc)
    if kind is None:  # compressed-tensors with dequantize=True: dense weights
        return ["from_pretrained: compressed-tensors with dequantize=True loads dense weights"]
    fmt = FORMATS[kind]
    if device.sm < fmt.min_sm:
        raise TraceError(f"{fmt.library} does not run on {device.name}: {fmt.min_sm_why}", hint="pick a newer GPU")
    from ..trace.quantkernels import quantize_format

    n = quantize_format(model, kind, dtype, skip=skip, sm_count=device.sm_count, group=_group(kind, qc))
    return [f"from_pretrained: {n} linear layers as {fmt.library} [{fmt.source}]"]


def _group(kind: Quant, qc: Any) -> int:
    """The config's group size (0: the format's default; -1: one group per row)."""
    if kind in (Quant.AWQ, Quant.GPTQ):
        return int(_get(qc, "group_size", 0) or 0)
    if kind is Quant.AO_INT4:
        return int(_get(_get(qc, "quant_type"), "group_size", 0) or 0)
    if kind is Quant.CT_W4A16:
        inner = _get(qc, "quantization_config") or qc
        groups = _get(inner, "config_groups") or {}
        for scheme in (groups.values() if isinstance(groups, dict) else groups):
            return int(_get(_get(scheme, "weights"), "group_size", 0) or 0)
    return 0


def _bnb(model: nn.Module, qc: Any, dtype: torch.dtype, skip: tuple[str, ...]) -> list[str]:
    from ..trace.quant import quantize_linears

    if _get(qc, "load_in_8bit"):
        n = quantize_linears(model, Quant.INT8, dtype, double_quant=False, skip=skip, storage_dtype=dtype)
        return [f"from_pretrained: {n} linear layers as bitsandbytes LLM.int8 (Linear8bitLt)"]
    if not _get(qc, "load_in_4bit"):
        return []
    kind = Quant.INT4 if str(_get(qc, "bnb_4bit_quant_type", "fp4")) == "fp4" else Quant.NF4
    compute = _get(qc, "bnb_4bit_compute_dtype") or torch.float32  # BitsAndBytesConfig's default
    if isinstance(compute, str):
        compute = getattr(torch, compute.removeprefix("torch."))
    double = bool(_get(qc, "bnb_4bit_use_double_quant", False))
    n = quantize_linears(model, kind, compute, double_quant=double, skip=skip, storage_dtype=dtype)
    return [f"from_pretrained: {n} linear layers as bitsandbytes {kind} (Linear4bit"
            f"{', double quantisation' if double else ''}, computing in {str(compute).removeprefix('torch.')})"]


def _kind(method: str, qc: Any) -> Quant | None:
    if method in ("awq", "gptq"):
        bits = int(_get(qc, "bits", 4) or 4)
        if bits != 4:
            raise TraceError(f"{method} with bits={bits} is not emulated (4-bit only)", hint="use a 4-bit checkpoint")
        if method == "gptq" and _get(qc, "desc_act"):
            raise TraceError("GPTQ with desc_act=True (act-order) is not emulated: Marlin keeps g_idx and its sort "
                             "indices and stages a permuted copy of each input", hint="use a desc_act=False checkpoint")
        if method == "awq" and str(getattr(_get(qc, "version", "gemm"), "value", _get(qc, "version", "gemm"))).lower() \
                not in ("gemm", "gemv"):
            raise TraceError(f"AWQ version {_get(qc, 'version')} is not emulated", hint="use an AWQ GEMM checkpoint")
        return Quant.AWQ if method == "awq" else Quant.GPTQ
    if method == "torchao":
        qt = _get(qc, "quant_type")
        if isinstance(qt, str):
            raise TraceError(f"TorchAoConfig('{qt}'): transformers 5 takes a torchao config object, not a string",
                             hint="pass e.g. TorchAoConfig(Int4WeightOnlyConfig())")
        name = (qt.get("default", qt).get("_type") if isinstance(qt, dict) else type(qt).__name__) or str(qt)
        if name not in _TORCHAO:
            raise TraceError(f"torchao {name} is not emulated", hint=f"use one of: {', '.join(_TORCHAO)}")
        return _TORCHAO[name]
    if method == "compressed-tensors":
        return _compressed(qc)
    raise TraceError(f"from_pretrained(quantization_config=…) with quant_method={method or '?'} is not emulated",
                     hint=f"emulated: {SUPPORTED}")


def _compressed(qc: Any) -> Quant | None:
    if _get(qc, "dequantize") or _get(qc, "run_compressed") is False:
        return None
    inner = _get(qc, "quantization_config") or qc
    groups = _get(inner, "config_groups") or {}
    kinds = set()
    for scheme in (groups.values() if isinstance(groups, dict) else groups):
        w = _get(scheme, "weights")
        bits, typ = int(_get(w, "num_bits", 0) or 0), str(getattr(_get(w, "type"), "value", _get(w, "type")))
        acts = _get(scheme, "input_activations")
        if bits == 4 and typ == "int" and acts is None and _get(w, "symmetric", True):
            kinds.add(Quant.CT_W4A16)
        elif bits == 8 and typ == "int" and acts is not None:
            kinds.add(Quant.CT_W8A8)
        elif bits == 8 and typ == "float":
            kinds.add(Quant.CT_FP8)
        else:
            raise TraceError(f"compressed-tensors scheme with {bits}-bit {typ} weights"
                             f"{'' if acts is None else ' and quantised activations'}"
                             f"{'' if _get(w, 'symmetric', True) else ', asymmetric'} is not emulated",
                             hint="emulated: W4A16 (symmetric), W8A8 int8, FP8")
    if len(kinds) != 1:
        raise TraceError("compressed-tensors config with no (or several) quantisation schemes is not emulated",
                         hint="one scheme for all linears: W4A16, W8A8 or FP8")
    return kinds.pop()
