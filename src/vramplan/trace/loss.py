"""The loss implementations of ``Workload.loss``, with their real code's tensor sizes and lifetimes.

A causal LM's step is split where each implementation splits it: the backbone runs
(``model.base_model``, the cache it fills included), then the loss runs on its last hidden
state and the output head's weight.

- ``full`` — the model computes its own loss (transformers ``ForCausalLMLoss``, today's
  default): full-vocabulary logits in the compute dtype, ``logits.float()``, then
  ``cross_entropy`` (fp32 log-softmax output saved for backward). Not handled here.
- ``chunked`` — torchtune 0.6.1: the model outputs its logits as a list of ``N`` chunks
  (``TransformerDecoder.chunked_output``: ``[self.output(c) for c in h.chunk(N, dim=1)]``,
  torchtune/modules/transformer.py), the recipe shifts the labels
  (``torch.hstack((labels[..., 1:], ignore))``) and ``CEWithChunkedOutputLoss``
  (torchtune/modules/loss/ce_chunked_output_loss.py) upcasts and cross-entropies one chunk at
  a time (``F.cross_entropy(chunk.float(), labels, reduction="sum")``), divided by the count
  of non-ignored labels. :func:`chunked_ce` is that code, op for op (torchtune itself does not
  import next to torchao ≥ 0.13, so it is not called).
- ``liger`` — Liger Kernel 0.8.5 ``LigerFusedLinearCrossEntropyFunction``
  (liger_kernel/ops/fused_linear_cross_entropy.py): chunks of
  ``next_pow2(ceil(BT / ceil(V / H)))`` tokens; per chunk the logits ``x_c @ Wᵀ`` are
  materialised, the Triton kernel writes the loss and overwrites the logits with their
  gradient in place, and ``grad_input``/``grad_weight`` are accumulated *in the forward*
  (``zeros_like`` of the hidden states and of the weight, saved for backward). Triton does
  not run on meta: :class:`LigerFusedLinearCE` allocates what that code allocates.
- ``cce`` — Cut Cross-Entropy 25.1.1 (cut_cross_entropy/cce.py, cce_lse_forward.py,
  indexed_dot.py, cce_backward.py): the logits are never materialised; the forward keeps an
  fp32 log-sum-exp per token (+ an fp32 per-vocabulary logit average for gradient
  filtering), the backward allocates ``de = zeros_like(e)``, ``dc = zeros_like(c,
  dtype=e.dtype)`` (+ ``dc.to(c.dtype)``), two int32 lock tables and the vocabulary ordering
  (``argsort(logit_avg).to(int32)``). :class:`CutCrossEntropy` allocates the same.
- ``trl`` — TRL 1.16's fused LM head (``add_fused_lm_head`` in trl/trainer/utils.py, called with
  ``fused_lm_head=True`` by its SFT, DPO, KTO and GRPO trainers; ``ChunkedLogProbFunction`` in
  trl/kernels/chunked_logprob.py) on CUDA, where Triton folds each tile in place: the backbone's
  last hidden state without its last position, only the positions whose label is not ignored
  (``hidden[mask]``: a copy, saved), seven fp32 statistics per token, one
  ``[min(N, 4096), 32768]`` tile buffer in the compute dtype that every ``mm(out=)`` writes, the
  16-bit copy of each token tile and of each vocabulary slice of an fp32 weight; the backward
  recomputes the tiles into an fp32 ``grad_hidden`` (and ``grad_weight`` when the head trains),
  accumulated in place (``addmm(out_dtype=float32)``, torch ≥ 2.8). :class:`TrlChunkedLogProb`
  allocates the same; :func:`trl_log_probs` is the head's wrapper.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import TraceError
from ..workload import TRL_TOKEN_TILE, TRL_VOCAB_TILE, Loss

IGNORE_INDEX = -100


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def liger_chunk(bt: int, vocab: int, hidden: int) -> int:
    """Tokens per chunk of Liger's fused linear cross-entropy (``chunk_mem_const=1``)."""
    inc = _cdiv(vocab, hidden)
    return min(_next_pow2(_cdiv(bt, inc)), bt)


