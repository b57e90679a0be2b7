"""Workload features applied to a meta model before tracing.

Order (each step sees the previous one's model): precision → LoRA (peft) → quantised base
weights → adapters onto the trace device → gradient checkpointing.

- precision: ``fp32`` and ``*-mixed`` keep fp32 weights (mixed adds emulated CUDA autocast);
  ``bf16``/``fp16`` convert the model (pure low precision); under PEFT the frozen base is
  stored in the compute dtype.
- LoRA: ``peft.get_peft_model`` with ``LoraConfig(r, alpha=2r, dropout=0)`` (``use_dora``,
  ``use_rslora`` as the workload says); peft keeps the adapters in fp32 over 16-bit bases
  (``autocast_adapter_dtype``), as it does on a GPU.
- QLoRA / int8 / int4 / nf4 / fp8: base ``nn.Linear`` layers (not the LM head) become
  :class:`~vramplan.trace.quant.QuantLinear` (QLoRA: NF4 with double quantisation).
- checkpointing: transformers models through ``gradient_checkpointing_enable`` (non-reentrant),
  other models by wrapping each block of their largest ``ModuleList``; the policies (full,
  every k-th, torchtitan's op-level SAC, Megatron-style selective, a user's SAC policy) are in
  :mod:`.sac`; ``checkpoint_fraction`` < 1 checkpoints the first layers only.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..emulate.tensors import on_meta
from ..errors import TraceError, WorkloadError
from ..precision import fsdp_shards_quantised, precision_model
from ..quantformats import format_of
from ..target import DEFAULT_PROFILE, DeviceProfile
from ..workload import (
    ALL_LINEAR,
    LORA_DEFAULT_TARGETS,
    Checkpointing,
    Float8,
    Peft,
    Quant,
    Workload,
)
from . import sac
from .quant import quantize_linears, use_bnb_lora_forward
from .quantkernels import quantize_format


def param_dtype(w: Workload) -> torch.dtype:
    """Dtype of the stored weights, from the one precision model (:mod:`vramplan.precision`):
    fp32 masters under fp32/AMP; 16-bit when pure, under PEFT (the usual recipe: load the base
    in bf16, train fp32 adapters under autocast) and for a quantised model's unquantised rest."""
    return _dtype(precision_model(w).weight_dtype)


def compute_dtype(w: Workload) -> torch.dtype:
    return _dtype(precision_model(w).compute_dtype)


def autocast_dtype(w: Workload) -> torch.dtype | None:
    name = precision_model(w).autocast_dtype
    return _dtype(name) if name is not None else None


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype


def apply_precision(model: nn.Module, w: Workload) -> list[str]:
    model.to(param_dtype(w))
    pm = precision_model(w)
    if not w.mixed:
        return []
    if not pm.autocast:  # FSDP2's MixedPrecisionPolicy, DeepSpeed's bf16/fp16 engine: no autocast runs
        return [f"{w.precision}: {_name(param_dtype(w))} weights, cast to {_name(compute_dtype(w))} for compute "
                "by the sharding engine's mixed precision (no autocast)"]
    if w.peft is not Peft.NONE:
        return [f"{w.precision} with PEFT: frozen base stored in {_name(param_dtype(w))}, CUDA autocast emulated"]
    return [f"{w.precision}: fp32 weights, CUDA autocast to {_name(compute_dtype(w))} emulated"]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def lora_targets(model: nn.Module, w: Workload) -> list[str]:
    if tuple(w.lora_targets) != (ALL_LINEAR,):
        return list(w.lora_targets)
    getter: Any = getattr(model, "get_output_embeddings", None)
    out_emb = getter() if callable(getter) else None
    names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
             if isinstance(m, nn.Linear) and m is not out_emb}
    return sorted(names - {"lm_head", "score", "classifier"})


DIFFUSERS_LORA_TARGETS = ("to_k", "to_q", "to_v", "to_out.0")
"""The attention projections diffusers' LoRA training scripts give adapters (``LoraConfig(
target_modules=["to_k", "to_q", "to_v", "to_out.0"])``)."""

