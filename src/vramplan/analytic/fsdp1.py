"""FSDP1 (``FullyShardedDataParallel``, ``engine=fsdp1``): its flat parameters, for one rank.

What the trace wraps (:func:`vramplan.trace.layout._fsdp1`, as accelerate and HF Trainer do): one
unit per transformer block and the root (the embeddings, the final norm, the head),
``use_orig_params=True``, ``limit_all_gathers=True``, no forward prefetch, the workload's backward
prefetch; under ``*-mixed`` ``MixedPrecision(param_dtype=reduce_dtype=<16-bit>)`` with autocast.
Read from torch 2.13 ``torch/distributed/fsdp`` (docs/research/fsdp1-analytic.md):

* **flat parameters** (``_flat_param.py``): each unit's parameters are one flat tensor in the
  parameters' dtype; ``_get_shard`` (L1122; its padding L1114) chunks it over the world and pads
  every shard to the first chunk's size: each rank holds ``ceil(numel / world)`` elements of every
  unit (``use_orig_params`` also aligns each parameter to 16 bytes, ``_get_aligned_numel`` L2771:
  the dimensions counted here are multiples of 4 elements).
* **unshard** (``unshard`` L1359, ``_alloc_padded_unsharded_flat_param`` L1395): the unit's
  all-gather output ``_full_param_padded`` (the padded flat parameter in ``param_dtype``); the
  original parameters are views into it — one copy, where FSDP2 also copies out of its all-gather
  buffer. Under MixedPrecision the 16-bit shard (``_mp_shard``, ``_use_low_precision_shard``
  L1342) lives only around the all-gather (``_free_low_precision_sharded_param`` L1533).
  ``_reshard`` frees the output's storage: FULL_SHARD after each unit's forward but the root's
  (``_runtime_utils.py`` ``_post_forward_reshard`` L486-L497), SHARD_GRAD_OP only after its
  backward. ``limit_all_gathers`` bounds the all-gathers in flight on the GPU's streams; a trace
  (and this model) frees a buffer at its reshard.
* **backward prefetch** (``_runtime_utils.py``): BACKWARD_PRE unshards the next unit in backward
  order right after the current one (``_pre_backward_hook`` L630, its prefetch L693), so a block's
  backward holds its own parameters and the previous block's, and the root's pre-backward (before
  the loss's backward) holds the last block's; BACKWARD_POST prefetches after the current unit's
  reshard (``_post_backward_reshard`` L793-L807: one block at a time); none gathers in each unit's
  own pre-backward.
* **gradients**: autograd makes each original parameter's gradient (``param_dtype``) and the
  views' backward concatenates a unit's into its padded flat gradient (``param_dtype``); the
  post-backward hook on the flat parameter's AccumulateGrad (``_post_backward_hook`` L701)
  reshards, reduce-scatters into a shard in ``reduce_dtype`` (``_reduce_grad`` L831) and casts it to
  the parameters' dtype (``_cast_grad_to_param_dtype`` L1030): the sharded ``flat_param.grad``
  the optimizer steps. The root's gradients wait unsharded (the head's from the loss's backward on)
  until the embeddings' backward, the last, completes its flat gradient.
* **zero_grad** with ``use_orig_params`` drops the original parameters' ``grad`` views only: the
  flat gradients live until the next forward's ``_root_pre_forward`` resets them (L594,
  ``_reset_flat_param_grad_info_if_needed``, ``_flat_param.py`` L2447): the forward starts with
  every gradient shard of the previous step.
"""

from __future__ import annotations

from vramplan._dataclass import dataclass
from vramplan.workload import Engine, Fsdp1Prefetch, Optimizer, Peft, Quant, Workload


@dataclass(frozen=True)
class Fsdp1:
    """FSDP1's per-unit sizes of one rank, in bytes (see the module docstring)."""

    root: int
    """The root unit's gathered flat parameter (``param_dtype``), held from its forward to the end of backward."""
    block: int
    """The largest block unit's gathered flat parameter."""
    blocks: int
    """Every block unit's, gathered (SHARD_GRAD_OP keeps them from their forward to their backward)."""
    prefetched: int
    """What a block's backward holds gathered beyond its own (BACKWARD_PRE: the previous block)."""
    loss_prefetched: int
    """What the loss's backward holds beyond the root (BACKWARD_PRE: the last block)."""
    block_grad_shard: int
    """One block's gradient shard, in the parameters' dtype."""
    head_fresh: int
    """The root's original-parameter gradients made before the blocks' backward (the final norm's
    and the head's, ``param_dtype``), waiting for the root's flat gradient."""
    root_fresh: int
    """The root's original-parameter gradients once the embeddings' is made."""
    root_flat: int
    """The root's padded flat gradient (``param_dtype``)."""
    block_fresh: int
    """A block's original-parameter gradients (``param_dtype``)."""
    block_flat: int
    """A block's padded flat gradient (``param_dtype``)."""
    tied_sum: int
    """A head tied to the embeddings: in the embeddings' backward, the head's gradient waiting in the
    shared parameter's input buffer, the embeddings' new one and their out-of-place sum
    (``input_buffer.h``), beside the root's other original-parameter gradients (0 untied)."""
    root_reduce: int
    """The root's post-backward reduce, once resharded: its flat gradient, the reduce-scatter output
    (``reduce_dtype``) and, where that is not the parameters' dtype, its cast (the shard)."""
    keep_all: bool
    """SHARD_GRAD_OP."""


