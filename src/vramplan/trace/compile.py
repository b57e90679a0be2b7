"""``torch.compile``: the activations AOTAutograd's partitioner saves, from the real partitioner.

Each transformer block is compiled on its own, as torchtitan's ``apply_compile`` does
(``transformer_block.compile(fullgraph=True)``, torchtitan 0.3.0
``torchtitan/distributed/compile.py`` L69-L70; earlier ``torch.compile(transformer_block,
fullgraph=True)``). For a block's first call with given
input shapes, AOTAutograd (``torch._functorch.aot_autograd.aot_function``) traces the joint
forward+backward graph on fake tensors with Inductor's decomposition table and splits it with
``torch._functorch.partitioners.min_cut_rematerialization_partition`` — the partitioner
``torch.compile``'s Inductor backend uses — so what the forward graph returns for backward is
exactly what a compiled block keeps. Tracing happens with the trace's recording paused (the
CUDA emulation stays on: SDPA becomes the flash/efficient kernel, autocast casts are in the
graph); the compiled function is cached per block class and input signature and reused by
every layer, as compiled code is. Inductor's joint-graph passes run first, as in
``torch.compile``; one of them would take the meta tensors the trace computes on for values
without data and drop the block's outputs (:func:`_outputs_not_dataless`).

The forward and backward graphs then run op by op under the trace (``torch.fx.Interpreter``
frees each value after its last use). Approximation, stated in the trace's notes: Inductor
fuses elementwise chains into kernels that never materialise their intermediates, so the
transient memory *inside* a block's forward/backward is an upper bound; what is saved between
forward and backward — the figure the partitioner decides — is exact for the graph.

Blocks under activation checkpointing hold the checkpoint inside their compiled graph, as
Dynamo puts it there (torch 2.13 ``torch/_higher_order_ops/wrap.py``,
``tag_activation_checkpoint_impl``): the checkpoint is traced with a selective-checkpoint context
that tags each op ``PREFER_RECOMPUTE`` (or as the workload's SAC policy says) under one
``ac_graph_id``, and the partitioner recomputes the tagged ops in the compiled backward. The
forward then keeps the region's inputs only (full checkpointing) or the policy's saved ops that
backward reads (selective), and computes no more than the block's output; the compiled backward
recomputes and differentiates in one graph. Checked against torch.compile on CPU for the saved
tensors (tests/test_trace_compile.py) and, under FSDP2, for each rank's storage peak
(tests/test_trace_fsdp_compile.py).

Under FSDP2 the block's ``fully_shard`` hooks run outside the compiled graph (torch 2.13 wraps
them in ``torch._dynamo.disable``, ``torch/distributed/fsdp/_fully_shard/_fsdp_state.py``
L289, L323, L380), so the compiled function takes the unsharded parameters as inputs, and
whatever of them it saves is freed by FSDP's reshard and gathered again before backward, as
in eager (docs/research/fsdp-compile.md).

Not compiled (traced eagerly, with a note): the embedding, final norm,
head and loss outside the blocks, inference (no partitioning happens without autograd), and
a block whose graph cannot be traced (data-dependent control flow; the note says why).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

_TRACING = contextvars.ContextVar("vramplan_compile_tracing", default=False)


def tracing() -> bool:
    """Whether AOTAutograd is tracing a block now (a checkpoint's contexts are then its own:
    the compiled backward recomputes, not the checkpoint)."""
    return _TRACING.get()


class BlockCompiler:
    """Compiled forwards shared by the blocks of one model (one cache per trace)."""

    def __init__(self, pause: Callable[[], contextlib.AbstractContextManager[Any]]) -> None:
        self.pause = pause
        self.cache: dict[Any, Any] = {}
        self.saved: dict[Any, tuple[int, int]] = {}
        """signature → (tensors saved for backward, of them graph inputs: weights, the block input)."""
        self.saved_bytes: dict[Any, int] = {}
        """signature → bytes of the saved tensors the block computes (not its inputs)."""
        self.failures: list[str] = []
        self.blocks = 0
        self.partitioner = ""
        self.checkpointed = 0
        """Of the blocks compiled, those inside an activation checkpoint."""

    def wrap(self, block: nn.Module) -> None:
        """Compile what the block runs, its activation checkpoint included when it has one, as
        the checkpoint is inside the compiled region's graph in a real run
        (:func:`_tagged_checkpoint`): transformers' ``GradientCheckpointingLayer`` checkpoints
        ``partial(forward, self, **kwargs)`` through ``_gradient_checkpointing_func`` (that
        function gets the compiled region), vramplan's own wrapper the block's
        ``_vramplan_forward`` with its ``_vramplan_checkpoint``; other blocks their ``forward``."""
        names = [n for n, _ in block.named_parameters()] + [n for n, _ in block.named_buffers()]
        gc = block.__dict__.get("_gradient_checkpointing_func")
        if getattr(block, "gradient_checkpointing", False) and callable(gc):
            self.checkpointed += 1

            def checkpointed(fn: Any, *args: Any) -> Any:
                if isinstance(fn, functools.partial):
                    inner, kw = functools.partial(fn.func, *fn.args), dict(fn.keywords)
                else:
                    inner, kw = fn, {}

                def region(*a: Any, **k: Any) -> Any:
                    return _tagged_checkpoint(gc, functools.partial(inner, **k), *a)

                return self._call(block, names, region, args, kw)

            block.__dict__["_gradient_checkpointing_func"] = checkpointed
            return
        own = block.__dict__.get("_vramplan_checkpoint")
        if "_vramplan_forward" in block.__dict__ and callable(own):  # vramplan's own checkpoint wrapper
            self.checkpointed += 1
            body = block.__dict__["_vramplan_forward"]

            def own_region(*a: Any, **k: Any) -> Any:
                return _tagged_checkpoint(own, functools.partial(body, **k), *a)

            block.__dict__["forward"] = lambda *args, **kwargs: self._call(block, names, own_region, args, kwargs)
            return
        inner = block.forward
        block.__dict__["forward"] = lambda *args, **kwargs: self._call(block, names, inner, args, kwargs)

    def _call(self, block: nn.Module, names: list[str], inner: Callable[..., Any], args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> Any:
        if not torch.is_grad_enabled() or self.failures:
            return inner(*args, **kwargs)
        tensors = [p for _, p in block.named_parameters()] + [b for _, b in block.named_buffers()]
        leaves, spec = tree_flatten((args, kwargs))
        idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        key = (type(block), tuple(names), str(spec),
               tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in tensors),
               tuple((tuple(leaves[i].shape), leaves[i].dtype, leaves[i].requires_grad) for i in idx),
               tuple(repr(x) for i, x in enumerate(leaves) if i not in idx),
               _layer_kind(block))
        fn = self.cache.get(key)
        if fn is None:
            try:
                fn = self._compile(block, inner, names, leaves, spec, idx, key)
            except Exception as e:  # noqa: BLE001 — a block that cannot be traced runs eagerly
                at = traceback.extract_tb(e.__traceback__)[-1:]  # (where it failed: torch's file and line)
                where = f" (at {at[0].filename.rsplit('site-packages/', 1)[-1]}:{at[0].lineno})" if at else ""
                self.failures.append(f"{type(block).__name__}: {type(e).__name__}: {str(e).splitlines()[0][:160]}{where}")
                return inner(*args, **kwargs)
            self.cache[key] = fn
        return fn(*tensors, *(leaves[i] for i in idx))

    def _compile(self, block: nn.Module, inner: Callable[..., Any], names: list[str], leaves: list[Any],
                 spec: Any, idx: list[int], key: Any) -> Any:
        from torch._functorch.aot_autograd import aot_function
        from torch._functorch.partitioners import min_cut_rematerialization_partition as min_cut
        from torch._inductor.decomposition import select_decomp_table

        inductor_partition = _inductor_partition()
        from torch.nn.utils.stateless import _reparametrize_module

        n_state = len(names)
        # the non-tensor leaves only: the compiled function is cached for every later call, and
        # the first call's tensors (the block's input, the rotary embeddings) must not live on in it
        tensor_at = set(idx)
        fixed = [None if i in tensor_at else x for i, x in enumerate(leaves)]
        counts: dict[str, int] = {}

        def f(*flat: Any) -> Any:
            state = dict(zip(names, flat[:n_state], strict=True))
            call = list(fixed)
            for i, t in zip(idx, flat[n_state:], strict=True):
                call[i] = t
            args, kwargs = tree_unflatten(call, spec)
            with _reparametrize_module(block, state):
                return inner(*args, **kwargs)

        def partition(joint: Any, joint_inputs: Any, **kw: Any) -> Any:
            try:  # Inductor's joint-graph passes first, as torch.compile runs them
                with _no_failure_dump(), _outputs_not_dataless(), _no_pad_benchmark():
                    fw, bw = inductor_partition(copy.deepcopy(joint), joint_inputs, **kw)
                self.partitioner = "Inductor's partition_fn (joint-graph passes + min-cut)"
            except Exception:  # noqa: BLE001 — a graph their passes or the min-cut cannot handle
                fw, bw = min_cut(joint, joint_inputs, **kw)
                self.partitioner = ("min_cut_rematerialization_partition (Inductor's joint-graph passes "
                                    "failed on this graph and are skipped: on CPU the saved set is the same "
                                    "under SDPA, 38 % larger under eager attention)")
            out = next(n for n in fw.graph.nodes if n.op == "output").args[0]
            params = {n for n in fw.graph.nodes if n.op == "placeholder"}
            kept = [v for v in out[kw.get("num_fwd_outputs", 0):] if isinstance(v, torch.fx.Node) and not _host(v)]
            counts["saved"] = len(kept)
            counts["inputs"] = sum(1 for v in kept if _root(v) in params)
            counts["bytes"] = sum(_nbytes(v) for v in kept if _root(v) not in params)
            return fw, bw

        fn = aot_function(f, fw_compiler=_interpreted, bw_compiler=_interpreted, partition_fn=partition,
                          decompositions=select_decomp_table())
        tensors = [p for _, p in block.named_parameters()] + [b for _, b in block.named_buffers()]
        # (a checkpointed block compiles on its first call, inside the checkpoint: its saved-tensor
        # hooks must not see the tracing, so plain hooks sit on top of them meanwhile)
        token = _TRACING.set(True)
        try:
            with self.pause(), torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same), \
                    _no_device_rng():
                fn(*tensors, *(leaves[i] for i in idx))  # traces and partitions; the result is dropped
        finally:
            _TRACING.reset(token)
        self.saved[key] = (counts.get("saved", 0), counts.get("inputs", 0))
        self.saved_bytes[key] = counts.get("bytes", 0)
        return fn


_AC_GRAPH_IDS = iter(range(1, 1 << 62))


def _tagged_checkpoint(gc: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` checkpointed as Dynamo's ``tag_activation_checkpoint`` runs a checkpoint it
    finds in a compiled region (torch 2.13 ``torch/_higher_order_ops/wrap.py``,
    ``tag_activation_checkpoint_impl``): non-reentrant, no RNG-state preservation (Inductor
    functionalises RNG instead), no early stop, and a selective-checkpoint context that tags every
    op it traces ``PREFER_RECOMPUTE`` with one ``ac_graph_id`` (the user's ``context_fn`` when
    ``gc`` carries one), so that AOTAutograd's partitioner recomputes the region in the compiled
    backward instead of saving it."""
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    user = gc.keywords.get("context_fn") if isinstance(gc, functools.partial) else None
    graph_id = next(_AC_GRAPH_IDS)

    def context_fn() -> Any:
        if user is not None:
            fwd, rec = user()
        else:
            fwd, rec = create_selective_checkpoint_contexts(lambda *_a, **_k: CheckpointPolicy.PREFER_RECOMPUTE)
        fwd.ac_graph_id = graph_id
        return fwd, rec

    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False, context_fn=context_fn,
                      early_stop=False)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


