"""One trace in progress: recorder, modes, hooks and the phase controls step runners use."""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ..emulate.tensors import on_meta
from ..errors import TraceError
from ..events import Action, Category
from ..workload import Phase
from .asynctp import check_compile
from .autocast import Autocast
from .compile import tracing as compile_tracing
from .cuda import DeviceProfile
from .dispatch import TraceMode
from .flex import compiled_call, raw_devices_in_autograd
from .functions import CudaFunctionMode
from .modules import ModuleTracker
from .recorder import PHASE_INDEX, Recorder
from .values import Values

_ACTIVE: contextvars.ContextVar[TraceSession | None] = contextvars.ContextVar("vramplan_trace_session", default=None)


class TraceSession:
    """Owns the recording state of one trace; a context manager around the traced steps."""

    @staticmethod
    def current() -> TraceSession | None:
        """The session whose steps are running (innermost), or None outside a trace."""
        return _ACTIVE.get()

    def __init__(self, profile: DeviceProfile, *, autocast_dtype: torch.dtype | None = None) -> None:
        self.profile = profile
        self.rec = Recorder()
        self.modules = ModuleTracker(self.rec.intern)
        self.values = Values()
        self.rec.on_free.append(self.values.forget)
        self.dispatch = TraceMode(self.rec, self.modules, self.values, profile)
        self.autocast = Autocast(self.rec, autocast_dtype) if autocast_dtype is not None else None
        self.functions = CudaFunctionMode(self.dispatch, profile, self.autocast)
        self.notes: list[str] = []
        self._stack = contextlib.ExitStack()

    # --- lifecycle -------------------------------------------------------------------
    def __enter__(self) -> TraceSession:
        st = self._stack
        try:
            self.modules.install()
            st.callback(self.modules.remove)
            st.enter_context(_patched_fused_devices())
            st.enter_context(_patched_compile(self.notes))
            st.enter_context(raw_devices_in_autograd())
            st.enter_context(_patched_checkpoint(self))
            st.enter_context(_patched_cuda_calls(self.rec))
            st.enter_context(_patched_autocast_query(self))
            st.enter_context(warnings.catch_warnings())
            warnings.simplefilter("ignore")
            st.enter_context(self.functions)
            st.enter_context(self.dispatch)
            token = _ACTIVE.set(self)
            st.callback(_ACTIVE.reset, token)
        except BaseException:
            st.close()  # a refused set-up (e.g. unknown checkpoint internals) undoes the patches
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()
        self.rec.close()

    # --- setup -----------------------------------------------------------------------
    def add_model(self, model: nn.Module, name: str | None = None) -> None:
        """Name the model's modules and record its parameters and buffers (phase setup)."""
        self.modules.add_root(model, name)
        rec = self.rec
        rec.phase = PHASE_INDEX[Phase.SETUP]
        rec.op = rec.intern("model weights")
        for mod in model.modules():
            rec.module = self.modules.name_of(mod)
            for p in mod.parameters(recurse=False):
                rec.relabel(local_tensor(p), Category.PARAMETER)
            for b in mod.buffers(recurse=False):
                rec.relabel(local_tensor(b), Category.BUFFER)
            if hasattr(mod, "vramplan_on_new_weight"):  # (quantkernels: weights decompressed in the step)
                mod.__dict__["vramplan_on_new_weight"] = lambda t: rec.relabel(t, Category.BUFFER)
        rec.module = 0

    def add_inputs(self, tensors: Iterable[Any]) -> None:
        self.rec.phase = PHASE_INDEX[Phase.SETUP]
        self.rec.op = self.rec.intern("step inputs")
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.rec.track(t, int(Category.INPUT))

    # --- phases ----------------------------------------------------------------------
    def start_iteration(self, it: int) -> None:
        self.rec.iteration = it
        self.rec.mark(f"iteration {it}")

    @contextlib.contextmanager
    def phase(self, phase: Phase) -> Iterator[None]:
        rec = self.rec
        rec.phase = PHASE_INDEX[phase]
        rec.module = 0
        rec.mark(str(phase))
        yield

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        """Around ``loss.backward()``: ops with grad mode on are checkpoint recompute."""
        self.rec.phase = PHASE_INDEX[Phase.BACKWARD]
        self.rec.mark("backward")
        self.dispatch.in_backward = True
        try:
            yield
        finally:
            self.dispatch.in_backward = False

    @contextlib.contextmanager
    def autocast_region(self, enabled: bool = True) -> Iterator[None]:
        """An emulated ``torch.autocast("cuda", dtype)`` region (the weight-cast cache dies at exit)."""
        ac = self.autocast
        if ac is None or not enabled:
            yield
            return
        ac.enter()
        try:
            yield
        finally:
            ac.exit()

    # --- categories known after the fact ----------------------------------------------
    def label_tensors(self, tensors: Iterable[Any], cat: Category) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor) and on_meta(t):
                self.rec.relabel(local_tensor(t), cat)

    def label_grads(self, params: Iterable[nn.Parameter]) -> None:
        self.label_tensors((p.grad for p in params if p.grad is not None), Category.GRADIENT)

    def label_optimizer(self, opt: Any) -> None:
        state = getattr(opt, "state", {})
        for s in state.values():
            if isinstance(s, dict):
                self.label_tensors(s.values(), Category.OPTIMIZER_STATE)

    def label_cache(self, cache: Any) -> None:
        self.label_tensors(cache_tensors(cache), Category.KV_CACHE)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2 / tensor-parallel parameters, gradients and
    optimizer states); a plain tensor itself."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def cache_tensors(cache: Any) -> list[torch.Tensor]:
    """Tensors held by a transformers cache object (any layer layout), found iteratively
    (a recursive closure would form a reference cycle that keeps old cache tensors alive)."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(cache, 0)]
    while stack:
        obj, depth = stack.pop()
        if depth > 4 or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            out.append(obj)
        elif isinstance(obj, (list, tuple)):
            stack.extend((x, depth + 1) for x in obj)
        elif isinstance(obj, dict):
            stack.extend((x, depth + 1) for x in obj.values())
        elif hasattr(obj, "__dict__") and not isinstance(obj, (nn.Module, type)):
            stack.extend((x, depth + 1) for x in vars(obj).values())
    return out


@contextlib.contextmanager
def _patched_fused_devices() -> Iterator[None]:
    """Meta parameters count as CUDA ones for optimizers and gradient clipping: ``fused=True`` is
    accepted, an optimizer built without ``foreach=`` defaults to foreach, and
    ``clip_grad_norm_(foreach=True)`` (torchtitan's) takes the foreach kernels, as on CUDA (the
    optimizer module imported torch.utils._foreach_utils' two functions by name: both places)."""
    import torch.optim.optimizer as oo
    import torch.utils._foreach_utils as fu

    saved = [(m, name, getattr(m, name)) for m in (oo, fu)
             for name in ("_get_fused_kernels_supported_devices", "_get_foreach_kernels_supported_devices")]
    for m, name, fn in saved:
        setattr(m, name, lambda fn=fn: [*fn(), "meta"])
    try:
        yield
    finally:
        for m, name, fn in saved:
            setattr(m, name, fn)


@contextlib.contextmanager
def _patched_checkpoint(sess: TraceSession) -> Iterator[None]:
    """Enter the trace's function mode around checkpoint recompute, which autograd runs in
    its own thread (where the main thread's TorchFunctionMode is not active).

    Non-reentrant: the ``context_fn`` recompute context is composed with the mode (autocast on
    iff the region's forward ran under autocast). Reentrant: ``CheckpointFunction.backward``
    runs under the mode.

    The non-reentrant generator that ``checkpoint()`` calls moved in torch 2.14
    (torch/utils/checkpoint.py): up to 2.13 it is ``_checkpoint_without_reentrant_generator(fn,
    preserve_rng_state, context_fn, ..., *args, **kwargs)``; from 2.14 ``checkpoint()`` calls
    ``_checkpoint_without_reentrant_generator_impl(fn, args, kwargs, *, context_fn=...)`` and
    the old name is a shim over it. Patching the old name alone on 2.14 left recompute outside
    the mode (no autocast, no CUDA emulation), so recompute saved other tensors than the
    forward (``CheckpointError``) or mixed dtypes in SDPA. We patch the function that
    ``checkpoint()`` reaches, and only that one (the 2.14 shim reaches it too)."""
    import torch.utils.checkpoint as ckpt

    reentrant_bwd = ckpt.CheckpointFunction.backward

    def composed(context_fn: Any) -> Any:
        if compile_tracing():  # a checkpoint inside a compiled block: its compiled backward recomputes
            return context_fn

        def fn() -> tuple[Any, Any]:
            fwd_ctx, rec_ctx = context_fn()
            ac = sess.autocast
            mode = sess.functions.for_recompute(ac is not None and ac.enabled)
            return fwd_ctx, _both(rec_ctx, mode)
        return fn

    name, patched = _checkpoint_generator_patch(ckpt, composed)
    orig = getattr(ckpt, name)

    def backward(ctx: Any, *args: Any) -> Any:
        with sess.functions.for_recompute(sess.autocast is not None):
            return reentrant_bwd(ctx, *args)

    setattr(ckpt, name, patched)
    ckpt.CheckpointFunction.backward = staticmethod(backward)  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        setattr(ckpt, name, orig)
        ckpt.CheckpointFunction.backward = staticmethod(reentrant_bwd)  # type: ignore[method-assign, assignment]


def _checkpoint_generator_patch(ckpt: Any, composed: Any) -> tuple[str, Any]:
    """(name, replacement) of the non-reentrant generator ``checkpoint()`` calls on this torch."""
    impl = getattr(ckpt, "_checkpoint_without_reentrant_generator_impl", None)
    if impl is not None:  # torch >= 2.14: context_fn is keyword-only
        def generator_impl(fn: Any, args: Any, kwargs: Any, **options: Any) -> Any:
            options["context_fn"] = composed(options.get("context_fn", ckpt.noop_context_fn))
            return impl(fn, args, kwargs, **options)
        return "_checkpoint_without_reentrant_generator_impl", generator_impl
    gen = getattr(ckpt, "_checkpoint_without_reentrant_generator", None)
    if gen is None:
        raise TraceError(f"torch {torch.__version__}: torch.utils.checkpoint has no non-reentrant generator "
                         "vramplan knows, so checkpoint recompute cannot be emulated",
                         hint="vramplan's trace is tested on torch 2.13 and 2.14; `method=analytic` does not trace")

    def generator(fn: Any, preserve_rng_state: Any, context_fn: Any, *args: Any, **kwargs: Any) -> Any:
        return gen(fn, preserve_rng_state, composed(context_fn), *args, **kwargs)
    return "_checkpoint_without_reentrant_generator", generator


@contextlib.contextmanager
def _patched_cuda_calls(rec: Recorder) -> Iterator[None]:
    """``torch.cuda.synchronize()`` / ``empty_cache()`` in user code become SYNC / EMPTY_CACHE
    events for the allocator replay (instead of failing on a machine without CUDA)."""
    sync, empty = torch.cuda.synchronize, torch.cuda.empty_cache

    def synchronize(device: Any = None) -> None:
        rec.emit_action(Action.SYNC, "torch.cuda.synchronize")

    def empty_cache() -> None:
        rec.emit_action(Action.EMPTY_CACHE, "torch.cuda.empty_cache")

    torch.cuda.synchronize, torch.cuda.empty_cache = synchronize, empty_cache  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.empty_cache = sync, empty  # type: ignore[assignment]


@contextlib.contextmanager
def _patched_autocast_query(sess: TraceSession) -> Iterator[None]:
    """``torch._C._is_any_autocast_enabled()`` is true inside an emulated autocast region, as
    it is inside ``torch.autocast("cuda")`` (``nn.LSTM`` skips its input/weight dtype check
    then, since cuDNN's autocast wrapper casts both to fp16)."""
    orig = torch._C._is_any_autocast_enabled

    def query() -> bool:
        ac = sess.autocast
        return bool(orig()) or (ac is not None and ac.enabled)

    torch._C._is_any_autocast_enabled = query  # type: ignore[assignment]
    try:
        yield
    finally:
        torch._C._is_any_autocast_enabled = orig  # type: ignore[assignment]


class _both:  # noqa: N801 (used like the context-manager function it replaced)
    """``first`` then ``second`` entered, exited in reverse; re-enterable, and it keeps both
    alive as long as it lives. The checkpoint frame holds its recompute context until the
    frame dies, and with it the SAC storage of outputs the recompute never reached (early
    stop); a generator-based context manager dropped ``first`` after the recompute and freed
    that storage too early."""

    def __init__(self, first: Any, second: Any) -> None:
        self.first, self.second = first, second
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(self.first)
        stack.enter_context(self.second)
        self._stack = stack

    def __exit__(self, *exc: Any) -> Any:
        stack, self._stack = self._stack, None
        return stack.__exit__(*exc) if stack is not None else None


def _is_flex_attention(fn: Any) -> bool:
    import sys

    mod = sys.modules.get("torch.nn.attention.flex_attention")
    return mod is not None and fn is getattr(mod, "flex_attention", None)


@contextlib.contextmanager
def _patched_compile(notes: list[str]) -> Iterator[None]:
    """``torch.compile`` is ignored (eager memory is traced) — with a note; with Inductor's
    micro-pipeline TP on, refused (:mod:`.asynctp`)."""
    orig = torch.compile

    def no_compile(model: Any = None, **kwargs: Any) -> Any:
        if model is None:
            return lambda m: no_compile(m, **kwargs)
        if _is_flex_attention(model):  # its fused kernels' memory is counted (trace.flex)
            note = ("torch.compile(flex_attention): counted as Inductor's fused FlexAttention kernels (their "
                    "outputs and log-sum-exp; no scores materialised)")
            if note not in notes:
                notes.append(note)
            return compiled_call(model)
        if not kwargs.get("disable", False):  # (FlexAttention's graph holds no TP collective to fuse)
            check_compile(kwargs.get("backend", "inductor"), kwargs.get("options"))
        if not any("torch.compile ignored" in n for n in notes):
            notes.append("torch.compile ignored: the eager step is traced (compiled graphs may fuse away temporaries)")
        return model

    torch.compile = no_compile  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compile = orig
