"""vLLM's own KV-cache sizing functions called on the same inputs as vramplan's.

vLLM pins its own torch, so it is never installed into this project's environment. The
test runs when vLLM's pure-Python modules import, e.g. from a wheel unpacked next to the
few small packages they import (no GPU, no vLLM extension needed)::

    pip download vllm==0.10.1.1 --no-deps -d /tmp/vllm_dl
    unzip -q /tmp/vllm_dl/vllm-0.10.1.1-*.whl 'vllm/*.py' -d /tmp/vllm_dl/src
    pip install --target /tmp/vllm_deps --no-deps cachetools cbor2 cloudpickle setproctitle \\
        pyzmq msgspec blake3 pybase64 prometheus_client fastapi starlette opentelemetry-api \\
        opentelemetry-sdk opentelemetry-semantic-conventions openai sniffio openai_harmony aiohttp \\
        multidict attrs yarl propcache aiohappyeyeballs aiosignal frozenlist diskcache py-cpuinfo
    PYTHONPATH=src:/tmp/vllm_dl/src:/tmp/vllm_deps pytest tests/test_serving_vllm_reference.py

Elsewhere it is skipped.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vramplan.models.catalog import resolve
from vramplan.pools import vllm as ours
from vramplan.pools.kvspec import LayerKV, layer_specs
from vramplan.units import GiB

utils = pytest.importorskip("vllm.v1.core.kv_cache_utils", reason="vLLM's Python sources are not importable here")
iface = pytest.importorskip("vllm.v1.kv_cache_interface")
torch = pytest.importorskip("torch")


def _config(max_model_len: int, block_size: int = 16, mnbt: int = 8192) -> SimpleNamespace:
    return SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=max_model_len),
        cache_config=SimpleNamespace(block_size=block_size, num_gpu_blocks_override=None),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=mnbt, disable_hybrid_kv_cache_manager=False),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
    )


def _theirs(layers: tuple[LayerKV, ...], block_size: int) -> dict[str, object]:
    dtype = {1: torch.float8_e4m3fn, 2: torch.bfloat16}
    specs: dict[str, object] = {}
    for i, x in enumerate(layers):
        common = dict(block_size=block_size, num_kv_heads=x.kv_heads, head_size=x.head_size,
                      dtype=dtype[x.dtype_bytes], use_mla=x.kind == "mla")
        if x.kind == "sliding":
            specs[f"layers.{i}"] = iface.SlidingWindowSpec(sliding_window=x.window, **common)
        else:
            specs[f"layers.{i}"] = iface.FullAttentionSpec(**common)
    return specs


CASES = [
    ("llama-3.1-8b", {}, 32768, 20 * GiB + 12345),
    ("llama-3.1-8b", {"tp": 2, "kv_cache_dtype": "fp8"}, 131072, 7 * GiB),
    ("llama-3.1-70b", {"tp": 16}, 8192, 30 * GiB),
    ("gemma-2-9b", {}, 8192, 6 * GiB + 777),
    ("deepseek-v3", {"tp": 8}, 16384, 9 * GiB),
    ("mistral-7b", {}, 32768, 11 * GiB),
]


@pytest.mark.parametrize("model, kw, max_len, avail", CASES)
def test_get_kv_cache_config_agrees(model: str, kw: dict[str, object], max_len: int, avail: int) -> None:
    layers = layer_specs(resolve(model), **kw)  # type: ignore[arg-type]
    cfg = _config(max_len)
    specs = _theirs(layers, 16)
    theirs = utils.get_kv_cache_config(cfg, specs, avail)
    mine = ours.kv_cache_config(layers, avail, 16)
    assert theirs.num_blocks == mine.num_blocks
    assert len(theirs.kv_cache_groups) == len(mine.groups)
    assert sum(t.size for t in theirs.kv_cache_tensors) == mine.pool_bytes
    assert utils.get_max_concurrency_for_kv_cache_config(cfg, theirs) == pytest.approx(
        ours.max_concurrency(mine, max_len, 16, 8192))
    assert utils.max_memory_usage_bytes(cfg, specs.values()) == ours.needed_memory(layers, max_len, 16, 8192)


@pytest.mark.parametrize("avail", [0, 1 * GiB, 3 * GiB + 5])
def test_check_enough_kv_cache_memory_agrees(avail: int) -> None:
    layers = layer_specs(resolve("llama-3.1-8b"))
    cfg = _config(131072)
    mine = ours.check_enough(layers, avail, 131072, 16, 8192)
    with pytest.raises(ValueError) as e:
        utils.check_enough_kv_cache_memory(cfg, _theirs(layers, 16), avail)
    assert " ".join(str(e.value).split()) == " ".join((mine or "").split())
