"""``compile``: what AOTAutograd's partitioner keeps for backward, checked against the real
``torch.compile`` (Inductor) on CPU, and its effect in the trace."""

from __future__ import annotations

import shutil

import pytest
import torch

from vramplan.trace.compile import BlockCompiler, paused_dispatch
from vramplan.trace.run import TraceOptions, trace_workload
from vramplan.trace.testing import tiny_spec
from vramplan.workload import Workload

NO_WS = TraceOptions(workspaces=False)


def _layer_and_inputs(attention: str):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256)
    cfg._attn_implementation = attention
    torch.manual_seed(0)
    x = torch.randn(2, 128, 64, requires_grad=True)
    cos, sin = LlamaRotaryEmbedding(cfg)(x, torch.arange(128)[None])
    return (lambda: LlamaDecoderLayer(cfg, 0)), x, cos, sin


def _saved(layer, x, cos, sin) -> list[tuple[tuple[int, ...], int]]:
    """(shape, storage bytes) of each new storage the step saves for backward (weights, the
    layer's own input and views of them are not new memory)."""
    own = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {x.untyped_storage().data_ptr()}
    seen: dict[int, tuple[tuple[int, ...], int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in own:
            seen[ptr] = (tuple(t.shape), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, position_embeddings=(cos, sin), attention_mask=None)
    return sorted(seen.values())


NO_CC = shutil.which("cc") is None and shutil.which("gcc") is None


@pytest.mark.skipif(NO_CC, reason="Inductor on CPU needs a C compiler")
@pytest.mark.parametrize("attention,joint_passes", [("eager", True), ("sdpa", True), ("sdpa", False)])
def test_saved_activations_match_real_torch_compile_on_cpu(attention: str, joint_passes: bool,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A transformers Llama decoder layer compiled for real by torch.compile (Inductor, CPU)
    saves exactly the tensors our per-block AOTAutograd + partitioner emulation saves — also
    without Inductor's joint-graph passes (the emulation's fallback when they fail on a graph)
    when attention is SDPA. (With eager attention and no joint passes the partitioner keeps
    38 % more; the trace's note says which partitioner ran.)"""
    from vramplan.trace import compile as tc

    if not joint_passes:
        def refuse() -> object:
            def partition(*a: object, **k: object) -> object:
                raise RuntimeError("joint-graph passes refused")
            return partition
        monkeypatch.setattr(tc, "_inductor_partition", refuse)
    make, x, cos, sin = _layer_and_inputs(attention)
    ours = make()
    compiler = BlockCompiler(paused_dispatch)
    compiler.wrap(ours)
    ours(x, position_embeddings=(cos, sin), attention_mask=None)  # compiles (first call)
    emulated = _saved(ours, x, cos, sin)
    assert ("skipped" in compiler.partitioner) is not joint_passes
    real_layer = make()
    real = _saved(torch.compile(real_layer, backend="inductor"), x, cos, sin)
    # (torch.compile re-creates the parameters' views, so compare against its own parameter set)
    eager = _saved(make(), x, cos, sin)
    assert emulated == real
    assert sum(b for _, b in emulated) < sum(b for _, b in eager)


@pytest.mark.skipif(NO_CC, reason="Inductor on CPU needs a C compiler")
def test_meta_graph_saves_what_real_torch_compile_saves() -> None:
    """The emulation as the trace runs it, on meta tensors, keeps for backward what a Llama
    decoder layer compiled for real (Inductor, CPU) keeps: as many tensors, as many bytes. Eager
    attention, whose kernels are the same on every device (the CPU's SDPA kernel saves other
    tensors than the emulated GPU's). Inductor's joint-graph passes take a graph output on the
    meta device for a value without data and drop the code computing it: before the emulation
    hid the meta device from that pass, torch 2.14.1 kept nothing here (the joint graph had
    lost the layer's output and its gradients) and 2.13.0, whose min-cut then failed, fell back
    to the partitioner alone and kept 16 tensors (1,910,784 B) where the real layer keeps 13
    (1,378,304 B)."""
    make, x, cos, sin = _layer_and_inputs("eager")
    layer = make().to("meta")
    compiler = BlockCompiler(paused_dispatch)
    compiler.wrap(layer)
    xm, cm, sm = (t.detach().to("meta") for t in (x, cos, sin))
    layer(xm.requires_grad_(), position_embeddings=(cm, sm), attention_mask=None)  # compiles (first call)
    assert compiler.partitioner.startswith("Inductor's partition_fn") and not compiler.failures
    ((saved, inputs),) = compiler.saved.values()
    (nbytes,) = compiler.saved_bytes.values()
    real = _saved_new(torch.compile(make(), backend="inductor"), x, cos, sin)
    assert (saved - inputs, nbytes) == (len(real), sum(b for _, b in real))
    assert all(t.device.type == "meta" for t in layer.parameters())


def test_compile_lowers_the_traced_activations() -> None:
    spec = tiny_spec("llama-3.1-8b", layers=2)
    base = Workload(task="train", batch=2, seq=128, precision="bf16")
    eager = trace_workload(spec, base, options=NO_WS)
    comp = trace_workload(spec, base.replace(compile=True), options=NO_WS)
    note = next(n for n in comp.notes if "torch.compile emulated" in n)
    assert "2 blocks" in note and "partition" in note
    assert comp.peak_allocated < eager.peak_allocated


def test_compile_traces_checkpointed_blocks_inside_their_checkpoint() -> None:
    spec = tiny_spec("llama-3.1-8b", layers=2)
    w = Workload(task="train", batch=2, seq=128, precision="bf16", compile=True, checkpointing="full",
                 checkpoint_every=2)
    r = trace_workload(spec, w, options=NO_WS)
    assert any("1 blocks compiled with their activation checkpoint inside the graph" in n for n in r.notes)
    assert any("(2 blocks" in n for n in r.notes) and not any("not emulated" in n for n in r.notes)


def _saved_new(layer, x, cos, sin) -> list[tuple[tuple[int, ...], int]]:
    """As :func:`_saved`, also leaving out the rotary inputs (existing memory) and the CPU
    generator state a checkpoint keeps to replay dropout (a host tensor on a GPU too)."""
    own = {t.untyped_storage().data_ptr() for t in (*layer.parameters(), x, cos, sin)}
    seen: dict[int, tuple[tuple[int, ...], int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in own and t.dtype != torch.uint8:
            seen[ptr] = (tuple(t.shape), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, position_embeddings=(cos, sin), attention_mask=None)
    return sorted(seen.values())


@pytest.mark.skipif(NO_CC, reason="Inductor on CPU needs a C compiler")
@pytest.mark.parametrize("how", ["transformers", "vramplan"])
def test_compiled_checkpointed_block_saves_what_real_torch_compile_saves(how: str) -> None:
    """A checkpointed Llama decoder layer under torch.compile (Inductor, CPU: the checkpoint
    becomes a tagged region of the compiled graph) keeps for backward what the emulation keeps
    — the checkpoint's inputs only — whether transformers' gradient checkpointing or vramplan's
    own wrapper checkpoints it; eager checkpointing keeps the same, and an uncheckpointed
    compiled layer keeps more."""
    import functools

    from torch.utils.checkpoint import checkpoint

    from vramplan.trace import features

    make, x, cos, sin = _layer_and_inputs("sdpa")

    def checkpointed():
        layer = make()
        if how == "transformers":
            layer.gradient_checkpointing = True
            layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
        else:
            features._wrap_checkpoint(layer, {"use_reentrant": False})
        return layer

    ours = checkpointed()
    compiler = BlockCompiler(paused_dispatch)
    compiler.wrap(ours)
    ours(x, position_embeddings=(cos, sin), attention_mask=None)  # compiles (first call)
    assert compiler.checkpointed == 1 and not compiler.failures and compiler.cache
    emulated = _saved_new(ours, x, cos, sin)
    real = _saved_new(torch.compile(checkpointed(), backend="inductor"), x, cos, sin)
    assert emulated == real == []
    plain = make()
    BlockCompiler(paused_dispatch).wrap(plain)
    assert _saved_new(plain, x, cos, sin)  # without the checkpoint the compiled layer keeps tensors


def _saved_by(fn, *inputs) -> list[tuple[tuple[int, ...], int]]:
    own = {t.untyped_storage().data_ptr() for t in inputs}
    seen: dict[int, tuple[tuple[int, ...], int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in own:
            seen[t.untyped_storage().data_ptr()] = (tuple(t.shape), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sorted(seen.values())


@pytest.mark.skipif(NO_CC, reason="Inductor on CPU needs a C compiler")
def test_compiled_chunk_cross_entropy_keeps_per_token_values_as_real_torch_compile() -> None:
    """torchtune's compute_cross_entropy compiled for real (Inductor, CPU) keeps two [T, 1] fp32
    values per chunk, where eager keeps the chunk's fp32 log-softmax [T, V]; the emulation's
    compiled chunk keeps per-token values only too (a few more bytes a token: the gather index
    and the mask) and computes the same loss."""
    import torch.nn.functional as F

    from vramplan.trace.loss import CompiledChunkCrossEntropy

    def compute_cross_entropy(logits, labels):  # torchtune 0.6.1, CEWithChunkedOutputLoss
        return F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")

    torch.manual_seed(0)
    t, v = 64, 1000
    x = torch.randn(t, v, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, v, (t,))
    labels[:5] = -100
    real = _saved_by(torch.compile(compute_cross_entropy, backend="inductor"), x, labels)
    eager = _saved_by(compute_cross_entropy, x, labels)
    ce = CompiledChunkCrossEntropy()
    compiler = BlockCompiler(paused_dispatch)
    compiler.wrap(ce)
    ours = _saved_by(ce, x, labels)
    assert real == [((t, 1), 4 * t), ((t, 1), 4 * t)]
    assert max(b for _, b in eager) == 4 * t * v
    assert ours and all(b <= 8 * t for _, b in ours) and not compiler.failures
    assert torch.allclose(ce(x, labels), compute_cross_entropy(x, labels))


def test_compile_drops_the_chunked_losss_fp32_chunks() -> None:
    spec = tiny_spec("llama-3.1-8b", layers=2)
    base = Workload(task="train", batch=2, seq=256, precision="bf16", loss="chunked")
    eager = trace_workload(spec, base, options=NO_WS)
    comp = trace_workload(spec, base.replace(compile=True), options=NO_WS)
    vocab = spec.config["vocab_size"]
    assert eager.peak_allocated - comp.peak_allocated > 2 * 256 * vocab * 4 * 0.5  # about the fp32 chunks' bytes
    assert any("compute_cross_entropy compiled" in n for n in comp.notes)


@pytest.mark.skipif(NO_CC, reason="Inductor on CPU needs a C compiler")
@pytest.mark.parametrize("policy", ["op", "selective"])
def test_compiled_selective_checkpoint_saves_what_real_torch_compile_saves(policy: str) -> None:
    """A Llama decoder layer under selective checkpointing (torchtitan's op policy, Megatron's)
    compiled for real (Inductor, CPU) keeps for backward exactly the tensors the emulation keeps:
    the policy's tags go into the compiled graph as Dynamo's ``tag_activation_checkpoint`` puts
    them, and the partitioner saves the tagged ops backward reads (fewer than eager SAC's
    must-saves: the emulation once kept those, an upper bound)."""
    import functools

    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from vramplan.trace import sac

    make, x, cos, sin = _layer_and_inputs("sdpa")
    context = sac._op_context if policy == "op" else functools.partial(create_selective_checkpoint_contexts,
                                                                         sac.megatron_policy)

    def checkpointed():
        layer = make()
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False, context_fn=context)
        return layer

    ours = checkpointed()
    compiler = BlockCompiler(paused_dispatch)
    compiler.wrap(ours)
    ours(x, position_embeddings=(cos, sin), attention_mask=None)  # compiles (first call)
    assert not compiler.failures and compiler.checkpointed == 1
    emulated = _saved_new(ours, x, cos, sin)
    real = _saved_new(torch.compile(checkpointed(), backend="inductor"), x, cos, sin)
    assert emulated == real and real  # the policy's saved matmul outputs
    plain = make()
    BlockCompiler(paused_dispatch).wrap(plain)
    assert sum(b for _, b in real) < sum(b for _, b in _saved_new(plain, x, cos, sin))
