"""Qwen2.5-VL in closed form: its language model at the sequence with the image tokens, plus its
vision tower.

The language model is a Qwen2 decoder (:func:`vramplan.models.vlm.text_spec`), estimated by
:func:`.estimate.estimate` at ``seq + images × (tokens + markers) + videos × (…)`` tokens (the
processor's counts, :mod:`vramplan.models.vlm`). The vision tower runs first, on the micro-batch's
patches ``P`` (``pixel_values`` rows), and what it leaves is added to the language model's instants,
as transformers 5.24.0 ``models/qwen2_5_vl/modeling_qwen2_5_vl.py`` runs it:

- every block (``Qwen2_5_VLVisionBlock``, ``:351-369``) keeps, per patch, what its ops save for
  backward when the tower trains: RMSNorm's fp32 input, rstd and normalised input (``:50-55``, twice);
  the linears' inputs (autocast's 16-bit casts of the norms' fp32 outputs); ``qkv``'s output (its ``v``
  is a view of it, ``:282-284``); ``q`` and ``k`` after the fp32 RoPE, cast back (``:212-222``); each
  attention call's output and fp32 logsumexp (window or full attention: the same bytes per patch, the
  calls split by ``cu_seqlens``, ``:309-324``); the concatenated output ``proj`` reads (``:325``); the
  SwiGLU MLP's gate output, activation output, up output and product (``:96``). The patch embedding
  keeps its input cast, the rotary ``cos``/``sin`` (fp32, ``[P, head_dim]`` each) are saved once for
  all blocks, the merger (``:196-198``) keeps its norm's and linears' inputs and its GELU's input;
- full checkpointing (transformers' ``gradient_checkpointing_enable`` checkpoints the vision blocks
  too: ``GradientCheckpointingLayer``) keeps a block's input only, and its backward recomputes one block;
- a frozen tower (``freeze_vision``, or LoRA, whose base weights do not train: the default targets
  ``q_proj k_proj v_proj o_proj`` are the language model's) saves nothing: nothing in it needs a
  gradient. Its forward holds one block's working set; autocast caches no cast of a weight that does
  not require a gradient;
- a frozen tower under full checkpointing carries a gradient to its input: transformers'
  checkpointing switch calls ``enable_input_require_grads`` (``modeling_utils.py:3190-3197``), which
  hooks every input embedding of the model, the tower's too (``_input_embed_layer = "patch_embed"``,
  ``:389``; ``modeling_utils.py:2147-2177``): the patch embedding's output becomes a leaf that requires
  a gradient. The tower then keeps each block's input and that leaf, its merger saves what its
  input's gradient needs (its norm's fp32 input and rstd, the GELU's input, and the 16-bit casts of
  its frozen fp32 linears' weights), and each block's backward recomputes it saving only what the
  input's gradient needs (the norms' fp32 inputs and rstd, ``qkv``'s output, ``q``/``k`` after RoPE,
  the attention's output and logsumexp, the MLP's gate, activation and up outputs, and its linears'
  weight casts), the gradient of its output arriving beside them;
- autograd runs the tower's backward after the language model's layers (its nodes are later than the
  token embedding's) and before the token embedding's: the tower's saved tensors are alive through the
  language model's backward, and the tower's gradients appear while they are freed;
- the ``pixel_values`` input (fp32 under mixed precision, else the compute dtype, ``P × 3·2·14²``) is
  alive for the whole step, as ``generate``'s model kwargs keep it through decoding.

The scope: one GPU (or plain data parallelism with the tower frozen), no quantisation, SDPA attention,
no checkpointing or full checkpointing of every layer (the tower trained or frozen), any precision,
gradient accumulation, images and videos; the rest is traced (``method=trace``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from vramplan._dataclass import dataclass
from vramplan.errors import WorkloadError
from vramplan.models._params_vlm import count_vision_qwen2_5, vision_value
from vramplan.models.params import VLM_COUNTED
from vramplan.models.spec import ModelSpec
from vramplan.models.vlm import PROCESSORS, image_tokens, text_spec, video_tokens
from vramplan.results import Breakdown, PhasePeak
from vramplan.workload import (
    ALL_LINEAR,
    Attention,
    Checkpointing,
    Objective,
    Peft,
    Phase,
    Quant,
    Workload,
)

from .arch import Linear
from .blocks import Ctx, Terms, linear_inputs, norm
from .regime import Regime, Trainable, regime
from .result import AnalyticEstimate, ModelStates
from .states import _optimizer_bytes, _optimizer_temp

ANALYTIC_VLMS = frozenset(VLM_COUNTED)
"""The vision-language models with a closed form (their parameter count too)."""

_Estimate = Callable[..., AnalyticEstimate]


@dataclass(frozen=True)
class Tower:
    """Qwen2.5-VL's vision tower, as its config sizes it."""

    depth: int
    hidden: int
    intermediate: int
    heads: int
    out_hidden: int
    channels: int
    temporal: int
    patch: int
    merge: int
    params: int

    @property
    def pixels(self) -> int:
        """Values per patch row of ``pixel_values``."""
        return self.channels * self.temporal * self.patch * self.patch

    def linears(self) -> tuple[Linear, ...]:
        d, i = self.hidden, self.intermediate
        return (Linear("qkv", "qkv", d, 3 * d), Linear("proj", "o", d, d), Linear("gate_proj", "gate", d, i),
                Linear("up_proj", "up", d, i), Linear("down_proj", "down", i, d))

    @property
    def merger_linears(self) -> tuple[Linear, ...]:
        wide = self.merge * self.merge * self.hidden
        return (Linear("mlp.0", "fc1", wide, wide), Linear("mlp.2", "fc2", wide, self.out_hidden))

    @property
    def matrix_params(self) -> int:
        """Elements of the weight matrices (linears and the patch embedding's kernel): what autocast casts."""
        return (self.depth * sum(lin.params for lin in self.linears())
                + sum(lin.params for lin in self.merger_linears) + self.pixels * self.hidden)


