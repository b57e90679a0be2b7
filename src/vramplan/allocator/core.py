"""The allocator's compiled core: which parts are built, current, and in use.

Two parts of the replay may be compiled when the package is installed (``setup.py``; both are
optional, and the package is whole without them):

- **the event loop**: :mod:`.fused` and :mod:`.blocks`, compiled by mypyc from the same Python
  source (one unit: a compiled loop works on compiled blocks only);
- **long free lists**: :mod:`._keyset` (``_keyset.c``), used in place of :class:`.freelist.Blocked`.

The Python source stays the reference: ``VRAMPLAN_PURE_PYTHON=1`` runs it instead of what was
built, and so does a build older than its source. ``setup.py`` writes the SHA-256 of each part's
source beside the built files (``_core_build.json``); :func:`select`, run when the package is
first imported, hashes the sources again and loads a part from its Python source where they
differ (or where nothing was built), so an edited ``fused.py`` can never be shadowed by a stale
build. ``tests/test_allocator_core.py`` replays random logs both ways and compares every figure.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PURE_ENV = "VRAMPLAN_PURE_PYTHON"
"""Set to 1: run the Python source even where the compiled core is built and current."""
BUILD_INFO = "_core_build.json"
"""Written by ``setup.py`` next to this file: each built part's source hashes."""
LOOP = ("blocks", "fused")
"""The modules mypyc compiles, in import order (``blocks`` first: ``fused`` imports it)."""
LOOP_SOURCES = ("blocks.py", "fused.py")
KEYSET_SOURCES = ("_keyset.c",)

_HERE = Path(__file__).resolve().parent
_PACKAGE = __name__.rpartition(".")[0]


@dataclass(frozen=True)
class Part:
    """One compiled part: ``state`` is ``compiled`` (built, current, in use), ``pure`` (turned off
    by the environment), ``stale`` (built from other source: the source runs), or ``not built``."""

    name: str
    state: str
    detail: str


def _digest(names: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for name in names:
        try:
            out[name] = hashlib.sha256((_HERE / name).read_bytes()).hexdigest()
        except OSError:
            out[name] = ""
    return out


def _built() -> dict[str, Any]:
    try:
        info = json.loads((_HERE / BUILD_INFO).read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _extension(module: str) -> Path | None:
    """The built extension file of ``module`` in this folder, if any."""
    from importlib.machinery import EXTENSION_SUFFIXES

    for suffix in EXTENSION_SUFFIXES:
        p = _HERE / f"{module}{suffix}"
        if p.exists():
            return p
    return None


def _judge(name: str, modules: tuple[str, ...], sources: tuple[str, ...], info: dict[str, Any]) -> Part:
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        return Part(name, "pure", f"{PURE_ENV} is set: the Python source runs")
    missing = [m for m in modules if _extension(m) is None]
    if missing:
        return Part(name, "not built", "no compiled " + ", ".join(missing) + " (see README: the compiled core)")
    built = info.get(name)
    if not isinstance(built, dict) or built != _digest(sources):
        return Part(name, "stale", "built from other source than " + ", ".join(sources)
                    + ": the Python source runs (reinstall to rebuild)")
    return Part(name, "compiled", "built from the current " + ", ".join(sources))


_PARTS: dict[str, Part] = {}


def select() -> None:
    """Decide once per process which parts run compiled; load the event loop's modules from their
    Python source where it does not (before anything imports the built ones)."""
    if _PARTS:
        return
    info = _built()
    loop = _judge("loop", LOOP, LOOP_SOURCES, info)
    keyset_part = _judge("keyset", ("_keyset",), KEYSET_SOURCES, info)
    _PARTS["loop"], _PARTS["keyset"] = loop, keyset_part
    if loop.state != "compiled" and _extension(LOOP[0]) is not None:  # (built, but not to be used)
        for module in LOOP:
            full = f"{_PACKAGE}.{module}"
            if full in sys.modules:
                continue
            spec = importlib.util.spec_from_file_location(full, _HERE / f"{module}.py")
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            sys.modules[full] = mod
            spec.loader.exec_module(mod)


def parts() -> list[Part]:
    """What runs now, part by part."""
    select()
    return [_PARTS["loop"], _PARTS["keyset"]]


def keyset() -> Any:
    """:class:`._keyset.KeySet` where it is built, current and not turned off; else None."""
    select()
    if _PARTS["keyset"].state != "compiled":
        return None
    from . import _keyset
    from .blocks import SHIFT

    if _keyset.SHIFT != SHIFT:  # (a build against another key layout: never mix them)
        _PARTS["keyset"] = Part("keyset", "stale", f"built with SHIFT {_keyset.SHIFT}, the source has {SHIFT}")
        return None
    return _keyset.KeySet
