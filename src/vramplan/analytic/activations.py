"""Activation bytes of one rank: saved terms evaluated for a shape, checkpointing applied.

Checkpointing (``checkpoint_fraction`` f of the layers):

- none: every layer keeps :func:`.blocks.block_saved`.
- full: a checkpointed layer keeps only its input; in backward one layer is recomputed, so
  its whole saved set is alive again next to the checkpoints (Korthikanti: 2sbh per layer
  plus one layer's working set).
- selective (Korthikanti et al. 2022): checkpointed layers drop the attention core (QKᵀ,
  softmax, dropout — the s² terms) and recompute it in backward. With flash/SDPA kernels
  there is no s² term, so selective saves nothing more than flash already does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from vramplan.workload import Attention, Checkpointing, Workload

from .arch import Arch
from .blocks import (
    Ctx,
    Saved,
    backward_transient,
    block_input,
    block_saved,
    head_saved,
    infer_working,
    norm_keeps_input,
)
from .parallel import Stage, tokens_per_rank


@dataclass(frozen=True)
class TokenShape:
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
    positions: int = 0
    """Positions whose logits the head computes (last stage)."""
    hidden: int = 0
    """Width of the hidden states the head reads."""


def stage_acts(arch: Arch, stage: Stage, w: Workload, ctx: Ctx, tokens: int, seq: int,
               positions: int) -> StageActs:
    """``positions``: tokens (or images) whose logits the head computes, on this rank."""
    p, h = w.parallel, arch.hidden
    layers = layer_full = recompute = transient = checkpointed = 0
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
        else:
            ck, rc = full, 0
        layers += k * ck + (n - k) * full
        layer_full = max(layer_full, full)
        recompute = max(recompute, rc if k else 0)
        at, mt = backward_transient(g, ctx)
        transient = max(transient, size(at, shape), size(mt, shape))
    head = size(head_saved(arch.head, arch.norm, ctx, h), TokenShape(tokens, seq, p.tp, p.sp)) if stage.head else 0
    embed = math.ceil(tokens * h / (p.tp if p.sp else 1)) if (stage.embed and arch.embed_dropout > 0) else 0
    mask = 0
    if ctx.attention is Attention.EAGER and arch.head.kind == "lm":
        mask = tokens_per_rank(w, seq) * seq * ctx.rg.stream
    classes = arch.head.classes // (p.tp if arch.head.kind != "cls" else 1)
    return StageActs(
        layers=layers, layer_full=layer_full, recompute=recompute, transient=transient,
        head=head, embed=embed, logits=positions * classes if stage.head else 0, mask=mask,
        checkpointed=checkpointed, softcap=arch.head.softcap, positions=positions if stage.head else 0, hidden=h,
    )


def checkpointed_layers(w: Workload, n: int) -> int:
    """Layers of a group of ``n`` that are checkpointed (``checkpoint_fraction``, rounded)."""
    if w.checkpointing is Checkpointing.NONE:
        return 0
    return min(n, math.floor(w.checkpoint_fraction * n + 0.5))


def infer_layer(stage: Stage, w: Workload, ctx: Ctx, h: int, tokens: int, kv_len: int) -> int:
    """The largest set of tensors alive at once in a no-grad forward of one layer."""
    p = w.parallel
    worst = 0
    for g, _ in stage.groups:
        shape = TokenShape(tokens, kv_len if not g.attn.window else min(kv_len, g.attn.window), p.tp, p.sp)
        at, mt = infer_working(g, ctx, h)
        worst = max(worst, size(at, shape), size(mt, shape))
    return worst