def tower(spec: ModelSpec) -> Tower:
    v: Mapping[str, Any] = spec.config.get("vision_config") or {}

    def get(key: str) -> int:
        return int(vision_value(v, key))

    return Tower(depth=get("depth"), hidden=get("hidden_size"), intermediate=get("intermediate_size"),
                 heads=get("num_heads"), out_hidden=get("out_hidden_size"), channels=get("in_channels"),
                 temporal=get("temporal_patch_size"), patch=get("patch_size"), merge=get("spatial_merge_size"),
                 params=count_vision_qwen2_5(v, spec.name))


def _trace_instead(what: str, field: str) -> WorkloadError:
    return WorkloadError(f"{what}: the analytic method has Qwen2.5-VL on one GPU (or plain data parallelism "
                         "with the tower frozen), "
                         "unquantised, with SDPA attention and no or full checkpointing",
                         hint="use `method=trace` (auto traces catalog models)", field=field)


def _check(spec: ModelSpec, w: Workload) -> None:
    if spec.model_type not in ANALYTIC_VLMS:
        raise WorkloadError(f"{spec.name} ({spec.model_type}) is a vision-language model whose vision tower has no "
                            "closed form here (Qwen2.5-VL has one)", hint="use `method=trace`")
    p = w.parallel
    for name in ("tp", "pp", "cp", "ep"):
        if getattr(p, name) > 1:
            raise _trace_instead(f"`{name}={getattr(p, name)}`", name)
    if p.zero:
        raise _trace_instead(f"`zero={p.zero}`", "zero")
    if w.quant is not Quant.NONE:
        raise _trace_instead(f"`quant={w.quant}`", "quant")
    if w.attention is not Attention.SDPA:
        raise _trace_instead(f"`attention={w.attention}`", "attention")
    if w.activation_offload:
        raise _trace_instead("`activation_offload`", "activation_offload")
    if w.optimizer_in_backward:
        raise _trace_instead("`optimizer_in_backward`", "optimizer_in_backward")
    if p.dp > 1 and w.training and w.peft is Peft.NONE and not w.freeze_vision:
        raise _trace_instead(f"`dp={p.dp}` with the vision tower trained (DDP's buckets of its gradients)", "dp")
    if w.objective is not Objective.SFT or w.rl:
        raise _trace_instead(f"`objective={w.objective}`", "objective")
    if w.checkpointing not in (Checkpointing.NONE, Checkpointing.FULL) or (
            w.checkpointing is Checkpointing.FULL and (w.checkpoint_fraction != 1.0 or w.checkpoint_every != 1)):
        raise _trace_instead(f"`checkpointing={w.checkpointing}` (fraction {w.checkpoint_fraction}, every "
                             f"{w.checkpoint_every})", "checkpointing")
    if w.training and w.peft is not Peft.NONE:
        vision = {lin.name for lin in tower(spec).linears()} | {"0", "2", "mlp.0", "mlp.2"}
        wanted = set(w.lora_targets)
        if ALL_LINEAR in wanted or wanted & vision:
            raise WorkloadError(
                f"LoRA targets {', '.join(sorted(wanted))}: peft would wrap linears of the vision tower too "
                f"({', '.join(sorted(wanted & vision) or ['all-linear'])}); the analytic method puts adapters on the "
                "language model only", hint="use `method=trace`, or `lora_targets` among q_proj, k_proj, v_proj, "
                "o_proj", field="lora_targets")


