"""The on-disk store: traces and replays kept between processes (the second question is instant).

A trace is a pure function of the model spec, the workload, the device profile and the trace
options, and of the code that ran it (vramplan, torch, transformers, peft); a replay is a pure
function of the trace, the allocator configuration and the capacity. :mod:`.cache` keeps them
for one process; this module keeps them on disk for every later one, so that asking the same
model again (another batch, ``fit`` after ``estimate``, the web page's next input) loads a
file instead of importing torch and tracing.

- **Where**: ``$VRAMPLAN_CACHE_DIR``, else ``$XDG_CACHE_HOME/vramplan``, else
  ``~/.cache/vramplan``. ``VRAMPLAN_NO_CACHE=1`` (the CLI's ``--no-cache``) neither reads nor
  writes it.
- **Keys**: the canonical text of everything the value depends on (:func:`canonical`), with a
  :func:`fingerprint` of the code: the size and modification time of every vramplan module and
  of the installed files that name the versions of torch, transformers, peft and the other
  packages a trace may run. Any change of
  code or of an installed version is a miss, never a stale answer. The file is named by the
  key's SHA-256 and holds the whole key text, which a read compares (no collision can answer).
- **Bounded**: at most ``$VRAMPLAN_CACHE_MAX`` bytes (default 2 GiB); a write that passes it
  deletes the least recently used files (a read touches its file). The store is scanned at a
  process's first write and again only when its count reaches the bound.
- **Safe**: written to a temporary file in the same folder and renamed over the name (atomic on
  POSIX and Windows), so concurrent writers of one key leave one whole file and a reader never
  sees half of one; a file that does not read back whole (truncated, foreign, from another
  format) is a miss and is deleted. Values are pickles read by an unpickler that builds only
  vramplan's own result dataclasses and enums, ``array`` and numpy arrays: a planted file
  cannot run code.
- **Cheap to hit**: nothing here imports torch or transformers.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import io
import os
import pickle
import re
import struct
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DIR_ENV = "VRAMPLAN_CACHE_DIR"
OFF_ENV = "VRAMPLAN_NO_CACHE"
MAX_ENV = "VRAMPLAN_CACHE_MAX"
DEFAULT_MAX_BYTES = 2 * 1024**3
"""Default bound of the store: a Llama-3.1-8B train trace takes ~1.3 MB, a DeepSeek-V3 one ~150 MB."""
FORMAT = 1
"""Bumped whenever what a file holds changes shape."""
MAGIC = b"vramplan-store\n"
SUFFIX = ".vps"
_HEADER = struct.Struct("<II")  # format, key length


def off() -> bool:
    return os.environ.get(OFF_ENV, "") not in ("", "0")


def directory() -> Path:
    given = os.environ.get(DIR_ENV)
    if given:
        return Path(given).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "vramplan"


def max_bytes() -> int:
    text = os.environ.get(MAX_ENV, "")
    if not text:
        return DEFAULT_MAX_BYTES
    from ..errors import VramplanError
    from ..units import parse_bytes

    try:
        return parse_bytes(text)
    except VramplanError:
        raise VramplanError(f"{MAX_ENV}={text!r} is not a size", hint=f"set it to e.g. 2GiB or 500MB, or unset {MAX_ENV}") from None


# --------------------------------------------------------------------------- keys
def canonical(x: Any) -> str:
    """A text that is equal for equal values in every process (no ids, no hash order)."""
    if isinstance(x, enum.Enum):
        return f"{type(x).__name__}.{x.name}"
    if x is None or isinstance(x, (bool, int, str)):
        return repr(x)
    if isinstance(x, float):
        return repr(x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        inner = ",".join(f"{f.name}={canonical(getattr(x, f.name))}" for f in dataclasses.fields(x))
        return f"{type(x).__qualname__}({inner})"
    if isinstance(x, Mapping):
        items = sorted((canonical(k), canonical(v)) for k, v in x.items())
        return "{" + ",".join(f"{k}:{v}" for k, v in items) + "}"
    if isinstance(x, (list, tuple)):
        return "[" + ",".join(canonical(v) for v in x) + "]"
    if isinstance(x, (set, frozenset)):
        return "{" + ",".join(sorted(canonical(v) for v in x)) + "}"
    raise TypeError(f"no canonical text for a {type(x).__name__}")


_FINGERPRINT: str | None = None
_VERSIONED = (("torch", ("version.py", "__init__.py")), ("transformers", ("__init__.py",)),
              ("peft", ("__init__.py",)), ("diffusers", ("__init__.py",)), ("timm", ("version.py", "__init__.py")),
              ("bitsandbytes", ("__init__.py",)), ("torchao", ("__init__.py",)), ("accelerate", ("__init__.py",)))
"""Packages whose code a trace may run (models, quantisation, layouts), and the files of each that
change with its version."""


def fingerprint() -> str:
    """The code a trace ran: every vramplan module and data file (size and mtime), the Python
    version, and the files of torch, transformers, peft and the other packages a trace may run
    (:data:`_VERSIONED`) that name their versions, found without importing them."""
    global _FINGERPRINT
    if _FINGERPRINT is None:
        h = hashlib.sha256()
        pkg = Path(__file__).resolve().parent.parent
        for root, dirs, files in os.walk(pkg):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                if name.endswith(".py") or name.endswith(".json"):
                    st = os.stat(os.path.join(root, name))
                    h.update(f"{os.path.relpath(os.path.join(root, name), pkg)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
        import importlib.util

        for mod, names in _VERSIONED:
            try:
                spec = importlib.util.find_spec(mod)
            except (ImportError, ValueError):
                spec = None
            origin = spec.origin if spec is not None else None
            if not origin:
                h.update(f"{mod}:absent\n".encode())
                continue
            where = Path(origin).parent
            for name in names:
                try:
                    st = os.stat(where / name)
                except OSError:
                    continue
                h.update(f"{mod}/{name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
        h.update(f"format {FORMAT} python {sys.version}".encode())
        _FINGERPRINT = h.hexdigest()[:20]
    return _FINGERPRINT


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# --------------------------------------------------------------------------- reading safely
_NUMPY = frozenset({("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
                    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
                    ("numpy", "ndarray"), ("numpy", "dtype")})
_PLAIN = frozenset({("array", "array"), ("array", "_array_reconstructor"), ("builtins", "frozenset"),
                    ("builtins", "set"), ("collections", "OrderedDict")})


class Refused(pickle.UnpicklingError):
    """A stored file asked for something other than vramplan's result data."""


