"""The build of vramplan: its Python package, plus an optional compiled core for the allocator's
replay (see ``src/vramplan/allocator/core.py`` and the README's "The compiled core").

Every setting of the package is in pyproject.toml; this file only adds the compiled parts:

- the event loop: ``allocator/blocks.py`` and ``allocator/fused.py``, compiled by mypyc (a build
  requirement in pyproject.toml) from the same source that runs when nothing is compiled;
- ``allocator/_keyset.c``: long free lists in C.

Each part is built where it can be (a C compiler is needed); where a part fails, the install goes
on without it and the Python source runs. ``VRAMPLAN_BUILD_PURE=1`` builds neither. The build
records each part's source hashes in ``allocator/_core_build.json``, which the package checks at
import so that a build older than its source never runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
ALLOC = Path("src") / "vramplan" / "allocator"
PARTS = {"loop": ("blocks.py", "fused.py"), "keyset": ("_keyset.c",)}
BUILD_INFO = "_core_build.json"  # (allocator/core.py reads it)
KEYSET = "vramplan.allocator._keyset"


def _say(msg: str) -> None:
    print(f"vramplan build: {msg}", file=sys.stderr)


def _digest(names: tuple[str, ...]) -> dict[str, str]:
    return {n: hashlib.sha256((ROOT / ALLOC / n).read_bytes()).hexdigest() for n in names}


def _loop_extensions() -> list[Extension]:
    """mypyc's extensions for the event loop (none where mypyc is missing or fails)."""
    try:
        from mypyc.build import mypycify
    except ImportError:
        _say("mypyc not found: the event loop stays pure Python")
        return []
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        return list(mypycify([str(ALLOC / n) for n in PARTS["loop"]], opt_level="3", debug_level="0",
                             group_name="vramplan_core"))
    except BaseException as e:  # (mypyc exits on a type error: never fail the install for it)  # noqa: BLE001
        _say(f"mypyc failed ({type(e).__name__}: {e}): the event loop stays pure Python")
        return []
    finally:
        os.chdir(cwd)


class OptionalBuildExt(build_ext):
    """build_ext that lets each extension fail alone, then records what was built."""

    def run(self) -> None:
        self._built: set[str] = set()
        try:
            super().run()
        except Exception as e:  # noqa: BLE001 - (no compiler at all)
            _say(f"no compiled core ({type(e).__name__}: {e}): the Python source runs")
        self._record()

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001
            _say(f"{ext.name} not compiled ({type(e).__name__}: {e}): its Python source runs")
            Path(self.get_ext_fullpath(ext.name)).unlink(missing_ok=True)  # (an earlier build's, left in build/)
            return
        self._built.add(ext.name)

    def _record(self) -> None:
        names = {e.name for e in self.extensions}
        info = {}
        if KEYSET in self._built:
            info["keyset"] = _digest(PARTS["keyset"])
        if names - {KEYSET} and names - {KEYSET} <= self._built:
            info["loop"] = _digest(PARTS["loop"])
        out = Path(self.get_ext_fullpath(KEYSET)).parent / BUILD_INFO
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
        _say(f"compiled parts: {', '.join(sorted(info)) or 'none'} (recorded in {out})")

    def get_outputs(self) -> list[str]:  # (the record travels with the extensions into a wheel)
        return [*super().get_outputs(), str(Path(self.get_ext_fullpath(KEYSET)).parent / BUILD_INFO)]


def _extensions() -> list[Extension]:
    if os.environ.get("VRAMPLAN_BUILD_PURE", "") not in ("", "0"):
        _say("VRAMPLAN_BUILD_PURE is set: nothing compiled")
        return []
    keyset = Extension(KEYSET, [str(ALLOC / "_keyset.c")], extra_compile_args=["-O2"])
    return [keyset, *_loop_extensions()]


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
