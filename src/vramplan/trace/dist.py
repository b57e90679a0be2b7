"""One rank of a distributed job, traced alone on PyTorch's fake process group.

PyTorch ships a process group that does not communicate
(``torch/testing/_internal/distributed/fake_pg.py``: ``FakeStore`` + backend ``"fake"``,
backed by ``c10d::FakeProcessGroup``): every collective returns at once and leaves its
output untouched, so the real FSDP2 / DDP / DTensor code of rank ``r`` of a world of ``W``
runs in this one process. Collective *outputs* are allocated by the caller (FSDP2's
``all_gather_copy_in`` / ``foreach_reduce``, DDP's buckets) with ordinary factory calls
before the collective is issued, so on our ``meta`` tensors they become ALLOC events like
any other storage — exactly as NCCL's outputs go through the caching allocator.

What this module adds to a :class:`~vramplan.trace.session.TraceSession`:

- :func:`fake_world` initialises the fake process group (rank ``r`` of ``W``) and a
  ``DeviceMesh`` of device type ``"cuda"`` with named dims (``dp``, ``tp``, ``pp``, ``cp``…),
  and tears both down afterwards (process group destroyed, mesh caches cleared) so that
  traces repeat in one process. The world size is a number only: rank 0 of 8 and of 1,024
  cost the same (no per-rank state is built beyond the mesh's own groups).
- :func:`emulated_streams` answers ``torch.cuda.Stream/Event/current_stream/stream`` with
  stand-ins: entering ``torch.cuda.stream(s)`` sets the recorder's stream, so storages that
  FSDP2 allocates on its all-gather / reduce-scatter streams carry that stream id and the
  allocator replay gives them their own pools (``CUDACachingAllocator.cpp``: one pool per
  stream). Waits and events are no-ops (a trace is one serial order of the host program).
- :func:`recorded_resizes` turns ``UntypedStorage.resize_`` on ``meta`` storages into FREE /
  ALLOC events: FSDP2 allocates and frees its unsharded parameters by resizing their storage
  (``_fsdp_param.py``: ``alloc_storage`` / ``free_storage``, torch ≥ 2.4), FSDP1 did the same.

The ``"fake"`` backend and ``FakeStore`` exist from torch 2.1; ``DeviceMesh`` skips device
set-up for it from 2.6 — older versions get our ``torch.cuda`` answers instead.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import traceback
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import torch

from ..emulate.tensors import on_meta
from ..errors import TraceError
from ..results import HOST_GRADIENTS, HOST_PARAMETERS
from .host import HostMemory
from .recorder import Recorder

MESH_DIMS = ("pp", "dp_replicate", "dp", "cp", "tp", "ep")
"""Known mesh dimension names, outermost first (torchtitan's order: pp, dp_replicate,
dp_shard, cp, tp)."""


@dataclass(frozen=True)
class World:
    """The emulated world: rank ``rank`` of ``size`` ranks, laid out as a named mesh."""

    dims: tuple[tuple[str, int], ...]
    """(name, size) per mesh dimension, outermost first; sizes multiply to the world size."""
    rank: int = 0

    def __post_init__(self) -> None:
        if not self.dims:
            raise TraceError("a distributed trace needs at least one mesh dimension")
        for name, n in self.dims:
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise TraceError(f"mesh dimension `{name}` must be a positive integer, got {n!r}")
        names = [d for d, _ in self.dims]
        if len(set(names)) != len(names):
            raise TraceError(f"mesh dimension names repeat: {names}")
        if not 0 <= self.rank < self.size:
            raise TraceError(f"rank {self.rank} is outside a world of {self.size} ranks",
                             hint=f"use a rank from 0 to {self.size - 1}")

    @property
    def size(self) -> int:
        n = 1
        for _, k in self.dims:
            n *= k
        return n

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d for d, _ in self.dims)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(k for _, k in self.dims)

    def dim(self, name: str) -> int:
        """Size of dimension ``name`` (1 if the mesh has none)."""
        for d, k in self.dims:
            if d == name:
                return k
        return 1


def world_of(**sizes: int) -> World:
    """A world from named sizes in :data:`MESH_DIMS` order; dims of size 1 are dropped
    (except that a world of one GPU keeps ``dp=1``)."""
    unknown = set(sizes) - set(MESH_DIMS)
    if unknown:
        raise TraceError(f"unknown mesh dimension(s) {sorted(unknown)}", hint=f"use {', '.join(MESH_DIMS)}")
    dims = tuple((d, sizes[d]) for d in MESH_DIMS if d in sizes and sizes[d] != 1)
    return World(dims or (("dp", 1),))


def check_torch() -> None:
    """Refuse clearly where this torch cannot run a fake world."""
    if not torch.distributed.is_available():
        raise TraceError(f"torch {torch.__version__} was built without torch.distributed",
                         hint="install a torch build with distributed support (the PyPI wheels have it)")
    try:
        from torch.distributed.device_mesh import init_device_mesh  # noqa: F401
        from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401
    except ImportError as e:
        raise TraceError(f"torch {torch.__version__} has no fake process group / DeviceMesh ({e})",
                         hint="tracing a parallel layout needs torch >= 2.4; `method=analytic` works without") from None


# --------------------------------------------------------------------------- the world
_lock = threading.Lock()


@contextlib.contextmanager
def fake_world(world: World) -> Iterator[Any]:
    """Initialise the fake process group and a ``"cuda"`` ``DeviceMesh`` for ``world``;
    yields the mesh. Refuses when a process group is already initialised (a real job, or a
    trace that did not clean up)."""
    check_torch()
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not _lock.acquire(blocking=False):
        raise TraceError("another distributed trace is running in this process",
                         hint="trace parallel layouts one at a time")
    try:
        if dist.is_initialized():
            raise TraceError("a torch.distributed process group is already initialised in this process",
                             hint="trace parallel layouts in a process that has not called init_process_group")
        hook = sys.excepthook  # init_process_group prefixes it with "[rank0]:" (each time)
        with _cuda_device_queries():
            dist.init_process_group("fake", store=FakeStore(), rank=world.rank, world_size=world.size)
            try:
                mesh = init_device_mesh("cuda", world.shape, mesh_dim_names=world.names)
                yield mesh
            finally:
                _teardown()
                sys.excepthook = hook
    finally:
        _lock.release()


def _teardown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    _forget_sharding_propagation()
    with contextlib.suppress(Exception):  # mesh caches (names vary across torch versions)
        from torch.distributed.device_mesh import _mesh_resources

        for attr in ("mesh_stack", "child_to_root_mapping", "child_to_parent_mapping", "root_to_flatten_mapping",
                     "flatten_name_to_root_dims", "mesh_dim_group_options"):
            v: Any = getattr(_mesh_resources, attr, None)
            if hasattr(v, "clear"):
                v.clear()


def _forget_sharding_propagation() -> None:
    """Empty DTensor's sharding propagation caches (the C++ fast path's and the Python one).

    They map an op's input specs to its output specs, meshes included, and a ``DeviceMesh``
    compares by value (ranks, layout, dim names): ``mesh["tp"]`` of a later world of another
    shape (dp=4 × tp=2, then dp=2 × cp=2 × tp=2) equals this world's, so the later trace's op
    would get this world's mesh back, whose collectives name this world's destroyed groups
    (group names restart at "0" with each world: "Could not resolve the process group
    registered under the name 3", or quietly another group of the same name)."""
    with contextlib.suppress(Exception):
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()
        return
    with contextlib.suppress(Exception):  # older: the Python cache only
        from torch.distributed.tensor import DTensor

        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()


@contextlib.contextmanager
def _cuda_device_queries() -> Iterator[None]:
    """``torch.cuda`` device queries answered for one visible GPU (``DeviceMesh`` / FSDP read
    ``current_device()``; torch < 2.6 also set the device for the fake backend).

    ``is_available()`` keeps the answer it gave before: with ``PYTORCH_NVML_BASED_CUDA_CHECK=1``
    (set for the rest of the process by ``import deepspeed``, which HF Trainer does where
    DeepSpeed is installed; torch 2.14.1 ``torch/cuda/__init__.py`` ``is_available``:
    ``return device_count() > 0``) it would follow the ``device_count`` answered here and say
    yes on a host without a GPU. Dynamo's compilation metrics then asked the CUDA runtime for
    device properties (``has_triton`` → ``is_triton_capable``), failed, and logged the error
    with its traceback: a log handler that keeps records (pytest's) kept the first iteration's
    frames, and the tensors they held, alive for the rest of the trace (+197,076 B in the
    FSDP2 + compile check)."""
    cuda = torch.cuda
    answer = bool(cuda.is_available())
    patches = {
        "current_device": lambda: 0,
        "set_device": lambda device: None,
        "is_initialized": lambda: True,
        "device_count": lambda: 1,
        "is_available": lambda: answer,
    }
    saved = {k: getattr(cuda, k) for k in patches}
    for k, v in patches.items():
        setattr(cuda, k, v)
    # torch >= 2.14's optimizer asks ``torch.accelerator.current_stream()`` whether a CUDA graph
    # is being captured before each step: answer with the emulated default stream, never the
    # real driver (the emulated streams of a rank session override this in turn)
    acc = getattr(torch, "accelerator", None)
    acc_saved = getattr(acc, "current_stream", None) if acc is not None else None
    if acc is not None and acc_saved is not None:
        default = FakeStream(0, "default")
        acc.current_stream = lambda device=None: default
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(cuda, k, v)
        if acc is not None and acc_saved is not None:
            acc.current_stream = acc_saved


# --------------------------------------------------------------------------- streams
class FakeStream:
    """Stands in for ``torch.cuda.Stream``: an id the recorder stamps on allocations."""

    def __init__(self, sid: int, name: str = "") -> None:
        self.stream_id = sid
        self.name = name
        self.device = torch.device("cuda", 0)
        self.device_index = 0
        self.device_type = 1  # DeviceType.CUDA

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> FakeEvent:
        ev = event if isinstance(event, FakeEvent) else FakeEvent()
        ev.record(self)
        return ev

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def is_capturing(self) -> bool:
        """Never inside a CUDA-graph capture (torch >= 2.14's optimizer asks the current
        accelerator stream before every step)."""
        return False

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FakeStream) and other.stream_id == self.stream_id

    def __hash__(self) -> int:
        return hash(("FakeStream", self.stream_id))

    def __repr__(self) -> str:
        return f"<emulated cuda stream {self.stream_id}{' ' + self.name if self.name else ''}>"


