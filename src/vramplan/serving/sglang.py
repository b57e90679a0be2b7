"""SGLang start-up sizing (the RadixAttention token pool), per release from 0.4.6 to 0.5.23
(:class:`vramplan.pools.sglang_release.SglangRelease`; ``docs/research/sglang-version-history.md``).

- Defaults by release and by nvidia-smi's total (MiB): ``mem_fraction_static`` (a TP table, then a
  reserved-memory table, from 0.5.3 reserved = 512 MiB + 1.5 × chunked_prefill_size + 2 ×
  cuda_graph_max_bs + TP × PP / 8 GiB …), ``chunked_prefill_size``, ``cuda_graph_max_bs``.
- ``ModelRunner.profile_max_num_token`` (every release): ``total_gpu_memory`` is the free memory
  after the distributed init (CUDA context + NCCL taken), ``available_gpu_memory`` the free
  memory after loading the weights; ``rest_memory = available − total × (1 − mem_fraction_static)``;
  ``max_num_token = int(rest_memory × 2^30 // cell_size)`` with ``cell_size = kv_heads(tp) ×
  head_dim × layers × 2 × element_size`` (MLA: ``(kv_lora_rank + qk_rope_head_dim) × layers ×
  element_size``); rounded down to ``page_size``. SGLang does not profile a forward: the
  ``1 − mem_fraction_static`` share is what activations, the request pool and CUDA graphs get.
- The pool: each layer's K and V buffers hold ``tokens + page_size`` rows; the request pool
  ``max_num_reqs`` rows (``+ 1`` before 0.4.7) of ``context_len + 4`` int32, ``max_num_reqs = clamp(tokens /
  context_len × 512, 2048, 4096)``. "Not enough memory. Please try to increase
  --mem-fraction-static." when the pool is empty. A pool smaller than ``context_len`` still
  starts; the scheduler caps one request's input at ``min(context_len, tokens) − 1``.
- Sliding-window layers get a full-length pool like every other layer (hybrid SWA pools, Mamba
  and NSA indexer caches are not modelled).
- Log: "Load weight end. … avail mem=A GB, mem usage=W GB.", "KV Cache is allocated. #tokens: N,
  K size: X GB, V size: Y GB" and "Memory pool end. avail mem=M GB" (SGLang divides by 2^30 and
  prints GB). The CUDA-graph capture's "mem usage" is vramplan's rough estimate (activations ×
  graph batch / chunk), not a rule SGLang follows.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramplan.engine.forward import forward
from vramplan.hardware.catalog import usable_capacity
from vramplan.hardware.gpu import GPU
from vramplan.models.spec import ModelSpec
from vramplan.pools.base import outside
from vramplan.pools.kvspec import bytes_per_token, layer_specs
from vramplan.pools.result import ServePlan
from vramplan.pools.sglang_release import NEWEST, SglangRelease
from vramplan.units import GiB, MiB

VERSION = NEWEST


@dataclass(frozen=True, kw_only=True)
class SglangSettings:
    mem_fraction_static: float | None = None
    context_length: int | None = None
    max_running_requests: int | None = None
    chunked_prefill_size: int | None = None
    max_total_tokens: int | None = None
    kv_cache_dtype: str = "auto"
    page_size: int = 1
    disable_cuda_graph: bool = False
    engine_version: str = NEWEST


def gpu_mem_mib(gpu: GPU) -> float:
    """``get_device_memory_capacity``: nvidia-smi's ``memory.total`` in MiB (the catalog's measured
    figure; else the CUDA total, a few hundred MiB lower)."""
    return (gpu.smi_total or usable_capacity(gpu)[0]) / MiB


def default_fraction(tp: int) -> float:
    """0.4.6's table by TP size (GPUs up to 81,920 MiB)."""
    if tp >= 16:
        return 0.79
    if tp >= 8:
        return 0.81
    if tp >= 4:
        return 0.85
    if tp >= 2:
        return 0.87
    return 0.88


