"""Identical decoder layers traced a few times, the model's other layers written exactly.

A decoder's repeated layers run the same ops on the same shapes, so the trace of an
``L``-layer model is the trace of a shorter model with more copies of one layer's events
inserted: in the forward, the backward (and recompute), the optimizer's per-parameter
outputs (foreach ops allocate one tensor per parameter, in parameter order) and every
iteration. Tracing Llama-3.1-8B's 32 layers costs a second and DeepSeek-V3's 61 layers
(58 with 256 experts each) four minutes; this module traces the model three times with
``p + 1``, ``p + 2`` and ``p + 3`` layers (``p``: the dense prefix of an MoE model) and
writes the ``L``-layer log from them, as :mod:`.decode` does with decode steps:

1. Each event becomes a token: action, size, stream, category, phase, module path with the
   layer index blanked, op, dtype/shape and iteration (ids left out).
2. The ``p + 2`` log must be the ``p + 1`` log with blocks inserted at some points (found
   greedily), and the ``p + 3`` log exactly the same with each block inserted twice.
3. Every FREE must name its allocation by a rule that holds in both longer traces: a fixed
   event of the shortest, the first or the last copy of a block, the same copy, the copy
   before or after (the layer before or after), or the mirrored copy (the optimizer frees a
   list back to front); every layer index must be affine in the copy and the copy count.
4. The log is written for ``L - p - 1`` copies (ids are allocation ordinals, as the recorder
   numbers them) and, as a self-check, for two copies, which must equal the ``p + 3`` trace
   column for column.

FLOPs, parameter counts and notes are affine in the number of layers and extrapolated from
the same traces (the third checks the progression). Where anything does not hold — per-layer
config differences (``layer_types``, MoE layer steps), partial or every-k-th checkpointing,
parallel layouts, activation offload, compile — nothing is replicated and every layer is
traced; :func:`refusal` says why up front, :func:`extrapolate` returns the reason when the
check fails. ``tests/test_trace_replicate.py`` compares replicated logs with full traces.

MoE experts are replicated the same way (:func:`extrapolate_experts`): each reduced model (or,
where its layers differ, the model itself) is traced with every eager experts loop cut to 2, 3
and 4 experts (:mod:`.experts`), and the same alignment, rules and writer give the log of every
expert (module paths keep their layer indices; a FREE is matched by its allocation's size, see
:class:`_Vocab`). DeepSeek-V3's 58 MoE layers of 256 experts are nine small traces.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..events import Action, EventLog
from ..models.spec import ModelSpec
from ..workload import Checkpointing, Workload
from .result import TraceResult

REPEATED = 2
"""Repeated layers (after the dense prefix) in the shortest of the three reduced traces: the
first and the last, between which the others are inserted."""
WINDOW = 64
"""Tokens that must match after a candidate insertion for the greedy alignment to take it at once."""
CANDIDATES = 4096
"""Candidate insertion lengths tried at one point."""
BACKTRACK = 64
"""Tokens the alignment may back up over to start a block earlier."""
EXPERTS = 2
"""Experts each MoE loop runs in the shortest of the three expert-cut traces (:mod:`.experts`)."""
CUT_FROM = 64
"""Fewest experts per MoE layer for which the loops are cut: three traces with 2, 3 and 4
experts cost more than one of every expert below that. CPU seconds of the default train
trace, every expert vs cut (2-core machine, loaded): Mixtral-8x7B's 8: 5.5 vs 8.4;
gpt-oss-20b's 32: 20.2 vs 19.1; DeepSeek-V2-Lite's 64: 12.8 vs 8.3; Qwen3-30B-A3B's 128:
20.1 vs 8.2; DeepSeek-V3's 256: 28.6 vs 13.2."""
_NO_CONTAINER = "\0"
"""A layer list no module path has (expert-cut traces keep their layer indices)."""

_ALLOC = int(Action.ALLOC)
_PER_LAYER_INTS = ("decoder_sparse_step", "moe_layer_freq", "interleave_moe_layer_step", "full_attention_interval",
                   "sliding_window_pattern", "global_attn_every_n_layers", "cross_attention_layers_step")


@dataclass(frozen=True)
class Traced:
    """One reduced model's trace: its result, its module paths and its layer count."""

    result: TraceResult
    paths: frozenset[str]
    layers: int


@dataclass(frozen=True)
class Replicated:
    """The extrapolated ``L``-layer figures (read by :func:`.run.summarize_log`)."""

    events: EventLog
    paths: frozenset[str]
    params: int
    trainable: int
    flops: int | None
    notes: tuple[str, ...]


