"""KV-cache layout of one GPU rank, per layer type, as inference engines size it.

One :class:`LayerKV` per attention layer of the first pipeline stage, with the KV heads
*this rank* holds. The rules, with where they come from:

- **Full attention** — ``2 · block_size · kv_heads · head_size · dtype_bytes`` per block
  per layer (vLLM 0.10.1.1 ``vllm/v1/kv_cache_interface.py`` ``AttentionSpec.page_size_bytes``,
  ``coef = 2``); the same per-token figure in SGLang's ``cell_size``
  (``python/sglang/srt/model_executor/model_runner.py`` ``profile_max_num_token``), TGI's
  ``total_cache_size`` (``server/text_generation_server/models/flash_causal_lm.py`` warmup)
  and TensorRT-LLM's KV pool.
- **Sliding window** (Mistral v0.1, Gemma 2/3 local layers) — the same page size; vLLM's
  hybrid KV-cache manager keeps only ``window − 1 + max_num_batched_tokens`` tokens of
  them per request (``SlidingWindowSpec.max_memory_usage_bytes``, + 1 block).
- **MLA** (DeepSeek-V2/V3) — one "head" of ``kv_lora_rank + qk_rope_head_dim`` values,
  ``coef = 1``, not split by TP (vLLM ``ModelConfig.get_head_size`` / ``get_num_kv_heads``
  returns 1 for MLA; SGLang's MLA ``cell_size``). The same 576 × dtype bytes in every vLLM
  release 0.9.2 … 0.34.0 (``AttentionSpec`` with ``use_mla`` to 0.10.2, ``MLAAttentionSpec`` from
  0.11.0; no page padding for DeepSeek-V2/V3); the block size comes from the MLA attention
  backend (:meth:`.vllm_release.Release.mla_block`; docs/research/vllm-mla-kv.md). DeepSeek-V3.2's
  ``fp8_ds_mla`` (656 B) and indexer cache (132 B) are not modelled (no catalog model uses them).
- **TP** — KV heads are split across ranks; when ``tp > kv_heads`` vLLM and SGLang replicate
  them so that every rank keeps ``max(1, kv_heads // tp)`` (vLLM
  ``ModelConfig.get_num_kv_heads``; SGLang copies it), TensorRT-LLM ``ceil(kv_heads / tp)``
  (= 1 there too), while TGI keeps *all* KV heads on every rank
  (``num_kv_heads // world_size if > 0 else num_kv_heads`` in ``flash_causal_lm.py``). A TP
  size that does not divide the KV heads when ``tp ≤ kv_heads`` cannot shard the K/V
  projections in any of them, so it is refused.
- **kv_cache_dtype** — ``auto`` is the model dtype (2 B for bf16/fp16), ``fp8`` 1 B
  (fp8_e4m3 / fp8_e5m2; per-tensor scales are a few bytes per layer and not counted).
"""

from __future__ import annotations

from dataclasses import dataclass

from vramplan.errors import WorkloadError
from vramplan.models.spec import Family, ModelSpec

KV_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bf16", "fp16", "fp32")
_DTYPE_BYTES = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "bf16": 2, "bfloat16": 2, "fp16": 2,
                "float16": 2, "fp32": 4, "float32": 4}


@dataclass(frozen=True)
class LayerKV:
    """The cache one attention layer keeps on one rank."""

    kind: str
    """``full`` | ``sliding`` | ``mla``."""
    kv_heads: int
    """KV heads on this rank (1 for MLA)."""
    head_size: int
    dtype_bytes: int
    window: int | None = None

    @property
    def bytes_per_token(self) -> int:
        coef = 1 if self.kind == "mla" else 2
        return coef * self.kv_heads * self.head_size * self.dtype_bytes

    def page_bytes(self, block_size: int) -> int:
        """One block of ``block_size`` tokens of this layer (vLLM's ``page_size_bytes``)."""
        return block_size * self.bytes_per_token


