"""The assumptions behind an analytic estimate, one sentence each."""

from __future__ import annotations

from vramplan.precision import fsdp_cpu_offload
from vramplan.units import fmt_bytes
from vramplan.workload import (
    Attention,
    Checkpointing,
    Engine,
    Loss,
    Optimizer,
    OptimizerImpl,
    Peft,
    Quant,
    Task,
    Workload,
    bnb_optim_block,
)

from .arch import Arch
from .parallel import lora_tp
from .regime import Regime, Trainable
from .states import pipeline_fsdp


def notes(arch: Arch, w: Workload, rg: Regime, tr: Trainable, stage: int, workspace: int) -> tuple[str, ...]:
    out = ["Analytic estimate of torch.cuda.max_memory_allocated() per GPU (rank); the allocator's "
           "caching and the memory outside it (CUDA context) are separate figures."]
    p = w.parallel
    out.append(f"Precision {w.precision}: {rg.label}.")
    if w.training:
        out += _training(arch, w, rg, tr)
    else:
        out += _inference(arch, w)
    if w.attention is Attention.EAGER:
        out.append("Eager attention materialises the b·heads·s·s scores (softmax kept in fp32) and HF's 4-D mask.")
    else:
        out.append(f"Attention {w.attention}: fused kernel saving q, k, v, output and an fp32 logsumexp; "
                   "GQA runs natively without repeating k/v.")
    if w.quant is not Quant.NONE:
        dq = ("with double quantisation" if w.peft is Peft.QLORA and not w.bnb_single_quant
              else "without double quantisation")
        out.append(f"{w.quant} storage (bitsandbytes-style, {dq} for 4-bit) for the layers' linear weights; "
                   f"embeddings, lm_head and norms stay {'fp32' if rg.weight == 4 else '16-bit'} (a dequantised "
                   f"copy of one matrix, in {rg.bnb_dtype if w.quant in (Quant.NF4, Quant.INT4) else rg.compute_dtype}, "
                   "is transient).")
    if any(g.ffn.kind == "moe" for g in arch.groups):
        out.append("MoE: tokens spread evenly over experts; each expert-parallel rank holds experts/ep "
                   "and processes top_k × its tokens.")
    if p.pp > 1:
        v = p.stages_per_rank
        per = f" of {v} stages each" if v > 1 else ""
        sizes = sorted({hi - lo for lo, hi in p.stage_bounds(arch.layers)})
        split = f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]}–{sizes[-1]}"
        middle = ", rank 1 (the most layers of the middle ranks)" if p.pp > 2 else ""
        out.append(f"Pipeline ({p.pp_schedule} over {w.grad_accum} micro-batches): reporting rank {stage}, the "
                   f"highest of the first rank (embeddings{per}){middle} and the last (head and logits{per}); stages "
                   f"of {split} layers as torchtitan splits {arch.layers} (the embeddings counted as "
                   f"{p.pp_first_less}, the head as {p.pp_last_less}); a rank holds the activations of the forwards "
                   "its schedule runs before their backwards.")
    if p.tp > 1 and lora_tp(w):
        sp = " with sequence parallelism sharding norm/dropout activations" if p.sp else ""
        out.append(f"Tensor parallel {p.tp} with {w.peft} as transformers' tp_plan and peft run it: column/row splits, "
                   f"a vocab-parallel embedding, the logits all-gathered whole on every rank (lm_head "
                   f"colwise_gather_output, no loss parallel){sp}; adapters split with their layer (a column-parallel "
                   "layer's lora_B, a row-parallel layer's lora_A), the other matrix whole on every rank.")
    elif p.tp > 1:
        sp = " with sequence parallelism sharding norm/dropout activations" if p.sp else ""
        out.append(f"Tensor parallel {p.tp}: Megatron column/row splits, vocab-parallel embeddings and logits{sp}.")
    if p.cp > 1:
        out.append(f"Context parallel {p.cp}: each rank holds seq/{p.cp} tokens of activations.")
    out.append(f"Includes the cuBLAS workspace ({fmt_bytes(workspace, 'MiB')}), one per thread "
               "(the backward runs on autograd's thread with its own handle).")
    return tuple(out)


_LOSS = {  # the default (transformers' ForCausalLMLoss) is described with the phases
    Loss.CHUNKED: ("Loss: torchtune CEWithChunkedOutputLoss in {n} chunks — logits output as chunks, one fp32 "
                   "upcast at a time, every chunk's fp32 log-softmax saved."),
    Loss.LIGER: ("Loss: Liger fused linear cross-entropy — logits one chunk of tokens at a time, input and head "
                 "gradients computed in the forward and kept for backward."),
    Loss.CCE: ("Loss: Cut Cross-Entropy — no logits; an fp32 log-sum-exp per token, the logits recomputed "
               "block-wise in backward."),
    Loss.TRL: ("Loss: TRL's fused LM head (trl 1.16, CUDA) — no logits; [4,096 tokens, 32,768 vocabulary] tiles into "
               "one buffer, the scored hidden states copied and saved, fp32 gradient accumulators in backward."),
}