class _Unpickler(pickle.Unpickler):
    """Builds vramplan's dataclasses and enums, arrays and numpy arrays; nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _PLAIN or (module, name) in _NUMPY:
            return super().find_class(module, name)
        if module.startswith("vramplan.") and "." not in name:
            obj = super().find_class(module, name)
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                return obj
        raise Refused(f"refusing to load global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise Refused("refusing a persistent id")


# --------------------------------------------------------------------------- the store
@dataclass(frozen=True)
class Entry:
    path: Path
    kind: str
    bytes: int
    used: float
    """Last read or write (the file's modification time)."""


@dataclass(frozen=True)
class Info:
    directory: Path
    entries: int
    bytes: int
    max_bytes: int
    by_kind: tuple[tuple[str, int, int], ...]
    """(kind, files, bytes)."""


_KIND = re.compile(r"^[a-z][a-z0-9_-]*$")


class Store:
    """Files under ``root/v{FORMAT}/{kind}/{group}/{name}``: a group gathers the entries of one
    key but for a few fields (a trace's batch and sequence), so that nearby questions find them."""

    def __init__(self, root: Path | None = None, limit: int | None = None) -> None:
        self.root = (root if root is not None else directory()) / f"v{FORMAT}"
        self.limit = limit if limit is not None else max_bytes()
        self.reads = self.hits = self.writes = 0
        self._held: int | None = None
        """Bytes the store held at its last scan plus what this process wrote since (other
        processes write too: it is rescanned whenever it reaches the bound)."""

    def _path(self, kind: str, group: str, name: str) -> Path:
        assert _KIND.match(kind) and re.fullmatch(r"[0-9a-f]{16,64}", group) and _KIND.match(name), (kind, group, name)
        return self.root / kind / group / (name + SUFFIX)

    def get(self, kind: str, group: str, name: str, key: str) -> Any | None:
        """The value stored under this key, or None (absent, unreadable or another key)."""
        path = self._path(kind, group, name)
        self.reads += 1
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            return None
        try:
            value = _decode(data, key)
        except Exception:  # noqa: BLE001 — any unreadable file is a miss, and goes
            _unlink(path)
            return None
        if value is _OTHER_KEY:
            return None
        try:
            os.utime(path)
        except OSError:
            pass
        self.hits += 1
        return value

    def names(self, kind: str, group: str) -> list[str]:
        """The names stored in one group (nearby entries)."""
        try:
            return sorted(p.name[: -len(SUFFIX)] for p in (self.root / kind / group).iterdir()
                          if p.name.endswith(SUFFIX))
        except OSError:
            return []

    def put(self, kind: str, group: str, name: str, key: str, value: Any) -> bool:
        """Store a value (False where it cannot be written: no room, a read-only folder)."""
        try:
            blob = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError, RecursionError):
            return False
        raw = key.encode()
        size = len(MAGIC) + _HEADER.size + len(raw) + len(blob)
        if size > self.limit:
            return False
        path = self._path(kind, group, name)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(MAGIC)
                    f.write(_HEADER.pack(FORMAT, len(raw)))
                    f.write(raw)
                    f.write(blob)
                os.replace(tmp, path)
            except BaseException:
                _unlink(Path(tmp))
                raise
        except OSError:
            return False
        self.writes += 1
        if self._held is None:
            self._held = sum(e.bytes for e in self.entries())
        else:
            self._held += size
        if self._held > self.limit:  # (a scan of every file only when the bound may be passed)
            self.trim()
        return True

    def entries(self) -> Iterator[Entry]:
        if not self.root.is_dir():
            return
        for kind_dir in sorted(self.root.iterdir()):
            if not kind_dir.is_dir():
                continue
            for dirpath, _, files in os.walk(kind_dir):
                for name in files:
                    p = Path(dirpath) / name
                    try:
                        st = p.stat()
                    except OSError:
                        continue
                    yield Entry(path=p, kind=kind_dir.name, bytes=st.st_size, used=st.st_mtime)

    def trim(self, limit: int | None = None) -> int:
        """Delete the least recently used files until the store holds at most ``limit`` bytes
        (temporary files of a writer that died an hour ago too); the bytes deleted."""
        limit = self.limit if limit is None else limit
        now = time.time()
        keep: list[Entry] = []
        freed = 0
        for e in self.entries():
            if e.path.name.startswith(".tmp-"):
                if now - e.used > 3600:
                    freed += e.bytes
                    _unlink(e.path)
                continue
            keep.append(e)
        total = sum(e.bytes for e in keep)
        for e in sorted(keep, key=lambda e: e.used):
            if total <= limit:
                break
            _unlink(e.path)
            total -= e.bytes
            freed += e.bytes
        self._held = total
        return freed

    def clear(self) -> int:
        """Delete every file; the bytes deleted."""
        freed = 0
        for e in list(self.entries()):
            freed += e.bytes
            _unlink(e.path)
        self._held = 0
        for dirpath, _, _ in sorted(os.walk(self.root), key=lambda t: -len(t[0])) if self.root.is_dir() else ():
            try:
                os.rmdir(dirpath)
            except OSError:
                pass
        return freed

    def info(self) -> Info:
        kinds: dict[str, list[int]] = {}
        for e in self.entries():
            k = kinds.setdefault(e.kind, [0, 0])
            k[0] += 1
            k[1] += e.bytes
        return Info(directory=self.root.parent, entries=sum(v[0] for v in kinds.values()),
                    bytes=sum(v[1] for v in kinds.values()), max_bytes=self.limit,
                    by_kind=tuple((k, v[0], v[1]) for k, v in sorted(kinds.items())))


