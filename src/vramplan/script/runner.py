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
import dataclasses
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
import torch.utils._device as _device_utils
from torch import nn

from ..emulate import DeviceFacts, LiveAllocator, emulated_gpu
from ..emulate.checkpoints import loading as checkpoint_loading
from ..emulate.construct import _is_cuda as is_cuda
from ..emulate.modules import CONVERTING
from ..emulate.tensors import on_meta, raw_device
from ..emulate.threads import modes_follow_threads
from ..errors import TraceError, VramplanError
from ..events import Action, Category, EventLog
from ..target import DeviceProfile
from ..trace import session as trace_session
from ..trace.places import Places
from ..trace.recorder import PHASE_INDEX
from ..trace.result import TraceResult
from ..trace.session import TraceSession
from ..workload import Phase
from .oom import OomGuard, recovering_handlers
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
    device_forwards: int = 0
    """Top-level forward calls of a model whose parameters are on the emulated GPU."""
    host_forwards: int = 0
    """…and of a model whose parameters stayed on the host (the CPU)."""
    device_param_bytes: int = 0
    host_param_bytes: int = 0
    """Parameter bytes of the models that ran on the GPU / stayed on the host (each counted once)."""
    host_model: str = ""
    """``Model at file:line``: the first model with parameters that ran forward on the host."""
    param_dtypes: dict[str, int] = field(default_factory=dict)
    """Bytes of the GPU models' parameters by dtype (``torch.float32`` …)."""
    autocast: list[str] = field(default_factory=list)
    """dtypes of the ``torch.autocast("cuda")`` regions the script entered."""
    optimizer_kinds: list[tuple[str, str]] = field(default_factory=list)
    """(class name, implementation: foreach / fused / for-loop) of each optimizer built."""
    inputs: list[tuple[tuple[int, ...], str]] = field(default_factory=list)
    """(shape, dtype) of the host tensors copied to the GPU before the first forward on it."""
    batch: int | None = None
    seq: int | None = None
    image: int | None = None
    workers: int = 0
    """DataLoader workers the script asked for (run in this process instead)."""
    backwards: int = 0
    """Backward passes (``loss.backward()``, ``torch.autograd.backward``)."""
    calls: list[tuple[str, int, int]] = field(default_factory=list)
    """(class, first event, end event) of each top-level module call, in order: which model ran
    when (a pipeline's text encoders, denoiser steps and VAE decode)."""
    fsdp_compute: str = ""
    """The 16-bit dtype FSDP's mixed precision computes in (FSDP1 ``MixedPrecision.param_dtype``,
    FSDP2 ``MixedPrecisionPolicy.param_dtype``: gathered parameters cast from fp32 shards), if any."""


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
        self.live: LiveAllocator | None = None
        """The allocator simulation of the run (an inference script stops once its peak stops rising)."""
        self.guard: OomGuard | None = None
        """Out-of-memory errors for the script's own handlers (a batch-size finder's trials do not end the run)."""
        self._inference_peak = -1
        self._held = -1
        """The most memory held between two forward calls so far (a KV cache, a growing context)."""
        self._flat = 0
        self.rose_until = 0
        """The last forward call that raised the allocated peak (inference)."""
        self.world = 1
        """Ranks of the declared world (the script is rank 0)."""
        self.launched = False
        """A launcher (torchrun, accelerate launch) started the script: a process group even for one rank."""
        self.places: Places | None = None
        self.path = Path(".")
        self._backward_depth = 0
        self._root_modules: list[weakref.ref[nn.Module]] = []
        self._first_shape: tuple[int, ...] | None = None
        """The input shape the first device call's batch and sequence were read from."""
        self._layout_known = False
        """Whether that input is known to be batch-major or time-major (an RNN said, or the first
        attention layer inside has been seen)."""

    # --- progress -----------------------------------------------------------------------
    def report(self, what: str) -> None:
        now = time.monotonic()
        if self.progress is not None and now - self.started > 1.0 and now - self._last_report > 0.5:
            self._last_report = now
            count = f"step {self.run.steps}/{self.steps}" if self.run.optimizers else \
                f"forward {self.run.forwards}"
            if self.guard is not None and self.guard.searching:
                count = f"batch-size search, trial {len(self.guard.tried)} (batch {self.guard.current})"
            self.progress(f"{what} · {count} · {now - self.started:.1f} s")

    # --- modules ------------------------------------------------------------------------
    def module_pre(self, mod: nn.Module, args: Any) -> None:
        if self._depth and not self._layout_known and isinstance(mod, nn.MultiheadAttention):
            self._attention_layout(mod, args)
        if self._depth == 0:
            if id(mod) not in self._roots:
                self._add_root(mod)
            self._where_it_runs(mod, args)
            if not self.sess.dispatch.in_backward:
                self._set_phase(Phase.FORWARD)
            self.run.calls.append((type(mod).__name__, len(self.sess.rec.log), -1))
        self._depth += 1

    def _where_it_runs(self, mod: nn.Module, args: Any) -> None:
        """Count a top-level call as on the GPU or on the host (by its first parameter), and
        read the batch's shape from the first call on the GPU."""
        p = next(mod.parameters(), None)
        if p is None:
            return
        run = self.run
        if self.on_device(p) or _offloaded_to_device(mod):
            run.device_forwards += 1
            if run.device_forwards == 1:
                self._shapes(args, time_major=any(isinstance(m, nn.RNNBase) and not m.batch_first
                                                  for m in mod.modules()), model=mod)
        else:
            run.host_forwards += 1
            if not run.host_model:
                run.host_model = f"{type(mod).__name__} at {self.where()}"

    def _attention_layout(self, mod: nn.MultiheadAttention, args: Any) -> None:
        """The first attention layer of the first device call says whether its input was time-major:
        ``nn.MultiheadAttention`` without ``batch_first`` (``nn.Transformer*``'s default) takes
        ``[seq, batch, embed]``; when its query's first two sizes are the call's input's, that input
        was ``[seq, batch]`` too (a model that transposes inside, as open_clip's text tower does, hands
        it the other order)."""
        self._layout_known = True
        query = args[0] if isinstance(args, tuple) and args else None
        first = self._first_shape
        if mod.batch_first or not isinstance(query, torch.Tensor) or query.dim() != 3 or first is None \
                or len(first) < 2 or tuple(query.shape[:2]) != tuple(first[:2]):
            return
        self.run.seq, self.run.batch = int(query.shape[0]), int(query.shape[1])

    def _shapes(self, args: Any, time_major: bool = False, model: nn.Module | None = None) -> None:
        """Batch and sequence (or image size) from the first call's inputs (else the host tensors
        copied to the device before it, less those shaped like the model's own buffers: FSDP1
        moves them itself); ``time_major``: an RNN without ``batch_first`` takes ``[seq, batch]``."""
        run = self.run
        own = set() if model is None else {(tuple(b.shape), str(b.dtype)) for b in model.buffers()}
        moved = [x for x in run.inputs if x not in own]
        seen = [(tuple(a.shape), str(a.dtype)) for a in (args if isinstance(args, tuple) else (args,))
                if isinstance(a, torch.Tensor)] or moved
        ints = [s for s, d in seen if "int" in d and len(s) >= 2]
        if not ints and any("int" in d and len(s) >= 2 for s, d in moved):
            # a first call without token ids (a vision-language model's vision tower, called by
            # `generate` before the model): the token ids the script moved to the device say it
            seen = moved
            ints = [s for s, d in seen if "int" in d and len(s) >= 2]
        floats = [s for s, d in seen if "float" in d or "bfloat" in d]
        self._first_shape = ints[0] if ints else seen[0][0] if seen else None
        self._layout_known = time_major
        if seen and seen[0][0]:
            run.batch = seen[0][0][1 if time_major and len(seen[0][0]) > 1 else 0]
        if ints:
            run.batch, run.seq = (ints[0][1], ints[0][0]) if time_major else (ints[0][0], ints[0][1])
        elif floats and len(floats[0]) == 4:
            run.image = floats[0][-1]

    def on_device(self, t: torch.Tensor) -> bool:
        return on_meta(t) and (self.places is None or not self.places.is_host(t))

    def where(self) -> str:
        return _user_frame(traceback.extract_stack()[:-1], self.path)

    def module_post(self, mod: nn.Module, args: Any, out: Any) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            self.run.forwards += 1
            if self.run.calls:
                name, first, _ = self.run.calls[-1]
                self.run.calls[-1] = (name, first, len(self.sess.rec.log))
            self.report("forward")
            if self.run.optimizers == 0 and not torch.is_grad_enabled() and self._peak_settled():
                self.run.stopped_by = "forwards"
                raise _Stop

    def _peak_settled(self) -> bool:
        """True once ``steps`` forward calls in a row (after the first ``steps``) have raised
        neither the peak of requested bytes nor the most held after a call: a loop over batches of
        one shape stops after ``steps`` + 1 or 2 calls, a generation loop whose cache or context
        grows runs on to its length limit (its peak is at its last token)."""
        run = self.run
        if self.live is None:
            return run.forwards >= self.steps
        al = self.live.sync()
        peak, held = al.max_requested, al.requested  # (bytes asked for: not the allocator's rounding, which
        # moves by up to a block's unsplit tail as free blocks are reused)
        if peak > self._inference_peak or held > self._held:
            self._inference_peak, self._held = peak, max(held, self._held)
            self._flat, self.rose_until = 0, run.forwards
        else:
            self._flat += 1
        return run.forwards >= self.steps and self._flat >= self.steps

    def _add_root(self, mod: nn.Module) -> None:
        self._roots.add(id(mod))
        self._root_modules.append(weakref.ref(mod))
        for m in mod.modules():
            self._roots.add(id(m))
        name = type(mod).__name__
        later = bool(self.run.roots)  # (a second model: its paths carry its class, e.g. AutoencoderKL.decoder…)
        if any(True for _ in mod.parameters()):
            self.run.roots.append(name)
        self.sess.modules.add_root(mod, name, prefix=later)
        rec = self.sess.rec
        run = self.run
        seen: set[int] = set()
        whole = _fsdp1_whole_numels(mod)
        if not run.fsdp_compute:
            run.fsdp_compute = _fsdp_compute_dtype(mod)
        for p in mod.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            count = whole.get(id(p), p.numel())  # (FSDP1: the model's parameters, not this rank's shard)
            run.params += count
            if p.requires_grad:
                run.trainable += count
            n = p.numel() * p.element_size()
            if self.on_device(p):
                run.device_param_bytes += n
                run.param_dtypes[str(p.dtype)] = run.param_dtypes.get(str(p.dtype), 0) + n
            else:
                run.host_param_bytes += n
            if on_meta(p):
                rec.relabel(p, Category.PARAMETER)
        for b in mod.buffers():
            if on_meta(b):
                rec.relabel(b, Category.BUFFER)
        for sub in mod.modules():
            if hasattr(sub, "vramplan_on_new_weight"):  # (quantised layers that decompress in the step)
                sub.__dict__["vramplan_on_new_weight"] = lambda t: rec.relabel(t, Category.BUFFER)

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
        if self.run.steps >= self.steps and not self._searching():
            self.run.stopped_by = "steps"
            raise _Stop
        self.sess.start_iteration(self.run.steps + 1)

    def _searching(self) -> bool:
        """A batch-size finder's trial runs (its steps do not end the run: the training after it does)."""
        return self.guard is not None and bool(self.guard.searching)

    def optimizer_created(self, opt: Any) -> None:
        self.run.optimizers += 1
        d = getattr(opt, "defaults", {}) or {}
        impl = "fused" if d.get("fused") else "for-loop" if d.get("foreach") is False else "foreach"
        name = type(opt).__name__
        if name in ("SGD",) and d.get("momentum"):
            name = "SGD-momentum"
        self.run.optimizer_kinds.append((name, impl))

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
        self._backward_depth += 1
        try:
            with self.sess.backward():
                yield
        finally:
            self._backward_depth -= 1
        if self._backward_depth:
            return
        run = self.run
        run.backwards += 1
        if not run.optimizers:
            params = [p for ref in self._root_modules if (m := ref()) is not None for p in m.parameters()]
            self.sess.label_grads(params)
            # a loop that updates its parameters by hand (``p.data.add_(p.grad, alpha=-lr)``): a
            # backward pass is its step
            run.steps = run.backwards
            self.report("backward")
            if run.backwards >= self.steps and not self._searching():
                run.stopped_by = "backwards"
                raise _Stop
            self.sess.start_iteration(run.backwards + 1)

    # --- autocast -----------------------------------------------------------------------
    def autocast_enter(self, dtype: torch.dtype) -> None:
        ac = self.sess.autocast
        if ac is None:
            return
        if self._autocast_depth == 0:
            ac.dtype = dtype
            ac.enter()
            if str(dtype) not in self.run.autocast:
                self.run.autocast.append(str(dtype))
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


