"""Request rounding and segment sizing (``round_size``, ``roundup_power2_next_division``,
``get_allocation_size`` in c10/cuda/CUDACachingAllocator.cpp)."""

from __future__ import annotations

from .config import AllocatorConfig
from .constants import MIN_BLOCK_SIZE, MIN_LARGE_ALLOC, ROUND_LARGE, SMALL_BUFFER, SMALL_SIZE


def roundup_power2_next_division(size: int, divisions: int) -> int:
    """Round ``size`` up to the next of ``divisions`` equal steps between two powers of two.

    E.g. 1200 with 4 divisions lies in [1024, 2048), whose steps are 1024, 1280, 1536, 1792:
    it becomes 1280. Powers of two are returned unchanged.
    """
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    low = size & ~(step - 1)
    return size if low == size else low + step


def round_size(size: int, conf: AllocatorConfig) -> int:
    """The block size a request of ``size`` bytes gets: at least 512, a multiple of 512, or the
    next power-of-two division when ``roundup_power2_divisions`` asks for one (d > 1 and
    size > 512·d)."""
    if size < MIN_BLOCK_SIZE:
        return MIN_BLOCK_SIZE
    d = conf.divisions(size)
    if d > 1 and size > MIN_BLOCK_SIZE * d:
        return roundup_power2_next_division(size, d)
    return -(-size // MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE


def allocation_size(size: int, conf: AllocatorConfig) -> int:
    """Size of a new segment for a (rounded) request: 2 MiB (small pool), the large segment
    size (20 MiB by default) below 10 MiB, otherwise the request rounded up to 2 MiB."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return conf.large_segment_size
    return -(-size // ROUND_LARGE) * ROUND_LARGE