@contextlib.contextmanager
def _no_failure_dump() -> Iterator[None]:
    """The partitioner writes ``min_cut_failed_graph*.txt`` into the working directory when it
    gives up (torch/_functorch/partitioners.py, ``solve_min_cut``); we fall back instead, so
    the dump goes to the null device."""
    import os

    import torch._functorch.partitioners as parts

    orig = getattr(parts, "_get_unique_path", None)
    if orig is None:
        yield
        return
    parts._get_unique_path = lambda *a, **k: os.devnull
    try:
        yield
    finally:
        parts._get_unique_path = orig


@contextlib.contextmanager
def _outputs_not_dataless() -> Iterator[None]:
    """Inductor's ``remove_no_ops`` (a joint-graph pass, run at the end of
    ``constant_fold_uniform_value``) replaces every graph output whose value is on the ``meta``
    device by an ``empty_strided`` and drops the code that computed it, as "meta tensors
    returned from the graph have no data" (torch 2.14.1 ``torch/_inductor/fx_passes/joint_graph.py``
    L221-L248, called at L612; 2.13.0 L185-L212, called at L568). The trace's meta tensors stand
    for device memory, and a real run's outputs are CUDA tensors, which the pass keeps. Without
    this the joint graph lost the block's output and every gradient: on torch 2.14.1 the
    partitioner then saved only what the attention kernel's backward reads (a Llama layer under
    eager attention: nothing), on 2.13.0 the min-cut failed on the damaged graph and the
    emulation fell back to the partitioner without the passes (under eager attention 16 saved
    tensors where the real compiled layer keeps 13). While the pass runs, the graph's values
    report the CPU instead of ``meta`` (shapes, strides and dtypes unchanged; the pass compares
    devices only between the graph's own values); afterwards they are ``meta`` again."""
    try:
        from torch._inductor.fx_passes import joint_graph
    except ImportError:
        yield
        return
    orig = getattr(joint_graph, "remove_no_ops", None)
    if orig is None:
        yield
        return

    @functools.wraps(orig)
    def remove_no_ops(gm: Any, *args: Any, **kwargs: Any) -> Any:
        moved = []
        for node in gm.graph.nodes:
            v = node.meta.get("val")
            for t in v if isinstance(v, (list, tuple)) else (v,):
                if getattr(t, "fake_device", None) == torch.device("meta"):
                    t.fake_device = torch.device("cpu")
                    moved.append(t)
        try:
            return orig(gm, *args, **kwargs)
        finally:
            for t in moved:
                t.fake_device = torch.device("meta")

    joint_graph.remove_no_ops = remove_no_ops
    try:
        yield
    finally:
        joint_graph.remove_no_ops = orig