class FakeEvent:
    """Stands in for ``torch.cuda.Event`` (the trace is one serial order: nothing to wait for)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.stream: FakeStream | None = None

    def record(self, stream: Any = None) -> FakeEvent:
        self.stream = stream if isinstance(stream, FakeStream) else None
        return self

    def wait(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class StreamTable:
    """The emulated streams of one trace: stream 0 is the default (compute) stream."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.streams: list[FakeStream] = [FakeStream(0, "default")]

    def new(self, name: str = "") -> FakeStream:
        s = FakeStream(len(self.streams), name)
        self.streams.append(s)
        return s

    def current(self) -> FakeStream:
        sid = self.rec.stream
        return self.streams[sid] if 0 <= sid < len(self.streams) else self.streams[0]

    @contextlib.contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        rec = self.rec
        saved = rec.stream
        if isinstance(stream, FakeStream):
            rec.stream = stream.stream_id
        try:
            yield
        finally:
            rec.stream = saved


@contextlib.contextmanager
def emulated_streams(rec: Recorder) -> Iterator[StreamTable]:
    """Patch ``torch.cuda``'s stream and event API (see the module docstring)."""
    table = StreamTable(rec)
    cuda = torch.cuda

    class make_stream(FakeStream):  # noqa: N801 (stands for torch.cuda.Stream)
        """``torch.cuda.Stream(...)``: a new emulated stream of this trace (a class, so that code
        can still name it: ``torch.cuda.Stream | None`` annotations)."""

        def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> FakeStream:  # type: ignore[misc]
            return table.new()

    def stream_ctx(stream: Any = None) -> Any:
        return table.use(stream)

    patches: dict[str, Any] = {
        "Stream": make_stream,
        "Event": FakeEvent,
        "current_stream": lambda device=None: table.current(),
        "default_stream": lambda device=None: table.streams[0],
        "stream": stream_ctx,
        "current_device": lambda: 0,
        "set_device": lambda device: None,
        "is_initialized": lambda: True,
    }
    saved = {k: getattr(cuda, k) for k in patches}
    # FSDP2 finds the device module from a tensor's device type (``_get_device_handle(
    # t.device.type)`` = ``getattr(torch, type)``): our device tensors are ``meta``
    had_meta = hasattr(torch, "meta")
    meta_saved = getattr(torch, "meta", None)
    torch.meta = types.SimpleNamespace(**patches, synchronize=lambda device=None: None,  # type: ignore[attr-defined]
                                       is_available=lambda: True, device_count=lambda: 1)
    acc = getattr(torch, "accelerator", None)
    acc_saved = getattr(acc, "current_stream", None) if acc is not None else None
    for k, v in patches.items():
        setattr(cuda, k, v)
    if acc is not None and acc_saved is not None:
        acc.current_stream = lambda device=None: table.current()
    try:
        yield table
    finally:
        for k, v in saved.items():
            setattr(cuda, k, v)
        if acc is not None and acc_saved is not None:
            acc.current_stream = acc_saved
        if had_meta:
            torch.meta = meta_saved  # type: ignore[attr-defined]
        else:
            del torch.meta  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- storage resizes
