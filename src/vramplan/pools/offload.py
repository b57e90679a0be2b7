"""vLLM's KV offload tier (``--kv-offloading-size S --kv-offloading-backend native|lmcache``): the
host RAM it takes, the tokens it holds, and what it changes on the GPU, per release.

Read in the sdists (docs/research/vllm-kv-offload.md; paths inside each sdist's ``vllm/``):

* The flags appear in 0.11.1 (engine/arg_utils.py:936-939). ``S`` is the total over the ``W`` =
  TP × PP ranks (config/cache.py:407-411 in 0.34.0).
* **native** (``OffloadingConnector``; ``VLLM_USE_SIMPLE_KV_OFFLOAD`` is off by default): in
  0.11.1–0.13.x the flag path writes ``num_cpu_blocks: 0``, which the spec rejects when the
  connector starts (0.11.1 config/vllm.py:317-330, 0.13.0 v1/kv_offload/cpu.py:24-28: read, not
  run). 0.14–0.26: ``N = ⌊S·2^30 / (b·W)⌋`` offloaded blocks (rounded up to the 4 KiB page from
  0.23.0), one pinned ``torch.zeros`` per KV tensor per rank — PyTorch's pinned allocator rounds each
  up to a power of two (ATen/core/CachingHostAllocator.h). 0.27–0.34: one ``/dev/shm`` region per
  engine of ``⌊S·2^30 / c⌋`` chunks of ``c = roundup(b·W, 4096)`` bytes (v1/kv_offload/cpu/spec.py:
  96-133, shared_offload_region.py:90-187), each rank pinning and touching its own slot (``b`` per
  chunk). No device buffer; the connector is built after the pool is sized, so the pool is unchanged
  — except that up to 0.21.x any KV connector turns the hybrid KV-cache manager off (sliding-window
  layers sized as full attention; config/vllm.py, "Turning off hybrid kv cache manager because
  `--kv-transfer-config` is set").
* **lmcache**: 0.11.1–0.22.x run LMCache in vLLM's process (``LMCacheConnectorV1`` with
  ``max_local_cpu_size = S/(TP·PP)`` GiB pinned per rank; a GPU buffer of layers × (2, 1 for MLA) ×
  ``chunk_size`` 256 tokens × the rank's KV heads × head size, outside the budget; the hybrid manager
  always off); from 0.23.0 the flag means ``LMCacheMPConnector``: the cache lives in a separate
  ``lmcache server`` sized by its own ``--l1-size-gb`` (``S`` is not forwarded; config/vllm.py:1097-1103).
"""

from __future__ import annotations

from dataclasses import dataclass

from vramplan.errors import WorkloadError

from .kvspec import LayerKV
from .vllm_release import Release

BACKENDS = ("native", "lmcache")
PAGE = 4096
"""Host page size (``mmap.PAGESIZE`` on x86-64): the offloaded chunk's alignment."""
LMCACHE_CHUNK = 256
"""LMCache's default ``chunk_size`` (tokens)."""


@dataclass(frozen=True)
class Offload:
    backend: str
    host_per_rank: int
    """Host RAM this rank pins (and touches) for the tier."""
    host_shared: int
    """The ``/dev/shm`` region per engine (0: private per-rank memory)."""
    cpu_tokens: int
    """Tokens the CPU tier holds (0: not in vLLM's process)."""
    gpu: int
    """Device memory the connector adds outside the budget."""
    disables_hybrid: bool
    notes: tuple[str, ...]
    log: tuple[str, ...] = ()


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def check(rel: Release, size: float | None, backend: str) -> None:
    """The release's own limits on the flags (one-line refusals)."""
    if size is None:
        return
    if backend not in BACKENDS:
        raise WorkloadError(f"invalid kv_offloading_backend {backend!r}", hint=f"choose one of {' | '.join(BACKENDS)}",
                            field="kv_offloading_backend")
    if isinstance(size, bool) or not size > 0:
        raise WorkloadError(f"kv_offloading_size must be a positive number of GiB, got {size!r}",
                            hint="e.g. `kv_offloading_size=16`", field="kv_offloading_size")
    if not rel.since("0.11.1"):
        raise WorkloadError(f"vLLM's kv_offloading_size appears in 0.11.1; {rel.text} offloads only through its "
                            "kv_transfer_config, which is not modelled", hint="use `engine_version=0.14.0` or later",
                            field="kv_offloading_size")
    if backend == "native" and not rel.since("0.14.0"):
        raise WorkloadError(f"vLLM {rel.text}'s native offloading flag passes num_cpu_blocks 0, which its CPU spec "
                            "rejects at start-up (read in 0.11.1-0.13.0, not run)",
                            hint="use `engine_version=0.14.0` or later, or `kv_offloading_backend=lmcache`",
                            field="kv_offloading_size")


