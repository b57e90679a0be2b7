"""Tiny versions of catalog models (2 layers, hidden 64) for tests and benchmarks.

``tiny_spec("llama-3.1-8b")`` keeps the architecture (GQA, MoE routing, MLA, sliding
windows, the head) and shrinks every size, so a trace takes a fraction of a second.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ..models.spec import ModelSpec

_DECODER = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "vocab_size": 256, "max_position_embeddings": 512,
}
_MOE = {
    "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "n_group": 1, "topk_group": 1,
    "first_k_dense_replace": 1,
}
_MLA = {"kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16}


def tiny_config(config: dict[str, Any], layers: int = 2) -> dict[str, Any]:
    """A shrunken copy of a catalog ``config.json``."""
    c = dict(config)
    mt = c.get("model_type") or c.get("_class_name")
    if mt == "UNet2DConditionModel":
        c.update(block_out_channels=[32, 64], down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
                 up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"], layers_per_block=1, attention_head_dim=8,
                 cross_attention_dim=32, norm_num_groups=8, sample_size=8)
        return c
    if mt == "resnet":
        c.update(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1])
        return c
    if mt == "vit":
        c.update(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=128,
                 image_size=32, patch_size=8)
        return c
    if mt == "bert":
        c.update(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=128,
                 vocab_size=256, max_position_embeddings=128)
        return c
    if mt == "gpt2":
        c.update(n_embd=64, n_layer=layers, n_head=4, vocab_size=256, n_positions=256, n_ctx=256)
        c.pop("n_inner", None)
        return c
    heads = c.get("num_attention_heads", 4) or 4
    kv = c.get("num_key_value_heads") or heads
    c.update(_DECODER, num_hidden_layers=layers)
    c["num_key_value_heads"] = 4 if kv == heads else 2
    if "head_dim" in c and c["head_dim"]:
        c["head_dim"] = 16
    if "query_pre_attn_scalar" in c:
        c["query_pre_attn_scalar"] = 16
    if c.get("sliding_window"):
        c["sliding_window"] = 16
    if "layer_types" in c:
        c.pop("layer_types")
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(c.get(k), int) and c[k] >= c["vocab_size"]:
            c[k] = 0
    for k, v in _MOE.items():
        if k in c and c[k] is not None:
            c[k] = v
    if c.get("kv_lora_rank"):
        c.update(_MLA)
        if c.get("q_lora_rank"):
            c["q_lora_rank"] = 32
    return c


def tiny_spec(name: str, layers: int = 2) -> ModelSpec:
    """The catalog model ``name`` shrunk to ``layers`` layers of width 64."""
    from ..models.catalog import resolve
    from ..models.normalize import spec_from_config

    spec = resolve(name)
    cfg = tiny_config(dict(spec.config), layers)
    return spec_from_config(cfg, name=f"tiny-{spec.name}", source=f"tiny copy of {spec.source}")


def memtracker_peak(make_model: Any, make_inputs: Any, *, iterations: int = 2, lr: float = 1e-4,
                    optimizer: str = "adamw", loss_fn: Any = None) -> int:
    """Peak total bytes that PyTorch's own ``MemTracker`` reports for the same training step,
    run under ``FakeTensorMode`` on fake CPU tensors (the reference our trace is compared with).

    ``make_model()`` / ``make_inputs()`` build the model and the keyword inputs inside the fake
    mode; the loss is ``out.loss`` when present, else ``loss_fn(out)`` or ``out.sum()``.
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    with FakeTensorMode():
        model = make_model()
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = (torch.optim.AdamW(params, lr=lr, foreach=True) if optimizer == "adamw"
               else torch.optim.SGD(params, lr=lr, foreach=True))
        mt = MemTracker()
        mt.track_external(model, opt)
        with mt:
            inputs = make_inputs()  # made inside the tracker so that it counts them, as we do
            for _ in range(iterations):
                out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
                loss = getattr(out, "loss", None)
                if loss is None:
                    t = out if isinstance(out, torch.Tensor) else out[0]
                    loss = loss_fn(t) if loss_fn is not None else t.sum()
                del out
                loss.backward()
                del loss
                opt.step()
                opt.zero_grad(set_to_none=True)
                mt.reset_mod_stats()
        snap = mt.get_tracker_snapshot("peak")
    return int(sum(v["Total"] for v in snap.values()))


