"""TGI 3.x's fused-MoE buffers in the warm-up prefill (CUDA), per kernel generation: what Mixtral's MoE layer
allocates over its input, per moment, as a function of tokens, experts, top-k, the expert intermediate on the
rank and the hidden size (:mod:`vramplan.serving.tgi` adds the tensors the model class holds).

Which kernel runs, per release (server/pyproject.toml, server/kernels.lock of huggingface/text-generation-inference):

- 3.0.0 … 3.0.2 moe-kernels 0.7.0, 3.1.0 moe-kernels 0.8.2 (pyproject v3.0.1:56-60, v3.1.0:78), read at those
  tags of danieldk/moe-kernels (``MOE_KERNELS``).
- 3.1.1 … 3.3.7: the kernel hub's ``kernels-community/moe`` (``load_kernel(module="moe", …)``,
  layers/moe/unquantized.py v3.1.1:10-15 = v3.3.7; 3.1.1 / 3.2.0 take ">=0.1.1" unlocked, 3.2.1 … 3.3.0 pin hub
  revision 605a216f, 3.3.1 … 3.3.7 e3efab93: server/kernels.lock). Those hub revisions are not stored; what is
  read is the same source as huggingface/kernels-community re-imported it, ``vllm-moe/`` at commit 716495f1
  (2026-06-24, "This imports vllm-moe into kernels-community again. This is the original version, updated to
  work with the latest kernel-builder") — its ``torch-ext/vllm_moe/`` (``HUB``). Assumed equal to the pinned
  revisions' buffers; the one difference that matters, one cache shared by the two expert GEMMs' outputs
  (``cache13``), would otherwise add M·topk·min(2·I, hidden) activation elements.

TGI's own MoE layer code is the same file at every tag from v3.1.1 to v3.3.7 (layers/moe/unquantized.py,
gptq_marlin.py, fp8.py: identical blobs), so one rule serves those releases.
"""

from __future__ import annotations

from vramplan.pools.base import cdiv

# The first release that loads the kernel hub's MoE (layers/moe/unquantized.py v3.1.1:10-15).
HUB_FROM = "3.1.1"
MOE_KERNELS = "moe-kernels"
HUB = "kernels-community/moe"
# fused_experts runs at most VLLM_FUSED_MOE_CHUNK_SIZE tokens per pass (default 32768; moe_kernels/fused_moe.py
# v0.7.0:16, v0.8.2:17; vllm_moe/fused_moe.py :23) and sizes its caches for one pass. Marlin MoE does not chunk.
FUSED_MOE_CHUNK = 32768


def moe_align_ints(tokens: int, topk: int, experts: int, *, marlin: bool = False) -> int:
    """Bytes of ``moe_align_block_size``'s int32 outputs for one pass of ``tokens`` rows: ``sorted_ids``
    [M·topk + E·(BLOCK_SIZE_M − 1)], ``expert_ids`` [⌈that / BLOCK_SIZE_M⌉], ``num_tokens_post_pad`` [1]
    (moe_kernels/fused_moe.py v0.7.0:218-231, v0.8.2:246-259; vllm_moe/moe_align_block_size.py :206-219, the same
    sizes). BLOCK_SIZE_M is the default config's, 64, or 16 for M ≤ E — and for Marlin MoE also M ≤ 32
    (``get_default_config``: moe_kernels v0.7.0:335-358, v0.8.2:377-400 with ``is_marlin`` :393; vllm_moe
    fused_moe.py :825-875, :868). A tuned config file for the card (configs/E=…,N=…,device_name=….json) may pick
    another (16 … 256): E · 4 bytes per unit of difference."""
    block = 16 if tokens <= experts or (marlin and tokens <= 32) else 64
    padded = tokens * topk + experts * (block - 1)
    return 4 * (padded + cdiv(padded, block) + 1)


