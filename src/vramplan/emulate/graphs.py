"""CUDA graphs on the emulated GPU: capture records, replay allocates nothing.

What a graph does to memory is the caching allocator's: while a graph captures, every allocation
comes from the graph's *private pool* (its own, or one shared through ``pool=``); blocks freed
during the capture go back to that pool and serve later allocations of the capture (or of a
capture sharing the pool), never the rest of the program; the pool keeps its segments through
``empty_cache`` while its graph lives; a replay runs the captured kernels on the same addresses
and allocates nothing. The emulation runs the captured region once, as the capture does, with
its allocations in the pool (``on_capture(pool)``: the trace gives them that pool's id as their
stream, :data:`vramplan.allocator.constants.PRIVATE_POOL` and up), and makes ``replay`` a no-op.

Only :class:`CUDAGraph`, ``graph_pool_handle`` and ``is_current_stream_capturing`` are emulated:
torch's own ``torch.cuda.graph`` context manager and ``make_graphed_callables`` run on them
(their warm-up iterations, side stream and ``empty_cache`` included), as on a GPU.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from ..errors import TraceError


class GraphState:
    """The process's captures (one at a time, as CUDA allows)."""

    def __init__(self, on_capture: Callable[[int | None], None]) -> None:
        self.on_capture = on_capture
        self.capturing: Any = None
        self._ids = itertools.count(1)

    def new_pool(self) -> tuple[int, int]:
        """``graph_pool_handle()``: an opaque (0, id) pair, as torch's ``MempoolId_t``."""
        return (0, next(self._ids))


def graph_api(state: GraphState) -> dict[str, Any]:
    """``torch.cuda``'s names to replace: the emulated ``CUDAGraph`` class and its two functions."""

    class CUDAGraph:
        """``torch.cuda.CUDAGraph`` on the emulated GPU (see the module docstring)."""

        def __init__(self, keep_graph: bool = False) -> None:
            self._pool: tuple[int, int] | None = None
            self._captured = False

        def capture_begin(self, pool: Any = None, capture_error_mode: str = "global", **kwargs: Any) -> None:
            if state.capturing is not None:
                raise RuntimeError("Cannot capture a CUDA graph while another capture is underway")
            self._pool = tuple(pool) if pool is not None else state.new_pool()  # type: ignore[assignment]
            state.capturing = self
            state.on_capture(self._pool[1])  # type: ignore[index]

        def capture_end(self) -> None:
            if state.capturing is not self:
                raise RuntimeError("capture_end() called without a capture underway on this graph")
            state.on_capture(None)
            state.capturing = None
            self._captured = True

        def replay(self) -> None:
            if not self._captured:
                raise TraceError("CUDAGraph.replay() of a graph that captured nothing",
                                 hint="capture it first (torch.cuda.graph(g): ...), as on a GPU")

        def instantiate(self) -> None: ...

        def reset(self) -> None:
            self._captured = False

        def pool(self) -> tuple[int, int] | None:
            return self._pool

        def enable_debug_mode(self) -> None: ...

        def debug_dump(self, debug_path: str) -> None: ...

        def raw_cuda_graph(self) -> int:
            return 0

        def raw_cuda_graph_exec(self) -> int:
            return 0

    CUDAGraph.__module__ = "torch.cuda"
    CUDAGraph.__qualname__ = "CUDAGraph"
    return {
        "CUDAGraph": CUDAGraph,
        "graph_pool_handle": state.new_pool,
        "is_current_stream_capturing": lambda: state.capturing is not None,
    }