VISION_TOWERS = ("visual", "vision_tower", "vision_model")
"""Names of a vision-language model's vision encoder in transformers (Qwen2-VL's ``visual``
holds its merger too)."""


def freeze_vision(model: nn.Module, w: Workload) -> list[str]:
    """``freeze_vision``: the vision tower's parameters do not train."""
    if not w.freeze_vision:
        return []
    towers = [(n, m) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in VISION_TOWERS]
    if not towers:
        raise WorkloadError("`freeze_vision` applies to vision-language models; this model has no vision tower",
                            hint="drop `freeze_vision`", field="freeze_vision")
    if not w.training:
        return []
    n = 0
    for _, m in towers:
        for q in m.parameters():
            n += q.numel() if q.requires_grad else 0
            q.requires_grad_(False)
    return [f"vision tower frozen ({', '.join(name for name, _ in towers)}: {n:,} parameters without gradients "
            "or optimizer states)"]


def apply_peft(model: nn.Module, w: Workload) -> tuple[nn.Module, list[str]]:
    if w.peft is Peft.NONE:
        return model, []
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:  # peft is in the models extra
        raise TraceError("tracing LoRA / QLoRA needs peft, which is not installed",
                         hint="pip install 'vramplan[models]' adds it; `method=analytic` works without it") from None
    targets: list[str] | None = lora_targets(model, w)
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    note = ""
    if not set(targets or ()) & present:
        if tuple(w.lora_targets) != LORA_DEFAULT_TARGETS:
            raise TraceError(f"none of the LoRA target modules {targets} exist in the model",
                             hint="set lora_targets to module names of the model, or all-linear")
        if _diffusers_model(model) is not None:  # (peft has no defaults for a diffusers model: no model_type)
            targets = [t for t in DIFFUSERS_LORA_TARGETS if t.split(".")[0] in present]
            note = (" (diffusers' LoRA training scripts' attention targets: train_text_to_image_lora.py, "
                    "train_dreambooth_lora_*.py)")
        else:
            targets, note = None, " (the default q/k/v/o names are absent: peft's defaults for this architecture)"
    cfg = LoraConfig(r=w.lora_rank, lora_alpha=2 * w.lora_rank, lora_dropout=0.0,
                     target_modules=targets, bias="none", use_dora=w.lora_dora, use_rslora=w.lora_rslora,
                     modules_to_save=list(w.lora_modules_to_save) or None)
    # On a meta model the adapters are built on meta too: peft would create them on the CPU,
    # initialise them for real (kaiming-uniform A, zero B: ~15 ms per layer on an 8B model, most
    # of a LoRA trace's set-up) and move them next to the base layer; to_trace_device() moves
    # everything to meta anyway, and no value of a weight reaches the trace.
    all_meta = all(on_meta(p) for p in model.parameters())
    try:
        with torch.device("meta") if all_meta else contextlib.nullcontext():
            peft_model = get_peft_model(model, cfg)
    except ValueError as e:
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
        some = f"some of: {', '.join(linear[:8])}, or all-linear" if linear else "module names of the model"
        raise TraceError(f"LoRA cannot wrap this model: {' '.join(str(e).split())}",
                         hint=f"set `lora_targets` to {some}") from None
    saved = {name.rsplit(".", 1)[-1] for name, m in peft_model.named_modules()
             if type(m).__name__ == "ModulesToSaveWrapper"}
    missing = [t for t in w.lora_modules_to_save if t.rsplit(".", 1)[-1] not in saved]
    if missing:  # (peft copies what it finds and says nothing of the rest)
        heads = [n for n in ("lm_head", "embed_tokens", "score", "classifier", "wte", "word_embeddings") if n in present]
        raise TraceError(f"`lora_modules_to_save`: no module named {', '.join(missing)} in the model",
                         hint=f"use module names of the model, such as {', '.join(heads) or 'its head or embedding'}")
    used = sorted(cfg.target_modules) if cfg.target_modules else []
    kind = "DoRA" if w.lora_dora else "LoRA"
    scaled = ", rsLoRA scaling" if w.lora_rslora else ""
    full = f"; {', '.join(w.lora_modules_to_save)} trained in full (a copy each)" if w.lora_modules_to_save else ""
    return peft_model, [f"{kind} r={w.lora_rank}{scaled} on {', '.join(used)}{note}{full} (peft {_peft_version()})"]


