"""Build a workload for real on a CUDA device and return its step, as vramplan predicts it.

The model is randomly initialised directly on the GPU in the workload's parameter dtype
(fp32 master weights for the mixed precisions); the batch is synthetic
(:func:`vramplan.models.build.example_inputs`). LoRA, gradient checkpointing and the
optimizer come from the tracer's own builders (:mod:`vramplan.trace.features`,
:func:`vramplan.trace.optim.make_optimizer`), so prediction and measurement configure the
same thing; quantised weights and 8-bit optimizers use the real bitsandbytes. What the
step does:

- train: ``grad_accum`` × (forward under autocast → loss → backward), optimizer step,
  ``zero_grad(set_to_none=True)``; fp16-mixed uses a GradScaler. The loop knobs act as in
  the trace (:mod:`vramplan.trace.steps`): ``keep_outputs`` holds the outputs through
  backward, ``keep_grads`` zeroes instead of freeing, ``optimizer_in_backward`` steps one
  optimizer per parameter from its post-accumulate-grad hook; ``loss=chunked`` runs the
  same code as the trace (:mod:`vramplan.trace.loss`), ``liger`` / ``cce`` the real
  libraries (``LigerFusedLinearCrossEntropyLoss``, ``cut_cross_entropy.linear_cross_entropy``);
- infer: one forward under ``torch.inference_mode()``;
- generate: ``model.generate`` of exactly ``new_tokens`` tokens, greedy, with the KV cache.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from vramplan.errors import WorkloadError
from vramplan.models.spec import ModelSpec
from vramplan.workload import (
    Loss,
    Optimizer,
    Peft,
    Precision,
    Quant,
    Task,
    Workload,
)


@dataclass
class WorkloadStep:
    """One step of the workload, callable; keeps the model and optimizer it drives."""

    model: Any
    run: Callable[[], None]
    optimizer: Any = None

    def __call__(self) -> None:
        self.run()


def check_measurable(w: Workload) -> None:
    """Workload features the harness cannot run for real (clear errors before any GPU work)."""
    if w.parallel.world_size > 1 or w.parallel.zero or w.parallel.offload_optimizer or w.parallel.offload_params:
        raise WorkloadError("`vramplan measure` runs one GPU without parallelism or offload",
                            hint="drop `dp`, `tp`, `pp`, `cp`, `zero` and the offload options")
    if w.quant not in (Quant.NONE, Quant.NF4, Quant.INT4, Quant.INT8):
        raise WorkloadError(f"measuring {w.quant} weights is not supported",
                            hint="use nf4, int4 or int8 (bitsandbytes)")


def build_step(spec: ModelSpec, w: Workload, *, device: str = "cuda") -> WorkloadStep:
    """Model, batch and optimizer on ``device``; returns the step."""
    import torch

    from vramplan.models.build import build_model, example_inputs
    from vramplan.trace import features

    check_measurable(w)
    dtype = features.param_dtype(w)
    model = build_model(spec, task=w.task, attention=str(w.attention), device=device, dtype=dtype)
    if w.quant is not Quant.NONE:
        model = _quantize(model, w, features.compute_dtype(w))
    model, _ = features.apply_peft(model, w)
    features.apply_checkpointing(model, w)
    model.train(w.training)
    inputs = example_inputs(spec, batch=w.batch, seq=w.seq, image_size=w.image_size, device=device,
                            labels=w.training, dtype=dtype, images=w.images, image_height=w.image_height,
                            videos=w.videos, video_frames=w.video_frames)
    amp = _Amp(torch, torch.device(device).type, features.autocast_dtype(w))
    if w.task is Task.GENERATE:
        return _generate_step(torch, model, inputs, w, amp)
    if w.task is Task.INFER:
        return _infer_step(torch, model, inputs, amp)
    return _train_step(torch, model, inputs, w, amp)


class _Amp:
    """Autocast on the step's device type (CUDA's autocast on a GPU), when the precision is mixed."""

    def __init__(self, torch: Any, device_type: str, dtype: Any | None) -> None:
        self.torch, self.device_type, self.dtype = torch, device_type, dtype

    def __call__(self) -> Any:
        return self.torch.autocast(self.device_type, dtype=self.dtype, enabled=self.dtype is not None)


# --------------------------------------------------------------------------- pieces
def _quantize(model: Any, w: Workload, compute: Any) -> Any:
    """Swap every linear layer but the output head for a bitsandbytes one (NF4 / FP4 / int8);
    bitsandbytes quantises each weight when the new layer moves to the weight's device.
    Untested here (no bitsandbytes on the CI machine): the accuracy suite's QLoRA case checks it."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise WorkloadError("measuring quantised weights needs bitsandbytes on a CUDA machine",
                            hint="pip install bitsandbytes") from None
    import torch

    if w.quant in (Quant.NF4, Quant.INT4) and w.bnb_compute_dtype.value != "auto":
        compute = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[w.bnb_compute_dtype.value]
    elif compute is torch.float32:
        compute = torch.bfloat16
    skip = {"lm_head", "classifier", "score"}

    def convert(parent: Any) -> None:
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear) and name not in skip:
                # 4-bit: quantised from the dtype the model was loaded in (quant_state.dtype), as the trace's
                weight = child.weight.data.to(compute) if w.quant is Quant.INT8 else child.weight.data
                if w.quant is Quant.INT8:
                    new = bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=child.bias is not None,
                                              has_fp16_weights=False, device="meta")
                    new.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
                else:
                    kind = "fp4" if w.quant is Quant.INT4 else "nf4"
                    new = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                            compute_dtype=compute, quant_type=kind, device="meta")
                    new.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type=kind,
                                                   compress_statistics=w.peft is Peft.QLORA
                                                   and not w.bnb_single_quant)
                if child.bias is not None:
                    new.bias = torch.nn.Parameter(child.bias.data.to(compute), requires_grad=False)
                setattr(parent, name, new.to(weight.device))
            else:
                convert(child)

    convert(model)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _optimizer(params: list[Any], w: Workload) -> Any:
    """The tracer's optimizer (same class and flags), but the real bitsandbytes for 8-bit AdamW."""
    if w.optimizer in (Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW_8BIT):
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise WorkloadError(f"measuring {w.optimizer} needs bitsandbytes", hint="pip install bitsandbytes") from None
        cls = bnb.optim.PagedAdamW8bit if w.optimizer is Optimizer.PAGED_ADAMW_8BIT else bnb.optim.AdamW8bit
        return cls(params, lr=1e-4)
    from vramplan.trace.optim import make_optimizer

    return make_optimizer(w, params)[0]


