"""``torch.cuda`` and ``torch.accelerator`` answered for the emulated GPU.

A script asks what it runs on before it builds anything (``torch.cuda.is_available()``,
``torch.accelerator.current_accelerator()``, ``get_device_properties(0).total_memory``,
``is_bf16_supported()``) and often prints memory figures as it goes. On a machine without a
GPU those calls fail or answer for no device (a CPU build of torch: no accelerator at all; a
CUDA build without a driver: errors). :func:`patched` answers them for the target GPU —
properties from the catalog, memory figures from the caching-allocator simulation fed with
the events recorded so far (:class:`~.live.LiveAllocator`), so that
``torch.cuda.max_memory_allocated()`` in the script prints the predicted figure — and puts
the real functions back afterwards.

Every emulated function takes torch's own arguments (:func:`.signatures.like`): the names and
defaults of the torch version installed, as Python binds them. A function this torch does not
have is not added. CUDA graphs and NVML-only queries that cannot be emulated raise an error
naming themselves (:class:`~vramplan.errors.TraceError`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._triton import has_triton

from ..errors import TraceError
from .facts import DeviceFacts
from .live import LiveAllocator
from .signatures import bind_init, like, signature_of
from .tensors import LEGACY_TYPES


@dataclass
class CudaState:
    """What the emulated runtime remembers between calls (shared with the tensors' device view)."""

    facts: DeviceFacts
    current: int = 0
    seed: int = 0
    streams: dict[int, Any] = field(default_factory=dict)
    """Each device's current stream, by index (absent: that device's default stream). CUDA's current
    stream is per device (c10 ``setCurrentCUDAStream`` sets it for the stream's own device)."""
    defaults: dict[int, Any] = field(default_factory=dict)
    """Each device's default stream, made on first use (stream id 0)."""
    stream_ids: int = 0
    """Stream ids given so far (each emulated ``Stream`` gets the next; a default stream is 0)."""
    on_stream: Callable[[int, int], None] | None = None
    """Told ``(device, stream id)`` whenever a device's current stream changes: the trace records
    that device's allocations on that stream (the allocator keeps one pool per stream)."""

    def index(self, device: Any) -> int:
        """The ordinal ``device`` names (None: the current device), checked against the count."""
        if device is None:
            return self.current
        if isinstance(device, str):
            device = torch.device(device)
        if isinstance(device, torch.device):
            if device.type not in ("cuda", "meta"):
                raise ValueError(f"Expected a cuda device, but got: {device}")
            idx = self.current if device.index is None else device.index
        elif isinstance(device, int) and not isinstance(device, bool):
            idx = device
        else:
            idx = getattr(device, "idx", getattr(device, "index", self.current))
            if not isinstance(idx, int):
                idx = self.current
        if idx < 0:
            return self.current
        if idx >= self.facts.count:
            raise RuntimeError(f"CUDA error: invalid device ordinal {idx} (the emulated machine has "
                               f"{self.facts.count} GPU{'s' if self.facts.count != 1 else ''}: vramplan run --gpus)")
        return idx


@dataclass(frozen=True)
class Properties:
    """Stands in for ``torch.cuda.get_device_properties()`` (``_CudaDeviceProperties``)."""

    name: str
    major: int
    minor: int
    total_memory: int
    multi_processor_count: int
    is_integrated: int = 0
    is_multi_gpu_board: int = 0
    L2_cache_size: int = 0
    max_threads_per_multi_processor: int = 2048
    warp_size: int = 32
    regs_per_multiprocessor: int = 65536
    shared_memory_per_block: int = 49152
    shared_memory_per_block_optin: int = 232448
    shared_memory_per_multiprocessor: int = 233472
    gcnArchName: str = ""  # noqa: N815 (torch's attribute name)
    uuid: str = "00000000-0000-0000-0000-000000000000"
    pci_bus_id: int = 0
    pci_device_id: int = 0
    pci_domain_id: int = 0


def _unsupported(what: str, hint: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise TraceError(f"{what} is not emulated by vramplan", hint=hint)
    return refuse


def _unsupported_class(name: str, what: str, hint: str) -> type:
    """A class in place of one the emulation cannot offer: it can be named (annotations,
    ``isinstance``), and making one stops the run with a line naming it."""
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        raise TraceError(f"{what} is not emulated by vramplan", hint=hint)
    return type(name, (), {"__init__": __init__, "__module__": "torch.cuda"})


@contextlib.contextmanager
def patched(facts: DeviceFacts, live: LiveAllocator, on_sync: Callable[[str], None],
            state: CudaState | None = None,
            on_capture: Callable[[int | None], None] | None = None,
            others: dict[int, Any] | None = None) -> Iterator[CudaState]:
    """Patch ``torch.cuda`` and ``torch.accelerator`` (see the module docstring);
    ``on_sync(kind)`` receives ``synchronize`` / ``empty_cache`` calls (the trace turns them
    into events); ``on_capture(pool)`` a CUDA graph's capture starting in its private pool
    (``None``: it ended; :mod:`.graphs`) — without it, CUDA graphs stop the run. ``others``: the
    GPUs other than 0 that may hold tensors of their own (index → their place: while its ``in_use``,
    its ``live`` allocator simulation, fed with that GPU's own events, answers that GPU's memory
    figures — a model spread by a device map; before, the emulated GPU's answer for every index)."""
    st = state or CudaState(facts)
    props = Properties(name=facts.name, major=facts.sm[0], minor=facts.sm[1], total_memory=facts.total_memory,
                       multi_processor_count=facts.sm_count, L2_cache_size=facts.l2_cache)
    cuda = torch.cuda
    stack = contextlib.ExitStack()
    stack.callback(_forget_triton_answer, has_triton.cache_info().currsize == 0)

    def put(owner: Any, name: str, impl: Callable[..., Any] | Any, *, exact: bool = True) -> None:
        """Replace ``owner.name`` by ``impl`` behind the real one's signature (only where this torch has it)."""
        if not hasattr(owner, name):
            return
        real = getattr(owner, name)
        value = like(real, impl) if exact and callable(impl) and not isinstance(impl, type) else impl
        if not exact and callable(value) and not hasattr(value, "__signature__"):
            sig = signature_of(real)
            if sig is not None:
                value.__signature__ = sig  # type: ignore[union-attr]  # (calls bind as the real one's)
        stack.callback(setattr, owner, name, real)
        setattr(owner, name, value)

    gpus = others or {}

    def stat(key: str) -> Callable[..., int]:
        return lambda device=None: int(of(device).stats()[key])

    def of(device: Any) -> LiveAllocator:
        """The allocator simulation of ``device``: GPU 0's, or another GPU's own once it is in use."""
        other = gpus.get(st.index(device)) if gpus else None
        return live if other is None or not other.in_use else other.live

    def mem_get_info(device: Any = None) -> tuple[int, int]:
        al = of(device).sync()  # (each GPU used has its own CUDA context outside its allocator)
        return max(0, facts.total_memory - facts.outside_allocator - al.reserved), facts.total_memory

    def set_device(device: Any) -> None:
        idx = st.index(device)
        st.current = idx

    def sync(*args: Any) -> None:
        on_sync("synchronize")

    def empty_cache(*args: Any) -> None:
        on_sync("empty_cache")

    def reset_peaks(device: Any = None) -> None:
        of(device).reset_peaks()

    def summary(device: Any = None, abbreviated: bool = False) -> str:
        s = of(device).stats()
        return (f"|  vramplan emulated {facts.name}: allocated {s['allocated_bytes.all.current']:,} B "
                f"(peak {s['allocated_bytes.all.peak']:,} B), reserved {s['reserved_bytes.all.current']:,} B "
                f"(peak {s['reserved_bytes.all.peak']:,} B)  |")

    def default_stream(device: Any = None) -> Any:
        idx = st.index(device)
        s = st.defaults.get(idx)
        if s is None:
            s = st.defaults[idx] = Stream(device=idx)
            s._vramplan_sid = 0
        return s

    def current_stream(device: Any = None) -> Any:
        idx = st.index(device)
        return st.streams.get(idx) or default_stream(idx)

    def set_stream(s: Any) -> None:
        """torch's ``_cuda_setStream`` (torch/csrc/cuda/Module.cpp ``THCPModule_setStream_wrap``):
        the stream's device becomes the current device, and the stream that device's current stream."""
        if s is None:
            return
        idx, sid = getattr(s, "device_index", None), getattr(s, "_vramplan_sid", None)
        if not isinstance(idx, int) or sid is None:  # (another emulation's stream: kept, not recorded)
            st.streams[st.current] = s
            return
        st.current = idx
        before = current_stream(idx)
        st.streams[idx] = s
        if st.on_stream is not None and getattr(before, "_vramplan_sid", None) != sid:
            st.on_stream(idx, sid)

    Stream, Event, stream_ctx, device_ctx = _classes(st, on_sync, current_stream, set_stream)

    def stream(s: Any) -> Any:
        return stream_ctx(s)

    def rng_state(device: Any = "cuda") -> torch.Tensor:
        return torch.zeros(16, dtype=torch.uint8)

    def manual_seed(seed: Any) -> None:
        st.seed = int(seed)

    functions: dict[str, Any] = {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "init": lambda: None,
        "device_count": lambda: facts.count,
        "current_device": lambda: st.current,
        "set_device": set_device,
        "get_device_properties": lambda device=None: (st.index(device), props)[1],
        "get_device_capability": lambda device=None: (st.index(device), facts.sm)[1],
        "get_device_name": lambda device=None: (st.index(device), facts.name)[1],
        "is_bf16_supported": lambda including_emulation=True: facts.bf16,
        "is_tf32_supported": lambda: facts.tf32,
        "get_arch_list": lambda: [f"sm_{facts.sm[0]}{facts.sm[1]}"],
        "get_gencode_flags": lambda: f"-gencode compute=compute_{facts.sm[0]}{facts.sm[1]},code=sm_{facts.sm[0]}{facts.sm[1]}",
        "mem_get_info": mem_get_info,
        "memory_allocated": stat("allocated_bytes.all.current"),
        "max_memory_allocated": stat("allocated_bytes.all.peak"),
        "memory_reserved": stat("reserved_bytes.all.current"),
        "max_memory_reserved": stat("reserved_bytes.all.peak"),
        "memory_cached": stat("reserved_bytes.all.current"),
        "max_memory_cached": stat("reserved_bytes.all.peak"),
        "memory_stats": lambda device=None: of(device).stats(),
        "memory_summary": summary,
        "list_gpu_processes": lambda device=None: f"GPU:{st.index(device)}\nno processes are running",
        "reset_peak_memory_stats": reset_peaks,
        "reset_max_memory_allocated": reset_peaks,
        "reset_max_memory_cached": reset_peaks,
        "reset_accumulated_memory_stats": lambda device=None: None,
        "synchronize": sync,
        "empty_cache": empty_cache,
        "ipc_collect": lambda: None,
        "manual_seed": manual_seed,
        "manual_seed_all": manual_seed,
        "seed": lambda: None,
        "seed_all": lambda: None,
        "initial_seed": lambda: st.seed,
        "get_rng_state": rng_state,
        "set_rng_state": lambda new_state, device="cuda": None,
        "get_rng_state_all": lambda: [rng_state() for _ in range(facts.count)],
        "set_rng_state_all": lambda new_states: None,
        "current_stream": current_stream,
        "default_stream": default_stream,
        "stream": stream,
        "set_stream": set_stream,
        "set_per_process_memory_fraction": lambda fraction, device=None: None,
        "get_per_process_memory_fraction": lambda device=None: 1.0,
        "can_device_access_peer": lambda device, peer_device: (st.index(device), st.index(peer_device), True)[2],
        "get_sync_debug_mode": lambda: 0,
        "set_sync_debug_mode": lambda debug_mode: None,
        "is_current_stream_capturing": lambda: False,
        "utilization": lambda device=None: 0,
        "temperature": lambda device=None: 0,
        "power_draw": lambda device=None: 0,
        "clock_rate": lambda device=None: 0,
        "memory_usage": lambda device=None: 0,
        "_lazy_init": lambda: None,
    }
    for name, impl in functions.items():
        put(cuda, name, impl, exact=not name.startswith("_"))
    for name, cls in (("Stream", Stream), ("Event", Event), ("StreamContext", stream_ctx), ("device", device_ctx)):
        put(cuda, name, cls, exact=False)
    put(cuda, "device_of", lambda obj: device_ctx(st.current if not isinstance(obj, torch.Tensor) else 0))
    if on_capture is None:
        graphs = "CUDA graph capture (torch.cuda.CUDAGraph / graph / make_graphed_callables)"
        graph_hint = "run the eager step (CUDA graphs reuse its memory in their own pool)"
        for name in ("CUDAGraph", "graph"):
            put(cuda, name, _unsupported_class(name, graphs, graph_hint), exact=False)
        for name in ("make_graphed_callables", "graph_pool_handle"):
            put(cuda, name, _unsupported(graphs, graph_hint))
    else:  # torch's own graph() and make_graphed_callables run on the emulated CUDAGraph
        import torch.cuda.graphs as graphs_module

        from .graphs import GraphState, graph_api

        for name, impl in graph_api(GraphState(on_capture)).items():
            for owner in (cuda, graphs_module):  # (make_graphed_callables calls its module's own names)
                put(owner, name, impl, exact=name != "CUDAGraph")
        if not hasattr(torch._C, "_host_emptyCache"):  # (graph() empties the pinned-host cache too)
            setattr(torch._C, "_host_emptyCache", lambda: None)  # noqa: B010
            stack.callback(delattr, torch._C, "_host_emptyCache")
    _patch_modules(put, cuda, functions, facts, on_sync, st, current_stream, set_stream, Stream, live)
    put(torch, "Generator", _generators(st), exact=False)
    for name, dtype in LEGACY_TYPES.items():
        put(cuda, name, _legacy_type(name, dtype), exact=False)
    try:
        with stack:
            yield st
    finally:
        pass


def _forget_triton_answer(fresh: bool) -> None:
    """torch's ``has_triton()`` is cached per process (torch/utils/_triton.py, ``functools.cache``)
    and, asked inside the emulated GPU, says yes: a library imported there (torchao's kernels
    modules test it at import) would leave that answer to every later import in the process
    (torchao 0.18's MoE Triton kernels then fail to define on a host whose Triton they do not
    match). An answer first given inside is forgotten on the way out, as in a new process."""
    if fresh:
        has_triton.cache_clear()


def _legacy_type(name: str, dtype: torch.dtype) -> type:
    """``torch.cuda.<name>``: ``T(*sizes)`` an uninitialised tensor on the emulated GPU, ``T(data)``
    one from data, ``isinstance(x, T)`` true for tensors of that dtype on it (a CPU build of torch
    has no CUDA types at all)."""

    class _Meta(type):
        def __instancecheck__(cls, obj: Any) -> bool:
            return isinstance(obj, torch.Tensor) and obj.dtype == dtype and obj.is_cuda

        def __call__(cls, *args: Any, **kwargs: Any) -> Any:
            if len(args) == 1 and not isinstance(args[0], int) and not isinstance(args[0], torch.Size):
                data = args[0]
                if isinstance(data, torch.Tensor):
                    return data.to(device="cuda", dtype=dtype)
                return torch.tensor(data, dtype=dtype, device="cuda")
            sizes = args[0] if len(args) == 1 and isinstance(args[0], torch.Size) else args
            return torch.empty(*sizes, dtype=dtype, device="cuda")

    return _Meta(name, (), {"__module__": "torch.cuda", "_vramplan_dtype": dtype,
                            "__doc__": f"torch.cuda.{name} on the emulated GPU (vramplan)"})


def _generators(st: CudaState) -> type:
    """``torch.Generator`` that makes generators of the emulated GPU: ``torch.Generator("cuda")``
    (diffusers' ``generator=torch.Generator("cuda").manual_seed(0)``, seeded sampling) needs
    ATen's CUDA library; here it is a host generator that reports ``cuda:N`` (``randn(device=
    "cuda", generator=g)`` runs on the trace device, whose kernels take any generator). Other
    devices, ``isinstance`` and ``issubclass`` answer as torch's own class."""
    real: Any = torch.Generator

    class _DeviceGenerator(real):  # type: ignore[misc,valid-type]
        _vramplan_index = 0

        @property
        def device(self) -> torch.device:
            return torch.device("cuda", self._vramplan_index)

        def __repr__(self) -> str:
            return f"<torch.Generator object (vramplan emulated cuda:{self._vramplan_index})>"

    class _Meta(type):
        def __instancecheck__(cls, obj: Any) -> bool:
            return isinstance(obj, real)

        def __subclasscheck__(cls, sub: Any) -> bool:
            return isinstance(sub, type) and issubclass(sub, real)

        def __call__(cls, device: Any = None) -> Any:
            d = device if device is None or isinstance(device, torch.device) else \
                torch.device(device if not isinstance(device, int) else f"cuda:{device}")
            if d is not None and d.type == "cuda":
                g = _DeviceGenerator()
                g._vramplan_index = st.index(d)
                return g
            return real() if device is None else real(device)

    class Generator(metaclass=_Meta):
        __doc__ = real.__doc__
        __module__ = "torch"

    return Generator


def _patch_modules(put: Callable[..., None], cuda: Any, functions: dict[str, Any], facts: DeviceFacts,
                   on_sync: Callable[[str], None], st: CudaState, current_stream: Callable[..., Any],
                   set_stream: Callable[..., Any], Stream: type, live: LiveAllocator) -> None:  # noqa: N803
    """The submodules (``torch.cuda.memory``, ``.random``, ``.nvtx``), ``torch.accelerator``,
    ``torch.version.cuda``, ``torch.backends`` and ``torch._C._get_accelerator``."""
    import torch.cuda.memory as cm
    import torch.cuda.random as cr

    for owner in (cm, cr):
        for name, impl in functions.items():
            if not name.startswith("_") and hasattr(owner, name):
                put(owner, name, impl)
    put(cm, "_record_memory_history", lambda *a: None)
    put(cm, "_snapshot", _unsupported("torch.cuda.memory._snapshot()",
                                       "`vramplan run --snapshot FILE` writes the predicted snapshot"), exact=False)
    put(cm, "_dump_snapshot", _unsupported("torch.cuda.memory._dump_snapshot()",
                                           "`vramplan run --snapshot FILE` writes the predicted snapshot"), exact=False)
    nvtx: Any = getattr(torch.cuda, "nvtx", None)
    if nvtx is not None:
        put(nvtx, "range_push", lambda msg: 0)
        put(nvtx, "range_pop", lambda: 0)
        put(nvtx, "range_start", lambda msg: 0)
        put(nvtx, "range_end", lambda range_id: None)
        put(nvtx, "mark", lambda msg: None)

        @contextlib.contextmanager
        def nvtx_range(msg: str, *args: Any, **kwargs: Any) -> Iterator[None]:
            yield

        put(nvtx, "range", nvtx_range, exact=False)

    acc = getattr(torch, "accelerator", None)
    if acc is not None:
        def device_capability(device: Any = None) -> dict[str, Any]:
            st.index(device)
            return {"major": facts.sm[0], "minor": facts.sm[1],
                    "supported_dtypes": [torch.float32, torch.float16, torch.float64, torch.int8, torch.int32,
                                         torch.int64, torch.bool] + ([torch.bfloat16] if facts.bf16 else [])}

        def set_index(device: Any) -> None:
            st.current = st.index(device)

        acc_functions: dict[str, Any] = {
            "is_available": lambda: True,
            "current_accelerator": lambda check_available=False: torch.device("cuda"),
            "device_count": lambda: facts.count,
            "current_device_index": lambda: st.current,
            "current_device_idx": lambda: st.current,
            "set_device_index": set_index,
            "set_device_idx": set_index,
            "current_stream": lambda device=None: current_stream(device),
            "set_stream": set_stream,
            "synchronize": lambda device=None: on_sync("synchronize"),
            "empty_cache": lambda: on_sync("empty_cache"),
            "empty_host_cache": lambda: None,
            "get_device_capability": device_capability,
            "get_memory_info": lambda device_index=None: functions["mem_get_info"](device_index),
            "memory_allocated": lambda device_index=None: functions["memory_allocated"](device_index),
            "max_memory_allocated": lambda device_index=None: functions["max_memory_allocated"](device_index),
            "memory_reserved": lambda device_index=None: functions["memory_reserved"](device_index),
            "max_memory_reserved": lambda device_index=None: functions["max_memory_reserved"](device_index),
            "memory_stats": lambda device_index=None: functions["memory_stats"](device_index),
            "reset_peak_memory_stats": lambda device_index=None: functions["reset_peak_memory_stats"](device_index),
            "reset_accumulated_memory_stats": lambda device_index=None: None,
        }
        for name, impl in acc_functions.items():
            put(acc, name, impl)
        for sub in ("memory",):
            mod = getattr(acc, sub, None)
            if mod is not None:
                for name, impl in acc_functions.items():
                    if hasattr(mod, name):
                        put(mod, name, impl)
        if hasattr(acc, "device_index"):
            put(acc, "device_index", _device_index_class(acc.device_index, st), exact=False)
        put(acc, "Graph", _unsupported_class("Graph", "CUDA graph capture (torch.accelerator.Graph)",
                                             "run the eager step (CUDA graphs reuse its memory in their own pool)"),
            exact=False)
    put(torch.version, "cuda", facts.cuda_version, exact=False)
    import torch.cuda.nccl as nccl

    put(nccl, "version", lambda: facts.nccl_version)
    put(nccl, "is_available", lambda tensors: True)
    if torch.distributed.is_available():
        put(torch.distributed, "is_nccl_available", lambda: True)
    put(torch.backends.cuda, "is_built", lambda: True)
    put(torch.backends.cudnn, "is_available", lambda: True)
    put(torch.backends.cudnn, "version", lambda: 91002)
    put(torch._C, "_get_accelerator", lambda *a: torch.device("cuda"), exact=False)


def _device_index_class(real: type, st: CudaState) -> type:
    class device_index:  # noqa: N801 (torch's name)
        """``with torch.accelerator.device_index(i):`` on the emulated GPU."""

        __signature__ = __import__("inspect").signature(real)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            (device,) = bind_init(real, args, kwargs)[:1]
            self.idx = device
            self.prev = st.current

        def __enter__(self) -> None:
            self.prev = st.current
            if self.idx is not None:
                st.current = st.index(self.idx)

        def __exit__(self, *exc: Any) -> None:
            st.current = self.prev

    return device_index


def _classes(st: CudaState, on_sync: Callable[[str], None], current_stream: Callable[..., Any],
             set_stream: Callable[[Any], None]) -> tuple[type, type, type, type]:
    """Emulated ``Stream``, ``Event``, ``StreamContext`` and ``device`` with torch's constructors."""
    import inspect

    real_stream, real_event = torch.cuda.Stream, torch.cuda.Event
    real_ctx, real_device = torch.cuda.StreamContext, torch.cuda.device

    class Stream:
        """An emulated CUDA stream of one device. Work on it is ordered like the default stream's (a
        trace is one serial order), but what is allocated while it is its device's current stream is
        recorded on it, and the caching allocator keeps one pool per stream (a block cached by one
        stream is not reused by another: ``CUDACachingAllocator.cpp`` ``get_free_block``)."""

        __signature__ = inspect.signature(real_stream)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            device, priority = bind_init(real_stream, args, kwargs)[:2]
            self.device_index = st.index(device)
            self.device = torch.device("cuda", self.device_index)
            self.priority = priority
            self.stream_id = id(self)
            self.device_type = 1
            st.stream_ids += 1
            self._vramplan_sid = st.stream_ids

        def synchronize(self) -> None:
            on_sync("synchronize")

        def wait_stream(self, stream: Any) -> None: ...
        def wait_event(self, event: Any) -> None: ...

        def record_event(self, event: Any = None) -> Any:
            ev = event if event is not None else Event()
            ev.record(self)
            return ev

        def query(self) -> bool:
            return True

        def is_capturing(self) -> bool:
            return False

        @property
        def cuda_stream(self) -> int:
            return 0

        def __enter__(self) -> Any:
            self._ctx = StreamContext(self)
            return self._ctx.__enter__()

        def __exit__(self, *exc: Any) -> None:
            self._ctx.__exit__(*exc)

        def __eq__(self, other: object) -> bool:
            return self is other

        def __hash__(self) -> int:
            return id(self)

        def __repr__(self) -> str:
            return f"<torch.cuda.Stream device=cuda:{self.device_index} cuda_stream=0x0 (vramplan emulated)>"

    class Event:
        """An emulated CUDA event (already complete; no timing)."""

        __signature__ = inspect.signature(real_event)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            bind_init(real_event, args, kwargs)

        def record(self, stream: Any = None) -> None: ...
        def wait(self, stream: Any = None) -> None: ...

        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            on_sync("synchronize")

        def elapsed_time(self, end_event: Any) -> float:
            return 0.0

    class StreamContext:
        """``with torch.cuda.stream(s):`` makes ``s`` its device's current stream for the block, as
        torch's ``StreamContext`` does (torch/cuda/__init__.py: the current device's stream and, for a
        stream of another device, that device's are put back on exit; ``set_stream`` also makes the
        stream's device current). Ops stay in one serial order."""

        __signature__ = inspect.signature(real_ctx)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            (self.stream,) = bind_init(real_ctx, args, kwargs)[:1]
            self.src_prev: Any = None
            self.dst_prev: Any = None

        def __enter__(self) -> Any:
            cur = self.stream
            if cur is None:
                return None
            self.src_prev = current_stream(None)
            if getattr(self.src_prev, "device", None) != getattr(cur, "device", None):
                self.dst_prev = current_stream(getattr(cur, "device_index", None))
            set_stream(cur)
            return cur

        def __exit__(self, *exc: Any) -> None:
            if self.stream is None or self.src_prev is None:
                return
            if self.dst_prev is not None:
                set_stream(self.dst_prev)
            set_stream(self.src_prev)

    class device:  # noqa: N801 (torch's name)
        """``with torch.cuda.device(i):`` sets the current device for the block."""

        __signature__ = inspect.signature(real_device)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            (d,) = bind_init(real_device, args, kwargs)[:1]
            self.idx = st.index(d) if d is not None and not (isinstance(d, int) and d < 0) else -1
            self.prev = st.current

        def __enter__(self) -> None:
            self.prev = st.current
            if self.idx >= 0:
                st.current = self.idx

        def __exit__(self, *exc: Any) -> None:
            st.current = self.prev

    return Stream, Event, StreamContext, device