# --------------------------------------------------------------------------- eligibility
def refusal(spec: ModelSpec, w: Workload, *, model_parallel: bool, layout: Any, checkpoint_policy: Any) -> str | None:
    """Why the layers of ``spec`` under ``w`` cannot be replicated (None: they may be; the
    traces are still checked)."""
    cfg = spec.config
    layers = cfg.get("num_hidden_layers")
    if not isinstance(layers, int) or isinstance(layers, bool) or layers != spec.layers:
        return "no top-level num_hidden_layers"
    if layers < reduced_layers(spec)[-1] + 1:
        return "too few layers to gain"
    if model_parallel or layout is not None:
        return "parallel layouts are traced in full"
    if w.training and (w.checkpointing is not Checkpointing.NONE or checkpoint_policy is not None) and (
            w.checkpoint_every != 1 or w.checkpoint_fraction != 1.0):
        return "checkpointing only some layers"
    if w.activation_offload or w.compile:
        return "activation offload / compile"
    why = _per_layer_config(spec)
    return why


def experts_refusal(spec: ModelSpec, w: Workload, *, model_parallel: bool, layout: Any) -> str | None:
    """Why the MoE experts loops of ``spec`` under ``w`` are not cut to a few experts
    (:mod:`.experts`; None: they are, and the traces are still checked)."""
    if spec.n_experts < CUT_FROM:
        return f"fewer than {CUT_FROM} experts per layer"
    if model_parallel or layout is not None:
        return "parallel layouts are traced in full"
    if w.activation_offload or w.compile:
        return "activation offload / compile"
    return None


def _per_layer_config(spec: ModelSpec) -> str | None:
    """A config whose layers differ one from the next (beyond a dense prefix)."""
    cfg = dict(spec.config)
    text = cfg.get("text_config")
    if isinstance(text, dict):
        return "a nested text config"
    n = cfg["num_hidden_layers"]
    for key, value in cfg.items():
        if isinstance(value, (list, tuple)) and len(value) == n and len({repr(v) for v in value}) > 1:
            return f"per-layer `{key}`"
        if key in ("mlp_only_layers", "no_rope_layers", "layers_block_type", "hybrid_override_pattern",
                   "attn_layer_indices", "block_types") and value:
            return f"per-layer `{key}`"
    for key in _PER_LAYER_INTS:
        v = cfg.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 1:
            return f"`{key}` = {v}"
    if cfg.get("use_sliding_window") and isinstance(cfg.get("max_window_layers"), int) and cfg["max_window_layers"] < n:
        return "sliding window on some layers"
    try:
        from ..models.build import quiet
        from ..models.hf_import import import_transformers

        # (its first import in a trace: import_transformers spares transformers' second folder scan)
        transformers = import_transformers()

        # (a deep copy: transformers edits nested entries such as rope_scaling in place)
        c = copy.deepcopy({k: v for k, v in cfg.items() if k != "model_type"})
        with quiet():
            built = transformers.AutoConfig.for_model(str(cfg.get("model_type")), **c)
    except Exception:  # noqa: BLE001 — the model build reports its own errors
        return None
    for key, value in vars(built).items():
        if isinstance(value, (list, tuple)) and len(value) == n and len({repr(v) for v in value}) > 1:
            return f"per-layer `{key}`"
    return None


def prefix_layers(spec: ModelSpec) -> int:
    """Leading layers kept as they are (the dense layers before an MoE model's first MoE layer)."""
    return int(spec.dense_layers) if spec.n_experts else 0


def reduced_layers(spec: ModelSpec) -> tuple[int, int, int]:
    p = prefix_layers(spec) + REPEATED
    return p, p + 1, p + 2


def reduced_spec(spec: ModelSpec, layers: int) -> ModelSpec:
    """``spec`` with ``layers`` decoder layers (everything else unchanged)."""
    return dataclasses.replace(spec, config={**spec.config, "num_hidden_layers": layers}, layers=layers)


# --------------------------------------------------------------------------- tokens
@dataclass
class _Tokens:
    tok: list[int]
    tmpl: np.ndarray
    """Global id of the module template (layer index blanked)."""
    idx: np.ndarray
    """Layer index, -1 where the module is not inside a layer."""


