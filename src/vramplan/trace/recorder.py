"""The event recorder: storages of ``meta`` tensors become ALLOC/FREE events.

A storage is allocated when an op first returns a tensor on it and freed when its last
reference dies (a weakref finalizer on the untyped storage, as PyTorch's MemTracker does).
Views and in-place results share a known storage and cost nothing. Only ``meta`` tensors
stand for GPU memory; CPU tensors (e.g. the optimizer's ``step`` counters) are ignored.

Categories: explicit ones (parameter, buffer, input, gradient, optimizer state, KV cache,
autocast cache, workspace) are set when known — at allocation or later via :meth:`relabel`.
Everything else is recorded as ``OTHER`` ("undecided") and resolved after the run by
:func:`resolve_categories`: allocated in a forward-like phase and still alive when that
phase span ends → activation (saved for backward, or an output); otherwise temporary.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..emulate.tensors import on_meta
from ..events import PHASES, Action, Category, EventLog
from ..workload import Phase

PHASE_INDEX: dict[Phase, int] = {Phase(p): i for i, p in enumerate(PHASES)}
FORWARD_LIKE = frozenset(PHASE_INDEX[p] for p in (Phase.FORWARD, Phase.RECOMPUTE, Phase.PREFILL, Phase.DECODE))
UNDECIDED = int(Category.OTHER)

_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "bool", torch.uint64: "u64",
    torch.float8_e4m3fn: "f8e4m3", torch.float8_e5m2: "f8e5m2",
}


def describe(t: torch.Tensor) -> str:
    """``bf16[4,2048,4096]``."""
    name = _DTYPE_NAMES.get(t.dtype) or str(t.dtype).removeprefix("torch.")
    return f"{name}[{','.join(str(s) for s in t.shape)}]"


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (any other tensor is its own)."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def inner_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that hold ``t``'s memory: ``t`` itself, or for a wrapper subclass (DTensor:
    its local shard; torchao's ``Float8TrainingTensor``: its fp8 data and scale;
    ``WeightWithDynamicFloat8CastTensor``: the weight it wraps) the tensors it flattens to
    (``__tensor_flatten__``), recursively. A wrapper's own storage reports its shape × dtype in
    bytes and holds no memory (``_make_wrapper_subclass`` allocates nothing, on CUDA as on the CPU)."""
    if type(t) is torch.Tensor or not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    out: list[torch.Tensor] = []
    for n in names:
        x = getattr(t, n, None)
        if isinstance(x, torch.Tensor):
            out += inner_tensors(x)
    return out


def _is_fake(t: torch.Tensor) -> bool:
    return any(c.__name__ == "FakeTensor" and c.__module__ == "torch._subclasses.fake_tensor" for c in type(t).__mro__)