def routing_moments(m: int, experts: int, topk: int, kernel: str) -> dict[str, int]:
    """``fused_topk`` with ``renormalize=True`` (Mixtral's, flash_mixtral_modeling.py v3.0.1:329, v3.3.7:330),
    over the router logits [M, E] in the 16-bit activation dtype that ``MixtralMoE.forward`` keeps
    (v3.0.1:341-344, v3.3.7:342-345):

    - ``topk_softmax``: ``topk_weights`` fp32, ``topk_ids`` and ``token_expert_indicies`` int32, each [M, topk],
      and ``gating_output.float()`` [M, E]; the kernel adds an fp32 [M·E] workspace when E is not a power of two
      or above 256 (csrc/moe/topk_softmax_kernels.cu v0.7.0:489-495; vllm-moe moe/topk_softmax_kernels.cu
      :489-495, the same);
    - ``renormalize``: ``topk_weights / topk_weights.sum(-1, keepdim=True)`` holds the old weights, the [M, 1]
      fp32 sum and the new weights. moe-kernels (v0.7.0:387-416, v0.8.2:436-465) passes the fp32 logits as a
      temporary and deletes ``token_expert_indicies`` first; the hub's ``fused_topk`` (vllm_moe/fused_moe.py
      :937-965) binds ``gating_output_float`` and renormalizes inside ``vllm_topk_softmax`` (:914-930) before
      the ``del``, so both are still alive there."""
    e, k = experts, topk
    logits = 2 * m * e
    workspace = 4 * m * e if (e & (e - 1)) or e > 256 else 0
    renorm = logits + 3 * 4 * m * k + 4 * m if kernel == MOE_KERNELS else logits + 4 * m * e + 4 * 4 * m * k + 4 * m
    return {"router": logits, "topk_softmax": logits + 4 * m * e + workspace + 3 * 4 * m * k, "renormalize": renorm}


def fused_moe_moments(m: int, hidden: int, inter: int, experts: int, topk: int, *, kernel: str = MOE_KERNELS,
                      fp8: bool = False) -> dict[str, int]:
    """Bytes the unquantized (or fp8 w8a8) fused MoE holds over its input, per moment, for ``m`` tokens, ``inter``
    = the expert intermediate on this rank (TGI shards each expert's w1/w3 by column and w2 by row:
    layers/moe/unquantized.py v3.0.1:98-154), 16-bit activations, written into the input (``inplace=True``,
    unquantized.py v3.0.1:84-95, v3.3.7:68-103 → its ``fused_moe`` :166-269; fp8.py v3.3.7:72-91): :func:`routing_moments`,
    then ``fused_experts`` with ``topk_weights`` and ``topk_ids`` alive and, per pass of Mc = min(M,
    :data:`FUSED_MOE_CHUNK`) tokens, :func:`moe_align_ints` — the previous pass's still bound while the next is
    aligned; the Triton GEMMs, ``silu_and_mul`` and ``moe_sum`` write into the caches / the input:

    - moe-kernels 0.7.0 / 0.8.2 (v0.7.0:471-612, v0.8.2:545-688): ``intermediate_cache1`` [Mc, topk, 2·I],
      ``intermediate_cache2`` [Mc·topk, I], ``intermediate_cache3`` [Mc, topk, hidden], all before the loop;
    - the hub's (vllm_moe/fused_moe.py ``fused_experts_impl`` :1244-1439): one ``cache13`` [Mc·topk·max(2·I,
      hidden)] that caches 1 and 3 view (:1306-1314) and ``intermediate_cache2`` [Mc·topk, I] (:1316-1319);
      with ``fp8`` (``use_fp8_w8a8``, TGI's on-the-fly fp8 with no input scale) each pass quantises its input
      and the activated cache with ``scaled_fp8_quant`` (vllm_moe/fp8.py :12-60: an fp8 copy and a dynamic
      per-tensor fp32 scale [1]), both bound through the w2 GEMM (fused_moe.py :1362-1369, :1404-1411);
    - fp8 with moe-kernels 0.8.2 (TGI 3.1.0's ``FP8SparseMoELayer``, layers/moe/fp8.py v3.1.0:72-91; 3.0.x has
      no fp8 MoE layer): ``invoke_fused_moe_kernel`` quantises its own GEMM input into a temporary
      (moe_kernels/fused_moe.py v0.8.2:284-287, ``scaled_fp8_quant`` fp8.py v0.8.2:10-60), freed when the GEMM
      returns: the larger of the two GEMMs' copies, Mc·hidden or Mc·topk·I bytes, + the scale."""
    k = topk
    moments = routing_moments(m, experts, topk, kernel)
    chunk = min(m, FUSED_MOE_CHUNK)
    passes = [min(FUSED_MOE_CHUNK, m - start) for start in range(0, m, FUSED_MOE_CHUNK)]
    aligned = [moe_align_ints(t, k, experts) for t in passes]
    align = max([aligned[0]] + [a + b for a, b in zip(aligned, aligned[1:], strict=False)])
    caches = (2 * inter + inter + hidden) if kernel == MOE_KERNELS else (max(2 * inter, hidden) + inter)
    if not fp8:
        quantised = 0
    elif kernel == MOE_KERNELS:
        quantised = max(chunk * hidden, chunk * k * inter) + 4
    else:
        quantised = chunk * hidden + chunk * k * inter + 2 * 4
    return moments | {"fused_experts": moments["router"] + 2 * 4 * m * k + 2 * chunk * k * caches + align + quantised}


