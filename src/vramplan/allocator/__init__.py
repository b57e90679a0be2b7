"""vramplan.allocator: PyTorch's CUDA caching allocator, simulated.

``parse_conf(s)`` reads a ``PYTORCH_CUDA_ALLOC_CONF`` string, ``replay(log, conf)`` runs an
event log through the simulation and returns peaks, segments and fragmentation, and
``CachingAllocator`` is the stateful simulator itself for other modules.
"""

from .config import AllocatorConfig, parse_conf
from .native import CachingAllocator
from .replay import replay
from .result import BlockInfo, ReplayResult, ReplayTimeline, SegmentEvent, SegmentInfo

__all__ = [
    "AllocatorConfig", "BlockInfo", "CachingAllocator", "ReplayResult", "ReplayTimeline",
    "SegmentEvent", "SegmentInfo", "parse_conf", "replay",
]
