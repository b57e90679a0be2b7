"""Preference-tuning steps: DPO and KTO as TRL 1.16's ``DPOTrainer`` and ``KTOTrainer`` run them
(trl/trainer/dpo_trainer.py and kto_trainer.py ``_compute_loss``, and their collators).

KTO (``KTOTrainer._compute_loss``, ``loss_type="kto"``, so ``calculate_KL``): a micro-batch is
``batch`` labelled sequences and a KL batch of as many mismatched prompt-completion pairs (the
collator cycles the completions). The policy first runs the KL batch under ``no_grad`` (its head
with KTOTrainer's fields: log-probs, entropy, mean logits), then the batch itself with gradients;
the reference runs the KL batch and the batch under ``no_grad`` (the same three sources as DPO's);
the desirable and undesirable sequences are picked by ``nonzero`` of the labels (the trace's rule
counts every sequence on both sides: an upper bound of a few values per sequence); the loss is
``nanmean`` of ``1 − sigmoid(β · (logratio − kl))`` and ``1 − sigmoid(β · (kl − logratio))``.

DPO:

One micro-batch is ``batch`` pairs: the chosen and the rejected sequences concatenated into one
batch of ``2 × batch`` (chosen first). The policy runs it through TRL's fused LM head
(:func:`.loss.trl_log_probs`, the fields DPOTrainer asks for: log-probabilities, entropy, mean
logits, top-1), the per-sequence log-probabilities are summed and split; then, under
``torch.no_grad()``, the reference runs the same batch:

- ``reference=adapters`` (TRL's choice under PEFT): the policy itself inside
  ``disable_adapter()``, so through the same patched head and its four fields;
- ``reference=model`` (TRL's choice otherwise): a frozen copy of the model in the policy's dtype
  (``ref_model_init_kwargs.setdefault("dtype", self.model.dtype)``), whose head asks for the
  log-probabilities only (``add_fused_lm_head(self.ref_model)``);
- ``reference=precomputed``: two fp32 values per pair read from the batch (the dataset's
  ``ref_chosen_logps`` / ``ref_rejected_logps``), no reference forward.

The sigmoid loss ``-logsigmoid(β · ((c − c_ref) − (r − r_ref)))`` is averaged over the pairs and
the step goes on as :func:`.steps.train_step` (backward, optimizer). The metrics' scalars the
trainers log (a few values per sequence) are not modelled. TRL scores the completion tokens only:
``Workload.prompt`` says how many tokens of each sequence are prompt (0: every position but the
first, as if the completions filled the sequences, an upper bound on the head's share).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import TraceError
from ..workload import Objective, Reference, Workload
from .loss import causal_lm_parts, through_root, trl_log_probs

DPO_POLICY_OUTPUTS: tuple[str, ...] = ("log_probs", "entropy", "mean_logits", "is_top1")
"""What DPOTrainer asks of the policy's head (trl 1.16 dpo_trainer.py: ``outputs = ("log_probs",
"entropy", "mean_logits", "is_top1")``, ``log_sum_sq_probs`` only with ``use_weighting``)."""
KTO_POLICY_OUTPUTS: tuple[str, ...] = ("log_probs", "entropy", "mean_logits")
"""What KTOTrainer asks of the policy's head (trl 1.16 kto_trainer.py L967-L970)."""
REF_OUTPUTS: tuple[str, ...] = ("log_probs",)
"""``add_fused_lm_head(self.ref_model)``: the default fields."""
BETA = 0.1
"""DPOConfig ``beta`` (its value does not change memory)."""
PRECOMPUTED_KEYS = ("ref_chosen_logps", "ref_rejected_logps")
KTO_PRECOMPUTED_KEYS = ("ref_logps", "ref_KL_logps")