@contextlib.contextmanager
def recorded_resizes(rec: Recorder) -> Iterator[None]:
    """``UntypedStorage.resize_`` of a ``meta`` storage becomes FREE (to 0) / ALLOC (from 0)."""
    cls = torch.UntypedStorage
    orig = cls.resize_

    def resize_(self: Any, size: int) -> Any:
        out = orig(self, size)
        if self.device.type == "meta":  # (an UntypedStorage: its own device)
            rec.resized(self, int(size))
        return out

    cls.resize_ = resize_  # type: ignore[method-assign]
    try:
        yield
    finally:
        cls.resize_ = orig  # type: ignore[method-assign]


# --------------------------------------------------------------------------- FSDP on meta
@contextlib.contextmanager
def fsdp_on_meta(rec: Recorder) -> Iterator[None]:
    """FSDP1 (:func:`_fsdp1_on_meta`) and FSDP2 on the trace device.

    - FSDP2 refuses to train parameters still on ``meta`` (``FSDPParamGroup.
      _validate_no_meta_params`` at lazy init: "FSDP parameters should be materialized from
      meta device before training"). On our trace device every tensor is ``meta`` and that is
      the point, so the check is skipped while a trace runs.
    - The unsharded parameters FSDP2 gathers are its per-parameter ``all_gather_outputs``
      (``FSDPParam.init_all_gather_outputs``, then ``alloc_storage`` / ``free_storage`` by
      resizing): they are recorded as parameters (the report's weights), each re-allocation
      too (a resize keeps the category).
    - The unsharded gradients FSDP2 accumulates while gradient sync is off (a pipeline stage's
      micro-batches before the last, torch/distributed/pipelining/stage.py
      ``backward_maybe_with_nosync``: the unsharded parameter's ``grad``, or under mixed precision
      ``FSDPParam.unsharded_accumulated_grad`` in the reduce dtype) are recorded as gradients.
    """
    with _fsdp1_on_meta(rec):
        yield from _fsdp2_on_meta(rec)