def _peft_version() -> str:
    import peft

    return str(peft.__version__)


def apply_quant(model: nn.Module, w: Workload, device: DeviceProfile = DEFAULT_PROFILE) -> list[str]:
    if w.quant is Quant.NONE:
        return []
    fmt = format_of(w.quant)
    if fmt is not None:
        if device.usable is not None and device.sm < fmt.min_sm:  # (no GPU given: nothing to check against)
            raise TraceError(f"{w.quant} does not run on {device.name} (sm{device.sm[0]}{device.sm[1]}): {fmt.min_sm_why}",
                             hint="pick a newer GPU, or another `quant`")
        cd = compute_dtype(w)
        n = quantize_format(model, w.quant, cd, sm_count=device.sm_count)
        return [f"{n} linear layers stored as {fmt.library} (LM head kept in {_name(param_dtype(w))}); "
                f"per forward: {fmt.forward} [{fmt.source}]"]
    double = w.peft is Peft.QLORA and not w.bnb_single_quant
    pm = precision_model(w)
    four_bit = w.quant in (Quant.NF4, Quant.INT4)
    compute = _dtype(pm.bnb_dtype) if four_bit else compute_dtype(w)
    # FSDP (FSDP-QLoRA as accelerate / HF document it): bnb_4bit_quant_storage = the dtype FSDP
    # all-gathers in, so the packed weights are sharded parameters the mixed-precision cast leaves alone
    storage = (compute_dtype(w) if w.mixed else param_dtype(w)) if four_bit and fsdp_shards_quantised(w) else None
    n = quantize_linears(model, w.quant, compute, double_quant=double, storage_dtype=param_dtype(w),
                         quant_storage=storage)
    wrapped = use_bnb_lora_forward(model) if four_bit else 0
    what = f"{w.quant}{' with double quantisation' if double else ''}"
    how = f", computing in {_name(compute)}" if four_bit else ""
    fsdp = (f"; under FSDP the packed weights are Params4bit parameters with bnb_4bit_quant_storage="
            f"{_name(storage)}, sharded, and the quant state (absmax, codes) stays whole on every rank") \
        if storage is not None else ""
    lora = (f"; {wrapped} LoRA layers run peft's bitsandbytes forward (lora.bnb.Linear4bit: the base output cloned "
            "before the adapter's is added)") if wrapped else ""
    return [f"{n} linear layers stored as {what} (bitsandbytes-style storage emulated; LM head kept{how}){fsdp}{lora}"]


FLOAT8_SM = (8, 9)
MXFP8_SM = (10, 0)


