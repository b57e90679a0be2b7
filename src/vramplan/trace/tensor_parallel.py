"""Tensor (and sequence) parallelism in a trace: PyTorch's own DTensor ``parallelize_module``.

Rank 0 of the tensor-parallel group is traced: its parameters are the DTensor shards
``parallelize_module`` leaves, every op of the step runs on the local shards, and the
collectives DTensor issues (all-reduce, all-gather, reduce-scatter of activations) are the
``_c10d_functional`` ops of a fake process group (they allocate their outputs, as NCCL's
functional collectives do, and communicate nothing).

The plan is torchtitan's for Llama (``torchtitan/models/llama3/infra/parallelize.py``,
``apply_tp``, read at commit 018740b) mapped onto transformers' module names:

============================  ================================================
transformers                  style (torchtitan's name)
============================  ================================================
``model.embed_tokens``        RowwiseParallel, input Replicate, output Shard(1) (``tok_embeddings``)
``model.norm``                SequenceParallel (``norm``)
``lm_head``                   ColwiseParallel, input Shard(1), output Shard(-1) kept as a
                              DTensor for the loss-parallel cross-entropy (``output``)
``input_layernorm``           SequenceParallel (``attention_norm``)
``self_attn``                 PrepareModuleInput: hidden_states Shard(1) → Replicate (``attention``)
``q_proj``/``k_proj``/``v_proj``  ColwiseParallel (``wq``/``wk``/``wv``)
``o_proj``                    RowwiseParallel, output Shard(1) (``wo``)
``post_attention_layernorm``  SequenceParallel (``ffn_norm``)
``mlp``                       PrepareModuleInput: Shard(1) → Replicate (``feed_forward``)
``gate_proj``/``up_proj``     ColwiseParallel (``w1``/``w3``)
``down_proj``                 RowwiseParallel, output Shard(1) (``w2``)
============================  ================================================

torchtitan always shards the sequence between blocks (sequence parallelism). Without
``sp`` the plan is the Megatron one: the same column/row splits, embeddings and block
outputs all-reduced to Replicate, norms replicated. Parameters the plan leaves whole (norms,
rotary buffers are not parameters) become Replicate DTensors so that one optimizer steps
over a single tensor type (PyTorch's foreach kernels refuse a mix of DTensor and Tensor).

transformers derives the rotary positions and the causal mask from the length of the
embedding output; under sequence parallelism that is the local shard, so the traced batch
carries explicit ``position_ids`` for the whole sequence (the attention sees the whole
sequence after PrepareModuleInput's all-gather, as in torchtitan).

LoRA under tensor parallelism is what a transformers user runs instead (``docs/research/
lora-under-tp.md``): ``from_pretrained(..., distributed_config=DistributedConfig(tp_size=N))``
shards the model with transformers' own ``tp_plan`` (its styles, not PyTorch's
``parallelize_module``), and peft's ``get_peft_model`` reads that plan to shard the adapters.
:func:`apply_transformers_tensor_parallel` makes transformers' own call on the fake world
(``maybe_distribute_model`` on a ``(pp, dp_replicate, fsdp, tp)`` mesh, as
``initialize_distributed_mesh`` builds it); the full-weight path keeps torchtitan's plan.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import TraceError

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class TensorParallelLayout:
    """Where the plan's modules are in a transformers decoder."""

    layers: nn.ModuleList
    layer_path: str
    """Dotted path of the decoder layers (``model.layers``)."""
    embed: str | None
    """None: a pipeline stage after the first (its stage holds no embeddings)."""
    norm: str | None
    head: str | None


