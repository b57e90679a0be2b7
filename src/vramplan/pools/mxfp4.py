"""vLLM's MXFP4 MoE weights (gpt-oss): which backend holds the experts on a GPU at a release, and the
bytes it holds per expert (``serve-plan --quantization mxfp4``; docs/research/vllm-public-logs.md,
"MXFP4 weights").

``Mxfp4MoEMethod.create_weights`` (0.10.1.1 model_executor/layers/quantization/mxfp4.py:137-260,
0.14.1 mxfp4.py:276-405) holds, per expert and rank, with ``I`` the intermediate size per TP rank
and ``H`` the hidden size, each rounded up to the backend's alignment:

* ``w13_weight`` uint8 ``[2I, H/2]`` and ``w13_weight_scale`` uint8 ``[2I, H/32]`` (one E8M0 scale per
  32 values), ``w13_bias`` bf16 ``[2I]``;
* ``w2_weight`` uint8 ``[H, I/2]``, ``w2_weight_scale`` uint8 ``[H, I/32]``, ``w2_bias`` bf16 ``[H]``.

The Marlin backend rounds ``I`` up to 128 and ``H`` up to 256 (0.10.1.1 mxfp4.py:156-167; 0.14.1
mxfp4.py:279-294; 0.19.1 fused_moe/oracle/mxfp4.py:380-385). Its repacking keeps those sizes:
``gptq_marlin_repack`` keeps 4 bits per value, the scales go back to E8M0 after the permutation and
the biases stay bf16 (0.10.1.1 quantization/utils/marlin_utils_fp4.py:195-297, :59-69), plus a
workspace of one int32 per SM (marlin_utils.py:201-209). Attention, router, embeddings and the LM
head stay bf16 (``Mxfp4Config.get_quant_method`` quantises only ``FusedMoE``, mxfp4.py:90-106).

Which backend (CUDA):

* 0.10.1.x: Marlin unless the GPU is compute capability 10.0 (FlashInfer there), because vLLM
  0.10.1.1 pins torch 2.7.1 (requirements/cuda.txt:9) and ``_should_use_marlin`` takes Marlin below
  torch 2.8.0 (mxfp4.py:123-135).
* 0.11.0 … 0.19.x: Marlin below compute capability 9.0 — the Triton kernels need 9.0 ≤ cc < 11.0
  and FlashInfer's MXFP4 backends SM90/SM100 (0.11.0 mxfp4.py:95-102; 0.14.1 mxfp4.py:143-169;
  0.19.1 fused_moe/oracle/mxfp4.py:204-207 and gpt_oss_triton_kernels_moe.py:555-563). On Hopper
  and newer the backend is Triton when the ``triton_kernels`` package is importable, whose swizzled
  layouts live in that package (mxfp4_utils.py ``_swizzle_mxfp4``), not in vLLM: not modelled.
* 0.20 and later add backends (TRT-LLM MXFP8, DeepGEMM, Humming, b12x) and move the padding rules:
  not modelled. 0.10.0 and earlier have no MXFP4.
"""

from __future__ import annotations

from vramplan.errors import WorkloadError
from vramplan.hardware.gpu import GPU
from vramplan.models.spec import ModelSpec

from .vllm_release import Release

BLOCK = 32
"""Values per E8M0 scale (``mxfp4_block``)."""


def marlin_align(spec: ModelSpec, gpu: GPU, version: str | None) -> tuple[int, int]:
    """(intermediate, hidden) alignment of the experts MXFP4 is held in on ``gpu`` at ``version``
    (Marlin's 128, 256), or the refusal with its cause."""
    if spec.model_type != "gpt_oss":
        raise WorkloadError(f"`quantization=mxfp4` is modelled for gpt-oss (its experts), not {spec.name}",
                            hint="use quantization none, fp8, awq or gptq", field="quantization")
    rel = Release.of(version)
    if not rel.since("0.10.1"):
        raise WorkloadError(f"`engine_version={rel.text}` has no MXFP4 (gpt-oss support arrives in vLLM 0.10.1)",
                            hint="use `engine_version` 0.10.1 … 0.19.1", field="engine_version")
    if rel.since("0.20.0"):
        raise WorkloadError(f"`quantization=mxfp4` at `engine_version={rel.text}` is not modelled: from 0.20 vLLM's backend oracle adds "
                            "MXFP8, DeepGEMM and Humming backends with their own padding",
                            hint="use `engine_version` 0.10.1 … 0.19.1", field="engine_version")
    sm = gpu.sm
    if sm is None:
        raise WorkloadError(f"`quantization=mxfp4` on {gpu.name} is not modelled (vLLM's CUDA backends only)",
                            field="quantization")
    marlin = sm != (10, 0) if not rel.since("0.11.0") else sm < (9, 0)
    if not marlin:
        raise WorkloadError(
            f"`quantization=mxfp4` on {gpu.name} (compute capability {sm[0]}.{sm[1]}) at `engine_version={rel.text}` is "
            "not modelled: "
            "vLLM holds them in the triton_kernels package's swizzled layout or FlashInfer's there, whose padding is "
            "not in vLLM's source", hint="plan a GPU below compute capability 9.0 (Marlin), or engine_version 0.10.1 "
            "on Hopper", field="quantization")
    return 128, 256


def expert_bytes(intermediate: int, hidden: int, tp: int, align: tuple[int, int]) -> int:
    """One expert's bytes on one TP rank: packed values, E8M0 scales and bf16 biases of ``w13`` and
    ``w2`` at the backend's padded sizes."""
    i = -(-(intermediate // tp) // align[0]) * align[0]
    h = -(-hidden // align[1]) * align[1]
    w13 = 2 * i * (h // 2) + 2 * i * (h // BLOCK) + 2 * i * 2
    w2 = h * (i // 2) + h * (i // BLOCK) + h * 2
    return w13 + w2


__all__ = ["BLOCK", "expert_bytes", "marlin_align"]