@contextlib.contextmanager
def _no_device_rng() -> Iterator[None]:
    """AOTAutograd saves and restores the RNG states around its tracing (``create_aot_state``
    enters torch/_dynamo/utils.py ``preserve_rng_state``), the CUDA generator's too whenever
    ``torch.cuda.is_available()`` says yes. The trace's tensors are meta: no device generator is
    drawn from, so there is nothing to save. Whenever something has made ``is_available`` say
    yes on a host without a GPU (with ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` it follows a patched
    ``device_count``: see ``dist._cuda_device_queries``), that save reached for the CUDA runtime ("CUDA driver version is
    insufficient") and every compiled block of the trace ran eagerly. While it traces, the CUDA
    generator's state is a placeholder that is never used."""
    cuda = torch.cuda
    saved = {k: getattr(cuda, k) for k in ("get_rng_state", "set_rng_state", "is_available")}
    count = getattr(torch._C, "_cuda_getDeviceCount", None)
    real = bool(cuda._is_compiled() and count is not None and count() > 0)  # (the runtime's own answer)
    cuda.is_available = lambda: real  # type: ignore[assignment]
    cuda.get_rng_state = lambda device="cuda": torch.zeros(16, dtype=torch.uint8)  # type: ignore[assignment]
    cuda.set_rng_state = lambda new_state, device="cuda": None  # type: ignore[assignment]
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(cuda, k, v)


