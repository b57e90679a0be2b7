"""Size constants of PyTorch's CUDA caching allocator (c10/core/AllocatorConfig.h,
c10/cuda/CUDACachingAllocator.cpp). Identical in PyTorch 2.4 – 2.13."""

from __future__ import annotations

from typing import Final

MiB = 1024 * 1024

MIN_BLOCK_SIZE = 512
"""kMinBlockSize: every request is rounded up to a multiple of 512 bytes (at least 512)."""
SMALL_SIZE: Final = 1 * MiB
"""kSmallSize: requests up to 1 MiB (after rounding) go to the small pool."""
SMALL_BUFFER = 2 * MiB
"""kSmallBuffer: small-pool segments (and small-pool expandable pages) are 2 MiB."""
MIN_LARGE_ALLOC = 10 * MiB
"""kMinLargeAlloc: large requests below 10 MiB get a ``large_segment_size`` segment."""
ROUND_LARGE = 2 * MiB
"""kRoundLarge: larger requests get a segment of their size rounded up to 2 MiB."""
LARGE_BUFFER = 20 * MiB
"""kLargeBuffer: default large segment size, large expandable page size, and the minimum
(and default) of ``max_split_size_mb`` / ``max_non_split_rounding_mb``."""
ROUNDUP_INTERVALS = 16
"""roundup_power2_divisions has one entry per power-of-two interval from 1 MiB to 64 GiB."""
NO_LIMIT = 2**64 - 1
"""``std::numeric_limits<size_t>::max()``: max_split_size when not set."""
PRIVATE_POOL: Final = 1 << 30
"""Event streams from here on are CUDA graphs' private memory pools (``torch.cuda.graph``'s
``pool``; the trace gives each capture's allocations its pool's id): a pool of its own like a
stream's, whose cached segments ``empty_cache``, garbage collection and the out-of-memory retry
leave alone while its graph lives (``release_cached_blocks`` skips private pools in use)."""