def _training(arch: Arch, w: Workload, rg: Regime, tr: Trainable) -> list[str]:
    p = w.parallel
    if w.optimizer_in_backward:
        zero = ("but the optimizer runs in backward (torchtune optimizer_in_bwd): one optimizer per parameter steps from its "
                "gradient hook and frees the gradient; at most one parameter's gradient and step temporaries "
                "are alive, and there is no optimizer phase.")
    elif w.keep_grads:
        zero = ("and zero_grad(set_to_none=False) zeroes the gradients in place: they stay allocated through the "
                "next forward and backward.")
    else:
        zero = "and zero_grad(set_to_none=True) frees gradients before each forward."
    out = [f"Steady state: optimizer states exist from the first step on (iteration 1's forward has none), {zero}"]
    if w.keep_outputs:
        out.append("The loop holds the model's outputs (logits, HF cache) until after backward.")
    if arch.head.kind == "lm" and w.loss is not Loss.FULL:
        out.append(_LOSS[w.loss].format(n=w.loss_chunks))
    if p.zero:
        out.append(f"ZeRO-{p.zero} over dp={p.dp}: DeepSpeed accounting — 16-bit weights and gradients, "
                   "fp32 master weights + states in the optimizer category (16Ψ in all, "
                   "ZeRO-1 4Ψ+12Ψ/N, ZeRO-2 2Ψ+14Ψ/N, ZeRO-3 16Ψ/N).")
        if pipeline_fsdp(w):
            out.append("Pipeline × FSDP2 as torchtitan runs it (reshard_after_forward=False under pp; torch's "
                       "PipelineStage turns gradient sync and resharding off until the last micro-batch): each "
                       "stage's parameters stay gathered (in param_dtype) from its first forward to the end of the step, "
                       "and its gradients accumulate unsharded in the reduce dtype, reduce-scattered at the end.")
        elif p.zero == 3 and p.framework is Engine.FSDP and w.quant is Quant.NONE:
            out.append("FSDP2 ZeRO-3 (a unit per block and the root's): the root unit (embeddings, final norm, "
                       "head) is gathered in 16-bit through the forward and backward, beside the running block "
                       "and the next one's all-gather (prefetched).")
        elif p.framework is Engine.FSDP1 and p.zero >= 2:
            prefetch = {"none": "no backward prefetch", "backward-post": "backward-post prefetch",
                        "backward-pre": "backward-pre prefetch: the next block gathered beside the running one"}
            held = "for its forward and again for its backward" if p.zero == 3 else "from its forward to its backward"
            out.append(f"FSDP1 {p.fsdp1_strategy} (a flat parameter per block and the root's, each padded to a "
                       "multiple of the shard group): the root is gathered from its forward to the end of backward, "
                       f"each block {held} ({prefetch[p.fsdp1_prefetch.value]}).")
        elif p.zero == 3:
            out.append("ZeRO-3 / FSDP: the largest unit (layer or embeddings) is gathered in 16-bit, "
                       "plus the prefetched next one.")
        elif p.framework is Engine.FSDP:
            out.append("FSDP2 ZeRO-2 (reshard_after_forward=False): parameters are sharded at rest; each unit's "
                       "16-bit parameters stay gathered from its forward to its backward.")
    elif p.dp > 1:
        out.append("DDP keeps gradient buckets the size of all gradients (gradient_as_bucket_view=False).")
    if p.offload_optimizer:
        out.append("Optimizer states (and master weights / gradient partitions under ZeRO) live in CPU memory.")
    if fsdp_cpu_offload(w):
        out.append("FSDP2 CPUOffloadPolicy(pin_memory=True): sharded parameters and gradients in pinned host memory "
                   "(power-of-two blocks), the optimizer step on the CPU; each all-gather copies its shards to the GPU "
                   "first. offload_params alone implies the whole policy (FSDP2 has one).")
    elif p.offload_params:
        out.append("Parameters live in CPU memory; only gathered layers are on the GPU.")
    if rg.autocast and rg.weight == 4:
        out.append("Autocast caches a 16-bit copy of every weight until the forward's autocast region exits; "
                   "without checkpointing the linears keep them saved until their backward.")
    out.append("Loss: 16-bit logits, their fp32 upcast and the fp32 log-softmax for every position "
               "(HF ForCausalLMLoss); its backward holds two more fp32 logit-sized gradients.")
    if w.grad_accum > 1 and not pipeline_fsdp(w):
        out.append(f"Gradient accumulation ({w.grad_accum}): gradients stay allocated through the forward and backward.")
    out.append(_optimizer(w, rg))
    every = f" (every {w.checkpoint_every}-th layer of them)" if w.checkpoint_every > 1 else ""
    if w.checkpointing is Checkpointing.FULL:
        out.append(f"Full checkpointing of {w.checkpoint_fraction:.0%} of layers{every}: each keeps its input; "
                   "one layer is recomputed at a time in backward.")
    elif w.checkpointing is Checkpointing.SELECTIVE:
        out.append("Selective checkpointing (Korthikanti et al.): the attention core (s² terms) is recomputed.")
    elif w.checkpointing is Checkpointing.OP:
        out.append(f"torchtitan op-level selective checkpointing of {w.checkpoint_fraction:.0%} of layers{every}: "
                   "each keeps its input, every other matmul output and the attention kernel outputs; the rest "
                   "is recomputed in backward.")
    if w.compile and w.training:
        out.append("torch.compile: the formulas count eager activations (AOTAutograd's partitioner keeps "
                   "fewer: `method=trace` runs it).")
    if w.activation_offload and w.training:
        out.append("Activation offload (torchtune OffloadActivations): saved tensors of at least 1 KiB go to "
                   "pinned host memory per save, about one layer's stay on the GPU.")
    if not tr.full:
        out.append(f"{w.peft}: frozen base in {'NF4' if w.peft is Peft.QLORA else '16-bit'}, rank-{tr.rank} adapters "
                   "in fp32 (PEFT autocast_adapter_dtype); gradients and states for adapters only; frozen "
                   "linears save no input.")
        if w.peft is Peft.QLORA:
            out.append("prepare_model_for_kbit_training would upcast embeddings, lm_head and norms to fp32 "
                       "(+2 B/param for them); not modelled.")
    return out


