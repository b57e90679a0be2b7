"""vLLM's KV cache for MLA models (DeepSeek-V2/V3) per release: one latent vector of
``kv_lora_rank + qk_rope_head_dim`` values per token and layer in every release, in blocks whose
size the MLA attention backend sets (:meth:`.Release.mla_block`; docs/research/vllm-mla-kv.md,
file:line per release). Each test states the rule and checks the plan against its arithmetic."""

from __future__ import annotations

import math

import pytest

from vramplan.models.catalog import resolve
from vramplan.pools.vllm_release import Release
from vramplan.serving.api import serve_plan

LITE = resolve("deepseek-v2-lite")  # 27 MLA layers, kv_lora_rank 512 + rope 64, qk_nope 128


def plan(version: str, gpu: str = "h100-sxm", **kw: object):  # type: ignore[no-untyped-def]
    kw.setdefault("max_model_len", 32768)
    return serve_plan("deepseek-v2-lite", gpu, engine_version=version, **kw)


# (release, GPU, kv_cache_dtype) → (block size, the rule's backend); Hopper 9.0, B200 10.0, B300 10.3, A100 8.0
CASES = [
    ("0.9.2", "h100-sxm", "auto", 64, "FLASHMLA"),        # FlashMLA forced on Hopper (0.9.2 cuda.py:155-166)
    ("0.10.0", "b200", "auto", 16, "TRITON_MLA"),         # CUTLASS MLA only when asked for (0.10.0 cuda.py:165-170)
    ("0.10.1.1", "b200", "auto", 128, "CUTLASS_MLA"),     # Blackwell default from 0.10.1 (cuda.py:142-178)
    ("0.12.0", "b300", "auto", 16, "TRITON_MLA"),         # is_device_capability(100): 10.0 only
    ("0.13.0", "b300", "auto", 128, "CUTLASS_MLA"),       # the 10.x family from 0.13.0
    ("0.14.1", "a100-sxm4-80gb", "auto", 16, "TRITON_MLA"),
    ("0.16.0", "b200", "auto", 64, "FLASHINFER_MLA"),     # FlashInfer MLA when qk_nope_head_dim is 128
    ("0.17.1", "h100-sxm", "fp8", 64, "FLASHMLA"),
    ("0.18.0", "h100-sxm", "auto", 16, "FLASH_ATTN_MLA"),  # the backend's preferred size from 0.18.0
    ("0.18.0", "h100-sxm", "fp8", 64, "FLASHMLA"),        # FlashAttention MLA takes no fp8 cache
    ("0.20.2", "b200", "auto", 32, "FLASHINFER_MLA"),     # 16 not taken: its smallest, 32
    ("0.33.0", "rtx-5090", "auto", 16, "TRITON_MLA"),
    ("0.34.0", "h100-sxm", "auto", 64, "FLASH_ATTN_MLA"),  # the default 64 is taken as it is
    ("0.34.0", "b200", "fp8", 64, "FLASHINFER_MLA"),
]


@pytest.mark.parametrize("version, gpu, kv, block, backend", CASES)
def test_the_mla_block_size_and_pool_follow_the_release(version: str, gpu: str, kv: str, block: int,
                                                        backend: str) -> None:
    """The plan's pool is ``num_blocks = available // (block × 576 × dtype) // layers`` with the
    release's MLA block size, and "Maximum concurrency" is blocks / ⌈max_model_len / block⌉."""
    p = plan(version, gpu, kv_cache_dtype=kv, max_model_len=16384, enforce_eager=True, tp=2 if gpu == "rtx-5090" else 1,
             **({"extensible_kv_cache": False} if version == "0.34.0" else {}))
    assert p.starts
    dtype = 1 if kv == "fp8" else 2
    per_token = (LITE.kv_lora_rank + LITE.qk_rope_head_dim) * dtype
    assert per_token == (576 * dtype) and p.bytes_per_token == LITE.layers * per_token
    assert p.block_size == block == p.settings["block_size"]
    page = block * per_token
    assert p.blocks == p.kv_available // page // LITE.layers
    assert p.kv_pool == p.blocks * page * LITE.layers
    assert p.max_concurrency == pytest.approx(p.blocks / math.ceil(16384 / block))
    assert any(f"picks {backend}" in n and f"blocks of {block} tokens" in n for n in p.notes)
    assert "--block-size" not in p.command


def test_a_given_block_size_is_overridden_to_0_17_and_kept_from_0_18() -> None:
    """To 0.11.0 FlashMLA's 64 replaces any other size; 0.11.1–0.17.x keep a multiple of it;
    from 0.18.0 ``update_block_size_for_backend`` returns early when the user set one."""
    assert plan("0.10.2", block_size=128).block_size == 64
    assert plan("0.11.1", block_size=128).block_size == 128
    assert plan("0.17.1", block_size=32).block_size == 64
    assert plan("0.18.0", block_size=32).block_size == 32
    b200 = plan("0.14.1", "b200", block_size=64)
    assert b200.block_size == 128 and any("overrides --block-size 64" in n for n in b200.notes)


def test_the_mla_cache_is_not_split_by_tp() -> None:
    """``num_kv_heads=1`` for MLA in every release: the per-token bytes do not shrink with TP."""
    one, four = plan("0.20.2", tp=1), plan("0.20.2", tp=4)
    assert one.bytes_per_token == four.bytes_per_token == LITE.layers * 576 * 2


def test_the_rule_outside_the_table() -> None:
    """The branches the catalog's models do not reach: a qk_nope_head_dim FlashInfer MLA does not
    take goes to CUTLASS MLA (128) on Blackwell, and 0.16–0.17 need it to be exactly 128."""
    assert Release.of("0.20.2").mla_block("10.0", kv_fp8=False, qk_nope_head_dim=192) == (128, "CUTLASS_MLA")
    assert Release.of("0.20.2").mla_block("10.0", kv_fp8=False, qk_nope_head_dim=64) == (32, "FLASHINFER_MLA")
    assert Release.of("0.16.0").mla_block("10.0", kv_fp8=False, qk_nope_head_dim=64) == (128, "CUTLASS_MLA")