def find_layout(model: nn.Module, *, stage: bool = False) -> TensorParallelLayout:
    """The decoder layers, embeddings, final norm and head of a Llama-style transformers model.

    ``stage``: the model is a pipeline stage's part (:func:`.pipeline_parallel.split`): the
    embeddings only on the first stage, the final norm and the head only on the last (elsewhere
    ``nn.Identity``, left out of the plan), as torchtitan's plan applies to each model part.
    Raises :class:`TraceError` for any other model (the plan names its modules)."""
    layers_path, layers = "", None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) and all(_is_llama_block(b) for b in mod):
            layers_path, layers = name, mod
            break
    if layers is None:
        raise TraceError(
            f"tensor parallelism is traced with torchtitan's Llama plan, which needs decoder layers with "
            f"self_attn.{{{','.join(ATTENTION)}}} and mlp.{{{','.join(MLP)}}}; {type(model).__name__} has none",
            hint="use `method=analytic` for tensor parallelism of other architectures")
    base = layers_path.rsplit(".", 1)[0] if "." in layers_path else ""
    prefix = f"{base}." if base else ""
    mods = dict(model.named_modules())
    embed: str | None = f"{prefix}embed_tokens"
    if not isinstance(mods.get(embed), nn.Embedding):
        if stage and getattr(mods.get(base), "embed_tokens", 0) is None:
            embed = None  # a later pipeline stage: no embeddings
        else:
            raise TraceError(f"{type(model).__name__} has no `{embed}` embedding where torchtitan's Llama plan "
                             "shards the vocabulary", hint="use `method=analytic`")
    norm = f"{prefix}norm" if f"{prefix}norm" in mods else None
    if stage and norm is not None and isinstance(mods[norm], nn.Identity):
        norm = None  # a pipeline stage before the last
    head = "lm_head" if isinstance(mods.get("lm_head"), nn.Linear) else None
    return TensorParallelLayout(layers=layers, layer_path=layers_path, embed=embed, norm=norm, head=head)


def _is_llama_block(block: nn.Module) -> bool:
    attn, mlp = getattr(block, "self_attn", None), getattr(block, "mlp", None)
    if attn is None or mlp is None:
        return False
    return all(isinstance(getattr(attn, n, None), nn.Linear) for n in ATTENTION) and all(
        isinstance(getattr(mlp, n, None), nn.Linear) for n in MLP)


