"""Pipeline parallelism in a trace: one stage of ``torch.distributed.pipelining`` per trace.

A transformers causal LM (``model.model.layers``, ``embed_tokens``, ``norm``, ``lm_head``) is
cut as torchtitan's ``pipeline_llama`` cuts its Llama (``torchtitan/models/llama3/infra/
pipeline.py``): ``layers / pp`` consecutive decoder layers per stage, the token embeddings
on the first stage only, the final norm and the head on the last stage only (other stages
pass hidden states: the norm and head become identities, transformers' model is called with
``inputs_embeds``). A tied head on the last stage keeps its own copy of the table.

The stage runs PyTorch's real schedule (``Schedule1F1B``, the schedule the analytic method
assumes: the first stage holds ``pp`` micro-batches of activations in flight) over
``grad_accum`` micro-batches of ``batch`` sequences, on a fake process group whose rank is
the stage's: the receive buffers are the schedule's own, sends and receives communicate
nothing. Each stage that differs is traced: the first (embeddings, most micro-batches in
flight) and the last (head, logits, loss); middle stages hold the same layers as the first,
without embeddings and with fewer micro-batches in flight, so the first bounds them.

The schedule's P2P warm-up vote (torch >= 2.13, ``_PipelineSchedule._warmup_p2p``) reads a
tensor's value, which a fake process group never fills: it is replaced by its outcome for
stages built with static shapes (``InferenceMode.STATIC``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import TraceError
from ..workload import Phase

SCHEDULE = "1F1B"


def stage_ranks(pp: int) -> tuple[int, ...]:
    """The pipeline ranks whose memory differs: the first and the last stage."""
    return (0, pp - 1)


@dataclass(frozen=True)
class StageSpec:
    rank: int
    pp: int
    first: bool
    last: bool
    layers: tuple[int, int]
    """[start, stop) of the decoder layers this stage holds."""


class _Stage(nn.Module):
    """The stage's part of a transformers causal LM, taking ids (first) or hidden states."""

    def __init__(self, lm: nn.Module, first: bool) -> None:
        super().__init__()
        self.lm = lm
        self.first = first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lm(input_ids=x, use_cache=False) if self.first else self.lm(inputs_embeds=x, use_cache=False)
        return out.logits


