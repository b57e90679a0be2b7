"""``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF`` strings, parsed as PyTorch parses them.

Follows ``c10/core/AllocatorConfig.{h,cpp}`` (AcceleratorAllocatorConfig, PyTorch ≥ 2.9) and
``c10/cuda/CUDAAllocatorConfig.cpp``: the string is split into tokens at ``, : [ ]`` (white
space dropped), then read as ``key:value`` pairs separated by commas. The checks and their
messages are PyTorch's; a bad string raises :class:`~vramplan.errors.ConfigError` in one line.

Version notes (from the sources):

- ``roundup_power2_divisions:[...,>:N]``: PyTorch ≥ 2.9 fills the intervals *after* the last
  explicit one with N; older releases also overwrote the last explicit interval. We follow the
  newer rule and say so in :attr:`AllocatorConfig.notes` when it matters.
- ``large_segment_size_mb`` exists only in recent releases (older ones reject it as unknown).
- ``garbage_collection_threshold`` only acts when a per-process memory fraction below 1 is set
  (``torch.cuda.set_per_process_memory_fraction`` or ``per_process_memory_fraction`` here):
  ``malloc`` runs the collector only ``if (set_fraction && threshold > 0)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vramplan.errors import ConfigError

from .constants import LARGE_BUFFER, MIN_LARGE_ALLOC, NO_LIMIT, ROUNDUP_INTERVALS, MiB

BACKENDS = ("native", "cudaMallocAsync")

_IGNORED_BOOL = (
    "release_lock_on_cudamalloc", "release_lock_on_hipmalloc", "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register", "pinned_use_background_threads",
    "graph_capture_record_stream_reuse", "pinned_free_catch_all", "throw_on_cudamalloc_oom",
)
_IGNORED_INT = (
    "pinned_num_register_threads", "pinned_reserve_segment_size_mb",
    "pinned_max_round_threshold_mb", "pinned_max_cached_size_mb",
)


@dataclass(frozen=True)
class AllocatorConfig:
    """The caching allocator's options, in bytes. The defaults are PyTorch's."""

    text: str = ""
    """The string this came from (empty: defaults)."""
    backend: str = "native"
    """``native`` (the caching allocator) or ``cudaMallocAsync`` (approximated)."""
    max_split_size: int = NO_LIMIT
    """Blocks at least this large are never split (``max_split_size_mb``; unlimited by default)."""
    max_non_split_rounding_size: int = LARGE_BUFFER
    """An oversize request may take a cached oversize block at most this much larger."""
    large_segment_size: int = LARGE_BUFFER
    """Segment size for large requests under 10 MiB, and the large expandable page size."""
    garbage_collection_threshold: float = 0.0
    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS
    """Divisions per power-of-two interval [1 MiB·2^i, 1 MiB·2^(i+1)); the first also covers
    sizes below 1 MiB, the last everything from 32 GiB up. 0 or 1: no power-of-two rounding."""
    expandable_segments: bool = False
    per_process_memory_fraction: float = 1.0
    ignored: tuple[str, ...] = ()
    """Options accepted (as PyTorch does) that do not change device memory (pinned host memory,
    locking)."""
    notes: tuple[str, ...] = field(default=(), compare=False)

    def divisions(self, size: int) -> int:
        """``roundup_power2_divisions(size)``: the interval index is log2(size) − 20, clamped."""
        index = size.bit_length() - 1 - 20
        if index < 0:
            index = 0
        elif index >= ROUNDUP_INTERVALS:
            index = ROUNDUP_INTERVALS - 1
        return self.roundup_power2_divisions[index]

    @property
    def gc_active(self) -> bool:
        """Whether garbage collection can run (threshold set *and* a memory fraction below 1)."""
        return self.garbage_collection_threshold > 0.0 and self.per_process_memory_fraction < 1.0

    def describe(self) -> str:
        """The non-default options, as a canonical conf string (``""`` for the defaults)."""
        parts: list[str] = []
        if self.backend != "native":
            parts.append(f"backend:{self.backend}")
        if self.max_split_size != NO_LIMIT:
            parts.append(f"max_split_size_mb:{self.max_split_size // MiB}")
        if self.max_non_split_rounding_size != LARGE_BUFFER:
            parts.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding_size // MiB}")
        if self.large_segment_size != LARGE_BUFFER:
            parts.append(f"large_segment_size_mb:{self.large_segment_size // MiB}")
        if self.garbage_collection_threshold:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold:g}")
        if any(self.roundup_power2_divisions):
            d = self.roundup_power2_divisions
            if len(set(d)) == 1:
                parts.append(f"roundup_power2_divisions:{d[0]}")
            else:
                body = ",".join(f"{1 << i}:{v}" for i, v in enumerate(d))
                parts.append(f"roundup_power2_divisions:[{body}]")
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.per_process_memory_fraction != 1.0:
            parts.append(f"per_process_memory_fraction:{self.per_process_memory_fraction:g}")
        return ",".join(parts)


def tokenize(s: str) -> list[str]:
    """PyTorch's ConfigTokenizer: ``, : [ ]`` are tokens of their own; white space is dropped."""
    tokens: list[str] = []
    buf: list[str] = []
    for ch in s:
        if ch in ",:[]":
            if buf:
                tokens.append("".join(buf))
                buf.clear()
            tokens.append(ch)
        elif not ch.isspace():
            buf.append(ch)
    if buf:
        tokens.append("".join(buf))
    return tokens