def causal_lm_parts(model: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module]:
    """(the transformers causal LM, its backbone, its output head); a TraceError when the model
    is not one (the loss knob needs the hidden states and the head's weight)."""
    hf: Any = model
    root = wrapper_root(model)
    if root is not None:  # (FSDP1 and DDP wrap the model: the module inside the wrapper)
        hf = root.module
    getter = getattr(hf, "get_base_model", None)
    if callable(getter):  # a PeftModel
        hf = getter()
    head = hf.get_output_embeddings() if callable(getattr(hf, "get_output_embeddings", None)) else None
    backbone = getattr(hf, "base_model", None)
    classes = _causal_lm_classes()  # (FSDP2's fully_shard subclasses the model: FSDPLlamaForCausalLM)
    if (not isinstance(head, nn.Module) or not isinstance(backbone, nn.Module) or backbone is hf
            or not any(c.__name__ in classes for c in type(hf).__mro__[:-1])):
        raise TraceError(f"the loss implementation needs a transformers causal LM (a backbone and an output "
                         f"head); {type(hf).__name__} is not one", hint="use `loss=full`")
    return hf, backbone, head


def fsdp1_root(model: nn.Module) -> Any:
    """``model`` when it is FSDP1's root unit (``FullyShardedDataParallel``), else None."""
    return model if any(c.__name__ == "FullyShardedDataParallel" for c in type(model).__mro__) else None


def wrapper_root(model: nn.Module) -> Any:
    """``model`` when it wraps the model it trains, as FSDP1's root unit and
    ``DistributedDataParallel`` do (the wrapped model is its ``module``), else None."""
    wrappers = ("FullyShardedDataParallel", "DistributedDataParallel")
    return model if any(c.__name__ in wrappers for c in type(model).__mro__) else None


def through_root(hf: nn.Module, fn: Callable[[], Any], model: nn.Module | None = None) -> Any:
    """``fn()``, a forward through the model's parts (its backbone, then a fused head), run as
    ``hf``'s forward when FSDP2 shards ``hf``: TRL's ``add_fused_lm_head`` patches ``model.forward``
    and calls the model (trl/trainer/utils.py ``_fused_forward``), so FSDP2's hooks on the root run:
    they gather the root's own parameters (the embeddings, the final norm, the head) before the
    forward and reduce-scatter their gradients after the backward; called part by part, they would
    not. Under FSDP1 (``model`` its root unit) the same, through the root unit's forward, which
    gathers its flat parameter and calls the module it wraps (the PEFT model or ``hf``); under DDP
    through its forward, which readies the reducer for the backward (``prepare_for_backward``) —
    accelerate's prepared model, which TRL calls (grpo_trainer.py:1498, ``_get_per_token_logps_and_entropies``:
    ``model(**model_inputs, labels=labels, fused_lm_head=True)``, trl 1.16.0). Elsewhere ``fn()`` as it is."""
    root = wrapper_root(model) if model is not None else None
    if root is not None:
        hf, call = root.module, root
    elif any(c.__name__ == "FSDPModule" for c in type(hf).__mro__):
        call = hf
    else:
        return fn()
    saved = hf.__dict__.get("forward")
    hf.forward = lambda *_a, **_k: fn()  # (an instance attribute: the class's forward stays)
    try:
        return call()
    finally:
        if saved is None:
            del hf.forward
        else:
            hf.forward = saved


