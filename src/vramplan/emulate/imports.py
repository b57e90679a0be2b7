"""Patch a module as soon as it is imported (now, if it already is), and undo it afterwards.

Libraries a script imports while it runs (transformers, triton) must meet the emulation too,
without vramplan importing them up front (triton alone takes ~0.25 s)."""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable, Iterator
from typing import Any

Patch = Callable[[Any, contextlib.ExitStack], None]
"""``patch(module, undo)``: change ``module``, registering how to put it back on ``undo``."""


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, targets: dict[str, Patch], undo: contextlib.ExitStack) -> None:
        self.targets = targets
        self.undo = undo

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        patch = self.targets.get(fullname)
        if patch is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        exec_module = spec.loader.exec_module
        undo = self.undo

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            patch(module, undo)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


@contextlib.contextmanager
def patched_on_import(targets: dict[str, Patch]) -> Iterator[None]:
    """Within the block, each module named in ``targets`` is patched when imported."""
    with contextlib.ExitStack() as undo:
        for name, patch in targets.items():
            if name in sys.modules:
                patch(sys.modules[name], undo)
        finder = _Finder(targets, undo)
        sys.meta_path.insert(0, finder)
        try:
            yield
        finally:
            if finder in sys.meta_path:
                sys.meta_path.remove(finder)


def replace(undo: contextlib.ExitStack, owner: Any, name: str, value: Any) -> None:
    """``owner.name = value`` until ``undo`` closes (the attribute as it was: own or inherited)."""
    if name in vars(owner):
        undo.callback(setattr, owner, name, vars(owner)[name])
    else:
        undo.callback(delattr, owner, name)
    setattr(owner, name, value)
