"""FLOPs of one step on one rank, for the runtime model.

Matmul FLOPs are 2 · tokens · active weight elements (MoE: top_k of the experts), plus the
attention core 2 · queries · keys · heads · (d_qk + d_v) — causal flash/SDPA kernels skip
the masked half, eager attention computes the whole square. A training step is forward +
backward (2× for trainable matmuls and attention, 1× for frozen ones: input gradients only)
+ recompute (full checkpointing: the forward of the checkpointed layers again; selective:
their attention core), times ``grad_accum``. TP splits matmuls, PP layers, CP queries.
"""

from __future__ import annotations

from vramplan.workload import Attention, Checkpointing, Task, Workload

from .arch import Arch, LayerGroup, Linear
from .blocks import head_linear
from .regime import Trainable


def _active(lin: Linear, g: LayerGroup) -> float:
    if lin.expert:
        return lin.params * g.ffn.top_k / max(1, g.ffn.experts)
    return float(lin.params)


def _keys(g: LayerGroup, queries: int, context: int, w: Workload) -> float:
    """Average keys per query: ``context`` keys visible to the last of ``queries`` queries."""
    a = g.attn
    if a.causal and w.attention is not Attention.EAGER:
        keys = context - (queries - 1) / 2
    else:
        keys = float(context)
    return min(keys, float(a.window)) if a.window else keys


def _core(g: LayerGroup) -> int:
    a = g.attn
    return 2 * a.heads * (a.head_dim + a.v_head_dim)


def step_flops(arch: Arch, w: Workload, tr: Trainable, seq: int | None = None) -> float:
    """``seq``: tokens per sequence (ViT: patches + 1); defaults to ``w.seq``."""
    p = w.parallel
    split = p.tp * p.pp * p.cp
    if w.task is Task.GENERATE:
        return _generate(arch, w) / (p.tp * p.pp)
    seq = w.seq if seq is None else seq
    tokens = w.batch * seq
    if arch.head.kind == "cls":
        positions = w.batch
    else:
        positions = tokens
    head = 2.0 * positions * head_linear(arch.head, arch.hidden).matrix
    head += sum(2.0 * tokens * lin.matrix for lin in arch.head.linears if lin.role != "head")
    frozen = trainable = adapters = core = 0.0
    for g in arch.groups:
        for lin in g.linears:
            f = 2.0 * tokens * _active(lin, g) * g.count
            if tr.full:
                trainable += f
            else:
                frozen += f
                adapters += 2.0 * tokens * tr.adapter_params(lin) * g.count
        core += g.count * tokens * _keys(g, seq, seq, w) * _core(g)
    if w.task is Task.INFER:
        return (trainable + frozen + core + head) / split
    fwd_layers = trainable + frozen + adapters + core
    total = 3 * (trainable + adapters + core) + 2 * frozen + (3 if tr.full else 2) * head
    f = w.checkpointed_share
    if w.checkpointing is Checkpointing.FULL:
        total += f * fwd_layers
    elif w.checkpointing is Checkpointing.SELECTIVE:
        total += f * core
    elif w.checkpointing is Checkpointing.OP:  # every other matmul; attention kernels saved
        total += f * 0.5 * (trainable + frozen + adapters)
    return total * w.grad_accum / split


def _generate(arch: Arch, w: Workload) -> float:
    b, prompt, new = w.batch, w.seq, w.new_tokens
    head = 2.0 * head_linear(arch.head, arch.hidden).matrix
    total = b * head * new  # logits of the last position, prefill and each decode step
    steps = max(0, new - 1)
    for g in arch.groups:
        m = 2.0 * sum(_active(lin, g) for lin in g.linears) * g.count
        total += m * b * (prompt + steps)
        total += g.count * b * prompt * _keys(g, prompt, prompt, w) * _core(g)
        total += g.count * b * _decode_keys(prompt, steps, g.attn.window) * _core(g)
    return total


def _decode_keys(prompt: int, steps: int, window: int | None) -> float:
    """Σ over decode steps j = 1..steps of the keys seen, min(prompt + j, window)."""
    grow = steps if not window else max(0, min(steps, window - prompt))
    keys = grow * prompt + grow * (grow + 1) / 2
    if window:
        keys += (steps - grow) * window
    return float(keys)