def _causal_lm_classes() -> frozenset[str]:
    """transformers' causal LMs, and its image-text-to-text models (a vision-language model's
    backbone takes the images and gives the language model's hidden states to its head)."""
    try:
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
            MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
        )
    except ImportError:
        return frozenset()
    names: set[str] = set()
    for mapping in (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES):
        for v in mapping.values():
            names.update((v,) if isinstance(v, str) else v)
    return frozenset(names)


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """Next-token targets with the last position ignored (torchtune's recipe; transformers
    pads and shifts the same way)."""
    ignore = torch.full((labels.shape[0], 1), IGNORE_INDEX, dtype=labels.dtype, device=labels.device)
    return torch.hstack((labels[..., 1:], ignore))


def _head_weight(head: nn.Module) -> torch.Tensor:
    w = getattr(head, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise TraceError(f"the output head {type(head).__name__} has no 2-D weight", hint="use `loss=full`")
    return w


# --- torchtune ---------------------------------------------------------------------------
class CompiledChunkCrossEntropy(nn.Module):
    """torchtune 0.6.1 ``CEWithChunkedOutputLoss.compute_cross_entropy`` (``F.cross_entropy(
    logits.float(), labels, ignore_index, reduction="sum")``), the function its
    ``training.compile_loss`` hands to ``torch.compile``: a module here, compiled by
    :class:`~vramplan.trace.compile.BlockCompiler` like a block. Written as log-softmax, gather
    and a masked sum — the same value — because AOTAutograd on meta tensors loses the gradient
    through ``aten::nll_loss`` (its meta kernel has no autograd: the joint graph comes out
    without a backward); the partitioner then keeps per-token values only, as for the real
    function (tests/test_trace_compile.py), not the chunk's fp32 log-softmax."""

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        keep = labels != IGNORE_INDEX
        logp = logits.float().log_softmax(-1)
        picked = logp.gather(1, torch.where(keep, labels, 0).unsqueeze(1)).squeeze(1)
        return -(picked * keep).sum()


def chunked_ce(logits: list[torch.Tensor], labels: torch.Tensor, chunks: int,
               compiled: nn.Module | None = None) -> torch.Tensor:
    """torchtune 0.6.1 ``CEWithChunkedOutputLoss.forward``, the same ops in the same order;
    ``compiled``: its ``compute_cross_entropy`` compiled (``compile``)."""
    total_elements = (labels != IGNORE_INDEX).sum()
    label_chunks = [t.reshape(-1) for t in labels.chunk(chunks, dim=1)]
    logit_chunks = [c.reshape(-1, c.size(-1)) for c in logits]
    total_loss: Any = 0.0
    for lc, tc in zip(logit_chunks, label_chunks, strict=False):
        if compiled is not None:
            total_loss += compiled(lc, tc)
        else:
            total_loss += F.cross_entropy(lc.float(), tc, ignore_index=IGNORE_INDEX, reduction="sum")
    return total_loss / total_elements


# --- Liger ---------------------------------------------------------------------------------
class LigerFusedLinearCE(torch.autograd.Function):
    """The allocations of Liger 0.8.5's ``fused_linear_cross_entropy_forward``/``_backward``
    on CUDA (defaults: mean reduction, no bias, no z-loss, ``accum_dtype=None``).

    ``use_mm_out`` (input dtype = weight dtype = the autocast dtype when autocast is on): one
    ``[chunk, V]`` logits buffer for all chunks and ``mm(out=)`` into ``grad_input``;
    otherwise fresh logits per chunk and a ``[chunk, H]`` product copied into ``grad_input``.
    ``grad_weight`` accumulates in place (``addmm``, with ``out_dtype=float32`` for an fp32
    weight, sm80+); before sm80 the product is a ``[V, H]`` temporary."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,  # type: ignore[override]
                autocast_dtype: torch.dtype | None, sm80: bool, cuda: bool = True) -> torch.Tensor:
        """``cuda=False``: the decisions Liger's code takes on a CPU tensor (no ``mm(out=)``, no
        in-place ``addmm``), for the comparison with a real CPU run."""
        bt, hidden = x.shape
        vocab = weight.shape[0]
        chunk = liger_chunk(bt, vocab, hidden)
        need_w = weight.requires_grad
        grad_input = torch.zeros_like(x)
        grad_weight = torch.zeros_like(weight) if need_w else None
        loss_1d = torch.zeros(bt, dtype=torch.float32, device=x.device)
        mask = target != IGNORE_INDEX
        mask.sum()  # total_n_non_ignore (.item())
        del mask
        mm_dtype = autocast_dtype or x.dtype
        use_mm_out = cuda and x.dtype == weight.dtype and x.dtype == mm_dtype
        storage = torch.empty((chunk, vocab), dtype=x.dtype, device=x.device) if use_mm_out else None
        for start in range(0, bt, chunk):
            end = min(start + chunk, bt)
            xc = x[start:end]
            if storage is not None:
                logits = storage[: end - start]
                torch.mm(xc, weight.t(), out=logits)
            else:
                logits = xc @ weight.t()
            # liger_cross_entropy_kernel: loss into loss_1d, d(loss)/d(logits) into `logits` in place
            if storage is not None:
                torch.mm(logits, weight, out=grad_input[start:end])
            else:
                grad_input[start:end] = logits @ weight
            if grad_weight is not None:
                if cuda and sm80 and logits.dtype in (torch.float16, torch.bfloat16):
                    xin = xc.to(logits.dtype) if xc.dtype != logits.dtype else xc
                    del xin  # addmm(grad_weight, logits.t(), xin[, out_dtype=float32], out=grad_weight)
                else:
                    grad_weight += torch.mm(logits.t(), xc).float()
            del logits, xc
        del storage
        loss = torch.sum(loss_1d)
        del loss_1d
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        ctx.save_for_backward(grad_input.detach(), grad_weight.detach() if grad_weight is not None else None)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        grad_input, grad_weight = ctx.saved_tensors
        torch.tensor(1.0, device=grad_output.device)  # torch.equal(grad_output, tensor(1.0)); scaled in place
        return grad_input, grad_weight, None, None, None, None


# --- Cut Cross-Entropy -------------------------------------------------------------------------
class CutCrossEntropy(torch.autograd.Function):
    """The allocations of CCE 25.1.1 ``LinearCrossEntropyFunction`` (``impl="cce"``, mean
    reduction, ``linear_cross_entropy``'s default ``filter_eps="high"``, so the per-vocabulary
    logit average is kept; every label valid, so ``valids`` is None)."""

    @staticmethod
    def forward(ctx: Any, e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        b = e.shape[0]
        valid = targets != IGNORE_INDEX  # _build_flat_valids: nonzero().to(int32), dropped when all valid
        nz = torch.empty((b, 1), dtype=torch.int64, device=e.device)
        nz32 = nz.to(torch.int32)
        del valid, nz, nz32
        lse = e.new_full((b,), -float("inf"), dtype=torch.float32)
        locks = e.new_zeros((_cdiv(b, 128),), dtype=torch.int32)  # uint32 in CCE (same bytes)
        logit_avg = e.new_zeros((c.shape[0],), dtype=torch.float32) if (e.requires_grad or c.requires_grad) else None
        del locks
        neg_dot = e.new_zeros((b,), dtype=torch.float32)
        nll = neg_dot.add_(lse)
        loss = nll.mean()
        del nll, neg_dot
        ctx.save_for_backward(e, c, lse, targets, logit_avg)
        ctx.c_requires_grad = c.requires_grad
        return loss

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        e, c, lse, _targets, logit_avg = ctx.saved_tensors
        order = torch.argsort(logit_avg).to(torch.int32) if logit_avg is not None else None
        b, hidden = e.shape
        de = torch.zeros_like(e)
        dc = torch.zeros_like(c, dtype=e.dtype) if ctx.c_requires_grad else None
        nd = _cdiv(hidden, 64)
        de_locks = e.new_zeros((_cdiv(b, nd), nd), dtype=torch.int32)
        dc_locks = c.new_zeros((_cdiv(c.shape[0], nd), nd), dtype=torch.int32)
        del de_locks, dc_locks, order
        return de, dc.to(c.dtype) if dc is not None else None, None


# --- TRL -------------------------------------------------------------------------------------------


TRL_OPTIONAL = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
"""trl 1.16 ``OPTIONAL_OUTPUTS``: per-token fields besides the log-probabilities, each computed
only when asked for."""
TRL_SFT_OUTPUTS = ("log_probs", "entropy", "is_top1")
"""What ``SFTTrainer`` asks of the head (trl 1.16 trl/trainer/sft_trainer.py, ``add_fused_lm_head(...,
outputs=("log_probs", "entropy", "is_top1"))``: its entropy and token-accuracy metrics)."""


class TrlChunkedLogProb(torch.autograd.Function):
    """The allocations of TRL 1.16 ``ChunkedLogProbFunction`` on CUDA with Triton, its locals'
    lifetimes included (the last token tile's cast lives until the function returns; in the
    backward each weight slice's cast is bound to a name, so the next is made before it is freed).
    The Triton kernels write into preallocated buffers and allocate nothing: left out here, as is
    the in-place ``addmm(out_dtype=float32)`` into the gradients."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,  # type: ignore[override]
                compute_dtype: torch.dtype, outputs: tuple[str, ...]) -> tuple[torch.Tensor | None, ...]:
        ctx.set_materialize_grads(False)
        n, vocab, dev = hidden.shape[0], weight.shape[0], hidden.device
        f32 = torch.float32
        running_max = torch.full((n,), float("-inf"), device=dev, dtype=f32)
        sum_exp = torch.zeros((n,), device=dev, dtype=f32)
        x_sum_exp = torch.zeros((n,), device=dev, dtype=f32)
        sq_sum_exp = torch.zeros((n,), device=dev, dtype=f32)
        z_sum = torch.zeros((n,), device=dev, dtype=f32)
        max_before_target = torch.full((n,), float("-inf"), device=dev, dtype=f32)
        target_logit = torch.zeros((n,), device=dev, dtype=f32)
        mm_buf = torch.empty((min(n, TRL_TOKEN_TILE), TRL_VOCAB_TILE), device=dev, dtype=compute_dtype)
        for token_start in range(0, n, TRL_TOKEN_TILE):
            token_end = min(token_start + TRL_TOKEN_TILE, n)
            hidden_chunk = hidden[token_start:token_end].to(compute_dtype)
            for start in range(0, vocab, TRL_VOCAB_TILE):
                end = min(start + TRL_VOCAB_TILE, vocab)
                tile = mm_buf[: token_end - token_start, : end - start]
                torch.mm(hidden_chunk, weight[start:end].to(compute_dtype).t(), out=tile)
        log_z = running_max + torch.log(sum_exp)
        logprobs = target_logit - log_z
        entropy = log_z - x_sum_exp / sum_exp if "entropy" in outputs else None
        log_sum_sq = torch.log(sq_sum_exp) - 2 * torch.log(sum_exp) if "log_sum_sq_probs" in outputs else None
        mean_logits = z_sum / vocab if "mean_logits" in outputs else None
        is_top1 = ((target_logit >= running_max) & (target_logit > max_before_target)
                   if "is_top1" in outputs else None)
        ctx.save_for_backward(hidden, weight, targets, log_z, log_z if entropy is None else entropy)
        ctx.compute_dtype = compute_dtype
        ctx.mark_non_differentiable(*(x for x in (log_sum_sq, mean_logits, is_top1) if x is not None))
        return logprobs, entropy, log_sum_sq, mean_logits, is_top1

    @staticmethod
    def backward(ctx: Any, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None,  # type: ignore[override]
                 *_: Any) -> tuple[Any, ...]:
        hidden, weight, _targets, _log_z, _ = ctx.saved_tensors
        compute = ctx.compute_dtype
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        n, vocab = hidden.shape[0], weight.shape[0]
        grad_hidden = torch.zeros(hidden.shape, device=hidden.device, dtype=torch.float32) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if need_weight else None
        mm_buf = torch.empty((min(n, TRL_TOKEN_TILE), TRL_VOCAB_TILE), device=hidden.device, dtype=compute)
        grad_logprobs = grad_logprobs.float().contiguous() if grad_logprobs is not None else None
        grad_entropy = grad_entropy.float().contiguous() if grad_entropy is not None else None
        for token_start in range(0, n, TRL_TOKEN_TILE):
            token_end = min(token_start + TRL_TOKEN_TILE, n)
            hidden_chunk = hidden[token_start:token_end].to(compute)
            for start in range(0, vocab, TRL_VOCAB_TILE):
                end = min(start + TRL_VOCAB_TILE, vocab)
                w_chunk = weight[start:end].to(compute)
                tile = mm_buf[: token_end - token_start, : end - start]
                torch.mm(hidden_chunk, w_chunk.t(), out=tile)
        return (grad_hidden.to(hidden.dtype) if grad_hidden is not None else None,
                grad_weight.to(weight.dtype) if grad_weight is not None else None, None, None, None)