def real_peak(make_model: Any, make_inputs: Any, *, task: str = "train", iterations: int = 2,
              loss_fn: Any = None, lr: float = 1e-4, seed: int = 0) -> int:
    """Peak bytes of live CPU tensor storages while the trace's step (:mod:`.steps`) runs for
    real on the CPU: model weights, inputs, activations, gradients, optimizer states
    (``AdamW(foreach=True)``) and every op's outputs — the reference the model-zoo tests
    compare traces with. Kernel-internal scratch memory is not seen (as in the trace,
    where CUDA's workspaces are emulated separately)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small CPU kernels: threads only contend on a loaded machine
    try:
        return _real_peak(make_model, make_inputs, task, iterations, loss_fn, lr, seed)
    finally:
        torch.set_num_threads(threads)


def _real_peak(make_model: Any, make_inputs: Any, task: str, iterations: int, loss_fn: Any, lr: float,
               seed: int) -> int:
    import torch

    from .run import _flat_tensors
    from .steps import loss_of

    torch.manual_seed(seed)
    tracker = _StoragePeak()
    model = make_model()
    model.train(task == "train")
    inputs = make_inputs()
    if isinstance(inputs, dict):
        batch: Any = ((), inputs)
    elif isinstance(inputs, (list, tuple)):
        batch = (tuple(inputs), {})
    else:
        batch = ((inputs,), {})
    for t in [*model.parameters(), *model.buffers(), *_flat_tensors(batch)]:
        tracker.add(t)
    with tracker:
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=lr, foreach=True) if task == "train" else None
        for _ in range(iterations):
            if opt is not None:
                out = model(*batch[0], **batch[1])
                loss = loss_of(out, batch, loss_fn)
                del out
                loss.backward()
                del loss
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                with torch.inference_mode():
                    out = model(*batch[0], **batch[1])
                    del out
    return tracker.peak


def _storage_peak_mode() -> Any:
    import contextlib
    import threading
    import weakref
    from functools import partial

    import torch
    from torch.utils._python_dispatch import (
        TorchDispatchMode,
        is_traceable_wrapper_subclass,
        is_traceable_wrapper_subclass_type,
    )
    from torch.utils._pytree import tree_leaves

    from .recorder import inner_tensors

    aten = torch.ops.aten
    # bf16/fp16 matrix products on a CPU without bf16 instructions (AVX2) take PyTorch's scalar
    # fallback, 5-8x slower than fp32 (a tiny Llama's 128k-vocabulary head: 2 s against 0.25 s
    # per call). They are computed in fp32 and rounded to the inputs' dtype: the same output
    # tensor (shape, dtype, a new contiguous storage) as the op makes, so what is tracked is
    # unchanged; the fallback accumulates in fp32 too. The fp32 copies are made inside this
    # handler, where no mode sees them, as a GPU kernel's own scratch is not seen.
    _HALF_MATMULS: dict[Any, Any] = {
        aten.mm.default: lambda a, b: torch.mm(a.float(), b.float()).to(a.dtype),
        aten.bmm.default: lambda a, b: torch.bmm(a.float(), b.float()).to(a.dtype),
        aten.addmm.default: lambda c, a, b, *, beta=1, alpha=1: torch.addmm(
            c.float(), a.float(), b.float(), beta=beta, alpha=alpha).to(a.dtype),
        aten.baddbmm.default: lambda c, a, b, *, beta=1, alpha=1: torch.baddbmm(
            c.float(), a.float(), b.float(), beta=beta, alpha=alpha).to(a.dtype),
    }

    def _half_cpu(args: Any) -> bool:
        tensors = [t for t in args if isinstance(t, torch.Tensor)]
        return (len({t.dtype for t in tensors}) == 1 and tensors[0].dtype in (torch.bfloat16, torch.float16)
                and all(not is_traceable_wrapper_subclass(t) and t.device.type == "cpu" and t.layout == torch.strided
                        for t in tensors))

    class StoragePeak(TorchDispatchMode):
        """Live bytes of CPU storages made by ops (or registered with :meth:`add`). A wrapper
        subclass (DTensor, torchao's float8 tensors, functional collectives'
        ``AsyncCollectiveTensor``) is handed each op (its ops on its inner tensors come back here)
        and counts by its inner tensors: its own storage, sized like its shape × dtype, holds no
        memory (:func:`.recorder.inner_tensors`)."""

        def __init__(self) -> None:
            super().__init__()
            self.live: dict[int, Any] = {}
            self.sizes: dict[int, int] = {}
            self.current = 0
            self.peak = 0
            self.lock = threading.RLock()
            """Held while the count changes: a storage the process group's worker thread frees is
            counted off on that thread (its weak reference's callback), which must not interleave
            with the main thread's read-modify-write of :attr:`current`."""
            self.phase_peaks: dict[str, int] = {}
            """Each phase's peak (:meth:`phase`)."""
            self.redispatch_dtensors = False
            """(Kept for callers: every wrapper subclass is handed its ops.)"""
            self.skip_wrappers = False
            """Leave out the storages of wrappers without ``__tensor_flatten__`` (no data
            pointer: no memory)."""
            self.native_half_matmuls = False
            """Run bf16/fp16 matrix products as the CPU does (slow) instead of in fp32."""
            self.await_collectives = False
            """At a functional collective's ``wait_tensor``, wait until the process group's
            worker thread has dropped the work too (:meth:`_await_release`); complete each
            functional collective where it is issued, its inputs released (:meth:`_await_inputs`)."""

        def add(self, t: torch.Tensor) -> None:
            if type(t) is not torch.Tensor and is_traceable_wrapper_subclass(t):
                for x in inner_tensors(t):
                    self.add(x)
                return
            if t.device.type != "cpu" or t.is_sparse:
                return
            st = t.untyped_storage()
            if st.device.type != "cpu":  # a FakeTensor (DTensor's sharding propagation): no memory
                return
            if self.skip_wrappers and type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
                try:
                    st.data_ptr()
                except RuntimeError:  # "an invalid python storage": a wrapper subclass's
                    return
            key = st._cdata
            if key in self.live:
                return
            n = st.nbytes()
            with self.lock:
                self.current += n
                self.peak = max(self.peak, self.current)
                self.sizes[key] = n
                self.live[key] = weakref.ref(st, partial(self._freed, key))

        def _freed(self, key: int, _ref: object) -> None:
            with self.lock:
                if self.live.pop(key, None) is not None:
                    self.current -= self.sizes.pop(key, 0)

        @contextlib.contextmanager
        def phase(self, name: str) -> Iterator[None]:
            """Record the peak while inside in :attr:`phase_peaks` under ``name`` (the largest
            over every entry; a phase's first level is the live bytes on entry)."""
            with self.lock:
                outer, self.peak = self.peak, self.current
            try:
                yield
            finally:
                with self.lock:
                    self.phase_peaks[name] = max(self.phase_peaks.get(name, 0), self.peak)
                    self.peak = max(outer, self.peak)

        @contextlib.contextmanager
        def resizes(self) -> Iterator[None]:
            """Count ``UntypedStorage.resize_`` of tracked storages (FSDP's unsharded parameters)."""
            cls = torch.UntypedStorage
            orig = cls.resize_
            mode = self

            def resize_(st: Any, size: int) -> Any:
                out = orig(st, size)
                key = st._cdata
                with mode.lock:
                    if key in mode.sizes:
                        mode.current += int(size) - mode.sizes[key]
                        mode.sizes[key] = int(size)
                        mode.peak = max(mode.peak, mode.current)
                    elif st.device.type == "cpu":
                        mode.current += int(size)
                        mode.sizes[key] = int(size)
                        mode.live[key] = weakref.ref(st, partial(mode._freed, key))
                        mode.peak = max(mode.peak, mode.current)
                return out

            cls.resize_ = resize_  # type: ignore[method-assign,assignment]
            try:
                yield
            finally:
                cls.resize_ = orig  # type: ignore[method-assign]

        def _await_release(self, t: torch.Tensor) -> None:
            """Return once the gloo work behind the waited collective output ``t`` is gone. A
            ``ProcessGroupGloo`` worker thread runs the work, completes its future (which ends
            ``wait_tensor``) and only then drops its own references to the work, which holds
            the output tensor (``ProcessGroupGloo::runLoop``: the ``work`` local and
            ``workInProgress_``, reset after re-taking ``workMutex_``). Until it does, a tensor
            the caller has freed stays allocated, for as long as the thread is not scheduled:
            the free lands later in the forward (a CPU's load decides where) where CUDA's
            collective frees it at once. Here the ``TensorImpl`` is held once by its Python
            object and once by the dispatcher's argument stack (this runs inside the
            ``wait_tensor`` call); more means the work still holds it. Where the call came
            through the op's Python autograd kernel (``torch/_library/autograd.py``
            ``forward_no_grad``; ``redispatch_no_grad`` from torch 2.14: a wait issued by Python
            code outside a dispatch, as
            ``all_gather_single``'s ``res.wait()`` of a sequence-parallel all-gather, or a
            tensor-parallel backward's), its redispatch holds the argument on a second stack."""
            import sys

            stacks = 1
            f: Any = sys._getframe(1)
            while f is not None:
                if f.f_code.co_name in _NO_GRAD_REDISPATCH and f.f_code.co_filename.endswith(
                        ("_library/autograd.py", "_library\\autograd.py")):
                    stacks += 1
                f = f.f_back
            _poll_until(lambda: t._use_count() <= 1 + stacks,  # type: ignore[attr-defined]
                        lambda: f"a collective's output {tuple(t.shape)} still held by "
                                f"{t._use_count() - 1 - stacks} references 60 s after its wait: "  # type: ignore[attr-defined]
                                "not the gloo worker's")

        def _await_inputs(self, out: Any, args: Any, kwargs: Any, before: list[int]) -> None:
            """Complete the functional collective just issued (``out``: its outputs) and return
            once gloo's worker thread has dropped the work, which holds the call's input tensors
            (``before``: their use counts at the call): the caller's later ``wait_tensor`` finds it
            done. The check of the output at the wait (:meth:`_await_release`) let one through:
            with the four ranks of the cp 4 test on one core (``taskset -c 0``), 1 run in 12 had
            rank 0 peak 32,768 B high, the extra storage the ring's ``torch.cat`` of the rank's key
            and value (8,192 floats), a ring collective's input, which the caller had dropped and
            gloo's work still held. Waited for here, 1 to 4 collectives per rank and run still
            held their inputs after completing, and all peaks came out as without load. Only when
            a collective completes changes, not what it allocates.

            The outputs too: the wait here is not dispatched to this mode (it runs inside its
            handler), so the check of :meth:`_await_release` does not run for it, and the work
            still held an output after it in 47 of 924 collectives of the PP × TP test (its use
            count 3 or 4, 1 within 10 ms). An output the caller then dropped was freed by gloo's
            worker thread whenever it ran: in a CI run (stop 49) the two tensor-parallel ranks of
            a pipeline rank peaked 504 B apart. Each output is waited for until only its Python
            object holds it."""
            inputs = [t for t in tree_leaves((args, kwargs)) if type(t) is torch.Tensor]
            for t in tree_leaves(out):
                if type(t) is torch.Tensor:
                    torch.ops._c10d_functional.wait_tensor(t)
                    if not any(t is x for x in inputs):  # (an in-place or ``out=`` variant: the caller's)
                        _poll_until(lambda t=t: t._use_count() <= 1,  # type: ignore[attr-defined,misc]
                                    lambda t=t: f"a functional collective's output {tuple(t.shape)} still held "  # type: ignore[misc]
                                                "60 s after it completed")
            _poll_until(lambda: all(t._use_count() <= n for t, n in zip(inputs, before, strict=True)),  # type: ignore[attr-defined]
                        lambda: "a functional collective's inputs still held 60 s after it completed")

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if any(t is not torch.Tensor and is_traceable_wrapper_subclass_type(t) for t in types):
                return NotImplemented
            before = ([t._use_count() for t in tree_leaves((args, kwargs)) if type(t) is torch.Tensor]  # type: ignore[attr-defined]
                      if self.await_collectives and func.namespace == "_c10d_functional" else [])
            fast = None if self.native_half_matmuls else _HALF_MATMULS.get(func)
            out = (fast(*args, **(kwargs or {})) if fast is not None and _half_cpu(args)
                   else func(*args, **(kwargs or {})))
            if self.await_collectives and func is torch.ops._c10d_functional.wait_tensor.default:
                self._await_release(args[0])
            elif self.await_collectives and func.namespace == "_c10d_functional":
                self._await_inputs(out, args, kwargs, before)
            self.add_all(out)
            return out

        def add_all(self, out: Any) -> None:
            """:meth:`add` each tensor of an op's output (nested lists and tuples too)."""
            stack = [out]
            while stack:
                o = stack.pop()
                if isinstance(o, torch.Tensor):
                    self.add(o)
                elif isinstance(o, (list, tuple)):
                    stack.extend(o)

    from .flex import register_dense_rules

    register_dense_rules(StoragePeak)
    return StoragePeak


def _StoragePeak() -> Any:  # noqa: N802 (a class built on first use: torch imported lazily)
    return _storage_peak_mode()()


def real_dist_peaks(make_model: Any, make_inputs: Any, *, world: int, layout: str, iterations: int = 2,
                    lr: float = 1e-4, bucket_cap_mb: float = 25.0, reshard_after_forward: bool = True,
                    mixed: bool = False, lora: tuple[str, ...] = (), timeout: float = 300.0) -> list[int]:
    """Each rank's storage peak (as :func:`real_peak` measures it) of a real CPU run of the
    trace's training step on ``world`` processes with the gloo backend: ``layout`` ``fsdp2``
    (``fully_shard`` on each child of the model's largest ``ModuleList`` and the root) or
    ``ddp`` (``DistributedDataParallel``), or ``fsdp1-<ShardingStrategy>[-<BackwardPrefetch>]``
    (``FullyShardedDataParallel``
    units on those children and the root, ``use_orig_params``; ``mixed``: accelerate's bf16
    ``MixedPrecision`` and autocast around the forward and loss, on the CPU; ``lora``: peft's LoRA
    (rank 16, as the trace's default) on those module names, wrapped by peft's own
    ``fsdp_auto_wrap_policy`` as transformers does).
    ``make_model`` / ``make_inputs`` must be picklable
    (module-level functions): each process calls them. Storage resizes (FSDP2 frees and
    re-allocates its unsharded parameters that way) are counted."""
    return [r["peak"] for r in real_dist_phase_peaks(
        make_model, make_inputs, world=world, layout=layout, iterations=iterations, lr=lr, bucket_cap_mb=bucket_cap_mb,
        reshard_after_forward=reshard_after_forward, mixed=mixed, lora=lora, timeout=timeout)]


def real_dist_phase_peaks(make_model: Any, make_inputs: Any, *, world: int, layout: str, iterations: int = 2,
                          lr: float = 1e-4, bucket_cap_mb: float = 25.0, reshard_after_forward: bool = True,
                          mixed: bool = False, lora: tuple[str, ...] = (), timeout: float = 300.0) -> list[dict[str, int]]:
    """:func:`real_dist_peaks` by phase: each rank's ``{"peak", "forward", "backward",
    "optimizer"}`` storage peaks, the trace's phases (forward with the loss; backward, which
    ends with FSDP's post-backward callback; the optimizer step with ``zero_grad``), each the
    largest over the iterations."""
    args = (world, layout, make_model, make_inputs, iterations, lr, bucket_cap_mb, reshard_after_forward, mixed, lora)
    return _spawn_gloo(_dist_worker, args, world, timeout, "gloo run")


def _poll_until(done: Any, message: Any, timeout: float = 60.0) -> None:
    """Return once ``done()`` is true (polled every 0.1 ms); raise ``RuntimeError(message())``
    after ``timeout`` seconds (a real run's collective buffers held by another thread: gloo's worker)."""
    import time

    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(message())
        time.sleep(1e-4)


_C10D_COLLECTIVES = ("all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single",
                     "all_reduce", "broadcast")
"""The ``torch.distributed`` collectives FSDP1/FSDP2 call through the module (so a patch of the
module's name is what they call); ``*_single`` from torch 2.13."""


@contextlib.contextmanager
def _c10d_waits_release() -> Iterator[None]:
    """Each of :data:`_C10D_COLLECTIVES` returns only once gloo's worker thread has dropped the
    work (``ProcessGroupGloo::runLoop``, as :meth:`StoragePeak._await_release` describes for
    functional collectives). The work holds the tensors it was handed and buffers of its own
    (gloo's reduce-scatter stages its input in a copy, allocated by the calling thread), all
    freed when the thread lets the work go. Without this, what the caller frees after the
    collective stays allocated until that thread is scheduled again: on a loaded machine, into
    the next part of the step, where a CUDA collective's buffers are free at once. In the CI run
    of stop 47, FSDP2's reduce-scatter copy of one layer's gradients (164,352 B) outlived the
    layer's backward on one rank.

    The call returns once the storages of its tensor arguments are held as often as before it
    (views the work made of them count) and every storage the call allocated otherwise is freed
    (a minute at most). A call with ``async_op`` runs synchronously and hands back a completed
    work: only when a collective waits changes, not what it allocates."""
    import weakref

    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    if not dist.is_available():  # (a build without torch.distributed: nothing to wait for)
        yield
        return

    class _Done(dist.Work):
        def wait(self, timeout: Any = None) -> bool:
            return True

        def is_completed(self) -> bool:
            return True

    class _Made(TorchDispatchMode):
        """Weak references to the CPU storages the ops under it return."""

        def __init__(self) -> None:
            super().__init__()
            self.made: list[Any] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if type(t) is torch.Tensor and t.device.type == "cpu":
                    self.made.append(weakref.ref(t.untyped_storage()))
            return out

    uses = torch._C._storage_Use_Count

    def released(fn: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            asynchronous = bool(k.pop("async_op", False))
            storages = [x.untyped_storage() for x in (*a, *k.values()) if isinstance(x, torch.Tensor)]
            before = [uses(s._cdata) for s in storages]
            with _Made() as mode:
                fn(*a, **k)
            own = {s._cdata for s in storages}
            made = [r for r in mode.made if (s := r()) is not None and s._cdata not in own]
            del mode

            def held() -> bool:
                return (any(uses(s._cdata) > n for s, n in zip(storages, before, strict=True))
                        or any(r() is not None for r in made))

            _poll_until(lambda: not held(), lambda: f"the buffers of a {fn.__name__} still held 60 s after it returned")
            return _Done() if asynchronous else None

        call.__name__ = getattr(fn, "__name__", "collective")
        return call

    saved = {name: getattr(dist, name) for name in _C10D_COLLECTIVES if hasattr(dist, name)}
    for name, fn in saved.items():
        setattr(dist, name, released(fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


_NO_GRAD_REDISPATCH = ("forward_no_grad", "redispatch_no_grad")
"""The function of ``torch/_library/autograd.py`` through which a custom op called without grad
redispatches below autograd (torch 2.13's name, 2.14's)."""

_FORKSERVER_PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.pipelining",
                       "transformers", "transformers.models.llama.modeling_llama", "vramplan.models.build",
                       "vramplan.trace.pipeline_parallel", "vramplan.trace.testing")
"""What the fork server of :func:`_spawn_gloo` imports before it forks the ranks: the modules
the real runs load."""

_PRELOAD_MORE: list[str] = []


def preload_in_fork_server(*modules: str) -> None:
    """Have the fork server of :func:`fork_context` import ``modules`` too (besides
    :data:`_FORKSERVER_PRELOAD`). Read when the server starts, on its first use in this process
    (one server per process, as multiprocessing keeps it): call this before, e.g. when a test
    module is imported. A module that does not import is skipped by the server."""
    _PRELOAD_MORE.extend(m for m in modules if m not in _PRELOAD_MORE)


def fork_context() -> Any:
    """multiprocessing's ``forkserver`` context, its server preloading :data:`_FORKSERVER_PRELOAD`
    and what :func:`preload_in_fork_server` added; ``spawn`` where there is no fork server
    (Windows)."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([*_FORKSERVER_PRELOAD, *_PRELOAD_MORE])  # (read when the server starts)
    return ctx


def _exit_after(rank: int, worker: Any, *args: Any) -> None:
    """``worker(rank, *args)``, then the process ends without the interpreter's teardown: once
    the result is written, a gloo thread still joinable when C++ statics are destroyed aborted the
    process now and then ("terminate called without an active exception"), failing the run. An
    exception in the worker still propagates (traceback, non-zero exit)."""
    import os
    import sys

    worker(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


_STORE_VAR = "VRAMPLAN_GLOO_STORE"


def _init_gloo(rank: int, world: int) -> None:
    """The gloo process group of a :func:`_spawn_gloo` rank, met at the run's own file store."""
    import os

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=os.environ.get(_STORE_VAR) or "env://", rank=rank, world_size=world)


def _spawn_gloo(worker: Any, args: tuple[Any, ...], nprocs: int, timeout: float, what: str) -> list[Any]:
    """Run ``worker(rank, *args, tmp, env)`` in ``nprocs`` processes on a free local port; each
    writes its result (an integer, or JSON) to ``tmp/rank<r>``, returned in rank order.

    The processes are forked from a fork server (multiprocessing's ``forkserver`` start method)
    that imported :data:`_FORKSERVER_PRELOAD` once, instead of each importing torch and
    transformers again as spawned processes do (seconds of CPU each, which four processes on two
    cores pay four times). The server is a fresh process: no threads, no OpenMP pool, no CUDA,
    no process group, nothing of the caller's state but its modules; each rank gets the caller's
    environment as it is at the call (``env``, set by the worker). ``spawn`` where there is no
    fork server (Windows)."""
    import json
    import os
    import socket
    import tempfile
    import time

    import torch.multiprocessing as mp

    method = fork_context().get_start_method()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        # the ranks meet at a file store of their own (:func:`_init_gloo`): a free port found here can be
        # taken by another run's store or gloo socket before rank 0 binds it, and two runs that meet at one
        # port hang each other. MASTER_PORT stays for code that makes its own group (env://).
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               _STORE_VAR: "file://" + os.path.join(tmp, "store")}
        ctx = mp.start_processes(_exit_after, args=(worker, *args, tmp, env), nprocs=nprocs, join=False,
                                 start_method=method)
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"the {nprocs}-process {what} did not finish in {timeout:g} s")
        out = []
        for r in range(nprocs):
            with open(os.path.join(tmp, f"rank{r}")) as f:
                out.append(json.loads(f.read()))
    return out