class _Vocab:
    """Strings and token tuples shared by the three logs."""

    def __init__(self, container: str, *, loose: bool = False) -> None:
        self.container = container
        self.loose = loose
        """A FREE names its allocation by size only (not shape and op): a gradient accumulated
        over the experts of one loop is freed as the first expert's ``index_put`` or
        ``select_backward`` and then as the ``add`` results of the others, so that the inserted
        experts look alike."""
        self.strings: dict[str, int] = {}
        self.names: list[str] = []
        self.tokens: dict[tuple[int, ...], int] = {}
        self._layer = re.compile(re.escape(container) + r"\.(\d+)(?=\.|$)")

    def sid(self, s: str) -> int:
        i = self.strings.get(s)
        if i is None:
            i = self.strings[s] = len(self.names)
            self.names.append(s)
        return i

    def module(self, path: str) -> tuple[int, int]:
        m = self._layer.match(path)
        if m is None:
            return self.sid(path), -1
        return self.sid(f"{self.container}.#{path[m.end():]}"), int(m.group(1))

    def read(self, log: EventLog, prefix: int, layers: int) -> _Tokens | None:
        """Tokens of ``log`` (a model with ``layers`` layers, the first ``prefix`` of another
        kind): a layer is named by its index in the prefix, else as the first, a middle or the
        last repeated layer."""
        gs = [self.sid(s) for s in log.strings]
        mods = [self.module(s) for s in log.strings]

        def label(i: int) -> str:
            if i < prefix:
                return str(i)
            return "first" if i == prefix else "last" if i == layers - 1 else "middle"

        mt = [m[0] if m[1] < 0 else self.sid(f"{self.names[m[0]]}@{label(m[1])}") for m in mods]
        tokens = self.tokens
        tok: list[int] = []
        # a FREE is told apart by what it frees (size, shape and op of the allocation): a run
        # of frees then splits at the layers' boundaries
        tg = _targets(log)
        if tg is None:
            return None
        size, desc, opc = log.size, log.desc, log.op
        for k, (a, sz, st, cat, ph, mo, op, de, it) in enumerate(zip(
                log.action, size, log.stream, log.category, log.phase, log.module, opc, desc, log.iteration,
                strict=True)):
            t = tg[k]
            if t >= 0:
                key = (a, size[t], st, cat, ph, mt[mo], gs[op], -1 if self.loose else gs[desc[t]], it,
                       -1 if self.loose else gs[opc[t]])
            else:
                key = (a, sz, st, cat, ph, mt[mo], gs[op], gs[de], it, -1)
            got = tokens.get(key)
            if got is None:
                got = tokens[key] = len(tokens)
            tok.append(got)
        mod = np.frombuffer(log.module, dtype=np.int32) if len(log) else np.zeros(0, np.int32)
        tm = np.asarray([m[0] for m in mods], dtype=np.int64)[mod]
        ix = np.asarray([m[1] for m in mods], dtype=np.int64)[mod]
        return _Tokens(tok=tok, tmpl=tm, idx=ix)


def container_of(traces: Sequence[Traced]) -> str | None:
    """The module path of the decoder's layer list: the prefix whose indices are exactly
    ``0 .. layers - 1`` in every trace."""
    found: set[str] | None = None
    for t in traces:
        seen: dict[str, set[int]] = {}
        for path in t.paths:
            parts = path.split(".")
            for i, part in enumerate(parts[1:], 1):
                if part.isdigit():
                    seen.setdefault(".".join(parts[:i]), set()).add(int(part))
                    break
        ok = {k for k, v in seen.items() if v == set(range(t.layers))}
        found = ok if found is None else found & ok
    if not found or len(found) != 1:
        return None
    return found.pop()


# --------------------------------------------------------------------------- alignment
def _common(a: list[int], i: int, b: list[int], j: int) -> int:
    limit = min(len(a) - i, len(b) - j)
    n = 0
    for chunk in (4096, 256, 16, 1):
        while n + chunk <= limit and a[i + n:i + n + chunk] == b[j + n:j + n + chunk]:
            n += chunk
    return n