def disables_hybrid(rel: Release, size: float | None, backend: str) -> bool:
    """Whether the connector turns the hybrid KV-cache manager off (sliding layers sized as full)."""
    if size is None:
        return False
    if backend == "lmcache":
        return not rel.since("0.23.0")
    return not rel.since("0.22.0")


def offload(rel: Release, size: float, backend: str, *, block_bytes: int, block_size: int, tp: int, pp: int,
            layers: tuple[LayerKV, ...], sliding: bool = False) -> Offload:
    """The tier for one rank whose KV blocks are ``block_bytes`` (all its layers) of ``block_size`` tokens."""
    world = tp * pp
    total = int(size * (1 << 30))
    hybrid = disables_hybrid(rel, size, backend) and sliding
    if backend == "lmcache":
        if rel.since("0.23.0"):
            return Offload(backend, 0, 0, 0, 0, False, (
                f"--kv-offloading-backend lmcache in vLLM {rel.text} is LMCacheMPConnector: the cache lives in a "
                "separate `lmcache server` process sized by its own --l1-size-gb (the size given here is not "
                "forwarded), with no GPU buffer in vLLM's process.",))
        per_rank = total // world
        per_token = sum(x.page_bytes(1) for x in layers)
        tokens = per_rank // (per_token * LMCACHE_CHUNK) * LMCACHE_CHUNK if per_token else 0
        gpu = sum((1 if x.kind == "mla" else 2) * LMCACHE_CHUNK * x.kv_heads * x.head_size * x.dtype_bytes
                  for x in layers)
        return Offload(backend, per_rank, 0, tokens, gpu, hybrid, (
            f"LMCache in vLLM's process (LMCacheConnectorV1, vLLM {rel.text}): max_local_cpu_size {per_rank / 2**30:.2f} "
            f"GiB pinned per rank (the size over TP × PP), about {tokens:,} tokens in chunks of {LMCACHE_CHUNK}; a "
            f"{gpu / 2**20:.0f} MiB GPU buffer outside gpu_memory_utilization's budget"
            + ("; the hybrid KV-cache manager off (sliding-window layers sized as full attention)." if hybrid else "."),))
    if rel.since("0.27.0"):
        chunk = -(-block_bytes * world // PAGE) * PAGE
        chunks = total // chunk if chunk else 0
        region = chunks * chunk
        return Offload(backend, chunks * block_bytes, region, chunks * block_size, 0, hybrid, (
            f"Native KV offloading (vLLM {rel.text}): one /dev/shm region per engine, {chunks:,} chunks of one block "
            f"on every rank ({region / 2**30:.2f} GiB: /dev/shm must hold it, e.g. docker --shm-size); each rank pins "
            f"its own slots ({chunks * block_bytes / 2**30:.2f} GiB); {chunks * block_size:,} tokens on the host. "
            "No GPU buffer; the GPU pool is sized before the connector exists.",),
            (f"Created mmap file /dev/shm/vllm_offload_<engine_id>.mmap ({region / 1e9:.2f} GB)",))
    per_block = block_bytes * world
    if rel.since("0.23.0"):
        per_block = -(-per_block // PAGE) * PAGE
    n = total // per_block if per_block else 0
    # one pinned tensor per KV tensor (layer) of n blocks, each rounded up to a power of two
    pinned = sum(_pow2(n * x.page_bytes(block_size)) for x in layers) if n else 0
    asked = n * block_bytes
    return Offload(backend, pinned, 0, n * block_size, 0, hybrid, (
        f"Native KV offloading (vLLM {rel.text}): {n:,} blocks ({n * block_size:,} tokens) on the host, as one pinned "
        f"tensor per layer per rank; PyTorch's pinned allocator rounds each up to a power of two: {pinned / 2**30:.2f} "
        f"GiB pinned per rank for {asked / 2**30:.2f} GiB of blocks."
        + (" Any KV connector turns the hybrid KV-cache manager off in this release: the sliding-window layers are "
           "sized as full attention." if hybrid else ""),))


__all__ = ["BACKENDS", "Offload", "check", "disables_hybrid", "offload"]