def _dist_worker(rank: int, world: int, layout: str, make_model: Any, make_inputs: Any, iterations: int, lr: float,
                 bucket_cap_mb: float, reshard_after_forward: bool, mixed: bool, lora: tuple[str, ...], tmp: str,
                 env: dict[str, str]) -> None:
    import contextlib
    import json
    import os

    import torch
    import torch.distributed as dist
    from torch import nn

    os.environ.update(env)
    torch.set_num_threads(1)
    _init_gloo(rank, world)
    try:
        from .run import _flat_tensors
        from .steps import loss_of

        torch.manual_seed(0)
        tracker = _StoragePeak()
        tracker.redispatch_dtensors = True
        model = make_model()
        policy: Any = None
        if lora:
            from peft import LoraConfig, get_peft_model
            from peft.utils.other import fsdp_auto_wrap_policy

            model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=list(lora),
                                                     bias="none"))
            policy = fsdp_auto_wrap_policy(model)
        model.train()
        inputs = make_inputs()
        batch: Any = ((), inputs) if isinstance(inputs, dict) else ((inputs,), {})
        if layout == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
            lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
            for blk in max(lists, key=len) if lists else []:
                fully_shard(blk, mesh=mesh, reshard_after_forward=reshard_after_forward)
            fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
            step_model: nn.Module = model
        elif layout.startswith("fsdp1"):  # fsdp1-FULL_SHARD, fsdp1-SHARD_GRAD_OP-BACKWARD_PRE, …
            from torch.distributed.fsdp import (
                BackwardPrefetch,
                FullyShardedDataParallel,
                MixedPrecision,
                ShardingStrategy,
            )
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy

            lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
            classes = {type(b) for b in max(lists, key=len)} if lists else set()
            bf16 = torch.bfloat16
            _, strategy, prefetch = (layout.split("-") + ["", ""])[:3]  # fsdp1-STRATEGY[-PREFETCH]
            strategy = strategy or "FULL_SHARD"
            where: dict[str, Any] = {}
            if "HYBRID" in strategy:  # 2 replicas × shard groups of world / 2 (replicate outer, shard inner)
                from torch.distributed.device_mesh import init_device_mesh

                where["device_mesh"] = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
            step_model = FullyShardedDataParallel(
                model, sharding_strategy=getattr(ShardingStrategy, strategy), **where,
                auto_wrap_policy=policy or (ModuleWrapPolicy(classes) if classes else None), device_id=torch.device("cpu"),
                use_orig_params=True, limit_all_gathers=True,
                backward_prefetch=getattr(BackwardPrefetch, prefetch) if prefetch else None,
                mixed_precision=MixedPrecision(param_dtype=bf16, reduce_dtype=bf16, buffer_dtype=bf16) if mixed else None)
        else:
            from torch.nn.parallel import DistributedDataParallel

            step_model = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
        for t in [*model.parameters(), *model.buffers(), *_flat_tensors(batch)]:
            tracker.add(getattr(t, "_local_tensor", t))
        with tracker, tracker.resizes(), _c10d_waits_release():
            params = [p for p in model.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(params, lr=lr, foreach=True)
            for _ in range(iterations):
                with tracker.phase("forward"), \
                        torch.autocast("cpu", dtype=torch.bfloat16) if mixed else contextlib.nullcontext():
                    out = step_model(*batch[0], **batch[1])
                    loss = loss_of(out, batch, None)
                del out
                with tracker.phase("backward"):
                    loss.backward()
                del loss
                with tracker.phase("optimizer"):
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        with open(os.path.join(tmp, f"rank{rank}"), "w") as f:
            f.write(json.dumps({"peak": tracker.peak, **tracker.phase_peaks}))
    finally:
        dist.destroy_process_group()


def real_ppo_dist_peaks(config: dict[str, Any], workload: Any, *, world: int, iterations: int = 2,
                        timeout: float = 300.0) -> list[dict[str, int]]:
    """Each rank's storage peaks of a real PPO step (:func:`.steps.grpo_step` with a critic, on a
    transformers Llama built from ``config``, fp32, AdamW foreach) over ``world`` gloo processes,
    the policy and the critic each sharded with FSDP2 over the same mesh as verl 0.7.0's
    ``apply_fsdp2`` shards them (``fully_shard`` on each ``_no_split_modules`` layer, then the root;
    verl/utils/fsdp_utils.py L507-L537): ``{"generation", "critic", "actor"}`` (the peak within
    each part of the last step, as :func:`.ppo.parts_of` reads the trace's) and ``"peak"``."""
    args = (world, config, workload, iterations)
    return _spawn_gloo(_ppo_dist_worker, args, world, timeout, "PPO gloo run")


class _PartMarks:
    """What :func:`.steps.grpo_step` reads as its event log's length, for a real run: each read
    closes a segment and keeps the storage peak within it, so the spans the step records index
    these segments as they index the trace's events."""

    def __init__(self, tracker: Any) -> None:
        self.tracker = tracker
        self.peaks: list[int] = []

    def __len__(self) -> int:
        self.peaks.append(self.tracker.peak)
        self.tracker.peak = self.tracker.current
        return len(self.peaks)


class _RealStepSession:
    """What the RL step asks of a trace session, for a real run: nothing recorded, no decode
    extrapolation; with a tracker, its log's length marks the step's parts (:class:`_PartMarks`)."""

    extrapolate = False
    autocast = None

    def __init__(self, tracker: Any = None) -> None:
        import contextlib

        self.rec = type("Rec", (), {"log": _PartMarks(tracker) if tracker is not None else []})()
        self.dispatch = type("Dispatch", (), {"bool_reads": False})()
        self._null = contextlib.nullcontext

    def phase(self, _p: Any) -> Any:
        return self._null()

    def backward(self) -> Any:
        return self._null()

    def autocast_region(self, _on: bool) -> Any:
        return self._null()

    def label_cache(self, *_a: Any) -> None: ...

    def label_grads(self, *_a: Any) -> None: ...

    def label_optimizer(self, *_a: Any) -> None: ...


def _rl_step_parts(tracker: Any, plan: Any, iterations: int) -> dict[str, int]:
    """Run :func:`.steps.grpo_step` ``iterations`` times for real, ``tracker`` counting: the
    storage peak within each part of the last step (``plan.spans``, as :func:`.ppo.parts_of`
    reads the trace's) and ``"peak"``."""
    from .steps import grpo_step

    sess = _RealStepSession(tracker)
    for _ in range(iterations):
        grpo_step(sess, plan)  # type: ignore[arg-type]
    marks = sess.rec.log
    len(marks)  # (the segment after the last part)
    out = {name: max(marks.peaks[lo:hi]) for name, ((lo, hi),) in plan.spans.items()}
    out["peak"] = max(marks.peaks)
    return out


def _ppo_dist_worker(rank: int, world: int, config: dict[str, Any], w: Any, iterations: int, tmp: str,
                     env: dict[str, str]) -> None:
    import json
    import os

    import torch
    import torch.distributed as dist

    os.environ.update(env)
    torch.set_num_threads(1)
    _init_gloo(rank, world)
    try:
        import transformers
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.utils._python_dispatch import _disable_current_modes

        from ..workload import Reference
        from . import ppo
        from .steps import StepPlan

        gloo_reduce_scatter = dist.reduce_scatter_single

        def reduce_scatter_single(*a: Any, **k: Any) -> Any:
            # gloo reduce-scatters as an all-reduce of an input-sized copy of the input, then a
            # split (ProcessGroupGloo ``_reduce_scatter_base``: a [numel] buffer seen as the split's
            # storage); NCCL's reduce-scatter allocates nothing: left out of the count
            with _disable_current_modes():
                return gloo_reduce_scatter(*a, **k)

        dist.reduce_scatter_single = reduce_scatter_single  # (FSDP2's DefaultReduceScatter calls it)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
        critic = ppo.value_copy(model, w, trained=True)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        layers = set(model._no_split_modules)
        for m in (model, critic):  # (verl passes `reshard_after_forward` to every call: the root's too)
            for sub in [s for s in m.modules() if type(s).__name__ in layers]:
                fully_shard(sub, mesh=mesh, reshard_after_forward=True)
            fully_shard(m, mesh=mesh, reshard_after_forward=True)
        model.train()
        tracker = _StoragePeak()
        tracker.redispatch_dtensors = True
        for t in [*model.parameters(), *model.buffers(), *critic.parameters(), *critic.buffers()]:
            tracker.add(getattr(t, "_local_tensor", t))
        with tracker, tracker.resizes(), _c10d_waits_release():
            params = [p for p in model.parameters() if p.requires_grad]
            plan = StepPlan(model=model, batch=((), {}), optimizer=torch.optim.AdamW(params, foreach=True),
                            grad_accum=w.grad_accum, trainable=params, compute_dtype=torch.float32,
                            objective=w.objective, reference=None, reference_source=Reference.NONE,
                            prompt=w.prompt, micro_batch=w.batch, completion=w.completion, critic=critic,
                            critic_optimizer=torch.optim.AdamW(list(critic.parameters()), foreach=True))
            out = _rl_step_parts(tracker, plan, iterations)
        with open(os.path.join(tmp, f"rank{rank}"), "w") as f:
            f.write(json.dumps(out))
    finally:
        dist.destroy_process_group()


def real_grpo_fsdp1_peaks(config: dict[str, Any], workload: Any, *, world: int, iterations: int = 2,
                          layout: str = "fsdp1", timeout: float = 300.0) -> list[dict[str, int]]:
    """Each rank's storage peaks of a real GRPO step (:func:`.steps.grpo_step`, no reference, on a
    transformers Llama built from ``config``, fp32, AdamW foreach) over ``world`` gloo processes,
    the policy wrapped with FSDP1 as accelerate's plugin wraps it (``FullyShardedDataParallel``
    units on the ``_no_split_modules`` layers and the root, FULL_SHARD, ``use_orig_params=True``,
    ``limit_all_gathers``, BACKWARD_PRE; trl 1.16.0 ``models/utils.py:292-312`` wraps a
    reference alike): ``{"generation", "actor"}`` (the peak within each part of the last step)
    and ``"peak"``. The sibling of :func:`real_ppo_dist_peaks` (FSDP2). ``layout="ddp"``: the
    policy wrapped with ``DistributedDataParallel`` instead (accelerate's default DDP arguments:
    25 MiB buckets), its gradients all-reduced at each micro-batch's backward as the trace's step
    runs them. ``layout="fsdp2"``: ``fully_shard`` on each ``_no_split_modules`` layer and the root
    (accelerate's FSDP2 plugin, ``reshard_after_forward=True``; gloo's reduce-scatter input copy left
    out, as :func:`real_ppo_dist_peaks` leaves it out); ``"fsdp2-zero2"``: the same with
    ``reshard_after_forward=False``, the plugin's too (ZeRO-2); ``"fsdp1-zero2"``: FSDP1 with
    ``SHARD_GRAD_OP``, the plugin's too.

    A workload with ``reference=model`` (GRPO with ``beta > 0``): a reference copy of the model
    (the same weights, ``requires_grad`` left on as ``from_pretrained`` leaves it) prepared by TRL's
    own ``trl.models.prepare_fsdp`` (trl 1.16.0 models/utils.py:292-342) given accelerate's own
    ``FullyShardedDataParallelPlugin`` (``fsdp_version`` 1 or 2, ``TRANSFORMER_BASED_WRAP``,
    ``use_orig_params=True``) on a stand-in for the ``Accelerator`` (its ``state.fsdp_plugin``,
    ``device`` and device mesh: the attributes prepare_fsdp reads); the policy is wrapped by this
    helper as above.

    ``objective=dpo``: a DPO step instead (:func:`.steps.train_step`, ``grad_accum`` micro-batches of
    ``batch`` pairs, random token ids, every position scored); returns ``{"peak", "adam_steps"}``,
    the storage peak over the ``iterations`` steps."""
    if layout not in ("fsdp1", "fsdp1-zero2", "fsdp2", "fsdp2-zero2", "ddp"):
        raise ValueError(f"layout {layout!r}: fsdp1, fsdp1-zero2, fsdp2, fsdp2-zero2 or ddp")
    args = (world, config, workload, iterations, layout)
    return _spawn_gloo(_grpo_fsdp1_worker, args, world, timeout, "GRPO FSDP1 gloo run")


def _grpo_fsdp1_worker(rank: int, world: int, config: dict[str, Any], w: Any, iterations: int, layout: str,
                       tmp: str, env: dict[str, str]) -> None:
    import json
    import os

    import torch
    import torch.distributed as dist

    os.environ.update(env)
    torch.set_num_threads(1)
    _init_gloo(rank, world)
    try:
        import transformers
        from torch.distributed.fsdp import (
            BackwardPrefetch,
            FullyShardedDataParallel,
            ShardingStrategy,
        )
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        from ..workload import Objective, Reference
        from .steps import StepPlan

        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
        ref: Any = None
        if w.reference_source is Reference.MODEL:
            import copy

            ref = copy.deepcopy(model)  # (TRL loads it afresh: the same weights and dtype)
        classes = {type(m) for m in model.modules() if type(m).__name__ in set(model._no_split_modules)}
        mesh = None
        wrapped: Any
        if layout == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            wrapped = DistributedDataParallel(model)
        elif layout.startswith("fsdp2"):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            _gloo_reduce_scatter_uncounted()
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
            reshard = layout == "fsdp2"
            for sub in [m for m in model.modules() if type(m) in classes]:
                fully_shard(sub, mesh=mesh, reshard_after_forward=reshard)
            wrapped = fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        else:
            strategy = ShardingStrategy.SHARD_GRAD_OP if layout == "fsdp1-zero2" else ShardingStrategy.FULL_SHARD
            wrapped = FullyShardedDataParallel(
                model, sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy(classes),
                device_id=torch.device("cpu"), use_orig_params=True, limit_all_gathers=True,
                backward_prefetch=BackwardPrefetch.BACKWARD_PRE)
        wrapped.train()
        if ref is not None:
            ref = _trl_prepared_reference(ref, layout, mesh)
        batch: dict[str, Any] = {}
        dpo = w.objective is Objective.DPO
        if dpo:  # (the collator's batch: chosen and rejected sequences, every position a completion token)
            from .preference import preference_inputs

            ids = torch.randint(0, config["vocab_size"], (w.sequences, w.seq), generator=torch.Generator().manual_seed(1))
            batch = preference_inputs({"input_ids": ids}, w)
        tracker = _StoragePeak()
        tracker.redispatch_dtensors = True
        held = [*model.parameters(), *model.buffers(), *batch.values()]
        if ref is not None:
            held += [*ref.parameters(), *ref.buffers()]
        for t in held:
            tracker.add(getattr(t, "_local_tensor", t))
        with tracker, tracker.resizes(), _c10d_waits_release():
            params = [p for p in wrapped.parameters() if p.requires_grad]
            plan = StepPlan(model=wrapped, batch=((), batch), optimizer=torch.optim.AdamW(params, foreach=True),
                            grad_accum=w.grad_accum, trainable=params, compute_dtype=torch.float32,
                            objective=w.objective, reference=ref, reference_source=w.reference_source,
                            prompt=w.prompt, micro_batch=w.batch, completion=w.completion)
            if dpo:
                from .steps import train_step

                for _ in range(iterations):
                    train_step(_RealStepSession(tracker), plan)  # type: ignore[arg-type]
                out = {"peak": tracker.peak}
            else:
                out = _rl_step_parts(tracker, plan, iterations)
        # (AdamW's ``step`` counters: one 4-byte scalar per parameter with elements on this rank)
        out["adam_steps"] = sum(1 for st in plan.optimizer.state.values() if "step" in st)
        with open(os.path.join(tmp, f"rank{rank}"), "w") as f:
            f.write(json.dumps(out))
    finally:
        dist.destroy_process_group()


def _gloo_reduce_scatter_uncounted() -> None:
    """gloo reduce-scatters as an all-reduce of an input-sized copy of the input, then a split
    (ProcessGroupGloo ``_reduce_scatter_base``); NCCL's reduce-scatter allocates nothing: the copy
    is left out of the count (FSDP2's DefaultReduceScatter calls ``reduce_scatter_single``)."""
    import torch.distributed as dist
    from torch.utils._python_dispatch import _disable_current_modes

    gloo_reduce_scatter = dist.reduce_scatter_single

    def reduce_scatter_single(*a: Any, **k: Any) -> Any:
        with _disable_current_modes():
            return gloo_reduce_scatter(*a, **k)

    dist.reduce_scatter_single = reduce_scatter_single


def _trl_prepared_reference(ref: Any, layout: str, mesh: Any) -> Any:
    """``ref`` prepared by TRL's own ``prepare_fsdp`` (trl 1.16.0 models/utils.py:292-342) under
    accelerate's own FSDP plugin (the version of ``layout``, transformer-based wrapping on the
    model's ``_no_split_modules``, ``use_orig_params=True`` as HF Trainer sets it), on a stand-in
    for the ``Accelerator`` that has what prepare_fsdp reads: ``state.fsdp_plugin``, ``device``,
    ``torch_device_mesh`` and ``parallelism_config.fsdp_dim_names``. DDP: TRL's
    ``prepare_model(evaluation_mode=True)`` leaves it unwrapped (returned as is, in eval mode)."""
    from types import SimpleNamespace

    import torch

    if layout == "ddp":
        return ref.eval()
    from accelerate.utils import FullyShardedDataParallelPlugin
    from trl.models import prepare_fsdp

    two = layout.startswith("fsdp2")
    # (FSDP1: accelerate 1.16 fills `sharding_strategy` from FSDP_SHARDING_STRATEGY, default FULL_SHARD, even when
    # `reshard_after_forward` is given, and prepare_fsdp takes `sharding_strategy or reshard_after_forward`, as
    # accelerate's own prepare does for the policy (accelerator.py:1919): the strategy is given as `sharding_strategy`,
    # what `accelerate launch` exports from `fsdp_sharding_strategy`)
    kw = {"reshard_after_forward": layout == "fsdp2"} if two else \
        {"sharding_strategy": "SHARD_GRAD_OP" if layout == "fsdp1-zero2" else "FULL_SHARD"}
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2 if two else 1, auto_wrap_policy="transformer_based_wrap",
                                            use_orig_params=True, **kw)
    acc = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), device=torch.device("cpu"),
                          torch_device_mesh=mesh, parallelism_config=SimpleNamespace(fsdp_dim_names=("dp",)))
    return prepare_fsdp(ref, acc)


