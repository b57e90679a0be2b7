"""Real-run agreement for pipeline schedules: torch.distributed.pipelining runs for real on the
CPU with the gloo backend (2 processes, a tiny Llama, fp32, eager attention) and the trace of
the same layout agree within 0.1 % on each rank's storage peak, for every schedule."""

from __future__ import annotations

import pytest
import torch

from vramplan.trace.testing import pipeline_agreement
from vramplan.workload import PP_SCHEDULES

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


@pytest.mark.parametrize("schedules", [("1F1B", "Interleaved1F1B", "ZBVZeroBubble"),
                                       pytest.param(("GPipe", "LoopedBFS", "InterleavedZeroBubble"),
                                                    marks=pytest.mark.slow)])
def test_gloo_pipeline_run_agrees_with_trace(schedules) -> None:
    assert set(schedules) <= set(PP_SCHEDULES)
    rows = pipeline_agreement(schedules)
    assert {(s, r) for s, r, _, _ in rows} == {(s, r) for s in schedules for r in (0, 1)}
    for schedule, rank, real, traced in rows:
        # sends and receives hold their tensors while the schedule keeps the work (trace.pipeline_parallel)
        assert abs(traced - real) / real < 0.001, (schedule, rank, traced, real)


def test_uneven_stages_agree_with_a_real_run() -> None:
    """Layers that do not divide by the stages (issue 34): torchtitan's split of 7 layers over 3
    stages (the embeddings and the head each count as a layer: 3, 3, 3 → 2, 3, 2 decoder layers),
    every rank traced, each within 0.1 % of the real gloo run of the same cut."""
    from vramplan.workload import Parallel

    assert Parallel(pp=3).stage_bounds(7) == ((0, 2), (2, 5), (5, 7))
    rows = pipeline_agreement(("1F1B",), pp=3, layers=7, microbatches=3)
    assert {r for _, r, _, _ in rows} == {0, 1, 2}
    for schedule, rank, real, traced in rows:
        assert abs(traced - real) / real < 0.001, (schedule, rank, traced, real)


def _agree_to_the_step_counters(rows: list[tuple[str, int, int, int]], schedules: tuple[str, ...]) -> None:
    """Each pipeline rank of each schedule, real against traced: within 0.01 %, and what is left
    is the real run's AdamW ``step`` counters, 4 B per parameter tensor of the rank's stages (9
    per Llama layer, the embeddings on the first stage, the norm and head on the last)."""
    from vramplan.workload import Parallel

    assert {(s, r) for s, r, _, _ in rows} == {(s, r) for s in schedules for r in (0, 1)}
    for schedule, rank, real, traced in rows:
        par = Parallel(pp=2, pp_schedule=schedule)
        bounds = par.stage_bounds(4)
        params = sum(9 * (bounds[i][1] - bounds[i][0]) + (i == 0) + 2 * (i == len(bounds) - 1)
                     for i in par.stage_ids(rank))
        assert real - traced == 4 * params, (schedule, rank, traced, real)
        assert abs(traced - real) / real < 1e-4, (schedule, rank, traced, real)


@pytest.mark.parametrize("schedules, mixed", [(("1F1B", "ZBVZeroBubble"), False), (("1F1B",), True)])
def test_pipeline_with_fsdp2_agrees_with_a_real_run(schedules, mixed) -> None:
    """PP × FSDP2 (issue 34): 4 gloo processes on a (pp 2, dp 2) mesh, each stage's part sharded
    with FSDP2 over dp as torchtitan shards it (``reshard_after_forward=False``; ``mixed``: bf16
    parameters, fp32 reduce), torch's pipeline stage on the pp group, and the trace of the same
    layout: each pipeline rank's peak within 0.01 %, the data-parallel ranks of a pipeline rank
    peaking alike. What is left is itemised: the real run's AdamW ``step`` counters, a 4-byte CPU
    scalar per parameter (19 parameters on rank 0 of 1F1B: the embeddings and 2 layers of 9; 20 on
    rank 1: 2 layers, the norm and the head), which a GPU keeps on the host and the trace does not
    count on the device."""

    rows = pipeline_agreement(schedules, dp=2, mixed=mixed)
    _agree_to_the_step_counters(rows, schedules)