def _fsdp1_on_meta(rec: Recorder) -> contextlib.ExitStack:
    """FSDP1 (``FullyShardedDataParallel``) on the trace device.

    - Its check that an unsharded flat parameter is allocated reads the storage's data pointer
      (``torch.distributed.utils._data_ptr_allocated``), which is 0 for every ``meta`` storage:
      on the trace device a storage of more than 0 bytes is allocated.
    - The padded unsharded flat parameters it all-gathers into (``_full_param_padded``, and
      under mixed precision the 16-bit ``_mp_shard`` and the full-precision
      ``_full_prec_full_param_padded``), made at lazy init, then freed and re-allocated by
      storage resizes, are recorded as parameters (the report's weights), as FSDP2's are.
    - At the end of backward ``_catch_all_reshard`` (``_runtime_utils.py``, called for every
      unit by ``_post_backward_final_callback``) skips a unit it takes for resharded: its flat
      parameter's data pointer equals its local shard's. On ``meta`` both pointers are 0, so a
      unit no post-backward hook resharded (under LoRA the frozen root, whose inputs need no
      gradient) kept its gathered parameters into the optimizer step where a GPU frees them
      (:func:`_already_resharded`: the same test by storage and offset)."""
    import torch.distributed.fsdp._flat_param as flat
    import torch.distributed.fsdp._runtime_utils as rt

    stack = contextlib.ExitStack()
    ptr = flat._data_ptr_allocated

    def allocated(t: torch.Tensor) -> bool:
        return t.untyped_storage().nbytes() > 0 if on_meta(t) else bool(ptr(t))

    init = flat.FlatParamHandle.init_flat_param_attributes

    from ..events import Category

    def init_flat_param_attributes(self: Any) -> Any:
        host = rec.host
        if self._offload_params and isinstance(host, HostMemory):  # CPUOffload: pins the shard, then _cpu_grad
            with host.pinning(HOST_PARAMETERS, HOST_GRADIENTS), host.factories():
                out = init(self)
        else:
            out = init(self)
        for name in ("_full_param_padded", "_mp_shard", "_full_prec_full_param_padded"):
            t = getattr(self.flat_param, name, None)
            if isinstance(t, torch.Tensor) and on_meta(t):
                rec.relabel(t, Category.PARAMETER)
        return out

    views = flat.FlatParamHandle._use_sharded_views

    def _use_sharded_views(self: Any) -> Any:
        host = rec.host
        if self._offload_params and isinstance(host, HostMemory):  # its empty views on the host shard's device
            with host.factories():
                return views(self)
        return views(self)

    catch_all = rt._catch_all_reshard

    def _catch_all_reshard(state: Any) -> Any:
        h = state._handle
        if h is not None and on_meta(h.flat_param) and not _already_resharded(h):
            rt._reshard(state, h, rt._should_free_in_backward(state, h))  # what a GPU's check leads to
            return None
        return catch_all(state)

    for owner, name, value in ((flat, "_data_ptr_allocated", allocated), (rt, "_catch_all_reshard", _catch_all_reshard),
                               (flat.FlatParamHandle, "init_flat_param_attributes", init_flat_param_attributes),
                               (flat.FlatParamHandle, "_use_sharded_views", _use_sharded_views)):
        stack.callback(setattr, owner, name, getattr(owner, name))
        setattr(owner, name, value)
    return stack