def applies(w: Workload) -> bool:
    """FSDP1 training over two or more data-parallel ranks (with one rank nothing is wrapped)."""
    p = w.parallel
    return p.engine is Engine.FSDP1 and p.dp > 1 and w.training


def unsupported(w: Workload) -> str:
    """What of ``w`` the FSDP1 formulas do not model ('' when they do)."""
    p = w.parallel
    if not w.training:
        return f"`task={w.task}` (FSDP1 is modelled for training)"
    if p.zero == 0:
        return "NO_SHARD (`zero=0`)"
    if p.offload_params:
        return "CPUOffload (`offload_params`)"
    if p.tp > 1 or p.pp > 1 or p.cp > 1 or p.ep > 1:
        return "FSDP1 combined with tensor, pipeline, context or expert parallelism"
    if w.peft is not Peft.NONE or w.quant is not Quant.NONE:
        # (peft's wrap policy makes each adapter its own unit beside the frozen blocks and root: not
        # modelled yet, docs/research/fsdp1-analytic.md)
        return f"`peft={w.peft}` (peft's per-adapter units, frozen flat parameters)" if w.peft is not Peft.NONE \
            else f"`quant={w.quant}`"
    if w.optimizer is Optimizer.ADAFACTOR:
        # (the sharded original parameters are 1-D views into the flat shard, ``_use_sharded_views``:
        # Adafactor factors no second moment there, and its step's temporaries are not read yet)
        return "Adafactor (FSDP1's sharded parameters are 1-D views: nothing to factor)"
    if w.rl:
        return f"`objective={w.objective}` (its rollout, reference and generation under FSDP1's units)"
    if w.optimizer_in_backward:
        return "an optimizer in backward"
    return ""


def padded(elems: int, world: int) -> int:
    """A flat parameter of ``elems`` elements padded as ``_get_shard`` pads it: ``world`` shards of
    ``ceil(elems / world)`` elements (torch 2.13 ``fsdp/_flat_param.py`` ``_get_shard``,
    ``_get_shard_metadata``)."""
    return -(-elems // world) * world if world > 1 else elems


def layout(w: Workload, *, blocks: list[int], root: int, head: int, tied: int, weight_b: int,
           gather_b: int) -> Fsdp1:
    """FSDP1's sizes of a fully trained model from its units' element counts: ``blocks`` every
    block unit's, ``root`` the root's, ``head`` the final norm's and the head's (of the root);
    ``tied``: the embeddings' elements where the head is tied to them (else 0);
    ``weight_b`` the flat parameters' (and their gradients') bytes per element, ``gather_b``
    ``param_dtype``'s (also the reduce dtype: accelerate sets both)."""
    p = w.parallel
    n = p.shard_group
    pre = p.fsdp1_prefetch is Fsdp1Prefetch.BACKWARD_PRE
    keep = p.zero == 2
    block = max(blocks, default=0)
    blk = padded(block, n) * gather_b
    shard = padded(root, n) // n
    return Fsdp1(
        root=padded(root, n) * gather_b, block=blk, blocks=sum(padded(b, n) for b in blocks) * gather_b,
        prefetched=blk if pre and not keep and len(blocks) > 1 else 0,
        loss_prefetched=blk if pre and not keep and blocks else 0,
        block_grad_shard=padded(block, n) // n * weight_b,
        head_fresh=head * gather_b, root_fresh=root * gather_b, root_flat=padded(root, n) * gather_b,
        block_fresh=block * gather_b, block_flat=blk, tied_sum=(root + 2 * tied) * gather_b if tied else 0,
        root_reduce=padded(root, n) * gather_b + shard * gather_b + (shard * weight_b if gather_b != weight_b else 0),
        keep_all=keep,
    )


__all__ = ["Fsdp1", "applies", "layout", "padded", "unsupported"]
