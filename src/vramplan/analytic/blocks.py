"""What one transformer block keeps alive, per token, derived op by op from autograd.

Each function appends :class:`Saved` terms (bytes per token, or per query·key pair for
materialised attention scores). The rules, checked against ``saved_tensors_hooks`` on a
real ``LlamaDecoderLayer`` (tests/test_analytic_torch.py):

- A linear saves its input only when its weight trains (``mm`` saves ``self`` for the
  weight gradient); it always keeps its weight (a parameter, or autocast's 16-bit copy).
- Under ``torch.autocast`` a linear fed an fp32 tensor saves its *own* 16-bit cast
  (casts of non-leaf tensors are not cached), so q, k and v each hold one.
- ``a * b`` saves ``b`` if ``a`` needs a gradient and ``a`` if ``b`` does; ``x * const``
  saves only the constant.
- HF ``LlamaRMSNorm``: ``x.to(fp32)`` → ``pow(2)`` (saves fp32 x) → ``mean`` → ``rsqrt``
  (saves the [n, 1] result) → ``x * rsqrt`` (saves fp32 x and rsqrt) → ``.to(input dtype)``
  → ``weight * normed`` (saves ``normed`` when the weight trains). Output dtype: the
  promotion of the weight the forward reads and the input (transformers 5.24
  ``models/llama/modeling_llama.py:62-67``): fp32 under AMP, whose weights are fp32 (``mul`` is on
  no autocast list); 16-bit under FSDP's mixed precision, whose forward reads the 16-bit
  ``param_dtype`` copy of the fp32 stored weight (``PrecisionModel.forward_weight``), and in pure 16-bit.
- ``layer_norm`` saves its input plus mean and rstd ([n] fp32 each); under autocast it is
  an fp32-list op, so a 16-bit input is saved as its fp32 cast and the output is fp32.
- SiLU / GELU (fused) save their input; GPT-2's composite ``gelu_new`` saves four
  intermediate-sized tensors (x, tanh(·), 0.5·x, 1 + tanh(·)).
- Dropout with p > 0 saves a bool mask (1 B/element); with p = 0 it returns its input.
- SDPA flash / memory-efficient kernels save q, k, v, out and an fp32 logsumexp [b, H, s];
  GQA runs natively (``enable_gqa``), so k and v keep kv_heads. Eager attention saves q and
  k/v repeated to all heads, the softmax output (fp32 under autocast or HF's upcast), and
  the 16-bit probabilities (or dropout mask + dropped probabilities).

``shard="tp"`` terms split across tensor-parallel ranks (head-split attention, MLP
intermediates, column/row-parallel inputs); ``shard="seq"`` terms are replicated across TP
ranks unless sequence parallelism splits them (norm inputs, block inputs, dropout masks).
"""

from __future__ import annotations

from dataclasses import replace

from vramplan._dataclass import dataclass
from vramplan.workload import Attention

from .arch import Head, LayerGroup, Linear
from .regime import Regime, Trainable


@dataclass(frozen=True)
class Saved:
    """One tensor autograd saves in a block, sized per token (or per attention pair)."""

    name: str
    per_token: float = 0.0
    per_pair: float = 0.0
    """Bytes per (query token, key token) pair: materialised attention scores."""
    shard: str = "tp"
    core: bool = False
    """Attention core (QKᵀ, softmax, dropout): recomputed under selective checkpointing."""
    packs: int = 1
    """Times autograd saves this tensor (each save is a separate copy under activation offload)."""


