"""FlexAttention on the traced GPU, as CUDA runs it compiled or eager.

``torch.nn.attention.flex_attention`` calls two higher-order operators, ``flex_attention`` and
``flex_attention_backward``. Their autograd kernel first traces the score function's joint
graph with fake tensors made on the query's device (``create_fw_bw_graph``); on the emulated GPU
that device would be ``cuda`` on a CPU-only torch, and autograd's engine aborts the process
without CUDA — so the kernel runs with tensors reporting their storage's device (``meta``), as
the trace's own kernels do.

Below autograd, :class:`~vramplan.trace.dispatch.TraceMode` answers each operator with what the
GPU allocates:

- **compiled** (``torch.compile(flex_attention)``, as torchtitan, torchtune and the FlexAttention
  docs run it): Inductor's fused Triton kernels, which allocate their outputs only — torch's own
  fake-tensor rules give those shapes (the output, the fp32 log-sum-exp and row maxima; in
  backward the query, key and value gradients, GQA's broadcast key/value gradients summed);
- **eager**: torch's dense reference (``sdpa_dense`` / ``sdpa_dense_backward``), which
  materialises the scores ``[B, H, Q, K]`` and the mask — what an uncompiled call allocates on
  any device.

``torch.compile`` is the identity while a trace runs (:mod:`.session`); a call counts as
compiled while a function ``torch.compile`` was given is running (:func:`compiled_call`).
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..emulate.tensors import raw


class _Compiled(threading.local):
    depth = 0


_COMPILED = _Compiled()


def compiled_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` marked as running compiled (FlexAttention inside it is Inductor's fused kernel)."""
    import functools

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        _COMPILED.depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _COMPILED.depth -= 1

    return run


def _module() -> Any:
    try:
        return importlib.import_module("torch._higher_order_ops.flex_attention")
    except ImportError:  # torch without FlexAttention
        return None


def register_rules(mode_class: type) -> None:
    """The two operators' rules for ``mode_class`` (the trace's dispatch mode; see the module
    docstring). Each runs with the mode on, so what it allocates is recorded."""
    fa = _module()
    if fa is None:
        return

    @fa.flex_attention.py_impl(mode_class)  # type: ignore[untyped-decorator]
    def _forward(mode: Any, *args: Any, **kwargs: Any) -> Any:
        compiled = _COMPILED.depth > 0
        with mode, raw():
            out = (fa.flex_attention_fake_impl if compiled else fa.sdpa_dense)(*args, **kwargs)
        if compiled:  # its backward is the compiled one too (it runs later, outside the call)
            lse = out[1].untyped_storage()
            _COMPILED_LSE[lse._cdata] = lse
        return out

    @fa.flex_attention_backward.py_impl(mode_class)  # type: ignore[untyped-decorator]
    def _backward(mode: Any, query: Any, key: Any, value: Any, out: Any, logsumexp: Any, *args: Any,
                  **kwargs: Any) -> Any:
        st = logsumexp.untyped_storage()
        compiled = _COMPILED_LSE.get(st._cdata) is st
        rule = fa.flex_attention_backward_fake_tensor_mode if compiled else fa.sdpa_dense_backward
        with mode, raw():
            return rule(query, key, value, out, logsumexp, *args, **kwargs)


_COMPILED_LSE: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
"""Storages of the log-sum-exps compiled forwards made (by storage key): their backward is compiled."""


@contextlib.contextmanager
def raw_devices_in_autograd() -> Iterator[None]:
    """While the block runs, FlexAttention's autograd kernel sees storages' real devices (see the
    module docstring); the kernel is put back afterwards."""
    fa = _module()
    if fa is None:
        yield
        return
    key = torch._C.DispatchKey.Autograd
    hop = fa.flex_attention
    original = hop.py_kernels[key]

    def autograd(*args: Any, **kwargs: Any) -> Any:
        with raw():
            return original(*args, **kwargs)

    hop.py_kernels[key] = autograd
    hop._dispatch_cache.clear()
    try:
        yield
    finally:
        hop.py_kernels[key] = original
        hop._dispatch_cache.clear()


def register_dense_rules(mode_class: type) -> None:
    """Rules for an observing dispatch mode (a real run's storage tracker): both operators run
    torch's dense reference with the mode on, as a real uncompiled call runs them below it."""
    fa = _module()
    if fa is None:
        return

    def dense(rule: Callable[..., Any]) -> Callable[..., Any]:
        def run(mode: Any, *args: Any, **kwargs: Any) -> Any:
            with mode:
                return rule(*args, **kwargs)

        return run

    fa.flex_attention.py_impl(mode_class)(dense(fa.sdpa_dense))
    fa.flex_attention_backward.py_impl(mode_class)(dense(fa.sdpa_dense_backward))


@contextlib.contextmanager
def eager_hop_calls() -> Iterator[None]:
    """Uncompiled ``flex_attention`` calls its operator directly, not through Dynamo's eager
    backend (which captures the call first, and cannot capture an observing mode's rule): the
    same operator, the same kernels below it (torch's own debugging switch)."""
    import sys

    mod: Any = sys.modules.get("torch.nn.attention.flex_attention") or importlib.import_module(
        "torch.nn.attention.flex_attention")
    saved = getattr(mod, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", None)
    if saved is None:
        yield
        return
    setattr(mod, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)  # noqa: B010 (torch's private switch)
    try:
        yield
    finally:
        setattr(mod, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", saved)  # noqa: B010
