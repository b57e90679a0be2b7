"""Text Generation Inference start-up sizing, per 3.x release from 3.0.0 to 3.3.7
(``server/text_generation_server/models/flash_causal_lm.py`` ``FlashCausalLM.warmup``;
:class:`vramplan.pools.tgi_release.TgiRelease`).

- The warm-up runs one prefill batch of ``max_batch_prefill_tokens`` tokens (its KV blocks
  are allocated first); the caching allocator keeps that peak reserved, so the free memory
  measured afterwards already excludes it. An OOM there is TGI's "Not enough memory to
  handle N prefill tokens. You need to decrease `--max-batch-prefill-tokens`".
- ``free_memory = get_free_memory(device, MEMORY_FRACTION)`` = CUDA free − (1 −
  ``--cuda-memory-fraction`` × ``TGI_WIGGLE_ROOM``) × total
  (``server/text_generation_server/utils/import_utils.py``);
  ``num_blocks = int(free_memory // total_cache_size) + batch_num_blocks`` with
  ``TGI_WIGGLE_ROOM`` 0.95 (3.0), 0.93 (3.1, 3.2), 0.90 (from 3.3.0) and ``total_cache_size = layers × BLOCK_SIZE × kv_heads ×
  head_size × 2 × dtype_size``; logged as "KV-cache blocks: N, size: BLOCK_SIZE", and the
  router's "Setting max batch total tokens to N".
- ``BLOCK_SIZE`` is 1 with the flashinfer attention TGI 3 uses by default (prefix caching),
  16 with paged attention, 256 with flashdecoding (``models/globals.py``).
- KV heads on a rank: ``num_kv_heads // world_size``, or *all* of them when that is 0.
- Unset limits are TGI 3's: ``max_batch_prefill_tokens`` the launcher's compute-optimal budget
  (:func:`default_prefill`), ``max_total_tokens`` zero config — min(KV tokens, positions) from the
  warm-up (``flash_causal_lm.py`` v3.0.1:1595-1606), printed as "Maximum total tokens defaulted to".
  Several shards: the router takes the smallest shard's answer; vramplan plans one rank.
- AWQ / GPTQ on Marlin (compute capability 8.0+), 3.0.0 … 3.1.0: the warm-up peak adds Marlin's
  per-GEMM buffers (:func:`marlin_temporaries`).
- The warm-up peak at ``max_batch_prefill_tokens``: the tensors TGI's own model class holds
  (:func:`warmup_peak`: FlashLlama's model types, Qwen2, Mistral, Gemma 2, per release; Mixtral with its
  fused-MoE buffers per kernel generation, :mod:`vramplan.serving.tgi_moe`: unquantized and AWQ / GPTQ Marlin
  MoE at every release, fp8 from 3.1.0); vramplan's generic forward for the others (other MoE models, Gemma,
  Phi, …). Approximated: it is the allocated peak, where TGI's free-memory reading sees
  the caching allocator's reserve; the
  router's refusal when ``max_total_tokens`` exceeds the pool is paraphrased, not quoted.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramplan.engine.forward import forward
from vramplan.errors import WorkloadError
from vramplan.hardware.catalog import usable_capacity
from vramplan.hardware.gpu import GPU
from vramplan.models.shape import model_shape
from vramplan.models.spec import Family, ModelSpec
from vramplan.pools.base import cdiv, outside
from vramplan.pools.kvspec import bytes_per_token, layer_specs
from vramplan.pools.result import ServePlan
from vramplan.pools.tgi_release import NEWEST, TgiRelease
from vramplan.serving.tgi_moe import FUSED_MOE_CHUNK as FUSED_MOE_CHUNK
from vramplan.serving.tgi_moe import (
    HUB,
    HUB_FROM,
    MOE_KERNELS,
    fused_moe_moments,
    marlin_moe_moments,
)
from vramplan.serving.tgi_moe import moe_align_ints as moe_align_ints
from vramplan.units import GiB

VERSION = NEWEST
BLOCK_SIZES = {"flashinfer": 1, "paged": 16, "flashdecoding": 256}
# FlashCausalLM.__init__ with ATTENTION == "flashinfer" builds its prefill / decode states on one shared
# workspace, torch.empty(128 MiB, uint8), kept for the process (layers/attention/flashinfer.py get_workspace,
# v3.0.0:23-28, v3.3.7:38-43; models/flash_causal_lm.py v3.0.1:1337-1352): allocated before the warm-up.
FLASHINFER_WORKSPACE = 128 * 2**20
# AWQ / GPTQ checkpoints run on Marlin from compute capability 8.0 (utils/quantization.py v3.0.1:125-143,
# layers/marlin/gptq.py v3.0.1:35-48). TGI 3.0.0 … 3.1.0 call marlin-kernels 0.3.6 / 0.3.7 (server/pyproject.toml),
# whose gptq_marlin_gemm allocates per call, besides its output, a_tmp [M, K] in the activation dtype and an fp32
# reduce buffer c_tmp [determine_reduce_max_m(M), N] (TGI passes use_fp32_reduce=True, layers/marlin/gptq.py
# v3.0.1:409-423; marlin-kernels v0.3.6 csrc/quantization/gptq_marlin/gptq_marlin.cu:1912-1931, 2307-2319,
# max_par 16 at :28). 3.1.1+ load kernels-community/quantization instead (not read): not counted there.
MARLIN_TEMPS_UNTIL = "3.1.0"


@dataclass(frozen=True, kw_only=True)
class TgiSettings:
    cuda_memory_fraction: float = 1.0
    max_total_tokens: int | None = None
    max_batch_prefill_tokens: int | None = None
    max_concurrent_requests: int = 128
    kv_cache_dtype: str = "auto"
    attention: str = "flashinfer"
    engine_version: str = NEWEST


def plan(spec: ModelSpec, gpu: GPU, *, tp: int = 1, pp: int = 1, quant: str = "none", dtype: str = "bf16",
         settings: TgiSettings = TgiSettings(), avg_request_len: int | None = None,
         method: str = "analytic") -> ServePlan:
    s = settings
    rel = TgiRelease.of(s.engine_version)
    wiggle = rel.wiggle_room
    total, _ = usable_capacity(gpu)
    block = BLOCK_SIZES.get(s.attention, 1)
    zero_config = s.max_total_tokens is None
    prefill = s.max_batch_prefill_tokens or default_prefill(spec, gpu, rel, tp, quant, s.cuda_memory_fraction)
    if spec.family is Family.MLA:
        raise WorkloadError(f"vramplan does not model TGI's KV layout for the MLA model {spec.name}",
                            hint="use --engine vllm, sglang or trtllm, which cache MLA's compressed latent")
    layers = layer_specs(spec, tp=tp, pp=pp, kv_cache_dtype=s.kv_cache_dtype, engine="tgi", sliding=False)
    per_token = bytes_per_token(layers)
    block_bytes = per_token * block
    out = outside(gpu, tp * pp)
    fwd = forward(spec, tokens=prefill, tp=tp, pp=pp, quant=quant, dtype=dtype, method=method)
    on_marlin = uses_marlin_temporaries(spec, gpu, rel, quant)
    marlin = marlin_temporaries(spec, prefill, tp) if on_marlin else 0
    # AWQ / GPTQ experts below compute capability 8.0 take DenseMoELayer (layers/moe/__init__.py v3.3.7:268-285,
    # gptq_marlin.py :29-43 ``has_sm_8_0``; flash_mixtral_modeling.py v3.3.7:363-365): not read, generic forward
    sparse = not (spec.is_moe and quant in ("awq", "gptq") and _major(gpu) < 8)
    layout = warmup_layout(spec, rel, quant) if sparse else None
    flash = warmup_peak(spec, prefill, tp, rel, marlin=on_marlin, max_total=s.max_total_tokens, quant=quant) \
        if sparse else None
    peak = flash if flash is not None else fwd.activation_peak + marlin
    batch_blocks = warmup_blocks(prefill, s.max_total_tokens, block)
    workspace = FLASHINFER_WORKSPACE if s.attention == "flashinfer" else 0
    cuda_free = total - out.context - out.later - fwd.weights - workspace - peak - batch_blocks * block_bytes
    free = max(0, int(cuda_free - (1 - s.cuda_memory_fraction * wiggle) * total))
    error = None
    if cuda_free - (1 - s.cuda_memory_fraction) * total < 0:
        error = (f"Not enough memory to handle {prefill} prefill tokens. You need to decrease "
                 "`--max-batch-prefill-tokens`")
    blocks = int(free // block_bytes) + batch_blocks if error is None else 0
    tokens = blocks * block
    # zero config: with prefill chunking (flashinfer / flashdecoding) the warm-up answers
    # min(blocks × BLOCK_SIZE, model_max_length, max_position_embeddings); without it (paged) the warm-up
    # batch's cache lengths, approximated by its prefill tokens (flash_causal_lm.py v3.0.1:1595-1606)
    chunking = s.attention != "paged"
    max_total = s.max_total_tokens or (min(tokens if chunking else prefill, spec.max_positions)
                                       if error is None else spec.max_positions)
    if error is None and tokens < max_total:
        error = (f"max batch total tokens ({tokens}) is smaller than `--max-total-tokens` ({max_total}) "
                 "(TGI's router refuses this; wording paraphrased)")
    conc = tokens / max_total if max_total else 0.0
    conc_avg = min(float(s.max_concurrent_requests), tokens / avg_request_len) if avg_request_len else None
    log = [f"KV-cache blocks: {blocks}, size: {block}", f"Setting max batch total tokens to {tokens}"] \
        if error is None else [f"Error: {error}"]
    if error is None and zero_config:
        log += [f"Maximum input tokens defaulted to {max_total - 1}", f"Maximum total tokens defaulted to {max_total}"]
    st = {"cuda_memory_fraction": s.cuda_memory_fraction, "tgi_wiggle_room": wiggle, "max_total_tokens": max_total,
          "max_batch_prefill_tokens": prefill, "max_concurrent_requests": s.max_concurrent_requests,
          "kv_cache_dtype": s.kv_cache_dtype, "attention": s.attention, "quantization": quant, "dtype": dtype}
    notes = [f"Follows TGI {rel.text} FlashCausalLM.warmup: the free memory after a warm-up prefill of "
             f"{prefill:,} tokens less (1 − cuda_memory_fraction × TGI_WIGGLE_ROOM {wiggle}) of the total becomes "
             f"KV blocks (warm-up peak {peak / GiB:.2f} GiB, "
             + (f"TGI's {layout.model_class} tensors as its forward holds them" if layout is not None else fwd.method)
             + (" with Marlin's GEMM buffers" if marlin else "") + ").",
             "max_batch_prefill_tokens defaults to the launcher's compute-optimal prefill (card f16 FLOP/s ÷ "
             "model FLOP per token; 4096 on a card the launcher does not know) capped by max_position_embeddings "
             "and the launcher's VRAM estimate; unset max_total_tokens is TGI 3's zero config: "
             "min(KV tokens, max_position_embeddings)."]
    if layout is None and spec.is_moe:
        notes.append(moe_buffers_note(spec, prefill, tp, rel, quant, s.max_total_tokens))
    return ServePlan(
        engine="tgi", engine_version=rel.text, model=spec.name, gpu=gpu.key, tp=tp, pp=pp, settings=st,
        total_memory=total, budget=int(total * s.cuda_memory_fraction), weights=fwd.weights,
        profile_peak=peak, non_torch=out.later, context=out.context, cuda_graph=0,
        cuda_graph_in_budget=True, kv_available=free + batch_blocks * block_bytes,
        kv_pool=blocks * block_bytes, block_size=block, blocks=blocks, tokens=tokens,
        bytes_per_token=per_token, max_model_len=max_total, max_concurrency=conc, avg_request_len=avg_request_len,
        concurrency_at_avg=conc_avg, max_running=s.max_concurrent_requests, starts=error is None, error=error,
        device_used=out.context + out.later + fwd.weights + workspace + peak + blocks * block_bytes,
        runner_buffers=workspace,
        log=tuple(log), command=command(spec, tp, quant, st), profile_method=fwd.method, notes=tuple(notes),
        layer_kinds={layers[0].kind: len(layers)},
    )


def moe_buffers_note(spec: ModelSpec, prefill: int, tp: int, rel: TgiRelease, quant: str,
                     max_total: int | None) -> str:
    """What the warm-up peak of an MoE model leaves out where TGI's model class or fused-MoE kernel for it was not
    read at ``rel`` (MoE models other than Mixtral; fp8 Mixtral on 3.0.x; AWQ / GPTQ Mixtral below compute
    capability 8.0, which runs DenseMoELayer): the MoE's per-call buffers, so the KV pool may be overstated."""
    return ("The fused-MoE kernel's per-call buffers (routing, sorted token ids, the expert GEMMs' caches) are not "
            f"in this warm-up peak: TGI {rel.text}'s MoE layer for {spec.name}"
            + (f" with {quant} weights" if quant != "none" else "")
            + " was not read, so the KV pool may be overstated.")


