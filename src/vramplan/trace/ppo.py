"""PPO with a value model, as verl 0.7.0 and OpenRLHF 0.11.0 run it (readings in
docs/research/rl-frameworks.md): the GRPO window of :mod:`.grpo` (the rollout, the policy's and
the reference's log-probabilities), scored besides by

- the **critic**: a copy of the policy's backbone with a scalar head (verl: ``AutoModelForTokenClassification``
  with ``num_labels=1``, fsdp_workers.py L1310; OpenRLHF: ``value_head`` ``nn.Linear(hidden, 1, bias=False)``),
  trained in full with its own gradients and optimizer states; its values of the completion tokens
  under ``no_grad`` after the rollout;
- the **reward model** (``reward_model``): the same shape, frozen, one score per sequence (its last
  token) under ``no_grad``, its weights in 16 bits (:func:`reward_dtype`);

then the advantages and returns of GAE per completion token (fp32), and the updates in verl's order
(``ray_trainer.fit``: ``update_critic``, then ``update_actor``): ``grad_accum`` critic micro-steps
(forward, the clipped value loss, backward; then its optimizer step and ``zero_grad``), then the
policy's micro-steps of :func:`.grpo.forward_loss` with per-token advantages.

The value models are made from the model as loaded, before PEFT: the critic in the policy's dtype, under the workload's checkpointing (verl's critic ``enable_gradient_checkpointing: true``).
Under FSDP (``dp=N, zero=3``) each is sharded with FSDP2 beside the policy on the same ranks, as
verl's workers shard them in one process per GPU (``run._lay_out_value_model``;
docs/research/rl-frameworks.md).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ..workload import Objective, Phase, Workload
from .features import compute_dtype
from .loss import causal_lm_parts

VALUE_CLIP = 0.5
"""verl ``critic.cliprange_value`` 0.5; OpenRLHF ``--critic.value_clip`` 0.5 (values do not change memory)."""


class ValueModel(nn.Module):
    """A causal LM's backbone with a scalar head: a value per token, ``[batch, seq, 1]`` (the logits of
    verl's ``AutoModelForTokenClassification`` with one label; callers index the label out: a module's
    output that is a view would lose FSDP2's pre-backward hook to an in-place op)."""

    def __init__(self, backbone: nn.Module, hidden: int, like: torch.Tensor) -> None:
        super().__init__()
        self.backbone = backbone
        self.score = nn.Linear(hidden, 1, bias=False, device=like.device, dtype=like.dtype)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
        return self.score(hidden)


def reward_dtype(w: Workload) -> torch.dtype:
    """The frozen reward model's weight dtype: the compute dtype when it is 16-bit, else bf16. verl 0.7.0's
    ``RewardModelWorker`` loads it with ``torch_dtype=torch.bfloat16`` and casts it there whatever the actor's
    dtype (verl/workers/fsdp_workers.py L1729-L1741); OpenRLHF 0.11.0's ``RewardModelActor`` loads it in
    ``--ds.param_dtype`` (bf16 by default, or fp16; openrlhf/trainer/ray/launcher.py L161-L168,
    openrlhf/models/model.py L94, L114). docs/research/rl-frameworks.md."""
    dtype = compute_dtype(w)
    return dtype if dtype.itemsize == 2 else torch.bfloat16


def value_copy(model: nn.Module, w: Workload, *, trained: bool) -> ValueModel:
    """A value model of ``model``'s architecture (its weights copied as loaded; the LM head dropped):
    the critic (``trained``) in the model's dtype, the frozen reward model in :func:`reward_dtype`."""
    hf, backbone, _head = causal_lm_parts(model)
    like = next(iter(backbone.parameters()))
    hidden = int(getattr(hf.config, "hidden_size", like.shape[-1]))
    m = ValueModel(copy.deepcopy(backbone), hidden, like)
    if not trained:
        m.to(reward_dtype(w))
    m.requires_grad_(trained)
    m.train(trained)
    return m


def values(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, completion: int, chunk: int,
           region: Any) -> torch.Tensor:
    """The completion tokens' values in chunks of ``chunk`` sequences (fp32), concatenated."""
    parts = []
    for start in range(0, ids.shape[0], chunk):
        with region():
            v = model(ids[start:start + chunk], mask[start:start + chunk])
        parts.append(v[:, -completion - 1:-1, 0].float())
        del v
    out = torch.cat(parts, dim=0)
    del parts
    return out


def scores(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, chunk: int, region: Any) -> torch.Tensor:
    """The reward model's score of each sequence: its last token's value (fp32)."""
    parts = []
    for start in range(0, ids.shape[0], chunk):
        with region():
            v = model(ids[start:start + chunk], mask[start:start + chunk])
        parts.append(v[:, -1, 0].float())
        del v
    out = torch.cat(parts, dim=0)
    del parts
    return out


