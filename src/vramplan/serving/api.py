"""``serve_plan``: model + GPU + engine settings → the engine's start-up sizing; and the
inverse questions (largest context that starts, cheapest GPU/instance and TP size)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from vramplan.errors import PlanError, WorkloadError
from vramplan.hardware.catalog import get_gpu
from vramplan.hardware.gpu import GPU
from vramplan.models.spec import ModelSpec
from vramplan.models.vlm import is_vlm
from vramplan.pools import spec as spec_rules
from vramplan.pools.base import check_quant, serving_dtype
from vramplan.pools.ep import EpSettings
from vramplan.pools.mm import LIMIT_DEFAULT, MmSettings
from vramplan.pools.result import ServePlan
from vramplan.pools.sglang_release import SglangRelease
from vramplan.pools.spec import MTP_TYPES, SpecSettings
from vramplan.pools.tgi_release import TgiRelease
from vramplan.pools.vllm_release import Release

from . import sglang, tgi, trtllm, vllm

ENGINES = ("vllm", "sglang", "tgi", "trtllm")
VLLM_BLOCK_SIZES = (1, 8, 16, 32, 64, 128)
FRACTION_NAME = {"vllm": "gpu_memory_utilization", "sglang": "mem_fraction_static",
                 "tgi": "cuda_memory_fraction", "trtllm": "free_gpu_memory_fraction"}


def _resolve(model: str | ModelSpec) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    from vramplan.models.catalog import resolve

    return resolve(model)


def _check(spec: ModelSpec, engine: str, fraction: float | None, max_model_len: int | None,
           avg_request_len: int | None, positive: dict[str, int | None]) -> None:
    if engine not in ENGINES:
        raise WorkloadError(f"unknown serving engine {engine!r}", hint=f"choose one of {' | '.join(ENGINES)}")
    if fraction is not None and not 0 < fraction <= 1:
        raise WorkloadError(f"{FRACTION_NAME[engine]} must be in (0, 1], got {fraction}",
                            hint="e.g. 0.9 for 90 % of the GPU")
    if max_model_len is not None:
        if max_model_len < 1:
            raise WorkloadError(f"max_model_len must be >= 1, got {max_model_len}")
        if spec.max_positions and max_model_len > spec.max_positions:
            raise WorkloadError(
                f"User-specified max_model_len ({max_model_len}) is greater than the derived max_model_len "
                f"(max_position_embeddings={spec.max_positions} in model's config.json)",
                hint=f"use --max-model-len {spec.max_positions} or less")
    if avg_request_len is not None and avg_request_len < 1:
        raise WorkloadError(f"average request length must be >= 1, got {avg_request_len}")
    for name, v in positive.items():
        if v is not None and v < 1:
            raise WorkloadError(f"{name} must be >= 1, got {v}")
    block = positive.get("block_size")
    if engine == "vllm" and block is not None and block not in VLLM_BLOCK_SIZES:
        raise WorkloadError(f"invalid block_size {block} for vLLM",
                            hint=f"choose one of {', '.join(map(str, VLLM_BLOCK_SIZES))} (vllm/config/cache.py BlockSize)")


def serve_plan(
    model: str | ModelSpec,
    gpu: str | GPU,
    *,
    engine: str = "vllm",
    tp: int = 1,
    pp: int = 1,
    quantization: str = "none",
    dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    memory_fraction: float | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    block_size: int | None = None,
    enforce_eager: bool = False,
    cuda_graph_sizes: tuple[int, ...] = (),
    enable_prefix_caching: bool = True,
    disable_hybrid_kv_cache_manager: bool = False,
    avg_request_len: int | None = None,
    method: str = "analytic",
    enable_lora: bool = False,
    max_loras: int = 1,
    max_lora_rank: int = 16,
    max_cpu_loras: int | None = None,
    fully_sharded_loras: bool = False,
    limit_mm_per_prompt: Mapping[str, int] | None = None,
    mm_processor_kwargs: Mapping[str, Any] | None = None,
    skip_mm_profiling: bool = False,
    speculative_config: Mapping[str, Any] | None = None,
    engine_version: str | None = None,
    extensible_kv_cache: bool | None = None,
    kv_offloading_size: float | None = None,
    kv_offloading_backend: str = "native",
    data_parallel_size: int = 1,
    enable_expert_parallel: bool = False,
    all2all_backend: str | None = None,
    num_redundant_experts: int = 0,
    routing: str = "even",
) -> ServePlan:
    """The figures ``engine`` would log at start-up for ``model`` on ``gpu`` (per rank).

    ``memory_fraction`` is the engine's own knob (vLLM ``gpu_memory_utilization``, SGLang
    ``mem_fraction_static``, TGI ``cuda_memory_fraction``, TensorRT-LLM
    ``free_gpu_memory_fraction``); ``max_model_len`` its per-request limit (SGLang
    ``context_length``, TGI ``max_total_tokens``, TensorRT-LLM ``max_seq_len``);
    ``max_num_seqs`` its concurrency limit (``max_running_requests``,
    ``max_concurrent_requests``, ``max_batch_size``); ``max_num_batched_tokens`` its token
    budget per step (``chunked_prefill_size``, ``max_batch_prefill_tokens``,
    ``max_num_tokens``); ``block_size`` its page (``page_size``, ``tokens_per_block``).
    ``method`` is how the profile forward is estimated: ``analytic`` or ``trace``.
    ``enable_lora`` (vLLM only): multi-LoRA serving with ``max_loras`` GPU slots of rank
    ``max_lora_rank`` (``max_cpu_loras``: the host-RAM cache; ``fully_sharded_loras``).
    A vision-language model (vLLM only): ``limit_mm_per_prompt`` (``{"image": n, "video": n}``,
    default 999 each), ``mm_processor_kwargs`` (``max_pixels``, ``min_pixels``),
    ``skip_mm_profiling`` (:mod:`vramplan.pools.mm`). Speculative decoding (vLLM only):
    ``speculative_config`` as vLLM takes it (``method``, ``num_speculative_tokens``, ``model``: the
    head's config.json or catalog name; :mod:`vramplan.pools.spec`). ``engine_version``: the
    release whose sizing is followed (default the newest): vLLM 0.9.2 … 0.34.0, SGLang 0.4.6 … 0.5.23,
    TGI 3.0.0 … 3.3.7; ``extensible_kv_cache``
    (vLLM 0.34 only): False for ``--no-enable-extensible-kv-cache``; ``kv_offloading_size`` (GiB over
    all ranks) and ``kv_offloading_backend`` (``native`` | ``lmcache``): vLLM's host KV tier
    (:mod:`vramplan.pools.offload`). ``data_parallel_size``, ``enable_expert_parallel``,
    ``all2all_backend``, ``num_redundant_experts`` (EPLB) and ``routing`` (``even`` | ``worst``):
    vLLM's MoE layout over ``tp × data_parallel_size`` GPUs (:mod:`vramplan.pools.ep`).
    """
    engine = (engine or "").strip().lower()
    spec = _resolve(model)
    g = gpu if isinstance(gpu, GPU) else get_gpu(gpu)
    _check(spec, engine, memory_fraction, max_model_len, avg_request_len,
           {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
            "block_size": block_size})
    bad = [n for n in cuda_graph_sizes if isinstance(n, bool) or not isinstance(n, int) or n < 1]
    if bad:
        raise WorkloadError(f"`cuda_graph_sizes` are batch sizes to capture, each >= 1; got {bad[0]}",
                            hint="e.g. `cuda_graph_sizes=512` (the largest), or `enforce_eager` for no graphs",
                            field="cuda_graph_sizes")
    if method not in ("analytic", "trace"):
        raise WorkloadError(f"invalid method {method!r}", hint="use analytic or trace")
    if enable_lora:
        _check_lora(engine, max_loras, max_lora_rank, max_cpu_loras)
    q = check_quant(quantization)
    if q == "mxfp4" and engine != "vllm":
        raise WorkloadError(f"`quantization=mxfp4` is modelled for vLLM only, not `engine={engine}`", hint="use engine vllm",
                            field="quantization")
    d = serving_dtype(spec, dtype)
    common: dict[str, Any] = {"tp": tp, "pp": pp, "quant": q, "dtype": d, "avg_request_len": avg_request_len,
                              "method": method}
    mm = _mm_settings(limit_mm_per_prompt, mm_processor_kwargs, skip_mm_profiling)
    sp = _spec_settings(spec, speculative_config)
    if sp.on and engine != "vllm":
        raise WorkloadError(f"speculative decoding is modelled for vLLM only, not {engine}", hint="use engine vllm",
                            field="speculative_config")
    if sp.on and pp > 1:
        raise WorkloadError("speculative decoding with pipeline parallelism is not modelled (the drafter sits on "
                            "the last stage)", hint="use tp instead of pp", field="speculative_config")
    if engine != "vllm" and (is_vlm(spec) or mm != MmSettings()):
        raise WorkloadError(f"serving a vision-language model is modelled for vLLM only ({spec.name} with "
                            f"{engine})", hint="use engine vllm")
    if engine == "trtllm" and engine_version:
        raise WorkloadError("TensorRT-LLM follows one release (1.0) in serve-plan", hint="drop `engine_version`",
                            field="engine_version")
    if engine != "vllm" and (extensible_kv_cache is not None or kv_offloading_size is not None):
        raise WorkloadError(f"the extensible KV cache and KV offloading are modelled for vLLM, not {engine}",
                            hint="drop them, or use engine vllm", field="engine_version")
    ep = EpSettings(data_parallel_size=data_parallel_size, enable_expert_parallel=enable_expert_parallel,
                    all2all_backend=all2all_backend, num_redundant_experts=num_redundant_experts,
                    routing=(routing or "even").strip().lower())
    if engine != "vllm" and (ep != EpSettings()):
        raise WorkloadError(f"data and expert parallelism are modelled for vLLM, not {engine}",
                            hint="drop them, or use engine vllm", field="enable_expert_parallel")
    if engine == "vllm":
        rel = Release.of(engine_version)
        vs = vllm.VllmSettings(
            mm=mm, spec=sp, engine_version=rel.text, extensible_kv_cache=extensible_kv_cache,
            kv_offloading_size=kv_offloading_size, kv_offloading_backend=(kv_offloading_backend or "native").strip().lower(),
            gpu_memory_utilization=memory_fraction,
            max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size, kv_cache_dtype=kv_cache_dtype, enforce_eager=enforce_eager,
            cuda_graph_sizes=tuple(cuda_graph_sizes), enable_prefix_caching=enable_prefix_caching,
            disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager, enable_lora=enable_lora,
            max_loras=max_loras, max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras,
            fully_sharded_loras=fully_sharded_loras, ep=ep)
        return vllm.plan(spec, g, settings=vs, **common)
    if engine == "sglang":
        ss = sglang.SglangSettings(
            mem_fraction_static=memory_fraction, context_length=max_model_len, max_running_requests=max_num_seqs,
            chunked_prefill_size=max_num_batched_tokens, kv_cache_dtype=kv_cache_dtype, page_size=block_size or 1,
            disable_cuda_graph=enforce_eager, engine_version=SglangRelease.of(engine_version).text)
        return sglang.plan(spec, g, settings=ss, **common)
    if engine == "tgi":
        if pp > 1:
            raise WorkloadError("TGI has no pipeline parallelism", hint="use --tp (TGI's --num-shard) instead")
        ts = tgi.TgiSettings(
            cuda_memory_fraction=memory_fraction if memory_fraction is not None else 1.0,
            max_total_tokens=max_model_len, max_batch_prefill_tokens=max_num_batched_tokens,
            max_concurrent_requests=max_num_seqs or 128, kv_cache_dtype=kv_cache_dtype,
            attention={None: "flashinfer", 1: "flashinfer", 16: "paged", 256: "flashdecoding"}.get(block_size, "paged"),
            engine_version=TgiRelease.of(engine_version).text)
        return tgi.plan(spec, g, settings=ts, **common)
    es = trtllm.TrtllmSettings(
        free_gpu_memory_fraction=memory_fraction if memory_fraction is not None else 0.9,
        max_seq_len=max_model_len, max_batch_size=max_num_seqs or 2048,
        max_num_tokens=max_num_batched_tokens or 8192, tokens_per_block=block_size or 32,
        kv_cache_dtype=kv_cache_dtype)
    return trtllm.plan(spec, g, settings=es, **common)


def _int_options(given: Mapping[str, Any] | None, name: str, keys: tuple[str, ...], *, low: int, what: str,
                 unknown: str, hint: str) -> dict[str, int]:
    """An engine option given as a mapping of integers: its keys known, its values integers >= ``low``."""
    d = dict(given or {})
    bad = sorted(set(d) - set(keys))
    if bad:
        raise WorkloadError(f"{name}: {unknown.format(bad[0])}", hint=f"{' and '.join(keys)} are", field=name)
    for k, v in d.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise WorkloadError(f"{name} {k} must be {what}, got {v!r}", hint=hint, field=name)
    return d


def _mm_settings(limits: Mapping[str, int] | None, kwargs: Mapping[str, Any] | None, skip: bool) -> MmSettings:
    """vLLM's multimodal settings from its own option forms."""
    limits = _int_options(limits, "limit_mm_per_prompt", ("image", "video"), low=0, what="a count",
                          unknown="unknown modality {!r}", hint="e.g. image=1")
    kw = _int_options(kwargs, "mm_processor_kwargs", ("max_pixels", "min_pixels"), low=1,
                      what="a positive pixel count", unknown="{!r} is not modelled", hint='e.g. {"max_pixels": 1003520}')
    return MmSettings(limit_image=limits.get("image", LIMIT_DEFAULT), limit_video=limits.get("video", LIMIT_DEFAULT),
                      max_pixels=kw.get("max_pixels"), min_pixels=kw.get("min_pixels"), skip_mm_profiling=skip)


def _spec_settings(spec: ModelSpec, config: Mapping[str, Any] | None) -> SpecSettings:
    """``speculative_config`` as vLLM 0.10.1.1 reads it (``SpeculativeConfig.__post_init__``: with no
    ``method``, DeepSeek-V3 without a ``model`` takes its own MTP layers, a path with ``eagle-`` or
    ``eagle3-`` is an EAGLE head, anything else a draft model)."""
    if not config:
        return SpecSettings()
    c = dict(config)
    bad = sorted(set(c) - {"method", "num_speculative_tokens", "model", "prompt_lookup_max", "prompt_lookup_min"})
    if bad:
        raise WorkloadError(f"speculative_config: {bad[0]!r} is not modelled",
                            hint="method, num_speculative_tokens and model are", field="speculative_config")
    k = c.get("num_speculative_tokens")
    if isinstance(k, bool) or not isinstance(k, int):
        raise WorkloadError(f"speculative_config needs num_speculative_tokens (an integer), got {k!r}",
                            hint='e.g. {"method": "eagle", "num_speculative_tokens": 3}', field="speculative_config")
    model = c.get("model")
    method = c.get("method")
    if method is None:
        if model is None and spec.model_type in MTP_TYPES:
            method = "deepseek_mtp"
        elif isinstance(model, str) and any(t in model.lower() for t in ("eagle-", "eagle3-")):
            method = "eagle"  # (0.10.1.1 detects an EAGLE3- path as eagle: give method eagle3 for one)
        else:
            method = "draft_model"
    draft = None
    if isinstance(model, str) and method in ("eagle", "eagle3"):
        draft = _resolve(model)
    sp = SpecSettings(method=str(method), num_speculative_tokens=k, draft=draft, draft_name=model or "")
    spec_rules.check(spec, sp)
    return sp


def _check_lora(engine: str, max_loras: int, rank: int, cpu: int | None) -> None:
    """vLLM's own checks (vllm/config/__init__.py ``LoRAConfig.__post_init__``/``verify_with_scheduler_config``)."""
    if engine != "vllm":
        raise WorkloadError(f"multi-LoRA serving is modelled for vLLM only, not {engine}", hint="use --engine vllm",
                            field="enable_lora")
    if isinstance(max_loras, bool) or not isinstance(max_loras, int) or max_loras < 1:
        raise WorkloadError(f"`max_loras` must be >= 1, got {max_loras!r}", hint="e.g. --max-loras 4", field="max_loras")
    if isinstance(rank, bool) or rank not in vllm.LORA_RANKS:
        raise WorkloadError(f"max_lora_rank ({rank}) must be one of {vllm.LORA_RANKS}.", hint="e.g. --max-lora-rank 16",
                            field="max_lora_rank")
    if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, int)):
        raise WorkloadError(f"`max_cpu_loras` must be a whole number, got {cpu!r}", hint="e.g. --max-cpu-loras 8",
                            field="max_cpu_loras")
    if cpu is not None and cpu < max_loras:
        raise WorkloadError(f"max_cpu_loras ({cpu}) must be >= max_loras ({max_loras})",
                            hint=f"use --max-cpu-loras {max_loras} or more", field="max_cpu_loras")


