"""`vramplan._dataclass.dataclass`: frozen classes get the standard decorator's repr, == and hash
(computed from their fields instead of compiled per class), checked against the standard
decorator on every vramplan class that uses it."""

from __future__ import annotations

import dataclasses
import importlib
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vramplan import _dataclass
from vramplan._dataclass import dataclass

SRC = Path(__file__).resolve().parents[1] / "src" / "vramplan"
FAST = sys.version_info < (3, 13)


def _users() -> list[type]:
    """Every dataclass defined in a vramplan module that imports ``vramplan._dataclass``."""
    out = []
    for path in sorted(SRC.rglob("*.py")):
        if not re.search(r"^from vramplan\._dataclass import dataclass$", path.read_text(), re.M):
            continue
        name = ".".join(("vramplan", *path.relative_to(SRC).with_suffix("").parts))
        mod = importlib.import_module(name)
        out += [c for c in vars(mod).values()
                if isinstance(c, type) and dataclasses.is_dataclass(c) and c.__module__ == name]
    return out


CLASSES = _users()


def _standard(cls: type) -> type:
    """The same fields under the standard decorator (frozen, default repr/eq/hash)."""
    spec = [(f.name, Any, dataclasses.field(repr=f.repr, compare=f.compare, hash=f.hash))
            for f in dataclasses.fields(cls)]
    ref = dataclasses.make_dataclass(cls.__name__, spec, frozen=True, kw_only=True)
    ref.__qualname__ = cls.__qualname__
    return ref


def _make(cls: type, values: dict[str, Any]) -> Any:
    obj = object.__new__(cls)
    for k, v in values.items():
        object.__setattr__(obj, k, v)
    return obj


VALUES = st.one_of(st.none(), st.integers(-3, 3), st.text(max_size=3), st.floats(allow_nan=True),
                   st.tuples(st.integers(0, 2)), st.booleans())


def test_the_analytic_path_uses_it() -> None:
    names = {c.__qualname__ for c in CLASSES}
    assert {"Workload", "MemoryReport", "ModelSpec", "ModelShape", "GPU"} <= names
    from vramplan.workload import Workload

    assert (Workload.__repr__ is _dataclass._repr) is FAST  # type: ignore[comparison-overlap]


@pytest.mark.parametrize("cls", [pytest.param(c, id=f"{c.__module__}.{c.__qualname__}") for c in CLASSES])
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_repr_eq_hash_are_the_standard_ones(cls: type, data: st.DataObject) -> None:
    ref = _standard(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    a = {n: data.draw(VALUES, label=n) for n in names}
    b = dict(a)
    if names and data.draw(st.booleans(), label="differ"):
        n = data.draw(st.sampled_from(names), label="which")
        b[n] = data.draw(VALUES, label="other")
    mine, mine_b, std, std_b = _make(cls, a), _make(cls, b), _make(ref, a), _make(ref, b)
    if "__repr__" not in cls.__dict__ or cls.__repr__ is _dataclass._repr:  # type: ignore[comparison-overlap]
        assert repr(mine) == repr(std)
    if cls.__eq__ is _dataclass._eq:  # type: ignore[comparison-overlap]
        assert (mine == mine_b) == (std == std_b)
        assert (mine != mine_b) == (std != std_b)
        assert mine.__eq__(object()) is NotImplemented
        assert mine.__eq__(std) is NotImplemented  # another class, even with the same fields
    if cls.__hash__ is _dataclass._hash:  # type: ignore[comparison-overlap]
        try:
            expected: int | type = hash(std)
        except TypeError:
            expected = TypeError
        if expected is TypeError:
            with pytest.raises(TypeError):
                hash(mine)
        else:
            assert hash(mine) == expected


def test_methods_the_class_defines_are_kept() -> None:
    @dataclass(frozen=True)
    class Own:
        a: int

        def __repr__(self) -> str:
            return "own"

        def __eq__(self, other: object) -> bool:
            return True

        def __hash__(self) -> int:
            return 7

    assert repr(Own(1)) == "own" and Own(1) == Own(2) and hash(Own(1)) == 7

    @dataclass(frozen=True)
    class EqOnly:  # the standard decorator adds the field hash over Python's implicit None
        a: int

        def __eq__(self, other: object) -> bool:
            return False

    assert hash(EqOnly(1)) == hash((1,))

    @dataclass(frozen=True)
    class NoHash:
        a: int
        __hash__ = None  # type: ignore[assignment]

    with pytest.raises(TypeError):
        hash(NoHash(1))


def test_fields_options_and_frozenness() -> None:
    @dataclass(frozen=True, kw_only=True)
    class C:
        a: int
        hidden: list[int] = dataclasses.field(default_factory=list, repr=False, compare=False)
        b: str = "x"

    c = C(a=1, hidden=[1])
    assert repr(c) == "test_fields_options_and_frozenness.<locals>.C(a=1, b='x')"
    assert c == C(a=1) and hash(c) == hash((1, "x")) and c != C(a=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.a = 2  # type: ignore[misc]
    assert dataclasses.replace(c, b="y").b == "y" and dataclasses.asdict(c) == {"a": 1, "hidden": [1], "b": "x"}

    @dataclass(frozen=True)
    class Node:
        child: Any

    loop = Node(None)
    object.__setattr__(loop, "child", loop)
    assert repr(loop) == "test_fields_options_and_frozenness.<locals>.Node(child=...)"


def test_other_options_get_the_standard_decorator() -> None:
    @dataclass
    class Mutable:
        a: int

    @dataclass(frozen=True, order=True)
    class Ordered:
        a: int

    assert Mutable.__repr__ is not _dataclass._repr  # type: ignore[comparison-overlap]
    assert Ordered.__eq__ is not _dataclass._eq and Ordered(1) < Ordered(2)  # type: ignore[comparison-overlap]