def apply_float8(model: nn.Module, w: Workload, device: DeviceProfile = DEFAULT_PROFILE) -> list[str]:
    """torchao's ``convert_to_float8_training`` with the workload's recipe, run for real on the
    meta model: its ``Float8Linear`` casts and ``_scaled_mm`` calls are what the trace records.
    Filtered as torchtitan filters (``float8.py``): not the output head, and no linear with a
    dimension that is not a multiple of 16. ``mxfp8``: torchao's ``MXFP8Linear`` on every linear
    (:func:`_apply_mxfp8`, :mod:`.mxfp8`)."""
    if w.float8 is Float8.NONE:
        return []
    if w.float8 is Float8.MXFP8 and device.usable is not None and device.sm < MXFP8_SM:
        raise TraceError(f"MXFP8 training needs an sm100+ GPU (torchtitan's converter checks "
                         f"has_cuda_capability(10, 0); torchao's MXFP8 casts and torch._scaled_mm's e8m0 block scales "
                         f"are Blackwell kernels); {device.name} is sm{device.sm[0]}{device.sm[1]}",
                         hint="pick a B200/GB200, or use `float8=rowwise`")
    if device.usable is not None and device.sm < FLOAT8_SM:
        raise TraceError(f"float8 training needs an sm89+ GPU (fp8 tensor cores for torch._scaled_mm); "
                         f"{device.name} is sm{device.sm[0]}{device.sm[1]}", hint="pick an H100/H200/L40S/B200, or drop `float8`")
    if precision_model(w).autocast:
        raise TraceError("float8 training under autocast (AMP: `*-mixed` without FSDP) is not traced: the emulated "
                         "autocast casts torchao's fp8 tensors where CUDA's leaves them to torchao",
                         hint="use `precision=bf16`, or FSDP (`zero=3`: its mixed precision has no autocast), as "
                              "torchtitan trains float8")
    if w.float8 is Float8.MXFP8:
        return _apply_mxfp8(model, w)
    try:
        import torchao
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise TraceError(f"float8 training is traced by running torchao's own Float8Linear, and torchao does not import "
                         f"here ({type(e).__name__}: {e})", hint="pip install torchao (0.18 tested)") from e
    recipe = {Float8.ROWWISE_GW_HP: "rowwise_with_gw_hp"}.get(w.float8, str(w.float8))
    config = Float8LinearConfig.from_recipe_name(recipe)
    if w.float8_fsdp_all_gather:
        import dataclasses

        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    getter: Any = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None

    def keep(mod: nn.Module, fqn: str) -> bool:
        if mod is head or fqn.rsplit(".", 1)[-1] in ("lm_head", "output") or not isinstance(mod, nn.Linear):
            return False
        return mod.in_features % 16 == 0 and mod.out_features % 16 == 0

    before = sum(1 for m in model.modules() if type(m) is nn.Linear)
    convert_to_float8_training(model, config=config, module_filter_fn=keep)
    after = sum(1 for m in model.modules() if type(m) is nn.Linear)
    gather = "; FSDP all-gathers the weights in fp8" if w.float8_fsdp_all_gather else ""
    return [f"float8 training ({recipe}): {before - after} linear layers converted to torchao {torchao.__version__}'s "
            f"Float8Linear (its own code traced), the output head and layers with a dimension not a multiple of 16 "
            f"kept{gather}"]


def _apply_mxfp8(model: nn.Module, w: Workload) -> list[str]:
    """torchtitan 0.3.0's ``quantize.linear.mx``: every linear becomes torchao's ``MXFP8Linear``
    with its defaults (:mod:`.mxfp8`); the trace runs it under :func:`.mxfp8.kernel_stand_ins`."""
    if w.compile:
        raise TraceError("MXFP8 training with `compile` is not traced: torchtitan's mxfp8 recipe compiles the model, "
                         "and the trace's per-block AOTAutograd emulation of torchao's mx_mm (an allow_in_graph "
                         "autograd function around Triton/CUDA casts) is unchecked: it keeps a different saved set "
                         "from the eager trace, with nothing to compare it with",
                         hint="drop `compile` (the eager MXFP8 step, torchao's code as it runs uncompiled)")
    if compute_dtype(w) != torch.bfloat16:
        raise TraceError(f"MXFP8 training casts bf16 only (torchao's Triton dim-0 cast asserts bfloat16 input); "
                         f"`precision={w.precision}` computes in {_name(compute_dtype(w))}",
                         hint="use `precision=bf16`, or `bf16-mixed` with FSDP (`zero=3`), as torchtitan trains")
    try:
        import torchao

        from . import mxfp8
    except ImportError as e:
        raise TraceError(f"MXFP8 training is traced by running torchao's own MXFP8Linear, and torchao does not import "
                         f"here ({type(e).__name__}: {e})", hint="pip install torchao (0.18 tested)") from e
    bad = mxfp8.bad_dims(model)
    if bad:
        name, d_in, d_out = bad[0]
        raise TraceError(f"MXFP8 training: `{name}` is {d_in} -> {d_out}, and torchao's MXFP8 casts need every "
                         f"dimension a multiple of 32 ({len(bad)} such linear layer(s); torchtitan's converter "
                         "filters none, and the cast asserts)", hint="use `float8=rowwise`")
    n = mxfp8.convert(model)
    return [f"MXFP8 training (torchtitan's quantize.linear.mx): {n} linear layers, the output head included, "
            f"converted to torchao {torchao.__version__}'s MXFP8Linear (kernel_preference=AUTO, RCEIL scales; its own "
            "code traced, its Triton dim-0 and CUDA dim-1 casts stood in for by their output allocations: fp8 data + "
            "e8m0 scale per 32 values); backward keeps the bf16 input and weight, as bf16 does"]