def real_tp_generate_peaks(model_name: str, *, tp: int, prompt: int, new_tokens: int,
                           timeout: float = 300.0) -> list[list[int]]:
    """Each rank's storage peak per forward (the prefill, then each decode step; as
    :func:`real_peak` measures it, the live bytes at the forward's start included) of a real CPU
    run of the trace's greedy generation (:func:`.steps.generate_step`: a transformers
    ``DynamicCache``, the prefill with ``logits_to_keep=1``, the last logits all-gathered) on
    ``tp`` gloo processes: the catalog model ``model_name`` shrunk (:func:`tiny_spec`), bf16,
    sharded by :func:`.tensor_parallel.apply_tensor_parallel` without sequence parallelism.

    Three things differ from a bare measurement, all for memory that a CUDA run does not hold:
    functional collectives' ``AsyncCollectiveTensor`` wrappers are not counted (their storage
    has the wrapped tensor's size and no memory); DTensor's sharding propagation runs inside
    :func:`.dist.dtensor_metadata_unrecorded`, which breaks the frame ↔ traceback cycle torch
    2.13 leaves per linear (otherwise the forward's activations stay alive until the next
    garbage collection, and the figures depend on when it runs); and each collective's wait
    returns only once gloo's worker thread has dropped the work, which holds the output
    (otherwise a freed all-reduce output stays allocated until that thread is scheduled again:
    on a loaded machine, into the next allocations)."""
    return _spawn_gloo(_tp_generate_worker, (tp, model_name, prompt, new_tokens), tp, timeout,
                       "tensor-parallel generation")