class _Aligner:
    """``b`` as ``a`` with blocks inserted, and ``c`` as ``a`` with each block inserted twice.

    Equal tokens pair up only where what they free pairs up too: an event of ``a`` freeing
    allocation ``x`` pairs with one of ``b`` freeing ``x``'s partner or an inserted
    allocation. At a mismatch the block taken is the first after which ``WINDOW`` tokens of
    ``a`` follow in both ``b`` and ``c`` (else the one after which most do)."""

    def __init__(self, a: list[int], b: list[int], c: list[int], ta: np.ndarray, tb: np.ndarray) -> None:
        self.a, self.b, self.c, self.ta, self.tb = a, b, c, ta, tb
        self.partner = np.full(len(a), -1, np.int64)
        self.inserted = np.zeros(len(b) + 1, bool)

    def _refs_ok(self, i: int, p: int, n: int, block: tuple[int, int] = (0, 0)) -> int:
        """How many of the ``n`` tokens paired from a[i] and b[p] on free partners (or inserted
        allocations, or ones in ``block``, the candidate insertion)."""
        if n == 0:
            return 0
        ta, tb = self.ta[i:i + n], self.tb[p:p + n]
        has = ta >= 0
        if not has.any():
            return n
        inside = ta >= i
        want = np.where(inside, ta - i + p, self.partner[np.where(has & ~inside, ta, 0)])
        ok = ~has | (tb == want) | self.inserted[np.where(tb >= 0, tb, len(self.b))] | (
            (tb >= block[0]) & (tb < block[1]))
        bad = np.flatnonzero(~ok)
        return int(bad[0]) if len(bad) else n

    def run(self) -> list[tuple[int, int, int]] | None:
        a, b = self.a, self.b
        out: list[tuple[int, int, int]] = []
        i = j = 0
        while True:
            n = self._refs_ok(i, j, _common(a, i, b, j))
            self.partner[i:i + n] = np.arange(j, j + n)
            i, j = i + n, j + n
            if i == len(a) and j == len(b):
                return out if self._rebuilds(out) else None
            # the block may start before the mismatch (tokens equal to the block's own): back
            # up over the run just matched, first to where WINDOW tokens follow, else the best
            need = min(WINDOW, len(a) - i)
            choice, best = None, -BACKTRACK - 2
            for d in range(min(n, BACKTRACK) + 1):
                ln, run = self._insertion(i - d, j - d)
                if ln and run - d > best:  # (tokens matched past the mismatch)
                    choice, best = (d, ln), run - d
                if ln and run >= need + d:
                    break
            if choice is None:
                return None
            d, ln = choice
            i, j = i - d, j - d
            self.partner[i:i + d] = -1
            out.append((i, j, ln))
            self.inserted[j:j + ln] = True
            j += ln

    def _rebuilds(self, out: list[tuple[int, int, int]]) -> bool:
        """Whether ``a`` with the blocks inserted once is ``b`` and twice is ``c`` (the greedy
        walk checks ``c`` only around each block: a match of ``a`` in ``b`` can still differ in
        ``c``)."""
        a, b = self.a, self.b
        once: list[int] = []
        twice: list[int] = []
        prev = 0
        for x, s, ln in out:
            block = b[s:s + ln]
            once += a[prev:x] + block
            twice += a[prev:x] + block + block
            prev = x
        return once + a[prev:] == b and twice + a[prev:] == self.c

    def _insertion(self, i: int, j: int) -> tuple[int, int]:
        """(length, tokens of ``a`` that follow in ``b`` and ``c``) of the best block at a[i]/b[j]."""
        a, b, c = self.a, self.b, self.c
        rem = (len(b) - j) - (len(a) - i)
        if rem <= 0:
            return 0, 0
        jc = i + 2 * (j - i)  # where c is: two blocks for every one of b
        if i == len(a):  # the rest of b, twice at the end of c
            block = b[j:]
            ok = c[jc:jc + rem] == block and c[jc + rem:] == block
            return (rem, 0) if ok else (0, 0)
        need = min(WINDOW, len(a) - i)
        pos, found, best = j + 1, 0, -1
        for _ in range(CANDIDATES):
            try:
                p = b.index(a[i], pos, j + rem + 1)
            except ValueError:
                break
            pos = p + 1
            ln = p - j
            block = b[j:p]
            if c[jc:jc + ln] != block or c[jc + ln:jc + 2 * ln] != block:
                continue
            run = min(_common(a, i, b, p), _common(a, i, c, jc + 2 * ln))
            run = self._refs_ok(i, p, run, (j, p))
            if run >= need:
                return ln, run
            if run > best:
                found, best = ln, run
        return found, best


def align(a: list[int], b: list[int], c: list[int], ta: np.ndarray, tb: np.ndarray
          ) -> list[tuple[int, int, int]] | None:
    """(point in a, start in b, length) of each block inserted (see :class:`_Aligner`)."""
    return _Aligner(a, b, c, ta, tb).run()