_OTHER_KEY = object()


def _decode(data: bytes, key: str) -> Any:
    if not data.startswith(MAGIC):
        raise Refused("not a vramplan store file")
    fmt, n = _HEADER.unpack_from(data, len(MAGIC))
    if fmt != FORMAT:
        raise Refused(f"store format {fmt}")
    start = len(MAGIC) + _HEADER.size
    if data[start:start + n].decode() != key:
        return _OTHER_KEY
    return _Unpickler(io.BytesIO(data[start + n:])).load()


def _unlink(p: Path) -> None:
    try:
        p.unlink()
    except OSError:
        pass


_STORE: Store | None = None


def default() -> Store | None:
    """The process's store (None when ``VRAMPLAN_NO_CACHE`` is set, or no folder can be named: no
    home directory); its folder and bound are read from the environment each time they change."""
    global _STORE
    if off():
        return None
    try:
        root = directory() / f"v{FORMAT}"
    except (RuntimeError, KeyError, OSError):  # (Path.home() without HOME or a passwd entry)
        return None
    if _STORE is None or _STORE.root != root:
        _STORE = Store()
    return _STORE


__all__ = ["Store", "Entry", "Info", "Refused", "canonical", "fingerprint", "digest", "default", "directory",
           "off", "max_bytes", "DIR_ENV", "OFF_ENV", "MAX_ENV", "DEFAULT_MAX_BYTES"]
