"""The one FLOPs model: FLOPs of a training, inference or generation step of a transformer.

Conventions (Kaplan et al. 2020; Narayanan et al. 2021): a matmul weight costs 2 FLOPs per token
forward and 4 backward (activation + weight gradient), so a training step is ~6·N·tokens; a frozen
base under LoRA skips its weight gradients (~4·N·tokens), its adapters train. Attention adds
``2·queries·keys·heads·(d_qk + d_v)`` per layer forward — causal flash/SDPA kernels skip the
masked blocks (~half of s²), eager attention computes the whole square and masks it. Full
activation checkpointing re-runs the forward of the checkpointed layers once (every layer, or
every k-th: ``checkpoint_every``); selective checkpointing re-runs their attention core;
torchtitan's op-level policy saves every other matmul and the attention kernels
(``_op_sac_save_list``, ``mm_count % 2``, torchtitan distributed/activation_checkpoint.py), so
it re-runs half of the layer matmuls. Cut Cross-Entropy (``loss=cce``) recomputes the
logits block by block in its backward (cut_cross_entropy/cce_backward.py): one more head forward;
the other loss implementations do the head's usual matmuls (Liger all of them inside the
forward). Generation computes the logits of the last prompt
position (transformers' ``logits_to_keep``), then one token per decode step against a growing
(or windowed) context.

The analytic method (:mod:`vramplan.analytic.flops`, from its exact per-layer weights) and the
runtime model (:func:`layout_of` a :class:`~.shape.ModelShape`) describe a model as a
:class:`FlopsLayout`; the formulas below are the only place FLOPs are counted. A trace counts
its own with torch's ``FlopCounterMode`` (``TraceResult.flops``).
"""

from __future__ import annotations

from vramplan._dataclass import dataclass
from vramplan.workload import Attention, Checkpointing, Loss, Task, Workload

from .shape import ModelShape


@dataclass(frozen=True)
class AttentionGroup:
    """``layers`` layers with the same attention core."""

    layers: int
    core: int
    """FLOPs per (query, key) pair over all heads: 2 · heads · (d_qk + d_v)."""
    window: int | None = None
    """Sliding window (keys a query sees at most)."""


