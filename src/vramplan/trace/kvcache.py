"""KV caches for generation: transformers' real cache classes, by the workload's KV dtype.

- ``auto``: ``DynamicCache`` (``generate``'s default; grows by ``torch.cat``) or, on request,
  ``StaticCache`` (preallocated to prompt + new tokens).
- ``fp8``: ``QuantizedCache(backend="fp8")``: float8 storage with a per-tensor scale; every
  step dequantises the whole cache into compute-dtype temporaries.
- ``int8`` / ``int4``: transformers' ``QuantizedLayer`` logic (a full-precision residual of up
  to 128 recent tokens, re-quantised group-wise when it fills) with the HQQ storage layout
  emulated (its backend package is not installed here): packed ``uint8`` values plus a scale
  and a zero point per 64-element group, in the compute dtype.
- ``fp32`` / ``bf16`` / ``fp16`` differing from the compute dtype: a ``DynamicCache`` whose
  layers store in that dtype and hand back compute-dtype copies.
"""

from __future__ import annotations

from typing import Any

import torch

from ..workload import KVDtype

GROUP = 64
RESIDUAL = 128
_FLOAT = {KVDtype.FP32: torch.float32, KVDtype.BF16: torch.bfloat16, KVDtype.FP16: torch.float16}


def make_cache(config: Any, *, kind: str, max_len: int, kv_dtype: KVDtype, compute: torch.dtype) -> tuple[Any, str]:
    """A cache object and a sentence describing it."""
    from transformers import DynamicCache, QuantizedCache, StaticCache
    from transformers.cache_utils import Cache

    if kv_dtype is KVDtype.FP8:
        return QuantizedCache(backend="fp8", config=config), "KV cache: transformers QuantizedCache(backend='fp8')"
    layers = int(getattr(config.get_text_config(decoder=True), "num_hidden_layers", 0) or 0) if config else 0
    if kv_dtype in (KVDtype.INT8, KVDtype.INT4):
        nbits = 8 if kv_dtype is KVDtype.INT8 else 4
        cache = Cache(layers=[_group_layer(nbits) for _ in range(layers)])
        return cache, (f"KV cache: {nbits}-bit group-wise quantisation (group {GROUP}, residual {RESIDUAL} tokens, "
                       "HQQ layout emulated)")
    store = _FLOAT.get(kv_dtype)
    if store is not None and store != compute:
        return Cache(layers=[_cast_layer(store) for _ in range(layers)]), f"KV cache stored as {kv_dtype}"
    if kind == "static":
        return StaticCache(config=config, max_cache_len=max_len), "KV cache: transformers StaticCache"
    return DynamicCache(config=config), "KV cache: transformers DynamicCache"


def _group_layer(nbits: int) -> Any:
    from transformers.cache_utils import QuantizedLayer

    class GroupQuantizedLayer(QuantizedLayer):
        """``QuantizedLayer`` with HQQ-like storage: packed values, per-group scale and zero."""

        def _quantize(self, tensor: torch.Tensor, axis: int = 0) -> Any:  # type: ignore[override]
            n = tensor.numel()
            groups = -(-n // GROUP)
            packed = torch.empty((n * nbits + 7) // 8, dtype=torch.uint8, device=tensor.device)
            scale = torch.empty(groups, dtype=tensor.dtype, device=tensor.device)
            zero = torch.empty(groups, dtype=tensor.dtype, device=tensor.device)
            return packed, scale, zero, tuple(tensor.shape), tensor.dtype

        def _dequantize(self, qtensor: Any) -> torch.Tensor:
            packed, _scale, _zero, shape, dtype = qtensor
            return torch.empty(shape, dtype=dtype, device=packed.device)

    return GroupQuantizedLayer(nbits=nbits, q_group_size=GROUP, residual_length=RESIDUAL)


def _cast_layer(store: torch.dtype) -> Any:
    from transformers.cache_utils import DynamicLayer

    class CastLayer(DynamicLayer):
        """A ``DynamicLayer`` storing in ``store`` and returning compute-dtype copies."""

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            dtype = key_states.dtype
            keys, values = super().update(key_states.to(store), value_states.to(store), *args, **kwargs)
            return keys.to(dtype), values.to(dtype)

    return CastLayer()