def _fsdp_compute_dtype(mod: nn.Module) -> str:
    """``torch.bfloat16`` / ``torch.float16`` when FSDP's mixed precision casts ``mod``'s gathered
    parameters to it (FSDP1's ``MixedPrecision``, FSDP2's ``MixedPrecisionPolicy``), else ''."""
    for m in mod.modules():
        dtype = getattr(getattr(m, "mixed_precision", None), "param_dtype", None)  # FSDP1
        get_state = getattr(m, "_get_fsdp_state", None)  # FSDP2 (FSDPModule)
        if dtype is None and callable(get_state):
            try:
                dtype = getattr(getattr(get_state(), "_mp_policy", None), "param_dtype", None)
            except Exception:  # noqa: BLE001 (not laid out yet: no policy to read)
                dtype = None
        if dtype in (torch.bfloat16, torch.float16):
            return str(dtype)
    return ""


def _fsdp1_whole_numels(mod: nn.Module) -> dict[int, int]:
    """id(parameter) → its unsharded element count, for the parameters FSDP1 flattened in ``mod``:
    with ``use_orig_params`` each original parameter is a view of this rank's shard (its
    ``numel()`` the part in the shard, 0 outside it); without, each unit's ``FlatParameter`` is
    the shard of all its parameters. Empty for any other model."""
    out: dict[int, int] = {}
    for m in mod.modules():
        flat = getattr(getattr(m, "_handle", None), "flat_param", None)
        numels = getattr(flat, "_numels", None)
        if flat is None or not isinstance(numels, (tuple, list)):
            continue
        out[id(flat)] = int(sum(numels))
        for p, n in zip(getattr(flat, "_params", None) or (), numels, strict=False):
            out[id(p)] = int(n)
    return out


