"""Activation checkpointing policies, run on PyTorch's own checkpoint machinery.

Every policy wraps a layer in non-reentrant ``torch.utils.checkpoint.checkpoint``; the
selective ones pass a ``context_fn`` built by ``torch.utils.checkpoint
.create_selective_checkpoint_contexts`` (the real SAC API), so what is saved, recomputed and
freed is decided by torch itself under the trace.

- ``full``: every layer, or every k-th (``checkpoint_every``): torchtitan's layer SAC
  (``selective_ac_option="<k>"``, torchtitan v0.2.2 ``torchtitan/distributed/
  activation_checkpoint.py::_apply_layer_sac``) wraps the blocks whose 1-based position is a
  multiple of k (``_layer_sac_count % ac_freq == 0``): layers k-1, 2k-1, ... (0-based).
- ``op``: torchtitan's op-level SAC (``selective_ac_option="op"``, same file,
  ``_apply_op_sac``): the outputs of the ops in ``_op_sac_save_list``
  (``torchtitan/models/llama3/infra/parallelize.py``, v0.2.2) are saved, except every second
  ``aten.mm`` (counted per checkpointed call, separately for forward and recompute); everything
  else is recomputed. torchtitan's ``per_op_sac_force_recompute_mm_shapes_by_fqns`` (empty by
  default) is not modelled.
- ``selective`` (vramplan's Megatron-style policy, unchanged): every matmul and attention
  kernel output saved, the rest recomputed. Under fused SDPA kernels this saves as much as no
  checkpointing, as Korthikanti et al.'s selective recompute only drops the s² attention core.
- a user policy (library API ``checkpoint_policy=``): a function ``(ctx, op, *args, **kwargs)
  -> CheckpointPolicy | bool`` or a list of ops to save, handed to
  ``create_selective_checkpoint_contexts`` unchanged.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..errors import WorkloadError
from ..workload import Checkpointing, Workload

aten = torch.ops.aten

Policy = Callable[..., Any] | Sequence[Any]
"""What ``create_selective_checkpoint_contexts`` takes: a policy function or a list of ops."""


def _ops(*names: str) -> frozenset[Any]:
    """The named ops that exist in this torch build (``namespace.op.overload`` or a HOP)."""
    out = set()
    for name in names:
        obj: Any = torch.ops
        if name.startswith("hop:"):
            obj = getattr(torch._higher_order_ops, name[4:], None)
        else:
            for part in name.split("."):
                obj = getattr(obj, part, None) if obj is not None else None
        if obj is not None:
            out.add(obj)
    return frozenset(out)


TORCHTITAN_OP_SAVE_LIST = _ops(
    "aten.mm.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_attention_math.default",
    "aten._scaled_dot_product_fused_attention_overrideable.default",
    "_c10d_functional.reduce_scatter_tensor.default",
    "aten.max.default",
    "hop:flex_attention",
    "torch_attn._varlen_attn.default",
    "hop:inductor_compiled_code",
)
"""torchtitan v0.2.2 ``_op_sac_save_list`` (``torchtitan/models/llama3/infra/parallelize.py``),
the ops present in this torch build."""

MEGATRON_SAVE_LIST = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default, aten._scaled_mm.default,
})
"""``checkpointing=selective``: matmul and attention-kernel outputs saved, the rest recomputed."""


def megatron_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """``checkpointing=selective``: save matmul and attention outputs, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if func in MEGATRON_SAVE_LIST else CheckpointPolicy.PREFER_RECOMPUTE


def torchtitan_op_policy() -> Callable[..., CheckpointPolicy]:
    """A fresh torchtitan op-level policy (its mm counters start at zero), as torchtitan's
    ``selective_checkpointing_context_fn`` builds one per checkpointed call."""
    meta: dict[str, int] = defaultdict(int)

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if (func == aten._to_copy.default and args and "cuda" in str(args[0].device)
                and str(kwargs.get("device", "")) == "cpu"):
            return CheckpointPolicy.MUST_SAVE
        key = "recompute_mm_count" if ctx.is_recompute else "forward_mm_count"
        if func == aten.mm.default:
            meta[key] += 1
        save = func in TORCHTITAN_OP_SAVE_LIST and not (func == aten.mm.default and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _op_context() -> Any:
    return create_selective_checkpoint_contexts(torchtitan_op_policy())


def context_fn(w: Workload, policy: Policy | None = None) -> Callable[[], Any] | None:
    """The ``context_fn`` for ``checkpoint()`` under the workload (None: plain recompute)."""
    if policy is not None:
        return functools.partial(create_selective_checkpoint_contexts, _user_policy(policy))
    if w.checkpointing is Checkpointing.OP:
        return _op_context
    if w.checkpointing is Checkpointing.SELECTIVE:
        return functools.partial(create_selective_checkpoint_contexts, megatron_policy)
    return None


def _user_policy(policy: Policy) -> Any:
    if callable(policy):
        return policy
    if isinstance(policy, (list, tuple, set, frozenset)):
        ops = list(policy)
        bad = [o for o in ops if not isinstance(o, torch._ops.OpOverload)]
        if bad:
            raise WorkloadError(f"checkpoint_policy lists must hold aten op overloads (torch.ops.aten.mm.default), "
                                f"got {bad[0]!r}", field="checkpoint_policy")
        return ops
    raise WorkloadError("checkpoint_policy must be a function (ctx, op, *args, **kwargs) -> CheckpointPolicy "
                        f"or a list of ops to save, got {type(policy).__name__}", field="checkpoint_policy")


def checkpointed(n: int, w: Workload, *, policy: bool = False) -> list[int]:
    """0-based indices of the checkpointed layers among ``n``: the first
    ``round(checkpoint_fraction × n)``, of which every ``checkpoint_every``-th (torchtitan's
    1-based ``count % k == 0``)."""
    if (w.checkpointing is Checkpointing.NONE and not policy) or not w.training:
        return []
    keep = checkpointed_count_first(n, w.checkpoint_fraction)
    k = w.checkpoint_every
    return [i for i in range(keep) if (i + 1) % k == 0]


def checkpointed_count_first(n: int, frac: float) -> int:
    """Layers the fraction covers (rounded half up, as the analytic path counts them)."""
    return n if frac >= 1.0 else max(0, min(n, int(frac * n + 0.5)))


def describe(w: Workload, policy: Policy | None) -> str:
    if policy is not None:
        return "selective checkpointing with the given policy (create_selective_checkpoint_contexts)"
    if w.checkpointing is Checkpointing.OP:
        return "torchtitan op-level selective checkpointing (save list, every second mm recomputed)"
    if w.checkpointing is Checkpointing.SELECTIVE:
        return "selective checkpointing (matmul and attention outputs saved)"
    return "full activation checkpointing"