class _Reader:
    """Cursor over the tokens with PyTorch-style checks."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = tokenize(text)
        self.i = 0

    def fail(self, msg: str) -> ConfigError:
        return ConfigError(f"bad allocator config {self.text!r}: {msg}",
                           hint="see https://pytorch.org/docs/stable/notes/cuda.html#environment-variables")

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise self.fail("unexpected end of string")
        self.i += 1
        return tok

    def expect(self, token: str, after: str) -> None:
        if self.peek() != token:
            raise self.fail(f"Error parsing CachingAllocator settings, expected '{token}' after '{after}'")
        self.i += 1

    def value(self, key: str) -> str:
        self.expect(":", key)
        tok = self.peek()
        if tok is None or tok in ",:[]":
            raise self.fail(f"Error, expecting {key} value")
        self.i += 1
        return tok

    def integer(self, key: str, tok: str | None = None) -> int:
        tok = self.value(key) if tok is None else tok
        if not tok.isdigit():
            raise self.fail(f"invalid value '{tok}' for {key}: expected a non-negative integer")
        return int(tok)

    def real(self, key: str) -> float:
        tok = self.value(key)
        try:
            return float(tok)
        except ValueError:
            raise self.fail(f"invalid value '{tok}' for {key}: expected a number") from None

    def boolean(self, key: str) -> bool:
        tok = self.value(key)
        if tok not in ("True", "False"):
            raise self.fail(f"Expected 'True' or 'False' for {key} but got '{tok}'")
        return tok == "True"


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _mb_option(r: _Reader, key: str, minimum: int) -> int:
    val = r.integer(key)
    if val < minimum:
        raise r.fail(f"CachingAllocator option {key} too small, must be >= {minimum}")
    return min(val, NO_LIMIT // MiB) * MiB


def _divisions(r: _Reader, notes: list[str]) -> tuple[int, ...]:
    key = "roundup_power2_divisions"
    r.expect(":", key)
    div = [0] * ROUNDUP_INTERVALS
    if r.peek() != "[":  # the single-number form, kept by PyTorch for backwards compatibility
        val = r.integer(key, r.take())
        if not _is_pow2(val):
            raise r.fail("For roundups, the divisions has to be power of 2")
        return (val,) * ROUNDUP_INTERVALS
    r.take()
    first, last_index, explicit = True, 0, False
    while True:
        tok = r.peek()
        if tok is None:
            raise r.fail("Expected closing bracket ']' in roundup_power2_divisions")
        if tok == "]":
            r.take()
            break
        boundary = r.take()
        r.expect(":", boundary)
        val = r.integer(key, r.take())
        if val != 0 and not _is_pow2(val):
            raise r.fail("For roundups, the divisions has to be power of 2 or 0 to disable roundup")
        if boundary == ">":
            for k in range(last_index + 1, ROUNDUP_INTERVALS):
                div[k] = val
            if explicit and div[last_index] != val:
                notes.append(
                    "roundup_power2_divisions: '>' applies after the last interval (PyTorch ≥ 2.9); "
                    "older releases also overwrote that interval"
                )
        else:
            if not boundary.isdigit() or not _is_pow2(int(boundary)):
                raise r.fail("For roundups, the intervals have to be power of 2")
            index = min(int(boundary).bit_length() - 1, ROUNDUP_INTERVALS - 1)
            if first:
                for k in range(index):
                    div[k] = val
                first = False
            div[index] = val
            last_index, explicit = index, True
        if r.peek() is None:
            raise r.fail("Expected closing bracket ']' in roundup_power2_divisions")
        if r.peek() != "]":
            r.expect(",", f"{boundary}:{val}")
    return tuple(div)


def parse_conf(s: str | None) -> AllocatorConfig:
    """Parse an allocator configuration string exactly as PyTorch accepts it.

    ``""`` or ``None`` gives the defaults. Raises :class:`ConfigError` on a string PyTorch
    would reject (unknown key, ``max_split_size_mb`` below 20, divisions not a power of two,
    ``garbage_collection_threshold`` outside (0, 1), a value other than ``True``/``False``...).
    """
    text = (s or "").strip()
    r = _Reader(text)
    opts: dict[str, object] = {}
    ignored: list[str] = []
    notes: list[str] = []
    native_only = False
    while r.peek() is not None:
        key = r.take()
        if key == "backend":
            name = r.value(key)
            if name not in BACKENDS:
                raise r.fail("Unknown allocator backend, options are native and cudaMallocAsync")
            opts["backend"] = name
        elif key == "max_split_size_mb":
            opts["max_split_size"] = _mb_option(r, key, LARGE_BUFFER // MiB)
            native_only = True
        elif key == "max_non_split_rounding_mb":
            opts["max_non_split_rounding_size"] = _mb_option(r, key, LARGE_BUFFER // MiB)
            native_only = True
        elif key == "large_segment_size_mb":
            mb = r.integer(key)
            if mb <= MIN_LARGE_ALLOC // MiB:
                raise r.fail(f"CachingAllocator option large_segment_size_mb must be > {MIN_LARGE_ALLOC // MiB} MB")
            opts["large_segment_size"] = min(mb, NO_LIMIT // MiB) * MiB
            notes.append("large_segment_size_mb is understood by recent PyTorch only; older releases reject it")
            native_only = True
        elif key == "garbage_collection_threshold":
            val_f = r.real(key)
            if not 0.0 < val_f < 1.0:
                raise r.fail("garbage_collect_threshold is invalid, set it in (0.0, 1.0)")
            opts["garbage_collection_threshold"] = val_f
            native_only = True
        elif key == "roundup_power2_divisions":
            opts["roundup_power2_divisions"] = _divisions(r, notes)
            native_only = True
        elif key == "expandable_segments":
            opts["expandable_segments"] = r.boolean(key)
            native_only = True
        elif key == "per_process_memory_fraction":
            val_f = r.real(key)
            if not 0.0 <= val_f <= 1.0:
                raise r.fail("per_process_memory_fraction is invalid, set it in [0.0, 1.0]")
            opts["per_process_memory_fraction"] = val_f
        elif key in _IGNORED_BOOL:
            r.boolean(key)
            ignored.append(key)
        elif key in _IGNORED_INT:
            count = r.integer(key)
            if key == "pinned_num_register_threads":
                if not _is_pow2(count):
                    raise r.fail(f"Number of register threads has to be power of 2, got {count}")
                if count > 128:
                    raise r.fail(f"Number of register threads should be less than or equal to 128, got {count}")
            elif key == "pinned_reserve_segment_size_mb" and count == 0:
                raise r.fail("Pinned reserve segment size has to be greater than 0")
            ignored.append(key)
        else:
            raise r.fail(f"Unrecognized key '{key}' in CUDA allocator config")
        if r.peek() is not None:
            r.expect(",", key)
    if ignored:
        notes.append(f"accepted and ignored (no effect on device memory): {', '.join(ignored)}")
    if opts.get("backend") == "cudaMallocAsync" and native_only:
        notes.append("backend:cudaMallocAsync ignores max_split_size_mb, roundup_power2_divisions, "
                     "garbage_collection_threshold and expandable_segments")
    gc = float(opts.get("garbage_collection_threshold", 0.0))  # type: ignore[arg-type]
    if gc and float(opts.get("per_process_memory_fraction", 1.0)) >= 1.0:  # type: ignore[arg-type]
        notes.append("garbage_collection_threshold has no effect unless a per-process memory "
                     "fraction below 1 is set (PyTorch collects only `if (set_fraction && threshold > 0)`)")
    return AllocatorConfig(text=text, ignored=tuple(ignored), notes=tuple(notes), **opts)  # type: ignore[arg-type]


def as_config(conf: AllocatorConfig | str | None) -> AllocatorConfig:
    """Accept a parsed config, a conf string, or None (defaults)."""
    if isinstance(conf, AllocatorConfig):
        return conf
    return parse_conf(conf)
