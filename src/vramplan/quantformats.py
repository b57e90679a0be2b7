"""Quantised weight formats beyond bitsandbytes: what each library's quantised linear keeps.

One table read by the trace (:mod:`vramplan.trace.quantkernels` builds these tensors and runs
each library's forward on them), the analytic refusal and the step-time model, so that the
bytes per weight have one source. Each entry names the library version and the file its
shapes come from; ``O`` = out_features, ``I`` = in_features, ``g`` = group size, ``cd`` = the
model's compute dtype (what the checkpoint was loaded in).

bitsandbytes (``nf4``/``int4``/``int8``) and the generic ``fp8`` stay in
:mod:`vramplan.trace.quant` / :func:`vramplan.analytic.states.quantised_bytes`.
"""

from __future__ import annotations

from vramplan._dataclass import dataclass

from .workload import Quant

MARLIN_WORKSPACE = 132
"""gptqmodel utils/marlin.py ``marlin_make_workspace_new``: int32 of max(SM count, 128) per
layer (132 on H100/H200; the table takes that; a few hundred bytes either way)."""
_BYTES = {"int32": 4, "int64": 8, "int16": 2, "int8": 1, "uint8": 1, "float8_e4m3fn": 1,
          "float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class Format:
    """One quantised-linear format as its library stores and runs it."""

    quant: Quant
    library: str
    """The library and version the shapes were read from."""
    group: int
    """Default group size (0: per output row / per tensor)."""
    source: str
    """File(s) the stored tensors and the forward follow."""
    forward: str
    """What one forward allocates, in words (shown in the report's notes)."""
    min_sm: tuple[int, int] = (7, 0)
    """Oldest GPU generation the library's kernels for it run on."""
    min_sm_why: str = ""


_MARLIN_FORWARD = ("the Marlin kernel writes the output and takes an fp32 reduce scratch of SMs × min(rows "
                   "rounded to 16, 64) × 256 for the call; no dequantised weight")
DECOMPRESSED = frozenset({Quant.CT_W4A16, Quant.CT_W8A8, Quant.CT_FP8})
"""compressed-tensors under transformers 5: dense compute-dtype weights after the first forward."""

FORMATS: dict[Quant, Format] = {f.quant: f for f in (
    Format(Quant.AWQ, "GPTQModel 7.7 AwqMarlinLinear (transformers 5 loads AWQ through GPTQModel; w_bit=4, "
           "zero point, fp16)", 128,
           "transformers/quantizers/quantizer_awq.py, integrations/awq.py (hf_select_quant_linear_v2); "
           "gptqmodel/nn_modules/qlinear/marlin_awq.py; gptqmodel_ext/marlin/gptq_marlin.cu, marlin_scratch.cuh",
           _MARLIN_FORWARD,
           (8, 0), "GPTQModel's Marlin kernels need sm80+ (older GPUs fall to other kernels, not modelled)"),
    Format(Quant.GPTQ, "GPTQModel 7.7 MarlinLinear (transformers 5 / optimum's default on sm80+; bits=4, sym, "
           "desc_act=False)", 128,
           "optimum/gptq/quantizer.py; gptqmodel/utils/importer.py (kernel priority); "
           "gptqmodel/nn_modules/qlinear/marlin.py (post_init repack, forward); gptqmodel_ext/marlin/gptq_marlin.cu",
           _MARLIN_FORWARD,
           (8, 0), "GPTQModel's Marlin kernels need sm80+ (older GPUs fall to ExLlamaV2, not modelled)"),
    Format(Quant.HQQ, "hqq 0.2.8 (HQQLinear, nbits=4, axis=1, PYTORCH backend)", 64,
           "hqq/core/quantize.py (Quantizer.quantize/dequantize, HQQLinear.forward_pytorch_backprop); "
           "hqq/core/bitpack.py",
           "every forward dequantises the whole weight: unpacked [O·I/g, g] in the compute dtype, (W - zero) and "
           "(·scale) copies of it alive together, then x @ W.T"),
    Format(Quant.AO_INT4, "torchao 0.18 (Int4WeightOnlyConfig, version 2, packing 'plain')", 128,
           "torchao/quantization/quantize_/workflows/int4/int4_tensor.py (Int4Tensor, mslk "
           "bf16i4bf16_rowwise)",
           "the fused int4 kernel writes the output only; the bias is added out of place",
           (9, 0), "its mslk/fbgemm-genai CUTLASS kernel needs sm90"),
    Format(Quant.AO_INT8, "torchao 0.18 (Int8WeightOnlyConfig, version 2, per row)", 0,
           "torchao/quantization/quantize_/workflows/int8/int8_tensor.py (Int8Tensor, linear)",
           "every forward casts the whole int8 weight to the compute dtype ([I, O], qdata.t().to(compute dtype)), then "
           "x @ it and a per-row scale multiply"),
    Format(Quant.AO_INT8_DYN, "torchao 0.18 (Int8DynamicActivationInt8WeightConfig, version 2)", 0,
           "torchao/quantization/quantize_/workflows/int8/int8_tensor.py; torchao/kernel/intmm.py "
           "(safe_int_mm)",
           "each input is quantised per token (fp32 temporaries, int8 copy); the int8 weight is made "
           "contiguous transposed ([I, O], 1 B/weight) for torch._int_mm (int32 output); 16 rows or "
           "fewer fall back to an fp32 matmul of fp32 copies of both"),
    Format(Quant.AO_FP8, "torchao 0.18 (Float8WeightOnlyConfig, per row)", 0,
           "torchao/quantization/quantize_/workflows/float8/float8_tensor.py; "
           "torchao/quantization/quant_primitives.py (_dequantize_affine_float8)",
           "every forward dequantises the whole weight: fp32 [O, I] copy, fp32 scaled copy, then the compute dtype"),
    Format(Quant.AO_FP8_DYN, "torchao 0.18 (Float8DynamicActivationFloat8WeightConfig, per tensor)", 0,
           "torchao/quantization/quantize_/workflows/float8/float8_tensor.py; torchao/float8/inference.py",
           "each input is quantised to fp8 (abs in the compute dtype, fp32 copy, fp32 scaled, e4m3 copy) for "
           "torch._scaled_mm; the weight is used as stored",
           (8, 9), "torchao asserts sm89+ (or MI300) for float8 dynamic activations"),
    Format(Quant.CT_W4A16, "compressed-tensors 0.20 under transformers 5 (W4A16, pack-quantized)", 128,
           "compressed_tensors/compressors/pack_quantized/base.py; "
           "compressed_tensors/compressors/model_compressors/model_compressor.py (ct_decompress_hook); "
           "transformers/quantizers/quantizer_compressed_tensors.py",
           "the first forward decompresses every linear to a dense compute-dtype weight (one module at a time) "
           "and the packed weight is freed: from then on the model holds dense weights"),
    Format(Quant.CT_W8A8, "compressed-tensors 0.20 under transformers 5 (W8A8 int8, dynamic per token)", 0,
           "compressed_tensors/compressors/naive_quantized/base.py; "
           "compressed_tensors/quantization/lifecycle/forward.py (quantized_forward, fake_quantize)",
           "the first forward decompresses every linear to a dense compute-dtype weight; every forward then "
           "fake-quantises its input (quantise-dequantise temporaries of the input's shape, in the compute dtype)"),
    Format(Quant.CT_FP8, "compressed-tensors 0.20 under transformers 5 (FP8_DYNAMIC)", 0,
           "compressed_tensors/compressors/naive_quantized/base.py; "
           "compressed_tensors/quantization/lifecycle/forward.py (quantized_forward, fake_quantize)",
           "the first forward decompresses every linear to a dense compute-dtype weight; every forward then "
           "fake-quantises its input to fp8 and back (temporaries of the input's shape)"),
)}


def format_of(q: Quant) -> Format | None:
    return FORMATS.get(q)


def stored(q: Quant, d_in: int, d_out: int, compute: str, *, group: int = 0,
           decompressed: bool = False) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(name, dtype, shape)`` of each tensor one quantised ``d_in → d_out`` linear keeps
    (the bias aside: it stays ``compute``). ``compute``: the torch dtype name the model was
    loaded in. ``decompressed``: compressed-tensors after its first forward."""
    fmt = FORMATS[q]
    g = d_in if group < 0 else (group or fmt.group)  # (-1: one group per row, GPTQ's per-channel)
    groups = -(-d_in // g) if g else 1
    if q is Quant.AWQ:  # AWQ layout (qweight packs 8 outputs per int32), Marlin-repacked in place: same sizes
        return [("qweight", "int32", (d_in, d_out // 8)), ("qzeros", "int32", (groups, d_out // 8)),
                ("scales", "float16", (groups, d_out)), ("workspace", "int32", (MARLIN_WORKSPACE,))]
    if q is Quant.GPTQ:  # gptq_marlin_repack: [I/16, 2·O] int32; qzeros and g_idx emptied (sym, no act order)
        return [("qweight", "int32", (d_in // 16, 2 * d_out)), ("scales", compute, (groups, d_out)),
                ("workspace", "int32", (MARLIN_WORKSPACE,))]
    if q is Quant.HQQ:  # axis=1: rows of g weights; 4-bit packs two rows of W_q per byte row
        rows = d_out * d_in // g
        return [("W_q", "uint8", (rows // 2, g)), ("scale", compute, (rows, 1)), ("zero", compute, (rows, 1))]
    if q is Quant.AO_INT4:  # Int4Tensor (plain): two 4-bit values per int8, scale/zero [I/g, O]
        return [("qdata", "int8", (d_out, d_in // 2)), ("scale", compute, (groups, d_out)),
                ("zero_point", compute, (groups, d_out))]
    if q in (Quant.AO_INT8, Quant.AO_INT8_DYN):  # Int8Tensor v2: per-row fp32 scale, int8 zero point
        return [("qdata", "int8", (d_out, d_in)), ("scale", "float32", (d_out, 1)), ("zero_point", "int8", (d_out, 1))]
    if q is Quant.AO_FP8:  # Float8Tensor, PerRow
        return [("qdata", "float8_e4m3fn", (d_out, d_in)), ("scale", "float32", (d_out, 1))]
    if q is Quant.AO_FP8_DYN:  # Float8Tensor, PerTensor (the config's default granularity)
        return [("qdata", "float8_e4m3fn", (d_out, d_in)), ("scale", "float32", (1, 1))]
    if q is Quant.CT_W4A16:
        scale = [("weight_scale", compute, (d_out, groups))]
        if decompressed:
            return [("weight", compute, (d_out, d_in)), *scale, ("weight_shape", "int64", (2,))]
        return [("weight_packed", "int32", (d_out, -(-d_in * 4 // 32))), *scale, ("weight_shape", "int64", (2,))]
    if q is Quant.CT_W8A8:
        return [("weight", compute if decompressed else "int8", (d_out, d_in)), ("weight_scale", compute, (d_out, 1))]
    if q is Quant.CT_FP8:
        return [("weight", compute if decompressed else "float8_e4m3fn", (d_out, d_in)),
                ("weight_scale", compute, (d_out, 1))]
    raise ValueError(f"no table entry for {q}")


_DIVIDES: dict[Quant, tuple[tuple[str, int], ...]] = {
    Quant.AWQ: (("out_features", 8),), Quant.GPTQ: (("in_features", 16), ("out_features", 8)),
    Quant.AO_INT4: (("in_features", 2),), Quant.CT_W4A16: (("in_features", 8),),
}
"""Packing rules: what a dimension must divide by for the format's packed layout (8 4-bit values
per int32 along AWQ's outputs, Marlin's 16-row input tiles, two values per byte); the group size
must divide ``in_features`` for the grouped formats."""


def layout_problem(q: Quant, d_in: int, d_out: int, group: int = 0) -> str | None:
    """Why a ``d_in → d_out`` linear cannot be stored in ``q`` (None: it can)."""
    fmt = FORMATS[q]
    dims = {"in_features": d_in, "out_features": d_out}
    for name, k in _DIVIDES.get(q, ()):
        if dims[name] % k:
            return f"{fmt.library} packs {name} in multiples of {k}; this layer has {dims[name]}"
    g = d_in if group < 0 else (group or fmt.group)
    if g and q in (Quant.AWQ, Quant.GPTQ, Quant.AO_INT4, Quant.CT_W4A16) and d_in % g:
        return f"{fmt.library} quantises groups of {g} inputs; in_features {d_in} is not a multiple"
    if q is Quant.HQQ and (d_in * d_out) % (2 * g):
        return f"{fmt.library} packs rows of {g} weights two to a byte; {d_in}×{d_out} weights do not divide"
    return None


def stored_bytes(q: Quant, d_in: int, d_out: int, compute: str, *, group: int = 0, decompressed: bool = False) -> int:
    total = 0
    for _, dtype, shape in stored(q, d_in, d_out, compute, group=group, decompressed=decompressed):
        n = 1
        for s in shape:
            n *= s
        total += n * _BYTES[dtype]
    return total


def bytes_per_weight(q: Quant, compute: str = "bfloat16", d: int = 4096) -> float:
    """Stored bytes per weight of a ``d × d`` linear (what a step moves per weight read)."""
    return stored_bytes(q, d, d, compute) / (d * d)