@dataclass(frozen=True)
class Ctx:
    """What decides a block's saved tensors: precision regime, trainable set, attention kernel."""

    rg: Regime
    tr: Trainable
    attention: Attention
    training: bool = True
    ring: bool = False
    """Context parallelism's ring attention (``cp > 1``): the rounds' outputs are merged in fp32
    and cast back (torch ``_context_parallel/_attention.py`` ``_SDPAMerger``), a fresh
    ``[B, H, T, D]``-contiguous tensor, so the o_proj input (``transpose(1, 2).contiguous()``)
    is a copy of it, where a fused kernel's own output is laid out ``[B, T, H, D]`` and the
    copy is a view (docs/research/pipeline-fsdp.md, pipeline × context parallelism)."""
    padded: bool = False
    """A padding attention mask reaches SDPA (TRL's GRPO batches prompts of different lengths):
    transformers 5.24 builds the 4-D mask and, with a mask, repeats k and v to every head
    (``integrations/sdpa_attention.py`` ``use_gqa_in_sdpa``, L42-L51: GQA in SDPA only without a
    mask; ``repeat_kv``, L19-L28 and L120-L127); SDPA converts the bool mask per call to an
    additive mask in the compute dtype (``convert_boolean_attn_mask``), which the fused kernel
    saves for its backward (docs/research/grpo-attention-mask.md)."""


class Terms(list[Saved]):
    def add(self, name: str, per_token: float = 0.0, *, pair: float = 0.0,
            shard: str = "tp", core: bool = False, packs: int = 1) -> None:
        if per_token or pair:
            self.append(Saved(name, per_token, pair, shard, core, packs))

    def saved_again(self, name: str) -> None:
        """Another op saves the tensor of term ``name`` (the latest such term)."""
        for i in range(len(self) - 1, -1, -1):
            if self[i].name == name:
                self[i] = replace(self[i], packs=self[i].packs + 1)
                return


# --- building blocks ---------------------------------------------------------------------

def norm(t: Terms, kind: str, in_b: int, width: int, ctx: Ctx, name: str, *,
         trains: bool | None = None, shard: str = "seq", rows: int = 1) -> int:
    """Append a norm's saved tensors; return the byte width of its output.

    ``rows``: rows normalised per token (per-head q/k norms normalise one row per head)."""
    trains = ctx.tr.full if trains is None else trains
    if kind == "layernorm":
        x_b = 4 if ctx.rg.autocast else in_b
        cast = " (fp32 cast)" if x_b != in_b else ""
        t.add(f"{name}: input{cast} + mean/rstd", x_b * width + 8 * rows, shard=shard)
        return x_b
    t.add(f"{name}: fp32 input", 4 * width, shard=shard, packs=2)  # pow and mul both save x
    t.add(f"{name}: rstd", 4 * rows, shard=shard)
    if kind == "gemma_rmsnorm":  # x.float() normalised, times (1 + weight.float()), cast back
        if trains:
            t.add(f"{name}: fp32 normalised input (weight grad)", 4 * width, shard=shard)
        return in_b
    if trains:
        t.add(f"{name}: normalised input (weight grad)", in_b * width, shard=shard)
    return max(in_b, ctx.rg.forward_weight)


def linear_inputs(t: Terms, lins: tuple[Linear, ...], in_b: int, width: int, ctx: Ctx, name: str, *,
                  shard: str, counted: bool = False) -> None:
    """Inputs saved by linears that read the same tensor (``counted``: already saved by another op)."""
    rg, c = ctx.rg, ctx.rg.compute
    shared = counted
    for lin in lins:
        if ctx.tr.full:
            if rg.autocast and in_b != c:
                t.add(f"{name}: {lin.name} input (autocast cast)", c * width, shard=shard)
            elif not shared:
                t.add(f"{name}: input", in_b * width, shard=shard)
                shared = True
            else:
                t.saved_again(f"{name}: input")
        elif ctx.tr.lora_on(lin):
            # PEFT casts x to the fp32 adapter dtype; under autocast lora_A then casts it back. Under FSDP2's
            # mixed precision the adapters are gathered in param_dtype (PrecisionModel.param_cast): the
            # cast is a no-op and each lora_A saves x itself (peft 0.21.2 tuners/lora/layer.py:1100 Linear.forward,
            # ``x = self._cast_input_dtype(x, lora_A.weight.dtype)``)
            if rg.param_cast:
                if not shared:
                    t.add(f"{name}: input", in_b * width, shard=shard)
                    shared = True
                else:
                    t.saved_again(f"{name}: input")
            elif rg.autocast:
                t.add(f"{name}: {lin.name} LoRA input (16-bit cast)", c * width, shard=shard)
            elif in_b == 4:
                if not shared:
                    t.add(f"{name}: input", 4 * width, shard=shard)
                    shared = True
            else:
                t.add(f"{name}: {lin.name} LoRA input (fp32 cast)", 4 * width, shard=shard)
            t.add(f"{name}: {lin.name} LoRA A output", ctx.tr.rank * (c if rg.autocast or rg.param_cast else 4),
                  shard="seq")


