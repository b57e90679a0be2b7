"""Decode steps traced once, then advanced exactly: the generation fast path.

Every decode step of ``generate`` runs the same ops; only the KV length grows by one token,
so each event's size (and each dimension of its shape) changes by the same amount from one
step to the next. Tracing 128 steps of a 70B model one by one costs a minute; this module
traces the first :data:`TRACED` steps, checks that the last :data:`MODEL_STEPS` of them
form an exact arithmetic progression — same actions, categories, modules, ops and streams;
every ALLOC's size and shape dimensions affine in the step; every FREE releasing the
allocation at the same position the same number of steps back — and then writes the
remaining steps' events into the log as that progression continues. The allocator replay
still sees every allocation and free of every step.

Where the progression does not hold (a quantised cache that re-quantises every 128 tokens,
a sliding window that stops growing, a lazily created buffer), nothing is extrapolated
and the steps are traced one by one, as before. :func:`eligible` turns the fast path off
up front for caches whose growth is known not to be affine.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from typing import Any

from ..events import Action
from .recorder import Recorder

MODEL_STEPS = 5
"""The last traced steps whose events must form an exact arithmetic progression (the first
of them only anchors what the second frees)."""
TRACED = MODEL_STEPS + 1
"""Decode steps traced for real before extrapolating (the first may differ: lazy set-up)."""

_DESC = re.compile(r"^([^\[]+)\[([0-9,]*)\]$")
_ALLOC, _FREE, _FREE_DEFERRED = int(Action.ALLOC), int(Action.FREE), int(Action.FREE_DEFERRED)


def eligible(cache: Any, config: Any, max_len: int) -> bool:
    """Whether the cache grows by exactly one token per step for the whole generation."""
    from transformers import DynamicCache, StaticCache

    if type(cache) not in (DynamicCache, StaticCache):
        return False  # quantised / cast layers re-quantise or copy in blocks
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    window = getattr(text, "sliding_window", None) or getattr(text, "attention_chunk_size", None)
    return not (isinstance(window, int) and 0 < window < max_len)


@dataclass
class DecodeExtrapolator:
    """Watches decode steps; once they repeat exactly, writes the rest of them."""

    rec: Recorder
    dispatch: Any
    """The trace mode: its ``flops`` counter is advanced with the steps."""
    starts: list[int] = field(default_factory=list)
    flops: list[int] = field(default_factory=list)
    extrapolated: int = 0

    def begin_step(self) -> None:
        self.starts.append(len(self.rec.log))
        self.flops.append(int(self.dispatch.flops))

    def finish(self, remaining: int) -> bool:
        """Called after a traced step; ``remaining`` steps are still to come. Returns True
        when they were written into the log (the caller then stops stepping)."""
        if remaining <= 0 or len(self.starts) < TRACED:
            return False
        bounds = self.starts[-MODEL_STEPS:] + [len(self.rec.log)]
        flops = self.flops[-MODEL_STEPS:] + [int(self.dispatch.flops)]
        pattern = self._pattern(bounds)
        if pattern is None:
            return False
        step_flops = [b - a for a, b in itertools.pairwise(flops)]
        dflops = _affine(step_flops)
        if dflops is None:
            return False
        self._write(pattern, bounds, remaining)
        last = step_flops[-1]
        self.dispatch.flops += sum(last + dflops * u for u in range(1, remaining + 1))
        self.extrapolated = remaining
        return True

    # --- analysis ---------------------------------------------------------------------
    def _pattern(self, bounds: list[int]) -> _Pattern | None:
        log = self.rec.log
        n = bounds[1] - bounds[0]
        if any(b - a != n for a, b in itertools.pairwise(bounds)) or n == 0:
            return None
        slices = [(a, b) for a, b in itertools.pairwise(bounds)]
        for col in (log.action, log.stream, log.category, log.phase, log.module, log.op, log.iteration):
            first = col[slices[0][0]:slices[0][1]]
            if any(col[a:b] != first for a, b in slices[1:]):
                return None
        # where each allocation id lives: (model step, position)
        where: dict[int, tuple[int, int]] = {}
        for s, (a, b) in enumerate(slices):
            for j in range(b - a):
                if log.action[a + j] == _ALLOC:
                    where[log.id[a + j]] = (s, j)
        deltas: list[int] = [0] * n
        dims: list[tuple[str, list[int], list[int]] | None] = [None] * n
        frees: dict[int, tuple[int, int]] = {}
        for j in range(n):
            act = log.action[slices[0][0] + j]
            if act == _ALLOC:
                d = _affine([log.size[a + j] for a, _ in slices])
                if d is None:
                    return None
                deltas[j] = d
                ok, shape = self._dims([log.desc[a + j] for a, _ in slices])
                if not ok:
                    return None
                dims[j] = shape
            elif act == _FREE or act == int(Action.FREE_DEFERRED):
                refs = []
                for s, (a, _) in enumerate(slices):
                    if s == 0:
                        continue  # the anchor step may free what came before the window
                    w = where.get(log.id[a + j])
                    if w is None:
                        return None  # frees something allocated before the model steps
                    refs.append((s - w[0], w[1]))
                if any(r != refs[0] for r in refs[1:]):
                    return None
                frees[j] = refs[0]
        # what is still alive must be a transient of the progression, not a per-step leak
        age = {pos: back for back, pos in frees.values()}
        live = self._live_positions(slices, where)
        if live is None:
            return None
        for s, j in live:
            back = age.get(j)
            if back is None or back <= len(slices) - 1 - s:
                return None
        return _Pattern(n=n, deltas=deltas, dims=dims, frees=frees, live=live)

    def _live_positions(self, slices: list[tuple[int, int]],
                        where: dict[int, tuple[int, int]]) -> list[tuple[int, int]] | None:
        lo = slices[0][0]
        out = []
        for rec in self.rec.live.values():
            if rec[1] < lo:
                continue
            w = where.get(rec[0])
            if w is None:
                return None
            out.append(w)
        return out

    def _dims(self, descs: list[int]) -> tuple[bool, tuple[str, list[int], list[int]] | None]:
        """(affine?, (dtype, last shape, per-step change) or None when the shape is constant)."""
        strings = self.rec.log.strings
        if all(d == descs[0] for d in descs):
            return True, None
        parsed = [_DESC.match(strings[d]) for d in descs]
        if any(m is None for m in parsed):
            return False, None
        names = {m.group(1) for m in parsed if m is not None}
        shapes = [[int(x) for x in m.group(2).split(",") if x] for m in parsed if m is not None]
        if len(names) != 1 or any(len(s) != len(shapes[0]) for s in shapes):
            return False, None
        steps = []
        for k in range(len(shapes[0])):
            d = _affine([s[k] for s in shapes])
            if d is None:
                return False, None
            steps.append(d)
        return True, (names.pop(), shapes[-1], steps)

    # --- synthesis --------------------------------------------------------------------
    def _write(self, pat: _Pattern, bounds: list[int], remaining: int) -> None:
        rec, log = self.rec, self.rec.log
        a, b = bounds[-2], bounds[-1]
        m = len(bounds) - 2  # index of the last traced model step
        # ids of the traced model steps' allocations, by (step, position)
        traced: list[dict[int, int]] = []
        for s in range(len(bounds) - 1):
            lo = bounds[s]
            traced.append({j: log.id[lo + j] for j in range(pat.n) if log.action[lo + j] == _ALLOC})
        alloc_pos = [j for j in range(pat.n) if log.action[a + j] == _ALLOC]
        per_step = len(alloc_pos)
        base = rec._next_id
        rank = {j: r for r, j in enumerate(alloc_pos)}

        def id_of(step: int, j: int) -> int:  # step: 0..m traced, > m synthesised
            if step <= m:
                return traced[step][j]
            return base + (step - m - 1) * per_step + rank[j]

        # the `remaining` steps as (remaining, n) arrays, row u-1 = step m+u: an ALLOC at j gets
        # id_of(m+u, j); a FREE at j releases id_of(m+u-back, pos) (a traced id while u <= back)
        import numpy as np

        n = pat.n
        acts = np.frombuffer(log.action, dtype=np.int8, count=b)[a:b]
        is_alloc = acts == _ALLOC
        frees = [j for j in range(n) if acts[j] in (_FREE, _FREE_DEFERRED)]
        back = np.zeros(n, dtype=np.int64)
        slot = np.zeros(n, dtype=np.int64)  # rank of the allocation an event creates or releases
        for j in alloc_pos:
            slot[j] = rank[j]
        for j in frees:
            back[j], pos = pat.frees[j]
            slot[j] = rank[pos]
        u = np.arange(1, remaining + 1, dtype=np.int64)[:, None]
        ids = base + (u - back - 1) * per_step + slot
        ids[:, ~(is_alloc | np.isin(acts, (_FREE, _FREE_DEFERRED)))] = 0
        for j in frees:  # the first steps free what the traced steps allocated
            bk, pos = pat.frees[j]
            for uu in range(1, min(bk, remaining) + 1):
                ids[uu - 1, j] = id_of(m + uu - bk, pos)
        sizes = np.frombuffer(log.size, dtype=np.int64, count=b)[a:b]
        new_sizes = sizes + u * np.asarray(pat.deltas, dtype=np.int64)
        descs = np.tile(np.frombuffer(log.desc, dtype=np.int32, count=b)[a:b], (remaining, 1))
        growing = [(j, dim) for j, dim in enumerate(pat.dims) if dim is not None]
        for uu in range(1, remaining + 1):  # (strings interned step by step, as the steps come)
            for j, (name, last, steps) in growing:
                shape = ",".join(str(x + uu * d) for x, d in zip(last, steps, strict=True))
                descs[uu - 1, j] = log.intern(f"{name}[{shape}]")
        del acts, sizes
        log.id.frombytes(ids.tobytes())
        log.size.frombytes(new_sizes.tobytes())
        log.desc.frombytes(descs.astype(np.int32).tobytes())
        for col in (log.action, log.stream, log.category, log.phase, log.module, log.op, log.iteration):
            col.frombytes(col[a:b].tobytes() * remaining)
        rec._next_id = base + remaining * per_step
        # the storages alive now stand for their counterparts `remaining` steps on
        first = bounds[0]
        for r in rec.live.values():
            if r[1] < first:
                continue
            s, j = divmod(r[1] - first, pat.n)
            step = s + remaining
            r[0] = id_of(step, j)
            r[1] = (first + step * pat.n + j) if step <= m else (b + (step - m - 1) * pat.n + j)
            r[2] = log.size[r[1]]


@dataclass(frozen=True)
class _Pattern:
    n: int
    deltas: list[int]
    dims: list[tuple[str, list[int], list[int]] | None]
    frees: dict[int, tuple[int, int]]
    """FREE position → (steps back, position) of the allocation it releases."""
    live: list[tuple[int, int]]


def _affine(values: list[int]) -> int | None:
    """The common difference of an arithmetic progression, or None."""
    d = values[1] - values[0]
    return d if all(y - x == d for x, y in itertools.pairwise(values)) else None
