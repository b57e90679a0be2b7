"""Pipeline parallelism in a trace: one rank of ``torch.distributed.pipelining`` per trace.

A transformers causal LM (``model.model.layers``, ``embed_tokens``, ``norm``, ``lm_head``) is
cut into ``pp × v`` stages of consecutive decoder layers (``v`` stages per rank under the
looped schedules, :attr:`~vramplan.workload.Parallel.stages_per_rank`), as torchtitan cuts its
Llama into model parts (``torchtitan/distributed/pipeline_parallel.py``
``generate_llm_fqn_per_model_part``: :meth:`~vramplan.workload.Parallel.stage_bounds`, the first
and last stages lighter by the layers their embeddings and head count for, uneven where the
layers do not divide): the token embeddings on the first stage only, the
final norm and the head on the last stage only (other stages pass hidden states: the norm and
head become identities, transformers' model is called with ``inputs_embeds``). A tied head on
the last stage keeps its own copy of the table. A rank holds the stages torch's
``generate_stage_to_rank_mapping`` gives it (:meth:`~vramplan.workload.Parallel.stage_ids`).

The rank runs PyTorch's real schedule class (``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``, ``ScheduleInterleavedZeroBubble``,
``ScheduleZBVZeroBubble``, by the names of ``get_schedule_class``) over ``grad_accum``
micro-batches of ``batch`` sequences, on a fake process group whose rank is the rank's: the
receive buffers are the schedule's own, sends and receives communicate nothing, and the
order of forwards, backwards (and the zero-bubble schedules' separate weight-gradient steps)
is the schedule's. The ranks that bound the others are traced
(:meth:`~vramplan.workload.Parallel.pipeline_ranks`): the first (embeddings, the most
micro-batches in flight), rank 1 (the most layers of the middle ranks, no fewer micro-batches in
flight than the ranks after it) and the last (head, logits, loss).

With context parallelism (torchtitan's ``cp`` between ``dp_shard`` and ``tp``) each stage runs on
its context-parallel rank's ``seq / cp`` tokens: the first stage takes the shard's token ids, the
stages hand on cp-local hidden states, the last computes its shard's logits and loss, and every
attention is torch's ring attention over the ``cp`` mesh (:func:`.context_parallel.ring_dispatcher`).

With tensor parallelism each rank's parts are tensor-parallelised on the world's ``tp``
dimension before the rest (:func:`tensor_parallelise`; torchtitan's ``(pp, dp_replicate,
dp_shard, cp, tp)`` mesh), and the stages hand on the TP-local hidden states.

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


def schedule_class(name: str) -> Any:
    """torch's schedule class for ``name`` (``get_schedule_class``'s spelling)."""
    import torch.distributed.pipelining.schedules as sch

    classes = {"GPipe": "ScheduleGPipe", "1F1B": "Schedule1F1B", "Interleaved1F1B": "ScheduleInterleaved1F1B",
               "LoopedBFS": "ScheduleLoopedBFS", "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble",
               "ZBVZeroBubble": "ScheduleZBVZeroBubble"}
    cls = getattr(sch, classes.get(name, ""), None)
    if cls is None:
        raise TraceError(f"torch {torch.__version__} has no {name} pipeline schedule",
                         hint="use `pp_schedule=1F1B` or GPipe, a newer torch, or `method=analytic`")
    return cls


@dataclass(frozen=True)
class StageSpec:
    index: int
    """Pipeline stage index, of ``stages``."""
    stages: int
    first: bool
    last: bool
    layers: tuple[int, int]
    """[start, stop) of the decoder layers this stage holds."""


class _Stage(nn.Module):
    """The stage's part of a transformers causal LM, taking ids (first) or hidden states."""

    def __init__(self, lm: nn.Module, first: bool, last: bool) -> None:
        super().__init__()
        self.lm = lm
        self.first = first
        self.last = last
        self.positions = 0
        """Under sequence parallelism the whole sequence's length (:func:`tensor_parallelise`):
        the stage's hidden states are its tensor-parallel rank's sequence shard, from which
        transformers would derive shard-long rotary positions; explicit ``position_ids`` for the
        whole sequence are passed instead, as the tensor-parallel trace's batch carries them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a stage before the last returns the decoder's hidden states (the causal LM's
        # `lm_head(hidden[:, slice])` would hand on a view, which the zero-bubble schedules'
        # input-gradient step cannot `detach_()`)
        run: Any = self.lm if self.last else self.lm.model
        kw: dict[str, Any] = {"use_cache": False}
        if self.positions:
            kw["position_ids"] = torch.arange(self.positions, device=x.device).unsqueeze(0).expand(x.shape[0], -1)
        out = run(input_ids=x, **kw) if self.first else run(inputs_embeds=x, **kw)
        return out.logits if self.last else out.last_hidden_state


def split(model: nn.Module, index: int, bounds: tuple[tuple[int, int], ...]) -> tuple[nn.Module, StageSpec]:
    """Cut ``model`` in place to pipeline stage ``index``, whose decoder layers are
    ``bounds[index]`` (:meth:`~vramplan.workload.Parallel.stage_bounds`); returns the stage module."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    head = getattr(model, "lm_head", None)
    if not (isinstance(layers, nn.ModuleList) and isinstance(getattr(inner, "embed_tokens", None), nn.Embedding)
            and isinstance(head, nn.Linear) and hasattr(inner, "norm")):
        raise TraceError(f"pipeline parallelism is traced for transformers causal LMs (model.layers, embed_tokens, "
                         f"norm, lm_head); {type(model).__name__} is not one", hint="use `method=analytic`")
    n, stages = len(layers), len(bounds)
    if bounds[-1][1] != n:
        raise TraceError(f"the stage bounds {bounds} do not cover the model's {n} layers")
    lo, hi = bounds[index]
    first, last = index == 0, index == stages - 1
    assert inner is not None
    inner.layers = nn.ModuleList(list(layers)[lo:hi])
    for i, layer in enumerate(inner.layers):  # transformers indexes caches and layer types by it
        attn = getattr(layer, "self_attn", None)
        if attn is not None and hasattr(attn, "layer_idx"):
            attn.layer_idx = i
    cfg: Any = model.config
    cfg.num_hidden_layers = hi - lo
    types = getattr(cfg, "layer_types", None)
    if isinstance(types, list) and len(types) == n:
        cfg.layer_types = types[lo:hi]
    if not first:
        inner.embed_tokens = None
    if not last:
        inner.norm = nn.Identity()
        model.lm_head = nn.Identity()
    return _Stage(model, first, last), StageSpec(index, stages, first, last, (lo, hi))


