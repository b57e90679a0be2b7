"""vLLM V1 start-up sizing, for any release from 0.9.2 to 0.34.0 (``--engine-version``; the
default is the newest). The structure below is 0.10.1.1's, each rule cited there; what each
later release changes is :class:`.vllm_release.Release` (files and lines per version).

1. ``Worker.init_device`` (``vllm/v1/worker/gpu_worker.py``): a memory snapshot after the
   CUDA context exists (from 0.11.0 after NCCL's init, in 0.34.0 after cuBLAS's too);
   ``requested_memory = total_memory × gpu_memory_utilization`` (rounded up from 0.14.0); it
   refuses to start when free memory is below that ("Free memory on device … on startup is
   less than desired GPU memory utilization …"; not with 0.34's extensible KV cache).
2. ``Worker.determine_available_memory`` + ``memory_profiling`` (``vllm/utils/__init__.py``):
   ``available = requested_memory − (weights + torch_peak_increase + non_torch_increase)``
   (0.27.0 measures the same sum as the drop in free memory plus the transient peak).
   ``torch_peak_increase`` is the allocated peak of ``GPUModelRunner.profile_run`` above the
   weights: a dummy forward over ``max_num_batched_tokens`` tokens split into
   ``min(max_num_seqs, max_num_batched_tokens)`` requests, then ``_dummy_sampler_run`` on one
   logit row per request (model runner V2 adds persistent sampler state). ``non_torch_increase``
   is what appeared outside PyTorch since the snapshot (NCCL, cuBLAS). The CUDA context is
   *not* in the budget; CUDA graphs are captured after the KV cache is allocated and are *not*
   counted either in 0.10.1.1 (``compile_or_warm_up_model``: "`memory_profiling` does not
   consider CUDAGraph memory size"); from 0.20.0 an estimate of them is taken from the budget,
   and 0.34.0's extensible KV cache sizes the pool after capture from measured free memory.
3. ``get_kv_cache_config`` (``vllm/v1/core/kv_cache_utils.py``): ``check_enough_kv_cache_memory``
   (errors quoted verbatim, per release), then one group of all layers when every layer has the
   same spec (``num_blocks = available // page_size // num_layers``), or for hybrid models
   (sliding window + full) groups of ``min(layers per type)`` layers sharing
   ``group_size`` tensors (``num_blocks = available // page_size // group_size``); the
   logged token count is ``num_blocks // num_groups × block_size`` (from 0.20.1 ⌊concurrency ×
   max_model_len⌋); ``get_max_concurrency_for_kv_cache_config`` gives "Maximum concurrency".
4. Defaults (``vllm/engine/arg_utils.py`` ``_set_default_args_v1``, ``vllm serve``):
   ``max_num_batched_tokens`` 8192 and ``max_num_seqs`` 1024 on GPUs with ≥ 70 GiB that are
   not A100s, else 2048 and 256; ``block_size`` 16 (``vllm/platforms/cuda.py``; MLA models: the
   MLA backend's, :meth:`.vllm_release.Release.mla_block`);
   ``gpu_memory_utilization`` 0.9 (``vllm/config/cache.py``); CUDA-graph capture sizes
   ``[1, 2, 4] + range(8, min(2 × max_num_seqs, 512) + 1, 8)`` capped at
   ``max_num_batched_tokens`` (``vllm/config/scheduler.py``, ``VllmConfig._set_cudagraph_sizes``);
   later releases: :class:`.vllm_release.Release`.

Approximated: the sampler's peak (0.10.1.1's native top-k/top-p path of
``vllm/v1/sample/ops/topk_topp_sampler.py``: 16-bit logits, an fp32 copy, sorted values,
int64 indices, two boolean masks, the softmax and the scattered result = dtype + 26 bytes
per logit, and CUDA's sort temporaries above that at the sort: dtype + 36 bytes from 128 rows;
:meth:`.vllm_release.Release.sampler_bytes`); the CUDA-graph pool (the
activations of one forward at the largest capture size, which all graphs share — a lower
bound: published logs report "Graph capturing finished …, took 0.1–1 GiB"); 0.34's
transient reserve (the sizing step's torch-reservation growth is taken as the profile's peak);
``non_torch_increase`` (vramplan's cuBLAS and NCCL items; vLLM's custom all-reduce IPC buffers
are not counted).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

from vramplan.errors import WorkloadError
from vramplan.hardware.catalog import usable_capacity
from vramplan.hardware.gpu import GPU
from vramplan.models.spec import ModelSpec
from vramplan.units import GiB

from . import ep as eprules
from . import offload as kvoff
from .base import Forward, cdiv, outside
from .kvspec import LayerKV, bytes_per_token, layer_specs
from .mm import LIMIT_DEFAULT, Encoder, MmSettings
from .result import ServePlan
from .spec import SpecSettings, draft_layers, drafter, runtime_logits
from .vllm_release import NEWEST, Release
from .vllm_release import SAMPLER_BYTES_PER_LOGIT as SAMPLER_BYTES_PER_LOGIT  # (re-exported)

VERSION = NEWEST
"""The release ``serve-plan`` follows unless told (``--engine-version``)."""


@dataclass(frozen=True, kw_only=True)
class VllmSettings:
    engine_version: str = NEWEST
    """The vLLM release whose sizing is followed (:mod:`.vllm_release`, OLDEST … NEWEST)."""
    gpu_memory_utilization: float | None = None
    """None: the release's default (0.9; 0.92 from 0.20.0; 1.0 with 0.34's extensible KV cache)."""
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    """None: the release's default (16; 64 from 0.34.0)."""
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] = ()
    enable_prefix_caching: bool = True
    disable_hybrid_kv_cache_manager: bool = False
    extensible_kv_cache: bool | None = None
    """0.34.0's extensible KV cache (None: on, its default on CUDA)."""
    kv_offloading_size: float | None = None
    """GiB of host KV tier over all ranks (``--kv-offloading-size``, from 0.11.1; :mod:`.offload`)."""
    kv_offloading_backend: str = "native"
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
    ep: eprules.EpSettings = eprules.EpSettings()
    """Data and expert parallelism (``--data-parallel-size``, ``--enable-expert-parallel``: :mod:`.ep`)."""


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


