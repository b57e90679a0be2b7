"""FLOPs of one step on one rank: the analytic method's exact weights laid out for the one FLOPs
model (:mod:`vramplan.models.flops`, shared with the runtime model).

Matmul weights are the layers' linears (MoE: top_k of the experts), LoRA adapters those
:class:`~.regime.Trainable` wraps, the head its output matrix (per position, or per sample for a
classifier) plus any head transform (per token).
"""

from __future__ import annotations

from vramplan.models.flops import AttentionGroup, FlopsLayout
from vramplan.models.flops import step_flops as _step_flops
from vramplan.workload import Workload

from .arch import Arch, LayerGroup, Linear
from .blocks import head_linear
from .regime import Trainable


def _active(lin: Linear, g: LayerGroup) -> float:
    if lin.expert:
        return lin.params * g.ffn.top_k / max(1, g.ffn.experts)
    return float(lin.params)


def layout(arch: Arch, tr: Trainable) -> FlopsLayout:
    """The FLOPs layout of ``arch`` with the adapters (and trainable base) of ``tr``."""
    matmul = adapters = 0.0
    attention: list[AttentionGroup] = []
    causal = True
    for g in arch.groups:
        for lin in g.linears:
            matmul += _active(lin, g) * g.count
            if not tr.full:
                adapters += tr.adapter_params(lin) * g.count
        a = g.attn
        attention.append(AttentionGroup(g.count, 2 * a.heads * (a.head_dim + a.v_head_dim), a.window))
        causal = causal and a.causal
    head = arch.head
    return FlopsLayout(
        matmul=matmul, attention=tuple(attention), causal=causal, adapters=adapters, trains_base=tr.full,
        head=float(head_linear(head, arch.hidden).matrix),
        head_tokens=float(sum(lin.matrix for lin in head.linears if lin.role != "head")),
        cls=head.kind == "cls",
    )


def step_flops(arch: Arch, w: Workload, tr: Trainable, seq: int | None = None) -> float:
    """``seq``: tokens per sequence (ViT: patches + 1); defaults to ``w.seq``."""
    return _step_flops(layout(arch, tr), w, seq)