def _tp_generate_worker(rank: int, tp: int, model_name: str, prompt: int, new_tokens: int, tmp: str,
                        env: dict[str, str]) -> None:
    import json
    import os

    import torch
    import torch.distributed as dist

    os.environ.update(env)
    torch.set_num_threads(1)
    _init_gloo(rank, tp)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from transformers import DynamicCache

        from ..models.build import build_model, quiet
        from .dist import dtensor_metadata_unrecorded
        from .steps import _last_logits
        from .tensor_parallel import apply_tensor_parallel

        spec = tiny_spec(model_name)
        torch.manual_seed(0)
        with quiet():
            model = build_model(spec, task="generate", device="cpu", dtype=torch.bfloat16)
        apply_tensor_parallel(model, init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",)), sp=False)
        ids = torch.randint(0, spec.vocab, (1, prompt))
        tracker = _StoragePeak()
        tracker.redispatch_dtensors = True
        tracker.skip_wrappers = True
        tracker.await_collectives = True
        for t in [*model.parameters(), *model.buffers(), ids]:
            tracker.add(getattr(t, "_local_tensor", t))
        peaks = []
        with tracker, dtensor_metadata_unrecorded(), torch.inference_mode():
            cache = DynamicCache(config=model.config)  # type: ignore[arg-type]
            nxt = ids
            for step in range(new_tokens):
                tracker.peak = tracker.current
                start = prompt + step - 1 if step else 0
                pos = torch.arange(start, prompt + step)
                kw: dict[str, Any] = {} if step else {"logits_to_keep": 1}
                out = model(input_ids=nxt, use_cache=True, cache_position=pos, past_key_values=cache, **kw)
                nxt = _last_logits(out).argmax(-1)
                del out, pos
                peaks.append(tracker.peak)
            del cache, nxt
        with open(os.path.join(tmp, f"rank{rank}"), "w") as f:
            f.write(json.dumps(peaks))
    finally:
        dist.destroy_process_group()


def real_lora_tp_peaks(model: str | ModelSpec, *, tp: int, batch: int, seq: int, targets: tuple[str, ...],
                       rank_r: int = 16, timeout: float = 300.0) -> list[dict[str, int]]:
    """Each rank's figures of a real CPU run of a LoRA training step under transformers' tensor
    parallelism on ``tp`` gloo processes, as a transformers + peft user runs it: ``model`` (a
    catalog name, shrunk by :func:`tiny_spec`, or a spec; fp32) saved and loaded back with
    ``from_pretrained(distributed_config=DistributedConfig(tp_size=tp))``, peft's
    ``get_peft_model`` (LoRA rank ``rank_r`` on ``targets``, as the trace's defaults), AdamW
    (``foreach=True``, CUDA's default) over the adapters in one parameter group per device mesh
    (what transformers' ``Trainer.create_optimizer`` does when they mix), two steps of the trace's
    training step. Per rank: ``peak`` (storage peak, as :func:`real_peak` measures it, without
    functional collectives' wrapper storages, see :func:`real_tp_generate_peaks`), and at the
    first optimizer step ``weights`` (local parameter storages), ``gradients`` (local
    gradients) and ``optimizer`` (local AdamW states; the ``step`` counters are host scalars on a
    GPU, left out).

    One thing differs from a bare CPU run, for memory a GPU run does not hold: on the CPU,
    ``from_pretrained`` leaves a column-sharded weight's local shard as a view of the whole
    checkpoint tensor (a slice along dim 0 needs no copy), whose storage is the whole weight; a
    GPU run copies each rank's shard to the device. The shards are copied here as that transfer
    would.

    And each functional collective completes where it is issued, and its wait returns only once
    gloo's worker thread has dropped the work (:attr:`StoragePeak.await_collectives`, as in
    :func:`real_tp_generate_peaks`). Without it, the all-reduces of DTensor's redistributes
    (``Partial`` → ``Replicate``: the vocabulary-parallel embedding, the row-parallel
    projections, the column-parallel input gradients) left outputs the caller had dropped held
    by the work, freed later on that thread whenever it ran. A debug copy of the tracker that
    logged frees off the main thread saw them in 12 of 23 runs (1 of 1 alone, 11 of 22 beside
    two or three busy-loop processes on a 2-core machine): outputs of 16,384 B (a rank's
    2 × 32 × 64 fp32 hidden states in the test) and 4,096 B. Holding the last k all-reduce
    outputs alive (a worker k behind) raised both ranks' peak by 16,384 B for k = 1 and
    86,016 B for k = 6: a CI run under load had rank 0 peak 98,304 B (6 × 16,384 B) high.
    With the waits: 0 such frees in 22 loaded runs, the peaks unchanged (946,584 B).
    """
    import tempfile

    import torch

    from ..models.build import build_model, quiet

    spec = tiny_spec(model) if isinstance(model, str) else model
    with tempfile.TemporaryDirectory() as saved:
        with quiet():
            built: Any = build_model(spec, task="train", device="cpu", dtype=torch.float32)
            built.save_pretrained(saved)
        args = (tp, saved, spec.vocab, batch, seq, targets, rank_r)
        return _spawn_gloo(_lora_tp_worker, args, tp, timeout, "LoRA tensor-parallel run")


def real_lora_tp_fsdp_failures(model_name: str, *, dp: int, tp: int, batch: int, seq: int,
                               targets: tuple[str, ...], rank_r: int = 16,
                               timeout: float = 300.0) -> list[dict[str, str]]:
    """What the Hugging Face stacks do with LoRA × TP × FSDP2 on ``dp × tp`` gloo processes (the
    catalog model ``model_name`` shrunk, fp32, saved and loaded back), per rank, as
    ``{"accelerate": ..., "transformers": ...}``, each the error the step raised ("" if it ran):

    - ``accelerate``: the load of accelerate's ND-parallel example
      (``examples/torch_native_parallelism/nd_parallel.py``): ``from_pretrained(tp_size=tp,
      tp_plan="auto", device_mesh=<the (dp_shard, tp) mesh>)``. (Accelerate's FSDP2 itself needs an
      accelerator: on the CPU its state is MULTI_CPU, which ParallelismConfig refuses.)
    - ``transformers``: ``from_pretrained(distributed_config=DistributedConfig(tp_size=tp,
      fsdp_size=dp))`` (TP, then FSDP2, at load), ``get_peft_model`` (LoRA rank ``rank_r`` on
      ``targets``), one forward and backward.

    Checks that the trace's refusal of LoRA under TP with ``dp`` (``trace.run``) still names
    what the real stacks do."""
    import tempfile

    import torch

    from ..models.build import build_model, quiet

    spec = tiny_spec(model_name)
    with tempfile.TemporaryDirectory() as saved:
        with quiet():
            built: Any = build_model(spec, task="train", device="cpu", dtype=torch.float32)
            built.save_pretrained(saved)
        args = (dp, tp, saved, spec.vocab, batch, seq, targets, rank_r)
        return _spawn_gloo(_lora_tp_fsdp_worker, args, dp * tp, timeout, "LoRA tensor-parallel FSDP2 run")


def real_lora_pp_tp_outcomes(model_name: str, *, pp: int, tp: int, batch: int, seq: int, targets: tuple[str, ...],
                             rank_r: int = 16, timeout: float = 300.0) -> list[dict[str, Any]]:
    """What transformers' own pipeline × tensor parallelism does with a LoRA training step on
    ``pp × tp`` gloo processes (the catalog model ``model_name`` shrunk, fp32, saved and loaded
    back): ``from_pretrained(distributed_config=DistributedConfig(pp_size=pp, tp_size=tp))``,
    peft's ``get_peft_model`` (LoRA rank ``rank_r`` on ``targets``), one forward with labels and a
    backward of the cross-entropy of the logits it returns. Per rank (transformers' mesh order,
    rank = pp rank × tp + tp rank): ``load`` (the error ``from_pretrained`` raised, "" if it loaded;
    nothing else is tried then), ``loss`` (whether the output carries one), ``backward`` (the
    error the backward raised, "" if it ran), ``adapters`` (trainable tensors on the rank) and
    ``with_grad`` (how many got a gradient).

    Checks that the trace's refusal of LoRA under ``pp × tp`` (``trace.run``) names what the
    Hugging Face stack does."""
    import tempfile

    import torch

    from ..models.build import build_model, quiet

    spec = tiny_spec(model_name)
    with tempfile.TemporaryDirectory() as saved:
        with quiet():
            built: Any = build_model(spec, task="train", device="cpu", dtype=torch.float32)
            built.save_pretrained(saved)
        args = (pp, tp, saved, spec.vocab, batch, seq, targets, rank_r)
        return _spawn_gloo(_lora_pp_tp_worker, args, pp * tp, timeout, "LoRA pipeline × tensor-parallel run")


def _error_line(e: BaseException) -> str:
    """An exception as one line: its type and its message's first line (what the outcome runs report)."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _lora_pp_tp_worker(rank: int, pp: int, tp: int, saved: str, vocab: int, batch: int, seq: int,
                       targets: tuple[str, ...], rank_r: int, tmp: str, env: dict[str, str]) -> None:
    import json
    import os

    import torch
    import torch.distributed as dist

    world = pp * tp
    os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    _init_gloo(rank, world)
    try:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM
        from transformers.distributed import DistributedConfig

        from ..models.build import quiet

        out: dict[str, Any] = {"load": "", "loss": False, "backward": "", "adapters": 0, "with_grad": 0}
        with quiet():
            try:
                model: Any = AutoModelForCausalLM.from_pretrained(
                    saved, dtype=torch.float32, distributed_config=DistributedConfig(pp_size=pp, tp_size=tp))
            except Exception as e:
                out["load"] = _error_line(e)
                with open(os.path.join(tmp, f"rank{rank}"), "w") as f:
                    f.write(json.dumps(out))
                return
            model = get_peft_model(model, LoraConfig(r=rank_r, lora_alpha=2 * rank_r, lora_dropout=0.0,
                                                     target_modules=list(targets), bias="none"))
            model.train()
            torch.manual_seed(0)
            ids = torch.randint(0, vocab, (batch, seq))
            res = model(input_ids=ids, labels=ids)
            out["loss"] = getattr(res, "loss", None) is not None
            try:
                loss = res.loss if out["loss"] else torch.nn.functional.cross_entropy(
                    res.logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
                loss.backward()
            except Exception as e:
                out["backward"] = _error_line(e)
        adapters = [p for p in model.parameters() if p.requires_grad]
        out["adapters"] = len(adapters)
        out["with_grad"] = sum(p.grad is not None for p in adapters)
        with open(os.path.join(tmp, f"rank{rank}"), "w") as f:
            f.write(json.dumps(out))
    finally:
        dist.destroy_process_group()


def _lora_tp_fsdp_worker(rank: int, dp: int, tp: int, saved: str, vocab: int, batch: int, seq: int,
                         targets: tuple[str, ...], rank_r: int, tmp: str, env: dict[str, str]) -> None:
    import json
    import os

    import torch
    import torch.distributed as dist

    world = dp * tp
    os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    _init_gloo(rank, world)
    try:
        from peft import LoraConfig, get_peft_model
        from torch.distributed.device_mesh import init_device_mesh
        from transformers import AutoModelForCausalLM
        from transformers.distributed import DistributedConfig

        from ..models.build import quiet

        out = {"accelerate": "", "transformers": ""}
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp_shard", "tp"))
        with quiet():
            try:
                AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32, tp_size=tp, tp_plan="auto",
                                                     device_mesh=mesh)
            except Exception as e:
                out["accelerate"] = _error_line(e)
            try:
                model: Any = AutoModelForCausalLM.from_pretrained(
                    saved, dtype=torch.float32, distributed_config=DistributedConfig(tp_size=tp, fsdp_size=dp))
                model = get_peft_model(model, LoraConfig(r=rank_r, lora_alpha=2 * rank_r, lora_dropout=0.0,
                                                         target_modules=list(targets), bias="none"))
                model.train()
                ids = torch.randint(0, vocab, (batch, seq))
                model(input_ids=ids, labels=ids).loss.backward()
            except Exception as e:
                out["transformers"] = _error_line(e)
        with open(os.path.join(tmp, f"rank{rank}"), "w") as f:
            f.write(json.dumps(out))
    finally:
        dist.destroy_process_group()


def _lora_tp_worker(rank: int, tp: int, saved: str, vocab: int, batch: int, seq: int, targets: tuple[str, ...],
                    rank_r: int, tmp: str, env: dict[str, str]) -> None:
    import json
    import os

    import torch
    import torch.distributed as dist

    os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(tp), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    _init_gloo(rank, tp)
    try:
        from peft import LoraConfig, get_peft_model
        from torch.distributed.tensor import DTensor
        from transformers import AutoModelForCausalLM
        from transformers.distributed import DistributedConfig

        from ..models.build import quiet
        from .dist import dtensor_metadata_unrecorded
        from .steps import loss_of

        def local(t: torch.Tensor) -> torch.Tensor:
            return t._local_tensor if isinstance(t, DTensor) else t

        def nbytes(ts: Any) -> int:
            seen = {local(t).untyped_storage()._cdata: local(t).untyped_storage().nbytes() for t in ts}
            return sum(seen.values())

        torch.manual_seed(0)
        with quiet():
            model: Any = AutoModelForCausalLM.from_pretrained(
                saved, distributed_config=DistributedConfig(tp_size=tp), dtype=torch.float32)
            model = get_peft_model(model, LoraConfig(r=rank_r, lora_alpha=2 * rank_r, lora_dropout=0.0,
                                                     target_modules=list(targets), bias="none"))
        with torch.no_grad():  # (see the docstring: the device copy of each shard)
            for mod in model.modules():
                for p in mod.parameters(recurse=False):
                    t = local(p)
                    if t.untyped_storage().nbytes() > t.numel() * t.element_size():
                        if isinstance(p, DTensor):
                            p._local_tensor = t.clone()
                        else:
                            p.data = t.clone()
        model.train()
        ids = torch.randint(0, vocab, (batch, seq))
        batch_kw: Any = ((), {"input_ids": ids, "labels": ids.clone()})
        tracker = _StoragePeak()
        tracker.redispatch_dtensors = True
        tracker.skip_wrappers = True
        tracker.await_collectives = True  # (see real_lora_tp_peaks: gloo's worker thread)
        for t in [*model.parameters(), *model.buffers(), ids, batch_kw[1]["labels"]]:
            tracker.add(local(t))
        parts: dict[str, int] = {}
        with tracker, dtensor_metadata_unrecorded():
            params = [p for p in model.parameters() if p.requires_grad]
            groups: dict[Any, list[Any]] = {}
            for p in params:  # transformers' Trainer.create_optimizer: one group per device mesh
                groups.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
            opt = torch.optim.AdamW([{"params": g} for g in groups.values()], lr=1e-4, foreach=True)
            for it in range(2):
                out = model(*batch_kw[0], **batch_kw[1])
                loss = loss_of(out, batch_kw, None)
                del out
                loss.backward()
                del loss
                if it == 0:
                    parts["weights"] = nbytes(list(model.parameters()))
                    parts["gradients"] = nbytes([p.grad for p in params if p.grad is not None])
                opt.step()
                if it == 0:
                    parts["optimizer"] = nbytes([v for st in opt.state.values() for k, v in st.items()
                                                 if k != "step" and isinstance(v, torch.Tensor)])
                opt.zero_grad(set_to_none=True)
        with open(os.path.join(tmp, f"rank{rank}"), "w") as f:
            f.write(json.dumps({"peak": tracker.peak, **parts}))
    finally:
        dist.destroy_process_group()


def forward_peaks(events: Any) -> list[int]:
    """Peak live bytes of each phase a trace marks (a generation: the prefill, then each decode
    step), the bytes live when it starts included: what :func:`real_tp_generate_peaks`
    measures per forward."""
    live: dict[int, int] = {}
    cur, out = 0, []
    for row in events.rows():
        action = row["action"]
        if action == "mark":
            if row["op"] in ("prefill", "decode"):
                out.append(cur)
        elif action == "alloc":
            live[row["id"]] = row["size"]
            cur += row["size"]
            if out:
                out[-1] = max(out[-1], cur)
        elif action in ("free", "free_deferred"):
            cur -= live.pop(row["id"], 0)
    return out


def block_model(width: int = 128, blocks: int = 3) -> Any:
    """A small residual MLP (input linear, ``blocks`` up/GELU/down blocks in a ``ModuleList``,
    output linear): the model of the real-run agreement checks for FSDP2 and DDP (no attention,
    so no kernel choice differs between the CPU run and the emulated GPU)."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(width, 4 * width)
            self.down = nn.Linear(4 * width, width)

        def forward(self, x: Any) -> Any:
            return x + self.down(nn.functional.gelu(self.up(x)))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(width, width)
            self.layers = nn.ModuleList(Block() for _ in range(blocks))
            self.out = nn.Linear(width, width)

        def forward(self, x: Any) -> Any:
            h = self.inp(x)
            for blk in self.layers:
                h = blk(h)
            return self.out(h)

    return Net()


def block_inputs(width: int = 128, batch: int = 8, rows: int = 128) -> Any:
    import torch

    return torch.randn(batch, rows, width)


def dist_agreement(world: int = 2) -> list[tuple[str, int, int, int]]:
    """(layout, rank, real storage peak, traced peak) for FSDP2 (ZeRO-3) and DDP over ``world``
    gloo processes, on :func:`block_model` (fp32, no CUDA workspaces: a CPU run has none)."""
    from ..workload import Precision, Task, Workload
    from .run import TraceOptions, trace_model

    out = []
    for layout, parallel in (("fsdp2", {"dp": world, "zero": 3}), ("ddp", {"dp": world})):
        real = real_dist_peaks(block_model, block_inputs, world=world, layout=layout, bucket_cap_mb=0.25)
        w = Workload(task=Task.TRAIN, precision=Precision.FP32).replace(**parallel)
        for rank, peak in enumerate(real):
            opts = TraceOptions(workspaces=False, count_flops=False, rank=rank)
            traced = trace_model(block_model, block_inputs(), workload=w, options=opts).peak_allocated
            out.append((layout, rank, peak, traced))
    return out


def real_pipeline_peaks(model_name: str, *, layers: int, pp: int, schedule: str, microbatches: int, batch: int,
                        seq: int, iterations: int = 2, dp: int = 1, mixed: bool = False, tp: int = 1,
                        sp: bool = False, cp: int = 1, training: bool = True, lora: tuple[str, ...] = (),
                        timeout: float = 300.0) -> list[int]:
    """Each rank's storage peak (as :func:`real_peak` measures it) of a real CPU run of
    ``torch.distributed.pipelining``'s ``schedule`` over ``pp × dp`` gloo processes: the catalog model
    ``model_name`` shrunk to ``layers`` layers (:func:`tiny_spec`), fp32, eager attention, cut
    and stepped as :mod:`.pipeline_parallel` does (AdamW, foreach), real weights and values.

    ``dp > 1``: torchtitan's layout (a ``(pp, dp)`` device mesh; each stage's part sharded with
    FSDP2 over ``dp`` as ``apply_fsdp_to_decoder`` shards it: the embeddings, the final norm with the
    head, each block, the part; ``reshard_after_forward=False``, torchtitan's default under pp;
    ``mixed``: ``MixedPrecisionPolicy(bfloat16, reduce float32, cast_forward_inputs=False)``), the
    stage on the mesh's ``pp`` group.

    ``tp > 1``: torchtitan's ``(pp[, dp], tp)`` mesh, each stage's part tensor-parallelised on
    ``tp`` first (:func:`.pipeline_parallel.tensor_parallelise`: torch's ``parallelize_module``
    with the trace's plan; ``sp``: sequence parallelism), the stages handing on the TP-local
    hidden states, the schedule stepped under ``loss_parallel`` (the last stage's cross-entropy
    of vocabulary-sharded logits; under ``sp`` with the whole-sequence masks the trace uses).
    Measured as the tensor-parallel gloo runs are (:func:`real_tp_generate_peaks`: functional
    collectives' wrapper storages left out, each wait until gloo's worker dropped the work,
    DTensor's sharding propagation outside the measurement's reference cycle).
    ``cp > 1``: torchtitan's ``(pp, cp)`` mesh, SDPA attention, each stage on its rank's ``seq / cp``
    tokens, the schedule stepped under torch's ring attention on ``cp``
    (:func:`.context_parallel.ring_dispatcher`; fp32, ``dp = tp = 1``). The ring's handlers are the
    CUDA kernels' ops, which have no CPU kernel: SDPA goes through the trace's own choice
    (:func:`.sdpa.run_sdpa`, the memory-efficient kernel for fp32), whose forward and backward get
    CPU stand-ins (:func:`_efficient_attention_on_cpu`): outputs with the meta kernels' shapes and
    strides, values from the math; what a stand-in computes inside is not counted (a dispatch mode
    does not see it), as the trace sees only the kernel's outputs.
    ``training=False``: one-pass inference as :func:`.pipeline_parallel.make_runner` runs it, a
    forward-only step of one micro-batch of ``batch`` (``ScheduleGPipe`` without a loss,
    ``step`` without targets under ``torch.no_grad()``; ``schedule`` and ``microbatches`` unused),
    the model in eval mode without gradients, no optimizer; under ``tp`` the last stage's logits
    stay vocabulary-sharded (the head's ``Shard(-1)`` output, torchtitan's loss-parallel layout).
    ``lora``: peft's LoRA (rank 16, alpha 32, no dropout: the trace's defaults) on those module names,
    ``get_peft_model`` on the rank's model parts after the split (and after TP), as the trace
    applies it: the base frozen, AdamW over the adapters.
    Peaks in global rank order (rank = ((pp rank × dp + dp rank) × cp + cp rank) × tp + tp rank)."""
    if not training:
        schedule, microbatches = "GPipe", 1
    args = (pp, model_name, layers, schedule, microbatches, batch, seq, iterations, dp, mixed, tp, sp, cp, training,
            lora)
    return _spawn_gloo(_pp_worker, args, pp * dp * tp * cp, timeout, "pipeline run")


def _efficient_attention_on_cpu() -> Any:
    """CPU kernels standing in for ``aten::_scaled_dot_product_efficient_attention`` and its
    backward (CUDA-only ops): each output allocated with the shape and strides of torch's meta
    kernel (``torch/_meta_registrations.py``), filled from the math. Returns the library (keep it)."""
    import math

    import torch

    aten = torch.ops.aten
    lib = torch.library.Library("aten", "IMPL")

    def meta(t: Any) -> Any:
        return t.to("meta") if isinstance(t, torch.Tensor) else t

    def like(m: Any) -> Any:
        return torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device="cpu")

    def scores(q: Any, k: Any, is_causal: bool, scale: Any) -> tuple[Any, float]:
        c = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
        s = (q @ k.transpose(-2, -1)) * c
        if is_causal:
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
        return s, c

    def attend(q: Any, k: Any, v: Any, is_causal: bool, scale: Any) -> tuple[Any, Any]:
        s, _ = scores(q, k, is_causal, scale)
        return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)

    def forward(q: Any, k: Any, v: Any, bias: Any, lse: bool, dropout_p: float = 0.0, is_causal: bool = False,
                *, scale: Any = None) -> Any:
        outs = [like(m) for m in aten._scaled_dot_product_efficient_attention.default(
            meta(q), meta(k), meta(v), meta(bias), lse, dropout_p, is_causal, scale=scale)]
        out, logsumexp = attend(q, k, v, is_causal, scale)
        outs[0].copy_(out)
        if lse:
            outs[1][..., :logsumexp.shape[-1]].copy_(logsumexp)
        return tuple(outs)

    def backward(grad: Any, q: Any, k: Any, v: Any, bias: Any, out: Any, lse: Any, seed: Any, offset: Any,
                 dropout_p: float, mask: Any, is_causal: bool = False, *, scale: Any = None) -> Any:
        shapes = aten._scaled_dot_product_efficient_attention_backward.default(
            meta(grad), meta(q), meta(k), meta(v), meta(bias), meta(out), meta(lse), meta(seed), meta(offset),
            dropout_p, mask, is_causal, scale=scale)
        s, c = scores(q, k, is_causal, scale)  # (below autograd here: the softmax backward by hand)
        p = torch.softmax(s, -1)
        dp = grad @ v.transpose(-2, -1)
        ds = p * (dp - (grad * (p @ v)).sum(-1, keepdim=True))
        grads = ((ds @ k) * c, (ds.transpose(-2, -1) @ q) * c, p.transpose(-2, -1) @ grad)
        outs = [like(m).copy_(g) for m, g in zip(shapes[:3], grads, strict=True)]
        return (*outs, None)

    lib.impl("_scaled_dot_product_efficient_attention", forward, "CPU")
    lib.impl("_scaled_dot_product_efficient_attention_backward", backward, "CPU")
    return lib