def _already_resharded(handle: Any) -> bool:
    """``_catch_all_reshard``'s test that a unit is resharded, by storage identity (and offset)
    where the data pointers of ``meta`` tensors are all 0: the flat parameter is its local shard,
    and FSDP did not skip its sharded views."""
    fp = handle.flat_param
    shard = fp._local_shard
    return (fp.untyped_storage()._cdata == shard.untyped_storage()._cdata
            and fp.storage_offset() == shard.storage_offset()
            and not handle._skipped_use_sharded_views)


def _fsdp2_on_meta(rec: Recorder) -> Iterator[None]:
    fpg: Any = None
    fp: Any = None
    for base in ("torch.distributed.fsdp._fully_shard", "torch.distributed._composable.fsdp"):  # 2.6+ / 2.4-2.5
        with contextlib.suppress(ImportError):
            import importlib

            fpg = importlib.import_module(f"{base}._fsdp_param_group")
            fp = importlib.import_module(f"{base}._fsdp_param")
            break
    if fpg is None or fp is None:
        yield
        return
    group_cls, param_cls = fpg.FSDPParamGroup, fp.FSDPParam
    chunker = getattr(fp, "_chunk_with_empty", None)
    if chunker is not None:
        fp._chunk_with_empty = _lazy_chunk_with_empty
    validate = getattr(group_cls, "_validate_no_meta_params", None)
    validate_cpu = getattr(group_cls, "_validate_cpu_offload_params", None)
    init_outputs = getattr(param_cls, "init_all_gather_outputs", None)
    post_backward = getattr(group_cls, "post_backward", None)
    if post_backward is not None:
        group_cls.post_backward = _labelling_unsharded_grads(post_backward, rec)
    reset = getattr(param_cls, "reset_sharded_param", None)
    if reset is not None:
        param_cls.reset_sharded_param = _rebinding_reset(reset)
    symm = getattr(group_cls, "set_symm_mem", None)  # torch ≥ 2.10: FSDP2's buffers on symmetric memory
    if symm is not None:
        from .fsdpsymm import refuse_symm_mem

        group_cls.set_symm_mem = refuse_symm_mem
    if validate is not None:
        group_cls._validate_no_meta_params = lambda self: None
    if validate_cpu is not None:  # CPU offload wants the shards on "cpu": ours are meta, booked as host memory
        group_cls._validate_cpu_offload_params = lambda self: None
    if init_outputs is not None:
        from ..events import Category

        def init_all_gather_outputs(self: Any, *args: Any, **kwargs: Any) -> Any:
            fresh = len(getattr(self, "all_gather_outputs", ())) == 0
            out = init_outputs(self, *args, **kwargs)
            if fresh:
                for t in self.all_gather_outputs:
                    if isinstance(t, torch.Tensor) and on_meta(t):
                        rec.relabel(t, Category.PARAMETER)
            return out

        param_cls.init_all_gather_outputs = init_all_gather_outputs
    try:
        yield
    finally:
        if validate is not None:
            group_cls._validate_no_meta_params = validate
        if validate_cpu is not None:
            group_cls._validate_cpu_offload_params = validate_cpu
        if reset is not None:
            param_cls.reset_sharded_param = reset
        if symm is not None:
            group_cls.set_symm_mem = symm
        if init_outputs is not None:
            param_cls.init_all_gather_outputs = init_outputs
        if chunker is not None:
            fp._chunk_with_empty = chunker
        if post_backward is not None:
            group_cls.post_backward = post_backward