def tensor_parallelise(model: nn.Module, mesh: Any, *, sp: bool, seq: int) -> list[str]:
    """Tensor-parallelise each model part of a pipeline rank (:class:`Chunks`) over the 1-D
    ``mesh`` (the world's ``tp`` dimension), as torchtitan's ``pipeline_llm`` runs
    ``parallelize_fn`` on each part after the split (torchtitan 0.3.0
    ``distributed/pipeline_parallel.py:108–121``; its ``parallelize_llama`` applies TP first): the
    plan of :func:`.tensor_parallel.apply_tensor_parallel` with the embeddings' style on the first
    stage only and the norm's and head's on the last only. The stages then hand on the blocks'
    local outputs: each tensor-parallel rank's sequence shard under ``sp``, the whole (replicated)
    hidden states without."""
    from .tensor_parallel import apply_tensor_parallel

    notes: list[str] = []
    parts: Any = model.parts
    for part in parts:
        notes = apply_tensor_parallel(part.lm, mesh, sp=sp, stage=True)
        if sp:
            part.positions = seq
    return notes


def shard_positions(model: nn.Module, seq: int) -> None:
    """Under context parallelism each stage runs on its context-parallel rank's ``seq`` tokens
    (torchtitan 0.3.0 shards each micro-batch's inputs, labels and positions before the
    schedule's step: :func:`.context_parallel.ring_dispatcher`); the stages take explicit
    ``position_ids`` of the shard's length, as torchtitan passes the sharded ``positions`` to
    every stage (``kwarg_mbs``, ``trainer.py`` L838–L864)."""
    parts: Any = model.parts
    for part in parts:
        part.positions = seq