def plan(spec: ModelSpec, gpu: GPU, *, tp: int = 1, pp: int = 1, quant: str = "none", dtype: str = "bf16",
         settings: SglangSettings = SglangSettings(), avg_request_len: int | None = None,
         method: str = "analytic") -> ServePlan:
    s = settings
    rel = SglangRelease.of(s.engine_version)
    total, _ = usable_capacity(gpu)
    gpu_mem = gpu_mem_mib(gpu)
    chunk = s.chunked_prefill_size or rel.chunked_prefill_size(gpu_mem)
    graph_bs = 0 if s.disable_cuda_graph else rel.cuda_graph_max_bs(gpu_mem, tp)
    context_len = s.context_length or spec.max_positions
    layers = layer_specs(spec, tp=tp, pp=pp, kv_cache_dtype=s.kv_cache_dtype, engine="sglang", sliding=False)
    mla = layers[0].kind == "mla"
    frac = s.mem_fraction_static if s.mem_fraction_static is not None else rel.mem_fraction_static(
        gpu_mem, tp=tp, pp=pp, chunk=chunk, graph_bs=graph_bs, mla=mla, graphs=not s.disable_cuda_graph)
    cell = bytes_per_token(layers)
    out = outside(gpu, tp * pp)
    fwd = forward(spec, tokens=chunk, tp=tp, pp=pp, quant=quant, dtype=dtype, method=method)
    total_free = total - out.context - out.later
    after_weights = fwd_free(total_free, fwd.weights)
    # GB floats as SGLang has them: rest = avail − total × (1 − f); tokens = int(rest × 2^30) // cell
    rest_gb = after_weights / GiB - total_free / GiB * (1 - frac)
    rest = int(rest_gb * GiB)
    tokens = max(0, rest // cell)
    if s.max_total_tokens:
        tokens = min(tokens, s.max_total_tokens)
    tokens = tokens // s.page_size * s.page_size
    error = None
    if tokens <= 0:
        error = "Not enough memory. Please try to increase --mem-fraction-static."
    max_num_reqs = rel.max_num_reqs(tokens, context_len, s.max_running_requests)
    max_reqs = rel.max_running(tokens, max_num_reqs, s.max_running_requests)
    pool = (tokens + s.page_size) * cell if error is None else 0
    req_pool = rel.req_pool_rows(max_num_reqs) * (context_len + 4) * 4 if error is None else 0
    graphs = fwd.activation_peak * graph_bs // chunk if graph_bs else 0
    reserve = int(total_free * (1 - frac))
    conc = tokens / context_len if context_len else 0.0
    conc_avg = min(float(max_reqs), tokens / avg_request_len) if avg_request_len else None
    notes = [
        f"Follows SGLang {rel.text} ModelRunner.profile_max_num_token: the pool is "
        f"mem_fraction_static ({frac}) of the free memory minus the weights (nvidia-smi total {gpu_mem:,.0f} MiB "
        "for the defaults).",
        f"Left for activations, the request pool and CUDA graphs: {reserve / GiB:.2f} GiB; vramplan predicts a "
        f"chunked-prefill forward of {chunk:,} tokens at {fwd.activation_peak / GiB:.2f} GiB ({fwd.method}), the request "
        f"pool at {req_pool / GiB:.2f} GiB and CUDA graphs up to batch {graph_bs} at {graphs / GiB:.2f} GiB (a rough "
        "estimate).",
        "Max concurrency counts tokens (SGLang's pool is per token); RadixAttention shares "
        "prefix tokens between requests, so real concurrency can be higher.",
    ]
    if fwd.activation_peak + graphs + req_pool > reserve and error is None:
        notes.append("The predicted activations + request pool + CUDA graphs exceed the reserved share: expect an "
                     "out-of-memory error under load; lower --mem-fraction-static or --chunked-prefill-size.")
    if error is None and tokens < context_len:
        notes.append(f"The pool ({tokens:,} tokens) is smaller than context_length ({context_len:,}): SGLang starts "
                     f"but caps one request's input at {min(context_len, tokens) - 1:,} tokens.")
    torch_dtype = "torch.float16" if dtype == "fp16" else "torch.bfloat16"
    if layers[0].dtype_bytes == 1:
        torch_dtype = "torch.float8_e5m2" if s.kv_cache_dtype == "fp8_e5m2" else "torch.float8_e4m3fn"
    alloc = rel.kv_line(tokens, pool // 2 if not mla else pool, pool // 2 if not mla else 0, mla, torch_dtype)
    gb = 1 << 30
    log = [f"Load weight end. avail mem={after_weights / gb:.2f} GB, mem usage={fwd.weights / gb:.2f} GB.",
           alloc if error is None else f"RuntimeError: {error}"]
    if error is None:
        log.append(f"Memory pool end. avail mem={(after_weights - pool - req_pool) / gb:.2f} GB")
    st = {"mem_fraction_static": frac, "context_length": context_len, "max_running_requests": max_reqs,
          "chunked_prefill_size": chunk, "cuda_graph_max_bs": graph_bs, "kv_cache_dtype": s.kv_cache_dtype,
          "page_size": s.page_size, "quantization": quant, "dtype": dtype, "gpu_mem_mib": round(gpu_mem),
          "max_num_reqs": max_num_reqs}
    kinds = {layers[0].kind: len(layers)}
    return ServePlan(
        engine="sglang", engine_version=rel.text, model=spec.name, gpu=gpu.key, tp=tp, pp=pp, settings=st,
        total_memory=total, budget=int(total_free * frac), weights=fwd.weights, profile_peak=fwd.activation_peak,
        non_torch=out.later, context=out.context, cuda_graph=graphs, cuda_graph_in_budget=False,
        kv_available=rest, kv_pool=pool, block_size=s.page_size, blocks=tokens // s.page_size, tokens=tokens,
        bytes_per_token=cell, max_model_len=context_len, max_concurrency=conc, avg_request_len=avg_request_len,
        concurrency_at_avg=conc_avg, max_running=max_reqs, starts=error is None, error=error,
        device_used=out.context + out.later + fwd.weights + pool + req_pool + fwd.activation_peak + graphs,
        log=tuple(log), command=command(spec, tp, pp, quant, st), profile_method=fwd.method,
        notes=tuple(notes), layer_kinds=kinds,
    )


def fwd_free(total_free: int, weights: int) -> int:
    """Free memory after loading the weights (``available_gpu_memory``)."""
    return total_free - weights


def command(spec: ModelSpec, tp: int, pp: int, quant: str, st: dict[str, object]) -> str:
    parts = ["python -m sglang.launch_server --model-path", spec.hub_id or spec.name]
    if tp > 1:
        parts.append(f"--tp {tp}")
    if pp > 1:
        parts.append(f"--pp-size {pp}")
    parts += [f"--mem-fraction-static {st['mem_fraction_static']}", f"--context-length {st['context_length']}",
              f"--chunked-prefill-size {st['chunked_prefill_size']}",
              f"--max-running-requests {st['max_running_requests']}"]
    if st["kv_cache_dtype"] != "auto":
        parts.append(f"--kv-cache-dtype {st['kv_cache_dtype']}")
    if quant != "none":
        parts.append(f"--quantization {quant}")
    if not st["cuda_graph_max_bs"]:
        parts.append("--disable-cuda-graph")
    return " ".join(parts)
