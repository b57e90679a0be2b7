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

        loader.exec_module = exec_module  # type: ignore[method-assign]  # this spec's loader only
        return spec


__all__ = ["import_transformers", "widen"]
