"""Step time: FLOPs and bytes against a GPU's rates, plus communication and offload.

Roofline per phase: a micro-batch takes ``max(flops / (peak · e_mm), bytes / (bw · e_bw))``
(as ``torch.distributed._tools.RuntimeEstimator`` does per op); the optimizer step is
memory-bound; communication and offload add what overlap does not hide; a pipeline adds
its bubble ``(p − 1)/(m + p − 1)`` of the step. Returns a frozen :class:`StepTime`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

from vramplan.errors import WorkloadError
from vramplan.hardware.gpu import GPU
from vramplan.models.flops import StepFlops, forward_flops, generate_flops, layout_of, train_flops
from vramplan.models.shape import SEQUENCE_FAMILIES, ModelShape, opaque_shape, tokens
from vramplan.models.spec import Family, ModelSpec
from vramplan.precision import fsdp_cpu_offload, precision_model
from vramplan.workload import Checkpointing, KVDtype, Loss, Peft, Task, Workload

from .adapters import adapter_params
from .comm import communication
from .offload import OffloadTime, activation_offload_time, offload_time
from .rates import DEFAULT_EFFICIENCY, Efficiency, compute_rate, matmul_efficiency, memory_bandwidth
from .traffic import (
    activation_bytes,
    cast_bytes,
    decode_bytes,
    matmul_weight_bytes,
    offloaded_activation_bytes,
    optimizer_bytes_per_param,
    touched_params,
    train_bytes,
    weight_storage_bytes,
)


class Bound(str, Enum):
    COMPUTE = "compute"
    MEMORY = "memory"
    COMMUNICATION = "communication"
    OFFLOAD = "offload"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """Predicted time of one step on one GPU, and what bounds it.

    A step is one optimizer step (all micro-batches) for training, one forward for
    inference, and prefill + all decode steps of one request batch for generation.
    """

    total: float
    """Seconds per step."""
    compute: float
    """Seconds the matmul work needs at the efficient rate."""
    memory: float
    """Seconds the memory traffic needs (forward/backward traffic + optimizer step)."""
    comm: float
    """Exposed (not overlapped) communication seconds."""
    offload: float
    """Exposed host-device transfer and CPU-optimizer seconds."""
    bubble: float
    """Pipeline-parallel idle seconds."""
    bound: Bound
    flops: float
    """FLOPs per GPU per step."""
    flops_source: str
    bytes_moved: float
    """GPU-memory bytes read + written per GPU per step."""
    comm_total: float
    """Communication seconds before overlap."""
    offload_total: float
    tokens_per_step: int
    """Tokens per step over all data-parallel ranks (generation: generated tokens); 0 for non-sequence models."""
    samples_per_step: int
    tokens_per_s: float
    samples_per_s: float
    mfu: float
    """Model FLOPs per second ÷ (GPU count × peak)."""
    peak_flops: float
    rate_name: str
    bandwidth: float
    num_gpus: int
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["bound"] = str(self.bound)
        d["notes"] = list(self.notes)
        return d


BUBBLE_RULE = {
    "GPipe": "(p − 1) micro-batch times",
    "1F1B": "(p − 1) micro-batch times, as GPipe",
    "Interleaved1F1B": "(p − 1) / v: each of v stages per rank is 1/v of a micro-batch time",
    "LoopedBFS": "(p − 1) / v, as interleaved",
    "InterleavedZeroBubble": "(p − 1) / (3 v): ZB-H1 fills about two thirds of 1F1B's bubble with "
                             "weight-gradient steps (Qi et al., Zero Bubble Pipeline Parallelism, ICLR 2024)",
    "ZBVZeroBubble": "(p − 1) / (3 v), as ZB-H1 (ZB-V's is near zero at equal memory, same paper): a "
                     "conservative figure",
}
"""How many micro-batch times each schedule's pipeline stands idle per step, in words."""