def _replace(stack: contextlib.ExitStack, owner: Any, name: str, value: Any) -> None:
    """``owner.name = value`` until ``stack`` closes (then the original is put back)."""
    stack.callback(setattr, owner, name, getattr(owner, name))
    setattr(owner, name, value)


@contextlib.contextmanager
def _patched(hooks: _Hooks, optimizers: weakref.WeakSet[Any]) -> Iterator[None]:
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

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        opt_init(self, *args, **kwargs)
        optimizers.add(self)
        hooks.optimizer_created(self)

    _replace(stack, oo.Optimizer, "__init__", init)

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

    stack.enter_context(_host_parameters(hooks))
    stack.enter_context(_patched_grad_scaler())
    stack.enter_context(_patched_distributed(hooks.world, hooks.launched))
    with stack:
        yield


@contextlib.contextmanager
def _host_parameters(hooks: _Hooks) -> Iterator[None]:
    """A Parameter made on the host is a host tensor without real storage (its values kept where
    small): autograd checks that a gradient lives where its parameter does, and a model's large
    weights are host tensors without values (:data:`HOST_WITHOUT_VALUES_FROM`), so all of its
    parameters must be, or a CPU step would mix the two kinds."""
    places, values = hooks.places, hooks.sess.values
    orig = nn.Parameter.__new__
    no_tf = torch._C.DisableTorchFunction

    def new(cls: Any, data: Any = None, requires_grad: bool = True) -> Any:
        if places is not None and type(data) is torch.Tensor and data.numel() and not building() \
                and not checkpoint_loading() and raw_device(data).type == "cpu":
            with no_tf(), places.scope("cpu"):
                host = torch.empty_strided(data.shape, data.stride(), dtype=data.dtype, device="meta")
            values.set_shadow(host, data.detach())
            data = host
        return orig(cls, data, requires_grad)

    nn.Parameter.__new__ = new  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Parameter.__new__ = orig  # type: ignore[method-assign]


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
def _patched_distributed(world: int = 1, launched: bool = False) -> Iterator[None]:
    """One process not launched by a launcher: ``init_process_group`` stops with a pointer to the
    launchers. Rank 0 of a declared world (one process included, under ``torchrun``): the fake
    process group is already up (:func:`_rank_zero`), so the script's ``init_process_group`` (its
    backend and rendezvous) is answered by it, and ``destroy_process_group`` is left to the
    runner's teardown."""
    world = max(world, 2) if launched else world
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
def _rank_zero(world: int, per_node: int, launched: bool = False) -> Iterator[None]:
    """Rank 0 of ``world`` ranks: the launcher's environment (RANK, LOCAL_RANK, WORLD_SIZE,
    LOCAL_WORLD_SIZE, MASTER_ADDR/PORT, as torchrun sets it) and PyTorch's fake process group
    (:func:`vramplan.trace.dist.fake_world`), torn down afterwards; for one process too when a
    launcher started it (``torchrun --nproc-per-node 1`` sets the same variables)."""
    if world <= 1 and not launched:
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


_ACCELERATE_STATES = ("PartialState", "AcceleratorState", "GradientState")


def _accelerate_states() -> list[dict[str, Any]]:
    import sys

    mod = sys.modules.get("accelerate.state")
    out = []
    for name in _ACCELERATE_STATES:
        shared = getattr(getattr(mod, name, None), "_shared_state", None)
        if isinstance(shared, dict):
            out.append(shared)
    return out


@contextlib.contextmanager
def _fresh_accelerate_state() -> Iterator[None]:
    """accelerate keeps its process state (distributed type, mixed precision, the FSDP or
    DeepSpeed plugin) in class-level singletons; a script starts with none, as a new process does,
    and whatever it set is cleared afterwards (the caller's own state put back)."""
    saved = [(d, dict(d)) for d in _accelerate_states()]
    for d, _ in saved:
        d.clear()
    _clear_device_caches()
    try:
        yield
    finally:
        for d in _accelerate_states():  # (accelerate may have been imported by the script)
            d.clear()
        for d, items in saved:
            d.update(items)
        _clear_device_caches()


def _clear_device_caches() -> None:
    """Libraries that detect the accelerator once and cache the answer (diffusers'
    ``TorchDeviceBackend._detect_device_type``, an ``lru_cache``): asked afresh inside the emulated
    GPU and again after it, as in a new process."""
    mod = sys.modules.get("diffusers.utils.torch_utils")
    detect = getattr(getattr(mod, "TorchDeviceBackend", None), "_detect_device_type", None)
    clear = getattr(detect, "cache_clear", None)
    if callable(clear):
        clear()


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


def _is_meta(d: Any) -> bool:
    return (isinstance(d, torch.device) and d.type == "meta") or (isinstance(d, str) and d == "meta")


