"""The TorchFunctionMode of a trace: CUDA behaviour that must act *above* autograd.

- ``F.scaled_dot_product_attention`` → the fused kernel the target GPU picks (:mod:`.sdpa`);
- autocast casts and the weight-cast cache (:mod:`.autocast`) while an emulated
  ``torch.autocast("cuda")`` region is active, and during checkpoint recompute of a forward
  that ran under autocast (function modes do not follow autograd into its device thread, so
  :mod:`.session` enters a recompute instance around each recomputed region);
- ``device="cuda"`` / ``.cuda()`` / ``.to("cuda")`` in user code → the trace device (meta);
- ``torch._VF.lstm/gru/rnn_tanh/rnn_relu`` → cuDNN's ``_cudnn_rnn`` (:mod:`.rnn`);
- ``torch.dropout`` (training, ``0 < p < 1``) → ``native_dropout`` with its bool mask, as
  CUDA's fused path (meta would take the CPU path's float noise tensor);
- ``pin_memory`` → a plain host tensor (page-locked memory is not GPU memory);
- ``F.one_hot`` → one ``zeros`` + scatter as on CUDA, tagged with its density (``1/n``) so
  that routing masks built from it get the uniform-load answer (:mod:`.datadep`);
- ``softmax(fp16 x, dtype=float32)`` → ``_softmax(x, dim, half_to_float=True)``: CUDA's
  no-copy path (aten/src/ATen/native/SoftMax.cpp ``softmax``: only a CUDA fp16 input with
  an fp32 ``dtype`` skips ``input.toType(dtype)``); any other input with a ``dtype`` (bf16
  scores with ``dtype=float32``, as transformers' eager attention calls it) is first copied:
  one more fp32 scores-sized tensor while the softmax runs (the composite op reaches the
  trace whole, so the copy is made explicit here).

A torch function written in Python that checks for overrides itself reaches this mode as one
call, and torch pops the mode while it handles a call: the function's own torch calls would run
as on ``meta`` (the CPU's paths). ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``,
so ``nn.Transformer*``) is run with the mode re-entered and its own override check off
(:func:`_descended`), so that its projections are autocast, its attention goes through the
fused kernel CUDA picks and its dropout keeps CUDA's bool mask.
"""

from __future__ import annotations

import types
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..emulate.tensors import RAW, on_meta, raw_device
from ..errors import TraceError
from ..events import Category
from . import rnn
from .autocast import Autocast, handles
from .cuda import DeviceProfile
from .dispatch import TraceMode
from .host import HostMemory
from .sdpa import run_sdpa

_META = torch.device("meta")
_SDPA = "scaled_dot_product_attention"
_DROPOUT = ("dropout", "dropout_")
_FROM_DATA = (torch.tensor, torch.as_tensor)
"""Factories from Python data (lists, numbers)."""


def _is_meta(d: Any) -> bool:
    return (isinstance(d, torch.device) and d.type == "meta") or d == "meta"


def _is_cuda(d: Any) -> bool:
    if isinstance(d, torch.device):
        return d.type == "cuda"
    if isinstance(d, str):
        return d.split(":")[0] == "cuda"
    return False


def _softmax_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, int, torch.dtype] | None:
    """(input, dim, dtype) of a ``softmax(input, dim, dtype=...)`` on meta that changes the dtype."""
    if not args or not isinstance(args[0], torch.Tensor):
        return None
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    dtype = kwargs.get("dtype", args[3] if len(args) > 3 and isinstance(args[3], torch.dtype) else
                       args[2] if len(args) > 2 and isinstance(args[2], torch.dtype) else None)
    if (on_meta(x) and isinstance(dtype, torch.dtype) and dtype != x.dtype and isinstance(dim, int)
            and x.is_floating_point() and dtype.is_floating_point):
        return x, dim, dtype
    return None


def _fused_dropout(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, float, bool] | None:
    """(input, p, inplace) of a ``F.dropout`` / ``torch.dropout(_)`` call that CUDA runs fused."""
    if not args or not isinstance(args[0], torch.Tensor):
        return None
    x = args[0]
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    train = args[2] if len(args) > 2 else kwargs.get("training", kwargs.get("train", True))
    inplace = name == "dropout_" or bool(args[3] if len(args) > 3 else kwargs.get("inplace", False))
    if on_meta(x) and train is True and isinstance(p, (int, float)) and 0.0 < p < 1.0 and x.numel() > 0:
        return x, float(p), inplace
    return None


_DESCEND = frozenset({"multi_head_attention_forward"})
"""Python composites of ``torch.nn.functional`` whose inner torch calls the mode must see."""
_NO_OVERRIDE = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")


def _never(*args: Any) -> bool:
    return False