def _optimizer(w: Workload, rg: Regime) -> str:
    o, impl = w.optimizer, w.optimizer_impl
    if w.parallel.offload_optimizer or fsdp_cpu_offload(w):
        return "The optimizer step runs on the CPU."
    if rg.master:
        return ("DeepSpeed's fused optimizer updates the fp32 master partition in place; the step holds an "
                "fp32 copy of the gradient partition.")
    if o in (Optimizer.ADAM, Optimizer.ADAMW):
        if impl is OptimizerImpl.FOREACH:
            return ("foreach Adam(W) (torch's CUDA default) allocates exp_avg_sq_sqrt for the whole "
                    "parameter group at once: one state-sized temporary per parameter at the step.")
        if impl is OptimizerImpl.FUSED:
            return "Fused Adam(W): no list-wide temporaries at the step."
        return "For-loop Adam(W): one denominator of the largest parameter at a time."
    if o in (Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW_8BIT):
        paged = (" Paged: the state buffers of tensors of >= 1e5 elements live in CUDA unified memory "
                 "(cudaMallocManaged), outside PyTorch's allocator: not counted here (they take GPU memory while "
                 "resident and page out to CPU under pressure); absmax and small tensors' states are counted."
                 if o is Optimizer.PAGED_ADAMW_8BIT else "")
        return (f"bitsandbytes {w.bnb_version} 8-bit Adam: 2 B/param + fp32 absmax per "
                f"{bnb_optim_block(w.bnb_version):,}-block, 32-bit for tensors < 4096." + paged)
    if o is Optimizer.ADAFACTOR:
        return "Adafactor (transformers defaults): factored fp32 second moment, no first moment."
    if o is Optimizer.LION:
        return "Lion: one momentum state per parameter."
    if o is Optimizer.SGD_MOMENTUM:
        return "SGD with momentum: one buffer per parameter."
    return "Plain SGD keeps no optimizer state."


def _inference(arch: Arch, w: Workload) -> list[str]:
    out = []
    if w.task is Task.GENERATE:
        out.append("Generate: prefill computes logits for the last position only (logits_to_keep=1); "
                   f"the KV cache holds prompt + {w.new_tokens} new tokens.")
    elif arch.head.kind == "lm":
        out.append("Forward without labels: logits for every position; HF builds a KV cache by default (use_cache).")
    if any(g.attn.kind == "mla" for g in arch.groups):
        out.append("MLA: the KV cache holds the compressed latent (kv_lora_rank + rope dims per token per layer) "
                   "as transformers 5 does; each decode step re-expands one layer's cache (a transient).")
    if any(g.attn.window for g in arch.groups):
        out.append("Sliding-window layers cache only their window of tokens.")
    if w.mixed:
        out.append("Mixed precision inference keeps fp32 weights and autocast's 16-bit copies of them.")
    return out