@dataclass(frozen=True)
class FlopsLayout:
    """What the FLOPs of a model depend on; weights in elements, for the whole model replica."""

    matmul: float
    """Weight elements of the layers one token multiplies through (MoE: top_k / experts of the
    routed stacks); the input embedding lookup is not a matmul."""
    attention: tuple[AttentionGroup, ...]
    causal: bool
    adapters: float = 0.0
    """LoRA adapter elements one token multiplies through (they always train)."""
    trains_base: bool = True
    """The layers' weights train (full fine-tuning); else frozen (PEFT): no weight gradients."""
    head: float = 0.0
    """Output-head matrix elements per logit position (a tied embedding counts here)."""
    head_tokens: float = 0.0
    """Head matmuls applied to every token before the output matrix (BERT's MLM transform)."""
    cls: bool = False
    """The head sees one position per sample (classifiers on the class token)."""


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one micro-batch on one replica, by pass."""

    forward: float
    backward: float = 0.0
    recompute: float = 0.0

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.recompute


def keys_per_query(seq: int, causal: bool, w: Workload, window: int | None) -> float:
    """Average keys each of ``seq`` queries attends to in a prefill, as the kernel computes them.

    Causal flash/SDPA kernels skip fully masked blocks, so they do ~half of s² work (a sliding
    window caps each query at ``window`` keys); eager attention computes the whole s×s score
    matrix and masks it.
    """
    if not causal or w.attention is Attention.EAGER:
        return float(seq)
    if window is None or window >= seq:
        return (seq + 1) / 2
    return (window * (window + 1) / 2 + (seq - window) * window) / seq


def decode_keys(prompt: int, steps: int, window: int | None) -> float:
    """Σ over decode steps j = 1..steps of the keys seen, min(prompt + j, window)."""
    grow = steps if not window else max(0, min(steps, window - prompt))
    keys = grow * prompt + grow * (grow + 1) / 2
    if window:
        keys += (steps - grow) * window
    return float(keys)


def attention_flops(f: FlopsLayout, w: Workload, batch: int, seq: int) -> float:
    """Forward FLOPs of the attention core (scores and weighted sum) over all layers."""
    return sum(g.layers * batch * seq * keys_per_query(seq, f.causal, w, g.window) * g.core
               for g in f.attention)


def _head(f: FlopsLayout, batch: int, tokens: int) -> float:
    positions = batch if f.cls else tokens
    return 2.0 * positions * f.head + 2.0 * tokens * f.head_tokens


def forward_flops(f: FlopsLayout, w: Workload, batch: int, seq: int) -> float:
    """FLOPs of one inference forward of ``batch`` sequences of ``seq`` positions on one replica."""
    tokens = batch * seq
    return 2.0 * tokens * f.matmul + attention_flops(f, w, batch, seq) + _head(f, batch, tokens)


def train_flops(f: FlopsLayout, w: Workload, batch: int, seq: int) -> StepFlops:
    """FLOPs of forward, backward and recomputation of one training micro-batch on one replica."""
    tokens = batch * seq
    layers = 2.0 * tokens * f.matmul
    adapters = 2.0 * tokens * f.adapters
    core = attention_flops(f, w, batch, seq)
    head = _head(f, batch, tokens)
    forward = layers + adapters + core + head
    weight_grads = layers + head if f.trains_base else 0.0
    backward = layers + 2 * adapters + 2 * core + head + weight_grads
    frac = checkpointed_fraction(w)
    if w.checkpointing is Checkpointing.FULL:
        recompute = frac * (layers + adapters + core)
    elif w.checkpointing is Checkpointing.SELECTIVE:
        recompute = frac * core
    elif w.checkpointing is Checkpointing.OP:  # every other matmul and the attention kernel saved
        recompute = frac * 0.5 * (layers + adapters)
    else:
        recompute = 0.0
    if w.loss in (Loss.CCE, Loss.TRL):  # both recompute the logits tile by tile in their backward
        recompute += head
    return StepFlops(forward, backward, recompute)


def checkpointed_fraction(w: Workload) -> float:
    """Share of the layers whose activations are recomputed: ``checkpoint_fraction``, of
    which every ``checkpoint_every``-th layer (torchtitan's ``selective_ac_option=k``)."""
    if w.checkpointing is Checkpointing.NONE:
        return 0.0
    return w.checkpoint_fraction / w.checkpoint_every


def generate_flops(f: FlopsLayout, w: Workload, prompt: int | None = None) -> tuple[float, float]:
    """(prefill, all decode steps) FLOPs of one generation batch on one replica: the prompt
    forward with the last position's logits, then ``new_tokens - 1`` one-token forwards (the last
    generated token is not fed back), each with its logits. ``prompt`` defaults to ``w.seq``."""
    b, new = w.batch, w.new_tokens
    prompt = w.seq if prompt is None else prompt
    head = 2.0 * f.head
    steps = max(0, new - 1)
    prefill = b * head * min(new, 1) + 2.0 * f.matmul * b * prompt
    decode = b * head * max(new - 1, 0) + 2.0 * f.matmul * b * steps
    for g in f.attention:
        prefill += g.layers * b * prompt * keys_per_query(prompt, f.causal, w, g.window) * g.core
        decode += g.layers * b * decode_keys(prompt, steps, g.window) * g.core
    return prefill, decode


def step_flops(f: FlopsLayout, w: Workload, seq: int | None = None) -> float:
    """FLOPs of one step (all micro-batches) on one rank: TP splits matmuls, PP layers, CP queries
    (generation: TP and PP). ``seq``: positions per sample (ViT: patches + 1); default ``w.seq``."""
    p = w.parallel
    if w.task is Task.GENERATE:
        return sum(generate_flops(f, w)) / (p.tp * p.pp)
    seq = w.seq if seq is None else seq
    split = p.tp * p.pp * p.cp
    if w.task is Task.INFER:
        return forward_flops(f, w, w.batch, seq) / split
    return train_flops(f, w, w.batch, seq).total * w.grad_accum / split


def layout_of(s: ModelShape, *, adapters: float = 0.0, trains_base: bool = True) -> FlopsLayout:
    """The layout of a model known by its shape only (published active parameters: a little more
    than its matmul weights — norms and biases count too)."""
    sliding = s.sliding_layers if s.sliding_window else 0
    core = 2 * s.heads * (s.qk_dim + s.v_dim)
    groups = tuple(AttentionGroup(n, core, window)
                   for n, window in ((s.layers - sliding, None), (sliding, s.sliding_window)) if n > 0)
    return FlopsLayout(matmul=float(s.matmul_params - s.head_params), attention=groups, causal=s.causal,
                       adapters=float(adapters), trains_base=trains_base, head=float(s.head_params))


__all__ = [
    "AttentionGroup", "FlopsLayout", "StepFlops", "attention_flops", "decode_keys", "forward_flops",
    "generate_flops", "keys_per_query", "layout_of", "step_flops", "train_flops",
]