def apply_tensor_parallel(model: nn.Module, mesh: Any, *, sp: bool, stage: bool = False) -> list[str]:
    """Shard ``model`` in place over the 1-D tensor-parallel ``mesh`` (rank 0's view);
    ``stage``: a pipeline stage's part (:func:`find_layout`)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    lay = find_layout(model, stage=stage)
    tp = mesh.size()
    _check_heads(model, tp)
    mods = dict(model.named_modules())
    tied = lay.head is not None and lay.embed is not None and mods[lay.head].weight is mods[lay.embed].weight
    between = Shard(1) if sp else Replicate()
    root: dict[str, Any] = {}
    if lay.embed is not None:
        root[lay.embed] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if sp and lay.norm is not None:
        root[lay.norm] = SequenceParallel()
    if lay.head is not None:
        root[lay.head] = ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False)
    if root:
        parallelize_module(model, mesh, root)
    if tied:
        assert lay.head is not None and lay.embed is not None
        # each style swaps in its own sharded Parameter, which unties a tied head; both shard the
        # vocabulary (Shard(0) of [vocab, hidden]), so the head takes the embedding's shard again
        mods[lay.head].weight = mods[lay.embed].weight
    for block in lay.layers:
        plan: dict[str, Any] = {
            **{f"self_attn.{n}": ColwiseParallel() for n in ATTENTION[:3]},
            "self_attn.o_proj": RowwiseParallel(output_layouts=between),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=between),
        }
        if sp:
            plan.update({
                "input_layernorm": SequenceParallel(),
                "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                                use_local_output=True),
                "post_attention_layernorm": SequenceParallel(),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                          use_local_output=True),
            })
            if isinstance(getattr(block, "pre_feedforward_layernorm", None), nn.Module):
                # sandwich norms (Gemma-2/3): post_attention_layernorm normalises the attention's
                # output before the residual add, pre_feedforward_layernorm is the MLP's input
                # norm; the post-norms hand back their local sequence shard to the residual stream
                plan["post_attention_layernorm"] = SequenceParallel(use_local_output=True)
                plan["pre_feedforward_layernorm"] = SequenceParallel()
                if isinstance(getattr(block, "post_feedforward_layernorm", None), nn.Module):
                    plan["post_feedforward_layernorm"] = SequenceParallel(use_local_output=True)
        parallelize_module(block, mesh, plan)
    replicated = _replicate_rest(model, mesh)
    what = "tensor + sequence parallelism" if sp else "tensor parallelism"
    if stage:
        return [f"{what} on each pipeline stage's part over the mesh's tp={tp} (torchtitan's Llama plan, "
                "the embeddings' and the head's styles where the stage holds them)"]
    notes = [f"{what} traced as rank 0 of tp={tp}: PyTorch's parallelize_module with torchtitan's Llama plan "
             f"on {len(lay.layers)} decoder layers (q/k/v/gate/up column-, o/down row-sharded, embeddings "
             f"vocabulary-sharded{', lm_head column-sharded with a loss-parallel cross-entropy' if lay.head else ''})"]
    if replicated:
        notes.append(f"{replicated} parameter tensor(s) the plan leaves whole (norms) are replicated on every rank")
    return notes


def compile_refusal() -> TraceError:
    """Why a training step with this plan and compiled blocks is not traced: the real run of that
    stack fails in its first backward (docs/research/fsdp-compile.md, "TP + compile").

    The embeddings' ``RowwiseParallel`` redistributes its output with ``async_op=True``
    (``_prepare_output_fn``, ``torch/distributed/tensor/parallel/style.py`` L292-L300 in torch
    2.13.0 and 2.14.1), so ``to_local()`` hands the first block a view, made by
    ``_ToTorchTensor``'s ``view_as``, of a funcol ``AsyncCollectiveTensor``: the view carries the
    gradient, the collective's inner tensor does not. AOTAutograd replaces an
    ``AsyncCollectiveTensor`` input by its ``trigger_wait()`` before it fakes the inputs
    (``process_inputs``, ``torch/_functorch/_aot_autograd/frontend_utils.py`` L72-L77 in 2.13.0,
    ``_resolve_input_async_collectives`` L178-L188 in 2.14.1), which is that inner tensor
    (``_functional_collectives.py`` ``trigger_wait``); so the input is recorded as needing no
    gradient (``collect_metadata_analysis.py``, ``requires_grad = ... f_arg.requires_grad``), the
    compiled backward returns none for it, and DTensor's ``Redistribute`` backward is handed
    autograd's plain zero tensor and fails (``'Tensor' object has no attribute
    '_local_tensor'``). Verified on torch 2.13.0 and 2.14.1 on 2 gloo processes, with and
    without sequence parallelism; cloning the first block's input (which waits it) lets the run
    through (tests/test_trace_tp_compile.py)."""
    import torch

    return TraceError(
        "tensor parallelism with compiled blocks is not traced: the real run fails in its first backward on torch "
        f"{torch.__version__.split('+')[0]} (verified on 2.13.0 and 2.14.1): the embeddings' all-reduce "
        "(reduce-scatter under sp) hands the first compiled block an AsyncCollectiveTensor view; AOTAutograd waits "
        "it by taking the collective's inner tensor, which needs no gradient, so the compiled backward returns none "
        "for it and DTensor's Redistribute backward fails ('Tensor' object has no attribute '_local_tensor'). This "
        "is the plan traced (torch's `parallelize_module` styles); torchtitan 0.3.0's own sharding returns DTensors "
        "to the blocks and was not checked",
        hint="trace it without `compile` (the eager TP step runs and is traced), or with tp=1")


def _check_heads(model: nn.Module, tp: int) -> None:
    """``tp`` must divide the attention and key/value heads (each rank takes whole heads)."""
    cfg = getattr(model, "config", None)
    for what in ("num_attention_heads", "num_key_value_heads"):
        n = getattr(cfg, what, None)
        if isinstance(n, int) and n % tp:
            raise TraceError(f"`tp={tp}` does not divide the model's {n} {what.replace('num_', '').replace('_', ' ')}",
                             hint="use a `tp` that divides the attention and key/value heads")


def _replicate_rest(model: nn.Module, mesh: Any) -> int:
    """``distribute_module`` every module whose own parameters the plan left whole (norms):
    its parameters become Replicate DTensors, its tensor inputs are wrapped as Replicate
    and its outputs handed back as local tensors. Returns how many parameters it wrapped."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    def wrap(mod: nn.Module, inputs: tuple[Any, ...], mesh: Any) -> tuple[Any, ...]:
        return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                     if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

    def unwrap(mod: nn.Module, out: Any, mesh: Any) -> Any:
        if isinstance(out, DTensor):
            return out.to_local()
        if isinstance(out, tuple):
            return tuple(x.to_local() if isinstance(x, DTensor) else x for x in out)
        return out

    n = 0
    for mod in list(model.modules()):
        own = [p for p in mod.parameters(recurse=False) if not isinstance(p, DTensor)]
        if not own:
            continue
        if any(isinstance(p, DTensor) for p in mod.parameters(recurse=False)):
            raise TraceError(f"{type(mod).__name__} has sharded and whole parameters after the plan",
                             hint="use `method=analytic` for this architecture")
        distribute_module(mod, mesh, _replicate_own, input_fn=wrap, output_fn=unwrap)  # type: ignore[arg-type]
        n += len(own)
    return n