def marlin_moe_moments(m: int, hidden: int, inter: int, experts: int, topk: int, *,
                       kernel: str = MOE_KERNELS) -> dict[str, int]:
    """Bytes GPTQ / AWQ Marlin MoE (TGI's ``GPTQMarlinSparseMoELayer``, compute capability 8.0+, float16
    activations: layers/moe/gptq_marlin.py v3.0.1:109-136, v3.1.0:113-140 → moe-kernels' ``fused_marlin_moe``; v3.3.7:
    119-148, 243-352 → the hub's ``fused_topk`` and ``fused_marlin_moe``) holds over its input per moment, all M
    tokens in one pass; the output is a new [M, hidden] tensor. After :func:`routing_moments`, with the router
    logits, ``topk_weights`` and ``topk_ids`` alive (moe_kernels/_fused_marlin_moe.py v0.7.0 = v0.8.2:145-338;
    vllm_moe/fused_marlin_moe.py :141-330, the same buffers):

    - ``sorted_token_ids`` (:func:`moe_align_ints` with the Marlin block rule; the other two outputs are dropped)
      and the int32 ``workspace`` [max(2·I, hidden) // 64 · 16] (:246-251 / :238-243);
    - ``intermediate_cache2`` [M·topk, I] (:284-288 / :276-280);
    - ``marlin_gemm_moe`` (csrc/moe/marlin_moe_ops.cu v0.7.0 = v0.8.2:512-516; vllm-moe
      marlin-moe/marlin_moe_ops.cu :511-515) allocates its output ``c`` [M, topk, N] and ``a_tmp`` — [M, K]
      for the w1 GEMM (``replicate_input``), [M, topk, K] for w2 — and ``expert_offsets`` [E + 1] int32:
      w1 → ``intermediate_cache1`` [M, topk, 2·I]; w2 → ``intermediate_cache3`` [M, topk, hidden] while cache 1
      is still bound;
    - ``torch.sum(intermediate_cache3, dim=1)``: the [M, hidden] output over the three caches."""
    k, h, i = topk, hidden, inter
    moments = routing_moments(m, experts, topk, kernel)
    base = moments["router"] + 2 * 4 * m * k + moe_align_ints(m, k, experts, marlin=True) \
        + 4 * (max(2 * i, h) // 64 * 16)
    offsets = 4 * (experts + 1)
    return moments | {
        "marlin_w1": base + 2 * m * k * i + 2 * m * k * 2 * i + 2 * m * h + offsets,
        "marlin_w2": base + 2 * m * k * (i + 2 * i + i + h) + offsets,
        "marlin_sum": base + 2 * m * k * (2 * i + i + h) + 2 * m * h,
    }