class Recorder:
    """Turns storage lifetimes into an :class:`EventLog` (columnar, interned strings)."""

    def __init__(self) -> None:
        self.log = EventLog()
        self.phase = 0
        self.iteration = 0
        self.stream = 0
        self.capture_pool: int | None = None
        """While a CUDA graph captures: its private pool's id, the stream of every event
        (:data:`vramplan.allocator.constants.PRIVATE_POOL` and up)."""
        self.module = 0
        """Interned id of the module path the current op belongs to."""
        self.op = 0
        """Interned id of the current op name."""
        self.live: dict[int, list[Any]] = {}
        """storage key → [event id, alloc event index, nbytes, weakref]."""
        self._next_id = 1
        self.active = True
        self.on_free: list[Callable[[int], None]] = []
        """Callbacks told the storage key of every freed storage (value trackers)."""
        self.host: Any = None
        """The rank's host memory (:class:`~vramplan.trace.host.HostMemory`) while tensors
        live on the CPU in the real run (FSDP2's CPU offload); None otherwise."""
        self.spans_closed: list[int] = []
        self.guard: Callable[[int], None] | None = None
        """Called with the bytes asked before each new storage is recorded; may raise
        (``vramplan run``'s emulated out-of-memory error, :mod:`vramplan.script.oom`)."""
        # columnar aliases (hot path)
        log = self.log
        self._a, self._id, self._sz, self._st = log.action, log.id, log.size, log.stream
        self._cat, self._ph, self._mod, self._opc = log.category, log.phase, log.module, log.op
        self._desc, self._it = log.desc, log.iteration

    # --- strings ---------------------------------------------------------------------
    def intern(self, s: str) -> int:
        return self.log.intern(s)

    # --- low level -------------------------------------------------------------------
    def _emit(self, action: int, eid: int, size: int, cat: int, desc: int = 0) -> int:
        idx = len(self._a)
        self._a.append(action)
        self._id.append(eid)
        self._sz.append(size)
        self._st.append(self.stream if self.capture_pool is None else self.capture_pool)
        self._cat.append(cat)
        self._ph.append(self.phase)
        self._mod.append(self.module)
        self._opc.append(self.op)
        self._desc.append(desc)
        self._it.append(self.iteration)
        return idx

    def mark(self, label: str) -> None:
        """A MARK event (phase or iteration boundary)."""
        saved = self.op
        self.op = self.intern(label)
        self._emit(int(Action.MARK), 0, 0, UNDECIDED)
        self.op = saved

    def emit_action(self, action: Action, label: str) -> None:
        """A SYNC / EMPTY_CACHE event (no memory change; the allocator replay acts on it)."""
        saved = self.op
        self.op = self.intern(label)
        self._emit(int(action), 0, 0, UNDECIDED)
        self.op = saved

    def synthetic_alloc(self, size: int, cat: Category, desc: str, op: str | None = None) -> int:
        """Allocate memory that no tensor stands for (a kernel workspace); returns its id."""
        eid = self._next_id
        self._next_id += 1
        saved = self.op
        if op is not None:
            self.op = self.intern(op)
        self._emit(int(Action.ALLOC), eid, int(size), int(cat), self.intern(desc))
        self.op = saved
        return eid

    def synthetic_free(self, eid: int, cat: Category, op: str | None = None) -> None:
        saved = self.op
        if op is not None:
            self.op = self.intern(op)
        self._emit(int(Action.FREE), eid, 0, int(cat))
        self.op = saved

    # --- storages --------------------------------------------------------------------
    def track(self, t: torch.Tensor, cat: int = UNDECIDED) -> int | None:
        """Record ``t``'s storage if new; returns its storage key (None if not a device tensor).
        A wrapper subclass stands for its inner tensors (:func:`inner_tensors`; a DTensor: this
        rank's shard): they are recorded, and the first one's key returned."""
        if type(t) is not torch.Tensor:
            if _is_fake(t):  # DTensor's sharding propagation runs ops on FakeTensors: no memory
                return None
            if is_traceable_wrapper_subclass(t):
                keys = [self.track(x, cat) for x in inner_tensors(t)]
                return next((k for k in keys if k is not None), None)
        if not on_meta(t):
            return None
        st = t.untyped_storage()
        key = st._cdata
        if key in self.live:
            return key
        nbytes = st.nbytes()
        if self.guard is not None:
            self.guard(nbytes)
        eid = self._next_id
        self._next_id += 1
        idx = self._emit(0, eid, nbytes, cat, self.intern(describe(t)))
        self.live[key] = [eid, idx, nbytes, weakref.ref(st, partial(self._freed, key))]
        return key

    def records(self, key: int) -> bool:
        """Whether the storage ``key`` is device memory this trace records (not ignored)."""
        entry = self.live.get(key)
        return entry is not None and entry[1] != -1

    def track_many(self, ts: Iterable[Any], cat: int = UNDECIDED) -> None:
        for t in ts:
            if isinstance(t, torch.Tensor):
                self.track(t, cat)

    def ignore(self, t: torch.Tensor) -> None:
        """Never record ``t``'s storage (nor views of it): memory that is not on the device in
        the real run (the unsharded meta model FSDP shards from)."""
        for x in inner_tensors(t):
            if not on_meta(x):
                continue
            st = x.untyped_storage()
            key = st._cdata
            if key not in self.live:
                self.live[key] = [0, -1, 0, weakref.ref(st, partial(self._freed, key))]

    def resized(self, st: Any, nbytes: int) -> None:
        """A tracked storage was resized in place (``UntypedStorage.resize_``, as FSDP frees
        and re-allocates unsharded parameters): the old bytes are freed, the new allocated
        under a new id (an untracked storage is tracked from here)."""
        key = st._cdata
        entry = self.live.get(key)
        if entry is None:
            if nbytes > 0:
                eid = self._next_id
                self._next_id += 1
                idx = self._emit(0, eid, nbytes, UNDECIDED, self.intern(f"storage[{nbytes}]"))
                self.live[key] = [eid, idx, nbytes, weakref.ref(st, partial(self._freed, key))]
            return
        if entry[2] == nbytes or entry[1] < 0:  # (unchanged, or an ignored storage)
            return
        cat = self._cat[entry[1]]
        if entry[0]:
            self._emit(1, entry[0], 0, cat)
        if nbytes > 0:
            eid = self._next_id
            self._next_id += 1
            entry[0], entry[1] = eid, self._emit(0, eid, nbytes, cat, self._desc[entry[1]])
        else:
            entry[0] = 0
        entry[2] = nbytes

    def _freed(self, key: int, _ref: object) -> None:
        rec = self.live.pop(key, None)
        if rec is None or not self.active:
            return
        if rec[0]:  # (0: resized to nothing, already freed)
            self._emit(1, rec[0], 0, self._cat[rec[1]])
        for cb in self.on_free:
            cb(key)

    def relabel(self, t: torch.Tensor, cat: Category) -> None:
        """Give ``t``'s storage a category (tracks it first if unseen; a wrapper subclass: each
        of its inner tensors')."""
        for x in inner_tensors(t):
            key = self.track(x, int(cat))
            if key is not None and self.live[key][1] >= 0:
                self._cat[self.live[key][1]] = int(cat)

    def close(self) -> None:
        """Stop recording (finalizers of storages still alive become no-ops)."""
        self.active = False
        self.on_free.clear()
        self.live.clear()


