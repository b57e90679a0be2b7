"""``torch.compile``: the activations AOTAutograd's partitioner saves, from the real partitioner.

Each transformer block is compiled on its own, as torchtitan's ``apply_compile`` does
(``torch.compile(transformer_block, fullgraph=True)``, torchtitan v0.2.2
``torchtitan/models/llama3/infra/parallelize.py``). For a block's first call with given
input shapes, AOTAutograd (``torch._functorch.aot_autograd.aot_function``) traces the joint
forward+backward graph on fake tensors with Inductor's decomposition table and splits it with
``torch._functorch.partitioners.min_cut_rematerialization_partition`` — the partitioner
``torch.compile``'s Inductor backend uses — so what the forward graph returns for backward is
exactly what a compiled block keeps. Tracing happens with the trace's recording paused (the
CUDA emulation stays on: SDPA becomes the flash/efficient kernel, autocast casts are in the
graph); the compiled function is cached per block class and input signature and reused by
every layer, as compiled code is.

The forward and backward graphs then run op by op under the trace (``torch.fx.Interpreter``
frees each value after its last use). Approximation, stated in the trace's notes: Inductor
fuses elementwise chains into kernels that never materialise their intermediates, so the
transient memory *inside* a block's forward/backward is an upper bound; what is saved between
forward and backward — the figure the partitioner decides — is exact for the graph.

Blocks under activation checkpointing are compiled inside the checkpoint (the checkpoint
encloses the compiled forward): the forward keeps the checkpoint's inputs, as a real compiled
block whose graph holds the checkpoint keeps them (checked against torch.compile on CPU for
full checkpointing); the backward recomputes the compiled forward before the compiled
backward. Not compiled (traced eagerly, with a note): the embedding, final norm,
head and loss outside the blocks, inference (no partitioning happens without autograd), and
a block whose graph cannot be traced (data-dependent control flow; the note says why).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten


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
        """Compile what the block runs, inside its activation checkpoint when it has one, as the
        checkpoint is inside the compiled region's graph in a real run: transformers'
        ``GradientCheckpointingLayer`` checkpoints ``partial(forward, self, **kwargs)`` through
        ``_gradient_checkpointing_func`` (that function gets the compiled call), vramplan's own
        wrapper the block's ``_vramplan_forward``; other blocks their ``forward``."""
        names = [n for n, _ in block.named_parameters()] + [n for n, _ in block.named_buffers()]
        gc = block.__dict__.get("_gradient_checkpointing_func")
        if getattr(block, "gradient_checkpointing", False) and callable(gc):
            self.checkpointed += 1

            def checkpointed(fn: Any, *args: Any) -> Any:
                if isinstance(fn, functools.partial):
                    inner, kw = functools.partial(fn.func, *fn.args), dict(fn.keywords)
                else:
                    inner, kw = fn, {}
                return gc(lambda *a: self._call(block, names, inner, a, kw), *args)

            block.__dict__["_gradient_checkpointing_func"] = checkpointed
            return
        attr = "_vramplan_forward" if "_vramplan_forward" in block.__dict__ else "forward"
        self.checkpointed += int(attr != "forward")
        inner = getattr(block, attr)
        block.__dict__[attr] = lambda *args, **kwargs: self._call(block, names, inner, args, kwargs)

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
                self.failures.append(f"{type(block).__name__}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
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
        fixed = list(leaves)
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
                with _no_failure_dump():
                    fw, bw = inductor_partition(copy.deepcopy(joint), joint_inputs, **kw)
                self.partitioner = "Inductor's partition_fn (joint-graph passes + min-cut)"
            except Exception:  # noqa: BLE001 — their passes refuse some meta graphs (the flash op)
                fw, bw = min_cut(joint, joint_inputs, **kw)
                self.partitioner = ("min_cut_rematerialization_partition (Inductor's joint-graph passes "
                                    "refuse the meta graph and are skipped: on CPU the saved set is the same "
                                    "under SDPA, 38 % larger under eager attention)")
            out = next(n for n in fw.graph.nodes if n.op == "output").args[0]
            params = {n for n in fw.graph.nodes if n.op == "placeholder"}
            kept = [v for v in out[kw.get("num_fwd_outputs", 0):] if isinstance(v, torch.fx.Node)]
            counts["saved"] = len(kept)
            counts["inputs"] = sum(1 for v in kept if _root(v) in params)
            counts["bytes"] = sum(_nbytes(v) for v in kept if _root(v) not in params)
            return fw, bw

        fn = aot_function(f, fw_compiler=_interpreted, bw_compiler=_interpreted, partition_fn=partition,
                          decompositions=select_decomp_table())
        tensors = [p for _, p in block.named_parameters()] + [b for _, b in block.named_buffers()]
        # (a checkpointed block compiles on its first call, inside the checkpoint: its saved-tensor
        # hooks must not see the tracing, so plain hooks sit on top of them meanwhile)
        with self.pause(), torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
            fn(*tensors, *(leaves[i] for i in idx))  # traces and partitions; the result is dropped
        self.saved[key] = (counts.get("saved", 0), counts.get("inputs", 0))
        self.saved_bytes[key] = counts.get("bytes", 0)
        return fn


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


def _nbytes(node: torch.fx.Node) -> int:
    v = node.meta.get("val")
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def _layer_kind(block: nn.Module) -> Any:
    """What makes layers of one class trace different graphs (sliding-window vs full attention)."""
    attn = getattr(block, "self_attn", None)
    return (getattr(block, "attention_type", None), getattr(attn, "sliding_window", None),
            getattr(attn, "is_sliding", None))


def _interpreted(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
    """Run the partitioned graph op by op (each value freed after its last use)."""
    def run(args: list[Any]) -> Any:
        return torch.fx.Interpreter(gm).boxed_run(args)

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
           "intermediates inside a block are run op by op (Inductor would fuse some away)"]
    if checkpointed:
        out.append(f"torch.compile: {checkpointed} blocks compiled inside their activation checkpoint: the "
                   "backward recomputes the compiled forward (the tensors it saves, as above) before the compiled "
                   "backward; under full checkpointing the forward keeps the checkpoint's inputs only, as a real "
                   "compiled checkpointed block does (tests/test_trace_compile.py)")
    return out
