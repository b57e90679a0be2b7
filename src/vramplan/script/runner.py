"""Run a user's unmodified script with the target GPU emulated, and record what it allocates.

The script runs in this process (``runpy``, as ``__main__``, with its own ``sys.argv``) under
a trace session (:mod:`vramplan.trace.session`): tensors it creates on or moves to ``cuda``
become fake device tensors (meta storage; CUDA semantics emulated as in ``vramplan trace``),
``torch.cuda`` answers for the target GPU (:mod:`.device`), and everything on the host —
datasets, tokenizers, Python — runs for real.

What the runner adds on top of a trace session, since it does not drive the loop itself:

- **phases** from the script's own calls: a top-level module call starts forward,
  ``backward()`` starts backward (gradient clipping and unscaling that follow belong to it),
  ``Optimizer.step`` starts optimizer (PyTorch's global optimizer step hooks; ``zero_grad``
  after it belongs to it);
- **iterations**: an optimizer step ends one; the run stops (the script is interrupted)
  after ``steps`` optimizer steps — or after ``steps`` top-level forward calls when the
  script never creates an optimizer (inference);
- **categories**: a module called from outside any module (a *root* model) has its
  parameters and buffers labelled weights; gradients and optimizer states are labelled at
  each step; host tensors copied to the device are inputs;
- ``torch.autocast("cuda")`` regions drive the trace's autocast emulation; ``GradScaler``
  steps the optimizer without reading ``found_inf`` back from the device (no overflow, the
  common case; the scale tensors are still allocated as on a GPU);
- values the script reads back for logging: ``isnan``/``isinf`` of activations are false (no
  overflow) and a float ``.item()`` (a loss, a gradient norm) reads 1.0 — both stated in the
  report's notes; integer and boolean reads that could steer allocations still stop the run;
- transformers' ``from_pretrained`` builds the model from its config on the fake device,
  never reading weights (:mod:`.pretrained`);
- ``torch.distributed.init_process_group`` stops with a pointer to the launchers, unless a
  world is declared (``torchrun`` / ``accelerate launch``, :mod:`.launch`): then the script
  runs as rank 0 of it on PyTorch's fake process group, so DDP / FSDP2 / DeviceMesh code
  traces one rank's memory.

An op or API the emulation cannot serve stops the run with one line naming it and the
user's ``file:line`` (:class:`~vramplan.errors.TraceError`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import runpy
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import TraceError, VramplanError
from ..events import Action, Category
from ..trace.construct import _is_cuda as is_cuda
from ..trace.cuda import DeviceProfile
from ..trace.host import HostMemory
from ..trace.recorder import PHASE_INDEX
from ..trace.result import TraceResult
from ..trace.session import TraceSession
from ..workload import Phase
from .device import DeviceFacts, LiveAllocator, emulated_cuda
from .pretrained import building, weightless_from_pretrained

Progress = Callable[[str], None]


class _Stop(BaseException):
    """Raised inside the script once enough steps ran (a BaseException: user code that
    catches ``Exception`` cannot swallow it)."""


class _Timeout(BaseException):
    pass


@dataclass
class ScriptRun:
    """What happened while the script ran."""

    steps: int = 0
    forwards: int = 0
    optimizers: int = 0
    roots: list[str] = field(default_factory=list)
    params: int = 0
    trainable: int = 0
    stopped_by: str = ""
    """``steps`` (enough optimizer steps), ``forwards`` (inference), ``end`` (the script ended)."""
    notes: list[str] = field(default_factory=list)


class _Hooks:
    """Global hooks that turn a script's calls into phases, iterations and categories."""

    def __init__(self, sess: TraceSession, run: ScriptRun, steps: int, progress: Progress | None,
                 started: float) -> None:
        self.sess = sess
        self.run = run
        self.steps = steps
        self.progress = progress
        self.started = started
        self._roots: set[int] = set()
        self._depth = 0
        self._autocast_depth = 0
        self._handles: list[Any] = []
        self._last_report = started
        self.world = 1
        """Ranks of the declared world (the script is rank 0)."""

    # --- progress -----------------------------------------------------------------------
    def report(self, what: str) -> None:
        now = time.monotonic()
        if self.progress is not None and now - self.started > 1.0 and now - self._last_report > 0.5:
            self._last_report = now
            self.progress(f"{what} · step {self.run.steps}/{self.steps} · {now - self.started:.1f} s")

    # --- modules ------------------------------------------------------------------------
    def module_pre(self, mod: nn.Module, args: Any) -> None:
        if self._depth == 0:
            if id(mod) not in self._roots:
                self._add_root(mod)
            if not self.sess.dispatch.in_backward:
                self._set_phase(Phase.FORWARD)
        self._depth += 1

    def module_post(self, mod: nn.Module, args: Any, out: Any) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            self.run.forwards += 1
            self.report("forward")
            if self.run.optimizers == 0 and self.run.forwards >= self.steps and not torch.is_grad_enabled():
                self.run.stopped_by = "forwards"
                raise _Stop

    def _add_root(self, mod: nn.Module) -> None:
        self._roots.add(id(mod))
        for m in mod.modules():
            self._roots.add(id(m))
        name = type(mod).__name__
        if any(True for _ in mod.parameters()):
            self.run.roots.append(name)
        self.sess.modules.add_root(mod, name)
        rec = self.sess.rec
        seen: set[int] = set()
        for p in mod.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            self.run.params += p.numel()
            if p.requires_grad:
                self.run.trainable += p.numel()
            if p.device.type == "meta":
                rec.relabel(p, Category.PARAMETER)
        for b in mod.buffers():
            if b.device.type == "meta":
                rec.relabel(b, Category.BUFFER)

    # --- optimizer ----------------------------------------------------------------------
    def step_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        params = [p for g in opt.param_groups for p in g["params"]]
        self.sess.label_grads(params)
        self._set_phase(Phase.OPTIMIZER)

    def step_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.sess.label_optimizer(opt)
        gc.collect()  # as a traced step: storages kept only by reference cycles die at the step's end
        self.run.steps += 1
        self.report("optimizer step")
        if self.run.steps >= self.steps:
            self.run.stopped_by = "steps"
            raise _Stop
        self.sess.start_iteration(self.run.steps + 1)

    def optimizer_created(self) -> None:
        self.run.optimizers += 1

    # --- phases -------------------------------------------------------------------------
    def _set_phase(self, phase: Phase) -> None:
        rec = self.sess.rec
        if rec.phase != PHASE_INDEX[phase]:
            rec.phase = PHASE_INDEX[phase]
            rec.module = 0
            rec.mark(str(phase))

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        self.report("backward")
        with self.sess.backward():
            yield

    # --- autocast -----------------------------------------------------------------------
    def autocast_enter(self, dtype: torch.dtype) -> None:
        ac = self.sess.autocast
        if ac is None:
            return
        if self._autocast_depth == 0:
            ac.dtype = dtype
            ac.enter()
        self._autocast_depth += 1

    def autocast_active(self) -> bool:
        return self._autocast_depth > 0

    def autocast_dtype(self) -> torch.dtype:
        ac = self.sess.autocast
        return ac.dtype if ac is not None else torch.bfloat16

    def autocast_exit(self) -> None:
        ac = self.sess.autocast
        if ac is None or self._autocast_depth == 0:
            return
        self._autocast_depth -= 1
        if self._autocast_depth == 0:
            ac.exit()