def resolve_categories(log: EventLog) -> None:
    """Decide undecided categories by lifetime and copy each ALLOC's category to its FREE.

    Undecided storages allocated in a forward-like phase (forward, recompute, prefill,
    decode) that outlive the contiguous span of that phase are activations; the rest are
    temporaries. (An id allocated or freed more than once: its last ALLOC and FREE count.)
    """
    n = len(log)
    if n == 0:
        return
    action = np.frombuffer(log.action, dtype=np.int8)
    ids = np.frombuffer(log.id, dtype=np.int64)
    phase = np.frombuffer(log.phase, dtype=np.int8)
    it = np.frombuffer(log.iteration, dtype=np.int16)
    cat = np.frombuffer(log.category, dtype=np.int8)  # (a writable view: resolved in place)
    span = np.zeros(n, np.int64)
    np.cumsum((phase[1:] != phase[:-1]) | (it[1:] != it[:-1]), out=span[1:])
    alloc_id, alloc_at = _last_per_id(ids, np.flatnonzero(action == 0))
    free_id, free_at = _last_per_id(ids, np.flatnonzero(action == 1))
    freed = _lookup(free_id, alloc_id)
    f = free_at[np.maximum(freed, 0)] if len(free_at) else np.zeros(len(alloc_at), np.int64)
    outlives = (freed < 0) | (span[f] != span[alloc_at])
    forward = np.isin(phase[alloc_at], np.fromiter(FORWARD_LIKE, np.int8))
    undecided = cat[alloc_at] == UNDECIDED
    at = alloc_at[undecided]
    cat[at] = np.where((forward & outlives)[undecided], int(Category.ACTIVATION), int(Category.TEMPORARY))
    k = _lookup(alloc_id, free_id)
    has = k >= 0
    cat[free_at[has]] = cat[alloc_at[k[has]]]


def _last_per_id(ids: np.ndarray, at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct ids, position of each one's last event) among the events ``at``."""
    rev = at[::-1]
    uniq, first = np.unique(ids[rev], return_index=True)
    return uniq, rev[first]


def _lookup(sorted_ids: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Index of each of ``want`` in ``sorted_ids`` (-1 where absent)."""
    if len(sorted_ids) == 0:
        return np.full(len(want), -1, np.int64)
    pos = np.minimum(np.searchsorted(sorted_ids, want), len(sorted_ids) - 1)
    return np.where(sorted_ids[pos] == want, pos, -1)