def largest_max_model_len(model: str | ModelSpec, gpu: str | GPU, **kwargs: Any) -> int:
    """The largest ``max_model_len`` with which the engine starts (0 if none), by bisection
    on :func:`serve_plan` (the engine's own check decides)."""
    spec = _resolve(model)
    kwargs.pop("max_model_len", None)

    def starts(n: int) -> bool:
        return serve_plan(spec, gpu, max_model_len=n, **kwargs).starts

    hi = spec.max_positions
    if starts(hi):
        return hi
    lo = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if mid and starts(mid):
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class Option:
    """One GPU/instance and TP size that serves the target, with its price."""

    gpu: str
    tp: int
    instance: str | None
    provider: str | None
    usd_per_hour: float | None
    """Price of the GPUs used (tp × the instance's price per GPU-hour)."""
    concurrency: float
    plan: ServePlan


def cheapest(model: str | ModelSpec, *, concurrency: int, context: int, engine: str = "vllm",
             tps: tuple[int, ...] = (1, 2, 4, 8), provider: str | None = None, limit: int = 10,
             progress: Callable[[str], None] | None = None, **kwargs: Any) -> list[Option]:
    """GPU/instance and TP size that hold ``concurrency`` requests of ``context`` tokens
    (``max_model_len = context``), cheapest per hour first (catalog prices, ``hardware.prices``)."""
    from vramplan.hardware.prices import list_instances

    if concurrency < 1 or context < 1:
        raise WorkloadError("target concurrency and context must be >= 1")
    spec = _resolve(model)
    kwargs.pop("max_model_len", None)
    kwargs.pop("avg_request_len", None)
    best: dict[tuple[str, int], Option] = {}
    for inst in list_instances(provider=provider):
        for tp in tps:
            if tp > inst.count:
                continue
            key = (inst.gpu, tp)
            price = inst.usd_per_gpu_hour * tp
            if key in best and (best[key].usd_per_hour or 0) <= price:
                continue
            try:
                p = serve_plan(spec, inst.gpu, engine=engine, tp=tp, max_model_len=context,
                               avg_request_len=context, **kwargs)
            except WorkloadError:
                continue
            if not p.starts or (p.concurrency_at_avg or 0) < concurrency:
                continue
            best[key] = Option(inst.gpu, tp, inst.name, inst.provider, price, p.concurrency_at_avg or 0.0, p)
    if not best:
        raise PlanError(f"no catalog GPU/instance with TP in {tps} serves {concurrency} requests of {context:,} tokens",
                        hint="lower `concurrency` or `context`, or quantise the weights (`quantization=fp8`) or "
                        "the KV cache (`kv_cache_dtype=fp8`)")
    ranked = sorted(best.values(), key=lambda o: (o.usd_per_hour or 0.0, o.tp))
    return ranked[:limit]


SWEEPS = ("utilization", "context")


def sweep(model: str | ModelSpec, gpu: str | GPU, *, over: str = "utilization",
          values: tuple[float, ...] | None = None, **kwargs: Any) -> list[tuple[float, ServePlan]]:
    """Plans across the memory fraction (``utilization``) or ``max_model_len`` (``context``)."""
    spec = _resolve(model)
    if over not in SWEEPS:
        raise WorkloadError(f"cannot sweep over {over!r}", hint=f"choose one of {' | '.join(SWEEPS)}")
    if over == "utilization":
        vals = values or tuple(round(0.5 + 0.05 * k, 2) for k in range(11))
        kwargs.pop("memory_fraction", None)
        return [(v, serve_plan(spec, gpu, memory_fraction=v, **kwargs)) for v in vals]
    top = spec.max_positions
    vals = values or tuple(float(v) for v in sorted({min(top, 2 ** k) for k in range(10, 21)}))
    kwargs.pop("max_model_len", None)
    return [(v, serve_plan(spec, gpu, max_model_len=int(v), **kwargs)) for v in vals]
