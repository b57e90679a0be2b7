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
from array import array
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch

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


def _is_fake(t: torch.Tensor) -> bool:
    return any(c.__name__ == "FakeTensor" and c.__module__ == "torch._subclasses.fake_tensor" for c in type(t).__mro__)


class Recorder:
    """Turns storage lifetimes into an :class:`EventLog` (columnar, interned strings)."""

    def __init__(self) -> None:
        self.log = EventLog()
        self.phase = 0
        self.iteration = 0
        self.stream = 0
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
        self._st.append(self.stream)
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
        A DTensor stands for this rank's shard: its local tensor is recorded."""
        if type(t) is not torch.Tensor:
            if _is_fake(t):  # DTensor's sharding propagation runs ops on FakeTensors: no memory
                return None
            t = local_tensor(t)
        if t.device.type != "meta":
            return None
        st = t.untyped_storage()
        key = st._cdata
        if key in self.live:
            return key
        nbytes = st.nbytes()
        eid = self._next_id
        self._next_id += 1
        idx = self._emit(0, eid, nbytes, cat, self.intern(describe(t)))
        self.live[key] = [eid, idx, nbytes, weakref.ref(st, partial(self._freed, key))]
        return key

    def track_many(self, ts: Iterable[Any], cat: int = UNDECIDED) -> None:
        for t in ts:
            if isinstance(t, torch.Tensor):
                self.track(t, cat)

    def ignore(self, t: torch.Tensor) -> None:
        """Never record ``t``'s storage (nor views of it): memory that is not on the device in
        the real run (the unsharded meta model FSDP shards from)."""
        if t.device.type != "meta":
            return
        st = t.untyped_storage()
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
        """Give ``t``'s storage a category (tracks it first if unseen)."""
        key = self.track(t, int(cat))
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
    temporaries. Vectorised (a generated 70B log has ~0.9 M events); a log whose ids repeat
    takes the reference loop, :func:`_resolve_categories_py`, whose result it equals.
    """
    import numpy as np

    n = len(log)
    if n == 0:
        return
    action = np.frombuffer(log.action, dtype=np.int8, count=n)
    ids = np.frombuffer(log.id, dtype=np.int64, count=n)
    phase = np.frombuffer(log.phase, dtype=np.int8, count=n)
    it = np.frombuffer(log.iteration, dtype=np.int16, count=n)
    cat = np.frombuffer(log.category, dtype=np.int8, count=n).copy()
    alloc_idx = np.flatnonzero(action == 0)
    free_idx = np.flatnonzero(action == 1)
    alloc_ids, free_ids = ids[alloc_idx], ids[free_idx]
    order = np.argsort(alloc_ids, kind="stable")
    sorted_ids = alloc_ids[order]
    sorted_free = np.sort(free_ids)
    if (sorted_ids[1:] == sorted_ids[:-1]).any() or (sorted_free[1:] == sorted_free[:-1]).any():
        del action, ids, phase, it
        _resolve_categories_py(log)
        return
    span = np.zeros(n, dtype=np.int64)
    np.cumsum((phase[1:] != phase[:-1]) | (it[1:] != it[:-1]), out=span[1:])
    # each FREE's ALLOC (if any), and each ALLOC's FREE (-1: never freed)
    if sorted_ids.size:
        pos = np.minimum(np.searchsorted(sorted_ids, free_ids), sorted_ids.size - 1)
        matched = sorted_ids[pos] == free_ids
    else:
        pos = np.zeros(free_ids.size, dtype=np.int64)
        matched = np.zeros(free_ids.size, dtype=bool)
    owner = alloc_idx[order[pos[matched]]]
    freed_at = free_idx[matched]
    free_of = np.full(n, -1, dtype=np.int64)
    free_of[owner] = freed_at
    f = free_of[alloc_idx]
    undecided = cat[alloc_idx] == UNDECIDED
    forward = np.isin(phase[alloc_idx], np.fromiter(FORWARD_LIKE, dtype=np.int8))
    outlives = (f < 0) | (span[np.maximum(f, 0)] != span[alloc_idx])
    decided = np.where(forward & outlives, int(Category.ACTIVATION), int(Category.TEMPORARY)).astype(np.int8)
    cat[alloc_idx[undecided]] = decided[undecided]
    cat[freed_at] = cat[owner]
    del action, ids, phase, it
    log.category[:] = array("b", cat.tobytes())


def _resolve_categories_py(log: EventLog) -> None:
    """:func:`resolve_categories` as one loop per event: the reference the vectorised version
    is tested against, and what it runs where an id is allocated or freed twice (then the last
    ALLOC and the last FREE of the id pair up)."""
    n = len(log)
    if n == 0:
        return
    action, ids, cat, phase, it = log.action, log.id, log.category, log.phase, log.iteration
    span = array("i", bytes(4 * n))
    s = 0
    for k in range(1, n):
        if phase[k] != phase[k - 1] or it[k] != it[k - 1]:
            s += 1
        span[k] = s
    alloc_at: dict[int, int] = {}
    free_at: dict[int, int] = {}
    for k in range(n):
        a = action[k]
        if a == 0:
            alloc_at[ids[k]] = k
        elif a == 1:
            free_at[ids[k]] = k
    activation, temporary = int(Category.ACTIVATION), int(Category.TEMPORARY)
    for eid, k in alloc_at.items():
        if cat[k] != UNDECIDED:
            continue
        f = free_at.get(eid)
        if phase[k] in FORWARD_LIKE and (f is None or span[f] != span[k]):
            cat[k] = activation
        else:
            cat[k] = temporary
    for eid, f in free_at.items():
        k2 = alloc_at.get(eid)
        if k2 is not None:
            cat[f] = cat[k2]
