"""The loss of a language-model training step, per implementation (``Workload.loss``).

The same code as the trace runs (:mod:`vramplan.trace.loss`, which cites each library's
source), written as the bytes alive at three instants: the end of the forward, inside the
loss backward, and what the loss leaves saved for the layers' backward. ``e`` is the logit
elements of the micro-batch (positions × vocabulary on this rank), ``c`` the compute dtype's
bytes, ``r`` the residual stream's (the dtype of the hidden states the head reads).

- full (transformers ``ForCausalLMLoss``): logits ``c·e``, their fp32 upcast ``4e`` (when
  ``c`` ≠ 4) and the fp32 log-softmax output ``4e`` (saved); its backward holds the
  gradients of the log-softmax output and of the logits, ``8e``.
- chunked (torchtune ``CEWithChunkedOutputLoss``, N chunks): the chunked logits ``c·e``
  and every chunk's log-softmax output ``4e`` (saved), but one chunk's upcast ``4e/N``;
  the backward holds one chunk's ``8e/N`` gradients and its 16-bit cast ``c·e/N``.
- liger (``LigerFusedLinearCrossEntropyFunction``): no logits; ``grad_input`` (``r·T·H``)
  and ``grad_weight`` (the head weight's bytes, when it trains) are computed in the forward
  and saved; while it runs, one chunk of ``next_pow2(⌈T / ⌈V/H⌉⌉)`` tokens' logits
  ``c·chunk·V``, an fp32 loss per token and (without the ``mm(out=)`` path) the chunk's
  ``[chunk, H]`` input-gradient product.
- cce (Cut Cross-Entropy): no logits; an fp32 log-sum-exp per token and an fp32 logit
  average per vocabulary entry saved (plus the 16-bit cast of fp32 hidden states under
  autocast); the backward allocates ``de`` (``c·T·H``), ``dc`` (``c·V·H``, its copy to an
  fp32 weight's dtype) and the vocabulary ordering (int64 + int32 per entry).
- trl (TRL 1.16's fused LM head on CUDA): no logits; the scored positions' hidden states copied
  (``r·T·H``), their int64 labels, an fp32 log-sum-exp per token and the label mask saved; in
  the forward seven fp32 statistics per token, one ``[min(T, 4096), 32768]`` tile buffer in the
  compute dtype, the compute-dtype cast of a token tile (when ``r`` ≠ ``c``) and of a 32,768-row
  slice of the weight (when the weight's dtype ≠ ``c``); in the backward fp32 ``grad_hidden``
  (``4·T·H``) and ``grad_weight`` (``4·V·H``, when the head trains), the same buffer and casts,
  and the gradients' casts back to the hidden states' and the weight's dtypes.
"""

from __future__ import annotations

import math

from vramplan._dataclass import dataclass
from vramplan.workload import TRL_TOKEN_TILE, TRL_VOCAB_TILE, Loss, Workload


@dataclass(frozen=True)
class LossMemory:
    """Bytes the loss holds around the end of the forward and in its backward."""

    forward_saved: int
    """Alive at the end of the forward and kept for the loss backward (activations)."""
    forward_transient: int
    """On top of ``forward_saved`` at the end of the forward, freed before backward."""
    backward_saved: int
    """Alive inside the loss backward (saved by the loss)."""
    backward_transient: int
    """On top of ``backward_saved`` inside the loss backward."""
    logits_held: int = 0
    """The output a loop holding ``out`` keeps through backward (``keep_outputs``)."""
    logits_grad: int = 0
    """The logits' gradient in the compute dtype, which the head's backward reads once the loss's
    own backward has freed the rest (``backward_saved``, ``backward_transient``)."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def liger_chunk(tokens: int, vocab: int, hidden: int) -> int:
    """Liger 0.8.5: ``min(next_pow2(⌈T / ⌈V/H⌉⌉), T)`` tokens per chunk."""
    n = _cdiv(tokens, _cdiv(vocab, max(1, hidden)))
    return min(1 if n <= 1 else 1 << (n - 1).bit_length(), tokens)


def loss_memory(w: Workload, *, tokens: int, classes: int, hidden: int, compute: int, stream: int,
                head_weight: int, head_trains: bool, autocast: bool, softcap: bool) -> LossMemory:
    """``head_weight``: bytes per element of the stored head weight; ``head_trains``: whether
    the head (or the tied embedding) gets a gradient."""
    c, e = compute, tokens * classes
    capped = e * c if softcap else 0
    upcast = 4 if c != 4 else 0
    if w.loss is Loss.FULL:
        return LossMemory(forward_saved=c * e + capped + 4 * e, forward_transient=upcast * e,
                          backward_saved=capped + 4 * e, backward_transient=8 * e, logits_held=c * e,
                          logits_grad=c * e)
    if w.loss is Loss.CHUNKED:
        one = math.ceil(e / w.loss_chunks)
        return LossMemory(forward_saved=c * e + capped + 4 * e, forward_transient=upcast * one,
                          backward_saved=capped + 4 * e, backward_transient=8 * one, logits_held=c * e,
                          logits_grad=c * e)
    vh = classes * hidden
    if w.loss is Loss.LIGER:
        chunk = liger_chunk(tokens, classes, hidden)
        grads = stream * tokens * hidden + (head_weight * vh if head_trains else 0)
        mm_out = stream == head_weight == c
        work = 4 * tokens + c * chunk * classes + (0 if mm_out else c * chunk * hidden)
        if head_trains and stream != c:
            work += c * chunk * hidden  # the input chunk cast for the in-place addmm
        return LossMemory(forward_saved=grads, forward_transient=work, backward_saved=grads, backward_transient=0)
    if w.loss is Loss.TRL:
        if w.prompt:  # (the preference collators' prompt tokens carry no label: not scored)
            tokens = max(1, tokens * (w.seq - w.prompt) // w.seq)
        rows = min(tokens, TRL_TOKEN_TILE)
        buf = c * rows * TRL_VOCAB_TILE
        h_cast = c * rows * hidden if stream != c else 0
        w_cast = c * min(classes, TRL_VOCAB_TILE) * hidden if head_weight != c else 0
        # hidden[mask], labels (int64), log_z, the entropy (SFTTrainer asks for it), the mask
        saved = stream * tokens * hidden + 17 * tokens
        fwd_work = 47 * tokens + buf + h_cast + w_cast  # 7 statistics, log(sum_exp), the per-token fields
        bwd = 4 * tokens + 4 * tokens * hidden + buf + h_cast + w_cast + (stream * tokens * hidden if stream != 4 else 0)
        if head_trains:
            bwd += 4 * vh + (head_weight * vh if head_weight != 4 else 0)
        return LossMemory(forward_saved=saved, forward_transient=fwd_work, backward_saved=saved,
                          backward_transient=bwd)
    # Cut Cross-Entropy
    cast = c * tokens * hidden if autocast and stream == 4 else 0
    saved = 4 * tokens + 4 * classes + cast
    fwd_work = 4 * tokens + 12 * tokens  # neg_dot; nonzero (int64) + its int32 copy
    bwd = 12 * classes + c * tokens * hidden
    if head_trains:
        bwd += c * vh + (head_weight * vh if head_weight != c else 0)
    return LossMemory(forward_saved=saved, forward_transient=fwd_work, backward_saved=saved, backward_transient=bwd)


__all__ = ["LossMemory", "liger_chunk", "loss_memory"]