def _labelling_unsharded_grads(post_backward: Any, rec: Recorder) -> Any:
    """``FSDPParamGroup.post_backward`` that records the unsharded gradients it leaves behind
    (no gradient sync: kept for the next micro-batch) as gradients."""
    from ..events import Category

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = post_backward(self, *args, **kwargs)
        if getattr(self, "reduce_grads", True):
            return out
        for fp in getattr(self, "fsdp_params", ()):
            acc = getattr(fp, "unsharded_accumulated_grad", None)
            grad = getattr(getattr(fp, "_unsharded_param", None), "grad", None)
            for t in (acc, grad):
                if isinstance(t, torch.Tensor) and on_meta(t):
                    rec.relabel(t, Category.GRADIENT)
        return out

    return run


def _rebinding_reset(reset: Any) -> Any:
    """``FSDPParam.reset_sharded_param`` for shards on the trace device.

    After ``model.to_empty(device="cuda")`` (or ``load_state_dict(assign=True)``) on a sharded
    model, the module's parameters hold new local shards; at lazy init FSDP2 rebinds its flat
    ``_sharded_param_data`` to them (padding a shard shorter than the padded size), so the shards
    made by ``fully_shard`` die (torch 2.13 ``_fsdp_param.py``). It returns early for ``meta``
    local tensors — every tensor of a trace — which kept both copies alive: the rebinding is done
    here for meta shards whose storage is not the flat shard's."""

    def reset_sharded_param(self: Any) -> Any:
        out = reset(self)
        local = getattr(getattr(self, "sharded_param", None), "_local_tensor", None)
        flat = getattr(self, "_sharded_param_data", None)
        padded = getattr(self, "padded_sharded_param_size", None)
        if not (isinstance(local, torch.Tensor) and isinstance(flat, torch.Tensor) and on_meta(local)
                and on_meta(flat) and padded is not None) or type(flat) is not torch.Tensor \
                or local.untyped_storage()._cdata == flat.untyped_storage()._cdata:
            return out
        if local.size() == padded:
            self._sharded_param_data = local.view(-1)
            return out
        dim = getattr(getattr(self, "fsdp_placement", None), "dim", 0)
        length = local.size(dim) if local.numel() > 0 else 0
        full = local.new_zeros(padded)
        full.narrow(dim, 0, length).copy_(local)
        self._sharded_param_data = full.view(-1)
        self.sharded_param._local_tensor = full.narrow(dim, 0, length)
        return out

    return reset_sharded_param


class _LazyChunks(Sequence[torch.Tensor]):
    """``_chunk_with_empty(tensor, n, dim)`` (torch/distributed/fsdp/_fully_shard/_fsdp_common.py:
    ``torch.chunk`` padded with empty tensors to ``n``), each chunk made when it is indexed.
    FSDP2 reads only chunk 0 (the padded size) and this rank's chunk, so sharding costs the
    same for 8 and 1,024 ranks instead of ``n`` views (and empties) per parameter."""

    def __init__(self, tensor: torch.Tensor, n: int, dim: int) -> None:
        self.tensor, self.n, self.dim = tensor, n, dim
        size = tensor.size(dim)
        self.step = -(-size // n)  # torch.chunk: ceil(size / chunks) per chunk
        self.size = size

    def __len__(self) -> int:
        return self.n

    @overload
    def __getitem__(self, i: int) -> torch.Tensor: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[torch.Tensor]: ...

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(self.n))]
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(i)
        start = i * self.step
        if start < self.size:
            return self.tensor.narrow(self.dim, start, min(self.step, self.size - start))
        return self[0].new_empty(0)


def _lazy_chunk_with_empty(tensor: torch.Tensor, num_chunks: int, dim: int) -> Any:
    if tensor.dim() == 0 or tensor.size(dim) == 0:
        out = list(torch.chunk(tensor, num_chunks, dim=dim))
        while len(out) < num_chunks:
            out.append(out[0].new_empty(0))
        return out
    return _LazyChunks(tensor, num_chunks, dim)