@dataclass(frozen=True)
class Vision:
    """The tower's bytes in one step of one rank (a micro-batch of ``patches``)."""

    patches: int
    weights: int
    gradients: int
    optimizer: int
    opt_temp: int
    casts: int
    """Autocast's 16-bit copies of the tower's weights (fp32 weights that train)."""
    pixels: int
    """``pixel_values`` (and ``pixel_values_videos``)."""
    saved: int
    """Saved for backward by the whole tower (0 when it does not train)."""
    merger: int
    """Of those, the merger's."""
    block: int
    """One block's saved set without checkpointing (the recomputed block)."""
    transient: int
    """The gradient working set of one block's backward."""
    working: int
    """The largest set alive at once in one block's forward when nothing is saved."""
    trains: bool
    flops: float
    through: bool = False
    """Frozen, a gradient flowing through it to the patch embedding's output (checkpointing)."""
    recast: int = 0
    """Autocast's 16-bit casts of one block's frozen fp32 weights, saved by its recomputed linears."""
    leaf: int = 0
    """The patch embedding's output made to require a gradient (a leaf), then its gradient."""


def _block_terms(t: Tower, ctx: Ctx) -> Terms:
    """Per patch, what one vision block saves (module docstring)."""
    c, d, i = ctx.rg.compute, t.hidden, t.intermediate
    qkv, proj, gate, up, down = t.linears()
    terms = Terms()
    out = norm(terms, "rmsnorm", c, d, ctx, "norm1")
    linear_inputs(terms, (qkv,), out, d, ctx, "attn qkv", shard="seq")
    terms.add("qkv output (v is a view of it)", 3 * c * d)
    terms.add("q, k after RoPE", 2 * c * d)
    terms.add("attention output + fp32 logsumexp", c * d + 4 * t.heads)
    linear_inputs(terms, (proj,), c, d, ctx, "attn proj", shard="seq")
    out = norm(terms, "rmsnorm", c, d, ctx, "norm2")
    linear_inputs(terms, (gate, up), out, d, ctx, "mlp in", shard="seq")
    terms.add("mlp: gate output (activation input)", c * i)
    terms.add("mlp: activation output and up output (mul inputs)", 2 * c * i)
    linear_inputs(terms, (down,), c, i, ctx, "mlp down", shard="seq")
    return terms


