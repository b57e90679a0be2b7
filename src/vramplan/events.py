"""The event log: every allocation and free the GPU would see, in order.

Written by :mod:`vramplan.trace` (or read from a snapshot / JSON-lines file) and replayed by
:mod:`vramplan.allocator`. Columnar (one ``array`` per field) so that millions of events
stay small and replay fast; strings (module paths, op names, dtype/shape) are interned.

Actions:

- ``ALLOC``  a tensor storage of ``size`` requested bytes comes alive on ``stream``
- ``FREE``   the storage ``id`` dies (its last reference dropped)
- ``FREE_DEFERRED`` the storage dies on its stream but was used on another stream
  (``record_stream``): the allocator keeps it until the next ``SYNC`` of that stream
- ``SYNC``   all pending cross-stream events complete (e.g. ``torch.cuda.synchronize``)
- ``EMPTY_CACHE`` ``torch.cuda.empty_cache()``
- ``MARK``   no memory change; ``op`` names a marker (phase/iteration boundary)
"""

from __future__ import annotations

import json
import os
import stat
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any

from .errors import VramplanError


class Action(IntEnum):
    ALLOC = 0
    FREE = 1
    FREE_DEFERRED = 2
    SYNC = 3
    EMPTY_CACHE = 4
    MARK = 5


class Category(IntEnum):
    PARAMETER = 0
    BUFFER = 1
    GRADIENT = 2
    OPTIMIZER_STATE = 3
    ACTIVATION = 4
    TEMPORARY = 5
    AUTOCAST_CACHE = 6
    KV_CACHE = 7
    INPUT = 8
    WORKSPACE = 9
    OTHER = 10

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def bucket(self) -> str:
        """The report's breakdown key (see :data:`vramplan.results.BREAKDOWN_KEYS`)."""
        return _BUCKET[self]


_BUCKET = {
    Category.PARAMETER: "weights",
    Category.BUFFER: "weights",
    Category.GRADIENT: "gradients",
    Category.OPTIMIZER_STATE: "optimizer",
    Category.ACTIVATION: "activations",
    Category.INPUT: "activations",
    Category.TEMPORARY: "temporaries",
    Category.AUTOCAST_CACHE: "temporaries",
    Category.WORKSPACE: "temporaries",
    Category.KV_CACHE: "kv_cache",
    Category.OTHER: "temporaries",
}

PHASES = ("setup", "forward", "backward", "recompute", "optimizer", "prefill", "decode")

_I64, _I32, _I16 = (1 << 63) - 1, (1 << 31) - 1, (1 << 15) - 1


def not_a_file(st: os.stat_result) -> str:
    """What a path is when it is not a regular file ("a character device", …), else "". A device
    such as /dev/zero never ends, a pipe can be read only once: neither is read as a file."""
    mode = st.st_mode
    if stat.S_ISREG(mode):
        return ""
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a regular file"


def _row_int(row: dict[str, Any], key: str, where: str, n: int, limit: int) -> int:
    """An integer field of a JSON-lines event; 4096.0 is accepted, 1.5, true and 1e30 are not."""
    v = row.get(key, 0)
    if isinstance(v, str):
        try:
            v = int(v)
        except ValueError:
            pass
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (float("inf"), float("-inf")) \
            or v != int(v):
        raise VramplanError(f"{where}:{n}: id, size, stream and iteration must be integers; got {key}={row.get(key)!r}")
    if not -limit - 1 <= int(v) <= limit:
        raise VramplanError(f"{where}:{n}: {key}={int(v):,} is out of range (at most {limit:,})")
    return int(v)