def trl_log_probs(hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor, autocast_dtype: torch.dtype | None,
                  outputs: tuple[str, ...] = TRL_SFT_OUTPUTS, prompt: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """TRL 1.16's ``_fused_forward`` after the backbone (``fused_lm_head=True``, no
    ``shift_labels``, on CUDA: only the positions with a label are scored): (each requested
    per-position field ``[batch, seq - 1]``, zero where ignored; the label mask).

    ``prompt``: the first ``prompt`` tokens of each sequence carry no label (the preference
    collators' completion mask). TRL selects the scored positions with the boolean mask
    (``hidden[mask]``, a copy); the trace does not know the labels' values, so with a prompt it
    takes the same positions by slicing (``[:, prompt - 1:]``, a copy of the same size) instead of
    the mask's every-position rule."""
    if getattr(head, "bias", None) is not None:
        raise TraceError("loss=trl is modelled for an output head without a bias", hint="use `loss=full`")
    weight = _head_weight(head)
    hidden_states = hidden[:, :-1]
    shifted = labels[:, 1:]
    mask = shifted != IGNORE_INDEX
    compute = autocast_dtype or hidden.dtype
    if prompt:
        first = prompt - 1
        scored_hidden = hidden_states[:, first:].reshape(-1, hidden_states.shape[-1])
        scored_labels = shifted[:, first:].reshape(-1)
    else:
        scored_hidden, scored_labels = hidden_states[mask], shifted[mask]
    per_token = TrlChunkedLogProb.apply(scored_hidden, weight, scored_labels, compute, outputs)
    del scored_hidden, scored_labels
    names = ("log_probs", *TRL_OPTIONAL)
    fields = {name: x.new_zeros(mask.shape).masked_scatter(mask, x) for name, x in zip(names, per_token, strict=True)
              if x is not None}
    del per_token
    return fields, mask


def _softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """transformers' final-logit soft-capping (Gemma 2): ``tanh(logits / cap) * cap``."""
    if not cap:
        return logits
    return torch.tanh(logits / cap) * cap


def loss_note(w: Any) -> str:
    """What the trace ran for ``w.loss`` (one line for the report)."""
    if w.loss is Loss.CHUNKED:
        compiled = ("; compute_cross_entropy compiled (torchtune's compile_loss): each chunk keeps the per-token "
                    "values the partitioner saves, not its fp32 log-softmax") if getattr(w, "compile", False) else ""
        return (f"loss: torchtune CEWithChunkedOutputLoss, {w.loss_chunks} chunks (logits output as a list of chunks, "
                f"one fp32 upcast at a time){compiled}")
    if w.loss is Loss.TRL:
        return ("loss: TRL's fused LM head emulated (allocations of trl 1.16 ChunkedLogProbFunction on CUDA: no "
                "logits, [4,096 tokens, 32,768 vocabulary] tiles, fp32 gradient accumulators)")
    if w.loss is Loss.LIGER:
        return ("loss: Liger fused linear cross-entropy emulated (allocations of liger_kernel 0.8.5: logits chunk by "
                "chunk, input/weight gradients computed in the forward)")
    return ("loss: Cut Cross-Entropy emulated (allocations of cut-cross-entropy 25.1.1: no logits, fp32 "
            "log-sum-exp per token)")


# --- the step -----------------------------------------------------------------------------------
def forward_and_loss(model: nn.Module, batch: tuple[tuple[Any, ...], dict[str, Any]], loss: Loss, chunks: int,
                     *, autocast_dtype: torch.dtype | None, sm: tuple[int, int],
                     chunk_ce: nn.Module | None = None) -> tuple[Any, torch.Tensor]:
    """(what the loop holds as the model's output, the loss) for ``loss`` ≠ full."""
    args, kwargs = batch
    kwargs = dict(kwargs)
    labels = kwargs.pop("labels", None)
    if not isinstance(labels, torch.Tensor):
        raise TraceError(f"loss={loss} needs labels in the batch (a causal LM's training inputs)", hint="use `loss=full`")
    hf, backbone, head = causal_lm_parts(model)
    if loss is Loss.TRL:
        kwargs["use_cache"] = False  # (TRL's fused forward sets it)
    # (through a sharded root's forward: the trainer calls the prepared model)
    return through_root(hf, lambda: _forward_and_loss(hf, backbone, head, args, kwargs, labels, loss, chunks,
                                                      autocast_dtype=autocast_dtype, sm=sm, chunk_ce=chunk_ce), model)


def _forward_and_loss(hf: nn.Module, backbone: nn.Module, head: nn.Module, args: tuple[Any, ...],
                      kwargs: dict[str, Any], labels: torch.Tensor, loss: Loss, chunks: int, *,
                      autocast_dtype: torch.dtype | None, sm: tuple[int, int],
                      chunk_ce: nn.Module | None) -> tuple[Any, torch.Tensor]:
    out = backbone(*args, **kwargs)
    hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
    if loss is Loss.TRL:  # (its loss: -log_probs.sum() / mask.sum().clamp(min=1))
        fields, mask = trl_log_probs(hidden, head, labels, autocast_dtype)
        return (fields, out), -fields["log_probs"].sum() / mask.sum().clamp(min=1)
    target = shifted_labels(labels)
    if loss is Loss.CHUNKED:
        cap = getattr(getattr(hf, "config", None), "final_logit_softcapping", None)
        logits = [_softcap(head(h), cap) for h in hidden.chunk(chunks, dim=1)]
        return (logits, out), chunked_ce(logits, target, chunks, chunk_ce)
    weight = _head_weight(head)
    flat = hidden.reshape(-1, hidden.shape[-1])
    if loss is Loss.LIGER:
        value = LigerFusedLinearCE.apply(flat, weight, target.reshape(-1), autocast_dtype, sm >= (8, 0))
        return out, value
    if autocast_dtype is not None and flat.dtype == torch.float32:
        flat = flat.to(autocast_dtype)  # CCE's backward takes 16-bit embeddings only
    return out, CutCrossEntropy.apply(flat, weight, target.reshape(-1))


__all__ = ["CompiledChunkCrossEntropy", "CutCrossEntropy", "LigerFusedLinearCE", "TrlChunkedLogProb", "causal_lm_parts",
           "fsdp1_root",
           "wrapper_root",
           "chunked_ce", "forward_and_loss", "liger_chunk", "loss_note", "shifted_labels", "through_root", "trl_log_probs",
           "TRL_SFT_OUTPUTS"]