def _softmax_bytes(g: LayerGroup, ctx: Ctx) -> int:
    c = ctx.rg.compute
    return 4 if (ctx.rg.autocast or c == 4 or g.attn.softmax_fp32) else c


def _softmax_copy(g: LayerGroup, ctx: Ctx) -> int:
    """``softmax(x, dtype=float32)`` on CUDA first copies a bf16 input to fp32 (only fp16 has
    the no-copy ``half_to_float`` kernel; aten/src/ATen/native/SoftMax.cpp)."""
    c = ctx.rg.compute
    return 4 if _softmax_bytes(g, ctx) == 4 and c != 4 and ctx.rg.compute_dtype != "float16" else 0


def _eager_core(t: Terms, g: LayerGroup, ctx: Ctx) -> None:
    a, c = g.attn, ctx.rg.compute
    sm = _softmax_bytes(g, ctx)
    t.add("attn: softmax output", pair=sm * a.heads, core=True)
    if a.dropout > 0 and ctx.training:
        t.add("attn: dropout mask", pair=a.heads, core=True)
        t.add("attn: dropped probabilities", pair=c * a.heads, core=True)
    elif sm != c:
        t.add("attn: probabilities (16-bit)", pair=c * a.heads, core=True)


# --- attention ---------------------------------------------------------------------------

def mha(t: Terms, g: LayerGroup, ctx: Ctx, in_b: int, h: int) -> None:
    a, c = g.attn, ctx.rg.compute
    linear_inputs(t, g.role("qkv") or g.role("q", "k", "v"), in_b, h, ctx, "attn qkv", shard="seq")
    if a.qk_norm:  # per-head RMSNorm of the projections (their RoPE'd outputs feed the kernel)
        norm(t, g.norm, c, a.q_dim, ctx, "q_norm", shard="tp", rows=a.heads)
        norm(t, g.norm, c, a.kv_dim, ctx, "k_norm", shard="tp", rows=a.kv_heads)
    if ctx.attention is Attention.EAGER:
        t.add("attn: q", c * a.q_dim)
        t.add("attn: k, v repeated to all heads", 2 * c * a.q_dim)
        _eager_core(t, g, ctx)
        out_counted = False  # the output is transposed into a fresh tensor for o_proj
    elif ctx.padded:
        t.add("attn: q, k, v repeated to all heads (kernel inputs)", 3 * c * a.q_dim)
        t.add("attn: additive padding mask [b, 1, s, s] (one per layer)", pair=c, shard="seq")
        t.add("attn: output + fp32 logsumexp", c * a.q_dim + 4 * a.heads)
        out_counted = not ctx.ring
    else:
        t.add("attn: q, k, v (kernel inputs)", c * (a.q_dim + 2 * a.kv_dim))
        t.add("attn: output + fp32 logsumexp", c * a.q_dim + 4 * a.heads)
        out_counted = not ctx.ring  # the ring's merged output is copied for o_proj
    linear_inputs(t, g.role("o"), c, a.q_dim, ctx, "attn o", shard="tp", counted=out_counted)