@contextlib.contextmanager
def _no_pad_benchmark() -> Iterator[None]:
    """Inductor's ``pad_mm`` joint-graph patterns pad a matrix product whose dimensions are not
    aligned when a timing on the GPU says the padded one is faster (``should_pad``; torch 2.14.1
    ``torch/_inductor/fx_passes/pad_mm.py`` L474-L484, ``_should_pad`` times both with real
    tensors on the graph's device). The emulated GPU cannot time anything, and a timing would reach
    for the real CUDA runtime (on a machine without a GPU: "CUDA driver version is insufficient",
    which then failed every later compiled block of the process). While the passes run, no product
    is padded: aligned dimensions (a catalog model's) are never padded anyway; for others the
    trace leaves out the padded copies, and its notes say so."""
    try:
        from torch._inductor.fx_passes import pad_mm
    except ImportError:
        yield
        return
    orig = getattr(pad_mm, "should_pad", None)
    if orig is None:
        yield
        return
    pad_mm.should_pad = lambda *_a, **_k: False
    try:
        yield
    finally:
        pad_mm.should_pad = orig


def _inductor_partition() -> Callable[..., Any]:
    """Inductor's ``partition_fn`` (``torch/_inductor/compile_fx.py``: its joint-graph passes, then
    ``min_cut_rematerialization_partition``); on a torch without the module-level function,
    the partitioner alone."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    try:
        from torch._inductor import compile_fx
    except ImportError:
        return min_cut_rematerialization_partition
    fn = getattr(compile_fx, "partition_fn", None)
    return fn if callable(fn) else min_cut_rematerialization_partition


def _root(node: torch.fx.Node) -> torch.fx.Node:
    """The node a chain of view ops starts from (a saved ``t(weight)`` is the weight's memory)."""
    while node.op == "call_function" and getattr(node.target, "is_view", False) and node.args \
            and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def _host(node: torch.fx.Node) -> bool:
    """A value on the CPU in a graph traced on fake device tensors: the generator state a
    functionalised random op saves (a host tensor under CUDA too)."""
    v = node.meta.get("val")
    return isinstance(v, torch.Tensor) and v.device.type == "cpu"


def _nbytes(node: torch.fx.Node) -> int:
    v = node.meta.get("val")
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def _layer_kind(block: nn.Module) -> Any:
    """What makes layers of one class trace different graphs (sliding-window vs full attention)."""
    attn = getattr(block, "self_attn", None)
    return (getattr(block, "attention_type", None), getattr(attn, "sliding_window", None),
            getattr(attn, "is_sliding", None))


class _RngInterpreter(torch.fx.Interpreter):
    """Runs Inductor's functionalised RNG ops (a recomputed random op, such as the efficient SDPA
    kernel in a compiled checkpoint) as CUDA runs them: ``run_and_save_rng_state(op, *args)`` is
    the op plus the generator's state, ``torch.cuda.get_rng_state()``, a host tensor (no device
    memory); ``run_with_rng_state(state, op, *args)`` the op (torch 2.13
    ``torch/_prims/rng_prims.py``: their CUDA and CPU implementations)."""

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        name = getattr(target, "__name__", "")
        if isinstance(target, torch._ops.HigherOrderOperator) and name == "run_and_save_rng_state":
            op, *rest = args
            with paused_dispatch():
                state = torch.empty(16, dtype=torch.uint8)  # the host-side state (not recorded)
            return state, op(*rest, **kwargs)
        if isinstance(target, torch._ops.HigherOrderOperator) and name == "run_with_rng_state":
            _state, op, *rest = args
            return op(*rest, **kwargs)
        return super().call_function(target, args, kwargs)


def _interpreted(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
    """Run the partitioned graph op by op (each value freed after its last use)."""
    def run(args: list[Any]) -> Any:
        return _RngInterpreter(gm).boxed_run(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


@contextlib.contextmanager
def paused_dispatch() -> Iterator[None]:
    """Run without the trace's dispatch mode (the recorder sees nothing); function modes stay."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


def apply_compile(blocks: list[nn.Module]) -> BlockCompiler:
    compiler = BlockCompiler(paused_dispatch)
    compiler.blocks = len(blocks)
    for b in blocks:
        compiler.wrap(b)
    return compiler


def notes(compiler: BlockCompiler) -> list[str]:
    n_blocks, checkpointed = compiler.blocks, compiler.checkpointed
    if compiler.failures:
        return [f"torch.compile not emulated (blocks traced eagerly): AOTAutograd could not trace "
                f"{compiler.failures[0]}"]
    saved = ", ".join(f"{s - i} tensors ({compiler.saved_bytes[k]:,} B) + {i} of its inputs/weights"
                      for k, (s, i) in compiler.saved.items())
    out = [f"torch.compile emulated per block ({n_blocks} blocks, torchtitan-style): AOTAutograd with "
           f"{compiler.partitioner} keeps {saved or 'nothing'} per block for backward; "
           "intermediates inside a block are run op by op (Inductor would fuse some away); matrix products "
           "are not padded (Inductor's pad_mm decides by timing them on the GPU)"]
    if checkpointed:
        out.append(f"torch.compile: {checkpointed} blocks compiled with their activation checkpoint inside the "
                   "graph (Dynamo's tag_activation_checkpoint): the partitioner recomputes the checkpointed ops in "
                   "the compiled backward; the forward keeps what is listed above, as real torch.compile does "
                   "(tests/test_trace_compile.py)")
    return out