def _pp_worker(rank: int, pp: int, model_name: str, layers: int, schedule: str, microbatches: int, batch: int,
               seq: int, iterations: int, dp: int, mixed: bool, tp: int, sp: bool, cp: int, training: bool,
               lora: tuple[str, ...], tmp: str, env: dict[str, str]) -> None:
    import contextlib
    import os

    import torch
    import torch.distributed as dist
    from torch import nn

    os.environ.update(env)
    torch.set_num_threads(1)
    _init_gloo(rank, pp * dp * tp * cp)
    try:
        from torch.distributed.pipelining import PipelineStage

        from ..models.build import build_model, quiet
        from ..workload import Parallel
        from . import pipeline_parallel as ppl

        spec = tiny_spec(model_name, layers=layers)
        par = Parallel(pp=pp, pp_schedule=schedule)
        bounds = par.stage_bounds(layers)
        torch.manual_seed(0)
        tracker = _StoragePeak()
        group: Any = None
        mesh: Any = None
        if dp > 1 or tp > 1 or cp > 1:
            from torch.distributed.device_mesh import init_device_mesh

            dims = [(n, k) for n, k in (("pp", pp), ("dp", dp), ("cp", cp), ("tp", tp)) if k > 1 or n == "pp"]
            mesh = init_device_mesh("cpu", tuple(k for _, k in dims), mesh_dim_names=tuple(n for n, _ in dims))
            group = mesh["pp"].get_group()
        pp_rank = rank // (dp * tp * cp)
        parts, specs = [], []
        attention = "sdpa" if cp > 1 else "eager"
        with quiet():
            for index in par.stage_ids(pp_rank):
                full = build_model(spec, task="train" if training else "infer", attention=attention, device="cpu",
                                   dtype=torch.float32)
                part, st = ppl.split(full, index, bounds)
                part.train(training)
                if not training:
                    part.requires_grad_(False)
                parts.append(part)
                specs.append(st)
        seq //= cp  # each context-parallel rank's shard
        if cp > 1:
            ppl.shard_positions(ppl.Chunks(parts), seq)
        if tp > 1:  # torchtitan's parallelize_fn on each model part: TP first
            ppl.tensor_parallelise(ppl.Chunks(parts), mesh["tp"], sp=sp, seq=seq)
        if lora:  # peft on the rank's parts (in place: the stages' modules get the adapters)
            from peft import LoraConfig, get_peft_model

            with quiet():
                get_peft_model(ppl.Chunks(parts), LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                             target_modules=list(lora), bias="none"))
        if dp > 1:  # torchtitan's apply_fsdp_to_decoder on each model part
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            kw: dict[str, Any] = {"mesh": mesh["dp"]}
            if mixed:
                kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                       cast_forward_inputs=False)
            for part in parts:
                lm: Any = part.lm
                if lm.model.embed_tokens is not None:
                    fully_shard(lm.model.embed_tokens, reshard_after_forward=False, **kw)
                if part.last:
                    fully_shard([lm.model.norm, lm.lm_head], reshard_after_forward=False, **kw)
                for blk in lm.model.layers:
                    fully_shard(blk, reshard_after_forward=False, **kw)
                fully_shard(part, **kw)
        cpu = torch.device("cpu")
        act = torch.bfloat16 if mixed else torch.float32

        def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())

        stages = []
        local = seq // tp if sp else seq  # the hidden states a stage hands on: TP-local
        for part, st in zip(parts, specs, strict=True):
            x = (torch.zeros(batch, seq, dtype=torch.long) if st.first
                 else torch.zeros(batch, local, spec.hidden, dtype=act, requires_grad=training))
            y = (torch.zeros(batch, seq, -(-spec.vocab // tp), dtype=act) if st.last
                 else torch.zeros(batch, local, spec.hidden, dtype=act, requires_grad=training))
            stages.append(PipelineStage(part, st.index, st.stages, cpu, input_args=(x,), output_args=(y,), group=group))
        cls = ppl.schedule_class(schedule)
        loss = loss_fn if training else None  # no loss: torch's schedule runs no backward
        sched = (cls(stages[0], n_microbatches=microbatches, loss_fn=loss) if schedule in ("GPipe", "1F1B")
                 else cls(stages, n_microbatches=microbatches, loss_fn=loss))
        model = nn.ModuleList(parts)
        for t in [*model.parameters(), *model.buffers()]:
            tracker.add(getattr(t, "_local_tensor", t))
        first, last = any(s.first for s in specs), any(s.last for s in specs)
        step_context: Any = contextlib.ExitStack()
        if tp > 1:
            from .dist import dtensor_metadata_unrecorded
            from .tensor_parallel import full_length_masks, loss_parallel

            tracker.skip_wrappers = True
            tracker.await_collectives = True
            step_context.enter_context(dtensor_metadata_unrecorded())
            step_context.enter_context(loss_parallel())
            if sp:
                step_context.enter_context(full_length_masks(seq))
        if cp > 1:
            import functools

            from ..target import DEFAULT_PROFILE
            from .context_parallel import ring_dispatcher
            from .dist import dtensor_metadata_unrecorded
            from .sdpa import run_sdpa

            tracker.skip_wrappers = True
            tracker.await_collectives = True
            kernels = _efficient_attention_on_cpu()  # (registered while the library lives)
            step_context.callback(kernels._destroy)
            original = nn.functional.scaled_dot_product_attention

            @functools.wraps(original)  # (the ring replaces F's function by this name)
            def sdpa(*a: Any, **k: Any) -> Any:  # the kernel the trace picks (memory-efficient for fp32)
                return run_sdpa(DEFAULT_PROFILE, original, *a, **k)[0]

            nn.functional.scaled_dot_product_attention = sdpa  # (before the ring wraps it)
            step_context.callback(setattr, nn.functional, "scaled_dot_product_attention", original)
            step_context.enter_context(dtensor_metadata_unrecorded())
            step_context.enter_context(ring_dispatcher(mesh["cp"]))
        if not training:
            step_context.enter_context(torch.no_grad())
        with tracker, tracker.resizes(), _c10d_waits_release(), step_context:
            opt = (torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, foreach=True)
                   if training else None)
            for _ in range(iterations):
                ids = torch.randint(0, spec.vocab, (batch * microbatches, seq))
                kwargs: dict[str, Any] = {"target": ids, "losses": []} if last and training else {}
                if ppl.returns_outputs(sched):
                    kwargs["return_outputs"] = False
                sched.step(*((ids,) if first else ()), **kwargs)
                del ids, kwargs
                if opt is not None:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        with open(os.path.join(tmp, f"rank{rank}"), "w") as f:
            f.write(str(tracker.peak))
    finally:
        dist.destroy_process_group()


def pipeline_agreement(schedules: tuple[str, ...] = ("GPipe", "1F1B", "Interleaved1F1B"), *, pp: int = 2,
                       layers: int = 4, microbatches: int = 4, batch: int = 2, seq: int = 64, dp: int = 1,
                       mixed: bool = False, tp: int = 1, sp: bool = False, cp: int = 1,
                       training: bool = True, lora: bool = False) -> list[tuple[str, int, int, int]]:
    """(schedule, pipeline rank, real storage peak, traced peak) of a tiny Llama over ``pp × dp × tp``
    gloo processes (:func:`real_pipeline_peaks`; ``dp > 1``: FSDP2 on each stage; ``tp > 1``: each
    stage tensor-parallel; the real peak of data- and tensor-parallel rank 0, whose peers' peaks
    must equal it; ``cp > 1``: ring attention on each stage, the real peak of cp rank 0, which
    its peers' must not exceed) and of the trace of the same layout (fp32 or FSDP2's bf16 mixed
    precision, eager attention — SDPA under ``cp`` —, no CUDA workspaces: a CPU run has none).
    ``training=False``: one-pass inference (``task=infer``), one forward-only micro-batch of ``batch``
    (``schedules`` and ``microbatches`` are then unused by both). ``lora``: LoRA training (``peft=lora``,
    the default rank and targets; peft on each rank's parts in the real run)."""
    from ..workload import (
        LORA_DEFAULT_TARGETS,
        Attention,
        Parallel,
        Peft,
        Precision,
        Task,
        Workload,
    )
    from .context_parallel import heaviest_rank
    from .run import TraceOptions, trace_pipeline_stages

    spec = tiny_spec("llama-3.1-8b", layers=layers)
    out = []
    for schedule in schedules:
        real = real_pipeline_peaks("llama-3.1-8b", layers=layers, pp=pp, schedule=schedule,
                                   microbatches=microbatches, batch=batch, seq=seq, dp=dp, mixed=mixed, tp=tp, sp=sp,
                                   cp=cp, training=training, lora=LORA_DEFAULT_TARGETS if lora else ())
        per = dp * tp * cp
        at = heaviest_rank(cp, training) * tp  # the traced cp rank (dp and tp rank 0) within its pipeline rank
        for r in range(pp):
            peers = set(real[r * per:(r + 1) * per])
            # (context-parallel ranks run different rounds, load-balanced: the traced cp rank the highest)
            if cp > 1 and dp == tp == 1 and max(peers) == real[r * per + at]:
                continue
            if len(peers) != 1:
                raise AssertionError(f"{schedule}: the data/tensor-parallel ranks of pipeline rank {r} peak apart: "
                                     f"{real[r * per:(r + 1) * per]}")
        w = Workload(task=Task.TRAIN if training else Task.INFER, precision=Precision.BF16_MIXED if mixed else Precision.FP32,
                     attention=Attention.SDPA if cp > 1 else Attention.EAGER, batch=batch, seq=seq,
                     grad_accum=microbatches, peft=Peft.LORA if lora else Peft.NONE,
                     parallel=Parallel(pp=pp, pp_schedule=schedule, dp=dp, zero=3 if dp > 1 else 0, tp=tp, sp=sp, cp=cp))
        opts = TraceOptions(workspaces=False, count_flops=False)
        traced = dict(trace_pipeline_stages(spec, w, options=opts))
        for rank in sorted(traced):
            out.append((schedule, rank, real[rank * per + at], traced[rank].peak_allocated))
    return out



def real_cp_peaks(model_name: str, *, layers: int, cp: int, dp: int = 1, batch: int, seq: int, iterations: int = 2,
                  timeout: float = 300.0) -> list[int]:
    """Each rank's storage peak (as :func:`real_peak` measures it) of a real CPU training run of
    context parallelism without pipeline parallelism over ``dp × cp`` gloo processes: the catalog
    model ``model_name`` shrunk to ``layers`` layers (:func:`tiny_spec`), fp32, SDPA attention,
    AdamW (foreach), stepped as the trace steps a catalog model (``model(**batch)``, its ``.loss``)
    under torch's ``context_parallel`` over the ``cp`` mesh with the batch's ``input_ids``,
    ``labels`` and explicit ``position_ids`` as the buffers sharded on the sequence dimension
    (:func:`.context_parallel.ring_attention`, the trace's own context: load-balanced rounds).
    ``dp > 1``: torchtitan's ``(dp, cp)`` mesh and FSDP2 (``reshard_after_forward=True``: ZeRO-3)
    over ``dp × cp`` flattened (``dp_cp``, as :meth:`.dist.RankContext.shard_mesh` shards), on
    each decoder layer and the root, as the trace's FSDP2 layout shards a catalog model.

    The ring's handlers are the CUDA kernels' ops, as under pipeline parallelism
    (:func:`real_pipeline_peaks`): SDPA goes through the trace's own choice (:func:`.sdpa.run_sdpa`,
    the memory-efficient kernel for fp32), whose forward and backward are CPU stand-ins with the
    meta kernels' outputs (:func:`_efficient_attention_on_cpu`). Peaks in global rank order
    (rank = dp rank × cp + cp rank)."""
    args = (model_name, layers, cp, dp, batch, seq, iterations)
    return _spawn_gloo(_cp_worker, args, dp * cp, timeout, "context-parallel run")


def _cp_worker(rank: int, model_name: str, layers: int, cp: int, dp: int, batch: int, seq: int, iterations: int,
               tmp: str, env: dict[str, str]) -> None:
    import functools
    import os

    import torch
    import torch.distributed as dist
    from torch import nn

    os.environ.update(env)
    torch.set_num_threads(1)
    _init_gloo(rank, dp * cp)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        from ..models.build import build_model, quiet
        from ..target import DEFAULT_PROFILE
        from .context_parallel import ring_attention
        from .dist import dtensor_metadata_unrecorded
        from .sdpa import run_sdpa
        from .steps import loss_of

        spec = tiny_spec(model_name, layers=layers)
        torch.manual_seed(0)
        mesh = (init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp")) if dp > 1
                else init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",)))
        with quiet():
            model = build_model(spec, task="train", attention="sdpa", device="cpu", dtype=torch.float32)
        model.train()
        if dp > 1:  # torchtitan's FSDP2 over the flattened dp_shard × cp mesh
            from torch.distributed.fsdp import fully_shard

            shard = mesh["dp", "cp"]._flatten("dp_cp")
            lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
            for blk in max(lists, key=len):
                fully_shard(blk, mesh=shard, reshard_after_forward=True)
            fully_shard(model, mesh=shard, reshard_after_forward=True)
        ring = mesh["cp"] if dp > 1 else mesh  # (outside the measurement: the mesh's own rank map is no GPU memory)
        ids = torch.randint(0, spec.vocab, (batch, seq))
        kw: dict[str, Any] = {"input_ids": ids, "labels": ids.clone(),
                              "position_ids": torch.arange(seq).unsqueeze(0).expand(batch, seq).contiguous()}
        tracker = _StoragePeak()
        tracker.skip_wrappers = True
        tracker.await_collectives = True
        for t in [*model.parameters(), *model.buffers(), *kw.values()]:
            tracker.add(getattr(t, "_local_tensor", t))
        kernels = _efficient_attention_on_cpu()  # (registered while the library lives)
        original = nn.functional.scaled_dot_product_attention

        @functools.wraps(original)  # (the ring replaces F's function by this name)
        def sdpa(*a: Any, **k: Any) -> Any:  # the kernel the trace picks (memory-efficient for fp32)
            return run_sdpa(DEFAULT_PROFILE, original, *a, **k)[0]

        nn.functional.scaled_dot_product_attention = sdpa  # (before the ring wraps it)
        try:
            with tracker, tracker.resizes(), _c10d_waits_release(), dtensor_metadata_unrecorded(), \
                    ring_attention(ring, kw):
                opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, foreach=True)
                for _ in range(iterations):
                    out = model(**kw)
                    loss = loss_of(out, ((), kw), None)
                    del out
                    loss.backward()
                    del loss
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        finally:
            nn.functional.scaled_dot_product_attention = original
            kernels._destroy()
        with open(os.path.join(tmp, f"rank{rank}"), "w") as f:
            f.write(str(tracker.peak))
    finally:
        dist.destroy_process_group()


def cp_agreement(cp: int, *, dp: int = 1, layers: int = 2, batch: int = 1, seq: int | None = None
                 ) -> list[tuple[int, int, int]]:
    """(rank, real storage peak, traced peak) of every rank of a tiny Llama trained under context
    parallelism without pipeline parallelism (``dp > 1``: FSDP2 ZeRO-3 over the flattened
    ``dp × cp`` mesh) over ``dp × cp`` gloo processes (:func:`real_cp_peaks`), each rank traced
    as itself (``TraceOptions(rank=)``) with the same workload (fp32, SDPA, no CUDA workspaces:
    a CPU run has none). ``seq`` defaults to ``64 · cp``, the shortest the load-balanced ring's
    memory-efficient kernel takes (:func:`.context_parallel.check_kernel`)."""
    from ..workload import Attention, Parallel, Precision, Task, Workload
    from .run import TraceOptions, trace_workload

    seq = seq or 64 * cp
    real = real_cp_peaks("llama-3.1-8b", layers=layers, cp=cp, dp=dp, batch=batch, seq=seq)
    w = Workload(task=Task.TRAIN, precision=Precision.FP32, attention=Attention.SDPA, batch=batch, seq=seq,
                 parallel=Parallel(dp=dp, cp=cp, zero=3 if dp > 1 else 0))
    spec = tiny_spec("llama-3.1-8b", layers=layers)
    out = []
    for rank, peak in enumerate(real):
        r = trace_workload(spec, w, options=TraceOptions(workspaces=False, count_flops=False, rank=rank))
        out.append((rank, peak, r.peak_allocated))
    return out


def _compiled_storage_peak() -> Any:
    """A :func:`_StoragePeak` that ``torch.compile`` compiles under and that sees what compiled
    code allocates (with :func:`_count_inductor_buffers`).

    ``ignore_compile_internals``: Dynamo skips every frame while a dispatch mode without it is
    active (torch 2.13 ``torch/_dynamo/convert_frame.py`` L2538-L2570: "non-infra torch dispatch
    mode present"); with it the mode is off while compiling and on while compiled code runs
    (``torch/utils/_python_dispatch.py`` L238-L262), where it sees the ops the generated code
    calls through the dispatcher (extern matmuls, fallback kernels) and higher-order operators
    (``supports_higher_order_operators``): a compiled checkpoint's ``run_and_save_rng_state``
    returns the generator's state, a host tensor under CUDA too, left out."""
    import torch
    from torch._prims.rng_prims import run_and_save_rng_state

    base = _storage_peak_mode()

    class CompiledStoragePeak(base):  # type: ignore[misc,valid-type]
        supports_higher_order_operators = True

        @classmethod
        def ignore_compile_internals(cls) -> bool:
            return True

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if not isinstance(func, torch._ops.HigherOrderOperator):
                return super().__torch_dispatch__(func, types, args, kwargs)
            out = func(*args, **(kwargs or {}))
            self.add_all(list(out[1:]) if func is run_and_save_rng_state else out)
            return out

    return CompiledStoragePeak()


def _count_inductor_buffers(tracker: Any) -> Any:
    """Route Inductor's CPU buffer allocator through ``tracker``: its generated Python wrapper
    binds ``empty_strided_cpu = torch._C._dynamo.guards._empty_strided_cpu`` when the module is
    loaded (torch 2.13 ``torch/_inductor/codegen/wrapper.py`` L1430), and that C++ function
    allocates past the dispatcher, so no dispatch mode sees the buffers (the activations a
    compiled forward saves among them). Returns the undo."""
    import torch

    guards: Any = torch._C._dynamo.guards
    orig = guards._empty_strided_cpu

    def empty_strided_cpu(*args: Any, **kwargs: Any) -> Any:
        out = orig(*args, **kwargs)
        tracker.add(out)
        return out

    guards._empty_strided_cpu = empty_strided_cpu

    def undo() -> None:
        guards._empty_strided_cpu = orig

    return undo


def real_fsdp_compile_peaks(spec: Any, *, world: int, batch: int, seq: int, compile: bool = True,
                            checkpointing: bool = False, iterations: int = 2,
                            timeout: float = 600.0) -> list[dict[str, Any]]:
    """Each rank's storage peaks of a real CPU run of the trace's training step (AdamW
    ``foreach``) on ``world`` gloo processes, laid out as torchtitan 0.3.0 lays a model out: the
    transformers model of ``spec`` (fp32, no KV cache), ``checkpointing``: transformers' full
    activation checkpointing (``use_reentrant=False``), then each decoder layer compiled with
    ``layer.compile(backend="inductor", fullgraph=True)`` (``torchtitan/distributed/compile.py``
    L69-L70), then FSDP2's ``fully_shard`` on each layer and the root (``apply_compile`` runs
    before ``apply_fsdp_to_decoder``, ``torchtitan/models/llama3/parallelize.py`` L61-L80).

    Per rank: ``peak`` (the highest of the iterations' phase peaks), ``peaks`` (per iteration:
    the ``forward`` (with the loss), ``backward`` and ``optimizer`` storage peaks), and Dynamo's
    counters (``graph_breaks``, ``unique_graphs``). What is counted is what :func:`real_peak`
    counts plus what compiled code allocates (:func:`_compiled_storage_peak`); FSDP2's storage
    resizes are counted. ``gc.collect()`` after each iteration: Dynamo's tracing state of a first
    compiled call (its ``LazyCache`` of the inputs the graph does not read, here the layer's
    ``position_ids``, ``[1, seq]`` int64) sits in a reference cycle until Python's cyclic
    collector runs, which no memory model times; without it iteration 2 holds 8·seq bytes more,
    while it lasts."""
    args = (world, spec, batch, seq, compile, checkpointing, iterations)
    return _spawn_gloo(_fsdp_compile_worker, args, world, timeout, "FSDP2 + compile run")


def _fsdp_compile_worker(rank: int, world: int, spec: Any, batch: int, seq: int, compile: bool,
                         checkpointing: bool, iterations: int, tmp: str, env: dict[str, str]) -> None:
    import gc
    import json
    import os

    import torch
    import torch.distributed as dist

    os.environ.update(env)
    torch.set_num_threads(1)
    _init_gloo(rank, world)
    try:
        from torch._dynamo.utils import counters
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from ..models.build import build_model, quiet
        from .steps import loss_of

        torch.manual_seed(0)
        with quiet():
            model: Any = build_model(spec, task="train", device="cpu", dtype=torch.float32)
        model.config.use_cache = False
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        layers = model.model.layers
        if compile:
            for layer in layers:
                layer.compile(backend="inductor", fullgraph=True)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        ids = torch.randint(0, spec.vocab, (batch, seq))
        batch_kw: Any = ((), {"input_ids": ids, "labels": ids.clone()})
        tracker = _compiled_storage_peak()
        for t in [*model.parameters(), *model.buffers(), ids, batch_kw[1]["labels"]]:
            tracker.add(getattr(t, "_local_tensor", t))
        undo = _count_inductor_buffers(tracker)
        peaks = []
        try:
            with tracker, tracker.resizes(), _c10d_waits_release():
                opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, foreach=True)
                for _ in range(iterations):
                    tracker.peak = tracker.current
                    out = model(*batch_kw[0], **batch_kw[1])
                    loss = loss_of(out, batch_kw, None)
                    del out
                    row = {"forward": tracker.peak}
                    tracker.peak = tracker.current
                    loss.backward()
                    del loss
                    row["backward"] = tracker.peak
                    tracker.peak = tracker.current
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    row["optimizer"] = tracker.peak
                    peaks.append(row)
                    gc.collect()  # (see real_fsdp_compile_peaks)
        finally:
            undo()
        with open(os.path.join(tmp, f"rank{rank}"), "w") as f:
            f.write(json.dumps({"peak": max(max(r.values()) for r in peaks), "peaks": peaks,
                                "graph_breaks": sum(counters["graph_break"].values()),
                                "unique_graphs": counters["stats"]["unique_graphs"]}))
    finally:
        dist.destroy_process_group()