def apply_experts_impl(model: nn.Module, sm: tuple[int, int]) -> list[str]:
    """transformers MoE experts: ``grouped_mm`` (its default) needs bf16 weights on sm80+;
    otherwise the eager per-expert loop runs (as it would have to on that GPU)."""
    setter = getattr(model, "set_experts_implementation", None)
    config = getattr(model, "config", None)
    current = getattr(config, "_experts_implementation", None)
    if setter is None or current is None:
        return []
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    if not experts:
        return []
    ok = sm >= (8, 0) and all(p.dtype == torch.bfloat16 for p in experts)
    impl = "grouped_mm" if ok else "eager"
    if impl != current:
        try:
            setter(impl)
        except ValueError:  # its own experts code, not transformers' switchable one (Llama 4's bmm)
            return []
    why = "" if ok else " (grouped_mm needs bf16 expert weights on sm80+)"
    return [f"MoE experts run '{impl}'{why}"]


def to_trace_device(model: nn.Module) -> None:
    """Move anything a feature created off the trace device (peft builds adapters on CPU)."""
    if any(not on_meta(p) for p in model.parameters()) or any(not on_meta(b) for b in model.buffers()):
        model.to("meta")


def apply_checkpointing(model: nn.Module, w: Workload, policy: sac.Policy | None = None) -> list[str]:
    """Checkpoint the model's layers under the workload's policy (:mod:`.sac`); ``policy``: a
    user SAC policy for ``create_selective_checkpoint_contexts`` (implies checkpointing)."""
    if (w.checkpointing is Checkpointing.NONE and policy is None) or not w.training:
        return []
    kwargs: dict[str, Any] = {"use_reentrant": False}
    ctx_fn = sac.context_fn(w, policy)
    if ctx_fn is not None:
        kwargs["context_fn"] = ctx_fn
    hf = _hf_model(model)
    dm = _diffusers_model(model)
    if dm is not None and policy is None and ctx_fn is None and w.checkpoint_every == 1 \
            and w.checkpoint_fraction == 1.0:
        # diffusers' own switch: the model's forward checkpoints each block it loops over
        # (FLUX: its double- and single-stream blocks), through the function given here
        def checkpoint_fn(module: nn.Module, *args: Any) -> Any:
            return checkpoint(module.__call__, *args, **kwargs)

        dm.enable_gradient_checkpointing(checkpoint_fn)
        lists = [(n, len(m)) for n, m in dm.named_children() if isinstance(m, nn.ModuleList) and len(m) > 1]
        what = ", ".join(f"{n} ({k})" for n, k in lists) or "its blocks"
        return [f"{sac.describe(w, policy)} (diffusers enable_gradient_checkpointing: {what}, use_reentrant=False)"]
    if hf is not None and getattr(hf, "supports_gradient_checkpointing", False):
        if hasattr(hf, "activation_checkpointing_enable"):
            hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        flagged = [m for m in hf.modules() if getattr(m, "gradient_checkpointing", None) is True and m is not hf]
        # The flag is also set on containers (e.g. LlamaModel); the checkpointed units are the
        # innermost flagged modules (the decoder layers).
        layers = [m for m in flagged if not any(
            getattr(c, "gradient_checkpointing", None) is True for c in m.modules() if c is not m)]
        keep = set(sac.checkpointed(len(layers), w, policy=policy is not None))
        for i, m in enumerate(layers):
            if i not in keep:
                m.gradient_checkpointing = False
        how = "transformers gradient_checkpointing_enable"
    else:
        blocks = _largest_module_list(model)
        if blocks is None:
            return [f"checkpointing {w.checkpointing} requested but the model has no block list; traced as written"]
        keep = set(sac.checkpointed(len(blocks), w, policy=policy is not None))
        for i, block in enumerate(blocks):
            if i in keep:
                _wrap_checkpoint(block, kwargs)
        how = "torch.utils.checkpoint around each block"
    every = f", every {w.checkpoint_every}-th layer" if w.checkpoint_every > 1 else ""
    return [f"{sac.describe(w, policy)} of {len(keep)} layers{every} ({how}, use_reentrant=False)"]