def reference_copy(model: nn.Module, w: Workload) -> nn.Module | None:
    """DPO's frozen reference (``reference=model``): a copy of the model as loaded, before PEFT,
    in the policy's dtype, gradients off, in eval mode (accelerate prepares it with
    ``evaluation_mode=True``); None for every other workload."""
    if w.objective is Objective.SFT or w.reference_source is not Reference.MODEL:
        return None
    w.check_reference_model(traced=True)
    import copy

    ref = copy.deepcopy(model)
    ref.requires_grad_(False)
    ref.eval()
    return ref


def step_note(w: Workload) -> str:
    """What the traced preference step ran (one line for the report)."""
    ref = {Reference.MODEL: "a frozen copy of the model", Reference.ADAPTERS: "the policy with its adapters disabled",
           Reference.PRECOMPUTED: "log-probabilities read from the batch (no reference forward)"}[w.reference_source]
    if w.objective is Objective.KTO:
        return ("KTO step as TRL 1.16 KTOTrainer runs it: the KL batch (mismatched completions) under no_grad, then "
                f"the labelled sequences, through TRL's fused LM head (log-probs, entropy, mean logits); reference: "
                f"{ref}, both batches under no_grad. {_scored(w)}; the metrics' scalars are not counted")
    return ("DPO step as TRL 1.16 DPOTrainer runs it: the pairs' chosen and rejected sequences as one batch through "
            f"TRL's fused LM head (log-probs, entropy, mean logits, top-1); reference: {ref}, under no_grad; the "
            f"sigmoid loss. {_scored(w)}; the metrics' scalars are not counted")


def _scored(w: Workload) -> str:
    if w.prompt:
        return f"The completion's {w.seq - w.prompt:,} tokens of each sequence are scored, not the {w.prompt:,} of the prompt"
    return ("Every position but the first is scored (completions filling the sequence: an upper bound where there is "
            "a prompt, `prompt=N`)")


def reference_note(reference: nn.Module, w: Workload) -> str:
    n = sum(q.numel() for q in reference.parameters())
    dtypes = sorted({str(q.dtype).removeprefix("torch.") for q in reference.parameters()})
    when = "after the rollout" if w.objective is Objective.GRPO else "after the policy's forward"
    return (f"{str(w.objective).upper()} reference: a frozen copy of the model ({n:,} parameters, {'/'.join(dtypes)}, "
            f"the policy's dtype as TRL loads it), run under no_grad {when}")


def preference_inputs(kwargs: dict[str, Any], w: Workload) -> dict[str, Any]:
    """A causal LM's training inputs made the preference collator's batch: ``input_ids`` and an
    int64 ``completion_mask`` (every position a completion token: the upper bound), no labels
    (the step makes them); KTO adds the KL batch (``KL_input_ids``, ``KL_completion_mask``) and
    the bool ``label`` per sequence; ``reference=precomputed`` adds the dataset's fp32 columns
    (DPO: two per pair; KTO: two per sequence). Without padding the collator's ``attention_mask``
    is all ones, for which transformers builds no mask (SDPA's causal path): it is left out, as
    the other traces leave it out."""
    ids = kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        raise TraceError(f"objective={w.objective} needs a token model's inputs (input_ids)")
    out = {k: v for k, v in kwargs.items() if k != "labels"}
    out["completion_mask"] = torch.ones_like(ids)  # (zeros over the first `prompt` tokens: values the trace does
    keys = PRECOMPUTED_KEYS                        # not hold; the step takes the prompt from the workload)
    if w.objective is Objective.KTO:
        out["KL_input_ids"] = torch.empty_like(ids)
        out["KL_completion_mask"] = torch.ones_like(ids)
        out["label"] = torch.empty(ids.shape[0], dtype=torch.bool, device=ids.device)
        keys = KTO_PRECOMPUTED_KEYS
    if w.reference_source is Reference.PRECOMPUTED:
        out.update({k: torch.empty(w.batch, dtype=torch.float32, device=ids.device) for k in keys})
    return out


Region = Callable[[], contextlib.AbstractContextManager[Any]]