def kv_dtype_bytes(kv_cache_dtype: str, model_dtype: str) -> int:
    """Bytes per cached value: ``auto`` follows the model's dtype (fp32 models serve in 16 bit)."""
    key = kv_cache_dtype.strip().lower()
    if key == "auto":
        return min(2, _DTYPE_BYTES.get(model_dtype.lower(), 2))
    if key not in _DTYPE_BYTES:
        raise WorkloadError(f"invalid kv_cache_dtype {kv_cache_dtype!r}", hint=f"choose one of {' | '.join(KV_DTYPES)}")
    return _DTYPE_BYTES[key]


def kv_heads_per_rank(total: int, tp: int, engine: str) -> int:
    """KV heads one TP rank caches, by each engine's rule (see the module docstring)."""
    if tp <= total and total % tp:
        divisors = [d for d in range(1, total + 1) if total % d == 0]
        raise WorkloadError(
            f"tensor_parallel_size {tp} does not divide the model's {total} KV heads",
            hint=f"use a TP size in {', '.join(map(str, divisors))} or a multiple of {total} "
            "(above it the KV heads are replicated: vLLM/SGLang/TensorRT-LLM keep 1 per rank, "
            "TGI all of them)")
    if engine == "tgi":
        return total // tp if total // tp > 0 else total
    if engine == "trtllm":
        return -(-total // tp)
    return max(1, total // tp)


def check_tp(spec: ModelSpec, tp: int, pp: int) -> None:
    """TP must divide the attention heads (vLLM ``ParallelConfig``/``ModelConfig.verify_with_parallel_config``:
    "Total number of attention heads (…) must be divisible by tensor parallel size (…)");
    PP must not exceed the layers."""
    if tp < 1 or pp < 1:
        raise WorkloadError(f"TP and PP sizes must be positive, got tp={tp}, pp={pp}")
    if spec.heads and spec.heads % tp:
        raise WorkloadError(
            f"Total number of attention heads ({spec.heads}) must be divisible by tensor parallel size ({tp})",
            hint="choose a TP size that divides the attention heads")
    if spec.layers and pp > spec.layers:
        raise WorkloadError(f"pipeline_parallel_size {pp} exceeds the model's {spec.layers} layers")


def stage_layers(layers: int, pp: int) -> int:
    """Layers on the largest pipeline stage (vLLM ``get_pp_indices`` gives the remainder to
    the later stages; the stage with most layers holds the fewest blocks, and
    ``unify_kv_cache_configs`` makes every stage use the smallest block count)."""
    return -(-layers // pp)


def layer_specs(spec: ModelSpec, *, tp: int = 1, pp: int = 1, kv_cache_dtype: str = "auto",
                engine: str = "vllm", sliding: bool = True) -> tuple[LayerKV, ...]:
    """The KV layers of the fullest pipeline stage on one TP rank.

    ``sliding`` False treats sliding-window layers as full attention (engines without a
    hybrid KV manager, or vLLM's ``--disable-hybrid-kv-cache-manager``).
    """
    if not spec.is_decoder or not spec.layers:
        raise WorkloadError(f"{spec.name} is not a decoder-only language model",
                            hint="serving plans need a decoder LLM (see `vramplan models`)")
    check_tp(spec, tp, pp)
    vb = kv_dtype_bytes(kv_cache_dtype, spec.dtype)
    n = stage_layers(spec.layers, pp)
    if spec.family is Family.MLA and spec.kv_lora_rank:
        return tuple(LayerKV("mla", 1, spec.kv_lora_rank + spec.qk_rope_head_dim, vb) for _ in range(n))
    shape = spec.shape
    heads = kv_heads_per_rank(shape.kv_heads, tp, engine)
    head_size = shape.head_dim
    n_sliding = 0
    if sliding and spec.sliding_window and spec.sliding_layers:
        n_sliding = round(spec.sliding_layers * n / spec.layers)
    full = [LayerKV("full", heads, head_size, vb) for _ in range(n - n_sliding)]
    slide = [LayerKV("sliding", heads, head_size, vb, spec.sliding_window) for _ in range(n_sliding)]
    return tuple(full + slide)


def bytes_per_token(layers: tuple[LayerKV, ...]) -> int:
    """KV bytes one token costs on this rank if every layer kept it (all layers summed)."""
    return sum(layer.bytes_per_token for layer in layers)