def _loss(torch: Any, out: Any) -> Any:
    loss = getattr(out, "loss", None)
    if loss is not None:
        return loss
    first = out[0] if isinstance(out, (tuple, list)) else out
    logits: Any = getattr(out, "logits", first)
    return logits.float().mean()


def _forward_loss(torch: Any, model: Any, inputs: Mapping[str, Any], w: Workload, amp: _Amp) -> tuple[Any, Any]:
    """(outputs, loss) as ``w.loss`` computes them."""
    if w.loss is Loss.FULL:
        out = model(**inputs)
        return out, _loss(torch, out)
    from vramplan.trace.loss import causal_lm_parts, forward_and_loss, shifted_labels

    if w.loss is Loss.CHUNKED:
        return forward_and_loss(model, ((), dict(inputs)), w.loss, w.loss_chunks, autocast_dtype=None, sm=(0, 0))
    if w.loss is Loss.TRL:  # TRL's own head, as its trainers add it (after PEFT, on the base model)
        try:
            from trl.trainer.utils import add_fused_lm_head
        except ImportError:
            raise WorkloadError("measuring loss=trl needs TRL", hint="pip install trl") from None
        base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
        if not getattr(base, "_vramplan_trl_head", False):
            add_fused_lm_head(base)
            base._vramplan_trl_head = True
        out = model(**inputs, fused_lm_head=True)
        return out, out.loss
    _hf, backbone, head = causal_lm_parts(model)
    out = backbone(**{k: v for k, v in inputs.items() if k != "labels"})
    hidden = out.last_hidden_state
    flat = hidden.reshape(-1, hidden.shape[-1])
    target = shifted_labels(inputs["labels"]).reshape(-1)
    try:
        if w.loss is Loss.LIGER:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            return out, LigerFusedLinearCrossEntropyLoss()(head.weight, flat, target)
        from cut_cross_entropy import linear_cross_entropy
    except ImportError:
        raise WorkloadError(f"measuring loss={w.loss} needs its library",
                            hint="pip install liger-kernel / cut-cross-entropy") from None
    if amp.dtype is not None and flat.dtype == torch.float32:
        flat = flat.to(amp.dtype)  # CCE's backward takes 16-bit embeddings only
    return out, linear_cross_entropy(flat, head.weight, target)


def _train_step(torch: Any, model: Any, inputs: Mapping[str, Any], w: Workload, amp: _Amp) -> WorkloadStep:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise WorkloadError("the model has no trainable parameters to train")
    scaler = torch.amp.GradScaler(amp.device_type) if w.precision is Precision.FP16_MIXED else None
    if w.optimizer_in_backward:  # torchtune's optimizer_in_bwd (validated: no accumulation, no scaler)
        optimizers = {p: _optimizer([p], w) for p in params}

        def step_one(param: Any) -> None:
            optimizers[param].step()
            optimizers[param].zero_grad(set_to_none=True)

        for p in params:
            p.register_post_accumulate_grad_hook(step_one)

        def step_in_backward() -> None:
            with amp():
                out, loss = _forward_loss(torch, model, inputs, w, amp)
                if not w.keep_outputs:
                    del out
                    out = None
            loss.backward()
            del loss, out

        return WorkloadStep(model, step_in_backward, optimizers)
    opt = _optimizer(params, w)

    def step() -> None:
        for _ in range(w.grad_accum):
            with amp():
                out, loss = _forward_loss(torch, model, inputs, w, amp)
                loss = loss / w.grad_accum
                if not w.keep_outputs:
                    del out
                    out = None
            if scaler is not None:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            del loss, out
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=not w.keep_grads)

    return WorkloadStep(model, step, opt)


def _infer_step(torch: Any, model: Any, inputs: Mapping[str, Any], amp: _Amp) -> WorkloadStep:
    args = {k: v for k, v in inputs.items() if k != "labels"}

    def step() -> None:
        with torch.inference_mode(), amp():
            out = model(**args)
        del out

    return WorkloadStep(model, step)


def _generate_step(torch: Any, model: Any, inputs: Mapping[str, Any], w: Workload, amp: _Amp) -> WorkloadStep:
    if not hasattr(model, "generate"):
        raise WorkloadError("this model cannot generate", hint="use `task=infer`")
    args = {k: v for k, v in inputs.items() if k != "labels"}
    cfg = getattr(model, "generation_config", None)
    pad = getattr(cfg, "pad_token_id", None)
    if pad is None:
        pad = getattr(cfg, "eos_token_id", None) or 0

    def step() -> None:
        with torch.inference_mode(), amp():
            out = model.generate(**args, max_new_tokens=w.new_tokens, min_new_tokens=w.new_tokens,
                                 do_sample=False, use_cache=True, pad_token_id=pad)
        del out

    return WorkloadStep(model, step)
