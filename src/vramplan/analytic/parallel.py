"""Per-rank view of a model under TP/PP/EP/CP/SP, and the checks that sizes divide.

Pipeline stages hold the decoder layers torchtitan gives them
(:meth:`~vramplan.workload.Parallel.stage_bounds`: an even share of the layers plus the
embeddings and the head counted as ``pp_first_less`` / ``pp_last_less`` layers, so the first and
last stages hold fewer); a rank holds one stage under GPipe and 1F1B, ``pp_virtual`` (stages
``r, r + pp, …``) under the looped schedules, stages ``r`` and ``2 pp − 1 − r`` under
ZBVZeroBubble's V. The rank with the first stage holds the input embeddings, the rank with the
last the final norm, the output head and the logits (a tied head is a copy of the embeddings).
How many micro-batches' activations a rank holds at once follows the order in which torch's
schedule runs its forwards and backwards (:func:`chunks_in_flight`).
"""

from __future__ import annotations

import dataclasses
import math

from vramplan._dataclass import dataclass
from vramplan.errors import WorkloadError
from vramplan.models.arch import arch_of
from vramplan.models.shape import tokens
from vramplan.models.spec import Family, ModelSpec
from vramplan.workload import Peft, Task, Workload

from .arch import Arch, LayerGroup, Linear


@dataclass(frozen=True)
class Stage:
    """The layers, embedding and head one pipeline rank holds, and its in-flight micro-batches."""

    index: int
    groups: tuple[tuple[LayerGroup, int], ...]
    """(layer group, layers of it on this stage)."""
    embed: bool
    head: bool
    in_flight: int
    """Micro-batch chunks whose activations are alive at once: forwards of one of the rank's
    ``virtual`` stages (``layers / virtual`` layers each) not yet run backward."""
    virtual: int = 1
    """Pipeline stages this rank holds (chunks of its layers)."""
    head_in_flight: int = 1
    """Forwards of the last stage (logits and loss) run before its first backward."""
    receives: int = 0
    """Receive buffers per micro-batch: one per local stage that receives activations (all but
    the first) and one per local stage that receives gradients (all but the last). torch's
    ``PipelineStage`` makes them for every micro-batch of the step when the schedule is first
    run, and keeps them (``_prepare_forward_infra`` / ``_prepare_backward_infra``)."""

    chunk_layers: tuple[int, ...] = ()
    """Interleaved1F1B: the layers of each of the rank's stages, in order (() where every chunk
    is counted alike, ``layers / virtual``)."""
    flight: tuple[tuple[int, ...], int] = ((), 0)
    """Interleaved1F1B: (the chunks in flight of each local stage, the local stage whose backward
    runs) at the backward with the most layers in flight (:func:`interleaved_flight`)."""
    flight_last: tuple[tuple[int, ...], int] = ((), 0)
    """The same at the last local stage's backward with the most (the loss and head instants)."""

    @property
    def layers(self) -> int:
        return sum(n for _, n in self.groups)

    def held(self, per_microbatch: int, less: int = 0, *, last: bool = False, uniform: bool = False) -> int:
        """Bytes of ``in_flight − less`` chunks, given one micro-batch's bytes over all the rank's layers
        (per layer alike). Interleaved1F1B: the chunks in flight at its backward with the most layers in
        flight (``last``: the last local stage's backward), each its own stage's layers, ``less``
        chunks of the stage whose backward runs fewer (``uniform``: every chunk ``1 / virtual`` of the
        rank's layers, as for the other schedules)."""
        if not self.chunk_layers or uniform:
            return per_microbatch * max(0, self.in_flight - less) // self.virtual
        counts, back = self.flight_last if last and self.flight_last[0] else self.flight
        live = sum(c * n for c, n in zip(counts, self.chunk_layers, strict=True)) - less * self.chunk_layers[back]
        return per_microbatch * max(0, live) // max(1, sum(self.chunk_layers))

    def held_outputs(self, size: int, less: int = 0, *, last: bool = False) -> int:
        """A stage's output of ``size`` bytes kept per chunk in flight of each local stage but the
        last one (``fwd_cache``), as :meth:`held` counts chunks."""
        if not self.chunk_layers:
            return self.held(size * (self.virtual - self.head), less)
        counts, back = self.flight_last if last and self.flight_last[0] else self.flight
        kept = range(len(counts) - 1 if self.head else len(counts))
        return size * max(0, sum(counts[i] for i in kept) - (less if back in kept else 0))

    @property
    def label(self) -> str:
        return f"pipeline stage {self.index}"