def mla(t: Terms, g: LayerGroup, ctx: Ctx, in_b: int, h: int) -> None:
    """DeepSeek MLA: low-rank q (q_a → RMSNorm → q_b) and kv (kv_a → RMSNorm → kv_b)."""
    a, c, n = g.attn, ctx.rg.compute, g.attn.heads
    q_a = g.role("q_a")
    linear_inputs(t, (q_a or g.role("q")) + g.role("kv_a"), in_b, h, ctx, "mla down", shard="seq")
    if q_a:
        out = norm(t, "rmsnorm", c, a.q_lora_rank, ctx, "q_a_layernorm")
        linear_inputs(t, g.role("q_b"), out, a.q_lora_rank, ctx, "mla q_b", shard="seq")
    out = norm(t, "rmsnorm", c, a.kv_lora_rank, ctx, "kv_a_layernorm")
    linear_inputs(t, g.role("kv_b"), out, a.kv_lora_rank, ctx, "mla kv_b", shard="seq")
    qk = n * a.head_dim
    t.add("attn: q and k (k_rot copied into every head)", 2 * c * qk)
    if ctx.attention is Attention.FLASH:  # HF pads v to the qk head size for flash-attn
        t.add("attn: v padded to qk head size", c * qk)
    elif ctx.attention is Attention.EAGER:  # matmul copies the strided v view
        t.add("attn: v (contiguous copy)", c * n * a.v_head_dim)
    else:  # the kernel keeps the v view, and with it the whole kv_b output
        t.add("attn: kv_b output (held by the v view)", c * n * (a.nope_dim + a.v_head_dim))
    if ctx.attention is Attention.EAGER:
        _eager_core(t, g, ctx)
        out_counted = False
    else:
        width = qk if ctx.attention is Attention.FLASH else n * a.v_head_dim
        t.add("attn: output + fp32 logsumexp", c * width + 4 * n)
        out_counted = ctx.attention is Attention.SDPA and not ctx.ring
    linear_inputs(t, g.role("o"), c, n * a.v_head_dim, ctx, "attn o", shard="tp", counted=out_counted)


# --- MLP ---------------------------------------------------------------------------------

def _gated(t: Terms, g: LayerGroup, ctx: Ctx, in_b: int, h: int, i: int,
           up: tuple[Linear, ...], down: tuple[Linear, ...], name: str, *, counted: bool = False) -> None:
    c = ctx.rg.compute
    linear_inputs(t, up, in_b, h, ctx, f"{name} in", shard="seq", counted=counted)
    t.add(f"{name}: gate output (activation input)", c * i * g.ffn.act_saves)
    t.add(f"{name}: activation output and up output (mul inputs)", 2 * c * i)
    linear_inputs(t, down, c, i, ctx, f"{name} down", shard="tp")


def ffn(t: Terms, g: LayerGroup, ctx: Ctx, in_b: int, h: int) -> None:
    f, c = g.ffn, ctx.rg.compute
    if f.kind == "gated":
        _gated(t, g, ctx, in_b, h, f.intermediate, g.role("gate", "up") or g.role("gate_up"),
               g.role("down"), "mlp")
    elif f.kind == "plain":
        linear_inputs(t, g.role("fc1"), in_b, h, ctx, "mlp fc1", shard="seq")
        per = c * f.act_saves
        if f.act_saves == 4 and ctx.rg.autocast:
            # GPT-2's composite gelu_new under CUDA autocast: pow is on CUDA's fp32 list, so
            # its fp32 input copy, tanh's fp32 output and the fp32 1 + tanh are saved beside
            # the 16-bit 0.5·x (CPU autocast keeps pow in 16-bit: 4 × 2 B there).
            per = 4 + 4 + 4 + c
        t.add("mlp: activation input/intermediates", per * f.intermediate)
        linear_inputs(t, g.role("fc2"), c, f.intermediate, ctx, "mlp fc2", shard="tp")
    else:
        _moe(t, g, ctx, in_b, h)
    if f.dropout > 0 and ctx.training:
        t.add("mlp: residual dropout mask", h, shard="seq")