def _replicate_own(name: str, mod: nn.Module, mesh: Any) -> None:
    """``distribute_module``'s partition_fn: this module's own parameters as Replicate DTensors."""
    from torch.distributed.tensor import DTensor, Replicate

    for pname, p in list(mod.named_parameters(recurse=False)):
        if not isinstance(p, DTensor):
            d = DTensor.from_local(p.detach(), mesh, [Replicate()], run_check=False)
            mod.register_parameter(pname, nn.Parameter(d, requires_grad=p.requires_grad))


def position_ids(batch_kwargs: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The batch with explicit whole-sequence ``position_ids`` (see the module docstring), and
    (meta tensor, values) shadows for them: transformers reads them (packed-sequence check)."""
    ids = batch_kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or "position_ids" in batch_kwargs:
        return batch_kwargs, []
    b, s = ids.shape[0], ids.shape[1]
    real = torch.arange(s, dtype=torch.long).unsqueeze(0).expand(b, s).contiguous()
    pos = torch.empty(b, s, dtype=torch.long, device=ids.device)
    return {**batch_kwargs, "position_ids": pos}, [(pos, real)]


def loss_parallel() -> contextlib.AbstractContextManager[Any]:
    """``torch.distributed.tensor.parallel.loss_parallel()``: the cross-entropy of vocabulary-
    sharded logits without gathering them (torchtitan's default), around forward and backward."""
    from torch.distributed.tensor.parallel import loss_parallel as region

    return region()


@contextlib.contextmanager
def full_length_masks(seq: int) -> Iterator[None]:
    """Attention masks for the whole sequence under sequence parallelism.

    transformers sizes the causal / sliding-window mask by the embedding output's length
    (``masking_utils._preprocess_mask_arguments``: ``q_length = inputs_embeds.shape[1]``,
    transformers 5.x), which the vocabulary-sharded embedding hands on as this rank's sequence
    shard; the attention sees the whole sequence after PrepareModuleInput's all-gather. A
    causal model without a window needs no mask (SDPA's ``is_causal``); a sliding window does,
    and a mask of the shard's length would not match. While a step runs, the embedding output
    is seen at the whole length (a view: nothing is allocated), so the mask is the one a
    single GPU builds."""
    try:
        import transformers.masking_utils as mu
    except ImportError:  # pragma: no cover - transformers without masking_utils (< 4.53)
        yield
        return
    orig = getattr(mu, "_preprocess_mask_arguments", None)
    if orig is None:  # pragma: no cover
        yield
        return

    def whole(config: Any, inputs_embeds: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(inputs_embeds, torch.Tensor) and inputs_embeds.dim() == 3:
            b, s, h = inputs_embeds.shape
            if 0 < s < seq and seq % s == 0:
                inputs_embeds = inputs_embeds[:, :1].expand(b, seq, h)
        return orig(config, inputs_embeds, *args, **kwargs)

    mu._preprocess_mask_arguments = whole
    try:
        yield
    finally:
        mu._preprocess_mask_arguments = orig


TRANSFORMERS_MESH = ("pp", "dp_replicate", "fsdp", "tp")
"""transformers' dense mesh dimensions (``distributed/utils.py`` ``initialize_distributed_mesh``)."""


def transformers_world(tp: int, rank: int = 0) -> Any:
    """The fake world of a tensor-parallel-only transformers job: its dense mesh ``(1, 1, 1, tp)``."""
    from .dist import World

    return World(tuple(zip(TRANSFORMERS_MESH, (1, 1, 1, tp), strict=True)), rank=rank)


def apply_transformers_tensor_parallel(model: nn.Module, mesh: Any) -> list[str]:
    """Shard ``model`` as ``from_pretrained(distributed_config=DistributedConfig(tp_size=N))``
    does, before its weights load: transformers' ``maybe_distribute_model`` with the model's
    own ``tp_plan`` over ``mesh`` (:func:`transformers_world`'s), an expert mesh beside it as
    ``initialize_distributed_mesh`` builds one. The model keeps the plan and the mesh, where
    peft's ``get_peft_model`` reads them to shard its adapters."""
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from transformers import PreTrainedModel
        from transformers.distributed import DistributedConfig
        from transformers.distributed.utils import TransformersDeviceMesh
    except ImportError as e:  # (transformers before the DTensor tensor-parallel API, 5.17)
        raise TraceError(f"LoRA under tensor parallelism is traced with transformers' DTensor tp_plan, which this "
                         f"transformers does not have ({e})", hint="install transformers >= 5.17") from None
    tp = mesh["tp"].size()
    if not isinstance(model, PreTrainedModel) or not model.tp_plan:
        raise TraceError(f"LoRA under tensor parallelism is traced with transformers' own tp_plan (what "
                         f"from_pretrained(distributed_config=...) shards by); {type(model).__name__} has none",
                         hint="use `method=analytic`, or `tp=1`")
    _check_heads(model, tp)
    experts = init_device_mesh(mesh.device_type, (1, 1, tp, 1), mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep"))
    config = DistributedConfig(tp_size=tp)
    tied = _untie(model)
    type(model).maybe_distribute_model(model, config, TransformersDeviceMesh(mesh, experts))
    if tied:
        model.tie_weights(recompute_mapping=False)
    from torch.distributed.tensor import DTensor

    by_style: dict[str, list[str]] = {}
    for name, style in model.tp_plan.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in by_style.setdefault(style, []):
            by_style[style].append(leaf)
    plan = "; ".join(f"{style} {'/'.join(names)}" for style, names in by_style.items())
    whole = sum(1 for p in model.parameters() if not isinstance(p, DTensor))
    notes = [f"tensor parallelism traced as rank {mesh.get_local_rank('tp')} of tp={tp} with transformers' own tp_plan, "
             f"as from_pretrained(distributed_config=DistributedConfig(tp_size={tp})) shards the model ({plan}); "
             f"{whole} parameter tensor(s) the plan leaves whole (norms) stay plain tensors on every rank. The "
             "adapters follow peft's reading of that plan; full-weight TP is traced with torchtitan's plan instead"]
    if tied:
        pairs = ", ".join(f"`{t}` to `{model.all_tied_weights_keys[t]}`" for t in tied)
        notes.append(f"tied weights ({pairs}) sharded once: from_pretrained shards the model untied, then ties it "
                     "after loading, so the head computes with the embedding's vocabulary shard (Shard(0))")
    return notes


def _untie(model: Any) -> list[str]:
    """Give each tied parameter (a tied ``lm_head.weight``) a meta placeholder of its own, as
    ``from_pretrained`` builds the model before it shards it, and return their names.

    ``from_pretrained`` constructs the model under ``init.no_tie_weights()`` (transformers 5.24
    ``modeling_utils.py`` L3816), shards it with ``maybe_distribute_model`` (L4414), loads, and
    ties last (``_finalize_model_loading``, L4628: ``tie_weights(recompute_mapping=False)``). A
    tied head is therefore sharded by its own plan entry (``colwise_gather_output``: ``Shard(0)``
    over the vocabulary) and then replaced by the embedding's parameter (``embedding_rowwise``,
    the same ``Shard(0)``; ``distributed/mixin.py`` L93-L94), which the head's installed forward
    reads. On a model built tied, the expanded plan still lists ``lm_head.weight`` (each module's
    ``named_parameters(recurse=False)``, ``distributed/mixin.py`` L223), but
    ``apply_tensor_parallelism`` looks it up in the de-duplicated ``named_parameters()``, misses,
    and takes it for a module: ``KeyError: 'lm_head.weight'`` (``distributed/tensor_parallel.py``
    L644-L654)."""
    untied = []
    for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        try:
            shared = model.get_parameter(target) is model.get_parameter(source)
        except AttributeError:
            continue
        if not shared:
            continue
        parent, _, leaf = target.rpartition(".")
        p = model.get_parameter(source)
        setattr(model.get_submodule(parent), leaf,
                nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad))
        untied.append(target)
    return untied


def lora_rowwise_mismatch(model: nn.Module) -> tuple[str, int, int] | None:
    """(module, LoRA A's ``in_features``, the base layer's) of the first LoRA layer on a
    row-sharded linear whose A was built at a width transformers' RowwiseParallel does not
    read as the layer's input width, or None.

    peft (0.21) sizes adapters by a TP-sharded layer's local weight (``tuners_utils.py``
    ``_get_in_out_features``) and wraps a row-sharded layer's ``lora_A`` as a ``Shard(1)``
    DTensor with RowwiseParallel's forward (``lora/model.py`` ``add_lora_tp_hooks_dtensor``);
    RowwiseParallel takes a plain input as the local slice of ``in_features`` wide
    (transformers 5.24 ``distributed/tensor_parallel.py`` ``_from_local_last_dim_shard``), and
    the A's ``in_features`` is the local width: with gradients on, the forward fails."""
    for name, mod in model.named_modules():
        base = getattr(mod, "base_layer", None)
        if getattr(base, "_hf_tp_plan", None) != "rowwise":
            continue
        width = getattr(base, "in_features", None)
        for a in getattr(mod, "lora_A", {}).values():
            local = getattr(a, "in_features", None)
            if isinstance(local, int) and isinstance(width, int) and local != width:
                return name, local, width
    return None


def mesh_groups(params: list[nn.Parameter]) -> list[dict[str, Any]] | None:
    """The optimizer's parameter groups as transformers' ``Trainer.create_optimizer`` forms them
    when parameters sit on different device meshes (``trainer_optimizer.py`` ``has_mixed_dtensor``;
    one group per mesh, plain tensors in their own): a foreach or fused kernel refuses a mix of
    DTensor and Tensor. None when they share one (a single group)."""
    from torch.distributed.tensor import DTensor

    by_mesh: dict[Any, list[nn.Parameter]] = {}
    for p in params:
        by_mesh.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    if len(by_mesh) < 2:
        return None
    return [{"params": ps} for ps in by_mesh.values()]
