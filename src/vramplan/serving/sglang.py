"""SGLang start-up sizing (the RadixAttention token pool), following SGLang **0.4.6**.

- ``mem_fraction_static`` default by TP size: 0.88 (tp 1), 0.87 (≥ 2), 0.85 (≥ 4), 0.81
  (≥ 8), 0.79 (≥ 16); ``chunked_prefill_size`` 2048 on GPUs under 25,000 MB else 8192;
  ``cuda_graph_max_bs`` 8 / 160 likewise (``python/sglang/srt/server_args.py``
  ``ServerArgs.__post_init__``). Newer releases derive the fraction from a reserved-memory
  rule instead; pass ``--mem-fraction-static`` to pin it.
- ``ModelRunner.profile_max_num_token`` (``python/sglang/srt/model_executor/model_runner.py``):
  ``total_gpu_memory`` is the free memory after the distributed init (CUDA context + NCCL
  taken), ``available_gpu_memory`` the free memory after loading the weights;
  ``rest_memory = available − total × (1 − mem_fraction_static)``;
  ``max_num_token = int(rest_memory × 2^30 // cell_size)`` with ``cell_size = kv_heads(tp) ×
  head_dim × layers × 2 × element_size`` (MLA: ``(kv_lora_rank + qk_rope_head_dim) × layers
  × element_size``); rounded down to ``page_size`` (1). SGLang does not profile a forward:
  the ``1 − mem_fraction_static`` share is what activations and CUDA graphs get.
- ``init_memory_pool``: "Not enough memory. Please try to increase --mem-fraction-static."
  when the pool is empty; ``max_num_reqs = min(max(int(tokens / context_len × 512), 2048), 4096)``
  unless ``--max-running-requests`` is given. A pool smaller than ``context_len`` still
  starts; the scheduler caps one request's input at ``min(context_len, tokens) − 1``.
- Sliding-window layers get a full-length pool like every other layer (0.4.6 has no
  separate SWA pool; later releases add one for hybrid models).
- Log: "KV Cache is allocated. #tokens: N, K size: X GB, V size: Y GB" (SGLang divides by
  2^30 and prints GB).
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
from vramplan.units import GiB

VERSION = "0.4.6"


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


def default_fraction(tp: int) -> float:
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
    total, _ = usable_capacity(gpu)
    frac = s.mem_fraction_static if s.mem_fraction_static is not None else default_fraction(tp)
    small = gpu.capacity < 25_000 * 10**6
    chunk = s.chunked_prefill_size or (2048 if small else 8192)
    graph_bs = 0 if s.disable_cuda_graph else (8 if small else 160)
    context_len = s.context_length or spec.max_positions
    layers = layer_specs(spec, tp=tp, pp=pp, kv_cache_dtype=s.kv_cache_dtype, engine="sglang", sliding=False)
    cell = bytes_per_token(layers)
    out = outside(gpu, tp * pp)
    fwd = forward(spec, tokens=chunk, tp=tp, pp=pp, quant=quant, dtype=dtype, method=method)
    total_free = total - out.context - out.later
    rest = int(fwd_free(total_free, fwd.weights) - total_free * (1 - frac))
    tokens = max(0, rest // cell)
    if s.max_total_tokens:
        tokens = min(tokens, s.max_total_tokens)
    tokens = tokens // s.page_size * s.page_size
    error = None
    if tokens <= 0:
        error = "Not enough memory. Please try to increase --mem-fraction-static."
    max_reqs = s.max_running_requests or min(max(int(tokens / max(context_len, 1) * 512), 2048), 4096)
    pool = tokens * cell
    graphs = fwd.activation_peak * graph_bs // chunk if graph_bs else 0
    reserve = int(total_free * (1 - frac))
    conc = tokens / context_len if context_len else 0.0
    conc_avg = min(float(max_reqs), tokens / avg_request_len) if avg_request_len else None
    notes = [
        f"Follows SGLang {VERSION} ModelRunner.profile_max_num_token: the pool is "
        f"mem_fraction_static ({frac}) of the free memory minus the weights.",
        f"Left for activations and CUDA graphs: {reserve / GiB:.2f} GiB; vramplan predicts a chunked-prefill "
        f"forward of {chunk:,} tokens at {fwd.activation_peak / GiB:.2f} GiB ({fwd.method}) and CUDA graphs up to "
        f"batch {graph_bs} at {graphs / GiB:.2f} GiB.",
        "Max concurrency counts tokens (SGLang's pool is per token, page_size 1); RadixAttention shares "
        "prefix tokens between requests, so real concurrency can be higher.",
    ]
    if fwd.activation_peak + graphs > reserve and error is None:
        notes.append("The predicted activations + CUDA graphs exceed the reserved share: expect an out-of-memory "
                     "error under load; lower --mem-fraction-static or --chunked-prefill-size.")
    if error is None and tokens < context_len:
        notes.append(f"The pool ({tokens:,} tokens) is smaller than context_length ({context_len:,}): SGLang starts "
                     f"but caps one request's input at {min(context_len, tokens) - 1:,} tokens.")
    kv_gib = pool / 2 / GiB
    if layers[0].kind == "mla":
        alloc = f"KV Cache is allocated. #tokens: {tokens}, KV size: {pool / GiB:.2f} GB"
    else:
        alloc = f"KV Cache is allocated. #tokens: {tokens}, K size: {kv_gib:.2f} GB, V size: {kv_gib:.2f} GB"
    log = [f"Load weight end. mem usage={fwd.weights / GiB:.2f} GB",
           alloc if error is None else f"RuntimeError: {error}"]
    st = {"mem_fraction_static": frac, "context_length": context_len, "max_running_requests": max_reqs,
          "chunked_prefill_size": chunk, "cuda_graph_max_bs": graph_bs, "kv_cache_dtype": s.kv_cache_dtype,
          "page_size": s.page_size, "quantization": quant, "dtype": dtype}
    kinds = {layers[0].kind: len(layers)}
    return ServePlan(
        engine="sglang", engine_version=VERSION, model=spec.name, gpu=gpu.key, tp=tp, pp=pp, settings=st,
        total_memory=total, budget=int(total_free * frac), weights=fwd.weights, profile_peak=fwd.activation_peak,
        non_torch=out.later, context=out.context, cuda_graph=graphs, cuda_graph_in_budget=False,
        kv_available=rest, kv_pool=pool, block_size=s.page_size, blocks=tokens // s.page_size, tokens=tokens,
        bytes_per_token=cell, max_model_len=context_len, max_concurrency=conc, avg_request_len=avg_request_len,
        concurrency_at_avg=conc_avg, max_running=max_reqs, starts=error is None, error=error,
        device_used=out.context + out.later + fwd.weights + pool + fwd.activation_peak + graphs,
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