def _moe(t: Terms, g: LayerGroup, ctx: Ctx, in_b: int, h: int) -> None:
    """transformers 5 MoE: per expert, ``x[token_idx]`` → gate_up → act·up → down → ·weight →
    ``index_add_`` (which saves its source: its formula calls ``expand_as(source)``)."""
    f, c, k = g.ffn, ctx.rg.compute, g.ffn.top_k
    shared_up = g.role("shared_gate", "shared_up")
    # the router and the shared expert read the same normalised hidden state
    fp32_copy = f.router_fp32 and in_b != 4 and not ctx.rg.autocast
    if fp32_copy and ctx.tr.full:  # DeepSeek: F.linear(x.type(float32), weight.type(float32))
        t.add("router: fp32 input copy", 4 * h, shard="seq")
    router_keeps_x = (ctx.tr.full and bool(g.role("router")) and not fp32_copy
                      and not (ctx.rg.autocast and in_b != c))
    linear_inputs(t, () if fp32_copy else g.role("router"), in_b, h, ctx, "router", shard="seq")
    if f.router_fp32:  # sigmoid scores, group top-k, masks
        t.add("router: fp32 scores, group top-k, mask, top-k values/indices", 5 * f.experts + 12 * k + 28, shard="seq")
    else:
        t.add("router: fp32 probabilities, top-k values/indices, their sum", 4 * f.experts + 12 * k + 4, shard="seq")
    t.add("experts: token/slot indices and routing weights (int64, int64, fp32)", 20 * k, shard="seq")
    if ctx.tr.full:  # the gathered tokens (cast under autocast) saved by the expert linear
        t.add("experts: gathered inputs (top-k per token)", k * (c if ctx.rg.autocast else in_b) * h, shard="seq")
    t.add("experts: gate_up outputs (held by act and mul)", k * 2 * c * f.intermediate * f.act_saves)
    t.add("experts: activation outputs", k * c * f.intermediate)
    if ctx.tr.full:
        t.add("experts: down inputs", k * c * f.intermediate)
    t.add("experts: outputs (saved by the routing-weight mul)", k * c * h, shard="seq")
    t.add("experts: weighted outputs (index_add_ source, hidden dtype)", k * in_b * h, shard="seq")
    if f.shared_intermediate:
        _gated(t, g, ctx, in_b, h, f.shared_intermediate, shared_up, g.role("shared_down"),
               "shared expert", counted=router_keeps_x)


# --- whole block / head ------------------------------------------------------------------

def block_saved(g: LayerGroup, ctx: Ctx, h: int) -> Terms:
    """Saved for backward by one layer (pre-norm order; post-norm BERT saves the same sizes)."""
    t = Terms()
    r = ctx.rg.stream
    out = norm(t, g.norm, r, h, ctx, "norm1")
    (mla if g.attn.kind == "mla" else mha)(t, g, ctx, out, h)
    if g.post_norms:
        norm(t, g.norm, ctx.rg.compute, h, ctx, "post-attention norm")
    if g.ffn.dropout > 0 and ctx.training:
        t.add("attn: residual dropout mask", h, shard="seq")
    out = norm(t, g.norm, r, h, ctx, "norm2")
    ffn(t, g, ctx, out, h)
    if g.post_norms:
        norm(t, g.norm, ctx.rg.compute, h, ctx, "post-MLP norm")
    return t


def block_input(ctx: Ctx, h: int) -> Terms:
    """What a fully checkpointed layer keeps: its input hidden state."""
    t = Terms()
    t.add("checkpoint: layer input", ctx.rg.stream * h, shard="seq")
    return t


def op_sac_saved(g: LayerGroup, ctx: Ctx) -> Terms:
    """What torchtitan's op-level SAC stores for one checkpointed layer besides its input
    (vramplan.trace.sac): the output of every odd-numbered ``aten.mm`` of the layer (the 1st,
    3rd, ... in block order; a LoRA-wrapped linear runs three: base, A, B) and the fused
    attention kernel's outputs. Approximations: a linear with a bias runs ``addmm`` (not in
    torchtitan's list) but is counted as an mm here; routed experts (grouped/looped matmuls)
    are not counted."""
    t = Terms()
    c, a = ctx.rg.compute, g.attn
    n = 0
    for lin in g.linears:
        if lin.expert:
            continue
        outs = [lin.d_out]
        if ctx.tr.lora_on(lin):
            outs += [ctx.tr.rank, lin.d_out]
        for d in outs:
            n += 1
            if n % 2 == 1:
                t.add(f"op SAC: {lin.name} mm output", c * d * lin.count,
                      shard="tp" if lin.tp and d != ctx.tr.rank else "seq")
    if ctx.attention is not Attention.EAGER:
        t.add("op SAC: attention kernel output + fp32 logsumexp", c * a.heads * (a.v_head_dim or a.head_dim) + 4 * a.heads)
    return t


