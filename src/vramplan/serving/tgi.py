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
- Approximated: the warm-up peak (vramplan's forward at ``max_batch_prefill_tokens``, its allocated
  peak, where TGI's free-memory reading sees the caching allocator's reserve); the
  router's refusal when ``max_total_tokens`` exceeds the pool is paraphrased, not quoted.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramplan.engine.forward import forward
from vramplan.errors import WorkloadError
from vramplan.hardware.catalog import usable_capacity
from vramplan.hardware.gpu import GPU
from vramplan.models.spec import Family, ModelSpec
from vramplan.pools.base import cdiv, outside
from vramplan.pools.kvspec import bytes_per_token, layer_specs
from vramplan.pools.result import ServePlan
from vramplan.pools.tgi_release import NEWEST, TgiRelease
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
    flash = flash_llama_peak(spec, prefill, tp, marlin=on_marlin)
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
             + ("TGI's FlashLlamaForCausalLM tensors as its forward holds them" if flash is not None else fwd.method)
             + (" with Marlin's GEMM buffers" if marlin else "") + ").",
             "max_batch_prefill_tokens defaults to the launcher's compute-optimal prefill (card f16 FLOP/s ÷ "
             "model FLOP per token; 4096 on a card the launcher does not know) capped by max_position_embeddings "
             "and the launcher's VRAM estimate; unset max_total_tokens is TGI 3's zero config: "
             "min(KV tokens, max_position_embeddings)."]
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


def uses_marlin_temporaries(spec: ModelSpec, gpu: GPU, rel: TgiRelease, quant: str) -> bool:
    """Whether the warm-up's GEMMs carry Marlin's per-call buffers (:func:`marlin_temporaries`): an AWQ / GPTQ
    dense model on compute capability 8.0+ under TGI 3.0.0 … 3.1.0 (the releases whose kernel was read)."""
    major = int((gpu.compute_capability or "0").split(".")[0])
    return quant in ("awq", "gptq") and not spec.is_moe and major >= 8 and not rel.since("3.1.1")


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


# model_type values TGI serves with FlashLlamaForCausalLM (models/__init__.py v3.0.1:882-890, v3.3.7:993, 1044)
FLASH_LLAMA_TYPES = ("llama", "phi3", "granite", "baichuan")


def marlin_reduce_rows(tokens: int) -> int:
    """marlin-kernels' ``determine_reduce_max_m(M, max_par=16)``: M rounded up to 16 up to 64 rows, else
    64 × min(⌈M / 64⌉, 16)."""
    return cdiv(tokens, 16) * 16 if tokens <= 64 else 64 * min(cdiv(tokens, 64), 16)


def flash_llama_peak(spec: ModelSpec, tokens: int, tp: int, *, marlin: bool) -> int | None:
    """The warm-up prefill's allocated peak as TGI's FlashLlamaForCausalLM holds its tensors (every 3.x tag,
    models/custom_modeling/flash_llama_modeling.py v3.0.1), in units of M × 2 bytes (16-bit activations):

    - held through every later layer: ``inputs_embeds`` (kept by the two outer ``forward`` frames, :687-688,
      :601) and the loop's ``hidden_states`` / ``residual`` (:610-624); in the layer (:474-496) the locals
      ``normed_hidden_states``, ``res``, ``attn_output``, ``normed_attn_res_output``, ``attn_res`` — the
      CUDA ``FastRMSNorm`` returns a new normed tensor and a new residual sum (layers/layernorm.py v3.0.1:140-166,
      hidden ≤ 8192): 8 × hidden during the MLP, 5 × hidden during the attention;
    - the MLP (:379-404) keeps the fused ``gate_up_states`` [M, 2·I/tp] alive through ``down_proj``, whose
      input is ``act(gate) * up`` [M, I/tp] (the ``act`` result is a temporary of the product);
    - the attention: the fused qkv [M, (H + 2·KV)/tp · d], the attention output [M, H/tp · d], o_proj's [M, h];
    - Marlin's ``a_tmp`` / ``c_tmp`` at each GEMM when ``marlin`` (:func:`marlin_temporaries`).

    The peak is the largest of the GEMM moments and the activation's; the last position's logits and the
    small sampling tensors are left out. ``None`` where this layout is not TGI's (another model class, an MoE,
    hidden > 8192: the in-place RMSNorm path) — the caller falls back to vramplan's forward."""
    if spec.model_type not in FLASH_LLAMA_TYPES or spec.is_moe or spec.hidden > 8192 or not spec.intermediate:
        return None
    m, h, d = tokens, spec.hidden, spec.head_dim
    i, q, kv = spec.intermediate // tp, spec.heads // tp * d, max(1, spec.kv_heads // tp) * d
    rows = marlin_reduce_rows(m)

    def temps(k: int, n: int) -> int:
        return (m * k * 2 + rows * n * 4) if marlin else 0

    mlp_held, attn_held = 8 * h, 5 * h
    moments = (
        2 * m * (attn_held + (q + 2 * kv)) + temps(h, q + 2 * kv),        # qkv GEMM
        2 * m * (attn_held + (q + 2 * kv) + q + h) + temps(q, h),          # o_proj GEMM
        2 * m * (mlp_held + 2 * i) + temps(h, 2 * i),                      # gate_up GEMM
        2 * m * (mlp_held + 2 * i + 2 * i),                                 # act(gate) * up
        2 * m * (mlp_held + 2 * i + i + h) + temps(i, h),                  # down_proj GEMM
    )
    return max(moments)


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
