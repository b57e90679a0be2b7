"""``dataclass``, the standard one, made cheaper to define on Python 3.10–3.12.

On those versions :func:`dataclasses.dataclass` writes each method it adds as Python source and
compiles it with ``exec``: six sources for a frozen class (``__init__``, ``__repr__``, ``__eq__``,
``__hash__``, ``__setattr__``, ``__delattr__``). Compiling them is most of the cost of importing
vramplan's modules: about a third of ``vramplan estimate MODEL --method analytic`` (Python 3.11,
``valgrind --tool=callgrind``: ``PyRun_StringFlags`` 38 % of the process's instructions).

:func:`dataclass` here is :func:`dataclasses.dataclass` except for ``frozen=True`` classes that
keep the default ``repr``, ``eq`` and hash: it lets the standard decorator write ``__init__`` and
the frozen ``__setattr__``/``__delattr__`` as usual, and gives the class ``__repr__``, ``__eq__``
and ``__hash__`` that compute from :func:`dataclasses.fields` what the generated ones compute
(CPython 3.11 ``Lib/dataclasses.py``: ``_repr_fn``, ``_cmp_fn``, ``_hash_fn``, ``_hash_action``):

- ``repr``: ``QualName(a=1, b='x')`` over the fields with ``repr=True``; ``...`` on recursion;
- ``==``: the tuples of the fields with ``compare=True``, for two objects of the same class,
  else ``NotImplemented``;
- ``hash``: of the tuple of the fields whose ``hash`` (default: ``compare``) is true;
- methods the class body defines itself are kept, as the standard decorator keeps them.

One visible difference: such a class's ``__dataclass_params__`` says ``repr=False, eq=False`` (the
standard decorator was asked not to write those methods); nothing in vramplan reads it.

``tests/test_dataclass_fast.py`` checks all three against the standard decorator on every
vramplan class that uses it. On Python 3.13 and later, where the standard decorator compiles one
source per class, this is :func:`dataclasses.dataclass` itself. Type checkers see
:func:`dataclasses.dataclass`.
"""

from __future__ import annotations

import dataclasses
import functools
import reprlib
import sys
from collections.abc import Callable
from operator import attrgetter
from typing import TYPE_CHECKING, Any

_STANDARD = sys.version_info >= (3, 13)
"""Python 3.13+ compiles one source per class: the standard decorator is used as it is."""

_OWN = frozenset({"repr", "eq", "order", "unsafe_hash"})
"""Options under which a class gets the standard methods (any explicit choice of them)."""


def _getter(names: tuple[str, ...]) -> Callable[[Any], tuple[Any, ...]]:
    """``obj → (obj.a, obj.b, …)``, a tuple for any number of names (C speed via attrgetter)."""
    if not names:
        return lambda obj: ()
    if len(names) == 1:
        one = attrgetter(names[0])
        return lambda obj: (one(obj),)
    return attrgetter(*names)  # type: ignore[return-value]  # several names: a tuple


@functools.cache
def _plan(cls: type) -> tuple[tuple[str, ...], Callable[[Any], tuple[Any, ...]], Callable[[Any], tuple[Any, ...]]]:
    """Per class: the names ``repr`` shows, and the getters of the compared and the hashed fields."""
    fields = dataclasses.fields(cls)
    shown = tuple(f.name for f in fields if f.repr)
    compared = _getter(tuple(f.name for f in fields if f.compare))
    hashed = _getter(tuple(f.name for f in fields if (f.compare if f.hash is None else f.hash)))
    return shown, compared, hashed


@reprlib.recursive_repr()
def _repr(self: Any) -> str:
    shown, _, _ = _plan(self.__class__)
    return self.__class__.__qualname__ + "(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in shown) + ")"


def _eq(self: Any, other: Any) -> Any:
    if other.__class__ is self.__class__:
        _, compared, _ = _plan(self.__class__)
        return compared(self) == compared(other)
    return NotImplemented


def _hash(self: Any) -> int:
    return hash(_plan(self.__class__)[2](self))


_repr.__name__ = _repr.__qualname__ = "__repr__"
_eq.__name__ = _eq.__qualname__ = "__eq__"
_hash.__name__ = _hash.__qualname__ = "__hash__"


def _frozen(cls: type, kw: dict[str, Any]) -> type:
    own = cls.__dict__
    explicit_hash = "__hash__" in own and not (own["__hash__"] is None and "__eq__" in own)
    out: type = dataclasses.dataclass(cls, repr=False, eq=False, **kw)
    if "__repr__" not in own:
        out.__repr__ = _repr  # type: ignore[assignment]
    if "__eq__" not in own:
        out.__eq__ = _eq  # type: ignore[assignment]
    if not explicit_hash:  # the standard "add" action for eq=True, frozen=True
        out.__hash__ = _hash  # type: ignore[assignment]
    return out


def _dataclass(cls: type | None = None, /, **kw: Any) -> Any:
    def wrap(c: type) -> type:
        if kw.get("frozen") and not (_OWN & kw.keys()):
            return _frozen(c, kw)
        return dataclasses.dataclass(c, **kw)

    return wrap if cls is None else wrap(cls)


if TYPE_CHECKING:
    from dataclasses import dataclass as dataclass
elif _STANDARD:
    dataclass = dataclasses.dataclass
else:
    dataclass = _dataclass

__all__ = ["dataclass"]