def real_tp_compile_run(spec: Any, *, tp: int, batch: int, seq: int, sp: bool, backend: str = "inductor",
                        wait_first_input: bool = False, iterations: int = 2,
                        timeout: float = 600.0) -> list[dict[str, Any]]:
    """A real CPU training run of the trace's tensor-parallel step with compiled blocks on ``tp``
    gloo processes: the transformers model of ``spec`` (fp32, no KV cache) sharded by
    :func:`.tensor_parallel.apply_tensor_parallel`, then each decoder layer compiled with
    ``layer.compile(backend=backend, fullgraph=True)`` (torchtitan's order: TP, then compile),
    the loss-parallel cross-entropy, AdamW ``foreach``; ``iterations`` steps.

    ``wait_first_input``: the first layer's input is cloned (which waits the embeddings'
    ``AsyncCollectiveTensor`` and hands the block a plain tensor), the one change that lets the
    run through (:func:`.tensor_parallel.compile_refusal`). Per rank: ``ok``, ``error`` (the
    exception's type and message), ``where`` (the innermost frame's file and function), the
    steps done (``steps``), ``first_input`` (the type of the first layer's input) and Dynamo's
    ``unique_graphs``. Only whether it runs is measured, no memory."""
    args = (tp, spec, batch, seq, sp, backend, wait_first_input, iterations)
    return _spawn_gloo(_tp_compile_worker, args, tp, timeout, "TP + compile run")