@contextlib.contextmanager
def ddp_on_fake() -> Iterator[None]:
    """DDP's constructor all-gathers every rank's parameter shapes and compares them
    (``torch/distributed/utils.py``: ``_verify_param_shape_across_processes``); on the fake
    process group the gathered shapes are never written, so the check would fail. Every
    emulated rank holds the same model by construction: the check is skipped."""
    try:
        import torch.nn.parallel.distributed as ddp_mod
    except ImportError:
        yield
        return
    orig = getattr(ddp_mod, "_verify_param_shape_across_processes", None)
    if orig is None:
        yield
        return
    ddp_mod._verify_param_shape_across_processes = lambda *a, **k: None  # type: ignore[attr-defined]
    try:
        yield
    finally:
        ddp_mod._verify_param_shape_across_processes = orig  # type: ignore[attr-defined]


@contextlib.contextmanager
def dtensor_metadata_unrecorded() -> Iterator[None]:
    """DTensor derives an op's output shape by running it on fake tensors of the *global*
    shape (``ShardingPropagator._propagate_tensor_meta_non_cached``,
    torch/distributed/tensor/_sharding_prop.py); under the trace's dispatch mode those
    meta kernels would be recorded as full-size allocations (and cached ones kept alive).
    That bookkeeping allocates nothing on a GPU: it runs with the trace's modes set aside."""
    try:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
    except ImportError:
        yield
        return
    from torch.utils._python_dispatch import _disable_current_modes

    # torch >= 2.13 also propagates sharding through an op's decomposition on meta tensors of
    # the global shape (``propagate_op_sharding_non_cached`` → ``_decompositions.py``
    # ``propagate_strategy`` / ``to_meta``), and its lru_cache keeps them: the whole
    # propagation is bookkeeping
    names = ("_propagate_tensor_meta_non_cached", "propagate_op_sharding_non_cached")
    saved = {n: getattr(ShardingPropagator, n) for n in names if getattr(ShardingPropagator, n, None) is not None}
    if not saved:
        yield
        return

    def unrecorded(orig: Any, name: str) -> Any:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            with _disable_current_modes():
                try:
                    return orig(self, *args, **kwargs)
                except Exception as e:
                    _clear_finished_frames(e)
                    if name != "_propagate_tensor_meta_non_cached" or not _on_emulated_cuda(args):
                        raise
                    first = e
                # (outside the handler: the retry's own failure is not chained to the first)
                with _fake_args_on_meta():
                    try:
                        return orig(self, *args, **kwargs)
                    except Exception as e:
                        _clear_finished_frames(e)
                raise first
        return run

    for n, orig in saved.items():
        setattr(ShardingPropagator, n, unrecorded(orig, n))
    try:
        yield
    finally:
        for n, orig in saved.items():
            setattr(ShardingPropagator, n, orig)


def _on_emulated_cuda(args: tuple[Any, ...]) -> bool:
    """True when the op schema (``args[0]``) runs on a ``"cuda"`` mesh while CUDA is emulated
    (the trace's DeviceMesh, a script's own ``init_device_mesh("cuda", ...)``)."""
    schema = args[0] if args else None
    specs = [a for a in getattr(schema, "args_spec", ()) if getattr(a, "mesh", None) is not None]
    return bool(specs) and specs[0].mesh.device_type == "cuda"


@contextlib.contextmanager
def _fake_args_on_meta() -> Iterator[None]:
    """DTensor's fake propagation with its fake arguments on the ``meta`` device instead of the
    mesh's ``"cuda"`` (``_rebuild_tensor_from_dtensor_meta``, torch/distributed/tensor/_op_schema.py).

    A fake CUDA tensor is fake for its data, not for its device: a Tensor method with a device
    guard asks the CUDA runtime for the device, so on the emulated GPU ``fake.copy_(other)``
    raises "PyTorch is not linked with support for cuda devices" on a CPU build (torch 2.13)
    and "CUDA driver version is insufficient" on a CUDA build without a GPU (2.14.1). DTensor's
    ``uniform_`` reaches it through its decomposition (``self.copy_(uniform(...))``,
    torch/_decomp/decompositions.py): ``nn.Linear.reset_parameters`` on an FSDP2 model moved with
    ``to_empty(device="cuda")``, as PyTorch's own FSDP2 example runs it. Only the output's shape,
    stride and dtype are read, which the meta kernels give; used only when the fake CUDA run
    failed (a device's kernels may lay outputs out their own way)."""
    import torch.distributed.tensor._op_schema as op_schema

    rebuild = op_schema._rebuild_tensor_from_dtensor_meta

    def on_meta(arg: Any) -> Any:
        m = arg.tensor_meta
        if m is None:
            return rebuild(arg)  # (raises as torch does)
        return torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device="meta")

    op_schema._rebuild_tensor_from_dtensor_meta = on_meta
    try:
        yield
    finally:
        op_schema._rebuild_tensor_from_dtensor_meta = rebuild