class Chunks(nn.Module):
    """The stages one rank holds (one, or ``v`` under a looped schedule), as one module."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)


def fsdp_units(model: nn.Module) -> list[tuple[Any, bool | None]]:
    """The FSDP2 units of a pipeline rank's model parts, in the order torchtitan's
    ``apply_fsdp_to_decoder`` shards each part (torchtitan 0.3.0 ``distributed/fsdp.py``): the
    token embeddings (first stage), the final norm with the head as one unit (last stage,
    ``reshard_after_forward`` False unless the policy is "always"), each decoder block, then the
    part itself (``fully_shard``'s default: its root keeps its parameters after forward). Each
    with its ``reshard_after_forward`` (None: ``fully_shard``'s default); the pipeline's
    policy is torchtitan's under pp, False (:func:`~.layout.pipeline_layout`)."""
    units: list[tuple[Any, bool | None]] = []
    parts: Any = model.parts
    for part in parts:
        lm: Any = part.lm
        inner = lm.model
        if inner.embed_tokens is not None:
            units.append((inner.embed_tokens, False))
        if getattr(part, "last", False):
            units.append(([inner.norm, lm.lm_head], False))
        units += [(blk, False) for blk in inner.layers]
        units.append((part, None))
    return units


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


class _HeldWork:
    """A fake process group's P2P work that keeps its tensors while it exists, as a real one
    does (gloo's send/recv work holds its tensor; NCCL's work stashes it for its stream), so
    that a sent activation or gradient dies when the schedule drops the work, not before."""

    def __init__(self, work: Any, tensors: list[torch.Tensor]) -> None:
        self.work = work
        self.tensors = tensors

    def wait(self, *a: Any, **k: Any) -> Any:
        return self.work.wait(*a, **k)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


@contextlib.contextmanager
def held_p2p() -> Iterator[None]:
    """Wrap the schedules' P2P works (``schedules._batch_p2p``) in :class:`_HeldWork`."""
    import torch.distributed.pipelining.schedules as sch

    orig = getattr(sch, "_batch_p2p", None)
    if orig is None:  # pragma: no cover - another torch layout: tensors die at the send
        yield
        return

    def batch_p2p(p2p_ops: list[Any], *a: Any, **k: Any) -> list[Any]:
        works = orig(p2p_ops, *a, **k)
        tensors = [op.tensor for op in p2p_ops]
        return [_HeldWork(w, tensors) for w in works]

    sch._batch_p2p = batch_p2p
    try:
        yield
    finally:
        sch._batch_p2p = orig


def p2p_on_meta(group: Any = None) -> None:
    """Let the fake process group (``group``, default the world's) serve sends and receives of
    ``meta`` tensors: batched P2P (``dist.batch_isend_irecv``, the schedules' transport) asks the
    group for the backend of the tensors' device, and the trace's device tensors are ``meta``."""
    import torch.distributed as dist

    pg: Any = group if group is not None else dist.distributed_c10d._get_default_group()
    meta = torch.device("meta")
    with contextlib.suppress(RuntimeError):
        pg._get_backend(meta)
        return
    cuda = torch.device("cuda")
    pg._register_backend(meta, pg._get_backend_type(cuda) if hasattr(pg, "_get_backend_type")
                         else dist.ProcessGroup.BackendType.CUSTOM, pg._get_backend(cuda))


def returns_outputs(schedule: Any) -> bool:
    """Whether ``schedule.step`` takes ``return_outputs`` (torch >= 2.7; before, the last stage's
    outputs were always kept and merged). torchtitan passes ``return_outputs=False``
    (``torchtitan/train.py``, 2025–2026): the logits of each micro-batch are not kept to the step's end."""
    import inspect

    return "return_outputs" in inspect.signature(schedule.step).parameters


def make_runner(model: Chunks, specs: list[StageSpec], *, schedule: str, micro: int,
                microbatches: int, seq: int, hidden: int, vocab: int, act_dtype: torch.dtype,
                out_dtype: torch.dtype, training: bool = True, group: Any = None, tp: int = 1,
                sp: bool = False) -> Callable[[Any, Any], None]:
    """A step runner (``runner(sess, plan)``) that runs this rank's part of one step of ``schedule``.

    ``group``: the pipeline's process group (the mesh's ``pp`` dimension; default the world).
    ``tp``/``sp``: the parts are tensor-parallel (:func:`tensor_parallelise`): the hidden states a
    stage receives and sends are the local ones (``seq / tp`` tokens under ``sp``), the last
    stage's logits its vocabulary shard (the loss-parallel cross-entropy reads them).
    ``training=False``: a forward-only step of one micro-batch (``ScheduleGPipe`` without a loss
    under ``torch.no_grad()``: torch runs no backward when grad mode is off)."""
    from torch.distributed.pipelining import PipelineStage

    cls = schedule_class(schedule if training else "GPipe")
    if not training:
        microbatches = 1
    state: dict[str, Any] = {}
    local = seq // tp if sp else seq

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())

    def stage_of(mod: nn.Module, spec: StageSpec, sess: Any, plan: Any) -> Any:
        meta = torch.device("meta")
        x = (torch.zeros(micro, seq, dtype=torch.long, device=meta) if spec.first
             else torch.zeros(micro, local, hidden, dtype=act_dtype, device=meta))
        y = (torch.zeros(micro, seq, -(-vocab // tp), dtype=out_dtype, device=meta) if spec.last
             else torch.zeros(micro, local, hidden, dtype=act_dtype, device=meta))
        # static shapes; hidden states carry gradients between stages, token ids and logits-to-loss do not
        if not spec.first and training:
            x.requires_grad_(True)
        if not spec.last and training:
            y.requires_grad_(True)
        stage = PipelineStage(mod, spec.index, spec.stages, meta, input_args=(x,), output_args=(y,), group=group)
        fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk

        def forward_one_chunk(*a: Any, **k: Any) -> Any:
            with sess.phase(Phase.FORWARD), sess.autocast_region(plan.autocast):
                return fwd(*a, **k)

        def backward_one_chunk(*a: Any, **k: Any) -> Any:
            with sess.backward():
                return bwd(*a, **k)

        stage.forward_one_chunk = forward_one_chunk  # type: ignore[method-assign]
        stage.backward_one_chunk = backward_one_chunk  # type: ignore[method-assign]
        wgt = getattr(stage, "backward_weight_one_chunk", None)
        if wgt is not None:  # the zero-bubble schedules' separate weight-gradient step

            def backward_weight_one_chunk(*a: Any, **k: Any) -> Any:
                with sess.backward():
                    return wgt(*a, **k)

            stage.backward_weight_one_chunk = backward_weight_one_chunk  # type: ignore[method-assign]
        reduce = getattr(stage, "perform_reduce_grad", None)
        if reduce is not None:  # FSDP's post-backward (reduce-scatter, reshard) after the last micro-batch

            def perform_reduce_grad(*a: Any, **k: Any) -> Any:
                with sess.phase(Phase.BACKWARD):  # (on the main thread, outside autograd)
                    return reduce(*a, **k)

            stage.perform_reduce_grad = perform_reduce_grad  # type: ignore[method-assign]
        return stage

    def build(sess: Any, plan: Any) -> Any:
        stages = [stage_of(mod, spec, sess, plan) for mod, spec in zip(model.parts, specs, strict=True)]
        try:
            loss = loss_fn if training else None
            if len(stages) == 1 and (schedule in ("GPipe", "1F1B") or not training):
                return cls(stages[0], n_microbatches=microbatches, loss_fn=loss)
            return cls(stages, n_microbatches=microbatches, loss_fn=loss)
        except ValueError as e:  # the schedule's own check of micro-batches and stages
            raise TraceError(f"torch's {schedule} refuses this layout: {e}",
                             hint="change `grad_accum` (micro-batches per step) or `pp_virtual`") from None

    first, last = any(sp.first for sp in specs), any(sp.last for sp in specs)

    def run(sess: Any, plan: Any) -> None:
        if "schedule" not in state:
            state["schedule"] = build(sess, plan)
        schedule_ = state["schedule"]
        meta = torch.device("meta")
        with sess.phase(Phase.FORWARD):
            ids = torch.zeros(micro * microbatches, seq, dtype=torch.long, device=meta)
        args = (ids,) if first else ()
        kwargs: dict[str, Any] = {"target": ids, "losses": []} if last and training else {}
        if returns_outputs(schedule_):  # torchtitan's trainer: the last stage keeps no outputs
            kwargs["return_outputs"] = False
        with static_warmup(), held_p2p(), torch.no_grad() if not training else contextlib.nullcontext():
            schedule_.step(*args, **kwargs)
        del ids, args, kwargs
        sess.label_grads(plan.trainable)
        with sess.phase(Phase.OPTIMIZER):
            if plan.optimizer is not None:
                plan.optimizer.step()
                sess.label_optimizer(plan.optimizer)
                plan.optimizer.zero_grad(set_to_none=True)

    return run
