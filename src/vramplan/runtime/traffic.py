"""Bytes moved through GPU memory (HBM/GDDR) by one micro-batch and one optimizer step.

Coarse by design: enough to tell a memory-bound phase (decode, optimizer step, small
batches) from a compute-bound one. Per-element costs are stated next to each term.
"""

from __future__ import annotations

from vramplan.models.flops import checkpointed_fraction
from vramplan.models.shape import ModelShape
from vramplan.precision import precision_model
from vramplan.quantformats import DECOMPRESSED, bytes_per_weight, format_of
from vramplan.workload import (
    Attention,
    Checkpointing,
    Loss,
    Optimizer,
    OptimizerImpl,
    Quant,
    Workload,
)

_QUANT_STORAGE = {Quant.INT8: 1.0, Quant.INT4: 0.5625, Quant.NF4: 0.5625, Quant.FP8: 1.0}
"""Stored bytes per quantised weight (4-bit: 0.5 + blockwise absmax, bitsandbytes)."""

# Elementwise traffic per token per layer in a forward pass, in elements: norms, residual
# adds, rotary, attention input/output and activation-function reads and writes.
_PER_HIDDEN = 20
_PER_FFN = 6


_FUSED = frozenset({Quant.AWQ, Quant.GPTQ, Quant.AO_INT4, Quant.AO_FP8_DYN, Quant.AO_INT8_DYN})
"""Formats whose kernels read the stored weight directly (no dequantised copy per forward)."""


def reads_packed(w: Workload) -> bool:
    """The format's matmul kernel reads the stored (packed) weight directly."""
    return w.quant in _FUSED


def _format_bytes(w: Workload) -> float | None:
    if format_of(w.quant) is None:
        return None
    if w.quant in DECOMPRESSED:
        return float(precision_model(w).compute)
    return bytes_per_weight(w.quant, precision_model(w).compute_dtype)


def weight_storage_bytes(w: Workload) -> float:
    """Bytes per base weight as stored on the GPU."""
    if w.quant in _QUANT_STORAGE:
        return _QUANT_STORAGE[w.quant]
    other = _format_bytes(w)
    return other if other is not None else float(precision_model(w).weight)


def matmul_weight_bytes(w: Workload) -> float:
    """Bytes per weight a matmul reads: its compute dtype (fp32: 4, else 2); a fused
    quantised kernel reads the stored weight."""
    if reads_packed(w):
        return weight_storage_bytes(w)
    return float(precision_model(w).compute)


def cast_bytes(w: Workload) -> float:
    """Bytes per weight moved, before the matmuls and serially with them, to make the
    compute-dtype copy: autocast reads the fp32 master (4 B) and writes a 16-bit copy (2 B)
    each forward (its cache lives for one autocast region); bitsandbytes dequantises the
    stored weight (storage read + 2 B write). Nothing for pure 16-bit, fp32, or weights stored in
    the compute dtype already (PEFT's 16-bit base): the precision model's ``cast_bytes``."""
    if w.quant in _QUANT_STORAGE:
        return _QUANT_STORAGE[w.quant] + 2.0
    if format_of(w.quant) is not None:  # HQQ and torchao weight-only dequantise every forward
        return 0.0 if w.quant in _FUSED or w.quant in DECOMPRESSED else weight_storage_bytes(w) + 2.0
    return float(precision_model(w).cast_bytes)


def decode_weight_bytes(w: Workload, batch: int) -> tuple[float, float]:
    """(matmul read, serial cast) bytes per weight for one decode step. 4-bit weights at
    batch 1 go through fused 4-bit GEMV kernels that read the packed weight directly."""
    if w.quant in (Quant.NF4, Quant.INT4) and batch == 1:
        return _QUANT_STORAGE[w.quant], 0.0
    return matmul_weight_bytes(w), cast_bytes(w)


def touched_params(s: ModelShape, tokens: int) -> float:
    """Parameters whose weights a micro-batch of ``tokens`` reads (MoE: experts hit)."""
    if not s.n_experts or not s.experts_per_token or s.params <= s.active_params:
        return float(s.active_params)
    k_over_e = s.experts_per_token / s.n_experts
    experts = (s.params - s.active_params) / (1.0 - k_over_e)
    dense = s.params - experts
    hit = 1.0 - (1.0 - k_over_e) ** max(tokens, 1)
    return dense + experts * hit