# --------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class _Shape:
    """The short log with ``k`` copies of each block inserted."""

    n: int
    """Events of the shortest log."""
    xs: np.ndarray
    """Insertion points (before event x of the shortest log), increasing."""
    ls: np.ndarray
    """Block lengths."""

    @functools.cached_property
    def _before(self) -> np.ndarray:
        """Block lengths before each point, then the total."""
        return np.concatenate(([0], np.cumsum(self.ls))).astype(np.int64)

    def start(self, k: int) -> np.ndarray:
        """Where each point's first copy starts in the log with k copies."""
        return self.xs + k * self._before[:-1]

    def base_pos(self, t: np.ndarray, k: int) -> np.ndarray:
        return t + k * self._before[np.searchsorted(self.xs, t, side="right")]

    def length(self, k: int) -> int:
        return int(self.n + k * self.ls.sum())

    def origins(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per event of the k-copy log: (base position or -1, point, copy 1.., offset)."""
        n = self.length(k)
        base = np.full(n, -1, np.int64)
        q = np.full(n, -1, np.int64)
        c = np.zeros(n, np.int64)
        j = np.zeros(n, np.int64)
        t = np.arange(self.n, dtype=np.int64)
        base[self.base_pos(t, k)] = t
        starts = self.start(k)
        for p, (s, ln) in enumerate(zip(starts.tolist(), self.ls.tolist(), strict=True)):
            for cc in range(1, k + 1):
                lo = s + (cc - 1) * ln
                q[lo:lo + ln] = p
                c[lo:lo + ln] = cc
                j[lo:lo + ln] = np.arange(ln)
        return base, q, c, j


# rule kinds for what a FREE (or any event with an id) refers to
_NONE, _BASE = 0, 1
_COPY_RULES: dict[int, tuple[tuple[int, int, int], Callable[[Any, int], Any]]] = {
    # kind: (the copy named in the 1-copy log and by copies 1 and 2 of the 2-copy log, 0 for
    # the fixed event; which copy copy c of k names — outside 1..k: the fixed event)
    2: ((1, 1, 2), lambda c, k: c),  # the same layer
    3: ((1, 2, 1), lambda c, k: k + 1 - c),  # mirrored: a list freed back to front
    4: ((1, 1, 1), lambda c, k: 1),  # the first copy
    5: ((1, 2, 2), lambda c, k: k),  # the last copy
    6: ((0, 0, 1), lambda c, k: c - 1),  # the layer before
    7: ((0, 2, 0), lambda c, k: c + 1),  # the layer after
    8: ((0, 1, 0), lambda c, k: k - c),  # mirrored, the layer before
    9: ((0, 0, 2), lambda c, k: k + 2 - c),  # mirrored, the layer after
}
_BASE_RULES: dict[int, tuple[tuple[int, int], Callable[[int], int]]] = {
    # kind: (the copy named in the 1- and 2-copy logs; which copy it names in the k-copy log)
    4: ((1, 1), lambda k: 1),
    5: ((1, 2), lambda k: k),
}


def _targets(log: EventLog) -> np.ndarray | None:
    """Per event, the position of the allocation its id names (-1 when none); None when the
    ids are not allocation ordinals."""
    act = np.frombuffer(log.action, dtype=np.int8).astype(np.int64)
    ids = np.frombuffer(log.id, dtype=np.int64)
    alloc = np.nonzero(act == _ALLOC)[0]
    if not np.array_equal(ids[alloc], np.arange(1, len(alloc) + 1)):
        return None
    out = np.full(len(act), -1, np.int64)
    ref = (act != _ALLOC) & (ids > 0)
    if np.any(ids[ref] > len(alloc)):
        return None
    out[ref] = alloc[ids[ref] - 1]
    return out


@dataclass
class _Model:
    shape: _Shape
    base_src: np.ndarray
    """Per event of the shortest log (per block offset below): where its columns are read in the 2-copy log."""
    copy_src: list[np.ndarray]
    base_rule: np.ndarray
    base_ref: tuple[np.ndarray, np.ndarray, np.ndarray]
    """(fixed event, point, offset) each event's id names (by its rule)."""
    copy_rule: list[np.ndarray]
    copy_ref: list[tuple[np.ndarray, np.ndarray, np.ndarray]]
    base_tmpl: np.ndarray
    base_idx0: np.ndarray
    base_slope: np.ndarray
    copy_tmpl: list[np.ndarray]
    copy_alpha: list[np.ndarray]
    copy_u: list[np.ndarray]
    copy_v: list[np.ndarray]


def _fit(shape: _Shape, toks: Sequence[_Tokens], logs: Sequence[EventLog]) -> _Model | str:
    """Reference and layer-index rules that reproduce the 1- and 2-copy logs."""
    tgt1, tgt2 = _targets(logs[1]), _targets(logs[2])
    if tgt1 is None or tgt2 is None:
        return "ids are not allocation ordinals"
    b1, q1, c1, j1 = shape.origins(1)
    b2, q2, c2, j2 = shape.origins(2)
    t = np.arange(shape.n, dtype=np.int64)
    p1, p2 = shape.base_pos(t, 1), shape.base_pos(t, 2)

    def describe(tg: np.ndarray, base: np.ndarray, q: np.ndarray, c: np.ndarray, j: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(base target or -1, point, copy, offset) of each target (copy 0 = no target)."""
        has = tg >= 0
        tt = np.where(has, tg, 0)
        return (np.where(has, base[tt], -1), np.where(has, q[tt], -1), np.where(has, c[tt], 0),
                np.where(has, j[tt], -1))

    d1 = describe(tgt1, b1, q1, c1, j1)
    d2 = describe(tgt2, b2, q2, c2, j2)
    # base events: their targets in the 1- and 2-copy logs
    bb1, bq1, bc1, bj1 = (x[p1] for x in d1)
    bb2, bq2, bc2, bj2 = (x[p2] for x in d2)
    has1, has2 = tgt1[p1] >= 0, tgt2[p2] >= 0
    if not np.array_equal(has1, has2):
        return "references differ between the traces"
    rule = np.full(shape.n, -1, np.int64)
    rule[~has1] = _NONE
    rule[has1 & (bb1 >= 0) & (bb2 == bb1)] = _BASE
    cp = has1 & (bb1 < 0) & (bb2 < 0) & (bq1 == bq2) & (bj1 == bj2) & (bc1 == 1)
    for kind, ((_, second), _nth) in _BASE_RULES.items():
        rule[cp & (bc2 == second)] = kind
    if np.any(rule < 0):
        return "a reference of the shortest trace's events has no rule"
    base_ref = (bb1, bq1, bj1)
    # layer indices of base events
    i0 = toks[0].idx
    ib1, ib2 = toks[1].idx[p1], toks[2].idx[p2]
    slope = ib1 - i0
    if np.any((ib2 - ib1) != slope) or np.any((i0 < 0) != (ib1 < 0)) or np.any((slope != 0) & (slope != 1)):
        return "a layer index is not affine in the layer count"
    copy_rule: list[np.ndarray] = []
    copy_ref: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    copy_alpha, copy_u, copy_v, copy_tmpl, copy_src = [], [], [], [], []
    s1, s2 = shape.start(1), shape.start(2)
    for p, ln in enumerate(shape.ls.tolist()):
        off = np.arange(ln, dtype=np.int64)
        e1 = s1[p] + off
        e21, e22 = s2[p] + off, s2[p] + ln + off
        o1 = tuple(x[e1] for x in d1)
        o21 = tuple(x[e21] for x in d2)
        o22 = tuple(x[e22] for x in d2)
        h = tgt1[e1] >= 0
        if not (np.array_equal(h, tgt2[e21] >= 0) and np.array_equal(h, tgt2[e22] >= 0)):
            return "references differ between the copies"
        r = np.full(ln, -1, np.int64)
        fixed, rq, rj = np.full(ln, -1, np.int64), np.full(ln, -1, np.int64), np.full(ln, -1, np.int64)
        r[~h] = _NONE
        allbase = h & (o1[0] >= 0) & (o21[0] == o1[0]) & (o22[0] == o1[0])
        r[allbase] = _BASE
        fixed[allbase] = o1[0][allbase]
        obs = (o1, o21, o22)
        for kind, (pat, _copy_of) in _COPY_RULES.items():
            ok = h & (r < 0)
            copies = [(o, want) for o, want in zip(obs, pat, strict=True) if want]
            bases = [o for o, want in zip(obs, pat, strict=True) if not want]
            ref = copies[0][0]
            for o, want in copies:
                ok &= (o[0] < 0) & (o[2] == want) & (o[1] == ref[1]) & (o[3] == ref[3])
            for o in bases:
                ok &= (o[0] >= 0) & (o[0] == bases[0][0])
            r[ok] = kind
            rq[ok], rj[ok] = ref[1][ok], ref[3][ok]
            if bases:
                fixed[ok] = bases[0][0][ok]
        if np.any(r < 0):
            return "a reference inside a repeated block has no rule"
        # layer indices: alpha + u * copy + v * copies
        x1, x21, x22 = toks[1].idx[e1], toks[2].idx[e21], toks[2].idx[e22]
        if np.any((x1 < 0) != (x21 < 0)) or np.any((x1 < 0) != (x22 < 0)):
            return "a repeated block's layer index comes and goes"
        v = x21 - x1
        u = x22 - x21
        if np.any(np.abs(u) > 1) or np.any(np.abs(v) > 1):
            return "a repeated block's layer index does not progress by one"
        copy_rule.append(r)
        copy_ref.append((fixed, rq, rj))
        copy_alpha.append(x1 - u - v)
        copy_u.append(u)
        copy_v.append(v)
        copy_tmpl.append(toks[2].tmpl[e21])
        copy_src.append(e21)
    return _Model(shape=shape, base_src=p2, copy_src=copy_src, base_rule=rule, base_ref=base_ref,
                  copy_rule=copy_rule, copy_ref=copy_ref,
                  base_tmpl=toks[0].tmpl, base_idx0=i0, base_slope=slope, copy_tmpl=copy_tmpl,
                  copy_alpha=copy_alpha, copy_u=copy_u, copy_v=copy_v)


def _write(m: _Model, k: int, src_log: EventLog, vocab: _Vocab) -> EventLog:
    """The log with ``k`` copies of every block."""
    sh = m.shape
    n = sh.length(k)
    starts = sh.start(k)
    src = np.empty(n, np.int64)
    tmpl = np.empty(n, np.int64)
    idx = np.empty(n, np.int64)
    tpos = np.full(n, -1, np.int64)
    t = np.arange(sh.n, dtype=np.int64)
    bp = sh.base_pos(t, k)
    src[bp] = m.base_src
    tmpl[bp] = m.base_tmpl
    idx[bp] = m.base_idx0 + k * m.base_slope  # (-1 + 0: no layer)
    ls = sh.ls

    def copy_pos(q: np.ndarray, c: np.ndarray | int, j: np.ndarray) -> np.ndarray:
        return starts[q] + (c - 1) * ls[q] + j

    r = m.base_rule
    fixed, rq, rj = m.base_ref
    sel = r == _BASE
    tpos[bp[sel]] = sh.base_pos(fixed[sel], k)
    for kind, (_seen, nth) in _BASE_RULES.items():
        sel = r == kind
        tpos[bp[sel]] = copy_pos(rq[sel], nth(k), rj[sel])
    copies = np.arange(1, k + 1, dtype=np.int64)[:, None]  # (k, 1): copy c of each block
    for p, ln in enumerate(ls.tolist()):
        rr = m.copy_rule[p]
        fixed, rq, rj = m.copy_ref[p]
        fixed_pos = sh.base_pos(np.where(fixed >= 0, fixed, 0), k)
        lo = int(starts[p])
        sl = slice(lo, lo + k * ln)
        src[sl] = np.tile(m.copy_src[p], k)
        tmpl[sl] = np.tile(m.copy_tmpl[p], k)
        idx[sl] = (m.copy_alpha[p] + m.copy_u[p] * copies + m.copy_v[p] * k).ravel()  # (-1: no layer)
        tp = np.full((k, ln), -1, np.int64)
        s = rr == _BASE
        tp[:, s] = fixed_pos[s]
        for kind, (_pat, copy_of) in _COPY_RULES.items():
            s2 = np.flatnonzero(rr == kind)
            if not len(s2):
                continue
            cc = np.broadcast_to(np.asarray(copy_of(copies, k), dtype=np.int64), (k, 1))
            inside = (cc >= 1) & (cc <= k)
            q2 = rq[s2]
            at = starts[np.where(q2 >= 0, q2, 0)] + (cc - 1) * ls[np.where(q2 >= 0, q2, 0)] + rj[s2]
            tp[:, s2] = np.where(inside, at, fixed_pos[s2])
        tpos[sl] = tp.ravel()
    out = EventLog()
    for name in ("action", "size", "stream", "category", "phase", "iteration"):
        col = getattr(src_log, name)
        arr = np.frombuffer(col, dtype=np.dtype(col.typecode))[src] if len(col) else np.zeros(0, col.typecode)
        getattr(out, name).frombytes(np.ascontiguousarray(arr).tobytes())
    for name in ("op", "desc"):
        remap = np.asarray([out.intern(s) for s in src_log.strings], dtype=np.int32)
        arr = remap[np.frombuffer(getattr(src_log, name), dtype=np.int32)[src]]
        getattr(out, name).frombytes(arr.tobytes())
    # module strings: template with its layer index (a dense table over the templates used)
    used_tmpl = np.flatnonzero(np.bincount(tmpl, minlength=len(vocab.names)))
    dense = np.zeros(len(vocab.names), np.int64)
    dense[used_tmpl] = np.arange(len(used_tmpl))
    width = int(idx.max()) + 2 if len(idx) else 1
    key = dense[tmpl] * width + (idx + 1)
    table = np.zeros(len(used_tmpl) * width, np.int32)
    for kk in np.flatnonzero(np.bincount(key, minlength=len(table))).tolist():
        tm, ix = divmod(kk, width)
        path = vocab.names[int(used_tmpl[tm])]
        table[kk] = out.intern(path.replace(f"{vocab.container}.#", f"{vocab.container}.{ix - 1}", 1)
                               if ix else path)
    out.module.frombytes(table[key].tobytes())
    act = np.frombuffer(out.action, dtype=np.int8)
    isalloc = act == _ALLOC
    ordinal = np.cumsum(isalloc)
    ids = np.where(isalloc, ordinal, 0)
    ref = tpos >= 0
    ids[ref] = ordinal[tpos[ref]]
    out.id.frombytes(ids.astype(np.int64).tobytes())
    return out


def _same_log(a: EventLog, b: EventLog) -> bool:
    if len(a) != len(b):
        return False
    for name in ("action", "id", "size", "stream", "category", "phase", "iteration"):
        if getattr(a, name) != getattr(b, name):
            return False
    for name in ("module", "op", "desc"):
        sa, sb = a.strings, b.strings
        if [sa[i] for i in getattr(a, name)] != [sb[i] for i in getattr(b, name)]:
            return False
    return True


# --------------------------------------------------------------------------- numbers
def _affine(values: Sequence[int]) -> int | None:
    d = values[1] - values[0]
    return d if values[2] - values[1] == d else None


def _note(texts: Sequence[str], steps: int) -> str | None:
    """A note whose integers are affine in the layer count, written ``steps`` layers past the
    shortest trace's (None when it is not): the three traces are at copies 0, 1 and 2."""
    from .nearby import NOTE_NUMBERS, text_on_line

    return text_on_line(texts, (0, 1, 2), steps, NOTE_NUMBERS)


# --------------------------------------------------------------------------- the whole
def extrapolate(traces: Sequence[Traced], layers: int) -> Replicated | str:
    """The ``layers``-layer log from three traces with one layer more each (or why not)."""
    if len(traces) != 3 or [t.layers - traces[0].layers for t in traces] != [0, 1, 2]:
        return "need three traces one layer apart"
    steps = layers - traces[0].layers
    container = container_of(traces)
    if container is None:
        return "no single layer list in the module paths"
    results = [t.result for t in traces]
    figures = _figures(results, steps)
    if isinstance(figures, str):
        return figures
    events = _extend([r.events for r in results], _Vocab(container), [t.layers for t in traces],
                     traces[0].layers - REPEATED, steps)
    if isinstance(events, str):
        return events
    paths = _paths(traces[2].paths, container, layers)
    for path in sorted(paths):  # (per-module attribution looks every module up in the strings)
        events.intern(path)
    flops, params, trainable, notes = figures
    return Replicated(events=events, paths=paths, params=params, trainable=trainable, flops=flops, notes=notes)


def extrapolate_experts(results: Sequence[TraceResult], runs: int) -> Replicated | str:
    """The log of a model whose experts loops run ``runs`` experts each, from its traces with
    every loop cut to 2, 3 and 4 experts (:mod:`.experts`), or why not. The module paths are
    those of the traces (the same model)."""
    if len(results) != 3:
        return "need three traces one expert apart"
    steps = runs - EXPERTS
    figures = _figures(results, steps)
    if isinstance(figures, str):
        return figures.replace("layer count", "expert count")
    events = _extend([r.events for r in results], _Vocab(_NO_CONTAINER, loose=True), [0, 0, 0], 0, steps)
    if isinstance(events, str):
        return events
    flops, params, trainable, notes = figures
    return Replicated(events=events, paths=frozenset(), params=params, trainable=trainable, flops=flops,
                      notes=notes)


def _extend(logs: Sequence[EventLog], vocab: _Vocab, layers: Sequence[int], prefix: int, steps: int
            ) -> EventLog | str:
    """The log with ``steps`` more copies of what the second and third logs insert (each one
    copy more than the one before) into the first, or why not."""
    read = [vocab.read(log, prefix, n) for log, n in zip(logs, layers, strict=True)]
    toks = [t for t in read if t is not None]
    if len(toks) != 3:
        return "ids are not allocation ordinals"
    ta, tb = _targets(logs[0]), _targets(logs[1])
    if ta is None or tb is None:
        return "ids are not allocation ordinals"
    pts = align(toks[0].tok, toks[1].tok, toks[2].tok, ta, tb)
    if not pts:
        return "the longer trace is not the shorter one with blocks inserted"
    shape = _Shape(n=len(toks[0].tok), xs=np.asarray([p[0] for p in pts], np.int64),
                   ls=np.asarray([p[2] for p in pts], np.int64))
    want: list[int] = []
    prev = 0
    for x, s, ln in pts:
        want += toks[0].tok[prev:x] + toks[1].tok[s:s + ln] * 2
        prev = x
    want += toks[0].tok[prev:]
    if want != toks[2].tok:
        return "the third trace does not repeat the second one's inserted block"
    model = _fit(shape, toks, logs)
    if isinstance(model, str):
        return model
    if not _same_log(_write(model, 2, logs[2], vocab), logs[2]):
        return "the rules do not rewrite the third trace"
    return _write(model, steps, logs[2], vocab)


def _figures(results: Sequence[TraceResult], steps: int) -> tuple[int | None, int, int, tuple[str, ...]] | str:
    """(FLOPs, parameters, trainable parameters, notes) ``steps`` copies past the first of three
    traces one copy apart (each affine in the copies), or why not."""
    flops = [r.flops for r in results]
    if all(f is None for f in flops):
        total_flops = None
    else:
        if any(f is None for f in flops):
            return "FLOPs counted in some traces only"
        d = _affine([int(f) for f in flops if f is not None])
        if d is None:
            return "FLOPs are not affine in the layer count"
        total_flops = int(flops[0] or 0) + steps * d
    counts = []
    for attr in ("params", "trainable_params"):
        vals = [int(getattr(r, attr)) for r in results]
        d = _affine(vals)
        if d is None:
            return f"{attr} is not affine in the layer count"
        counts.append(vals[0] + steps * d)
    notes_in = [r.notes for r in results]
    if not (len(notes_in[0]) == len(notes_in[1]) == len(notes_in[2])):
        return "the notes differ between the traces"
    notes = []
    for trio in zip(*notes_in, strict=True):
        note = _note(trio, steps)
        if note is None:
            return "a note is not affine in the layer count"
        notes.append(note)
    return total_flops, counts[0], counts[1], tuple(notes)


def _paths(paths: frozenset[str], container: str, layers: int) -> frozenset[str]:
    """Module paths of the full model: every layer's submodules under every index (a superset
    is harmless: only ancestors of recorded paths are looked up)."""
    layer = re.compile(re.escape(container) + r"\.(\d+)(?=\.|$)")
    rests: set[str] = set()
    out: set[str] = set()
    for p in paths:
        m = layer.match(p)
        if m is None:
            out.add(p)
        else:
            rests.add(p[m.end():])
    out.update(f"{container}.{i}{rest}" for i in range(layers) for rest in rests)
    return frozenset(out)