def _tp_compile_worker(rank: int, tp: int, spec: Any, batch: int, seq: int, sp: bool, backend: str,
                       wait_first_input: bool, iterations: int, tmp: str, env: dict[str, str]) -> None:
    import contextlib
    import json
    import os
    import traceback

    import torch
    import torch.distributed as dist
    from torch import nn

    os.environ.update(env)
    torch.set_num_threads(1)
    _init_gloo(rank, tp)
    out: dict[str, Any] = {"ok": False, "steps": 0}
    try:
        from torch._dynamo.utils import counters
        from torch.distributed.device_mesh import init_device_mesh

        from ..models.build import build_model, quiet
        from .tensor_parallel import apply_tensor_parallel, full_length_masks, loss_parallel

        torch.manual_seed(0)
        with quiet():
            model: Any = build_model(spec, task="train", device="cpu", dtype=torch.float32)
        model.config.use_cache = False
        apply_tensor_parallel(model, init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",)), sp=sp)
        model.train()
        layers = model.model.layers
        for layer in layers:
            layer.compile(backend=backend, fullgraph=True)

        class First(nn.Module):  # records (and optionally waits) the first compiled layer's input
            def __init__(self, inner: nn.Module) -> None:
                super().__init__()
                self.inner = inner

            def forward(self, hidden: Any, *args: Any, **kwargs: Any) -> Any:
                out["first_input"] = type(hidden).__name__
                return self.inner(hidden.clone() if wait_first_input else hidden, *args, **kwargs)

        layers[0] = First(layers[0])
        ids = torch.randint(0, spec.vocab, (batch, seq))
        kw: dict[str, Any] = {"input_ids": ids, "labels": ids.clone()}
        step = contextlib.ExitStack()
        step.enter_context(loss_parallel())
        if sp:  # (as the trace runs SP: whole-sequence positions and masks, tensor_parallel.position_ids)
            kw["position_ids"] = torch.arange(seq).unsqueeze(0).expand(batch, seq)
            step.enter_context(full_length_masks(seq))
        with step:
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, foreach=True)
            for _ in range(iterations):
                model(**kw).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                out["steps"] += 1
        out["ok"] = True
        out["unique_graphs"] = counters["stats"]["unique_graphs"]
    except Exception as e:  # the failure is the result
        frame = traceback.extract_tb(e.__traceback__)[-1]
        out.update(error=f"{type(e).__name__}: {e}", where=f"{frame.filename}:{frame.name}")
    finally:
        with open(os.path.join(tmp, f"rank{rank}"), "w") as f:
            f.write(json.dumps(out))
        dist.destroy_process_group()
