"""Analytic FLOPs of one micro-batch on one model replica (before TP/PP/CP splits).

Conventions (Kaplan et al. 2020; Narayanan et al. 2021): a matmul parameter costs
2 FLOPs per token forward and 4 backward (activation + weight gradient), so a training
step is ~6·N·tokens. Attention adds ``2·b·s·s_kv·heads·(d_qk + d_v)`` per layer forward
(``4·b·s²·h`` for standard heads), where causal flash/SDPA kernels halve ``s_kv``.
A frozen base under LoRA skips its weight gradients: ~4·N·tokens instead of 6.
Full activation checkpointing re-runs the forward of the checkpointed layers once;
selective checkpointing re-runs the attention core only.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramplan.workload import Checkpointing, Peft, Workload

from .shape import Shape, keys_per_query


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one micro-batch on one replica, by pass."""

    forward: float
    backward: float = 0.0
    recompute: float = 0.0

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.recompute


def attention_flops(s: Shape, w: Workload, batch: int, seq: int) -> float:
    """Forward FLOPs of the attention core (scores and weighted sum) over all layers."""
    sliding = s.sliding_layers if s.sliding_window else 0
    total = 0.0
    for n_layers, window in ((s.layers - sliding, None), (sliding, s.sliding_window)):
        if n_layers <= 0:
            continue
        kpq = keys_per_query(s, seq, w, window)
        total += n_layers * 2.0 * batch * seq * kpq * s.heads * (s.qk_dim + s.v_dim)
    return total


def forward_flops(s: Shape, w: Workload, batch: int, seq: int, adapter_params: int = 0) -> float:
    tokens = batch * seq
    return 2.0 * (s.matmul_params + adapter_params) * tokens + attention_flops(s, w, batch, seq)


def train_flops(s: Shape, w: Workload, batch: int, seq: int, adapter_params: int = 0) -> StepFlops:
    """FLOPs of forward, backward and recomputation for one training micro-batch."""
    tokens = batch * seq
    attn = attention_flops(s, w, batch, seq)
    fwd = 2.0 * (s.matmul_params + adapter_params) * tokens + attn
    if w.peft is Peft.NONE:
        bwd = 4.0 * s.matmul_params * tokens + 2.0 * attn
    else:  # frozen base: activation gradients only; adapters get both
        bwd = 2.0 * s.matmul_params * tokens + 4.0 * adapter_params * tokens + 2.0 * attn
    frac = w.checkpointed_share
    head = 2.0 * s.head_params * tokens
    if w.checkpointing is Checkpointing.FULL:
        recompute = frac * max(fwd - head, 0.0)
    elif w.checkpointing is Checkpointing.SELECTIVE:
        recompute = frac * attn
    elif w.checkpointing is Checkpointing.OP:  # torchtitan op SAC: every other matmul, attention saved
        recompute = frac * 0.5 * max(fwd - head - attn, 0.0)
    else:
        recompute = 0.0
    return StepFlops(fwd, bwd, recompute)


def decode_flops(s: Shape, w: Workload, batch: int, context: float) -> float:
    """FLOPs of generating one token for ``batch`` sequences that attend ``context`` keys."""
    sliding = s.sliding_layers if s.sliding_window else 0
    attn = 0.0
    for n_layers, window in ((s.layers - sliding, None), (sliding, s.sliding_window)):
        if n_layers > 0:
            keys = min(context, window) if window else context
            attn += n_layers * 2.0 * batch * keys * s.heads * (s.qk_dim + s.v_dim)
    return 2.0 * s.matmul_params * batch + attn