def split(model: nn.Module, rank: int, pp: int) -> tuple[nn.Module, StageSpec]:
    """Cut ``model`` in place to pipeline stage ``rank`` of ``pp``; returns the stage module."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    head = getattr(model, "lm_head", None)
    if not (isinstance(layers, nn.ModuleList) and isinstance(getattr(inner, "embed_tokens", None), nn.Embedding)
            and isinstance(head, nn.Linear) and hasattr(inner, "norm")):
        raise TraceError(f"pipeline parallelism is traced for transformers causal LMs (model.layers, embed_tokens, "
                         f"norm, lm_head); {type(model).__name__} is not one", hint="use `method=analytic`")
    n = len(layers)
    if n % pp:
        raise TraceError(f"`pp={pp}` does not divide the {n} layers", hint="use a `pp` that divides the layers")
    per = n // pp
    lo, hi = rank * per, (rank + 1) * per
    first, last = rank == 0, rank == pp - 1
    assert inner is not None
    inner.layers = nn.ModuleList(list(layers)[lo:hi])
    for i, layer in enumerate(inner.layers):  # transformers indexes caches and layer types by it
        attn = getattr(layer, "self_attn", None)
        if attn is not None and hasattr(attn, "layer_idx"):
            attn.layer_idx = i
    cfg: Any = model.config
    cfg.num_hidden_layers = per
    types = getattr(cfg, "layer_types", None)
    if isinstance(types, list) and len(types) == n:
        cfg.layer_types = types[lo:hi]
    if not first:
        inner.embed_tokens = None
    if not last:
        inner.norm = nn.Identity()
        model.lm_head = nn.Identity()
    return _Stage(model, first), StageSpec(rank, pp, first, last, (lo, hi))


@contextlib.contextmanager
def static_warmup() -> Iterator[None]:
    """Replace the schedule's P2P warm-up vote by its outcome for static shapes (see above)."""
    import torch.distributed.pipelining.schedules as sch

    base = getattr(sch, "_PipelineSchedule", None)
    orig = getattr(base, "_warmup_p2p", None)
    if base is None or orig is None:  # torch < 2.13: no vote
        yield
        return
    from torch.distributed.pipelining.stage import InferenceMode

    def warmup(self: Any, stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
        for st in stages:
            st._inference_mode = InferenceMode.STATIC

    base._warmup_p2p = warmup  # type: ignore[attr-defined]
    try:
        yield
    finally:
        base._warmup_p2p = orig  # type: ignore[attr-defined]


def p2p_on_meta() -> None:
    """Let the fake process group serve sends and receives of ``meta`` tensors: batched P2P
    (``dist.batch_isend_irecv``, the schedules' transport) asks the group for the backend of
    the tensors' device, and the trace's device tensors are ``meta``."""
    import torch.distributed as dist

    pg: Any = dist.distributed_c10d._get_default_group()
    meta = torch.device("meta")
    with contextlib.suppress(RuntimeError):
        pg._get_backend(meta)
        return
    cuda = torch.device("cuda")
    pg._register_backend(meta, pg._get_backend_type(cuda) if hasattr(pg, "_get_backend_type")
                         else dist.ProcessGroup.BackendType.CUSTOM, pg._get_backend(cuda))


def make_runner(stage_mod: nn.Module, spec: StageSpec, *, micro: int, microbatches: int, seq: int, hidden: int,
                vocab: int, act_dtype: torch.dtype, out_dtype: torch.dtype) -> Callable[[Any, Any], None]:
    """A step runner (``runner(sess, plan)``) that runs this stage's part of one 1F1B step."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    state: dict[str, Any] = {}

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())

    def build(sess: Any, plan: Any) -> Any:
        meta = torch.device("meta")
        x = (torch.zeros(micro, seq, dtype=torch.long, device=meta) if spec.first
             else torch.zeros(micro, seq, hidden, dtype=act_dtype, device=meta))
        y = torch.zeros(micro, seq, vocab if spec.last else hidden, dtype=out_dtype if spec.last else act_dtype,
                        device=meta)
        # static shapes; hidden states carry gradients between stages, token ids and logits-to-loss do not
        if not spec.first:
            x.requires_grad_(True)
        if not spec.last:
            y.requires_grad_(True)
        stage = PipelineStage(stage_mod, spec.rank, spec.pp, meta, input_args=(x,), output_args=(y,))
        fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk

        def forward_one_chunk(*a: Any, **k: Any) -> Any:
            with sess.phase(Phase.FORWARD), sess.autocast_region(plan.autocast):
                return fwd(*a, **k)

        def backward_one_chunk(*a: Any, **k: Any) -> Any:
            with sess.backward():
                return bwd(*a, **k)

        stage.forward_one_chunk = forward_one_chunk  # type: ignore[method-assign]
        stage.backward_one_chunk = backward_one_chunk  # type: ignore[method-assign]
        return Schedule1F1B(stage, n_microbatches=microbatches, loss_fn=loss_fn)

    def run(sess: Any, plan: Any) -> None:
        if "schedule" not in state:
            state["schedule"] = build(sess, plan)
        schedule = state["schedule"]
        meta = torch.device("meta")
        with sess.phase(Phase.FORWARD):
            ids = torch.zeros(micro * microbatches, seq, dtype=torch.long, device=meta)
        with static_warmup():
            if spec.first:
                schedule.step(ids)
            elif spec.last:
                schedule.step(target=ids, losses=[])
            else:
                schedule.step()
        del ids
        sess.label_grads(plan.trainable)
        with sess.phase(Phase.OPTIMIZER):
            if plan.optimizer is not None:
                plan.optimizer.step()
                sess.label_optimizer(plan.optimizer)
                plan.optimizer.zero_grad(set_to_none=True)

    return run
