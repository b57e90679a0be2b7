"""Preference-tuning steps: DPO as TRL 1.16 ``DPOTrainer`` runs it (trl/trainer/dpo_trainer.py
``_compute_loss``, ``DataCollatorForPreference``).

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
the step goes on as :func:`.steps.train_step` (backward, optimizer). What is not modelled: the
metrics' scalars DPOTrainer logs (a few values per pair), and prompts: every position but the
first is scored, as if the completions filled the sequences (TRL scores the completion tokens
only: an upper bound on the head's share).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import TraceError
from ..workload import Objective, Quant, Reference, Workload
from .loss import causal_lm_parts, trl_log_probs

DPO_POLICY_OUTPUTS: tuple[str, ...] = ("log_probs", "entropy", "mean_logits", "is_top1")
"""What DPOTrainer asks of the policy's head (trl 1.16 dpo_trainer.py: ``outputs = ("log_probs",
"entropy", "mean_logits", "is_top1")``, ``log_sum_sq_probs`` only with ``use_weighting``)."""
REF_OUTPUTS: tuple[str, ...] = ("log_probs",)
"""``add_fused_lm_head(self.ref_model)``: the default fields."""
BETA = 0.1
"""DPOConfig ``beta`` (its value does not change memory)."""
PRECOMPUTED_KEYS = ("ref_chosen_logps", "ref_rejected_logps")


def reference_copy(model: nn.Module, w: Workload) -> nn.Module | None:
    """DPO's frozen reference (``reference=model``): a copy of the model as loaded, before PEFT,
    in the policy's dtype, gradients off, in eval mode (accelerate prepares it with
    ``evaluation_mode=True``); None for every other workload."""
    if w.objective is not Objective.DPO or w.reference_source is not Reference.MODEL:
        return None
    if w.quant is not Quant.NONE:
        raise TraceError("a quantised DPO reference model is not modelled",
                         hint="use `reference=adapters` (TRL's choice under PEFT) or `reference=precomputed`")
    p = w.parallel
    if p.dp > 1 or p.tp > 1 or p.pp > 1 or p.cp > 1:
        raise TraceError("a DPO reference model under data or model parallelism is not modelled (the trace would "
                         "have to shard it as the framework prepares it)",
                         hint="use `reference=adapters` with `peft=lora`, or `reference=precomputed`")
    import copy

    ref = copy.deepcopy(model)
    ref.requires_grad_(False)
    ref.eval()
    return ref


def step_note(w: Workload) -> str:
    """What the traced DPO step ran (one line for the report)."""
    ref = {Reference.MODEL: "a frozen copy of the model", Reference.ADAPTERS: "the policy with its adapters disabled",
           Reference.PRECOMPUTED: "log-probabilities read from the batch (no reference forward)"}[w.reference_source]
    return ("DPO step as TRL 1.16 DPOTrainer runs it: the pairs' chosen and rejected sequences as one batch through "
            f"TRL's fused LM head (log-probs, entropy, mean logits, top-1); reference: {ref}, under no_grad; the "
            "sigmoid loss. Every position but the first is scored (completions filling the sequence: an upper bound "
            "where prompts are long); the metrics' scalars are not counted")


def reference_note(reference: nn.Module) -> str:
    n = sum(q.numel() for q in reference.parameters())
    dtypes = sorted({str(q.dtype).removeprefix("torch.") for q in reference.parameters()})
    return (f"DPO reference: a frozen copy of the model ({n:,} parameters, {'/'.join(dtypes)}, the policy's dtype as "
            "TRL loads it), run under no_grad after the policy's forward")


def dpo_inputs(kwargs: dict[str, Any], pairs: int, source: Reference) -> dict[str, Any]:
    """A causal LM's training inputs for ``2 × pairs`` sequences made DPO's batch, as
    ``DataCollatorForPreference`` makes it: ``input_ids`` and a ``completion_mask`` (int64; every
    position a completion token: the upper bound), no labels (the step makes them), and with
    ``reference=precomputed`` the two fp32 columns per pair. Without padding the collator's
    ``attention_mask`` is all ones, for which transformers builds no mask (SDPA's causal path):
    it is left out, as the other traces leave it out."""
    ids = kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        raise TraceError("objective=dpo needs a token model's inputs (input_ids)")
    out = {k: v for k, v in kwargs.items() if k != "labels"}
    out["completion_mask"] = torch.ones_like(ids)
    if source is Reference.PRECOMPUTED:
        out.update({k: torch.empty(pairs, dtype=torch.float32, device=ids.device) for k in PRECOMPUTED_KEYS})
    return out


def _sequence_logps(model: nn.Module, kwargs: dict[str, Any], labels: torch.Tensor, autocast: torch.dtype | None,
                    outputs: tuple[str, ...]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(the head's per-position fields, the per-sequence log-probabilities ``[2b]``)."""
    _hf, backbone, head = causal_lm_parts(model)
    out = backbone(**{**kwargs, "use_cache": False})
    hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
    del out
    fields, _mask = trl_log_probs(hidden, head, labels, autocast, outputs)
    del hidden, _mask
    seq_len = labels.shape[1] - 1
    return fields, fields["log_probs"][:, -seq_len:].sum(dim=1)


def dpo_forward_loss(model: nn.Module, reference: nn.Module | None, source: Reference,
                     batch: tuple[tuple[Any, ...], dict[str, Any]], autocast: torch.dtype | None) -> tuple[Any, torch.Tensor]:
    """(the outputs a loop would hold, the loss) of one DPO micro-batch."""
    args, kwargs = batch
    if args:
        raise TraceError("objective=dpo needs keyword inputs (input_ids, labels)")
    kwargs = dict(kwargs)
    completion_mask = kwargs.pop("completion_mask", None)
    if not isinstance(completion_mask, torch.Tensor) or not isinstance(kwargs.get("input_ids"), torch.Tensor):
        raise TraceError("objective=dpo needs input_ids and a completion_mask in the batch (dpo_inputs)")
    pre = [kwargs.pop(k, None) for k in PRECOMPUTED_KEYS]
    labels = kwargs["input_ids"].masked_fill(completion_mask == 0, -100)
    fields, logps = _sequence_logps(model, kwargs, labels, autocast, DPO_POLICY_OUTPUTS)
    chosen_logps, rejected_logps = logps.chunk(2, dim=0)
    if source is Reference.PRECOMPUTED:
        ref_chosen, ref_rejected = pre
        if ref_chosen is None or ref_rejected is None:
            raise TraceError("reference=precomputed needs the reference log-probabilities in the batch")
    else:
        with torch.no_grad():
            if source is Reference.ADAPTERS:
                disable = getattr(model, "disable_adapter", None)
                if not callable(disable):
                    raise TraceError("reference=adapters needs a PEFT model", hint="use `reference=model`")
                ctx: Any = disable()
                outputs = DPO_POLICY_OUTPUTS  # (the policy's own patched head)
                ref_model = model
            else:
                if reference is None:
                    raise TraceError("reference=model needs the reference model")
                ctx, outputs, ref_model = contextlib.nullcontext(), REF_OUTPUTS, reference
            with ctx:
                ref_fields, ref_logps = _sequence_logps(ref_model, kwargs, labels, autocast, outputs)
        ref_chosen, ref_rejected = ref_logps.chunk(2, dim=0)
        del ref_logps
    chosen_logratios = chosen_logps - ref_chosen
    rejected_logratios = rejected_logps - ref_rejected
    delta = chosen_logratios - rejected_logratios
    per_sequence = -F.logsigmoid(BETA * delta)
    loss = 0.0 + per_sequence.mean() * 1.0
    # (both outputs live until `_compute_loss` returns: the loop drops them before backward)
    return (fields, ref_fields if source is not Reference.PRECOMPUTED else None), loss


__all__ = ["BETA", "DPO_POLICY_OUTPUTS", "PRECOMPUTED_KEYS", "REF_OUTPUTS", "dpo_forward_loss", "dpo_inputs",
           "reference_copy", "reference_note", "step_note"]