@pytest.mark.parametrize("sp", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_pipeline_with_tensor_parallelism_agrees_with_a_real_run(sp) -> None:
    """PP × TP (issue 34): 4 gloo processes on torchtitan's (pp 2, tp 2) mesh, each stage's part
    tensor-parallelised on tp first (torch's parallelize_module with the trace's plan; ``sp``:
    sequence parallelism, torchtitan's default), torch's pipeline stage on the pp group handing on
    the TP-local hidden states, 1F1B over 4 micro-batches, fp32, the loss-parallel cross-entropy,
    and the trace of the same layout: each pipeline rank's peak within 0.01 %, both tensor-parallel
    ranks of a pipeline rank peaking alike. What is left is itemised as for PP × FSDP2: the real
    run's AdamW ``step`` counters, 4 B per parameter tensor (19 on rank 0: the embeddings and 2
    layers of 9; 20 on rank 1: 2 layers, the norm and the head), host tensors on a GPU."""

    rows = pipeline_agreement(("1F1B",), tp=2, sp=sp)
    _agree_to_the_step_counters(rows, ("1F1B",))


def test_pipeline_with_context_parallelism_agrees_with_a_real_run() -> None:
    """PP × CP (issue 34): 4 gloo processes on torchtitan's (pp 2, cp 2) mesh, each stage on its cp
    rank's half of the sequence, torch's ring attention over cp in every block (the dispatcher
    torchtitan's step runs under, load-balanced rounds), 1F1B over 4 micro-batches, fp32, and the
    trace of the same layout: each pipeline rank's peak (cp rank 0; its cp peer runs the other
    half of each round, no higher) within 0.01 %. The ring's handlers are the CUDA kernels' ops:
    the real run's memory-efficient attention forward and backward are CPU stand-ins with the meta
    kernels' outputs (``testing._efficient_attention_on_cpu``), everything around them real. What
    is left is itemised as for PP × FSDP2: the AdamW ``step`` counters, 4 B per parameter tensor
    (19 on rank 0: the embeddings and 2 layers of 9; 20 on rank 1: 2 layers, the norm and the head)."""

    rows = pipeline_agreement(("1F1B",), cp=2, seq=128)
    _agree_to_the_step_counters(rows, ("1F1B",))


@pytest.mark.parametrize("layout", [{"tp": 2, "sp": True}, {"cp": 2, "seq": 128}], ids=["tp-sp", "cp"])
def test_pipeline_inference_with_tp_or_cp_agrees_with_a_real_run(layout) -> None:
    """One-pass inference under PP × TP and PP × CP (issue 34): 4 gloo processes on torchtitan's
    (pp 2, tp 2) or (pp 2, cp 2) mesh, the tiny Llama in eval mode, fp32, one forward-only
    micro-batch (``ScheduleGPipe`` without a loss, ``step`` under ``torch.no_grad()`` without
    targets); under TP each stage tensor- and sequence-parallel and the last stage's logits its
    vocabulary shard (the head's ``Shard(-1)`` output), under CP torch's ring attention in every
    block (CPU stand-ins for its CUDA kernels, as in training). Each pipeline rank's traced peak
    equals the real one (tensor-parallel rank 0; the heaviest context-parallel rank, the last:
    ``context_parallel.heaviest_rank``): no optimizer, so no ``step`` counters are left over."""

    rows = pipeline_agreement(("GPipe",), training=False, **layout)
    assert {r for _, r, _, _ in rows} == {0, 1}
    for _, rank, real, traced in rows:
        assert traced == real, (layout, rank, traced, real)


@pytest.mark.parametrize("schedules, layout", [(("1F1B",), {}), (("1F1B", "ZBVZeroBubble"), {"cp": 2, "seq": 128})],
                         ids=["pp", "pp-cp"])
def test_lora_pipeline_agrees_with_a_real_run(schedules, layout) -> None:
    """LoRA under PP and under PP × CP (issue 34): 2 or 4 gloo processes, each rank's stage parts
    given peft's LoRA after the split (rank 16 on q/k/v/o, the base frozen, AdamW over the
    adapters), 4 micro-batches, fp32; under CP each stage on its cp rank's half of the sequence with
    torch's ring attention in every block (CPU stand-ins for its CUDA kernels, as for full weights),
    1F1B and the V schedule (its weight gradients apart from the input gradients). Each pipeline
    rank's traced peak (cp rank 0, the heaviest in training) within 0.01 % of the real one; what is
    left is the real run's AdamW ``step`` counters, 4 B per trainable tensor: lora_A and lora_B on 4
    projections of each layer of the rank's stages (2 layers each under 1F1B: 64 B; 1 and 3 under
    ZBVZeroBubble)."""
    from vramplan.workload import LORA_DEFAULT_TARGETS, Parallel

    rows = pipeline_agreement(schedules, lora=True, **layout)
    assert {(s, r) for s, r, _, _ in rows} == {(s, r) for s in schedules for r in (0, 1)}
    for schedule, rank, real, traced in rows:
        par = Parallel(pp=2, pp_schedule=schedule)
        bounds = par.stage_bounds(4)
        layers = sum(bounds[i][1] - bounds[i][0] for i in par.stage_ids(rank))
        assert real - traced == 4 * 2 * len(LORA_DEFAULT_TARGETS) * layers, (schedule, rank, traced, real)
        assert abs(traced - real) / real < 1e-4, (schedule, rank, traced, real)


def test_lora_under_pp_tp_fails_in_transformers_as_the_refusal_says() -> None:
    """LoRA under PP × TP is refused (issue 34) because the Hugging Face stack it would be traced as
    does not run it, checked for real with the installed transformers and peft: on 4 gloo processes
    ``from_pretrained(distributed_config=DistributedConfig(pp_size=2, tp_size=2))`` raises KeyError on
    every rank (the tensor-parallel plan names the layers the pipeline split removed); on 2 (pp alone)
    the model loads, peft's adapters are built, the output has no loss, the first stage's backward
    fails (its logits are a broadcast buffer outside autograd) and only the last stage's adapters
    get gradients. When a new version trains it, this fails: trace it then."""
    from vramplan.errors import TraceError
    from vramplan.trace.run import trace_workload
    from vramplan.trace.testing import real_lora_pp_tp_outcomes, tiny_spec
    from vramplan.workload import Parallel, Workload

    targets = ("q_proj", "v_proj")  # (column-sharded: peft trains them under transformers' TP alone)
    for got in real_lora_pp_tp_outcomes("llama-2-7b", pp=2, tp=2, batch=2, seq=32, targets=targets):
        assert got["load"].startswith("KeyError: 'model."), got
    first, last = real_lora_pp_tp_outcomes("llama-2-7b", pp=2, tp=1, batch=2, seq=32, targets=targets)
    assert first["load"] == last["load"] == "" and not first["loss"] and not last["loss"], (first, last)
    assert "does not require grad" in first["backward"] and first["with_grad"] == 0 < first["adapters"], first
    assert last["backward"] == "" and last["with_grad"] == last["adapters"] > 0, last
    w = Workload(task="train", precision="fp32", batch=2, seq=32, grad_accum=2, peft="lora", lora_targets=targets,
                 parallel=Parallel(pp=2, tp=2))
    with pytest.raises(TraceError, match=r"does not load .*KeyError.*forward-only"):
        trace_workload(tiny_spec("llama-2-7b"), w, iterations=1)