def _descended(func: Any) -> Any:
    """``func`` (a :data:`_DESCEND` composite) with its own override check off, or None: a copy
    of the function over its module's globals as they are now, where the ``has_torch_function*``
    names answer False (the functions it calls keep their own checks, so this mode sees them)."""
    if not isinstance(func, types.FunctionType) or func.__name__ not in _DESCEND:
        return None
    if func.__module__ != "torch.nn.functional":
        return None
    g = dict(func.__globals__)
    g.update(dict.fromkeys(_NO_OVERRIDE, _never))
    body = types.FunctionType(func.__code__, g, func.__name__, func.__defaults__, func.__closure__)
    body.__kwdefaults__ = func.__kwdefaults__
    return body


class _Plain:
    """The handler's answer "run the call itself, with these arguments"."""

    __slots__ = ("args", "kwargs")

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.args, self.kwargs = args, kwargs


class CudaFunctionMode(TorchFunctionMode):
    """Emulates CUDA-only Python-level behaviour for a trace on meta tensors."""

    def __init__(self, trace: TraceMode, profile: DeviceProfile, autocast: Autocast | None,
                 *, recompute_autocast: bool = False, backends: Counter[str] | None = None) -> None:
        super().__init__()
        self.trace = trace
        self.profile = profile
        self.autocast = autocast
        self.recompute_autocast = recompute_autocast
        """This instance runs a checkpoint recompute whose forward ran under autocast."""
        self.backends: Counter[str] = backends if backends is not None else Counter()

    def for_recompute(self, autocast_in_forward: bool) -> CudaFunctionMode:
        """The mode to enter in the autograd thread while a checkpointed region is recomputed
        (function modes do not follow autograd into its device thread)."""
        return CudaFunctionMode(self.trace, self.profile, self.autocast, recompute_autocast=autocast_in_forward,
                                backends=self.backends)

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        # The emulation's own calls (SDPA kernels, cuDNN RNN, fused dropout…) see storages' real
        # devices; the call itself, when this mode only adjusts its arguments, runs as on a GPU,
        # where torch's Python sees the emulated device (:mod:`vramplan.emulate.tensors`).
        RAW.depth += 1
        try:
            out = self._handle(func, types, args, kwargs or {})
        finally:
            RAW.depth -= 1
        if type(out) is _Plain:
            body = _descended(func)
            if body is not None:
                with self:  # torch popped this mode for the call: its inner calls see it again
                    return body(*out.args, **out.kwargs)
            return func(*out.args, **out.kwargs)
        return out

    def _handle(self, func: Any, types: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        name = getattr(func, "__name__", "")
        if name == "_parse_to":
            # ``Module.to``'s argument parser reads the device it is given and makes nothing: it
            # must see ``device="cuda"`` as written (``model.to(device=dev)``), as ``Module.to``
            # then moves each tensor with ``t.to(device, …)``, which is emulated like any copy
            return _Plain(args, kwargs)
        if func is torch.device and len(args) == 1 and not kwargs and type(args[0]) is int:
            # ``torch.device(0)``: the current accelerator's device 0 (FSDP1's ``device_id``,
            # ``torch.device(local_rank)``); a CPU-only torch has no accelerator to ask
            return torch.device("cuda", args[0])
        if func in _FROM_DATA and _is_meta(kwargs.get("device")) and args and not isinstance(args[0], torch.Tensor):
            # ``torch.tensor(data, device=x.device)`` where x is a trace tensor: made on the host and
            # copied under the trace, so that it keeps its values (torch's own copy inside
            # ``torch.tensor`` bypasses the trace: a meta tensor without them)
            grad = bool(kwargs.get("requires_grad", False))
            host_kw = {k: v for k, v in kwargs.items() if k not in ("device", "requires_grad", "pin_memory")}
            out = func(*args, **host_kw).to(_META)
            return out.requires_grad_(True) if grad else out
        to_cuda = "device" in kwargs and _is_cuda(kwargs["device"])
        if to_cuda:
            host = self.trace.rec.host
            if host is not None and not host.device_copy:  # made on the GPU: device memory, whatever the inputs
                with host.copying_to_device():
                    return self.__torch_function__(func, types, args, kwargs)
            kwargs = {**kwargs, "device": _META}
        if kwargs.get("pin_memory"):  # page-locked host memory: a host tensor, never GPU memory
            kwargs = {**kwargs, "pin_memory": False}
        if name == "to" or name == "cuda":
            return self._to(func, name, args, kwargs, to_cuda)
        if name == "pin_memory" and args and isinstance(args[0], torch.Tensor):
            host = self.trace.rec.host
            pinned = host.pin(args[0]) if isinstance(host, HostMemory) else None
            if pinned is not None:  # FSDP1's pinned shard and gradient buffer (CPUOffload)
                return pinned
        if name == "pin_memory" and args and isinstance(args[0], torch.Tensor) and (raw_device(args[0]).type == "cpu"):
            return args[0]
        ac = self.autocast
        if ac is not None and handles(name):
            if ac.enabled:
                args, kwargs = ac.apply(name, args, kwargs, cache=True)
            elif self.recompute_autocast and torch.is_grad_enabled():
                args, kwargs = ac.apply(name, args, kwargs, cache=False)
        if name == _SDPA and len(args) < 3 and all(k in kwargs for k in ("query", "key", "value")[len(args):]):
            # ``F.scaled_dot_product_attention(query=q, key=k, value=v)`` (diffusers' native backend)
            names = ("query", "key", "value")[len(args):]
            args = (*args, *(kwargs[k] for k in names))
            kwargs = {k: v for k, v in kwargs.items() if k not in names}
        if name == _SDPA and args and isinstance(args[0], torch.Tensor) and on_meta(args[0]):
            out, backend = run_sdpa(self.profile, func, *args, **kwargs)
            self.backends[backend] += 1
            return out
        if name == "one_hot":
            return self._one_hot(func, args, kwargs)
        loops = self.trace.experts
        if loops is not None and name == "unbind":  # `for expert_idx in expert_hit` (:mod:`.experts`)
            cut = loops.unbind(func, args, kwargs, self.trace.modules.current, self.trace.values)
            if cut is not None:
                return cut
        if name == "softmax":
            sm = _softmax_call(args, kwargs)
            if sm is not None:
                x, dim, dtype = sm
                if x.dtype == torch.float16 and dtype == torch.float32:
                    return torch.ops.aten._softmax.default(x, dim, True)
                converted = x.to(dtype)
                return torch.ops.aten._softmax.default(converted, dim, False)
        if name in _DROPOUT:
            drop = _fused_dropout(name, args, kwargs)
            if drop is not None:
                # CUDA's at::dropout takes the fused kernel (Dropout.cpp, is_fused_kernel_acceptable):
                # native_dropout keeps a bool mask; on meta it would keep a float noise tensor
                x, p, inplace = drop
                out = torch.ops.aten.native_dropout.default(x, p, True)[0]
                return x.copy_(out) if inplace else out
        if name in rnn.MODES and not kwargs:
            half = ac is not None and (ac.enabled or (self.recompute_autocast and torch.is_grad_enabled()))
            out = rnn.call_cudnn_rnn(name, args, self._host_values, autocast=half, dropout_state=self._dropout_state)
            if out is not NotImplemented:
                return out
        return _Plain(args, kwargs)

    def _dropout_state(self) -> None:
        """cuDNN's dropout state: allocated once per device and cached for the process."""
        tr = self.trace
        if not tr.rnn_dropout_state:
            tr.rnn_dropout_state = True
            tr.rec.synthetic_alloc(rnn.DROPOUT_STATE_BYTES, Category.WORKSPACE, "cudnn dropout state",
                                   op="cudnn.rnn.dropout_state")

    def _host_values(self, t: torch.Tensor) -> torch.Tensor | None:
        return t if not on_meta(t) else self.trace.values.cpu_view(t)

    def _to(self, func: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], to_cuda: bool = False) -> Any:
        host = self.trace.rec.host
        src = args[0] if args else None
        if host is not None and isinstance(src, torch.Tensor) and host.is_host(src) \
                and (name == "cuda" or to_cuda or any(_is_cuda(a) for a in args[1:])):
            # a host tensor copied to the GPU (FSDP2 CPU offload's all-gather input): a new
            # device tensor, where ``.to("meta")`` of a meta tensor would return it unchanged
            with host.copying_to_device():
                if name == "cuda":
                    return src.to(_META, copy=True)
                args = tuple(_META if _is_cuda(a) else a for a in args)
                return func(*args, **{**kwargs, "copy": True})
        if name == "cuda":
            return args[0].to(_META) if isinstance(args[0], torch.Tensor) else func(*args, **kwargs)
        args = tuple(_META if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)

    def _one_hot(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        x = args[0]
        classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
        if not isinstance(x, torch.Tensor) or not on_meta(x):
            return func(*args, **kwargs)
        values = self.trace.values
        cpu = values.cpu_view(x)
        if classes is None or classes < 0:
            if cpu is not None:
                classes = int(cpu.max()) + 1
            else:
                bound = values.get_bound(x)
                if bound is None:
                    raise TraceError(
                        "F.one_hot without num_classes needs the largest index, which a trace on fake "
                        "tensors does not know",
                        hint="pass num_classes=",
                    )
                classes = bound
        out = torch.zeros((*x.shape, classes), dtype=torch.int64, device=_META)
        values.drop_shadow(out)
        if cpu is not None:
            values.set_shadow(out, F.one_hot(cpu, classes))
        else:
            bound = values.get_bound(x)
            values.set_density(out, 1.0 / min(classes, bound) if bound else 1.0 / classes)
        return out