def _once_terms(t: Tower, ctx: Ctx, *, embed_saves: bool = True) -> Terms:
    """Per patch, what the tower saves outside its blocks (``embed_saves``: the patch embedding
    trains)."""
    c, d = ctx.rg.compute, t.hidden
    terms = Terms()
    if ctx.rg.autocast and embed_saves:  # the Conv3d's input: autocast's 16-bit cast of pixel_values (fp32 it is the input)
        terms.add("patch embedding input (autocast cast)", c * t.pixels)
    terms.add("rotary cos and sin (fp32, shared by the blocks)", 2 * 4 * (d // t.heads))
    terms.add("window index and its argsort (int64, per merged token)", 2 * 8 / (t.merge * t.merge))
    return terms


def _through_block_terms(t: Tower, ctx: Ctx) -> Terms:
    """Per patch, what one frozen block saves when a gradient flows through it to its input
    (module docstring: checkpointing with the tower frozen): its ops' inputs that the input's
    gradient needs, none that only a weight's gradient would."""
    c, d, i = ctx.rg.compute, t.hidden, t.intermediate
    terms = Terms()
    if c == 4:  # (fp32: norm1's ``to(float32)`` is the block's input itself, kept already)
        terms.add("norm1: rstd", 4)
    else:
        norm(terms, "rmsnorm", c, d, ctx, "norm1", trains=False)
    terms.add("qkv output (v is a view of it)", 3 * c * d)
    terms.add("q, k after RoPE", 2 * c * d)
    terms.add("attention output + fp32 logsumexp", c * d + 4 * t.heads)
    norm(terms, "rmsnorm", c, d, ctx, "norm2", trains=False)
    terms.add("mlp: gate output (activation input)", c * i)
    terms.add("mlp: activation output and up output (mul inputs)", 2 * c * i)
    return terms


def _through_merger_terms(t: Tower, ctx: Ctx) -> Terms:
    """Per patch, what the frozen merger saves for its input's gradient."""
    terms = Terms()
    norm(terms, "rmsnorm", ctx.rg.compute, t.hidden, ctx, "merger ln_q", trains=False)
    terms.add("merger: GELU input", ctx.rg.compute * t.hidden)
    return terms


def _merger_terms(t: Tower, ctx: Ctx) -> Terms:
    """Per patch, what the merger saves (freed by its backward, before the blocks')."""
    c, d = ctx.rg.compute, t.hidden
    terms = Terms()
    out = norm(terms, "rmsnorm", c, d, ctx, "merger ln_q")
    linear_inputs(terms, t.merger_linears[:1], out, d, ctx, "merger mlp.0", shard="seq")
    terms.add("merger: GELU input and output", 2 * c * d)
    return terms


def _per_patch(terms: Terms) -> float:
    return sum(s.per_token for s in terms)


def vision(spec: ModelSpec, w: Workload, rg: Regime, patches: int) -> Vision:
    t = tower(spec)
    c, d, i = rg.compute, t.hidden, t.intermediate
    trains = w.training and w.peft is Peft.NONE and not w.freeze_vision
    # transformers' checkpointing hooks every input embedding, the tower's patch embedding too
    # (modeling_utils.py:3190-3197, :2147-2177; the tower's ``_input_embed_layer = "patch_embed"``,
    # modeling_qwen2_5_vl.py:389): a frozen tower then carries a gradient to its input
    through = w.training and not trains and w.checkpointing is Checkpointing.FULL
    ctx = Ctx(rg, Trainable(full=True), Attention.SDPA, training=True)
    cast_weights = rg.autocast and rg.weight == 4
    recast = 0
    if through:
        block = _per_patch(_through_block_terms(t, ctx))
        merger = _per_patch(_through_merger_terms(t, ctx))
        once = _per_patch(_once_terms(t, ctx, embed_saves=False)) + merger
        kept = (t.depth + 1) * c * d + once  # each block's input and the patch embedding's output
        recast = c * sum(lin.params for lin in t.linears()) if cast_weights else 0
    else:
        block = _per_patch(_block_terms(t, ctx))
        merger = _per_patch(_merger_terms(t, ctx))
        once = _per_patch(_once_terms(t, ctx)) + merger
        if w.checkpointing is Checkpointing.FULL:
            kept = t.depth * c * d + once  # each block's input
        else:
            kept = t.depth * block + once
    grads = opt = temp = 0
    if trains:
        grads = t.params * rg.grad
        mats = [(lin.d_in, lin.d_out, t.depth, False, False) for lin in t.linears()]
        mats += [(lin.d_in, lin.d_out, 1, False, False) for lin in t.merger_linears]
        mats.append((t.pixels, d, 1, False, False))
        vectors = t.params - sum(a * b * n for a, b, n, _, _ in mats)
        opt = _optimizer_bytes(w, rg, t.params, mats, vectors)
        temp = _optimizer_temp(w, rg, t.params, 0)
    casts = c * t.matrix_params if (trains and cast_weights) else 0
    if through and cast_weights:  # the merger's linears save their frozen weights' casts for the backward
        casts = c * sum(lin.params for lin in t.merger_linears)
    out_b = max(c, rg.weight)  # a norm's output: the promotion of its weight and the 16-bit input
    # a block's input and its norm's output (the attention's or the MLP's argument) are alive through it;
    # the MLP holds the activation, the up output and their product; the attention the qkv output, the
    # fp32 copies of q and k and four fp32 RoPE temporaries (q·cos, rotate_half, its ·sin, the sum); beside
    # them the tower's rotary cos/sin (fp32) and its int64 position ids and window index
    working = max(c * d + out_b * d + 3 * c * i, c * d + out_b * d + 3 * c * d + 6 * 4 * d) \
        + 2 * 4 * (d // t.heads) + 16 + 2 * 8 // (t.merge * t.merge)
    if trains:  # (the rest is saved: only the fp32 RoPE copies and temporaries are extra)
        working = 6 * 4 * d
    elif through:  # (the block's input and the rotary tables are among the kept tensors)
        working -= c * d + 2 * 4 * (d // t.heads) + 16 + 2 * 8 // (t.merge * t.merge)
    pixels_in = 4 if w.mixed else c
    # get_image_features casts pixel_values to the tower's dtype (modeling_qwen2_5_vl.py:1093): a copy
    # alive through the tower's forward where they differ (fp32 inputs, 16-bit weights: LoRA's base)
    working += t.pixels * rg.weight if rg.weight != pixels_in else 0
    linear_flops = 2 * patches * (t.depth * sum(lin.params for lin in t.linears())
                                  + sum(lin.params for lin in t.merger_linears) // (t.merge * t.merge))
    return Vision(
        patches=patches, weights=t.params * rg.weight, gradients=grads, optimizer=opt, opt_temp=temp, casts=casts,
        pixels=patches * t.pixels * pixels_in,
        saved=round(patches * kept) if trains or through else 0,
        merger=round(patches * merger) if trains or through else 0,
        block=round(patches * block),
        # (through a frozen block, the gradient of its output arriving beside its own working set)
        transient=patches * (max(3 * c * i, 3 * c * d + 4 * d) + (c * d if through else 0)),
        working=patches * working,
        trains=trains, flops=linear_flops * (3 if trains else 2 if through else 1),
        through=through, recast=recast, leaf=patches * c * d if through else 0,
    )


def sequence(spec: ModelSpec, w: Workload) -> tuple[int, int]:
    """(tokens, patches) of one sequence: its text, images and videos."""
    tokens, patches = w.seq, 0
    if w.images:
        one = image_tokens(spec, *w.image_hw)
        tokens += w.images * (one.tokens + one.markers)
        patches += w.images * one.patches
    if w.videos:
        clip = video_tokens(spec, *w.image_hw, w.video_frames)
        tokens += w.videos * (clip.tokens + clip.markers)
        patches += w.videos * clip.patches
    return tokens, patches


def estimate_vlm(spec: ModelSpec, w: Workload, workspace_bytes: int | None, estimate: _Estimate) -> AnalyticEstimate:
    """The analytic estimate of a Qwen2.5-VL step (module docstring)."""
    _check(spec, w)
    tokens, per_seq = sequence(spec, w)
    lm_w = w.replace(images=0, videos=0, image_size=224, image_height=0, freeze_vision=False, seq=tokens)
    lm_spec = text_spec(spec)
    lm = estimate(lm_spec, lm_w, workspace_bytes=workspace_bytes)
    rg = regime(w)
    v = vision(spec, w, rg, w.batch * per_seq)
    ws = 0 if workspace_bytes is None else workspace_bytes
    lm_grads = lm.states.gradients
    # gradients kept across micro-steps (accumulation): the tower's, and the language model's where
    # the tower's forward runs (before the language model's, which ``estimate`` counts)
    keep = (w.grad_accum > 1 or w.keep_grads) and w.training
    held = v.gradients if keep else 0

    def plus(bd: Breakdown, **more: int) -> Breakdown:
        return dataclasses.replace(bd, **{k: getattr(bd, k) + n for k, n in more.items()})

    def peak(phase: Phase, *instants: Breakdown) -> PhasePeak:
        bd = max(instants, key=lambda b: b.total)
        return PhasePeak(phase, bd.total, bd)

    # the rotary inverse frequencies (inv_freq and original_inv_freq) of the language model (head_dim / 2
    # each) and of the tower (head_dim / 4 each: its axial RoPE), buffers the analytic decoder leaves out
    buffers = 2 * (lm_spec.head_dim // 2 + tower(spec).hidden // tower(spec).heads // 4) * rg.weight
    base = dict(weights=v.weights + buffers, optimizer=v.optimizer)
    phases: list[PhasePeak] = []
    for ph in lm.phases:
        bd = ph.breakdown
        if ph.phase is Phase.FORWARD and w.training:
            # (the end of the language model's forward: its FSDP2 first gathers, AnalyticEstimate.forward_end,
            # are not counted beside the tower's)
            bd = (lm.forward_end or ph).breakdown
            end = plus(bd, **base, gradients=held, activations=v.pixels + v.saved, temporaries=v.casts)
            tower_fwd = Breakdown(  # the tower's forward, before the language model's
                weights=lm.states.weights + v.weights + buffers, optimizer=lm.states.optimizer + v.optimizer,
                gradients=held + (lm_grads if keep else 0),
                # (a frozen tower's merger saves, and casts, after its blocks)
                activations=v.pixels + v.saved - (v.merger if v.through else 0),
                temporaries=(0 if v.through else v.casts) + v.working + 2 * ws)
            phases.append(peak(ph.phase, end, tower_fwd))
        elif ph.phase is Phase.BACKWARD:
            embed = 0 if lm_spec.tie_embeddings or keep else lm_spec.vocab * lm_spec.hidden * rg.grad
            if (v.trains or v.through) and w.peft is Peft.NONE:
                # the language model's backward instants come before the tower's backward, and so before
                # the token embedding's, whose new gradient autograd makes last: not there yet
                bd = dataclasses.replace(bd, gradients=min(bd.gradients, lm_grads - embed))
            lm_bwd = plus(bd, **base, gradients=held, activations=v.pixels + v.saved, temporaries=v.casts)
            instants = [lm_bwd]
            if v.trains or v.through:
                # the tower's backward: at its last block (its saved set, the language model's gradients
                # but the token embedding's, which autograd makes after it) and at its first block
                recompute = v.block if w.checkpointing is Checkpointing.FULL else 0
                opt = lm.states.optimizer + v.optimizer
                weights = lm.states.weights + v.weights + buffers
                casts = v.recast if v.through else v.casts
                instants.append(Breakdown(weights=weights, optimizer=opt, gradients=lm_grads - embed + held,
                                          activations=v.pixels + v.saved - v.merger + recompute,
                                          temporaries=casts + v.transient + 2 * ws))
                instants.append(Breakdown(weights=weights, optimizer=opt, gradients=lm_grads - embed + v.gradients,
                                          activations=v.pixels + v.block + 2 * v.leaf,  # (the leaf, then its gradient)
                                          temporaries=v.recast + v.transient + 2 * ws))
            if w.peft is Peft.NONE and lm_spec.tie_embeddings:
                # the token embedding's backward, the step's last: a tied weight already holds the output
                # head's gradient, and the embedding's new one is added to it out of place (as traced:
                # embedding_dense_backward, then add), three vocabulary-sized tensors for a moment
                table = lm_spec.vocab * lm_spec.hidden * rg.grad
                instants.append(Breakdown(weights=lm.states.weights + v.weights + buffers,
                                          optimizer=lm.states.optimizer + v.optimizer,
                                          gradients=lm_grads + v.gradients, activations=v.pixels,
                                          temporaries=2 * table + 2 * ws))
            phases.append(peak(ph.phase, *instants))
        elif ph.phase is Phase.OPTIMIZER:
            phases.append(peak(ph.phase, plus(bd, **base, gradients=v.gradients, activations=v.pixels,
                                              temporaries=v.opt_temp)))
        elif ph.phase in (Phase.FORWARD, Phase.PREFILL):  # inference: the tower runs, then the language model
            tower_fwd = Breakdown(weights=lm.states.weights + v.weights + buffers, activations=v.pixels,
                                  temporaries=v.working + ws)
            phases.append(peak(ph.phase, plus(bd, weights=v.weights + buffers, activations=v.pixels), tower_fwd))
        else:
            phases.append(peak(ph.phase, plus(bd, weights=v.weights + buffers, activations=v.pixels)))
    t = tower(spec)
    one = image_tokens(spec, *w.image_hw) if w.images else None
    note = (f"Qwen2.5-VL: the language model ({lm_spec.params:,} parameters) over {tokens:,} tokens a sequence "
            f"({w.seq:,} text" + (f" + {w.images} × {one.tokens + one.markers:,} of {w.image_hw[0]}x{w.image_hw[1]} "
                                  f"images, {one.width}x{one.height} after the processor's resize"
                                  if one else "")
            + (f" + {w.videos} video(s)" if w.videos else "")
            + f"); the vision tower ({t.params:,} parameters, {t.depth} blocks) over {v.patches:,} patches a "
            f"micro-batch, {'trained' if v.trains else 'frozen: nothing saved for backward' if w.training else 'forward only'}"
            f" ({PROCESSORS[spec.model_type].source}).")
    trainable = lm.trainable_params + (t.params if v.trains else 0)
    states = ModelStates(lm.states.weights + v.weights + buffers, lm.states.gradients + (v.gradients if w.training else 0),
                         lm.states.optimizer + v.optimizer)
    return dataclasses.replace(
        lm, phases=tuple(phases), peak=max(phases, key=lambda p: p.allocated), params=spec.params or lm.params + t.params,
        trainable_params=trainable, flops_per_step=lm.flops_per_step + v.flops * (w.grad_accum if w.training else 1),
        notes=(*lm.notes, note), states=states)


__all__ = ["ANALYTIC_VLMS", "Tower", "Vision", "estimate_vlm", "sequence", "tower", "vision"]
