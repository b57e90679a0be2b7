"""TensorRT-LLM start-up sizing (PyTorch backend / LLM API), following TensorRT-LLM **1.0**.

- ``KvCacheConfig.free_gpu_memory_fraction`` (default 0.9): the share of the GPU memory
  that is free *after loading the weights* that becomes the KV pool
  (``docs/source/examples/kvcacheconfig.md``: "allocate 90% of free GPU memory (after loading
  weights) for KV cache"). The PyTorch backend first runs a forward at ``max_num_tokens``
  and sizes the pool from the memory still free after it (``tensorrt_llm/_torch/pyexecutor/_util.py``
  ``KvCacheCreator``); vramplan takes that forward's peak from its own estimate.
- ``tokens_per_block`` 32 (``KvCacheConfig``); every layer of a block is packed in one pool
  (``docs/source/features/kvcache.md``); ``max_batch_size`` 2048 and ``max_num_tokens`` 8192
  (``tensorrt_llm/llmapi/llm_args.py`` defaults).
- KV heads on a rank: ``ceil(kv_heads / tp)``.
- Logged as "[MemUsageChange] Allocated X GiB for max tokens in paged KV cache (N)".
- A pool smaller than ``max_seq_len`` still starts; TensorRT-LLM then clamps the attention
  window to the pool (a warning), which vramplan reports as a note.
- Approximated: the CUDA-graph and runtime buffers TensorRT-LLM keeps outside the pool are
  folded into the forward's peak.
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

VERSION = "1.0"


@dataclass(frozen=True, kw_only=True)
class TrtllmSettings:
    free_gpu_memory_fraction: float = 0.9
    max_seq_len: int | None = None
    max_batch_size: int = 2048
    max_num_tokens: int = 8192
    tokens_per_block: int = 32
    kv_cache_dtype: str = "auto"


def plan(spec: ModelSpec, gpu: GPU, *, tp: int = 1, pp: int = 1, quant: str = "none", dtype: str = "bf16",
         settings: TrtllmSettings = TrtllmSettings(), avg_request_len: int | None = None,
         method: str = "analytic") -> ServePlan:
    s = settings
    total, _ = usable_capacity(gpu)
    max_seq = s.max_seq_len or spec.max_positions
    layers = layer_specs(spec, tp=tp, pp=pp, kv_cache_dtype=s.kv_cache_dtype, engine="trtllm", sliding=False)
    per_token = bytes_per_token(layers)
    block_bytes = per_token * s.tokens_per_block
    out = outside(gpu, tp * pp)
    fwd = forward(spec, tokens=s.max_num_tokens, tp=tp, pp=pp, quant=quant, dtype=dtype, method=method)
    free = total - out.context - out.later - fwd.weights - fwd.activation_peak
    pool_budget = int(max(0, free) * s.free_gpu_memory_fraction)
    blocks = pool_budget // block_bytes
    tokens = blocks * s.tokens_per_block
    error = None
    if blocks <= 0:
        error = ("no GPU memory left for the KV cache after loading the weights (TensorRT-LLM fails to "
                 "create the KV cache manager; wording paraphrased)")
    conc = tokens / max_seq if max_seq else 0.0
    conc_avg = min(float(s.max_batch_size), tokens / avg_request_len) if avg_request_len else None
    notes = [f"Follows TensorRT-LLM {VERSION}: free_gpu_memory_fraction ({s.free_gpu_memory_fraction}) of the memory "
             f"free after the weights and a forward of max_num_tokens {s.max_num_tokens:,} "
             f"({fwd.activation_peak / GiB:.2f} GiB, {fwd.method})."]
    if error is None and tokens < max_seq:
        notes.append(f"The pool ({tokens:,} tokens) is smaller than max_seq_len ({max_seq:,}): TensorRT-LLM "
                     "starts but limits the attention window to the pool.")
    log = [f"[MemUsageChange] Allocated {blocks * block_bytes / GiB:.2f} GiB for max tokens in paged KV cache ({tokens})."] \
        if error is None else [f"Error: {error}"]
    st = {"free_gpu_memory_fraction": s.free_gpu_memory_fraction, "max_seq_len": max_seq,
          "max_batch_size": s.max_batch_size, "max_num_tokens": s.max_num_tokens,
          "tokens_per_block": s.tokens_per_block, "kv_cache_dtype": s.kv_cache_dtype, "quantization": quant,
          "dtype": dtype}
    return ServePlan(
        engine="trtllm", engine_version=VERSION, model=spec.name, gpu=gpu.key, tp=tp, pp=pp, settings=st,
        total_memory=total, budget=total, weights=fwd.weights, profile_peak=fwd.activation_peak,
        non_torch=out.later, context=out.context, cuda_graph=0, cuda_graph_in_budget=True,
        kv_available=pool_budget, kv_pool=blocks * block_bytes, block_size=s.tokens_per_block, blocks=blocks, tokens=tokens,
        bytes_per_token=per_token, max_model_len=max_seq, max_concurrency=conc, avg_request_len=avg_request_len,
        concurrency_at_avg=conc_avg, max_running=s.max_batch_size, starts=error is None, error=error,
        device_used=out.context + out.later + fwd.weights + fwd.activation_peak + blocks * block_bytes,
        log=tuple(log), command=command(spec, tp, pp, quant, st), profile_method=fwd.method,
        notes=tuple(notes), layer_kinds={layers[0].kind: len(layers)},
    )


def command(spec: ModelSpec, tp: int, pp: int, quant: str, st: dict[str, object]) -> str:
    parts = ["trtllm-serve", spec.hub_id or spec.name, "--backend pytorch"]
    if tp > 1:
        parts.append(f"--tp_size {tp}")
    if pp > 1:
        parts.append(f"--pp_size {pp}")
    parts += [f"--max_seq_len {st['max_seq_len']}", f"--max_batch_size {st['max_batch_size']}",
              f"--max_num_tokens {st['max_num_tokens']}",
              f"--kv_cache_free_gpu_memory_fraction {st['free_gpu_memory_fraction']}"]
    return " ".join(parts)