def pipeline_bubble(p: Any) -> float:
    """Idle micro-batch times per step of the pipeline of ``p`` (a :class:`~vramplan.workload.Parallel`):
    ``(pp − 1)`` for GPipe and 1F1B, divided by the stages per rank for the looped schedules,
    and by three more for the zero-bubble ones (:data:`BUBBLE_RULE`)."""
    if p.pp == 1:
        return 0.0
    idle = (p.pp - 1) / p.stages_per_rank
    return idle / 3 if "ZeroBubble" in p.pp_schedule else idle


def step_time(
    spec: ModelSpec | None, w: Workload, gpu: GPU, *, flops: float | None = None,
    params: int | None = None, trainable_params: int | None = None,
    eff: Efficiency = DEFAULT_EFFICIENCY,
) -> StepTime:
    """Predict the step time of ``w`` on ``gpu`` (``w.parallel`` says how many).

    ``flops``: FLOPs of one step on one rank (all micro-batches) as a trace counts them
    (``TraceResult.flops``, ``FlopCounterMode``); without it they come from the formulas in
    :mod:`.flops`, which need a transformer ``spec``. ``params`` / ``trainable_params``
    override the spec's. Non-transformer models (CNNs, UNets) need ``flops``; their memory
    traffic counts weights, gradients and optimizer only (activation traffic unknown).
    """
    if spec is None or spec.family not in SEQUENCE_FAMILIES:
        if flops is None or not (params or (spec and spec.params)):
            name = spec.name if spec else "this model"
            raise WorkloadError(
                f"no FLOP count for {name}: step time of non-transformer models needs a trace",
                hint="use `method=trace`",
            )
    if spec is not None and spec.family in SEQUENCE_FAMILIES:
        s = spec.shape
    else:
        s = opaque_shape(spec.name if spec else "model", params or (spec.params if spec else 0))
    if params:
        s = _with_params(s, params)
    return _StepModel(spec, s, w, gpu, flops, trainable_params, eff).run()


def _with_params(s: ModelShape, params: int) -> ModelShape:
    if params == s.params:
        return s
    from dataclasses import replace

    return replace(s, params=params, active_params=min(s.active_params, params) or params)


