"""Activation bytes of one rank: saved terms evaluated for a shape, checkpointing applied.

Checkpointing (``checkpoint_fraction`` f of the layers):

- none: every layer keeps :func:`.blocks.block_saved`.
- full: a checkpointed layer keeps only its input; in backward one layer is recomputed, so
  its whole saved set is alive again next to the checkpoints (Korthikanti: 2sbh per layer
  plus one layer's working set).
- selective (Korthikanti et al. 2022): checkpointed layers drop the attention core (QKᵀ,
  softmax, dropout — the s² terms) and recompute it in backward. With flash/SDPA kernels
  there is no s² term, so selective saves nothing more than flash already does.
- op (torchtitan's op-level SAC, see ``vramplan.trace.sac``): a checkpointed layer keeps its
  input, every other matmul output and the attention kernel's outputs
  (:func:`.blocks.op_sac_saved`); in backward the rest of the layer is recomputed.
- ``activation_offload`` (torchtune ``OffloadActivations``, see ``vramplan.trace.offload``):
  every saved tensor of the layers goes to pinned host memory (power-of-two blocks); the GPU
  keeps about one layer's saved set (the forward stash, the tensors brought back in backward).
  torchtune copies per save (an input read by q, k and v goes three times) and also copies the
  weights that matmuls save (``weight.t()`` is no ``nn.Parameter``). Approximation: each saved
  term counts as one tensor; the RoPE tables a checkpointed layer saves are not counted.
- ``checkpoint_every`` k: of the layers the fraction covers, those whose 1-based index is a
  multiple of k are checkpointed (torchtitan's layer SAC); per layer group here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from vramplan._dataclass import dataclass
from vramplan.workload import Attention, Checkpointing, Workload

from .arch import Arch, LayerGroup
from .blocks import (
    Ctx,
    Saved,
    Terms,
    backward_transient,
    block_input,
    block_saved,
    head_saved,
    infer_working,
    norm_keeps_input,
    op_sac_saved,
)
from .parallel import Stage, logit_split, tokens_per_rank


@dataclass(frozen=True)
class TokenShape:
    """The token counts one rank's activations are sized by."""

    tokens: int
    """Tokens of one micro-batch on this rank."""
    kv_len: int
    """Keys each query attends to in materialised score matrices."""
    tp: int = 1
    sp: bool = False


def size(terms: Iterable[Saved], shape: TokenShape, *, core: bool = True) -> int:
    total = 0.0
    for t in terms:
        if t.core and not core:
            continue
        b = t.per_token * shape.tokens + t.per_pair * shape.tokens * shape.kv_len
        if t.shard == "tp" or shape.sp:
            b /= shape.tp
        total += b
    return math.ceil(total)


@dataclass(frozen=True)
class StageActs:
    """Activation bytes of one pipeline stage for one micro-batch."""

    layers: int
    """Saved by all layers of the stage for one micro-batch, under the checkpointing policy."""
    layer_full: int
    """The largest one-layer saved set without checkpointing."""
    recompute: int
    """Re-materialised in backward for one layer (0 without checkpointing)."""
    transient: int
    """The largest gradient working set inside one layer's backward."""
    head: int
    """Final norm / head inputs saved (last stage)."""
    embed: int
    """Embedding dropout mask (first stage)."""
    logits: int
    """Logit elements on this rank (positions × classes / TP)."""
    mask: int = 0
    """Eager attention: HF's 4-D additive mask, alive through the forward."""
    checkpointed: int = 0
    """Layers of the stage under checkpointing."""
    softcap: bool = False
    """Final-logit soft-capping keeps one more 16-bit logit-sized tensor (the tanh output)."""
    host: int = 0
    """``activation_offload``: pinned host bytes of the layers' offloaded saved tensors."""
    positions: int = 0
    """Positions whose logits the head computes (last stage)."""
    hidden: int = 0
    """Width of the hidden states the head reads."""


