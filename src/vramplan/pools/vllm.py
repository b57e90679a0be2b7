"""vLLM V1 start-up sizing, following vLLM **0.10.1.1** (files cited per rule).

1. ``Worker.init_device`` (``vllm/v1/worker/gpu_worker.py``): a memory snapshot after the
   CUDA context exists; ``requested_memory = total_memory × gpu_memory_utilization``; it
   refuses to start when free memory is below that ("Free memory on device … on startup is
   less than desired GPU memory utilization …").
2. ``Worker.determine_available_memory`` + ``memory_profiling`` (``vllm/utils/__init__.py``):
   ``available = requested_memory − (weights + torch_peak_increase + non_torch_increase)``.
   ``torch_peak_increase`` is the allocated peak of ``GPUModelRunner.profile_run`` above the
   weights: a dummy forward over ``max_num_batched_tokens`` tokens split into
   ``min(max_num_seqs, max_num_batched_tokens)`` requests, then ``_dummy_sampler_run`` on one
   logit row per request. ``non_torch_increase`` is what appeared outside PyTorch since the
   snapshot (NCCL, cuBLAS). The CUDA context is *not* in the budget; CUDA graphs are
   captured after the KV cache is allocated and are *not* counted either
   (``compile_or_warm_up_model``: "`memory_profiling` does not consider CUDAGraph memory size").
3. ``get_kv_cache_config`` (``vllm/v1/core/kv_cache_utils.py``): ``check_enough_kv_cache_memory``
   (errors quoted verbatim), then one group of all layers when every layer has the same
   spec (``num_blocks = available // page_size // num_layers``), or for hybrid models
   (sliding window + full) groups of ``min(layers per type)`` layers sharing
   ``group_size`` tensors (``num_blocks = available // page_size // group_size``); the
   logged token count is ``num_blocks // num_groups × block_size``;
   ``get_max_concurrency_for_kv_cache_config`` gives "Maximum concurrency".
4. Defaults (``vllm/engine/arg_utils.py`` ``_set_default_args_v1``, ``vllm serve``):
   ``max_num_batched_tokens`` 8192 and ``max_num_seqs`` 1024 on GPUs with ≥ 70 GiB that are
   not A100s, else 2048 and 256; ``block_size`` 16 (``vllm/platforms/cuda.py``);
   ``gpu_memory_utilization`` 0.9 (``vllm/config/cache.py``); CUDA-graph capture sizes
   ``[1, 2, 4] + range(8, min(2 × max_num_seqs, 512) + 1, 8)`` capped at
   ``max_num_batched_tokens`` (``vllm/config/scheduler.py``, ``VllmConfig._set_cudagraph_sizes``).

Approximated: the sampler's peak (native top-k/top-p path of
``vllm/v1/sample/ops/topk_topp_sampler.py``: 16-bit logits, an fp32 copy, sorted values,
int64 indices, two boolean masks, the softmax and the scattered result = dtype + 26 bytes
per logit); the CUDA-graph pool (the activations of one forward at the largest capture
size, which all graphs share — a lower bound: published logs report "Graph capturing
finished …, took 0.1–1 GiB", and vLLM ≥ 0.11 can count an estimate of it in the budget,
which 0.10.1.1 does not); ``non_torch_increase`` (vramplan's cuBLAS and NCCL items;
vLLM's custom all-reduce IPC buffers are not counted).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from vramplan.errors import WorkloadError
from vramplan.hardware.catalog import usable_capacity
from vramplan.hardware.gpu import GPU
from vramplan.models.spec import ModelSpec
from vramplan.units import GiB

from .base import Forward, cdiv, outside
from .kvspec import LayerKV, bytes_per_token, layer_specs
from .mm import LIMIT_DEFAULT, Encoder, MmSettings
from .result import ServePlan
from .spec import SpecSettings, draft_layers, drafter, runtime_logits

VERSION = "0.10.1.1"
SAMPLER_BYTES_PER_LOGIT = 26
"""Beyond the 16-bit logits: fp32 copy 4 + sorted 4 + int64 indices 8 + two bool masks 2 +
softmax 4 + scatter output 4 (``apply_top_k_top_p``); a vramplan trace of the same ops peaks
at 27.4 B per logit in all, the 16-bit logits included (tests/test_serving.py)."""


@dataclass(frozen=True, kw_only=True)
class VllmSettings:
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] = ()
    enable_prefix_caching: bool = True
    disable_hybrid_kv_cache_manager: bool = False
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_extra_vocab_size: int = 256
    fully_sharded_loras: bool = False
    enable_lora_bias: bool = False
    mm: MmSettings = MmSettings()
    """Multimodal settings (a vision-language model's ``limit_mm_per_prompt``,
    ``mm_processor_kwargs``, ``skip_mm_profiling``: :mod:`.mm`)."""
    spec: SpecSettings = SpecSettings()
    """Speculative decoding (``speculative_config``: :mod:`.spec`)."""


LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
"""vllm/config/__init__.py ``LoRAConfig.__post_init__``: the ranks ``max_lora_rank`` may take."""
LORA_EMBEDDING_TYPES = frozenset({"llama", "mistral", "phi3"})
"""Model types whose vLLM class declares ``embedding_modules`` (``LlamaForCausalLM`` and its
subclasses, vllm/model_executor/models/llama.py): ``embed_tokens`` and ``lm_head`` get LoRA
wrappers too; Qwen2/Qwen3/Gemma declare none (their linears only)."""


def _pad(n: int, to: int) -> int:
    return -(-n // to) * to


def lora_bytes(spec: ModelSpec, tp: int, s: VllmSettings, dtype_bytes: int, tokens: int, seqs: int,
               stage_layers: int | None = None, pp: int = 1) -> tuple[int, int, list[str]]:
    """(bytes vLLM 0.10.1.1 allocates for ``--enable-lora`` inside "Model loading took", the
    profile run's extra peak, notes). ``create_lora_weights`` of each wrapper
    (vllm/lora/layers.py): per decoder layer, ``lora_a_stacked`` ``(L, 1, R, in)`` per slice
    (replicated under TP; ``fully_sharded_loras``: R/tp) and ``lora_b_stacked`` ``(L, 1, out, R)``
    per slice (column-parallel: out/tp); row-parallel ``o_proj``/``down_proj`` shard ``lora_a``'s
    input and keep ``lora_b`` whole (fully sharded: h/tp). Llama-family models also wrap the
    embedding (``embeddings_tensors`` ``(L, E, h)``, ``lora_a`` ``(L, V + E, R)``, ``lora_b``
    ``(L, 1, h, R)``) and the logits (``(L, 1, R, h)``, ``(L, 1, pad256(V + E), R)``, ``(L, E, h)``),
    and grow the embedding by L·E rows and the head to pad256(V + E) rows (llama.py). The Punica
    wrapper's index tensors: ~48 B per batched token + 32 B per sequence (punica_base.py,
    punica_gpu.py). All of it is created in ``GPUModelRunner.load_model``'s memory profile
    (``load_lora_model``), so it is part of the weights line. The profile run's dummy adapters
    live in pinned host memory (``create_dummy_lora``); each wrapped linear's fp32 shrink buffer
    ``(slices, tokens, R)`` is the peak's only addition."""
    if not s.enable_lora:
        return 0, 0, []
    if spec.is_moe or spec.kv_lora_rank:
        raise WorkloadError("multi-LoRA on MoE or MLA models is not modelled (vLLM 0.10.1.1 wraps no expert or "
                            "MLA projection with LoRA)", hint="drop `enable_lora`", field="enable_lora")
    L, R, E, h = s.max_loras, s.max_lora_rank, s.lora_extra_vocab_size, spec.hidden
    a_div = tp if s.fully_sharded_loras else 1
    q, kv, inter = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim, spec.intermediate
    gated = spec.mlp_kind == "gated"
    col_in = [h] * 3 + [h] * (2 if gated else 1)  # qkv slices, gate/up slices
    col_out = [q, kv, kv] + [inter] * (2 if gated else 1)
    per_layer = sum(L * R // a_div * i for i in col_in) + sum(L * o // tp * R for o in col_out)
    for rin in (q, inter):  # o_proj, down_proj (row parallel)
        per_layer += L * R * (rin // tp) + L * (h // a_div) * R
    if s.enable_lora_bias:
        per_layer += sum(L * o // tp for o in col_out) + 2 * L * (h // a_div)
    n_layers = stage_layers if stage_layers is not None else spec.layers
    total = per_layer * n_layers * dtype_bytes
    notes = [f"--enable-lora: {L} GPU slots of rank {R} for every wrapped linear of the stage's {n_layers} layers "
             f"({total / GiB:.2f} GiB), created in load_model's memory profile "
             "(part of 'Model loading took'); vllm/lora/layers.py create_lora_weights."]
    if spec.model_type in LORA_EMBEDDING_TYPES and spec.vocab:
        v = spec.vocab
        emb = L * E * h * dtype_bytes + (L * (v + E) * R + L * h * R) * dtype_bytes
        emb += (_pad(v + L * E, 64) - _pad(v, 64)) * h * dtype_bytes // tp
        logits = (L * R * h + L * _pad(v + E, 256) * R) * dtype_bytes + L * E * h * dtype_bytes
        logits += (_pad(v + E, 256) - _pad(v, 64)) * h * dtype_bytes // tp
        if pp > 1:  # the first stage holds the embedding, the last the head: the plan sizes the first
            logits = 0
        total += emb + logits
        where = "embedding (the head's wrapper is on the last stage)" if pp > 1 else "embedding and the LM head"
        notes.append(f"The {where} get LoRA wrappers ({spec.model_type}'s embedding_modules): "
                     f"{(emb + logits) / GiB:.3f} GiB with {E} extra vocabulary rows per adapter.")
    total += 48 * tokens + 32 * seqs
    cpu = s.max_cpu_loras or L
    notes.append(f"max_cpu_loras={cpu}: adapters cached in pinned host RAM, not on the GPU; the profile run's "
                 f"{L} dummy adapters (rank 8) are host tensors copied into the GPU slots.")
    slices = 3
    return total, slices * tokens * (R // a_div) * 4, notes


def big_gpu(gpu: GPU, total: int) -> bool:
    """vLLM's "H100-class" test: ≥ 70 GiB and not an A100."""
    return total >= 70 * GiB and "a100" not in gpu.key


def capture_sizes(max_num_seqs: int, max_num_batched_tokens: int, given: tuple[int, ...] = ()) -> list[int]:
    if len(given) > 1:
        sizes = sorted(given)
    else:
        top = given[0] if given else min(max_num_seqs * 2, 512)
        sizes = [1, 2, 4] + list(range(8, top + 1, 8))
    return [s for s in sizes if s <= max_num_batched_tokens]


def max_memory_usage(layer: LayerKV, max_model_len: int, block_size: int, max_num_batched_tokens: int) -> int:
    """``KVCacheSpec.max_memory_usage_bytes``: the blocks one request of max_model_len needs."""
    page = layer.page_bytes(block_size)
    if layer.kind == "sliding" and layer.window:
        tokens = min(layer.window - 1 + max_num_batched_tokens, max_model_len)
        return (cdiv(tokens, block_size) + 1) * page
    return cdiv(max_model_len, block_size) * page


def needed_memory(layers: tuple[LayerKV, ...], max_model_len: int, block_size: int, mnbt: int) -> int:
    return sum(max_memory_usage(x, max_model_len, block_size, mnbt) for x in layers)


def estimate_max_model_len(layers: tuple[LayerKV, ...], available: int, current_max: int, block_size: int,
                           mnbt: int) -> int:
    """``estimate_max_model_len``: binary search over 1..max_model_len (0 if 1 does not fit)."""
    if needed_memory(layers, 1, block_size, mnbt) > available:
        return 0
    lo, hi, best = 1, current_max, 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if needed_memory(layers, mid, block_size, mnbt) <= available:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def check_enough(layers: tuple[LayerKV, ...], available: int, max_model_len: int, block_size: int,
                 mnbt: int) -> str | None:
    """``check_enough_kv_cache_memory``: None, or vLLM's ValueError text."""
    if available <= 0:
        return ("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
                "when initializing the engine.")
    needed = needed_memory(layers, max_model_len, block_size, mnbt)
    if needed <= available:
        return None
    est = estimate_max_model_len(layers, available, max_model_len, block_size, mnbt)
    est_msg = f"Based on the available memory, the estimated maximum model length is {est}." if est > 0 else ""
    return (f"To serve at least one request with the models's max seq len ({max_model_len}), "
            f"({needed / GiB:.2f} GiB KV cache is needed, which is larger than the available KV cache "
            f"memory ({available / GiB:.2f} GiB). {est_msg} Try increasing `gpu_memory_utilization` or "
            f"decreasing `max_model_len` when initializing the engine.")


@dataclass(frozen=True)
class KVConfig:
    num_blocks: int
    groups: tuple[tuple[LayerKV, int], ...]
    """(layer spec, layers in the group) per KV-cache group."""
    tokens: int
    pool_bytes: int


def kv_cache_config(layers: tuple[LayerKV, ...], available: int, block_size: int) -> KVConfig:
    """``_get_kv_cache_config_uniform_type`` / ``_get_kv_cache_config_uniform_page_size``."""
    by_type: dict[LayerKV, int] = {}
    for x in layers:
        by_type[x] = by_type.get(x, 0) + 1
    pages = {x.page_bytes(block_size) for x in by_type}
    if len(pages) != 1:
        raise WorkloadError("layers with different KV page sizes are not supported by vLLM 0.10's KV-cache manager")
    page = pages.pop()
    if len(by_type) == 1:
        (spec, n), = by_type.items()
        blocks = max(0, available // page // n)
        return KVConfig(blocks, ((spec, n),), blocks * block_size, page * blocks * n)
    group_size = min(by_type.values())
    groups: list[tuple[LayerKV, int]] = []
    for spec, n in by_type.items():
        for start in range(0, n, group_size):
            groups.append((spec, min(group_size, n - start)))
    blocks = max(0, available // page // group_size)
    return KVConfig(blocks, tuple(groups), blocks // len(groups) * block_size, page * blocks * group_size)


def max_concurrency(cfg: KVConfig, max_model_len: int, block_size: int, mnbt: int) -> float:
    """``get_max_concurrency_for_kv_cache_config``."""
    per_group = max(n for _, n in cfg.groups)
    per_request = per_group * sum(max_memory_usage(s, max_model_len, block_size, mnbt) for s, _ in cfg.groups)
    per_block = cfg.groups[0][0].page_bytes(block_size) * per_group
    return cfg.num_blocks / cdiv(per_request, per_block)


def profile_tokens(gpu: GPU, s: VllmSettings) -> int:
    """``max_num_batched_tokens``: the tokens of the profile run's forward."""
    return s.max_num_batched_tokens or (8192 if big_gpu(gpu, usable_capacity(gpu)[0]) else 2048)


def default_max_num_seqs(gpu: GPU) -> int:
    """``max_num_seqs`` by default: 1024 on the big GPUs (:func:`big_gpu`), else 256."""
    return 1024 if big_gpu(gpu, usable_capacity(gpu)[0]) else 256


def plan(spec: ModelSpec, gpu: GPU, fwd: Forward, *, tp: int = 1, pp: int = 1, quant: str = "none",
         dtype: str = "bf16", settings: VllmSettings = VllmSettings(), avg_request_len: int | None = None,
         encoder: Encoder | None = None) -> ServePlan:
    """vLLM's start-up sizing on ``gpu``, given ``fwd``: the weights and the peak of a forward over
    :func:`profile_tokens` tokens on one rank (:func:`vramplan.engine.forward.forward`); for a
    vision-language model ``spec`` is its language model and ``encoder`` its vision tower
    (:mod:`vramplan.engine.encoder`)."""
    s = settings
    total, _ = usable_capacity(gpu)
    mnbt = profile_tokens(gpu, s)
    max_num_seqs = s.max_num_seqs or default_max_num_seqs(gpu)
    max_model_len = s.max_model_len or spec.max_positions
    layers = layer_specs(spec, tp=tp, pp=pp, kv_cache_dtype=s.kv_cache_dtype, engine="vllm",
                         sliding=not s.disable_hybrid_kv_cache_manager)
    if s.disable_hybrid_kv_cache_manager:
        layers = tuple(LayerKV("full", x.kv_heads, x.head_size, x.dtype_bytes) if x.kind == "sliding" else x
                       for x in layers)
    world = tp * pp
    out = outside(gpu, world)
    requested = int(total * s.gpu_memory_utilization)
    num_reqs = min(max_num_seqs, mnbt)
    compute = 2
    lora, lora_peak, lora_notes = lora_bytes(spec, tp, s, compute, mnbt, max_num_seqs,
                                             stage_layers=len(layers) if pp > 1 else None, pp=pp)
    vision = encoder.weights if encoder is not None else 0
    draft = drafter(spec, s.spec, tp=tp, weight_bytes=_weight_bytes(fwd, spec, tp, pp), compute_bytes=compute,
                    max_num_batched_tokens=mnbt, max_num_seqs=max_num_seqs)
    layers = draft_layers(layers, draft)
    weights = fwd.weights + lora + vision + (draft.weights if draft is not None else 0)
    sampler = num_reqs * spec.vocab * (compute + SAMPLER_BYTES_PER_LOGIT) if spec.vocab else 0
    peak = lm_phase = max(fwd.activation_peak + lora_peak, sampler)
    prof = encoder.profile if encoder is not None else None
    held = 0
    if encoder is not None and prof is not None:  # profile_run: the encode, then the LM with the outputs held
        held = encoder.outputs + prof.pixel_bytes
        peak = max(encoder.peak, held + lm_phase)
    non_kv = weights + peak + out.later
    available = requested - non_kv
    sizes = [] if s.enforce_eager else capture_sizes(max_num_seqs, mnbt, s.cuda_graph_sizes)
    graphs = fwd.activation_peak * max(sizes) // mnbt if sizes else 0
    notes = [
        f"Follows vLLM {VERSION} V1 sizing (gpu_worker.determine_available_memory, kv_cache_utils.get_kv_cache_config).",
        f"Profile run: {mnbt:,} tokens as {num_reqs} requests; forward peak {fwd.activation_peak / GiB:.2f} GiB "
        f"({fwd.method}), sampler over {num_reqs} × {spec.vocab:,} logits {sampler / GiB:.2f} GiB; "
        "the larger is torch_peak_increase.",
        "The CUDA context and CUDA-graph memory sit outside gpu_memory_utilization's budget, in the remaining "
        f"{1 - s.gpu_memory_utilization:.0%} of the GPU; the CUDA-graph figure is a lower bound (the shared "
        "pool's activations; published logs show 0.1–1 GiB).",
    ]
    if encoder is not None:
        notes += _encoder_notes(encoder, held, lm_phase, s.mm)
    if draft is not None:
        notes += list(draft.notes)
        later = runtime_logits(spec.vocab, max_num_seqs, mnbt, draft.k, compute)
        if later > peak:
            notes.append(f"At run time a full decode batch's logits ({min(max_num_seqs * (draft.k + 1), mnbt):,} "
                         f"positions: {draft.k} draft tokens + 1 per request) take {later / GiB:.2f} GiB with their "
                         f"fp32 copy, above the profiled peak ({peak / GiB:.2f} GiB): only the memory outside "
                         "gpu_memory_utilization holds the difference.")
    if pp > 1:
        notes.append(f"Pipeline parallel {pp}: the stage with the most layers ({len(layers)}) and the first "
                     "stage's weights size the pool (unify_kv_cache_configs keeps the smallest block count).")
    notes += lora_notes
    if s.enable_prefix_caching:
        notes.append("Prefix caching shares blocks between requests with a common prefix; it does not change the pool size.")
    error: str | None = None
    free_at_start = total - out.context
    if free_at_start < requested:
        error = startup_error(free_at_start, total, s.gpu_memory_utilization)
    cc = gpu.compute_capability
    if error is None and dtype == "bf16" and gpu.vendor == "nvidia" and cc and float(cc) < 8.0:
        error = ("Bfloat16 is only supported on GPUs with compute capability of at least 8.0. "
                 f"Your {gpu.name} GPU has compute capability {cc}. You can use float16 instead by "
                 "explicitly setting the `dtype` flag in CLI, for example: --dtype=half.")
    if error is None:
        error = check_enough(layers, available, max_model_len, s.block_size, mnbt)
    cfg = kv_cache_config(layers, max(available, 0), s.block_size)
    conc = max_concurrency(cfg, max_model_len, s.block_size, mnbt)
    conc_avg = None
    if avg_request_len:
        conc_avg = min(float(max_num_seqs), max_concurrency(cfg, avg_request_len, s.block_size, mnbt))
    kinds: dict[str, int] = {}
    for x in layers:
        kinds[x.kind] = kinds.get(x.kind, 0) + 1
    # vLLM checks the pool before it allocates it, and captures graphs after: when the check
    # fails, neither exists (the blocks and tokens below are what the memory would have held)
    pool = cfg.pool_bytes if error is None else 0
    graphs = graphs if error is None else 0
    buffers = draft.buffers if draft is not None else 0
    used = out.context + weights + peak + out.later + pool + graphs + buffers
    if used > total and error is None:
        notes.append(f"Predicted device use {used / GiB:.2f} GiB exceeds the GPU's {total / GiB:.2f} GiB: CUDA-graph "
                     "capture may run out of memory; lower gpu_memory_utilization or add --enforce-eager.")
    log = [f"Model loading took {weights / GiB:.4f} GiB"]
    if prof is not None:
        log.append(prof.log())
    elif encoder is not None and s.mm.skip_mm_profiling:
        log.append("Skipping memory profiling for multimodal encoder and encoder cache.")
    log.append(f"Available KV cache memory: {available / GiB:.2f} GiB")
    if error is None:
        log += [f"GPU KV cache size: {cfg.tokens:,} tokens",
                f"Maximum concurrency for {max_model_len:,} tokens per request: {conc:.2f}x"]
        if sizes:
            log.append(f"Graph capturing finished, took {graphs / GiB:.2f} GiB")
    else:
        log.append(f"ValueError: {error}")
    settings_out = {
        "gpu_memory_utilization": s.gpu_memory_utilization, "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs, "max_num_batched_tokens": mnbt, "block_size": s.block_size,
        "kv_cache_dtype": s.kv_cache_dtype, "enforce_eager": s.enforce_eager,
        "cuda_graph_capture_sizes": len(sizes), "enable_prefix_caching": s.enable_prefix_caching,
        "quantization": quant, "dtype": dtype,
    }
    if draft is not None:
        settings_out["speculative_config"] = {"method": draft.method, "num_speculative_tokens": draft.k,
                                              **({"model": s.spec.draft_name} if s.spec.draft_name else {})}
    if encoder is not None:
        limits = {k: v for k, v in (("image", s.mm.limit_image), ("video", s.mm.limit_video)) if v != LIMIT_DEFAULT}
        pixels = {k: v for k, v in (("max_pixels", s.mm.max_pixels), ("min_pixels", s.mm.min_pixels)) if v is not None}
        settings_out.update({"limit_mm_per_prompt": limits, "mm_processor_kwargs": pixels,
                             "skip_mm_profiling": s.mm.skip_mm_profiling})
    if s.enable_lora:
        settings_out.update({"enable_lora": True, "max_loras": s.max_loras, "max_lora_rank": s.max_lora_rank,
                             "max_cpu_loras": s.max_cpu_loras or s.max_loras,
                             "fully_sharded_loras": s.fully_sharded_loras})
    return ServePlan(
        engine="vllm", engine_version=VERSION, model=spec.name, gpu=gpu.key, tp=tp, pp=pp,
        settings=settings_out, total_memory=total, budget=requested, weights=weights,
        profile_peak=peak, non_torch=out.later, context=out.context, cuda_graph=graphs,
        cuda_graph_in_budget=False, kv_available=available, kv_pool=pool,
        block_size=s.block_size, blocks=cfg.num_blocks, tokens=cfg.tokens,
        bytes_per_token=bytes_per_token(layers), max_model_len=max_model_len, max_concurrency=conc,
        avg_request_len=avg_request_len, concurrency_at_avg=conc_avg, max_running=max_num_seqs,
        starts=error is None, error=error, device_used=used, log=tuple(log),
        command=command(spec, tp, pp, quant, settings_out), profile_method=fwd.method, notes=tuple(notes),
        layer_kinds=kinds, vision_weights=vision, encoder_peak=encoder.peak if encoder is not None else 0,
        encoder_held=held, draft_weights=draft.weights if draft is not None else 0,
        draft_layers=draft.layers if draft is not None else 0, draft_buffers=buffers,
    )


def _weight_bytes(fwd: Forward, spec: ModelSpec, tp: int, pp: int) -> float:
    """The target's bytes per weight (quantised targets: their MTP layers are quantised too)."""
    params = spec.params or 1
    return max(0.5, min(4.0, fwd.weights * tp * pp / params))


def _encoder_notes(enc: Encoder, held: int, lm_phase: int, mm: MmSettings) -> list[str]:
    """What the vision tower adds to the start-up (see :mod:`.mm`)."""
    prof = enc.profile
    out = [f"Vision tower and projector: {enc.weights / GiB:.2f} GiB of the weights (loaded with the model)."]
    if prof is None:
        if mm.skip_mm_profiling:
            out.append("skip_mm_profiling: the vision encode is not profiled, so its activations and the encoder "
                       "outputs are not in the budget; leave room for them under gpu_memory_utilization.")
        else:
            out.append("No modality has a limit above 0: nothing is encoded at start-up (vLLM does not load the "
                       "vision tower then; its weights above are the upper bound).")
        return out
    t, h, w = prof.grid
    out.append(
        f"Multimodal profile: {prof.items} {prof.modality} item(s) of the maximum size, {t}×{h}×{w} patches each "
        f"({prof.patches:,} patches, {prof.tokens:,} encoder tokens; {prof.max_tokens:,} tokens per item for "
        f"scheduling), encoded in one forward: peak {enc.peak / GiB:.2f} GiB ({enc.method}, fp32 dummy pixels "
        f"included); the outputs and pixels ({held / GiB:.2f} GiB) stay through the language-model phase "
        f"({lm_phase / GiB:.2f} GiB): the larger of the two is the profile's peak.")
    if prof.modality == "video" and prof.tokens < prof.max_tokens:
        out.append(f"vLLM {VERSION} sizes the dummy video against max_num_batched_tokens, not max_model_len: it "
                   f"encodes {prof.tokens:,} of the {prof.max_tokens:,} tokens a video of the maximum size makes; "
                   "a real one that long encodes more at run time than the profile reserved for.")
    return out


def startup_error(free: int, total: int, utilization: float) -> str:
    """``Worker.init_device``'s refusal when less than ``total x utilization`` is free (verbatim)."""
    requested = int(total * utilization)
    return (f"Free memory on device ({free / GiB:.2f}/{total / GiB:.2f} GiB) on startup is less "
            f"than desired GPU memory utilization ({utilization}, {requested / GiB:.2f} GiB). "
            "Decrease GPU memory utilization or reduce GPU memory used by other processes.")


def command(spec: ModelSpec, tp: int, pp: int, quant: str, st: dict[str, object]) -> str:
    parts = ["vllm serve", spec.hub_id or spec.name]
    if tp > 1:
        parts.append(f"--tensor-parallel-size {tp}")
    if pp > 1:
        parts.append(f"--pipeline-parallel-size {pp}")
    parts += [f"--gpu-memory-utilization {st['gpu_memory_utilization']}", f"--max-model-len {st['max_model_len']}",
              f"--max-num-seqs {st['max_num_seqs']}", f"--max-num-batched-tokens {st['max_num_batched_tokens']}"]
    if st["block_size"] != 16:
        parts.append(f"--block-size {st['block_size']}")
    if st["kv_cache_dtype"] != "auto":
        parts.append(f"--kv-cache-dtype {st['kv_cache_dtype']}")
    if quant != "none":
        parts.append(f"--quantization {quant}")
    if st["enforce_eager"]:
        parts.append("--enforce-eager")
    if not st["enable_prefix_caching"]:
        parts.append("--no-enable-prefix-caching")
    if st.get("enable_lora"):
        parts += ["--enable-lora", f"--max-loras {st['max_loras']}", f"--max-lora-rank {st['max_lora_rank']}",
                  f"--max-cpu-loras {st['max_cpu_loras']}"]
        if st.get("fully_sharded_loras"):
            parts.append("--fully-sharded-loras")
    if st.get("limit_mm_per_prompt"):
        parts.append(f"--limit-mm-per-prompt '{json.dumps(st['limit_mm_per_prompt'])}'")
    if st.get("mm_processor_kwargs"):
        parts.append(f"--mm-processor-kwargs '{json.dumps(st['mm_processor_kwargs'])}'")
    if st.get("skip_mm_profiling"):
        parts.append("--skip-mm-profiling")
    if st.get("speculative_config"):
        parts.append(f"--speculative-config '{json.dumps(st['speculative_config'])}'")
    return " ".join(parts)