class _StepModel:
    """One evaluation; split into methods per task so each stays short."""

    def __init__(self, spec: ModelSpec | None, s: ModelShape, w: Workload, gpu: GPU,
                 flops: float | None, trainable: int | None, eff: Efficiency) -> None:
        self.spec, self.s, self.w, self.gpu, self.eff = spec, s, w, gpu, eff
        self.traced_flops = flops
        self.rate = compute_rate(gpu, w, eff)
        self.bw = memory_bandwidth(gpu) * eff.bandwidth
        p = w.parallel
        self.split = p.tp * p.pp * p.cp
        self.notes: list[str] = [n for n in (self.rate.note,) if n]
        self.tokens = tokens(w, s.tokens_per_sample(w) if spec is not None else w.seq)
        self.seq = self.tokens.per_sample
        self.sequence_model = spec is not None and spec.family in SEQUENCE_FAMILIES
        self.text_model = self.sequence_model and spec is not None and spec.family is not Family.VIT
        """Reports tokens per second (ViTs and CNNs report samples)."""
        self.adapters = 0
        if w.peft is not Peft.NONE:
            self.adapters = adapter_params(s, w) if spec is not None and spec.hidden else (trainable or 0)
        if trainable is None:
            trainable = self.adapters if w.peft is not Peft.NONE else s.params
        self.trainable = trainable
        self.layout = layout_of(s, adapters=self.adapters, trains_base=w.peft is Peft.NONE)

    # -- helpers -------------------------------------------------------------------
    def _efficient_rate(self, tokens: float) -> float:
        width = max(self.s.hidden // self.w.parallel.tp, 1) if self.s.hidden else 4096
        return self.rate.flops * matmul_efficiency(int(tokens), width, self.eff)

    def _flops_source(self) -> str:
        return "trace (FlopCounterMode)" if self.traced_flops is not None else "analytic (6·N·tokens + attention)"

    # -- tasks ---------------------------------------------------------------------
    def run(self) -> StepTime:
        if self.w.task is Task.TRAIN:
            return self._train()
        if self.w.task is Task.INFER:
            return self._infer()
        return self._generate()

    def _phase(self, flops: float, overlap_bytes: float, serial_bytes: float, tokens: float) -> _Phase:
        """Roofline of one phase on one GPU: max(compute, streaming) + serial cast kernels."""
        t_c = flops / self._efficient_rate(tokens)
        t_m = overlap_bytes / self.bw
        t_s = serial_bytes / self.bw
        return _Phase(t_c, t_m, t_s)

    def _train(self) -> StepTime:
        w, s, p, eff = self.w, self.s, self.w.parallel, self.eff
        b, seq = w.batch, self.seq
        if self.traced_flops is not None:  # per step on this rank → per micro-batch per replica
            per_mb = self.traced_flops / w.grad_accum * self.split
            f = StepFlops(per_mb / 3, per_mb * 2 / 3)
        else:
            f = train_flops(self.layout, w, b, seq)
        fwd_b, bwd_b, rec_b, cast_b = train_bytes(s, w, b, seq, self.trainable)
        mb = self._phase(f.total / self.split, (fwd_b + bwd_b + rec_b) / self.split, cast_b / self.split,
                         self.tokens.per_rank)
        t_mb = mb.total
        t_bwd = t_mb * f.backward / max(f.total, 1.0)
        m = w.grad_accum
        bubble = pipeline_bubble(p) * t_mb

        local_trainable = self.trainable / (p.tp * p.pp) / (p.shard_group if p.zero >= 1 else 1)
        off_opt = p.offload_optimizer or fsdp_cpu_offload(w)  # (FSDP2's one CPUOffloadPolicy)
        opt_bytes = 0.0 if off_opt else local_trainable * optimizer_bytes_per_param(w)
        t_opt = opt_bytes / self.bw
        comm = communication(
            s, w, self.gpu, trainable=self.trainable, base_bytes_per_param=self._gathered_bytes(),
            t_microbatch=t_mb, t_backward=t_bwd, eff=eff,
        )
        local_params = s.params / (p.tp * p.pp * p.shard_group) if p.zero == 3 else s.params / (p.tp * p.pp)
        off = offload_time(
            self.gpu, optimizer=off_opt, params=p.offload_params,
            local_trainable=local_trainable, local_params=local_params,
            grad_bytes=float(precision_model(w).compute), param_bytes=float(precision_model(w).compute),
            microbatches=m, t_microbatch=t_mb, t_backward=t_bwd,
            ranks_per_node=min(p.world_size, eff.gpus_per_node), eff=eff,
        )
        act_off = activation_offload_time(
            self.gpu, bytes_per_microbatch=offloaded_activation_bytes(s, w, b, seq) / self.split, microbatches=m,
            t_microbatch=t_mb, eff=eff)
        if act_off.total:
            off = OffloadTime(off.total + act_off.total, off.exposed + act_off.exposed, off.notes + act_off.notes)
        busy = m * t_mb + bubble
        contrib = {
            "compute": mb.compute_part / t_mb * busy if t_mb else 0.0,
            "memory": mb.memory_part / t_mb * busy + t_opt if t_mb else t_opt,
            "communication": comm.exposed,
            "offload": off.exposed,
        }
        self.notes += list(comm.notes) + list(off.notes)
        if w.peft is not Peft.NONE:
            self.notes.append("frozen base: backward skips its weight gradients (~4·N·tokens instead of 6)")
        self.notes += loop_notes(w)
        if p.pp > 1:
            idle = pipeline_bubble(p)
            self.notes.append(
                f"pipeline bubble {p.pp_schedule}: {idle:g} micro-batch times idle ({BUBBLE_RULE[p.pp_schedule]}), "
                f"{idle / (m + idle):.0%} of the step with {m} micro-batches over {p.pp} stages"
            )
        tokens = self.tokens.global_tokens if self.text_model else 0
        return self._result(
            total=busy + t_opt + comm.exposed + off.exposed, compute=m * mb.t_c, memory=m * mb.t_mem + t_opt,
            comm=comm, off=off, bubble=bubble, contrib=contrib, flops=m * f.total / self.split,
            bytes_moved=m * (fwd_b + bwd_b + rec_b + cast_b) / self.split + opt_bytes,
            tokens=tokens, samples=self.tokens.global_batch,
        )

    def _forward(self, b: int, seq: int) -> tuple[float, float, float]:
        """(flops, overlappable bytes, serial cast bytes) of an inference forward, per GPU."""
        w, s = self.w, self.s
        flops = forward_flops(self.layout, w, b, seq)
        touched = touched_params(s, b * seq)
        read = touched * matmul_weight_bytes(w) + activation_bytes(s, w, b, seq, training=False)
        return flops / self.split, read / self.split, touched * cast_bytes(w) / self.split

    def _infer(self) -> StepTime:
        w, p = self.w, self.w.parallel
        b, seq = w.batch, self.seq
        flops, read, cast = self._forward(b, seq)
        if self.traced_flops is not None:
            flops = self.traced_flops
        ph = self._phase(flops, read, cast, self.tokens.per_rank)
        comm = communication(self.s, w, self.gpu, trainable=0, base_bytes_per_param=self._gathered_bytes(),
                             t_microbatch=ph.total, t_backward=0.0, eff=self.eff)
        bubble = (p.pp - 1) / p.pp * ph.total if p.pp > 1 else 0.0
        contrib = {"compute": ph.compute_part, "memory": ph.memory_part + bubble,
                   "communication": comm.exposed, "offload": 0.0}
        self.notes += list(comm.notes)
        tokens = self.tokens.micro_batch * p.dp if self.text_model else 0
        return self._result(total=ph.total + bubble + comm.exposed, compute=ph.t_c, memory=ph.t_mem, comm=comm,
                            off=None, bubble=bubble, contrib=contrib, flops=flops, bytes_moved=read + cast,
                            tokens=tokens, samples=b * p.dp)

    def _generate(self) -> StepTime:
        if not self.sequence_model:  # an opaque model "generating": one traced step, as inference
            return self._infer()
        w, s, p = self.w, self.s, self.w.parallel
        b, seq, n = w.batch, self.seq, w.new_tokens
        _, pre_read, pre_cast = self._forward(b, seq)
        prefill, decode = generate_flops(self.layout, w, seq)
        pre_flops = prefill / self.split
        pre = self._phase(pre_flops, pre_read, pre_cast, self.tokens.per_rank)
        ctx = seq + (n + 1) / 2  # mean context over the decode steps
        dec_flops = decode / max(n, 1) / self.split  # the mean decode step
        dec_read, dec_cast = decode_bytes(s, w, b, ctx, _kv_bytes(w))
        dec = self._phase(dec_flops, dec_read / self.split, dec_cast / self.split, b)
        comm = communication(s, w, self.gpu, trainable=0, base_bytes_per_param=self._gathered_bytes(),
                             t_microbatch=pre.total, t_backward=0.0, decode_tokens=n, eff=self.eff)
        contrib = {
            "compute": pre.compute_part + n * dec.compute_part,
            "memory": pre.memory_part + n * dec.memory_part,
            "communication": comm.exposed, "offload": 0.0,
        }
        self.notes += list(comm.notes)
        kind = "memory" if dec.memory_part >= dec.compute_part else "compute"
        self.notes.append(
            f"prefill {pre.total * 1e3:.1f} ms, then {n} decode steps of {dec.total * 1e3:.2f} ms "
            f"({kind}-bound: weights + KV cache read per token)"
        )
        self.notes.append("excludes kernel-launch and Python overhead (eager decode adds ~5 µs per kernel; "
                          "CUDA graphs remove most)")
        return self._result(total=pre.total + n * dec.total + comm.exposed, compute=pre.t_c + n * dec.t_c,
                            memory=pre.t_mem + n * dec.t_mem, comm=comm, off=None, bubble=0.0, contrib=contrib,
                            flops=pre_flops + n * dec_flops,
                            bytes_moved=pre_read + pre_cast + n * (dec_read + dec_cast) / self.split,
                            tokens=b * n * p.dp, samples=b * p.dp)

    # -- assembly ------------------------------------------------------------------
    def _gathered_bytes(self) -> float:
        """Bytes per base parameter that ZeRO-3/FSDP all-gathers (16-bit, or the quantised storage)."""
        return weight_storage_bytes(self.w) if self.w.quant.value != "none" else float(precision_model(self.w).compute)

    def _result(self, *, total: float, compute: float, memory: float, comm: Any, off: Any,
                bubble: float, contrib: dict[str, float], flops: float, bytes_moved: float,
                tokens: int, samples: int) -> StepTime:
        p = self.w.parallel
        bound = Bound(max(contrib, key=lambda k: contrib[k]))
        n_gpus = p.world_size
        total = max(total, 1e-12)
        mfu = flops / total / self.rate.flops  # per GPU: the same ratio over all of them
        self.notes.insert(0, f"FLOPs: {self._flops_source()}; peak {self.rate.flops / 1e12:.0f} TFLOP/s "
                             f"({self.rate.name}), bandwidth {self.bw / self.eff.bandwidth / 1e9:.0f} GB/s "
                             f"× {self.eff.bandwidth:.0%} efficiency")
        if self.traced_flops is not None and self.text_model and self.w.attention.value != "eager":
            self.notes.append("FlopCounterMode counts causal attention as full s² work; flash kernels do ~half")
        return StepTime(
            total=total, compute=compute, memory=memory, comm=comm.exposed, offload=off.exposed if off else 0.0,
            bubble=bubble, bound=bound, flops=flops, flops_source=self._flops_source(),
            bytes_moved=bytes_moved, comm_total=comm.total, offload_total=off.total if off else 0.0,
            tokens_per_step=tokens, samples_per_step=samples, tokens_per_s=tokens / total,
            samples_per_s=samples / total, mfu=mfu, peak_flops=self.rate.flops,
            rate_name=self.rate.name, bandwidth=self.bw / self.eff.bandwidth, num_gpus=n_gpus,
            notes=tuple(self.notes),
        )


@dataclass(frozen=True)
class _Phase:
    t_c: float
    """Matmul compute seconds."""
    t_m: float
    """Streaming seconds that overlap with compute."""
    t_s: float
    """Serial seconds (cast / dequantise kernels)."""

    @property
    def total(self) -> float:
        return max(self.t_c, self.t_m) + self.t_s

    @property
    def t_mem(self) -> float:
        return self.t_m + self.t_s

    @property
    def compute_part(self) -> float:
        return self.t_c if self.t_c >= self.t_m else 0.0

    @property
    def memory_part(self) -> float:
        return (self.t_m if self.t_m > self.t_c else 0.0) + self.t_s


def _kv_bytes(w: Workload) -> float:
    return {
        KVDtype.AUTO: float(precision_model(w).compute), KVDtype.FP32: 4.0, KVDtype.BF16: 2.0, KVDtype.FP16: 2.0,
        KVDtype.FP8: 1.0, KVDtype.INT8: 1.0, KVDtype.INT4: 0.5,
    }[w.kv_dtype]


__all__ = ["Bound", "StepTime", "step_time"]


def loop_notes(w: Workload) -> list[str]:
    """How the loop's knobs enter the step time (those with no modelled cost say so)."""
    out = []
    if w.optimizer_in_backward:
        out.append("optimizer in backward: the same optimizer work, run from the gradient hooks (no time cost modelled)")
    if w.loss is Loss.CHUNKED:
        out.append("chunked cross-entropy: the same FLOPs and bytes as the full loss")
    elif w.loss is Loss.CCE:
        out.append("Cut Cross-Entropy: logits never written to memory; the backward recomputes the head matmul")
    elif w.loss is Loss.TRL:
        out.append("TRL's fused LM head: logit tiles kept in one buffer; the backward recomputes the head matmul")
    elif w.loss is Loss.LIGER:
        out.append("Liger fused linear cross-entropy: gradients computed in the forward, no extra FLOPs")
    if w.checkpointing is Checkpointing.OP:
        out.append("op-level selective checkpointing: half the layer matmuls and the ops between them recomputed")
    return out
