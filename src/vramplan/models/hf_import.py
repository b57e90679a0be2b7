"""Import transformers without scanning its model folders twice.

transformers 5 builds its lazy import structure by reading every file under
``transformers/models/`` (~1,700 files): once in ``transformers/__init__.py`` (for
``models`` as a ``Path``) and again when ``transformers.models`` is first imported (for its
``__init__.py``). ``create_import_structure_from_path`` is cached with ``functools.lru_cache``'s
default 128 entries, fewer than the ~560 folders it visits, so the second scan finds none
of the first scan's entries and reads every file again: ~0.3 s of CPU, every process that
builds a model (transformers 5.24.0, ``src/transformers/utils/import_utils.py``,
``create_import_structure_from_path`` and ``define_import_structure``).

:func:`import_transformers` gives that function an unbounded cache as its module is
executed, so the second scan is served from the first. The function reads files only
(the ``__all__`` lists and backends of each module); its results, and so everything
transformers builds from them, are the same (``tests/test_startup.py`` compares them).

The one scan left spends about half its time in ``fetch__all__``, which splits each file into
lines (1,698 files, 36 MB) to find the last line that starts with ``__all__`` and reads the list
from there. :func:`from_first_all_line` hands it the same file from the first line that starts
with ``__all__``: what it reads is unchanged, and it splits a few lines. ``tests/test_startup.py``
checks the two agree on every file of the installed transformers and on drawn texts.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

_MODULE = "transformers.utils.import_utils"
_FUNCTION = "create_import_structure_from_path"
_FETCH_ALL = "fetch__all__"
_LINE_BREAKS = frozenset("\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029")
"""Where ``str.splitlines`` ends a line ("\\r\\n" is "\\r" then "\\n")."""


def import_transformers() -> ModuleType:
    """``import transformers``; when this process has not imported it yet, with the import
    structure's cache made large enough for its second scan (see the module docstring)."""
    if "transformers" in sys.modules:
        return importlib.import_module("transformers")
    finder = _WidenCache()
    sys.meta_path.insert(0, finder)
    try:
        return importlib.import_module("transformers")
    finally:
        sys.meta_path.remove(finder)


def first_all_line(text: str) -> int | None:
    """Offset of the first line of ``text`` (as ``str.splitlines`` cuts it) that starts with
    ``__all__``; None if no line does."""
    at = text.find("__all__")
    while at >= 0:
        if at == 0 or text[at - 1] in _LINE_BREAKS:
            return at
        at = text.find("__all__", at + 1)
    return None


def from_first_all_line(fetch: Any) -> Any:
    """``fetch`` (transformers' ``fetch__all__``), given the file from its first line that starts
    with ``__all__`` (the whole file when none does). ``fetch`` reads the last such line and the
    lines after it, so it sees the same lines."""

    def fetch__all__(file_content: str) -> Any:
        at = first_all_line(file_content) if "__all__" in file_content else None
        return fetch(file_content if at is None else file_content[at:])

    fetch__all__.__wrapped__ = fetch  # type: ignore[attr-defined]
    return fetch__all__


def widen(module: ModuleType) -> bool:
    """Replace ``module.create_import_structure_from_path`` (an ``lru_cache`` of bounded size)
    by the same function under an unbounded cache; False (nothing changed) if it is not one."""
    fn = getattr(module, _FUNCTION, None)
    info = getattr(fn, "cache_info", None)
    wrapped = getattr(fn, "__wrapped__", None)
    if info is None or wrapped is None or info().maxsize is None:
        return False
    setattr(module, _FUNCTION, functools.lru_cache(maxsize=None)(wrapped))
    return True


class _WidenCache(importlib.abc.MetaPathFinder):
    """Finds ``transformers.utils.import_utils`` as Python would and widens the cache right
    after its code has run (before ``transformers/__init__.py`` calls it)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> Any:
            run(module)
            widen(module)
            fetch = getattr(module, _FETCH_ALL, None)
            if callable(fetch):
                setattr(module, _FETCH_ALL, from_first_all_line(fetch))

        loader.exec_module = exec_module  # type: ignore[method-assign]  # this spec's loader only
        return spec


__all__ = ["first_all_line", "from_first_all_line", "import_transformers", "widen"]