@dataclass
class EventLog:
    """Columnar event log. ``phase`` indexes :data:`PHASES`; ``module``/``op``/``desc`` index ``strings``."""

    action: array = field(default_factory=lambda: array("b"))
    id: array = field(default_factory=lambda: array("q"))
    size: array = field(default_factory=lambda: array("q"))
    """Requested bytes (before the allocator's rounding); 0 for non-alloc actions."""
    stream: array = field(default_factory=lambda: array("i"))
    category: array = field(default_factory=lambda: array("b"))
    phase: array = field(default_factory=lambda: array("b"))
    module: array = field(default_factory=lambda: array("i"))
    op: array = field(default_factory=lambda: array("i"))
    desc: array = field(default_factory=lambda: array("i"))
    """dtype and shape, e.g. ``bf16[4,2048,4096]``."""
    iteration: array = field(default_factory=lambda: array("h"))
    strings: list[str] = field(default_factory=lambda: [""])
    _index: dict[str, int] = field(default_factory=lambda: {"": 0}, repr=False)

    def __len__(self) -> int:
        return len(self.action)

    def intern(self, s: str) -> int:
        i = self._index.get(s)
        if i is None:
            i = len(self.strings)
            self.strings.append(s)
            self._index[s] = i
        return i

    def append(
        self, action: Action, id: int = 0, size: int = 0, *, stream: int = 0,
        category: Category = Category.OTHER, phase: int = 0, module: str = "", op: str = "",
        desc: str = "", iteration: int = 0,
    ) -> None:
        self.action.append(int(action))
        self.id.append(id)
        self.size.append(size)
        self.stream.append(stream)
        self.category.append(int(category))
        self.phase.append(phase)
        self.module.append(self.intern(module))
        self.op.append(self.intern(op))
        self.desc.append(self.intern(desc))
        self.iteration.append(iteration)

    def alloc(self, id: int, size: int, **kw: Any) -> None:
        self.append(Action.ALLOC, id, size, **kw)

    def free(self, id: int, **kw: Any) -> None:
        self.append(Action.FREE, id, 0, **kw)

    def extend(self, other: EventLog, id_offset: int = 0) -> None:
        """Append another log (re-interning its strings, shifting its ids)."""
        remap = [self.intern(s) for s in other.strings]
        self.action.extend(other.action)
        self.id.extend(array("q", (i + id_offset for i in other.id)) if id_offset else other.id)
        self.size.extend(other.size)
        self.stream.extend(other.stream)
        self.category.extend(other.category)
        self.phase.extend(other.phase)
        self.module.extend(array("i", (remap[i] for i in other.module)))
        self.op.extend(array("i", (remap[i] for i in other.op)))
        self.desc.extend(array("i", (remap[i] for i in other.desc)))
        self.iteration.extend(other.iteration)

    def rows(self) -> Iterator[dict[str, Any]]:
        s = self.strings
        for k in range(len(self)):
            a = Action(self.action[k])
            row: dict[str, Any] = {"action": a.name.lower(), "id": self.id[k]}
            if a is Action.ALLOC:
                row["size"] = self.size[k]
            row["stream"] = self.stream[k]
            row["category"] = Category(self.category[k]).label
            row["phase"] = PHASES[self.phase[k]]
            if self.module[k]:
                row["module"] = s[self.module[k]]
            if self.op[k]:
                row["op"] = s[self.op[k]]
            if self.desc[k]:
                row["desc"] = s[self.desc[k]]
            row["iteration"] = self.iteration[k]
            yield row

    # --- serialisation: JSON lines ---------------------------------------------------
    def write_jsonl(self, path: str | Path) -> None:
        with open(path, "w") as f:
            for row in self.rows():
                f.write(json.dumps(row, separators=(",", ":")) + "\n")

    @classmethod
    def from_rows(cls, rows: Iterable[dict[str, Any]], *, where: str = "events") -> EventLog:
        log = cls()
        actions = {a.name.lower(): a for a in Action}
        cats = {c.label: c for c in Category}
        for n, row in enumerate(rows, 1):
            if not isinstance(row, dict):
                raise VramplanError(f"{where}:{n}: expected a JSON object per line")
            name = str(row.get("action", "")).lower()
            if name == "free_completed":
                name = "free"
            if name not in actions:
                raise VramplanError(
                    f"{where}:{n}: unknown action {row.get('action')!r}",
                    hint="use alloc, free, free_deferred, sync, empty_cache or mark",
                )
            a = actions[name]
            needs_id = a in (Action.ALLOC, Action.FREE, Action.FREE_DEFERRED)
            if needs_id and row.get("id") is None:
                raise VramplanError(f"{where}:{n}: {name} needs an \"id\"", hint="give every alloc and its free the same integer id")
            if a is Action.ALLOC and row.get("size") is None:
                raise VramplanError(f"{where}:{n}: alloc needs a \"size\" in bytes")
            ident = _row_int(row, "id", where, n, _I64)
            size = _row_int(row, "size", where, n, _I64)
            stream = _row_int(row, "stream", where, n, _I32)
            iteration = _row_int(row, "iteration", where, n, _I16)
            if a is Action.ALLOC and size < 0:
                raise VramplanError(f"{where}:{n}: alloc size must be >= 0, got {size}")
            cat = cats.get(str(row.get("category", "other")), Category.OTHER)
            phase = str(row.get("phase", "setup"))
            log.append(
                a, ident, size, stream=stream, category=cat,
                phase=PHASES.index(phase) if phase in PHASES else 0,
                module=str(row.get("module", "")), op=str(row.get("op", "")),
                desc=str(row.get("desc", "")), iteration=iteration,
            )
        return log

    @classmethod
    def read_jsonl(cls, path: str | Path) -> EventLog:
        p = Path(path)

        def _rows() -> Iterator[dict[str, Any]]:
            try:
                with open(p, encoding="utf-8") as f:
                    kind = not_a_file(os.fstat(f.fileno()))
                    if kind:
                        raise VramplanError(f"cannot read {p}: it is {kind}, not a file",
                                            hint="save the events to a .jsonl file and pass its path")
                    for n, line in enumerate(f, 1):
                        line = line.strip()
                        if not line:
                            continue
                        try:
                            yield json.loads(line)
                        except json.JSONDecodeError as e:
                            raise VramplanError(f"{p}:{n}: not valid JSON ({e.msg})",
                                                hint="one JSON object per line") from None
            except UnicodeDecodeError:
                raise VramplanError(f"{p}: not a UTF-8 text file of JSON lines",
                                    hint="pass a .jsonl event file, or a snapshot .pickle") from None
            except OSError as e:
                raise VramplanError(f"cannot read {p}: {e.strerror or e}") from None

        log = cls.from_rows(_rows(), where=str(p))
        if not len(log):
            raise VramplanError(f"{p}: no events", hint='one JSON object per line, e.g. {"action": "alloc", "id": 1, "size": 1024}')
        return log