def _major(gpu: GPU) -> int:
    return int((gpu.compute_capability or "0").split(".")[0])


def uses_marlin_temporaries(spec: ModelSpec, gpu: GPU, rel: TgiRelease, quant: str) -> bool:
    """Whether the warm-up's dense GEMMs carry Marlin's per-call buffers (:func:`marlin_temporaries`): an AWQ /
    GPTQ model on compute capability 8.0+ under TGI 3.0.0 … 3.1.0 (the releases whose kernel was read) — dense, or
    Mixtral's attention (its experts run Marlin MoE, :func:`vramplan.serving.tgi_moe.marlin_moe_moments`)."""
    moe_ok = not spec.is_moe or warmup_layout(spec, rel, quant) is not None
    return quant in ("awq", "gptq") and moe_ok and _major(gpu) >= 8 and not rel.since(HUB_FROM)


def marlin_temporaries(spec: ModelSpec, tokens: int, tp: int) -> int:
    """The largest per-call buffers of marlin-kernels' ``gptq_marlin_gemm`` over one rank's linear layers at
    ``tokens`` rows: ``a_tmp`` [M, K] fp16 (AWQ runs in float16) + ``c_tmp`` [reduce_m, N] fp32, with reduce_m
    = ``determine_reduce_max_m`` (M rounded up to 16 up to 64 rows, else 64 × min(⌈M / 64⌉, 16)). Added to
    the 16-bit forward's peak: an upper bound, as the GEMM may not fall on that peak's moment."""
    hd, kv = spec.head_dim, max(1, spec.kv_heads // tp)
    shapes = ((spec.hidden, (spec.heads // tp + 2 * kv) * hd), (spec.heads // tp * hd, spec.hidden),
              (spec.hidden, 2 * spec.intermediate // tp), (spec.intermediate // tp, spec.hidden))
    reduce_m = marlin_reduce_rows(tokens)
    return max(tokens * k * 2 + reduce_m * n * 4 for k, n in shapes)


def marlin_reduce_rows(tokens: int) -> int:
    """marlin-kernels' ``determine_reduce_max_m(M, max_par=16)``: M rounded up to 16 up to 64 rows, else
    64 × min(⌈M / 64⌉, 16)."""
    return cdiv(tokens, 16) * 16 if tokens <= 64 else 64 * min(cdiv(tokens, 64), 16)


# model_type values TGI serves with FlashLlamaForCausalLM (models/__init__.py v3.0.1:882-890, v3.3.7:993, 1044)
FLASH_LLAMA_TYPES = ("llama", "phi3", "granite", "baichuan")
# model_type values whose TGI model class was read for the warm-up peak (:func:`warmup_layout`): FlashLlama's,
# Qwen2ForCausalLM (flash_qwen2_modeling.py), FlashMistralForCausalLM, FlashGemma2ForCausalLM
# (models/__init__.py v3.0.1:939-943, 1069-1073, 1146-1150; v3.3.7:1106-1110, 1335-1339, 1439-1443)
WARMUP_TYPES = (*FLASH_LLAMA_TYPES, "qwen2", "mistral", "gemma2")
@dataclass(frozen=True)
class WarmupLayout:
    """What one of TGI's model classes keeps alive at its warm-up prefill, in hidden-sized [M, hidden] tensors
    (:func:`warmup_peak`): during the attention, during the MLP; whether the attention copies the new K/V for
    the sliding window (``kv_to_cache = kv[prefill_cache_indices]``); whether the RMSNorm runs in fp32 on
    [M, hidden] temporaries (Gemma 2); whether the MLP is a fused MoE (Mixtral,
    :mod:`vramplan.serving.tgi_moe`) and which kernel generation runs it (``moe_kernel``: moe-kernels to 3.1.0,
    the kernel hub's ``kernels-community/moe`` from 3.1.1)."""

    model_class: str
    attn_held: int
    mlp_held: int
    kv_copy: bool = False
    fp32_norm: bool = False
    fused_moe: bool = False
    moe_kernel: str = ""


def warmup_layout(spec: ModelSpec, rel: TgiRelease, quant: str = "none") -> WarmupLayout | None:
    """The warm-up forward's layout of ``spec``'s TGI model class at ``rel`` (CUDA, every tag v3.0.0 … v3.3.7
    read where not said), or ``None`` where it was not read (other classes, other MoE models, Mixtral with other
    weights) or does not hold (hidden > 8192: ``FastRMSNorm`` adds in place, layers/layernorm.py
    v3.0.1:124-139).

    - FlashLlama (flash_llama_modeling.py v3.0.1:474-496, 601, 610-624, 687-688) and FlashMistral (the same
      layer, flash_mistral_modeling.py v3.0.1:370-394 = v3.3.7:370-394, loop :446-461, outer frame :523-536):
      ``inputs_embeds`` (kept by the two outer frames), the loop's ``hidden_states`` / ``residual``, the
      layer's ``normed_hidden_states``, ``res``, ``attn_output``, ``normed_attn_res_output``, ``attn_res`` —
      CUDA ``FastRMSNorm`` with a residual returns a new normed tensor and a new sum (``dropout_add_ln_fwd``,
      layers/layernorm.py v3.0.1:140-166, v3.3.7:161-187): 5 during the attention, 8 through the MLP.
    - Qwen2 to v3.1.0: the same layer (flash_qwen2_modeling.py v3.0.1:254-277, loop :334-348, :407-420).
      From v3.1.1 (#2943; v3.1.1:238-256, v3.3.7:288-310, loop :365-380): the norms take no residual, so
      ``residual`` is the input itself, and ``attn_output + residual`` / ``mlp_output + residual`` are explicit
      sums: ``inputs_embeds``, the loop's input, ``normed_hidden_states`` (3 during the attention), then
      ``attn_output``, the sum and its normed copy (6 through the MLP).
    - Gemma 2 (flash_gemma2_modeling.py v3.0.1:405-430, v3.3.7:406-430; its own RMSNorm :118-126 adds the
      residual in place and normalises an fp32 copy): ``inputs_embeds``, the loop's ``hidden_states`` /
      ``residual``, ``normed_hidden_states`` (4 during the attention), then ``attn_output``, the residual sum
      ``normed_attn_res_output`` and ``pre_normed`` (7 through the MLP); the post-feed-forward norm of
      ``mlp_output`` holds an fp32 [M, h] copy and its product (4 hidden-sized 16-bit units) over those 8.
    - The sliding-window copy (Mistral, Qwen2 attention: flash_mistral_modeling.py v3.0.1:208-211,
      flash_qwen2_modeling.py v3.0.1:143-146): ``FlashCausalLMBatch`` fills ``prefill_cache_indices`` for a
      model whose config has ``sliding_window`` (flash_causal_lm.py v3.0.1:1059-1063, 1160-1162, set at
      :1300-1303) until v3.2.0; from v3.2.1 it is always ``None`` (#3112; v3.3.7:1139). Gemma 2's attention
      takes no ``prefill_cache_indices``. Qwen2's config keeps its ``sliding_window`` with
      ``use_sliding_window: false`` in transformers 4.46.3 / 4.49 (TGI 3.0 / 3.2's pins,
      server/requirements_cuda.txt) — assumed from huggingface/transformers#36377 (Feb 2025), which reads it
      as a number there.
    - FlashMixtralForCausalLM (mixtral; models/__init__.py v3.0.1:1094-1098, v3.1.0:1219, v3.3.7:1373), the same
      file at v3.0.1, v3.1.0 and v3.3.7 but for one argument of the attention call: FlashMistral's layer
      (flash_mixtral_modeling.py v3.0.1:378-415) and attention (:230-295, the sliding-window copy :256-259,
      v3.3.7:257, to 3.2.0 as for Mistral), but ``MixtralModel`` embeds the ids itself and rebinds
      ``hidden_states`` in its loop (:463-485), so no frame keeps the embeddings past the first layer: the loop's
      ``hidden_states`` / ``residual``, ``normed_hidden_states``, ``res`` (4 during the attention), then
      ``attn_output``, ``normed_attn_res_output``, ``attn_res`` (7 through the MoE). ``MixtralMoE.forward``
      (v3.0.1:341-350, v3.3.7:342-351) keeps the router logits and calls ``SparseMoELayer`` (layers/moe/__init__.py
      v3.0.1:225-229, v3.3.7:221-243), whose moments per weight kind and kernel generation are
      :mod:`vramplan.serving.tgi_moe`'s over those 7: unquantized (``UnquantizedSparseMoELayer``, writes into
      ``normed_attn_res_output``: :func:`fused_moe_moments`), AWQ / GPTQ (``GPTQMarlinSparseMoELayer``, compute
      capability 8.0+ — the caller checks it: :func:`marlin_moe_moments`) and, from 3.1.0, ``--quantize fp8``
      (``FP8SparseMoELayer``, layers/moe/fp8.py v3.1.0 / v3.3.7:72-91, the fp8 w8a8 path; 3.0.x hands a
      ``HybridFP8UnquantLoader`` to ``UnquantizedSparseMoELayer``, layers/moe/__init__.py v3.0.1:225-229 — not
      read)."""
    if spec.is_moe:
        if (spec.model_type != "mixtral" or spec.hidden > 8192 or not spec.n_experts or not spec.experts_per_token):
            return None
        hub = rel.since(HUB_FROM)
        if quant not in ("none", "awq", "gptq") and not (quant == "fp8" and rel.since("3.1.0")):
            return None
        window = spec.config.get("sliding_window") is not None and not rel.since("3.2.1")
        return WarmupLayout("FlashMixtralForCausalLM", 4, 7, kv_copy=window, fused_moe=True,
                            moe_kernel=HUB if hub else MOE_KERNELS)
    if not spec.intermediate or spec.model_type not in WARMUP_TYPES:
        return None
    if spec.model_type == "gemma2":
        return WarmupLayout("FlashGemma2ForCausalLM", 4, 7, fp32_norm=True)
    if spec.hidden > 8192:
        return None
    window = spec.config.get("sliding_window") is not None and not rel.since("3.2.1")
    if spec.model_type == "qwen2":
        if rel.since("3.1.1"):
            return WarmupLayout("Qwen2ForCausalLM", 3, 6, kv_copy=window)
        return WarmupLayout("Qwen2ForCausalLM", 5, 8, kv_copy=window)
    if spec.model_type == "mistral":
        return WarmupLayout("FlashMistralForCausalLM", 5, 8, kv_copy=window)
    return WarmupLayout("FlashLlamaForCausalLM", 5, 8)


def warmup_requests(prefill: int, max_total: int | None) -> tuple[int, ...]:
    """The prompt lengths of the router's warm-up requests (:func:`warmup_blocks`): ``max_total_tokens − 1``
    each up to ``max_batch_prefill_tokens``, or one request of them all under zero config."""
    if max_total is None:
        return (prefill,)
    per_request = max(1, max_total - 1)
    full, rest = divmod(prefill, per_request)
    return (per_request,) * full + ((rest,) if rest else ())


def warmup_peak(spec: ModelSpec, tokens: int, tp: int, rel: TgiRelease, *, marlin: bool,
                max_total: int | None = None, quant: str = "none") -> int | None:
    """The warm-up prefill's allocated peak as TGI's model class holds its tensors: the largest of
    :func:`warmup_moments`; ``None`` where the layout is not known (:func:`warmup_layout`) — the caller falls
    back to vramplan's forward."""
    moments = warmup_moments(spec, tokens, tp, rel, marlin=marlin, max_total=max_total, quant=quant)
    return max(moments.values()) if moments else None


def warmup_moments(spec: ModelSpec, tokens: int, tp: int, rel: TgiRelease, *, marlin: bool,
                   max_total: int | None = None, quant: str = "none") -> dict[str, int]:
    """The bytes alive at each GEMM / activation moment of one layer of the warm-up prefill as TGI's model class
    holds its tensors (:func:`warmup_layout`), 16-bit activations, M = ``tokens`` rows:

    - the held hidden-sized tensors of the layout, during the attention and through the MLP;
    - the MLP (flash_llama_modeling.py v3.0.1:379-404, flash_qwen2_modeling.py v3.0.1:217-220 / v3.3.7:246-251,
      flash_mistral_modeling.py v3.0.1:326-330, flash_gemma2_modeling.py v3.0.1:347-352) keeps the fused
      ``gate_up_states`` [M, 2·I/tp] alive through ``down_proj``, whose input is ``act(gate) * up`` [M, I/tp]
      (the ``act`` result a temporary of the product);
    - the attention: the fused qkv [M, (H + 2·KV)/tp · d], the attention output [M, H/tp · d], o_proj's
      [M, h]; with the sliding-window copy, ``kv_to_cache`` [Σ min(prompt, window), 2·KV/tp · d] through
      the attention and o_proj (the attention's frame holds it);
    - Gemma 2: the post-feed-forward norm's moment (8 held + an fp32 [M, h] copy and product);
    - Mixtral (``fused_moe`` layout): the MoE's moments (:mod:`vramplan.serving.tgi_moe`, per weight kind and
      kernel generation) over the held tensors in place of the MLP's;
    - Marlin's ``a_tmp`` / ``c_tmp`` at each GEMM when ``marlin`` (:func:`marlin_temporaries`).

    Left out: the logits — the warm-up
    batch asks no prefill logprobs unless ``REQUEST_LOGPROBS`` (flash_causal_lm.py v3.0.1:296-299,
    v3.3.7:285), so ``lm_head_indices`` is each request's last position (v3.0.1:1165-1168, v3.3.7:1145) and
    the lm_head runs on a few rows after the layers' tensors are gone — and the small sampling tensors.
    Empty where the layout is not known."""
    lay = warmup_layout(spec, rel, quant)
    if lay is None:
        return {}
    m, h, d = tokens, spec.hidden, spec.head_dim
    i, q, kv = spec.intermediate // tp, spec.heads // tp * d, max(1, spec.kv_heads // tp) * d
    rows = marlin_reduce_rows(m)
    window = int(spec.config.get("sliding_window") or 0)
    copy = 2 * kv * sum(min(r, window) for r in warmup_requests(m, max_total)) if lay.kv_copy else 0

    def temps(k: int, n: int) -> int:
        return (m * k * 2 + rows * n * 4) if marlin else 0

    attn, mlp = lay.attn_held * h, lay.mlp_held * h
    moments = {
        "qkv": 2 * m * (attn + (q + 2 * kv)) + temps(h, q + 2 * kv),
        "o_proj": 2 * m * (attn + (q + 2 * kv) + q + h) + 2 * copy + temps(q, h),
    }
    if lay.fused_moe:
        shape = (m, h, model_shape(spec).moe_intermediate // tp, spec.n_experts, spec.experts_per_token)
        moe = marlin_moe_moments(*shape, kernel=lay.moe_kernel) if quant in ("awq", "gptq") else \
            fused_moe_moments(*shape, kernel=lay.moe_kernel, fp8=quant == "fp8")
        return moments | {name: 2 * m * mlp + b for name, b in moe.items()}
    moments |= {
        "gate_up": 2 * m * (mlp + 2 * i) + temps(h, 2 * i),
        "act": 2 * m * (mlp + 2 * i + 2 * i),
        "down_proj": 2 * m * (mlp + 2 * i + i + h) + temps(i, h),
    }
    if lay.fp32_norm:  # mlp_output, its fp32 copy and the normalised fp32 product
        moments["post_norm"] = 2 * m * (mlp + h + 4 * h)
    return moments


def warmup_blocks(prefill: int, max_total: int | None, block: int) -> int:
    """KV blocks of the router's warm-up batch (backends/v3/src/client/grpc_client.rs v3.0.1:109-155;
    flash_causal_lm.py v3.0.1:359-363): requests of ``truncate = min(max_input_tokens, what is left)``
    prompt tokens up to ``max_batch_prefill_tokens``, each with ``max_new_tokens = max_total_tokens −
    truncate`` (1 under zero config), each holding ⌈(prompt + max_new_tokens − 1) / BLOCK_SIZE⌉ blocks;
    ``max_input_tokens`` is ``max_total_tokens − 1`` as :func:`command` passes it."""
    if max_total is None:
        return cdiv(prefill, block)
    per_request = max(1, max_total - 1)
    full, rest = divmod(prefill, per_request)
    return (full + (1 if rest else 0)) * cdiv(max_total - 1, block)


def default_prefill(spec: ModelSpec, gpu: GPU, rel: TgiRelease, shards: int, quant: str, fraction: float) -> int:
    """The launcher's ``max_batch_prefill_tokens`` when unset (launcher/src/main.rs, v3.0.1:2030-2058,
    v3.3.7 the same with a VLM default; ``compute_optimal`` :32-50, ``Config::flop`` :254-281,
    ``vram_maximum`` :66-93, ``model_vram``/``token_vram`` :284-324): the card's f16 FLOP/s × shards ÷
    the model's FLOP per token (when over 100; else 4096), capped by max_position_embeddings and by
    (nvidia-smi total × shards × fraction × 0.95 − 2-byte weights) ÷ (KV + 3 × 1.5 × intermediate × 2 B)
    per token — the cap only for a card the launcher knows and a checkpoint with no quantization_config
    (AWQ / GPTQ here).
    TGI's own formulas, including its attention-weight term without the hidden size. An MoE model is
    approximate: the launcher reads ``num_local_experts`` (Mixtral's key) and ``num_experts_per_tok``
    from config.json and takes 1 expert otherwise; vramplan passes the model's own counts."""
    tflops = rel.card_tflops(gpu.key)
    ffn = spec.intermediate  # config.json intermediate_size, as the launcher reads it
    ffn_flop = ffn * ((spec.experts_per_token or 1) + spec.shared_experts if spec.is_moe else 1)
    attn = 2 * spec.heads * spec.head_dim * spec.hidden
    flop = (3 * attn + 2 * 2 * spec.kv_heads * spec.head_dim * spec.hidden + 2 * 3 * spec.hidden * ffn_flop) * spec.layers
    optimal = tflops * 10**12 * shards // flop if tflops and flop else 0
    value = min(optimal if optimal > 100 else 4096, spec.max_positions or optimal)
    # the cap is skipped for a checkpoint with a quantization_config: AWQ / GPTQ always; fp8 is taken as TGI's
    # on-the-fly `--quantize fp8` of a 16-bit checkpoint (an FP8 checkpoint would skip it too)
    if tflops and quant not in ("awq", "gptq"):
        total = int((gpu.smi_total or gpu.capacity) * shards * fraction * 0.95)
        experts = spec.n_experts if spec.is_moe else 1
        layer = 3 * ffn * experts * spec.hidden + (spec.heads + 2 * spec.kv_heads) * spec.head_dim \
            + spec.heads * spec.head_dim * spec.hidden
        model = (layer * spec.layers + 2 * spec.hidden * spec.vocab) * 2
        per_token = spec.kv_heads * 2 * spec.head_dim * 2 * spec.layers + (ffn + ffn // 2) * experts * 2 * 3
        if total > model:
            value = min(value, (total - model) // per_token)
    return value


def command(spec: ModelSpec, tp: int, quant: str, st: dict[str, object]) -> str:
    parts = ["text-generation-launcher --model-id", spec.hub_id or spec.name]
    if tp > 1:
        parts.append(f"--num-shard {tp}")
    parts += [f"--max-total-tokens {st['max_total_tokens']}",
              f"--max-input-tokens {int(str(st['max_total_tokens'])) - 1}",
              f"--max-batch-prefill-tokens {st['max_batch_prefill_tokens']}"]
    if st["cuda_memory_fraction"] != 1.0:
        parts.append(f"--cuda-memory-fraction {st['cuda_memory_fraction']}")
    if st["kv_cache_dtype"] != "auto":
        parts.append(f"--kv-cache-dtype {'fp8_e4m3fn' if st['kv_cache_dtype'] in ('fp8', 'fp8_e4m3') else st['kv_cache_dtype']}")
    if quant != "none":
        parts.append(f"--quantize {'bitsandbytes-nf4' if quant == 'bitsandbytes' else quant}")
    return " ".join(parts)
