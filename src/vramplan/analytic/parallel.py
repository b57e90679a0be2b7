"""Per-rank view of a model under TP/PP/EP/CP/SP, and the checks that sizes divide.

Pipeline stages get ``layers / pp`` consecutive layers; the first stage holds the input
embeddings and, under 1F1B, ``in_flight`` micro-batches of activations; the last stage holds
the final norm, the output head and the logits (a tied head is a copy of the embeddings).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vramplan.errors import WorkloadError
from vramplan.models.shape import tokens
from vramplan.models.spec import Family, ModelSpec
from vramplan.workload import Task, Workload

from .arch import Arch, LayerGroup, Linear


@dataclass(frozen=True)
class Stage:
    index: int
    groups: tuple[tuple[LayerGroup, int], ...]
    """(layer group, layers of it on this stage)."""
    embed: bool
    head: bool
    in_flight: int

    @property
    def layers(self) -> int:
        return sum(n for _, n in self.groups)

    @property
    def label(self) -> str:
        return f"pipeline stage {self.index}"


def stages(arch: Arch, w: Workload) -> tuple[Stage, ...]:
    """The first and the last pipeline stage (one stage when pp = 1)."""
    p = w.parallel
    per = arch.layers // p.pp
    in_flight = p.in_flight if w.training else 1
    if p.pp == 1:
        return (Stage(0, tuple((g, g.count) for g in arch.groups), True, True, 1),)
    return (
        Stage(0, _slice(arch, 0, per), True, False, in_flight),
        Stage(p.pp - 1, _slice(arch, arch.layers - per, arch.layers), False, True, 1),
    )


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


ROW_PARALLEL = frozenset({"o", "down", "fc2", "shared_down"})
"""Roles whose weight ``[d_out, d_in]`` tensor parallelism splits along ``d_in`` (Megatron's
row-parallel linears; torchtitan's ``RowwiseParallel`` ``wo``/``w2``): dim 0 stays whole."""


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
    if spec.layers % p.pp:
        raise WorkloadError(f"`pp={p.pp}` does not divide {spec.layers} layers of {name}",
                            hint=f"use {_divisors(spec.layers)}", field="pp")
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
    if w.training and p.pp > 1 and w.grad_accum < p.in_flight:
        raise WorkloadError(
            f"`pp={p.pp}` keeps {p.in_flight} micro-batches in flight but a step has only `grad_accum={w.grad_accum}`",
            hint=f"use `grad_accum={p.in_flight}` or more",
            field="pp")
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