def max_memory_usage(layer: LayerKV, max_model_len: int, block_size: int, inflight: int) -> int:
    """``KVCacheSpec.max_memory_usage_bytes``: the blocks one request of max_model_len needs
    (a sliding-window layer: its window + the tokens in flight, :meth:`.Release.inflight_tokens`)."""
    page = layer.page_bytes(block_size)
    if layer.kind == "sliding" and layer.window:
        tokens = min(layer.window - 1 + inflight, max_model_len)
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
                 mnbt: int, version: str = "0.10.1.1", hint: str = "") -> str | None:
    """``check_enough_kv_cache_memory``: None, or ``version``'s ValueError text (``hint``: 0.34's
    sizing-mode hint)."""
    rel = Release.of(version)
    if available <= 0:
        return rel.no_memory_error(hint)
    needed = needed_memory(layers, max_model_len, block_size, mnbt)
    if needed <= available:
        return None
    est = estimate_max_model_len(layers, available, max_model_len, block_size, mnbt)
    return rel.too_long_error(max_model_len, needed, available, est, hint)


@dataclass(frozen=True)
class KVConfig:
    num_blocks: int
    groups: tuple[tuple[LayerKV, int], ...]
    """(layer spec, layers in the group) per KV-cache group."""
    tokens: int
    pool_bytes: int
    block_bytes: int = 0
    """One block of every tensor of the pool on this rank (page × layers per group: vLLM 0.34's ``B``)."""
    block_size: int = 16

    def with_blocks(self, blocks: int) -> KVConfig:
        """The same layout with ``blocks`` blocks (the logged tokens: blocks per group × block size)."""
        return dataclasses.replace(self, num_blocks=blocks, pool_bytes=blocks * self.block_bytes,
                                   tokens=blocks // len(self.groups) * self.block_size)


def group_size(counts: list[int], version: str = "0.10.1.1") -> int:
    """Layers per KV-cache group of a hybrid model: the fewest layers of any type; 0.34.0 takes
    the most when max < 1.5 × min (padding the short type; v1/core/kv_cache_planning.py:561-578)."""
    lo, hi = min(counts), max(counts)
    return hi if Release.of(version).since("0.34.0") and hi < 1.5 * lo else lo


def kv_cache_config(layers: tuple[LayerKV, ...], available: int, block_size: int,
                    version: str = "0.10.1.1") -> KVConfig:
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
        return KVConfig(blocks, ((spec, n),), blocks * block_size, page * blocks * n, page * n, block_size)
    size = group_size(list(by_type.values()), version)
    groups: list[tuple[LayerKV, int]] = []
    for spec, n in by_type.items():
        for start in range(0, n, size):
            groups.append((spec, min(size, n - start)))
    blocks = max(0, available // page // size)
    return KVConfig(blocks, tuple(groups), blocks // len(groups) * block_size, page * blocks * size, page * size,
                    block_size)


def max_concurrency(cfg: KVConfig, max_model_len: int, block_size: int, mnbt: int) -> float:
    """``get_max_concurrency_for_kv_cache_config``."""
    per_group = max(n for _, n in cfg.groups)
    per_request = per_group * sum(max_memory_usage(s, max_model_len, block_size, mnbt) for s, _ in cfg.groups)
    per_block = cfg.groups[0][0].page_bytes(block_size) * per_group
    return cfg.num_blocks / cdiv(per_request, per_block)


GRANULE = 2 * 1024 * 1024
"""The extensible KV cache maps each layer's region in whole VMM granules (the driver's
granularity, at least 2 MiB: vllm/utils/extensible_tensor.py:28-31)."""


def blocks_within(budget: int, segments: int, stride: int, capacity: int) -> int:
    """``blocks_within`` (0.34.0 v1/worker/extensible_kv_cache.py:313-318): the most blocks ≤
    ``capacity`` whose ``segments`` regions of ``stride`` bytes per block, each rounded up to a
    granule, fit in ``budget``."""
    if budget <= 0 or segments <= 0 or stride <= 0:
        return 0

    def cost(n: int) -> int:
        return segments * cdiv(n * stride, GRANULE) * GRANULE

    lo, hi = 0, capacity
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def profile_tokens(gpu: GPU, s: VllmSettings) -> int:
    """``max_num_batched_tokens``: the tokens of the profile run's forward."""
    return s.max_num_batched_tokens or _batch_defaults(gpu, s.engine_version)[0]


def default_max_num_seqs(gpu: GPU, version: str = NEWEST) -> int:
    """``max_num_seqs`` by default (:meth:`.Release.batch_defaults`)."""
    return _batch_defaults(gpu, version)[1]


def _batch_defaults(gpu: GPU, version: str) -> tuple[int, int]:
    total = usable_capacity(gpu)[0]
    return Release.of(version).batch_defaults(total, big_gpu(gpu, total), gpu.compute_capability)


def plan(spec: ModelSpec, gpu: GPU, fwd: Forward, *, tp: int = 1, pp: int = 1, quant: str = "none",
         dtype: str = "bf16", settings: VllmSettings = VllmSettings(), avg_request_len: int | None = None,
         encoder: Encoder | None = None) -> ServePlan:
    """vLLM's start-up sizing on ``gpu``, given ``fwd``: the weights and the peak of a forward over
    :func:`profile_tokens` tokens on one rank (:func:`vramplan.engine.forward.forward`); for a
    vision-language model ``spec`` is its language model and ``encoder`` its vision tower
    (:mod:`vramplan.engine.encoder`). The rules are those of ``settings.engine_version``
    (:mod:`.vllm_release`)."""
    s = settings
    rel = Release.of(s.engine_version)
    ext = rel.extensible_default if s.extensible_kv_cache is None else s.extensible_kv_cache
    if ext and not rel.since("0.34.0"):
        raise WorkloadError(f"the extensible KV cache is vLLM 0.34's; {rel.text} sizes the cache from its profile",
                            hint="set extensible_kv_cache only with engine_version 0.34.0",
                            field="enable_extensible_kv_cache")
    # model runner V2 took dense text models from 0.25.0 and the rest (MoE, multimodal) from 0.29.0
    moe = spec.is_moe or encoder is not None
    utilization = s.gpu_memory_utilization if s.gpu_memory_utilization is not None else rel.default_utilization(ext)
    block_size = s.block_size or rel.block_size
    total, _ = usable_capacity(gpu)
    mnbt = profile_tokens(gpu, s)
    max_num_seqs = s.max_num_seqs or default_max_num_seqs(gpu, s.engine_version)
    max_model_len = s.max_model_len or spec.max_positions
    inflight = rel.inflight_tokens(mnbt, pp)
    kvoff.check(rel, s.kv_offloading_size, s.kv_offloading_backend)
    no_hybrid = s.disable_hybrid_kv_cache_manager or kvoff.disables_hybrid(rel, s.kv_offloading_size,
                                                                           s.kv_offloading_backend)
    layers = layer_specs(spec, tp=tp, pp=pp, kv_cache_dtype=s.kv_cache_dtype, engine="vllm",
                         sliding=not s.disable_hybrid_kv_cache_manager)
    mla_backend = None
    if any(x.kind == "mla" for x in layers):  # the MLA backend's block size (Release.mla_block)
        block_size, mla_backend = rel.mla_block(gpu.compute_capability, kv_fp8=s.kv_cache_dtype.lower().startswith("fp8"),
                                                given=s.block_size, qk_nope_head_dim=spec.qk_nope_head_dim or 128)
    sliding = any(x.kind == "sliding" for x in layers)
    if no_hybrid:
        layers = tuple(LayerKV("full", x.kv_heads, x.head_size, x.dtype_bytes) if x.kind == "sliding" else x
                       for x in layers)
    dp = s.ep.data_parallel_size
    if s.ep.on and quant not in ("none", "fp8"):
        raise WorkloadError(f"data/expert parallelism with {quant} weights is not modelled", hint="use quantization "
                            "none or fp8", field="enable_expert_parallel")
    lay = eprules.layout(spec, rel, s.ep, tp=tp, pp=pp, tokens=mnbt, expert_elems=fwd.expert_elems,
                         weight_bytes=1.0 if quant == "fp8" else 2.0)
    world = tp * pp * dp
    out = outside(gpu, world)
    requested = math.ceil(total * utilization) if rel.ceil_request else int(total * utilization)
    num_reqs = min(max_num_seqs, mnbt)
    compute = 2
    lora, lora_peak, lora_notes = lora_bytes(spec, tp, s, compute, mnbt, max_num_seqs,
                                             stage_layers=len(layers) if pp > 1 else None, pp=pp)
    vision = encoder.weights if encoder is not None else 0
    draft = drafter(spec, s.spec, tp=tp, weight_bytes=_weight_bytes(fwd, spec, tp, pp), compute_bytes=compute,
                    max_num_batched_tokens=mnbt, max_num_seqs=max_num_seqs)
    layers = draft_layers(layers, draft)
    weights = fwd.weights + lora + vision + (draft.weights if draft is not None else 0)
    ep_peak = ep_buffers = 0
    if lay is not None:
        weights += lay.weights_delta
        ep_peak, ep_buffers = lay.peak_delta, lay.non_torch
    per_logit = rel.sampler_bytes(moe, num_reqs)
    sampler = num_reqs * spec.vocab * (compute + per_logit) if spec.vocab else 0
    buffers = rel.runner_buffers(moe, max_num_seqs, spec.vocab)
    peak = lm_phase = max(fwd.activation_peak + lora_peak + ep_peak, sampler)
    prof = encoder.profile if encoder is not None else None
    held = 0
    if encoder is not None and prof is not None:  # profile_run: the encode, then the LM with the outputs held
        # (the V1 runner keeps the dummy pixel batch in a local through the LM phase; V2 frees it in the encoder runner)
        held = encoder.outputs + (0 if rel.v2_runner(moe) else prof.pixel_bytes)
        peak = max(encoder.peak, held + lm_phase)
    # memory outside PyTorch that the first snapshot does not see yet, so the budget pays for it
    non_torch = (out.cublas if rel.cublas_in_budget else 0) + ((out.later - out.cublas) if rel.nccl_in_budget else 0)
    non_torch += ep_buffers  # (DeepEP's buffer: made while the model loads, after the first snapshot)
    sizes = [] if s.enforce_eager else rel.capture_sizes(max_num_seqs, mnbt, s.cuda_graph_sizes,
                                                         spec_tokens=draft.k if draft is not None else 0)
    full = len({min(x, max_num_seqs) for x in sizes}) if rel.full_graphs else 0
    graphs = fwd.activation_peak * max(sizes) // mnbt if sizes else 0
    estimated = bool(sizes) and not ext and rel.graphs_estimated(moe)
    # vLLM's own estimate: the captures plus its 1 MiB floor for each FULL graph it extrapolates
    graph_estimate = graphs + max(0, full - 1) * (1 << 20) if estimated else 0
    counted = buffers if rel.buffers_counted else 0
    non_kv = weights + counted + peak + non_torch
    available = requested - non_kv - graph_estimate
    capacity = available
    reserve = 0
    if ext:
        # measure_kv_cache_bytes (0.34.0 extensible_kv_cache.py:592-618): after warm-up and capture,
        # free memory + the committed prefix, less a margin and the transient reserve max(P, G)
        held_now = weights + buffers + graphs
        device_left = total - out.context - out.later - held_now
        transient = peak
        margin = max(GiB, int(0.75 * transient))
        reserve = margin + transient
        available = max(0, min(requested - held_now, device_left - margin) - transient)
    notes = [
        f"Follows vLLM {rel.text} V1 sizing (gpu_worker.determine_available_memory, the KV-cache config; "
        f"rules per release in vramplan.pools.vllm_release).",
        f"Profile run: {mnbt:,} tokens as {num_reqs} requests; forward peak {fwd.activation_peak / GiB:.2f} GiB "
        f"({fwd.method}), sampler over {num_reqs} × {spec.vocab:,} logits {sampler / GiB:.2f} GiB "
        f"({compute} + {per_logit} bytes per logit); the larger is the profile's transient peak.",
    ]
    notes += _budget_notes(rel, ext, utilization, s.gpu_memory_utilization is not None, out.later - non_torch,
                           buffers, max_num_seqs, graphs, graph_estimate, estimated, full, reserve, peak)
    if encoder is not None:
        notes += _encoder_notes(encoder, held, lm_phase, s.mm, rel)
    if draft is not None:
        notes += list(draft.notes)
        later = runtime_logits(spec.vocab, max_num_seqs, mnbt, draft.k, compute)
        if later > peak:
            notes.append(f"At run time a full decode batch's logits ({min(max_num_seqs * (draft.k + 1), mnbt):,} "
                         f"positions: {draft.k} draft tokens + 1 per request) take {later / GiB:.2f} GiB with their "
                         f"fp32 copy, above the profiled peak ({peak / GiB:.2f} GiB): only the memory outside "
                         "gpu_memory_utilization holds the difference.")
    if lay is not None:
        notes += list(lay.notes)
    if pp > 1:
        notes.append(f"Pipeline parallel {pp}: the stage with the most layers ({len(layers)}) and the first "
                     "stage's weights size the pool (unify_kv_cache_configs keeps the smallest block count).")
    notes += lora_notes
    if (lora_notes or draft is not None) and not rel.text.startswith("0.10"):
        notes.append(f"The multi-LoRA and speculative-decoding parts follow vLLM 0.10.1.1's code (not re-read for "
                     f"{rel.text}).")
    if encoder is not None and rel.since("0.11.0"):
        notes.append("The multimodal profile's rules per release (the dummy item at max_model_len from 0.11.0, "
                     "0.11.0's padded outputs, the pixels freed by model runner V2) were read in 0.10.1.1, 0.10.2, "
                     "0.11.0, 0.12.0, 0.19.1 and 0.34.0; vLLM's own vision tower is transformers' here.")
    if mla_backend is not None:
        notes.append(mla_note(rel, mla_backend, block_size, s.block_size, gpu.compute_capability))
    if s.enable_prefix_caching:
        notes.append("Prefix caching shares blocks between requests with a common prefix; it does not change the pool size.")
    hint = _hint(ext, utilization, after=False)
    error: str | None = None
    free_at_start = total - out.context - (out.later - non_torch)
    if free_at_start < requested and not ext:
        error = rel.startup_error(free_at_start, total, utilization, requested)
    cc = gpu.compute_capability
    if error is None and dtype == "bf16" and gpu.vendor == "nvidia" and cc and float(cc) < 8.0:
        error = ("Bfloat16 is only supported on GPUs with compute capability of at least 8.0. "
                 f"Your {gpu.name} GPU has compute capability {cc}. You can use float16 instead by "
                 "explicitly setting the `dtype` flag in CLI, for example: --dtype=half.")
    cfg = kv_cache_config(layers, max(capacity, 0), block_size, rel.text)
    if error is None:  # (0.34 checks against the budget less one null block)
        error = check_enough(layers, capacity - (cfg.block_bytes if rel.null_block else 0), max_model_len, block_size,
                             inflight, rel.text, hint)
    if ext:  # the pool in whole granules per tensor, within the reservation's capacity
        segments = max(n for _, n in cfg.groups)
        cfg = cfg.with_blocks(blocks_within(available, segments, cfg.block_bytes // segments, cfg.num_blocks))
        if error is None:  # shrink_kv_cache_configs: one request of max_model_len in (blocks - 1) blocks
            error = check_enough(layers, max(cfg.num_blocks - 1, 0) * cfg.block_bytes, max_model_len, block_size,
                                 inflight, rel.text, _hint(ext, utilization, after=True))
    conc = max_concurrency(cfg, max_model_len, block_size, inflight)
    tokens = int(conc * max_model_len) if rel.tokens_from_concurrency else cfg.tokens
    conc_avg = None
    if avg_request_len:
        conc_avg = min(float(max_num_seqs), max_concurrency(cfg, avg_request_len, block_size, inflight))
    kinds: dict[str, int] = {}
    for x in layers:
        kinds[x.kind] = kinds.get(x.kind, 0) + 1
    # vLLM checks the pool before it allocates it, and captures graphs after: when the check
    # fails, neither exists (the blocks and tokens below are what the memory would have held)
    pool = cfg.pool_bytes if error is None else 0
    graphs = graphs if error is None else 0
    proposer = draft.buffers if draft is not None else 0
    tier = None
    if s.kv_offloading_size is not None:
        tier = kvoff.offload(rel, s.kv_offloading_size, s.kv_offloading_backend, block_bytes=cfg.block_bytes,
                             block_size=block_size, tp=tp, pp=pp, layers=layers, sliding=sliding)
        notes += list(tier.notes)
        proposer += tier.gpu
    resident_peak = 0 if ext else peak  # the extensible cache sizes after empty_cache()
    used = out.context + out.later + ep_buffers + weights + buffers + resident_peak + pool + graphs + proposer
    if used > total and error is None:
        notes.append(f"Predicted device use {used / GiB:.2f} GiB exceeds the GPU's {total / GiB:.2f} GiB: CUDA-graph "
                     "capture may run out of memory; lower gpu_memory_utilization or add --enforce-eager.")
    log = [rel.weights_line(weights, moe)]
    if prof is not None:
        log.append(prof.log())
    elif encoder is not None and s.mm.skip_mm_profiling:
        log.append("Skipping memory profiling for multimodal encoder and encoder cache.")
    log.append(f"Available KV cache memory: {rel.gib(capacity)} GiB")
    size_line = [f"GPU KV cache size: {tokens:,} tokens",
                 f"Maximum concurrency for {max_model_len:,} tokens per request: {conc:.2f}x"]
    size_lines = [", ".join(size_line)] if rel.kv_one_line else size_line
    usage = rel.usage_line(free=free_at_start, total=total, utilization=utilization, requested=requested,
                           weights=weights, non_torch=non_torch, consumed=weights + buffers + non_torch,
                           peak=peak + (graph_estimate if rel.since("0.27.0") else 0), graphs=graphs,
                           available=capacity)
    if error is None:
        if ext:
            if sizes:
                log.append(f"Graph capturing finished, took {graphs / GiB:.2f} GiB")
            if usage:
                log.append(usage)
            log += size_lines
            log.append(f"Extended KV cache to {cfg.num_blocks} blocks ({pool / GiB:.2f} GiB).")
            if tier is not None:
                log += tier.log
        else:
            log += size_lines
            if sizes:
                log.append(f"Graph capturing finished, took {graphs / GiB:.2f} GiB")
            if usage:
                log.append(usage)
            if tier is not None:
                log += tier.log
    else:
        log.append(f"ValueError: {error}")
    settings_out: dict[str, object] = {
        "engine_version": rel.text,
        "gpu_memory_utilization": utilization, "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs, "max_num_batched_tokens": mnbt, "block_size": block_size,
        "kv_cache_dtype": s.kv_cache_dtype, "enforce_eager": s.enforce_eager,
        "cuda_graph_capture_sizes": len(sizes), "enable_prefix_caching": s.enable_prefix_caching,
        "quantization": quant, "dtype": dtype,
    }
    if rel.since("0.34.0"):
        settings_out["enable_extensible_kv_cache"] = ext
    if lay is not None:
        settings_out["data_parallel_size"] = dp
    if s.ep.enable_expert_parallel and lay is not None:
        settings_out.update({"enable_expert_parallel": True, "all2all_backend": lay.backend,
                             "num_redundant_experts": s.ep.num_redundant_experts, "routing": s.ep.routing})
    if s.kv_offloading_size is not None:
        settings_out.update({"kv_offloading_size": s.kv_offloading_size, "kv_offloading_backend": s.kv_offloading_backend})
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
        engine="vllm", engine_version=rel.text, model=spec.name, gpu=gpu.key, tp=tp, pp=pp,
        settings=settings_out, total_memory=total, budget=requested, weights=weights,
        profile_peak=peak, non_torch=non_torch, context=out.context + out.later - non_torch, cuda_graph=graphs,
        cuda_graph_in_budget=ext or estimated, kv_available=available, kv_pool=pool,
        block_size=block_size, blocks=cfg.num_blocks, tokens=tokens,
        bytes_per_token=bytes_per_token(layers), max_model_len=max_model_len, max_concurrency=conc,
        avg_request_len=avg_request_len, concurrency_at_avg=conc_avg, max_running=max_num_seqs,
        starts=error is None, error=error, device_used=used, log=tuple(log),
        command=command(spec, tp, pp, quant, settings_out, default_block=block_size if s.block_size is None else None), profile_method=fwd.method, notes=tuple(notes),
        layer_kinds=kinds, vision_weights=vision, encoder_peak=encoder.peak if encoder is not None else 0,
        encoder_held=held, draft_weights=draft.weights if draft is not None else 0,
        draft_layers=draft.layers if draft is not None else 0, draft_buffers=proposer,
        runner_buffers=buffers, kv_reserve=reserve, cuda_graph_estimate=graph_estimate,
        host_kv=tier.host_per_rank if tier is not None else 0, host_kv_shared=tier.host_shared if tier is not None else 0,
        host_kv_tokens=tier.cpu_tokens if tier is not None else 0, connector_gpu=tier.gpu if tier is not None else 0,
        dp=dp, ep=lay.ep_size if lay is not None else 1, expert_weights=lay.expert_weights if lay is not None else 0,
        local_experts=lay.local_experts if lay is not None and lay.ep_size > 1 else 0, ep_buffers=ep_buffers,
    )


def _hint(ext: bool, utilization: float, *, after: bool) -> str:
    """0.34.0's ``_more_kv_cache_memory_hint`` (v1/core/kv_cache_planning.py:64-96)."""
    if not ext:
        return ("Try increasing `gpu_memory_utilization` when initializing the engine (this flag also controls CPU "
                "memory reservation on the CPU backend, despite its name).")
    used_by = "the model, its activations, CUDA graphs and warmup" if after else "the model and its activations"
    graphs = " CUDA graphs take less with fewer or smaller capture sizes in the compilation config." if after else ""
    if utilization < 1.0:
        return (f"The KV cache gets what is left after {used_by} within `gpu_memory_utilization`={utilization}; "
                "increase it (with the extensible KV cache it defaults to 1.0) or decrease `max_model_len` or "
                f"`max_num_seqs`.{graphs}")
    return (f"The extensible KV cache already takes all device memory left after {used_by}; decrease "
            f"`max_model_len` or `max_num_seqs`, or the model needs a device with more memory.{graphs}")


def _budget_notes(rel: Release, ext: bool, utilization: float, given: bool, before_snapshot: int, buffers: int,
                  max_num_seqs: int, graphs: int, graph_estimate: int, estimated: bool, full: int, reserve: int,
                  peak: int) -> list[str]:
    """Where this release puts each part: inside ``gpu_memory_utilization``'s budget or outside."""
    out: list[str] = []
    if before_snapshot:
        what = "NCCL's buffers and the cuBLAS handles" if not rel.cublas_in_budget else "NCCL's buffers"
        out.append(f"{what} ({before_snapshot / GiB:.2f} GiB) exist before vLLM {rel.text}'s first memory snapshot: "
                   "outside the budget, like the CUDA context.")
    if buffers:
        out.append(f"Model runner V2's sampler state ({buffers / GiB:.2f} GiB: penalty bin counts for {max_num_seqs} "
                   "sequences × the vocabulary, int32) is allocated after the weights are measured: "
                   + ("inside the profile's consumed memory." if rel.buffers_counted else
                      f"vLLM {rel.text}'s budget does not count it (the profile's peak is taken above it), so the "
                      "pool is that much larger and the GPU's remaining share holds it."))
    graph_kind = ("PIECEWISE graphs for every size and FULL decode graphs for "
                  f"{full} sizes" if full else "PIECEWISE graphs")
    if ext:
        out.append(
            f"Extensible KV cache (vLLM {rel.text}'s default on CUDA; --no-enable-extensible-kv-cache turns it off): the "
            "pool is sized after warm-up and CUDA-graph capture from measured free memory, less max(1 GiB, 0.75 × "
            f"the transient peak) and the transient reserve max(P, G): {reserve / GiB:.2f} GiB kept free in all "
            f"(P = the profile's peak {peak / GiB:.2f} GiB; the torch-reservation growth G of the sizing step is taken as "
            "P, and the sizing step with attention as no larger than the profile). gpu_memory_utilization "
            + (f"{utilization} caps the pool at that share of the GPU." if given else
               "is unset: 1.0, the device's free memory decides.")
            + f" The 'Available KV cache memory' line is the reservation's capacity, not the pool; {graph_kind} are "
            f"inside (measured): {graphs / GiB:.2f} GiB, a lower bound (the shared pool's activations at the largest "
            "size).")
    elif estimated:
        out.append(
            f"CUDA-graph memory is estimated and taken from the budget (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS, on "
            f"since 0.20.0): {graph_estimate / GiB:.2f} GiB for {graph_kind} — the shared pool's activations at the "
            "largest size plus vLLM's 1 MiB floor per extrapolated FULL graph, a lower bound of what it measures.")
    else:
        why = ("model runner V2's estimate returns 0 in 0.22–0.28" if rel.since("0.20.0") else
               "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS is off by default" if rel.since("0.18.0") else
               "memory_profiling does not consider CUDA-graph memory")
        out.append(f"The CUDA context and CUDA-graph memory sit outside gpu_memory_utilization's budget ({why}), in "
                   f"the remaining {1 - utilization:.0%} of the GPU; the CUDA-graph figure ({graph_kind}) is a lower "
                   "bound (the shared pool's activations; published logs show 0.1–1 GiB).")
    return out


def _weight_bytes(fwd: Forward, spec: ModelSpec, tp: int, pp: int) -> float:
    """The target's bytes per weight (quantised targets: their MTP layers are quantised too)."""
    params = spec.params or 1
    return max(0.5, min(4.0, fwd.weights * tp * pp / params))


def _encoder_notes(enc: Encoder, held: int, lm_phase: int, mm: MmSettings, rel: Release) -> list[str]:
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
        f"included); the outputs{'' if rel.v2_runner(True) else ' and pixels'} ({held / GiB:.2f} GiB) stay through "
        "the language-model phase "
        f"({lm_phase / GiB:.2f} GiB): the larger of the two is the profile's peak.")
    if prof.held_tokens:
        out.append(f"vLLM {rel.text} pads each encoder output to the encoder budget ({prof.budget:,} rows) while the "
                   "language-model phase runs.")
    if prof.modality == "video" and prof.tokens < prof.max_tokens and not rel.since("0.11.0"):
        out.append(f"vLLM {rel.text} sizes the dummy video against max_num_batched_tokens, not max_model_len: it "
                   f"encodes {prof.tokens:,} of the {prof.max_tokens:,} tokens a video of the maximum size makes; "
                   "a real one that long encodes more at run time than the profile reserved for.")
    return out


def mla_note(rel: Release, backend: str, block_size: int, given: int | None, cc: str | None) -> str:
    """Where an MLA model's block size comes from in this release (:meth:`.Release.mla_block`)."""
    per_token = "kv_lora_rank + qk_rope_head_dim values per token and layer, one latent vector, not split by TP"
    if given and given != block_size:
        why = f"vLLM {rel.text} overrides --block-size {given} for MLA ({backend} needs {block_size})"
    elif given:
        why = f"--block-size {given} is kept"
    else:
        why = f"vLLM {rel.text} picks {backend} on compute capability {cc or 'unknown'}: blocks of {block_size} tokens"
    return f"MLA KV cache: {per_token}; {why} (docs/research/vllm-mla-kv.md)."


def command(spec: ModelSpec, tp: int, pp: int, quant: str, st: dict[str, object],
            default_block: int | None = None) -> str:
    parts = ["vllm serve", spec.hub_id or spec.name]
    if tp > 1:
        parts.append(f"--tensor-parallel-size {tp}")
    if pp > 1:
        parts.append(f"--pipeline-parallel-size {pp}")
    if int(str(st.get("data_parallel_size", 1))) > 1:
        parts.append(f"--data-parallel-size {st['data_parallel_size']}")
    if st.get("enable_expert_parallel"):
        parts.append("--enable-expert-parallel")
        rel = Release.of(str(st.get("engine_version") or NEWEST))
        if st.get("all2all_backend") != eprules.default_backend(rel):
            if rel.since("0.12.0"):
                parts.append(f"--all2all-backend {st['all2all_backend']}")
            else:  # (an environment variable before 0.12.0)
                parts.insert(0, f"VLLM_ALL2ALL_BACKEND={st['all2all_backend']}")
        if st.get("num_redundant_experts"):
            parts.append("--enable-eplb")
            if rel.since("0.12.0"):
                parts.append(f"--eplb-config '{{\"num_redundant_experts\": {st['num_redundant_experts']}}}'")
            else:
                parts.append(f"--num-redundant-experts {st['num_redundant_experts']}")
    if not (st.get("enable_extensible_kv_cache") and st["gpu_memory_utilization"] == 1.0):  # 1.0: its default
        parts.append(f"--gpu-memory-utilization {st['gpu_memory_utilization']}")
    parts += [f"--max-model-len {st['max_model_len']}",
              f"--max-num-seqs {st['max_num_seqs']}", f"--max-num-batched-tokens {st['max_num_batched_tokens']}"]
    if st["block_size"] != (default_block or Release.of(str(st.get("engine_version") or NEWEST)).block_size):
        parts.append(f"--block-size {st['block_size']}")
    if st.get("enable_extensible_kv_cache") is False:
        parts.append("--no-enable-extensible-kv-cache")
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
    if st.get("kv_offloading_size") is not None:
        parts.append(f"--kv-offloading-size {st['kv_offloading_size']}")
        if st.get("kv_offloading_backend") != "native":
            parts.append(f"--kv-offloading-backend {st['kv_offloading_backend']}")
    return " ".join(parts)