def stages(arch: Arch, w: Workload) -> tuple[Stage, ...]:
    """The pipeline ranks that bound the others (:meth:`~vramplan.workload.Parallel.pipeline_ranks`:
    the first, rank 1 and the last); one stage when pp = 1."""
    p = w.parallel
    if p.pp == 1:
        return (Stage(0, tuple((g, g.count) for g in arch.groups), True, True, 1),)
    v = p.stages_per_rank
    bounds = p.stage_bounds(arch.layers)
    out = []
    for rank in p.pipeline_ranks():
        ids = p.stage_ids(rank)
        groups = _merge([g for i in ids for g in _slice(arch, *bounds[i])])
        if not w.training:
            flight = v
        elif rank == 0 and p.microbatches:  # the user's count of micro-batches in flight
            flight = p.microbatches * v
        else:
            flight = chunks_in_flight(p.pp_schedule, p.pp, v, w.grad_accum, rank)
        heads = w.grad_accum if w.training and p.pp_schedule in ("GPipe", "LoopedBFS") else 1
        last = p.pp * v - 1
        receives = sum(i != 0 for i in ids) + sum(i != last for i in ids) if w.training else 0
        stage = Stage(rank, groups, 0 in ids, last in ids, flight, v, heads, receives)
        if w.training and p.pp_schedule == "Interleaved1F1B" and not (rank == 0 and p.microbatches):
            sizes = tuple(hi - lo for lo, hi in (bounds[i] for i in ids))
            if len(set(sizes)) > 1:  # (stages of equal size: every chunk alike, as counted)
                stage = dataclasses.replace(stage, chunk_layers=sizes,
                                            flight=interleaved_flight(p.pp, v, w.grad_accum, rank, sizes),
                                            flight_last=interleaved_flight(p.pp, v, w.grad_accum, rank, sizes, True))
        out.append(stage)
    return tuple(out)


