"""Emulated callables take exactly the arguments torch's own take.

A script calls ``torch.cuda.stream(stream=s)`` or ``torch.accelerator.memory_allocated(0)``
with torch's parameter names; an emulation written by hand drifts from them (and between
torch versions). :func:`like` puts an implementation behind the real callable's signature:
every call is bound with :meth:`inspect.Signature.bind` as Python binds the real function's
arguments (an unknown keyword or a missing argument raises the same ``TypeError``), defaults
are applied, and the implementation receives the bound values in the real signature's order.
``inspect.signature`` of the emulated callable is the real one (tests compare them on every
torch version they run).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any


def signature_of(real: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(real)
    except (TypeError, ValueError):  # a builtin without a text signature
        return None


def like(real: Any, impl: Callable[..., Any]) -> Callable[..., Any]:
    """``impl`` behind ``real``'s signature (see the module docstring); ``impl`` gets the bound
    arguments positionally, in the order ``real`` declares them (``*args`` as a tuple,
    ``**kwargs`` as a dict)."""
    sig = signature_of(real)
    name = getattr(real, "__name__", getattr(impl, "__name__", "function"))
    if sig is None:
        return impl

    def emulated(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{name}() {e}") from None
        bound.apply_defaults()
        return impl(*bound.arguments.values())

    emulated.__signature__ = sig  # type: ignore[attr-defined]
    for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
        try:
            setattr(emulated, attr, getattr(real, attr))
        except (AttributeError, TypeError):
            pass
    emulated.__vramplan_emulated__ = True  # type: ignore[attr-defined]
    return emulated


def bind_init(real_cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The arguments of a constructor call, bound as ``real_cls(*args, **kwargs)`` binds them
    (its ``__init__``/``__new__`` signature), defaults applied, in declaration order."""
    sig = signature_of(real_cls)
    if sig is None:
        return [*args, kwargs]
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{getattr(real_cls, '__name__', 'class')}() {e}") from None
    bound.apply_defaults()
    return list(bound.arguments.values())
