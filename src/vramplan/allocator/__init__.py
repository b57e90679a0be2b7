"""vramplan.allocator: PyTorch's CUDA caching allocator, simulated.

``parse_conf(s)`` reads a ``PYTORCH_CUDA_ALLOC_CONF`` string, ``replay(log, conf)`` runs an
event log through the simulation and returns peaks, segments and fragmentation, and
``CachingAllocator`` is the stateful simulator itself for other modules.
"""

from . import core

core.select()  # (first: the event loop's modules compiled, or from their source; see core)

from .config import AllocatorConfig, parse_conf  # noqa: E402
from .native import CachingAllocator  # noqa: E402
from .replay import replay  # noqa: E402
from .result import BlockInfo, ReplayResult, ReplayTimeline, SegmentEvent, SegmentInfo  # noqa: E402

__all__ = [
    "AllocatorConfig", "BlockInfo", "CachingAllocator", "ReplayResult", "ReplayTimeline",
    "SegmentEvent", "SegmentInfo", "parse_conf", "replay",
]