def activation_bytes(s: ModelShape, w: Workload, batch: int, seq: int, *, training: bool) -> float:
    """Forward activation traffic of one micro-batch (elementwise ops, eager scores, logits)."""
    tokens = batch * seq
    cb = precision_model(w).compute
    total = float(tokens) * s.layers * (_PER_HIDDEN * s.hidden + _PER_FFN * s.ffn) * cb
    if w.attention is Attention.EAGER:  # scores written, softmax (fp32) read/written, read
        total += float(s.layers) * batch * s.heads * seq * seq * (3 * cb + 4)
    if s.lm_vocab and training and w.loss is Loss.TRL:  # TRL's tiles: written by the GEMM, read by the fold
        total += float(tokens) * s.lm_vocab * 2 * cb
    elif s.lm_vocab and not (training and w.loss is Loss.CCE):  # Cut Cross-Entropy keeps logits on chip
        total += float(tokens) * s.lm_vocab * (cb + 8 if training else cb)  # fp32 CE upcast
    return total


def offloaded_activation_bytes(s: ModelShape, w: Workload, batch: int, seq: int) -> float:
    """Bytes of saved activations activation offloading sends to the host per micro-batch
    (and fetches back in the backward): the inputs of checkpointed layers, and for layers
    not checkpointed their forward activations (taken as the forward activation traffic)."""
    if not w.activation_offload:
        return 0.0
    frac = checkpointed_fraction(w) if w.checkpointing in (Checkpointing.FULL, Checkpointing.OP) else 0.0
    act = activation_bytes(s, w, batch, seq, training=True)
    inputs = float(batch * seq) * s.layers * s.hidden * precision_model(w).compute
    return frac * inputs + (1.0 - frac) * act


def train_bytes(s: ModelShape, w: Workload, batch: int, seq: int, trainable: int) -> tuple[float, float, float, float]:
    """(forward, backward, recompute, serial cast) bytes of one training micro-batch on one
    replica. The backward reuses the forward's cast copies (saved for backward)."""
    tokens = batch * seq
    touched = touched_params(s, tokens)
    weights = touched * matmul_weight_bytes(w)
    act = activation_bytes(s, w, batch, seq, training=True)
    grads = 2.0 * trainable * precision_model(w).trainable_bytes  # gradient accumulate: read + write
    fwd = weights + act
    bwd = weights + 2.0 * act + grads
    passes = 1.0
    frac = checkpointed_fraction(w)
    if w.checkpointing is Checkpointing.FULL:
        rec = frac * (weights + act)
        passes += frac
    elif w.checkpointing is Checkpointing.OP:  # half the matmuls and the pointwise ops between them
        rec = frac * 0.5 * (weights + act)
        passes += 0.5 * frac
    elif w.checkpointing is Checkpointing.SELECTIVE:
        rec = w.checkpoint_fraction * 0.1 * act
    else:
        rec = 0.0
    if w.quant in _QUANT_STORAGE:
        # bitsandbytes dequantises again in the backward (MatMul4Bit.backward:
        # ``F.dequantize_4bit(B, ctx.state)`` for grad_A, bitsandbytes/autograd/_functions.py,
        # 0.4x-0.50): the dequantised copy is not saved, unlike autocast's cast copy.
        passes += 1.0
    return fwd, bwd, rec, passes * touched * cast_bytes(w)


def decode_bytes(s: ModelShape, w: Workload, batch: int, context: float, kv_bytes: float) -> tuple[float, float]:
    """(overlappable, serial cast) bytes to generate one token: the weights once, plus
    every sequence's KV cache."""
    read, cast = decode_weight_bytes(w, batch)
    touched = touched_params(s, batch)
    weights = touched * read
    sliding = s.sliding_layers if s.sliding_window else 0
    kv = 0.0
    for n_layers, window in ((s.layers - sliding, None), (sliding, s.sliding_window)):
        if n_layers > 0:
            keys = min(context, window) if window else context
            kv += n_layers * keys * s.kv_elems * kv_bytes * batch
    return weights + kv, touched * cast


def optimizer_bytes_per_param(w: Workload) -> float:
    """Bytes read and written per (local) trainable parameter by one optimizer step.

    Minimal traffic is read(param, grad, states) + write(param, states); mixed-precision
    AdamW: (4+4+8) + (4+8) = 28 B. The foreach implementation materialises whole-list
    temporaries (~2× the minimal traffic); fused and 8-bit kernels are single-pass.
    """
    pb = float(precision_model(w).trainable_bytes)
    states = {
        Optimizer.ADAM: 2 * pb, Optimizer.ADAMW: 2 * pb, Optimizer.ADAMW_8BIT: 2.0,
        Optimizer.PAGED_ADAMW_8BIT: 2.0, Optimizer.ADAFACTOR: 0.0, Optimizer.SGD: 0.0,
        Optimizer.SGD_MOMENTUM: pb, Optimizer.LION: pb,
    }[w.optimizer]
    minimal = (pb + pb + states) + (pb + states)
    single_pass = w.optimizer_impl is OptimizerImpl.FUSED or w.optimizer in (
        Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW_8BIT
    )
    return minimal * (1.0 if single_pass else 2.0)