def gae(rewards: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) of GAE with gamma = lambda = 1 (both frameworks' defaults), token by
    token from the last, as verl's ``compute_gae_advantage_return`` (core_algos.py) runs it: the
    token rewards (the sequence's score on its last token), the reversed scan, the whitened advantages."""
    token_rewards = torch.zeros_like(vals)
    token_rewards[:, -1] = rewards
    last = torch.zeros_like(vals[:, 0])
    reversed_adv = []
    n = vals.shape[1]
    for t in reversed(range(n)):
        nxt = vals[:, t + 1] if t < n - 1 else torch.zeros_like(last)
        delta = token_rewards[:, t] + nxt - vals[:, t]
        last = delta + last
        reversed_adv.append(last)
        del nxt, delta
    adv = torch.stack(reversed_adv[::-1], dim=1)
    del reversed_adv, last, token_rewards
    returns = adv + vals
    m = mask.float()
    mean = (adv * m).sum() / m.sum()
    var = ((adv - mean) ** 2 * m).sum() / m.sum()
    adv = (adv - mean) * torch.rsqrt(var + 1e-8) * m
    del m, mean, var
    return adv, returns


def critic_loss(critic: nn.Module, batch: dict[str, torch.Tensor], *, region: Any) -> torch.Tensor:
    """One critic micro-step's loss: the values of the completion tokens, verl's ``compute_value_loss``
    (the clipped squared error against the returns, the larger of the two, masked mean, times 0.5)."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    completion = batch["completion_ids"].shape[1]
    with region():
        v = critic(ids, mask)
    vpreds = v[:, -completion - 1:-1, 0].float()
    del v, ids, mask
    old, ret = batch["values"], batch["returns"]
    clipped = old + torch.clamp(vpreds - old, -VALUE_CLIP, VALUE_CLIP)
    l1, l2 = (vpreds - ret) ** 2, (clipped - ret) ** 2
    m = batch["completion_mask"].float()
    loss = 0.5 * (torch.max(l1, l2) * m).sum() / m.sum()
    del clipped, l1, l2, m, vpreds
    return loss


def critic_update(sess: Any, critic: nn.Module, optimizer: Any, batches: list[dict[str, torch.Tensor]],
                  region: Any) -> None:
    """``update_critic``: the micro-steps, then the critic's optimizer step and ``zero_grad``."""
    params = [p for p in critic.parameters() if p.requires_grad]
    for b in batches:
        with sess.phase(Phase.FORWARD):
            loss = critic_loss(critic, b, region=region)
        with sess.backward():
            loss.backward()
        del loss
        sess.label_grads(params)
    with sess.phase(Phase.OPTIMIZER):
        optimizer.step()
        sess.label_optimizer(optimizer)
        optimizer.zero_grad(set_to_none=True)


def step_note(w: Workload) -> str:
    rm = "a frozen reward model's score of each completion" if w.reward_model else "rule-based rewards (no model)"
    return (f"PPO step as verl 0.7.0 / OpenRLHF 0.11.0 run it: the rollout of {w.batch * w.grad_accum:,} completions "
            f"of {w.completion:,} tokens; the critic (the backbone and a scalar head, trained in full: its own "
            f"gradients and optimizer states) scores them under no_grad; {rm}; GAE advantages and returns; then "
            f"{w.grad_accum} critic micro-step(s) and its optimizer step, then {w.grad_accum} policy micro-step(s)")


def limit_note(w: Workload, parts: dict[str, int]) -> str:
    """Which part of the PPO step sets the peak: generation, the critic's update or the actor's."""
    names = {"generation": "generation (and scoring)", "critic": "critic training", "actor": "actor training"}
    top = max(parts, key=lambda k: parts[k])
    text = "; ".join(f"{names[k]} {v / 2**30:,.2f} GiB" for k, v in parts.items())
    return f"{str(w.objective).upper()} peaks: {text} allocated: the step's peak is {names[top]}'s"


def parts_of(log: Any, spans: dict[str, list[tuple[int, int]]]) -> dict[str, int]:
    """The most allocated within each part's event spans (the last traced iteration's)."""
    from .analysis import arrays

    a = arrays(log)
    out: dict[str, int] = {}
    for name, ss in spans.items():
        peak = 0
        for lo, hi in ss:
            if hi > lo:
                peak = max(peak, int(a.total[lo:hi].max()))
        out[name] = peak
    return out


def is_ppo(w: Workload) -> bool:
    return w.objective is Objective.PPO and w.training


__all__ = ["VALUE_CLIP", "ValueModel", "critic_loss", "critic_update", "gae", "is_ppo", "limit_note", "parts_of",
           "scores", "step_note", "value_copy", "values"]