def stage_acts(arch: Arch, stage: Stage, w: Workload, ctx: Ctx, tokens: int, seq: int,
               positions: int) -> StageActs:
    """``positions``: tokens (or images) whose logits the head computes, on this rank."""
    p, h = w.parallel, arch.hidden
    layers = layer_full = recompute = transient = checkpointed = host = one_layer = gpu_layers = 0
    offload = w.activation_offload and w.training
    for g, n in stage.groups:
        shape = TokenShape(tokens, seq, p.tp, p.sp)
        full_terms = block_saved(g, ctx, h)
        full = size(full_terms, shape)
        k = checkpointed_layers(w, n)
        checkpointed += k
        if w.checkpointing is Checkpointing.FULL:
            ck = size(block_input(ctx, h), shape)
            # the recomputed first norm saves the checkpointed input itself when dtypes match
            rc = full - (ck if norm_keeps_input(g, ctx) else 0)
        elif w.checkpointing is Checkpointing.SELECTIVE:
            ck = size(full_terms, shape, core=False)
            rc = full - ck
        elif w.checkpointing is Checkpointing.OP:
            inp = size(block_input(ctx, h), shape)
            ck = inp + size(op_sac_saved(g, ctx), shape)
            rc = full - ck  # the cached outputs and the input are reused by the recomputed layer
        else:
            ck, rc = full, 0
        layers += k * ck + (n - k) * full
        layer_full = max(layer_full, full)
        recompute = max(recompute, rc if k else 0)
        at, mt = backward_transient(g, ctx)
        transient = max(transient, size(at, shape), size(mt, shape))
        if offload:
            # what goes to pinned host memory: what autograd saves (the checkpoint inputs of a
            # checkpointed layer); SAC's cached outputs stay in its storage on the GPU
            inp_terms = block_input(ctx, h)
            host += (n - k) * (offloaded_bytes(full_terms, shape) + _weight_views(g, ctx, p.tp)) \
                + k * offloaded_bytes(inp_terms, shape)
            resident = (ck - size(inp_terms, shape)) if k and w.checkpointing is not Checkpointing.FULL else 0
            gpu_layers += k * resident
            one_layer = max(one_layer, stash_bytes(full_terms, shape) if n > k else 0,
                            stash_bytes(inp_terms, shape) if k else 0)
    if offload:  # GPU: SAC-cached outputs + the forward stash / the tensors brought back
        layers = gpu_layers + one_layer
        head_terms = head_saved(arch.head, arch.norm, ctx, h) if stage.head else Terms()
        host += offloaded_bytes([t for t in head_terms if not t.name.startswith("lm head")],
                                TokenShape(tokens, seq, p.tp, p.sp))
    head = size(head_saved(arch.head, arch.norm, ctx, h), TokenShape(tokens, seq, p.tp, p.sp)) if stage.head else 0
    embed = math.ceil(tokens * h / (p.tp if p.sp else 1)) if (stage.embed and arch.embed_dropout > 0) else 0
    mask = 0
    if ctx.attention is Attention.EAGER and arch.head.kind == "lm":
        mask = tokens_per_rank(w, seq) * seq * ctx.rg.stream
    classes = arch.head.classes // logit_split(arch, w)
    return StageActs(
        layers=layers, layer_full=layer_full, recompute=recompute, transient=transient,
        head=head, embed=embed, logits=positions * classes if stage.head else 0, mask=mask,
        checkpointed=checkpointed, softcap=arch.head.softcap, positions=positions if stage.head else 0, hidden=h,
        host=host,
    )


def offloaded_bytes(terms: Iterable[Saved], shape: TokenShape) -> int:
    """Pinned host bytes of saved tensors under torchtune-style offload: each term stands for
    one tensor, copied once per save (``packs``) into a power-of-two pinned block when it has
    at least 1024 bytes."""
    total = 0
    for t in terms:
        b = size((t,), shape)
        if b >= 1024:
            total += t.packs * (1 << (b - 1).bit_length())
    return total


def _weight_views(g: LayerGroup, ctx: Ctx, tp: int) -> int:
    """An ``mm`` saves its weight (``weight.t()``, or autocast's 16-bit copy) for the input's
    gradient; that is no ``nn.Parameter``, so torchtune's offloading copies it to pinned memory
    too (routed experts not counted)."""
    b = ctx.rg.compute if ctx.rg.autocast else ctx.rg.weight
    total = 0
    for lin in g.linears:
        if not lin.expert:
            n = lin.matrix * b // (tp if lin.tp else 1)
            if n >= 1024:
                total += 1 << (n - 1).bit_length()
    return total


def stash_bytes(terms: Iterable[Saved], shape: TokenShape) -> int:
    """The five largest offloadable saved tensors of a layer: torchtune's forward stash bound."""
    sizes = sorted((size((t,), shape) for t in terms), reverse=True)
    return sum(b for b in sizes[:5] if b >= 1024)


def checkpointed_layers(w: Workload, n: int) -> int:
    """Layers of a group of ``n`` that are checkpointed: the first ``checkpoint_fraction``
    (rounded), of which every ``checkpoint_every``-th (1-based multiples of k)."""
    if w.checkpointing is Checkpointing.NONE:
        return 0
    return min(n, math.floor(w.checkpoint_fraction * n + 0.5)) // w.checkpoint_every


def infer_layer(stage: Stage, w: Workload, ctx: Ctx, h: int, tokens: int, kv_len: int) -> int:
    """The largest set of tensors alive at once in a no-grad forward of one layer."""
    p = w.parallel
    worst = 0
    for g, _ in stage.groups:
        shape = TokenShape(tokens, kv_len if not g.attn.window else min(kv_len, g.attn.window), p.tp, p.sp)
        at, mt = infer_working(g, ctx, h)
        worst = max(worst, size(at, shape), size(mt, shape))
    return worst