HOST_WITHOUT_VALUES_FROM = 1 << 20
"""Bytes from which a host tensor made by a factory whose values do not matter (``empty``,
``zeros``, ``randn``, … — a layer's weight before ``.to("cuda")``, a synthetic data set) is a
host tensor without values (meta storage in the ``cpu`` place): a 70B model built on the CPU
takes no RAM. Smaller ones are real (indices, lengths, masks keep their values)."""
_VALUELESS = frozenset({
    "empty", "empty_strided", "zeros", "ones", "full", "rand", "randn", "randint", "normal",
    "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like",
})


def _holds_meta(data: Any, depth: int = 0) -> bool:
    """Whether nested lists of data hold a meta tensor (looked for in the first elements only)."""
    if isinstance(data, torch.Tensor):
        return on_meta(data)
    if isinstance(data, (list, tuple)) and depth < 4:
        return any(_holds_meta(x, depth + 1) for x in data[:8])
    return False


def _to_meta(rest: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``Tensor.to(*rest, **kwargs)`` asks for the meta device."""
    return _is_meta(kwargs.get("device")) or bool(rest) and _is_meta(rest[0])


def _host_request(d: Any) -> bool:
    return d is None or (isinstance(d, torch.device) and d.type == "cpu") or (isinstance(d, str) and d == "cpu")


class _InputMode(torch.overrides.TorchFunctionMode):
    """Where the script's tensors live (:class:`~vramplan.trace.places.Places`): host tensors
    copied to the device are step inputs (small integer ones keep their values as shadows:
    token ids, lengths); large host tensors from value-less factories take no RAM; the
    script's own meta tensors take no memory anywhere."""

    def __init__(self, sess: TraceSession, places: Places, run: ScriptRun | None = None) -> None:
        super().__init__()
        self.values = _host_values(sess)
        self.sess = sess
        self.places = places
        self.run = run
        sess.rec.host = places

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "pin_memory" and args and isinstance(args[0], torch.Tensor) and not self._on_device(args[0]):
            # page-locked host memory is not GPU memory; on a CUDA build of torch (no driver
            # here) the real call would reach the CUDA runtime (DataLoader(pin_memory=True))
            return args[0]
        if name == "to" and len(args) > 1 and type(args[1]) is int:
            # ``t.to(0)`` (accelerate's hooks: a device map's GPU ordinals): the current accelerator's
            # device 0, which a CPU-only torch has not
            args = (args[0], torch.device("cuda", args[1]), *args[2:])
        if type(kwargs.get("device")) is int and (name == "to" or func in _constructors()):
            kwargs = {**kwargs, "device": torch.device("cuda", kwargs["device"])}
        gpu = self._other_gpu(func, name, args, kwargs)
        if gpu is not None:
            return self._on_other_gpu(func, name, gpu, args, kwargs)
        if func in _constructors() and kwargs.get("device") is None:
            # the default device (``torch.set_default_device``, ``with torch.device(...)``): its
            # DeviceContext sits at the bottom of the mode stack and would fill it in after us
            default = getattr(_device_utils, "CURRENT_DEVICE", None)
            if default is not None and default.type != "cpu":
                kwargs = {**kwargs, "device": default}
        if func in _constructors() and _is_meta(kwargs.get("device")) and not building():
            # the script's own meta tensors (``with torch.device("meta")``: a model built to be
            # sharded, then ``to_empty``) take no memory in the real run: kept off the GPU's log,
            # with what is derived from them (FSDP2's meta shards) — ``device="cuda"`` is the GPU
            with self.places.scope("meta"):
                return func(*args, **kwargs)
        if name == "to" and args and isinstance(args[0], torch.Tensor) and _to_meta(args[1:], kwargs) \
                and not building() and args[0].device.type != "meta":  # (as the script sees it)
            # ``t.to("meta")`` (accelerate's offload hooks putting a weight away after its call):
            # a new meta tensor that holds no memory, where the emulated device's own storage is
            # meta too and torch would hand back ``t`` itself, keeping the device copy alive
            src = args[0]
            dtype = kwargs.get("dtype") or next((a for a in args[1:] if isinstance(a, torch.dtype)), src.dtype)
            with self.places.scope("meta"):
                return torch.empty_strided(src.shape, src.stride(), dtype=dtype, device="meta")
        if name in _VALUELESS and _host_request(kwargs.get("device")) and not building():
            out = self._host_without_values(func, name, args, kwargs)
            if out is not None:
                return out
        if name in _FROM_DATA and args and _holds_meta(args[0]):
            # torch.tensor([t0, t1, ...]) of meta tensors: torch reads each element's value with
            # Python dispatch switched off, so the elements' known values are read here
            args = (self._values_of(args[0]), *args[1:])
        if name in _FROM_DATA and is_cuda(kwargs.get("device")):
            # torch.tensor(data, device="cuda"): the values are the host data's; keep them
            host = func(*args, **{**kwargs, "device": "cpu"})
            out = host.to(kwargs["device"])
            if host.numel() <= 1 << 20:
                self.sess.values.set_shadow(out, host)
            return out
        out = func(*args, **kwargs)
        if name in _FINITE and isinstance(out, torch.Tensor) and self._on_device(out) \
                and not self.sess.values.has_shadow(out) and out.numel() <= 1 << 16:
            # activations are finite (no overflow): what the step does nearly always
            self.sess.values.set_shadow(out, torch.full(out.shape, name == "isfinite", dtype=torch.bool))
            self.sess.dispatch.rules_used["finite"] += 1
        if name in ("to", "cuda") and args and isinstance(args[0], torch.Tensor) and isinstance(out, torch.Tensor):
            src = args[0]
            if not self._on_device(src) and self._on_device(out) and not self._gpu_of(src):
                # a weight brought in by accelerate's offload hooks is a weight (``Parameter(w).to(dev)``)
                weight = isinstance(src, nn.Parameter) or getattr(src, "_vramplan_weight", False)
                self.sess.rec.relabel(out, Category.PARAMETER if weight else Category.INPUT)
                run = self.run
                if run is not None and not run.device_forwards and not CONVERTING[0] and len(run.inputs) < 64 \
                        and not weight:  # (FSDP1 moves parameters itself: not inputs)
                    run.inputs.append((tuple(out.shape), str(out.dtype)))
                if raw_device(src).type == "cpu" and not src.is_floating_point() and src.numel() <= 1 << 20:
                    self.sess.values.set_shadow(out, src)
        return out

    def _gpu_of(self, t: torch.Tensor) -> bool:
        """``t`` is on one of the emulated GPUs other than GPU 0 (its place)."""
        p = self.places.place_of(t)
        return p is not None and p.device.type == "cuda"

    def _other_gpu(self, func: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """The place of the GPU other than 0 that a copy (``t.to("cuda:1")``, ``t.cuda(1)``) or a
        factory (``torch.zeros(…, device="cuda:1")``) names (None: none)."""
        if not self.places.gpus_apart:
            return None
        if name in ("to", "cuda") and args and isinstance(args[0], torch.Tensor):
            dev = kwargs.get("device")
            if dev is None and len(args) > 1 and not isinstance(args[1], torch.dtype):
                dev = args[1]
                if isinstance(dev, torch.Tensor):
                    dev = dev.device
            if name == "cuda" and isinstance(dev, int):
                dev = torch.device("cuda", dev)
        elif func in _constructors() or name in _FROM_DATA:
            dev = kwargs.get("device")
        else:
            return None
        if isinstance(dev, int) and not isinstance(dev, bool):
            dev = f"cuda:{dev}"
        if isinstance(dev, (str, torch.device)):
            try:
                d = torch.device(dev)
            except RuntimeError:
                return None
            key = f"cuda:{d.index}"
            if d.type == "cuda" and d.index and key in self.places.by_device and self.places.by_device[key].in_use:
                return key
        return None

    def _on_other_gpu(self, func: Any, name: str, gpu: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A tensor made on, or copied to, a GPU other than 0 (a block of a model spread over
        the GPUs by a device map, :func:`_spread`): it lives in that GPU's place."""
        place = self.places.by_device[gpu]
        if name not in ("to", "cuda"):
            with self.places.scope(gpu):
                if name in _FROM_DATA:
                    host = func(*args, **{**kwargs, "device": "cpu"})
                    out = host.to("meta", copy=True)
                    self.sess.values.set_shadow(out, host)
                    return out
                return func(*args, **{**kwargs, "device": "meta"})
        src = args[0]
        dtype = kwargs.get("dtype") or next((a for a in args[1:] if isinstance(a, torch.dtype)), None)
        if self.places.place_of(src) is place and not kwargs.get("copy"):
            return src if dtype in (None, src.dtype) else src.to(dtype)  # (made in its place: its inputs are)
        with self.places.scope(gpu):
            if not on_meta(src):  # host data with values (token ids): a device tensor that keeps them
                out = torch.empty_strided(src.shape, src.stride(), dtype=dtype or src.dtype, device="meta")
                if src.numel() <= 1 << 20:
                    self.sess.values.set_shadow(out, src.to(dtype or src.dtype))
                return out
            return src.to(device="meta", dtype=dtype or src.dtype, copy=True)

    def _values_of(self, data: Any) -> Any:
        if isinstance(data, torch.Tensor):
            return self.values(data, "torch.tensor(data)") if on_meta(data) else data
        if isinstance(data, (list, tuple)):
            return type(data)(self._values_of(x) for x in data)
        return data

    def _on_device(self, t: torch.Tensor) -> bool:
        return on_meta(t) and not self.places.is_host(t)

    def _host_without_values(self, func: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A large host tensor from a value-less factory: meta storage in the ``cpu`` place
        (None: a small one, or a call meta cannot make — the real call runs)."""
        if name.endswith("_like"):  # like a host tensor with values (one without is placed by the trace)
            src = args[0] if args else kwargs.get("input")
            if not (isinstance(src, torch.Tensor) and raw_device(src).type == "cpu"):
                return None
        if kwargs.get("out") is not None or kwargs.get("generator") is not None:
            return None
        try:
            with self.places.scope("cpu"):
                out = func(*args, **{**kwargs, "device": "meta", "pin_memory": False}) \
                    if "pin_memory" in kwargs else func(*args, **{**kwargs, "device": "meta"})
        except (RuntimeError, TypeError, ValueError):
            return None
        if not isinstance(out, torch.Tensor) or out.untyped_storage().nbytes() < HOST_WITHOUT_VALUES_FROM:
            return None
        self.sess.dispatch.rules_used["host_without_values"] += 1
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
def _argv(path: Path, argv: Sequence[str], first: Path) -> Iterator[None]:
    """``sys.argv`` as Python gives it to the script, ``first`` first on ``sys.path`` (the script's
    folder; for ``python -m``, the working folder)."""
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(path), *argv]
    sys.path.insert(0, str(first))
    try:
        yield
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path


def _user_frame(tb: Any, path: Path) -> str:
    """``file:line`` of the innermost frame in the user's script (or its folder) of a traceback
    or a list of frames (never vramplan's own, even where it lies in that folder: a checkout
    beside the script)."""
    folder = str(path.parent.resolve())
    best = ""
    frames = tb if isinstance(tb, list) else traceback.extract_tb(tb)
    for fs in frames:
        f = os.path.realpath(fs.filename)  # (resolved as the folder is: a symlinked folder is the same one)
        if f == str(path.resolve()) or (f.startswith(folder + os.sep) and "site-packages" not in f
                                        and not f.startswith(_PACKAGE)):
            best = f"{os.path.relpath(os.path.abspath(fs.filename))}:{fs.lineno}"
    return best or str(path)


_PACKAGE = str(Path(__file__).resolve().parent.parent) + os.sep


def _script_error(e: BaseException, path: Path) -> TraceError:
    """The script's own exception as one line: where in the script, what, and whose it is."""
    if isinstance(e, SyntaxError) and e.filename and os.path.abspath(e.filename) == str(path.resolve()):
        return TraceError(f"{os.path.relpath(e.filename)}:{e.lineno}: SyntaxError: {e.msg}",
                          hint="the script does not parse: fix it (python -m py_compile SCRIPT)")
    where = _user_frame(e.__traceback__, path)
    text = str(e).strip().splitlines()
    what = f"{type(e).__name__}: {text[0][:300] if text else ''}".rstrip(": ")
    frames = traceback.extract_tb(e.__traceback__)
    obj = getattr(e, "obj", None) if isinstance(e, AttributeError) else None
    if obj is not None and type(obj).__module__.startswith("vramplan."):
        return TraceError(f"{where}: {what}", hint="an attribute the emulated GPU does not have yet: please report it "
                                                   "with the script")
    if "<vramplan." in str(e):  # torch names the mode that had no rule (a higher-order operator)
        return TraceError(f"{where}: {what}", hint="a call the emulated GPU does not run yet (the error names "
                                                   "vramplan's own mode): please report it with the script")
    if frames and os.path.abspath(frames[-1].filename).startswith(_PACKAGE):
        return TraceError(f"{where}: {what}",
                          hint=f"vramplan's emulation failed here ({os.path.basename(frames[-1].filename)}:"
                               f"{frames[-1].lineno}): please report it with the script")
    return TraceError(f"{where}: the script raised {what}",
                      hint="the script's own error, as a run on a GPU raises it: check the script and its "
                           "arguments after --")


class _ScriptExit(BaseException):
    """``os._exit(code)`` in the script: the run ends there (the process does not)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


@contextlib.contextmanager
def _no_process_exit() -> Iterator[None]:
    """``os._exit`` ends the script, not vramplan (which still has a report to write)."""
    real = os._exit

    def _exit(status: int) -> None:  # (torch-free: os._exit's own signature)
        raise _ScriptExit(status)

    os._exit = _exit  # type: ignore[assignment]
    try:
        yield
    finally:
        os._exit = real


@contextlib.contextmanager
def _workers_in_process(run: ScriptRun) -> Iterator[None]:
    """DataLoader workers run in this process: a worker process would start from this one,
    emulation and all, and send host tensors without values through shared memory, which
    they have none of. What the workers do is host work; the GPU sees the same batches."""
    import functools

    from torch.utils.data import DataLoader

    init = DataLoader.__init__

    # DataLoader's own signature (``__wrapped__``): Lightning and accelerate rebuild a loader (a
    # DistributedSampler under DDP) from ``inspect.signature(loader.__init__)``; a bare
    # ``(*args, **kwargs)`` would lose batch_size, shuffle, collate_fn…
    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        import inspect

        bound = inspect.signature(init).bind(self, *args, **kwargs)
        workers = bound.arguments.get("num_workers", 0) or 0
        if workers:
            run.workers = max(run.workers, int(workers))
            bound.arguments["num_workers"] = 0
            for k in ("prefetch_factor", "persistent_workers", "worker_init_fn", "multiprocessing_context"):
                bound.arguments.pop(k, None)
        init(*bound.args, **bound.kwargs)

    DataLoader.__init__ = __init__  # type: ignore[method-assign]
    try:
        yield
    finally:
        DataLoader.__init__ = init  # type: ignore[method-assign]


def _host_values(sess: TraceSession) -> Any:
    """Host values of a meta tensor the script reads (``.tolist()``, ``.numpy()``): known values,
    1.0 for floats (as ``.item()`` reads them, stated in the notes), else the run stops."""
    from ..trace.where import user_frame

    def values(t: torch.Tensor, what: str, exact: bool = False) -> torch.Tensor | None:
        cpu = sess.values.cpu_view(t)
        if cpu is not None or exact:
            return cpu
        reads = sess.dispatch.float_reads
        index = sess.dispatch.sampled_index(t)
        if index is not None:
            return torch.full(tuple(t.shape), index, dtype=t.dtype)
        if (t.is_floating_point() or t.is_complex()) and reads is not None:
            sess.dispatch.rules_used["host_float"] += 1
            return torch.full(tuple(t.shape), reads, dtype=t.dtype)
        raise TraceError(
            f"data-dependent control flow at {user_frame()}: {what} of a {t.dtype} tensor needs values "
            "computed from model data, which a run on fake tensors does not have",
            hint="make the branch depend on shapes or configuration; pass such values as inputs "
                 "(a Python list or a CPU tensor)")
    return values


def _capture_pool(sess: TraceSession) -> Callable[[int | None], None]:
    """A CUDA graph's capture: its allocations go to its private pool (``emulate.graphs``)."""
    from ..allocator.constants import PRIVATE_POOL

    def on_capture(pool: int | None) -> None:
        sess.rec.capture_pool = None if pool is None else PRIVATE_POOL + pool
        if pool is not None and not any("CUDA graph" in n for n in sess.notes):
            sess.notes.append("CUDA graphs: each capture's allocations are kept in its private pool (reused only by "
                              "captures sharing the pool, kept through empty_cache); a replay allocates nothing")

    return on_capture


def _stream_of(sess: TraceSession, places: Places) -> Callable[[int, int], None]:
    """A device's current stream changed (``torch.cuda.stream(s)``, ``set_stream``: :mod:`vramplan.emulate.cuda`):
    GPU 0's allocations are recorded on it (the recorder's stream), another GPU's on its own
    (:attr:`~vramplan.trace.places.GpuPlace.stream`); each GPU's allocator replay keeps one pool per stream."""
    def on_stream(device: int, stream: int) -> None:
        if device == 0:
            sess.rec.stream = stream
            return
        other = places.gpus.get(device)
        if other is not None:
            other.stream = stream

    return on_stream


def _loading(sess: TraceSession, places: Places) -> Any:
    """What ``from_pretrained`` needs of this run (:mod:`.pretrained`): the device, the notes, the
    host scope, the booking of a loaded model's tensors on the device, and its placement over
    the emulated GPUs and the host (:func:`_spread`)."""
    from .pretrained import Loading

    def book(model: nn.Module) -> None:
        for p in model.parameters():
            if on_meta(p) and not places.is_host(p):
                sess.rec.relabel(p, Category.PARAMETER)
        for b in model.buffers():
            if on_meta(b) and not places.is_host(b):
                sess.rec.relabel(b, Category.BUFFER)

    return Loading(device=sess.profile, notes=sess.notes, host_scope=lambda: places.scope("cpu"), book=book,
                   spread=lambda model, placement: _spread(model, placement, places, book))


def _spread(model: nn.Module, placement: dict[str, Any], places: Places,
            book: Callable[[nn.Module], None]) -> list[str]:
    """A model loaded with a device map over more than GPU 0, placed as transformers 5.24 loads
    it: each weight where the map puts it (``_load_pretrained_model`` reads every weight onto its
    device; modeling_utils.py:4524-4526 ``expand_device_map``), then transformers' own
    ``accelerate_dispatch`` (modeling_utils.py:4464-4466), i.e. accelerate's ``dispatch_model``
    (accelerate 1.16 big_modeling.py:311-496): an ``AlignDevicesHook`` per block moves the
    block's inputs to its GPU, and a block offloaded to the CPU has its weights put on ``meta``
    and copied to the main GPU for each call (``pre_forward``), then dropped (``post_forward``).

    The other GPUs' tensors live in their places (:class:`~vramplan.trace.places.Places`): they
    report ``cuda:N`` and are kept off GPU 0's log; a CPU-offloaded weight is a host tensor.
    ``"disk"`` is dispatched as ``"cpu"`` (the same copies to the GPU per call; the weights are
    read from the offload folder instead of RAM)."""
    from transformers.integrations.accelerate import accelerate_dispatch, expand_device_map

    gpus = {k for k in places.by_device if k.startswith("cuda:")}
    for k in gpus:  # from now on each GPU's tensors are its own (until now, all the emulated GPU's)
        places.by_device[k].in_use = True
    places.gpus_apart = bool(gpus)
    where: dict[str, str | None] = {}  # device map value → place (None: GPU 0)
    for dev in set(placement.values()):
        key = str(dev)
        key = f"cuda:{key}" if key.isdigit() else "cpu" if key == "disk" else key
        if key in ("cuda", "cuda:0"):
            where[str(dev)] = None
        elif key == "cpu" or key in gpus:
            where[str(dev)] = key
        else:
            raise TraceError(f"the script's device map places weights on {dev!r}, which the emulated machine does not "
                             f"have (GPUs cuda:0…cuda:{len(gpus)}, cpu, disk)", hint="emulate more GPUs: `gpus=N`")
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    device_of = expand_device_map(placement, names)
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    for name, t in tensors.items():
        place = where[str(device_of[name])]
        if place is not None and on_meta(t):
            places.adopt(t, place)
    book(model)
    dispatched = {k: "cpu" if v == "disk" else v for k, v in placement.items()}
    accelerate_dispatch(model, None, dispatched, None, None, False)
    setattr(model, "hf_device_map", dict(placement))  # noqa: B010  (dispatch_model sets the map it was given)
    for m in model.modules():  # the offloaded weights, which the hooks copy to the GPU per call: weights there
        loader = getattr(getattr(getattr(m, "_hf_hook", None), "weights_map", None), "dataset", None)
        for t in (getattr(loader, "state_dict", None) or {}).values():
            if isinstance(t, torch.Tensor):
                t._vramplan_weight = True  # type: ignore[attr-defined]
        if loader is not None:
            break
    book(model)  # (the buffers of offloaded blocks, moved to the main GPU by dispatch_model)
    notes = []
    off = {"cpu": 0, "disk": 0}  # (their buffers are on the GPU: offload_buffers=False)
    for name, t in model.named_parameters():
        dev = str(device_of[name])
        if dev in off:
            off[dev] += t.untyped_storage().nbytes()
    if off["cpu"] or off["disk"]:
        held = " and ".join(f"{n:,} B ({n / 2**30:.2f} GiB) {what}" for n, what in
                            ((off["cpu"], "in host RAM"), (off["disk"], "in the offload folder on disk")) if n)
        notes.append(f"device_map: weights offloaded: {held}; accelerate's hooks copy each offloaded block's "
                     "weights to GPU 0 for its call and drop them after it")
    if off["disk"]:
        notes.append("device_map: the blocks placed on \"disk\" are emulated as offloaded to the CPU: the same "
                     "copies to the GPU for each call (a real run reads them from the offload folder)")
    return notes


def trace_script(path: str | Path, argv: Sequence[str] = (), *, profile: DeviceProfile, facts: DeviceFacts,
                 steps: int = 2, timeout: float | None = 300.0, autocast_dtype: torch.dtype = torch.bfloat16,
                 alloc_conf: str | None = None, progress: Progress | None = None,
                 online: bool = False, world: int = 1,
                 env: dict[str, str] | None = None, module: str | None = None,
                 launched: bool = False) -> tuple[TraceResult, ScriptRun]:
    """Run the script at ``path`` with ``argv`` and trace it (see the module docstring).

    ``world`` > 1: the script is rank 0 of that many processes (a torchrun / accelerate
    launch), on PyTorch's fake process group; ``facts.count`` is the GPUs per node. ``env``: the
    launcher's own variables for the script (``accelerate launch``'s), set while it runs.
    ``module``: run as ``python -m MODULE`` (``path`` is its file): its packages are imported and
    it runs as ``__main__`` on the emulated GPU, the working folder first on ``sys.path``.
    ``launched``: a launcher started it (its rank variables and process group even for one process)."""
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
    sess.dispatch.bool_reads = False
    sess.dispatch.strict_devices = True
    places = Places(sess.rec, ("cpu", "meta", *(f"cuda:{i}" for i in range(1, facts.count))), alloc_conf)
    for i in range(1, facts.count):  # (GPUs apart from GPU 0 once a device map spreads a model: _spread)
        places.by_device[f"cuda:{i}"].in_use = False
    run = ScriptRun()
    if not isinstance(world, int) or world < 1:
        raise VramplanError(f"the world must be a positive number of processes, got {world!r}")
    hooks = _Hooks(sess, run, steps, progress, started)
    hooks.world = world
    hooks.launched = launched
    hooks.places = places
    hooks.path = p
    live = LiveAllocator(sess.rec.log, alloc_conf)
    hooks.live = live
    capacity = facts.total_memory - facts.outside_allocator
    guard = OomGuard(capacity=capacity, total=facts.total_memory,
                     replay=LiveAllocator(sess.rec.log, alloc_conf, capacity=capacity), stream=lambda: sess.rec.stream)


    def retried() -> None:  # the handler runs its function again: its steps and its batch count
        run.steps = run.device_forwards = 0
        # the emulated error was raised in Python frames (the trace's dispatch mode), whose reference cycles
        # keep the failed call's tensors; CUDA's is raised in C++ and they die with the exception
        gc.collect()
        sess.rec.emit_action(Action.EMPTY_CACHE, "out-of-memory retry: the allocator's cache freed")
        for other in places.gpus.values():
            other.empty_cache()

    def searched() -> None:  # Lightning's batch-size finder ended: the run's steps are the training's after it
        run.steps = run.device_forwards = 0

    guard.on_retry = retried
    guard.on_search_end = searched
    guard.on_release = lambda: sess.rec.emit_action(
        Action.EMPTY_CACHE, "the allocator freed its cache (inside an out-of-memory handler: to fit an allocation, or before its "
        "out-of-memory error)")
    sess.rec.guard = hooks.guard = guard
    optimizers: weakref.WeakSet[Any] = weakref.WeakSet()

    def on_sync(kind: str) -> None:
        action = Action.SYNC if kind == "synchronize" else Action.EMPTY_CACHE
        sess.rec.emit_action(action, f"torch.cuda.{kind}")
        if action is Action.EMPTY_CACHE:  # (every GPU's cache: GpuPlace.empty_cache)
            for other in places.gpus.values():
                other.empty_cache()

    try:
        with _offline(online), _collect_deterministically(), _environ(env or {}), _fresh_accelerate_state(), \
                _rank_zero(world, facts.count, launched), sess, \
                emulated_gpu(facts, live, on_sync=on_sync, values=_host_values(sess), places=places.all,
                             optimizers=optimizers, on_launch=lambda ts: _forget(sess, ts),
                             on_gpu=sess.rec.records, on_capture=_capture_pool(sess),
                             on_stream=_stream_of(sess, places)) \
                as gpu, \
                _rank_streams(world, sess), _patched(hooks, optimizers), _workers_in_process(run), \
                weightless_from_pretrained(_loading(sess, places)), _InputMode(sess, places, run), \
                _argv(p, argv, Path.cwd() if module else p.parent), \
                modes_follow_threads(trace_session._ACTIVE), _no_process_exit(), _deadline(timeout), \
                recovering_handlers(guard):
            sess.start_iteration(1)
            hooks._set_phase(Phase.FORWARD)
            try:
                if module:
                    runpy.run_module(module, run_name="__main__", alter_sys=True)
                else:
                    runpy.run_path(str(p), run_name="__main__")
                run.stopped_by = "end"
            except _Stop:
                pass
            except (SystemExit, _ScriptExit) as e:
                code = e.code
                if isinstance(code, str):
                    raise TraceError(f"the script stopped after {run.steps} step(s): {code}",
                                     hint="check the script's arguments (after --)") from None
                if code not in (None, 0):
                    how = " (os._exit)" if isinstance(e, _ScriptExit) else ""
                    raise TraceError(f"the script exited with status {code}{how} after {run.steps} step(s)",
                                     hint="check the script's arguments (after --)") from None
                run.stopped_by = "end"
    except _Timeout:
        if run.optimizers == 0 and run.forwards and hooks.rose_until >= run.forwards - 1:
            raise TraceError(
                f"the script's memory was still growing after {run.forwards} forward call(s) when {timeout:g} s ran "
                "out (an inference or generation loop runs until its memory stops growing: a cache or context that "
                "grows each call peaks at its last one)",
                hint="raise `timeout`, or generate fewer tokens for the run (memory grows linearly with them)") from None
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
        if not caused_by(e, _Stop):
            raise _script_error(e, p) from e
        # the script's own clean-up failed while vramplan stopped it (Lightning moves the model
        # back to the CPU in its teardown): the steps ran; what follows is not the step's memory
    sess.rec.guard = None
    _check_on_device(run, p)
    notes = list(sess.notes)
    if (handled := guard.note()) is not None:
        notes.append(handled)
    what = {"steps": f"stopped after {run.steps} optimizer step(s)",
            "backwards": f"stopped after {run.backwards} backward pass(es) (no optimizer: the script updates its "
                         "parameters itself)",
            "forwards": f"stopped after {run.forwards} forward call(s) (no optimizer: inference; memory last grew "
                        f"at call {hooks.rose_until}, then held for {steps})",
            "end": f"the script ended after {run.steps} optimizer step(s) and {run.forwards} forward call(s)"}
    notes.append(f"script {p.name}: {what.get(run.stopped_by, '')}; models {', '.join(run.roots) or '-'}")
    if run.workers:
        notes.append(f"DataLoader num_workers={run.workers} ran in this process (host work only: the GPU sees "
                     "the same batches)")
    if gpu.kernels:
        notes.append(f"{gpu.kernels} Triton kernel launch(es) ran as no-ops (they allocate nothing themselves: "
                     "their buffers are PyTorch allocations, traced)")
    if gpu.saved:
        files = sorted(set(gpu.saved))
        notes.append(f"torch.save wrote {len(files)} file(s) holding the device tensors' shapes without values "
                     f"(the emulated GPU has none): {', '.join(files[:3])}{' …' if len(files) > 3 else ''}; "
                     "they load back onto the emulated GPU only")
    if sess.dispatch.host_reads:
        notes.append(f"{sum(sess.dispatch.host_reads.values())} copy(ies) of device data into host tensors kept the "
                     "host's old values (the trace has no device values; memory is unaffected)")
    notes += _emulation_notes(sess, profile.name, profile.cublas_workspace)
    result = summarize(sess, params=run.params, trainable=run.trainable, flops=None, notes=notes)
    return dataclasses.replace(result, gpu_events=_other_gpus(places)), run


def _other_gpus(places: Places) -> tuple[tuple[int, EventLog], ...]:
    """The event stream of each GPU other than 0 that held tensors (a model spread over the GPUs
    by a device map: :func:`_spread`), by index."""
    return tuple((i, p.log) for i, p in sorted(places.gpus.items()) if p.in_use and p.used)


def caused_by(e: BaseException, kind: type[BaseException]) -> bool:
    """``e`` was raised while an exception of ``kind`` unwound (its context chain holds one)."""
    seen: set[int] = set()
    c: BaseException | None = e
    while c is not None and id(c) not in seen:
        if isinstance(c, kind):
            return True
        seen.add(id(c))
        c = c.__context__
    return False


def _forget(sess: TraceSession, tensors: list[Any]) -> None:
    """Tensors a kernel wrote (a Triton launch): the values the trace knew are gone."""
    for t in tensors:
        sess.values.drop_shadow(t)


def _check_on_device(run: ScriptRun, path: Path) -> None:
    """Never a figure for a run whose model stayed on the CPU (what the GPU would hold is then
    only workspaces): stop with the reason and where."""
    if run.steps == 0 and run.forwards == 0:
        raise TraceError(f"{path} ran no model (no forward call of an nn.Module and no optimizer step was seen)",
                         hint="move the model and its inputs to 'cuda' as you would on a GPU")
    if run.host_forwards and run.host_param_bytes >= run.device_param_bytes:
        what = "the model never reached the GPU" if not run.device_forwards else \
            "most of the model's parameters stayed on the CPU"
        raise TraceError(f"{what}: {run.host_model} ran forward on the CPU "
                         f"({run.host_param_bytes:,} B of parameters on the host, {run.device_param_bytes:,} B on "
                         "the emulated GPU)",
                         hint="move the model to the GPU as the script would on one (model.to('cuda')); "
                              "if the script picks its device itself, check what it chose")


def _offloaded_to_device(mod: nn.Module) -> bool:
    """Whether accelerate's offload hooks run ``mod`` on the GPU though its weights wait on the
    host: diffusers' ``enable_model_cpu_offload`` (a ``CpuOffload`` hook that moves the model to
    its execution device before the forward) and ``enable_sequential_cpu_offload`` (an
    ``AlignDevicesHook`` per submodule, weights brought in for each call)."""
    for m in mod.modules():
        hook = getattr(m, "_hf_hook", None)
        if hook is None:
            continue
        for h in getattr(hook, "hooks", None) or (hook,):
            dev = getattr(h, "execution_device", None)
            if dev is not None and (is_cuda(dev) or str(dev).startswith("cuda")):
                return True
    return False