def interleaved_flight(pp: int, v: int, m: int, rank: int, sizes: tuple[int, ...],
                       last: bool = False) -> tuple[tuple[int, ...], int]:
    """Interleaved1F1B on ``rank``: (the forwards of each local stage not yet run backward, the
    local stage whose backward runs) at the backward with the most layers in flight (``last``: a
    backward of the last local stage), ``sizes`` the layers of each local stage. torch 2.13
    ``pipelining/schedules.py`` ``ScheduleInterleaved1F1B._calculate_single_rank_operations``
    (:2954-3008): ``_get_warmup_ops`` forwards, then a forward and a backward per step, then the
    backwards; forward step ``k`` runs local stage ``(k // per_round) % v``, backward step ``k``
    local stage ``v − 1 − ((k − warmup) // per_round) % v`` (``_get_1f1b_rank_ops``, :2735-2869).
    Chunks of a rank's stages differ in size where the embeddings or the head take a stage's
    share of layers (``pp_first_less``, ``pp_last_less``)."""
    per_round = m // max(1, m // pp)
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)
    counts = [0] * v
    best: tuple[int, tuple[int, ...], int] = (-1, tuple(counts), v - 1)
    for k in range(warmup):
        counts[(k // per_round) % v] += 1
    for k in range(warmup, m * v + warmup):
        if k < m * v:
            counts[(k // per_round) % v] += 1
        b = v - 1 - ((k - warmup) // per_round) % v
        score = sum(c * n for c, n in zip(counts, sizes, strict=True))
        if (b == v - 1 or not last) and score > best[0]:
            best = (score, tuple(counts), b)
        counts[b] -= 1
    return best[1], best[2]


def chunks_in_flight(schedule: str, pp: int, v: int, m: int, rank: int) -> int:
    """The most forwards of rank ``rank``'s stages whose backward has not run yet, over one
    step of ``m`` micro-batches: what each torch schedule's action order gives
    (``torch/distributed/pipelining/schedules.py``, torch 2.13; ``tests/test_pipeline_schedules.py``
    checks each formula against torch's own ``pipeline_order``).

    GPipe runs every forward first; 1F1B ``min(m, pp − rank)`` forwards before its first
    backward; LoopedBFS every forward of every local stage; Interleaved1F1B its warm-up
    (``_get_warmup_ops``: ``(v − 1) × per-round + 2 × (pp − 1 − rank)``, capped at ``m × v``)
    and one more forward before the first backward; InterleavedZeroBubble the same with a
    factor 1, counted until each chunk's weight-gradient step (``W``), which runs ``rank`` steps
    after its input-gradient one: ``rank`` more chunks (a chunk waiting for ``W`` keeps the
    linears' inputs and output gradients, not all it saved: an upper bound); ZBVZeroBubble ``2 pp`` chunks once ``m >= 2 pp − 1`` (warm-up ``2 (pp − rank) − 1`` +
    ``2 rank`` forwards, then each forward of the second chunk is followed by its backward),
    fewer where torch drops the padding micro-batches of a shorter step."""
    if schedule == "GPipe":
        return m
    if schedule == "1F1B":
        return min(m, pp - rank)
    if schedule == "LoopedBFS":
        return m * v
    if schedule == "Interleaved1F1B":
        per_round = m // max(1, m // pp)
        warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)
        return warmup + 1 if warmup < m * v else warmup
    if schedule == "InterleavedZeroBubble":
        per_round = m // max(1, m // pp)
        warmup = min((v - 1) * per_round + (pp - 1 - rank), m * v)
        return min(warmup + 1 + rank, m * v)
    if schedule == "ZBVZeroBubble":
        return _zbv_in_flight(pp, m, rank)
    raise ValueError(f"unknown pipeline schedule {schedule!r}")


def _zbv_in_flight(pp: int, m: int, rank: int) -> int:
    """ZBVZeroBubble's forwards not yet backward on ``rank``: the phases of its
    ``_calculate_single_rank_operations`` (torch 2.13), which schedules ``max(2 pp − 1, m)``
    micro-batches and drops the actions of those beyond ``m``."""
    live = best = 0
    count = {"F0": 0, "F1": 0, "I0": 0, "I1": 0}

    def act(kind: str) -> None:
        nonlocal live, best
        real = count[kind] < m
        count[kind] += 1
        if real:
            live += 1 if kind[0] == "F" else -1
            best = max(best, live)

    n_micro = max(2 * pp - 1, m)
    for _ in range(2 * (pp - rank) - 1):
        act("F0")
    for _ in range(rank):
        act("F1")
        act("F0")
    for _ in range(pp - rank):
        act("F1")
        act("I1")
    while count["F1"] < count["F0"] or count["F0"] < n_micro:
        if count["F0"] < n_micro:
            act("F0")
        act("I0")
        act("F1")
        act("I1")
    return best


def stage_groups(arch: Arch, w: Workload, stage_id: int) -> tuple[tuple[LayerGroup, int], ...]:
    """The layer groups of pipeline stage ``stage_id`` (of ``pp × stages_per_rank``), in order."""
    return _slice(arch, *w.parallel.stage_bounds(arch.layers)[stage_id])


def _merge(groups: list[tuple[LayerGroup, int]]) -> tuple[tuple[LayerGroup, int], ...]:
    out: dict[int, tuple[LayerGroup, int]] = {}
    for g, n in groups:
        out[id(g)] = (g, out[id(g)][1] + n) if id(g) in out else (g, n)
    return tuple(out.values())


def _slice(arch: Arch, start: int, stop: int) -> tuple[tuple[LayerGroup, int], ...]:
    out: list[tuple[LayerGroup, int]] = []
    pos = 0
    for g in arch.groups:
        lo, hi = max(start, pos), min(stop, pos + g.count)
        if hi > lo:
            out.append((g, hi - lo))
        pos += g.count
    return tuple(out)


def local(lin: Linear, w: Workload) -> int:
    """Elements of this linear (stack) held by one rank."""
    n = lin.params
    if lin.tp:
        n //= w.parallel.tp
    if lin.expert:
        n //= w.parallel.ep
    return n


def local_small(g: LayerGroup, w: Workload) -> int:
    """Vector elements (norms, biases) of one layer of ``g`` held by one rank: all of them but the
    column-parallel linears' biases, which tensor parallelism splits (``LayerGroup.tp_small``)."""
    return g.small_params - g.tp_small + g.tp_small // w.parallel.tp


ROW_PARALLEL = frozenset({"o", "down", "fc2", "shared_down"})
"""Roles whose weight ``[d_out, d_in]`` tensor parallelism splits along ``d_in`` (Megatron's
row-parallel linears; torchtitan's ``RowwiseParallel`` ``wo``/``w2``): dim 0 stays whole."""


def lora_tp(w: Workload) -> bool:
    """LoRA under tensor parallelism runs as transformers + peft run it, not Megatron's layout:
    transformers' ``tp_plan`` (``LlamaForCausalLM._tp_plan``: ``lm_head: colwise_gather_output``,
    transformers 5.24 ``models/llama/modeling_llama.py:414``; the style registered as
    ``ColwiseParallel(Replicate in, Replicate out)``, ``distributed/tensor_parallel.py:602-604``)
    all-gathers the logits, so every rank holds the whole vocabulary's and computes the ordinary
    cross-entropy (no loss parallel); peft shards the adapters with the plan
    (:func:`local_adapters`). docs/research/lora-under-tp.md."""
    return w.parallel.tp > 1 and w.peft is not Peft.NONE


def logit_split(arch: Arch, w: Workload) -> int:
    """Ranks the logits' vocabulary is split over: ``tp`` (vocab-parallel logits: Megatron,
    torchtitan's loss parallel), 1 for a classification head and for LoRA under TP
    (:func:`lora_tp`: transformers gathers them)."""
    return 1 if arch.head.kind == "cls" or lora_tp(w) else w.parallel.tp


def local_adapters(lin: Linear, rank: int, w: Workload) -> tuple[int, int]:
    """Elements of (``lora_A`` ``[rank, d_in]``, ``lora_B`` ``[d_out, rank]``) of one matrix of
    ``lin`` on one rank. peft sizes the adapters of a TP-sharded linear by its local weight
    (peft 0.21.2 ``tuners/tuners_utils.py:175-186``) and shards them with the base layer's style
    (``tuners/lora/model.py:398-446``): a column-parallel layer's ``lora_B`` holds ``d_out / tp``
    rows, its ``lora_A`` is whole on every rank; a row-parallel layer's ``lora_A`` holds
    ``d_in / tp`` columns, its ``lora_B`` is whole (NeMo's LoRA splits the same way)."""
    tp = w.parallel.tp if lin.tp else 1
    if lin.role in ROW_PARALLEL:
        return rank * (lin.d_in // tp), lin.d_out * rank
    return rank * lin.d_in, (lin.d_out // tp) * rank


def fsdp_rows(rows: int, n: int) -> int:
    """Rows of dim 0 that rank 0 holds when FSDP2 shards ``rows`` over ``n`` ranks:
    ``torch.chunk`` sizes, ``ceil(rows / n)`` (``_chunk_with_empty`` in
    torch/distributed/fsdp/_fully_shard/_fsdp_common.py; ``FSDPParam._init_sharded_param``
    pads every rank's shard to chunk 0's size, torch 2.13)."""
    return -(-rows // n)


def fsdp_padding(lins: list[tuple[Linear, int]], embed_rows: int, head: list[Linear], h: int, w: Workload) -> int:
    """Elements FSDP2 adds to this rank's weight matrices by padding dim 0 of each (TP-local)
    tensor to a multiple of the shard group: with them, (elements + padding) / shard group is
    exactly rank 0's shard. Each linear's weight is ``[d_out, d_in]`` (column-parallel linears
    hold ``d_out / tp`` rows, row-parallel ones all ``d_out``); a routed-expert stack is one
    ``[experts / ep, …]`` tensor per layer; the token embedding ``[vocab / tp, hidden]``
    (torchtitan's RowwiseParallel shards the vocabulary). Norms and biases are not padded
    (their sizes divide any usual group)."""
    n, tp = w.parallel.shard_group, w.parallel.tp
    if n <= 1:
        return 0
    pad = 0

    def add(rows: int, cols: int, tensors: int) -> None:
        nonlocal pad
        if rows > 0:
            pad += tensors * (fsdp_rows(rows, n) * n - rows) * cols

    for lin, layers in lins:
        if lin.expert and lin.count > 1:
            rows = lin.count // w.parallel.ep
            add(rows, local(lin, w) // max(1, rows), layers)
            continue
        split = lin.tp and tp > 1
        rows = lin.d_out // tp if split and lin.role not in ROW_PARALLEL else lin.d_out
        cols = lin.d_in // tp if split and lin.role in ROW_PARALLEL else lin.d_in
        add(rows, cols, layers * lin.count)
    add(embed_rows, h, 1)
    for lin in head:
        add(lin.d_out // tp if lin.tp and tp > 1 else lin.d_out, lin.d_in, 1)
    return pad


def tokens_per_rank(w: Workload, seq: int | None = None) -> int:
    """Tokens of one micro-batch on one rank (context parallel splits the sequence)."""
    return tokens(w, seq).per_rank


def _divisors(n: int, limit: int = 8) -> str:
    ds = [d for d in range(1, n + 1) if n % d == 0][:limit]
    return ", ".join(str(d) for d in ds) + ("…" if len(ds) == limit else "")


def check_against_model(spec: ModelSpec, w: Workload) -> None:
    """Raise WorkloadError when the workload's parallel sizes or shapes do not fit the model."""
    name, p = spec.name, w.parallel
    for what in ("images", "videos"):
        if getattr(w, what):
            raise WorkloadError(f"`{what}` applies to vision-language models; {name} takes no {what}",
                                hint=f"drop `{what}`", field=what)
    layout = arch_of(spec.config)
    if layout is not None and layout.kind == "vlm":  # (Qwen2.5-VL has a closed form: analytic/vlm.py)
        raise WorkloadError(f"{name} ({spec.model_type}) is a vision-language model whose vision tower has no "
                            "closed form here", hint="use `method=trace`")
    if spec.family is Family.OTHER or spec.hidden <= 0 or spec.layers <= 0 or spec.heads <= 0:
        raise WorkloadError(
            f"{name} is not a transformer the analytic method knows",
            hint="use `method=trace`",
        )
    if w.image_size != 224 and spec.family is not Family.VIT:  # 224: the Workload default
        raise WorkloadError(f"`image_size` applies to vision models; {name} ({spec.family}) takes token sequences",
                            hint="drop `image_size` (`seq` sets the input length)")
    if w.task is Task.GENERATE and not spec.is_decoder:
        article = "an" if str(spec.family)[0] in "aeiou" else "a"
        raise WorkloadError(f"{name} is {article} {spec.family} model and does not generate text",
                            hint="use `task=infer` or `task=train`")
    if p.tp > 1:
        # suggest only sizes that divide every split dimension (heads, KV heads, MLP widths)
        splits = [spec.heads, spec.intermediate, spec.moe_intermediate]
        if spec.family is not Family.MLA:
            splits.append(spec.kv_heads)
        ok_tp = _divisors(math.gcd(*(s for s in splits if s)))
        if spec.heads % p.tp:
            raise WorkloadError(f"`tp={p.tp}` does not divide {spec.heads} attention heads of {name}",
                                hint=f"use {ok_tp}", field="tp")
        if spec.family is not Family.MLA and spec.kv_heads and spec.kv_heads % p.tp:
            raise WorkloadError(f"`tp={p.tp}` does not divide {spec.kv_heads} key/value heads of {name}",
                                hint=f"use {ok_tp}", field="tp")
        for what, size in (("intermediate size", spec.intermediate), ("expert intermediate size", spec.moe_intermediate)):
            if size and size % p.tp:
                raise WorkloadError(f"`tp={p.tp}` does not divide the {what} {size} of {name}",
                                    hint=f"use {ok_tp}", field="tp")
    if p.pp > 1:
        p.stage_bounds(spec.layers)  # torchtitan's split of the layers over the stages (raises where it raises)
    if p.ep > 1:
        if not spec.is_moe:
            raise WorkloadError(f"`ep={p.ep}` needs a mixture-of-experts model; {name} is dense", hint="drop `ep`", field="ep")
        if spec.n_experts % p.ep:
            raise WorkloadError(f"`ep={p.ep}` does not divide {spec.n_experts} experts of {name}",
                                hint=f"use {_divisors(spec.n_experts)}", field="ep")
    seq = w.seq if spec.family is not Family.VIT else 0
    if seq and p.cp > 1 and seq % p.cp:
        raise WorkloadError(f"`cp={p.cp}` does not divide the sequence length {seq}",
                            hint=f"use a `seq` that is a multiple of {p.cp}", field="cp")
    if seq and p.sp and (seq // p.cp) % p.tp:
        raise WorkloadError(f"sequence parallelism splits {seq // p.cp} tokens over `tp={p.tp}`, which does not divide them",
                            hint=f"use a `seq` that is a multiple of {p.tp * p.cp}", field="sp")
    if w.training and p.pp > 1:
        check_schedule(w)
    length = w.seq + (w.new_tokens if w.task is Task.GENERATE else 0)
    learned = spec.family is Family.ENCODER or spec.model_type in ("gpt2", "gpt_bigcode")
    if learned and spec.max_positions and length > spec.max_positions:
        raise WorkloadError(
            f"{name} has {spec.max_positions} learned positions; {length} tokens do not fit",
            hint=f"use `seq={spec.max_positions}` or less" if length == w.seq
            else f"keep `seq` + `new_tokens` at {spec.max_positions} or less", field="seq",
        )
    if spec.family is Family.VIT:
        patch = spec.shape.patch_size
        if w.image_size % patch:
            raise WorkloadError(f"`image_size={w.image_size}` is not a multiple of the patch size {patch} of {name}",
                                hint=f"use e.g. {max(patch, w.image_size // patch * patch)}", field="image_size")


def check_ring_kernel(w: Workload, compute_bytes: int, head_dim: int) -> None:
    """Refuse a load-balanced ring whose rounds run the memory-efficient kernel on chunks that are
    not a multiple of 32 queries, as the trace does (``trace.context_parallel.check_kernel``: the
    kernel pads its logsumexp to 32 queries and torch's ring merge does not slice it off, so the
    run fails on a GPU). The kernel is the memory-efficient one where flash attention cannot run:
    fp32 attention, or a head size above 256 (torch 2.13 ``sdp_utils.cpp``
    ``check_head_dim_size_flash``); the GPU's own limits (flash needs sm80+) are the trace's."""
    cp = w.parallel.cp
    chunk = w.seq // (2 * cp) if cp > 1 else 0
    efficient = compute_bytes == 4 or head_dim > 256
    if not chunk or chunk % 32 == 0 or not efficient:
        return
    step = 64 * cp
    why = "fp32" if compute_bytes == 4 else f"head size {head_dim}"
    raise WorkloadError(f"PyTorch's load-balanced ring attention runs the memory-efficient kernel here ({why}), whose "
                        f"logsumexp is padded to a multiple of 32 queries, which the ring's merge does not slice: each "
                        f"rank's chunks of `seq` / (2 × `cp`) = {chunk:,} tokens fail, on a GPU too",
                        hint=f"use a `seq` that is a multiple of {step:,} (e.g. {-(-w.seq // step) * step:,}), or "
                             "half precision (flash attention)", field="seq")


def check_schedule(w: Workload) -> None:
    """The micro-batch counts torch's schedule classes accept (their constructors' checks)."""
    p, m = w.parallel, w.grad_accum
    if p.pp_schedule == "1F1B" and m < p.pp:  # Schedule1F1B.__init__
        raise WorkloadError(f"1F1B over `pp={p.pp}` stages needs at least {p.pp} micro-batches per step; "
                            f"`grad_accum={m}` gives {m}", hint=f"use `grad_accum={p.pp}` or more, or "
                            "`pp_schedule=GPipe`", field="grad_accum")
    if p.pp_schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, m // p.pp)
        if m % rounds:  # ScheduleInterleaved1F1B.__init__ / ScheduleInterleavedZeroBubble.__init__
            raise WorkloadError(f"{p.pp_schedule} runs `grad_accum={m}` micro-batches in {rounds} rounds of "
                                f"`pp={p.pp}`, which must divide them", hint=f"use `grad_accum` of {rounds * p.pp} "
                                f"or another multiple of {p.pp}", field="grad_accum")
    if p.microbatches > m:
        raise WorkloadError(f"`microbatches={p.microbatches}` in flight but a step has only `grad_accum={m}`",
                            hint=f"use `grad_accum={p.microbatches}` or more", field="microbatches")