def apply_compile(model: nn.Module, w: Workload, policy: sac.Policy | None = None) -> tuple[Any, list[str]]:
    """``compile``: each block of the model's largest block list compiled on its own
    (:mod:`.compile`); returns (the compiler, whose notes come after the trace; notes)."""
    if not w.compile:
        return None, []
    if not w.training:
        return None, ["torch.compile: inference traced eagerly (no partitioning without autograd; "
                      "Inductor's fusion not modelled)"]
    from . import compile as tc

    blocks = _largest_module_list(model)
    if blocks is None:
        return None, ["torch.compile requested but the model has no block list; traced eagerly"]
    notes: list[str] = []
    config = getattr(_hf_model(model), "config", None)
    if config is not None and getattr(config, "use_cache", False):
        # a KV cache threaded through compiled blocks is Dynamo's side-effect handling, not
        # emulated; a compiled training step has no use for it
        config.use_cache = False
        notes.append("torch.compile: the model's KV cache is off in training (use_cache=False)")
    if w.checkpointing in (Checkpointing.SELECTIVE, Checkpointing.OP) or policy is not None:
        notes.append("torch.compile with selective checkpointing: the policy tags the ops of the compiled block's "
                     "graph as Dynamo's tag_activation_checkpoint does, and the partitioner saves from the tags "
                     "(what it keeps is real torch.compile's on CPU: tests/test_trace_compile.py)")
    return tc.apply_compile(list(blocks)), notes


def _hf_model(model: nn.Module) -> Any:
    for m in (model, getattr(model, "base_model", None), getattr(getattr(model, "base_model", None), "model", None)):
        if m is not None and hasattr(m, "gradient_checkpointing_enable"):
            return m
    return None


def _diffusers_model(model: nn.Module) -> Any:
    """The diffusers model inside ``model`` (peft wraps it) that has diffusers' checkpointing switch."""
    for m in (model, getattr(getattr(model, "base_model", None), "model", None)):
        if m is not None and callable(getattr(m, "enable_gradient_checkpointing", None)) \
                and getattr(m, "_supports_gradient_checkpointing", False) \
                and type(m).__module__.startswith("diffusers."):
            return m
    return None


def _largest_module_list(model: nn.Module) -> nn.ModuleList | None:
    best, best_n = None, 0
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > 1:
            n = sum(p.numel() for p in m.parameters())
            if n > best_n:
                best, best_n = m, n
    return best


def _wrap_checkpoint(block: nn.Module, kwargs: dict[str, Any]) -> None:
    block.__dict__["_vramplan_forward"] = block.forward  # (what runs inside the checkpoint: compile replaces it)
    block.__dict__["_vramplan_checkpoint"] = functools.partial(checkpoint, **kwargs)  # (compile's region takes it)
    block._vramplan_checkpointed = True  # type: ignore[assignment]

    def forward(*args: Any, **kw: Any) -> Any:
        inner = block.__dict__["_vramplan_forward"]
        if not torch.is_grad_enabled():
            return inner(*args, **kw)
        return checkpoint(inner, *args, **kwargs, **kw)

    block.forward = forward  # type: ignore[method-assign]