def _clear_finished_frames(exc: BaseException) -> None:
    """Drop the locals of the finished frames in ``exc``'s tracebacks (and its causes').

    Under ``inference_mode`` every DTensor ``aten.linear`` (CompositeImplicitAutograd) reaches
    ``propagate_op_sharding_non_cached``, which (torch >= 2.13) first tries the op's
    decomposition, keeps the exception in a local (``decomp_exception = e``) and raises
    ``NotImplementedError(...) from decomp_exception``; DTensor's dispatcher catches that and
    decomposes the op itself. The kept exception's traceback refers to the frame that holds
    it: a reference cycle, and the frame's ``f_back`` chain pins the caller frames (the
    model's forward calls and their local activations) until the garbage collector runs. A
    real process collects them at the next generation-0 collection; the trace collects only
    at the iteration's end, so every forward of a generation (prefill included) stayed alive
    through the decode loop. The frames are done when the exception reaches here: clearing
    their locals breaks the cycle (the exceptions keep their messages and line numbers)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)  # (skips the frames still running: ours)
        todo += [e.__cause__, e.__context__]


# --------------------------------------------------------------------------- one rank
@dataclass
class RankContext:
    """What a distributed trace hands to the code that lays the model out (FSDP, DDP, TP…)."""

    world: World
    mesh: Any
    """The ``DeviceMesh`` (device type ``"cuda"``, dims named as ``world.dims``)."""
    streams: StreamTable

    def submesh(self, *names: str) -> Any:
        """The mesh restricted to dims ``names`` (``mesh["dp"]``, ``mesh["dp", "tp"]``)."""
        if names == self.world.names:
            return self.mesh
        missing = [n for n in names if n not in self.world.names]
        if missing:
            raise TraceError(f"the mesh has no dimension(s) {missing}; it has {list(self.world.names)}")
        return self.mesh[names[0] if len(names) == 1 else names]

    def shard_mesh(self) -> Any:
        """The mesh FSDP shards over: ``dp``, times ``cp`` when there is context parallelism
        (torchtitan's flattened ``dp_shard_cp``: context-parallel ranks hold the same parameters),
        with ``dp_replicate`` in front under HSDP."""
        dims = tuple(d for d in ("dp", "cp") if d in self.world.names)
        if not dims:
            raise TraceError(f"the mesh has no dp or cp dimension; it has {list(self.world.names)}")
        if len(dims) == 2:
            self.mesh[dims]._flatten("dp_cp")
            shard = "dp_cp"
        else:
            shard = dims[0]
        if "dp_replicate" in self.world.names:
            return self.mesh["dp_replicate", shard]
        return self.mesh[shard] if len(self.world.names) > 1 else self.mesh


@contextlib.contextmanager
def rank_session(sess: Any, world: World, mesh: Any = None) -> Iterator[RankContext]:
    """Enter ``sess`` (a :class:`~vramplan.trace.session.TraceSession`, not yet entered) as
    rank ``world.rank``: the fake world is set up first (outside the trace's modes, so the
    mesh's own bookkeeping tensors are not recorded), then the session with emulated CUDA
    streams, recorded storage resizes and FSDP on meta. All is undone at exit (the process
    group destroyed), so a trace repeats in one process.

    ``mesh``: the ``DeviceMesh`` of a fake world the caller already entered for ``world``
    (TP × FSDP: the model was tensor-parallelised on its ``tp`` dimension before the session
    started); the caller then tears it down."""
    with contextlib.ExitStack() as st:
        if mesh is None:
            mesh = st.enter_context(fake_world(world))
        elif tuple(getattr(mesh, "mesh_dim_names", None) or ()) != world.names:
            raise TraceError(f"the mesh's dimensions {getattr(mesh, 'mesh_dim_names', None)} are not the "
                             f"world's {list(world.names)}")
        st.enter_context(sess)
        streams = st.enter_context(emulated_streams(sess.rec))
        st.enter_context(recorded_resizes(sess.rec))
        st.enter_context(fsdp_on_meta(sess.rec))
        st.enter_context(ddp_on_fake())
        st.enter_context(dtensor_metadata_unrecorded())
        yield RankContext(world=world, mesh=mesh, streams=streams)