def _sequence_logps(model: nn.Module, kwargs: dict[str, Any], labels: torch.Tensor, autocast: torch.dtype | None,
                    outputs: tuple[str, ...], region: Region, prompt: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(the head's per-position fields, the per-sequence log-probabilities): one model call in its
    own autocast region (``region``), its per-sequence sum outside it, as the trainers do."""
    hf, backbone, head = causal_lm_parts(model)

    def fused() -> dict[str, torch.Tensor]:
        # (TRL's fused forward holds the backbone's whole output through the head: a vision-language
        # model's carries its vision tower's outputs too)
        out = backbone(**{**kwargs, "use_cache": False})
        hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
        got, _mask = trl_log_probs(hidden, head, labels, autocast, outputs, prompt)
        del hidden, _mask, out
        return got

    with region():  # (through a sharded root's forward, as TRL calls the prepared model)
        fields = through_root(hf, fused, model)
    del fused
    seq_len = labels.shape[1] - 1
    return fields, fields["log_probs"][:, -seq_len:].sum(dim=1)


def dpo_forward_loss(model: nn.Module, reference: nn.Module | None, source: Reference,
                     batch: tuple[tuple[Any, ...], dict[str, Any]], autocast: torch.dtype | None,
                     region: Region, prompt: int = 0) -> tuple[Any, torch.Tensor]:
    """(the outputs a loop would hold, the loss) of one DPO micro-batch."""
    args, kwargs = batch
    if args:
        raise TraceError("objective=dpo needs keyword inputs (input_ids, labels)")
    kwargs = dict(kwargs)
    completion_mask = kwargs.pop("completion_mask", None)
    if not isinstance(completion_mask, torch.Tensor) or not isinstance(kwargs.get("input_ids"), torch.Tensor):
        raise TraceError("objective=dpo needs input_ids and a completion_mask in the batch (preference_inputs)")
    pre = [kwargs.pop(k, None) for k in PRECOMPUTED_KEYS]
    labels = kwargs["input_ids"].masked_fill(completion_mask == 0, -100)
    fields, logps = _sequence_logps(model, kwargs, labels, autocast, DPO_POLICY_OUTPUTS, region, prompt)
    chosen_logps, rejected_logps = logps.chunk(2, dim=0)
    if source is Reference.PRECOMPUTED:
        ref_chosen, ref_rejected = pre
        if ref_chosen is None or ref_rejected is None:
            raise TraceError("reference=precomputed needs the reference log-probabilities in the batch")
    else:
        with torch.no_grad():
            ctx, ref_model, outputs = _reference(model, reference, source, DPO_POLICY_OUTPUTS)
            with ctx:
                ref_fields, ref_logps = _sequence_logps(ref_model, kwargs, labels, autocast, outputs, region, prompt)
        ref_chosen, ref_rejected = ref_logps.chunk(2, dim=0)
        del ref_logps
    chosen_logratios = chosen_logps - ref_chosen
    rejected_logratios = rejected_logps - ref_rejected
    delta = chosen_logratios - rejected_logratios
    per_sequence = -F.logsigmoid(BETA * delta)
    loss = 0.0 + per_sequence.mean() * 1.0
    # (both outputs live until `_compute_loss` returns: the loop drops them before backward)
    return (fields, ref_fields if source is not Reference.PRECOMPUTED else None), loss


def _reference(model: nn.Module, reference: nn.Module | None, source: Reference,
               policy_outputs: tuple[str, ...]) -> tuple[Any, nn.Module, tuple[str, ...]]:
    """(the context to run the reference in, the module, its head's fields)."""
    if source is Reference.ADAPTERS:
        disable = getattr(model, "disable_adapter", None)
        if not callable(disable):
            raise TraceError("reference=adapters needs a PEFT model", hint="use `reference=model`")
        return disable(), model, policy_outputs  # (the policy's own patched head)
    if reference is None:
        raise TraceError("reference=model needs the reference model")
    return contextlib.nullcontext(), reference, REF_OUTPUTS


def kto_forward_loss(model: nn.Module, reference: nn.Module | None, source: Reference,
                     batch: tuple[tuple[Any, ...], dict[str, Any]], autocast: torch.dtype | None,
                     region: Region, prompt: int = 0) -> tuple[Any, torch.Tensor]:
    """(the outputs a loop would hold, the loss) of one KTO micro-batch (``KTOTrainer._compute_loss``)."""
    args, kwargs = batch
    kwargs = dict(kwargs)
    try:
        completion_mask, kl_ids, kl_mask, label = (kwargs.pop(k) for k in
                                                   ("completion_mask", "KL_input_ids", "KL_completion_mask", "label"))
    except KeyError as e:
        raise TraceError(f"objective=kto needs {e} in the batch (preference_inputs)") from None
    if args or not isinstance(kwargs.get("input_ids"), torch.Tensor):
        raise TraceError("objective=kto needs keyword inputs (input_ids)")
    pre = [kwargs.pop(k, None) for k in KTO_PRECOMPUTED_KEYS]
    num_chosen = label.sum()
    num_rejected = len(label) - num_chosen
    kl_kwargs = {**kwargs, "input_ids": kl_ids}

    def kl_logps_of(m: nn.Module, outputs: tuple[str, ...]) -> torch.Tensor:
        # (`_compute_kl_logps`: the KL labels made afresh for each model, freed on return)
        kl_labels = kl_ids.masked_fill(kl_mask == 0, -100)
        with torch.no_grad():
            _fields, logps = _sequence_logps(m, kl_kwargs, kl_labels, autocast, outputs, region, prompt)
        return logps

    kl_logps = kl_logps_of(model, KTO_POLICY_OUTPUTS)
    completion_labels = kwargs["input_ids"].masked_fill(completion_mask == 0, -100)
    fields, completion_logps = _sequence_logps(model, kwargs, completion_labels, autocast, KTO_POLICY_OUTPUTS, region, prompt)
    bool_labels = label.to(torch.bool)
    chosen_idx = torch.nonzero(bool_labels, as_tuple=False).view(-1)
    rejected_idx = torch.nonzero(~bool_labels, as_tuple=False).view(-1)
    chosen_logps = completion_logps.index_select(0, chosen_idx)
    rejected_logps = completion_logps.index_select(0, rejected_idx)
    ref_outputs = None
    if source is Reference.PRECOMPUTED:
        ref_logps, ref_kl_logps = pre
        if ref_logps is None or ref_kl_logps is None:
            raise TraceError("reference=precomputed needs the reference log-probabilities in the batch")
        ref_chosen = ref_logps.index_select(0, chosen_idx)
        ref_rejected = ref_logps.index_select(0, rejected_idx)
    else:
        with torch.no_grad():
            ctx, ref_model, outputs = _reference(model, reference, source, KTO_POLICY_OUTPUTS)
            with ctx:
                ref_kl_logps = kl_logps_of(ref_model, outputs)
                ref_outputs, ref_completion = _sequence_logps(ref_model, kwargs, completion_labels, autocast, outputs, region, prompt)
        ref_chosen = ref_completion.index_select(0, chosen_idx)
        ref_rejected = ref_completion.index_select(0, rejected_idx)
    kl = (kl_logps - ref_kl_logps).mean().detach().clamp(min=0)
    chosen_losses = 1 - torch.sigmoid(BETA * (chosen_logps - ref_chosen - kl))
    rejected_losses = 1 - torch.sigmoid(BETA * (kl - (rejected_logps - ref_rejected)))
    losses = torch.cat((1.0 * chosen_losses, 1.0 * rejected_losses), 0)
    del num_chosen, num_rejected
    return (fields, ref_outputs), losses.nanmean()


__all__ = ["BETA", "DPO_POLICY_OUTPUTS", "PRECOMPUTED_KEYS", "REF_OUTPUTS", "dpo_forward_loss", "kto_forward_loss",
           "preference_inputs",
           "KTO_POLICY_OUTPUTS", "reference_copy", "reference_note", "step_note"]