def _replace(stack: contextlib.ExitStack, owner: Any, name: str, value: Any) -> None:
    """``owner.name = value`` until ``stack`` closes (then the original is put back)."""
    stack.callback(setattr, owner, name, getattr(owner, name))
    setattr(owner, name, value)


@contextlib.contextmanager
def _patched(hooks: _Hooks) -> Iterator[None]:
    """Install the hooks and patches; undo them all afterwards."""
    import torch.amp.autocast_mode as am
    import torch.optim.optimizer as oo

    stack = contextlib.ExitStack()
    reg_pre = nn.modules.module.register_module_forward_pre_hook
    reg_post = nn.modules.module.register_module_forward_hook
    handles = [reg_pre(hooks.module_pre), reg_post(hooks.module_post, always_call=True),
               oo.register_optimizer_step_pre_hook(hooks.step_pre),
               oo.register_optimizer_step_post_hook(hooks.step_post)]
    for h in handles:
        stack.callback(h.remove)

    tensor_backward = torch.Tensor.backward
    autograd_backward = torch.autograd.backward

    def backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        with hooks.backward():
            return tensor_backward(self, *args, **kwargs)

    def autograd_bwd(*args: Any, **kwargs: Any) -> Any:
        with hooks.backward():
            return autograd_backward(*args, **kwargs)

    _replace(stack, torch.Tensor, "backward", backward)
    _replace(stack, torch.autograd, "backward", autograd_bwd)

    opt_init = oo.Optimizer.__init__
    optimizers: weakref.WeakSet[Any] = weakref.WeakSet()

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        opt_init(self, *args, **kwargs)
        optimizers.add(self)
        hooks.optimizer_created()

    _replace(stack, oo.Optimizer, "__init__", init)
    stack.enter_context(_parameters_keep_identity(optimizers))

    ac_enter, ac_exit = am.autocast.__enter__, am.autocast.__exit__

    def enter(self: Any) -> Any:
        if getattr(self, "device", None) == "cuda" and getattr(self, "_enabled", False):
            hooks.autocast_enter(self.fast_dtype)
            self._vramplan_cuda = True
            return self
        return ac_enter(self)

    def exit_(self: Any, *exc: Any) -> Any:
        if getattr(self, "_vramplan_cuda", False):
            hooks.autocast_exit()
            return False
        return ac_exit(self, *exc)

    _replace(stack, am.autocast, "__enter__", enter)
    _replace(stack, am.autocast, "__exit__", exit_)

    # autocast state queries for the emulated device ("cuda", and "meta": what fake tensors report)
    is_enabled, get_dtype = torch.is_autocast_enabled, torch.get_autocast_dtype

    def is_autocast_enabled(device_type: Any = None) -> bool:
        if device_type in (None, "cuda", "meta"):
            return hooks.autocast_active()
        return bool(is_enabled(device_type))

    def get_autocast_dtype(device_type: str) -> torch.dtype:
        if device_type in ("cuda", "meta"):
            return hooks.autocast_dtype()
        return get_dtype(device_type)

    _replace(stack, torch, "is_autocast_enabled", is_autocast_enabled)
    _replace(stack, torch, "get_autocast_dtype", get_autocast_dtype)

    # ``model.to(rank)``: an int is a CUDA ordinal, which a CPU build of torch cannot parse
    mod_to = nn.Module.to

    def module_to(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if args and isinstance(args[0], int) and not isinstance(args[0], bool):
            args = (f"cuda:{args[0]}", *args[1:])
        if isinstance(kwargs.get("device"), int) and not isinstance(kwargs["device"], bool):
            kwargs = {**kwargs, "device": f"cuda:{kwargs['device']}"}
        return mod_to(self, *args, **kwargs)

    _replace(stack, nn.Module, "to", module_to)
    stack.enter_context(_patched_grad_scaler())
    stack.enter_context(_patched_distributed(hooks.world))
    with stack:
        yield


@contextlib.contextmanager
def _parameters_keep_identity(optimizers: weakref.WeakSet[Any]) -> Iterator[None]:
    """``model.to("cuda")`` on a GPU keeps each Parameter object (only its data moves), so an
    optimizer built before the move (accelerate's ``prepare`` does exactly that) still steps
    the model's parameters. Moving to the fake device makes new Parameters: point every
    optimizer built so far at them, as the real move would have."""
    orig = nn.Module._apply
    depth = [0]

    def _apply(self: nn.Module, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if depth[0]:
            return orig(self, fn, *args, **kwargs)
        before = [(m, name, p) for m in self.modules() for name, p in m._parameters.items() if p is not None]
        depth[0] += 1
        try:
            out = orig(self, fn, *args, **kwargs)
        finally:
            depth[0] -= 1
        moved = {id(p): m._parameters[name] for m, name, p in before if m._parameters.get(name) is not p}
        if moved:
            for opt in list(optimizers):
                for group in opt.param_groups:
                    group["params"] = [moved.get(id(p), p) for p in group["params"]]
                state = opt.state
                items = [(moved.get(id(k), k), v) for k, v in state.items()]
                state.clear()
                state.update(items)
        return out

    with contextlib.ExitStack() as stack:
        _replace(stack, nn.Module, "_apply", _apply)
        yield


@contextlib.contextmanager
def _patched_grad_scaler() -> Iterator[None]:
    """``GradScaler.step`` reads ``found_inf`` back to the host (``.item()``), which fake tensors
    cannot answer: take the no-overflow branch (what nearly every step does)."""
    from torch.amp import grad_scaler as gs

    def step(self: Any, optimizer: Any, optimizer_state: Any, *args: Any, **kwargs: Any) -> Any:
        return optimizer.step(*args, **kwargs)

    with contextlib.ExitStack() as stack:
        _replace(stack, gs.GradScaler, "_maybe_opt_step", step)
        yield


@contextlib.contextmanager
def _patched_distributed(world: int = 1) -> Iterator[None]:
    """One process (``world`` 1): ``init_process_group`` stops with a pointer to the launchers.
    Rank 0 of a declared world: the fake process group is already up (:func:`_rank_zero`), so
    the script's ``init_process_group`` (its backend and rendezvous) is answered by it, and
    ``destroy_process_group`` is left to the runner's teardown."""
    import torch.distributed as dist

    if not dist.is_available():
        yield
        return

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        if world > 1:
            return None
        raise TraceError(
            "the script calls torch.distributed.init_process_group (multi-process training); "
            "vramplan run emulates one process unless a world is declared",
            hint="launch it as you would (rank 0 of the world is emulated): "
                 "`vramplan run -- torchrun --nproc-per-node 8 train.py`",
        )

    with contextlib.ExitStack() as stack:
        import torch.distributed.distributed_c10d as c10d

        for owner in (dist, c10d):
            _replace(stack, owner, "init_process_group", init_process_group)
            if world > 1:
                _replace(stack, owner, "destroy_process_group", lambda group=None: None)
        yield


@contextlib.contextmanager
def _rank_zero(world: int, per_node: int) -> Iterator[None]:
    """Rank 0 of ``world`` ranks: the launcher's environment (RANK, LOCAL_RANK, WORLD_SIZE,
    LOCAL_WORLD_SIZE, MASTER_ADDR/PORT, as torchrun sets it) and PyTorch's fake process group
    (:func:`vramplan.trace.dist.fake_world`), torn down afterwards."""
    if world <= 1:
        yield
        return
    from ..trace.dist import World, fake_world

    env = {"RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "NODE_RANK": "0", "WORLD_SIZE": str(world),
           "LOCAL_WORLD_SIZE": str(per_node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
           # DDP copies inputs already on the device through a side stream (torch.nn.parallel
           # ._functions._get_stream) that needs a real accelerator; the copy is a no-op here
           "PYTORCH_DDP_USE_SIDE_STREAM": "0"}
    with _environ(env), fake_world(World((("world", world),))):
        yield


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """Set ``env`` for the block, then put back (or remove) exactly those variables."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _rank_streams(world: int, sess: TraceSession) -> Iterator[None]:
    """In a declared world: FSDP2's all-gather / reduce-scatter streams get their own ids (and
    allocator pools), its resized parameter storages become FREE/ALLOC events, and FSDP2 may
    train parameters on the trace device (i12a's :mod:`vramplan.trace.dist`)."""
    if world <= 1:
        yield
        return
    from ..trace.dist import (
        ddp_on_fake,
        dtensor_metadata_unrecorded,
        emulated_streams,
        fsdp_on_meta,
        recorded_resizes,
    )

    with emulated_streams(sess.rec), recorded_resizes(sess.rec), fsdp_on_meta(sess.rec), ddp_on_fake(), \
            dtensor_metadata_unrecorded(), _cuda_default_mesh():
        yield


def _bucket_as_is(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations; strings fail
    fut: Any = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


@contextlib.contextmanager
def _cuda_default_mesh() -> Iterator[None]:
    """DDP's all-reduce answered in place (below); ``fully_shard(module)`` without a mesh builds one over the world on
    ``torch._C._get_accelerator()`` (``_fsdp_init._init_default_mesh``, torch 2.13) — the CPU
    on this machine; the script runs on the emulated GPU, so the default mesh is ``"cuda"``."""
    from torch.distributed.device_mesh import init_device_mesh

    def default_mesh(mesh_dim_names: tuple[str, ...] | None = None) -> Any:
        import torch.distributed as dist

        return init_device_mesh("cuda", (dist.get_world_size(),), mesh_dim_names=mesh_dim_names)

    with contextlib.ExitStack() as stack:
        import torch.nn.parallel.distributed as ddp

        # the fake group's all-reduce future carries no tensor, which DDP's reducer asserts
        # on (c10d/comm.cpp); an in-place all-reduce leaves the bucket as it is, so a comm hook
        # that returns the bucket's own buffer is the same memory without the assert
        ddp_init = ddp.DistributedDataParallel.__init__

        def ddp_init_with_hook(self: Any, *args: Any, **kwargs: Any) -> None:
            ddp_init(self, *args, **kwargs)
            self.register_comm_hook(None, _bucket_as_is)

        _replace(stack, ddp.DistributedDataParallel, "__init__", ddp_init_with_hook)
        for mod_name in ("torch.distributed.fsdp._fully_shard._fsdp_init",
                         "torch.distributed.fsdp._fully_shard._fully_shard"):
            try:
                mod = __import__(mod_name, fromlist=["_init_default_mesh"])
            except ImportError:
                continue
            if hasattr(mod, "_init_default_mesh"):
                _replace(stack, mod, "_init_default_mesh", default_mesh)
        yield


_FINITE = frozenset({"isnan", "isinf", "isfinite", "isposinf", "isneginf"})
_FROM_DATA = frozenset({"tensor", "as_tensor", "scalar_tensor"})


def _constructors() -> Any:
    from torch.utils._device import _device_constructors

    return _device_constructors()


_META_CONTEXT = [0]
"""Calls a ``with torch.device("meta")`` block is making right now (:func:`_meta_contexts`)."""


def _meta_default() -> bool:
    """The call comes from the script's ``with torch.device("meta")`` (library code passes
    ``device=t.device`` for its own trace-device tensors, which are meta too: only the context
    says "no memory")."""
    return _META_CONTEXT[0] > 0


@contextlib.contextmanager
def _meta_contexts() -> Iterator[None]:
    """Count the factory calls a meta ``DeviceContext`` (``torch.utils._device``, what ``with
    torch.device("meta")`` pushes) hands on: it runs before the trace's modes and fills in
    ``device``, which is all they would see of it."""
    from torch.utils._device import DeviceContext

    orig = DeviceContext.__torch_function__

    def torch_function(self: Any, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if self.device.type != "meta":
            return orig(self, func, types, args, kwargs)
        _META_CONTEXT[0] += 1
        try:
            return orig(self, func, types, args, kwargs)
        finally:
            _META_CONTEXT[0] -= 1

    DeviceContext.__torch_function__ = torch_function  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceContext.__torch_function__ = orig  # type: ignore[method-assign]


def _is_meta(d: Any) -> bool:
    return (isinstance(d, torch.device) and d.type == "meta") or (isinstance(d, str) and d == "meta")


class _InputMode(torch.overrides.TorchFunctionMode):
    """Host tensors copied to the device are step inputs; small integer ones keep their
    values as shadows (token ids, lengths) for data-dependent ops."""

    def __init__(self, sess: TraceSession) -> None:
        super().__init__()
        self.sess = sess
        self.meta = HostMemory(sess.rec, counted=False)
        sess.rec.host = self.meta

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "pin_memory" and args and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu":
            # page-locked host memory is not GPU memory; on a CUDA build of torch (no driver
            # here) the real call would reach the CUDA runtime (DataLoader(pin_memory=True))
            return args[0]
        if func in _constructors() and _is_meta(kwargs.get("device")) and _meta_default() and not building():
            # the script's own meta tensors (``with torch.device("meta")``: a model built to be
            # sharded, then ``to_empty``) take no memory in the real run: kept off the GPU's log,
            # with what is derived from them (FSDP2's meta shards) — ``device="cuda"`` is the GPU
            with self.meta.scope("meta"):
                return func(*args, **kwargs)
        if name in _FROM_DATA and is_cuda(kwargs.get("device")):
            # torch.tensor(data, device="cuda"): the values are the host data's; keep them
            host = func(*args, **{**kwargs, "device": "cpu"})
            out = host.to(kwargs["device"])
            if host.numel() <= 1 << 20:
                self.sess.values.set_shadow(out, host)
            return out
        out = func(*args, **kwargs)
        if name in _FINITE and isinstance(out, torch.Tensor) and out.device.type == "meta" \
                and not self.sess.values.has_shadow(out) and out.numel() <= 1 << 16:
            # activations are finite (no overflow): what the step does nearly always
            self.sess.values.set_shadow(out, torch.full(out.shape, name == "isfinite", dtype=torch.bool))
            self.sess.dispatch.rules_used["finite"] += 1
        if name in ("to", "cuda") and args and isinstance(args[0], torch.Tensor) and isinstance(out, torch.Tensor):
            src = args[0]
            if src.device.type == "cpu" and out.device.type == "meta":
                self.sess.rec.relabel(out, Category.INPUT)
                if not src.is_floating_point() and src.numel() <= 1 << 20:
                    self.sess.values.set_shadow(out, src)
        return out


_OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


@contextlib.contextmanager
def _offline(online: bool) -> Iterator[None]:
    """No network unless asked: Hugging Face libraries in the script work offline (they would
    otherwise look up model cards, chat templates and telemetry on the Hub)."""
    if online:
        yield
        return
    with _environ({k: "1" for k in _OFFLINE_ENV}):
        hub = sys.modules.get("huggingface_hub.constants")
        was = getattr(hub, "HF_HUB_OFFLINE", None)
        if hub is not None:
            setattr(hub, "HF_HUB_OFFLINE", True)  # noqa: B010  (read once at import: set it if loaded)
        try:
            yield
        finally:
            hub = sys.modules.get("huggingface_hub.constants")
            if hub is not None:
                setattr(hub, "HF_HUB_OFFLINE", bool(was) if was is not None else False)  # noqa: B010


_IMPORT_RETRY_S = 0.05
"""How soon a deadline that fell inside an import looks again."""


def _importing(frame: Any) -> bool:
    """Whether ``frame`` (where a signal landed) runs inside an import: some frame of its stack
    belongs to Python's import machinery (``<frozen importlib._bootstrap>``, where
    ``_find_and_load`` executes a module's body)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def _deadline(seconds: float | None, grace: float | None = None) -> Iterator[None]:
    """Interrupt the script after ``seconds`` (SIGALRM; main thread on POSIX only).

    Never inside an import, for up to ``grace`` more seconds (default: ``seconds``, at least
    10): an exception raised while a module's body runs leaves that package half-initialised
    for the rest of the process — its submodules stay in ``sys.modules`` without their
    parent — and every later import of it fails ("partially initialized module
    'torch._dynamo'"; torch imports ``torch._dynamo`` and sympy on a script's first meta op,
    ~0.5 s). The deadline waits for the import to finish and then interrupts the script."""
    if not seconds or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        yield
        return
    hard = time.monotonic() + seconds + (max(10.0, seconds) if grace is None else grace)

    def alarm(signum: int, frame: Any) -> None:
        if _importing(frame) and time.monotonic() < hard:
            signal.setitimer(signal.ITIMER_REAL, _IMPORT_RETRY_S)
            return
        raise _Timeout

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@contextlib.contextmanager
def _argv(path: Path, argv: Sequence[str]) -> Iterator[None]:
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(path), *argv]
    sys.path.insert(0, str(path.parent))
    try:
        yield
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path


def _user_frame(tb: Any, path: Path) -> str:
    """``file:line`` of the innermost frame in the user's script (or its folder)."""
    folder = str(path.parent.resolve())
    best = ""
    for fs in traceback.extract_tb(tb):
        f = os.path.abspath(fs.filename)
        if f == str(path.resolve()) or (f.startswith(folder + os.sep) and "site-packages" not in f):
            best = f"{os.path.relpath(f)}:{fs.lineno}"
    return best or str(path)


def trace_script(path: str | Path, argv: Sequence[str] = (), *, profile: DeviceProfile, facts: DeviceFacts,
                 steps: int = 2, timeout: float | None = 300.0, autocast_dtype: torch.dtype = torch.bfloat16,
                 alloc_conf: str | None = None, progress: Progress | None = None,
                 online: bool = False, world: int = 1) -> tuple[TraceResult, ScriptRun]:
    """Run the script at ``path`` with ``argv`` and trace it (see the module docstring).

    ``world`` > 1: the script is rank 0 of that many processes (a torchrun / accelerate
    launch), on PyTorch's fake process group; ``facts.count`` is the GPUs per node."""
    from ..trace.run import _collect_deterministically, _emulation_notes, summarize

    p = Path(path)
    if not p.is_file():
        raise TraceError(f"no such script: {p}", hint="vramplan run -- python path/to/train.py ARGS")
    if steps < 1:
        raise VramplanError(f"`steps` must be at least 1, got {steps}", hint="e.g. `steps=2`", field="steps")
    if timeout is not None and timeout <= 0:
        raise VramplanError(f"`timeout` must be positive seconds, got {timeout}", hint="e.g. `timeout=300`",
                             field="timeout")
    started = time.monotonic()
    sess = TraceSession(profile, autocast_dtype=autocast_dtype)
    sess.dispatch.float_reads = 1.0
    run = ScriptRun()
    if not isinstance(world, int) or world < 1:
        raise VramplanError(f"the world must be a positive number of processes, got {world!r}")
    hooks = _Hooks(sess, run, steps, progress, started)
    hooks.world = world
    live = LiveAllocator(sess.rec.log, alloc_conf)

    def on_sync(kind: str) -> None:
        action = Action.SYNC if kind == "synchronize" else Action.EMPTY_CACHE
        sess.rec.emit_action(action, f"torch.cuda.{kind}")

    try:
        with _offline(online), _collect_deterministically(), _rank_zero(world, facts.count), sess, \
                emulated_cuda(facts, live, on_sync), _rank_streams(world, sess), _patched(hooks), \
                weightless_from_pretrained(), _meta_contexts(), _InputMode(sess), _argv(p, argv), _deadline(timeout):
            sess.start_iteration(1)
            hooks._set_phase(Phase.FORWARD)
            try:
                runpy.run_path(str(p), run_name="__main__")
                run.stopped_by = "end"
            except _Stop:
                pass
            except SystemExit as e:
                if e.code not in (None, 0):
                    raise TraceError(f"the script exited with status {e.code} after {run.steps} step(s)",
                                     hint="check the script's arguments (after --)") from None
                run.stopped_by = "end"
    except _Timeout:
        raise TraceError(
            f"the script did not finish {steps} step(s) within {timeout:g} s (reached step {run.steps}, "
            f"{run.forwards} forward call(s))", hint="raise `timeout`, or lower `steps`") from None
    except TraceError as e:
        where = _user_frame(e.__traceback__, p)
        if where == str(p) or where in e.message:
            raise
        raise TraceError(f"{where}: {e.message}", hint=e.hint) from None
    except VramplanError:
        raise
    except Exception as e:
        where = _user_frame(e.__traceback__, p)
        text = str(e).strip().splitlines()
        raise TraceError(f"{where}: {type(e).__name__}: {text[0][:300] if text else ''}",
                         hint="the emulated GPU cannot run this call; see `vramplan run --help`") from e
    if run.steps == 0 and run.forwards == 0:
        raise TraceError(f"{p} ran no model on the GPU (no forward call on a cuda module was seen)",
                         hint="move the model and its inputs to 'cuda' as you would on a GPU")
    notes = list(sess.notes)
    what = {"steps": f"stopped after {run.steps} optimizer step(s)",
            "forwards": f"stopped after {run.forwards} forward call(s) (no optimizer: inference)",
            "end": f"the script ended after {run.steps} optimizer step(s) and {run.forwards} forward call(s)"}
    notes.append(f"script {p.name}: {what.get(run.stopped_by, '')}; models {', '.join(run.roots) or '-'}")
    notes += _emulation_notes(sess, profile.name, profile.cublas_workspace)
    result = summarize(sess, params=run.params, trainable=run.trainable, flops=None, notes=notes)
    return result, run