def norm_keeps_input(g: LayerGroup, ctx: Ctx) -> bool:
    """The first norm saves the layer input tensor itself (not a cast copy of it)."""
    r = ctx.rg.stream
    if g.norm == "layernorm":
        return (4 if ctx.rg.autocast else r) == r
    return r == 4  # RMSNorms save x.to(float32), the input itself only when it is fp32


def backward_transient(g: LayerGroup, ctx: Ctx) -> tuple[Terms, Terms]:
    """(attention, MLP) gradients alive at once inside one layer's backward; the larger counts."""
    a, f, c = g.attn, g.ffn, ctx.rg.compute
    at = Terms()
    if ctx.attention is Attention.EAGER:
        at.add("attn backward: grads of probabilities/softmax (fp32)", pair=(c + 8) * a.heads)
    else:
        qk = a.heads * a.head_dim
        kv = qk if ctx.padded else a.kv_heads * a.head_dim  # (padded: the repeated k, v's gradients)
        at.add("attn backward: dq, dk, dv + fp32 dq accumulator", c * (qk + 2 * kv) + 4 * qk)
    mt = Terms()
    if f.kind == "moe":
        per_expert = f.top_k / max(1, f.experts)
        mt.add("expert backward: grads of gate_up/act", 3 * c * f.intermediate * per_expert)
        mt.add("shared expert backward: grads of gate/up/act", 3 * c * f.shared_intermediate)
    else:
        mult = 3 if f.kind == "gated" else 1 + f.act_saves
        mt.add("mlp backward: grads of intermediates", mult * c * f.intermediate)
    return at, mt


def infer_working(g: LayerGroup, ctx: Ctx, h: int) -> tuple[Terms, Terms]:
    """(attention, MLP) tensors alive at once in a no-grad forward of one layer."""
    a, f, c, r = g.attn, g.ffn, ctx.rg.compute, ctx.rg.stream
    at = Terms()
    at.add("layer input + norm output", 2 * r * h, shard="seq")
    if a.kind == "mla":
        at.add("mla: q, k, kv_b output, output", c * a.heads * (3 * a.head_dim + a.nope_dim + a.v_head_dim))
    else:
        at.add("attn: q, k, v, output", c * (2 * a.q_dim + 2 * a.kv_dim))
    if ctx.attention is Attention.EAGER:
        at.add("attn: scores + softmax", pair=(c + _softmax_bytes(g, ctx) + _softmax_copy(g, ctx)) * a.heads)
    mt = Terms()
    mt.add("layer input + norm output", 2 * r * h, shard="seq")
    if f.kind == "moe":
        mt.add("router logits + probabilities", (c + 4) * f.experts, shard="seq")
        mt.add("shared expert: gate, up, product", 3 * c * f.shared_intermediate)
        mt.add("experts: one expert's tokens", 3 * c * f.intermediate * f.top_k / max(1, f.experts))
    else:
        mult = 3 if f.kind == "gated" else 1 + f.act_saves
        mt.add("mlp: intermediates", mult * c * f.intermediate)
    return at, mt


def head_linear(head: Head, h: int) -> Linear:
    """The output projection (the tied embedding when there is no separate head matrix)."""
    for lin in head.linears:
        if lin.role == "head":
            return lin
    return Linear("lm_head", "head", h, head.classes, lora=False)


def head_saved(head: Head, norm_kind: str, ctx: Ctx, h: int) -> Terms:
    """Final norm / MLM transform inputs saved for backward, per token (logits separately)."""
    t = Terms()
    r, c = ctx.rg.stream, ctx.rg.compute
    if head.kind == "cls":
        norm(t, norm_kind, r, h, ctx, "final norm")
        return t
    if head.kind == "mlm":
        linear_inputs(t, head.linears[:1], r, h, ctx, "mlm transform", shard="seq")
        t.add("mlm transform: GELU input", c * h, shard="seq")
        out = norm(t, "layernorm", c, h, ctx, "mlm transform norm")
    else:
        out = norm(t, norm_kind, r, h, ctx, "final norm")
    linear_inputs(t, (head_linear(head, h),), out, h, ctx, "lm head", shard="seq")
    return t
