"""Real-run agreement: FSDP2 and DDP run for real on the CPU with the gloo backend (2
processes) and the trace of the same layout agree within 1 % on each rank's storage peak
(FSDP1 and tensor-parallel generation more closely)."""

from __future__ import annotations

import pytest
import torch

from vramplan.trace.testing import dist_agreement

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


def test_gloo_run_agrees_with_trace() -> None:
    rows = dist_agreement(world=2)
    assert {(layout, rank) for layout, rank, _, _ in rows} == {("fsdp2", 0), ("fsdp2", 1), ("ddp", 0), ("ddp", 1)}
    for layout, rank, real, traced in rows:
        assert abs(traced - real) / real < 0.01, (layout, rank, traced, real)


@pytest.mark.parametrize("strategy, zero, world, shard, mixed, width, prefetch, lora", [
    ("FULL_SHARD", 3, 2, 0, False, 128, "backward-pre", ()),
    ("FULL_SHARD", 3, 2, 0, False, 128, "none", ("up", "down")),  # peft's LoRA, peft's wrap policy
    ("SHARD_GRAD_OP", 2, 2, 0, False, 128, "backward-post", ()),
    ("NO_SHARD", 0, 2, 0, False, 128, "none", ()),
    ("FULL_SHARD", 3, 2, 0, True, 100, "backward-pre", ()),  # bf16 MixedPrecision + autocast; padded flat params
    ("HYBRID_SHARD", 3, 4, 2, False, 128, "none", ()),  # 2 replicas × shard groups of 2
])
def test_fsdp1_gloo_run_agrees_with_trace(strategy, zero, world, shard, mixed, width, prefetch, lora) -> None:  # noqa: ANN001
    """FSDP1 (``FullyShardedDataParallel``: flat parameters per unit, ``use_orig_params``) run for
    real on ``world`` gloo processes and traced as ``engine=fsdp1`` on the fake process group:
    each rank's storage peak within 0.01 % (issue 34's bar; what is left, tens of bytes, is not
    itemised)."""
    from functools import partial

    from vramplan.trace.run import TraceOptions, trace_model
    from vramplan.trace.testing import block_inputs, block_model, real_dist_peaks
    from vramplan.workload import Precision, Task, Workload

    make, inputs = partial(block_model, width), partial(block_inputs, width)
    torch_prefetch = "" if prefetch == "none" else "-" + prefetch.upper().replace("-", "_")
    real = real_dist_peaks(make, inputs, world=world, layout=f"fsdp1-{strategy}{torch_prefetch}", mixed=mixed,
                           lora=lora)
    peft = {"peft": "lora", "lora_targets": lora} if lora else {}
    w = Workload(task=Task.TRAIN, precision=Precision.BF16_MIXED if mixed else Precision.FP32, **peft).replace(
        dp=world, zero=zero, engine="fsdp1", dp_shard=shard, fsdp1_prefetch=prefetch)
    for rank, peak in enumerate(real):
        r = trace_model(make, inputs(), workload=w, options=TraceOptions(workspaces=False, count_flops=False, rank=rank))
        assert abs(r.peak_allocated - peak) / peak < 1e-4, (rank, r.peak_allocated, peak)
        assert any(f"FSDP1 ({strategy})" in n for n in r.notes)


@pytest.mark.parametrize("strategy, zero, mixed, lora", [
    ("FULL_SHARD", 3, False, ("up", "down")),  # the frozen root: resharded by the catch-all at backward's end
    ("SHARD_GRAD_OP", 2, False, ("up", "down")),
    ("FULL_SHARD", 3, True, ()),
])
def test_fsdp1_gloo_run_agrees_with_trace_by_phase(strategy, zero, mixed, lora) -> None:  # noqa: ANN001
    """FSDP1 run for real on 2 gloo processes and traced: each rank's forward, backward and
    optimizer-step peaks within 0.01 %. The optimizer step is where a frozen unit that no
    post-backward hook resharded (under LoRA the root: its input needs no gradient) must be
    freed, by ``_catch_all_reshard`` at backward's end; its data-pointer test reads 0 on
    ``meta`` for both tensors, and the trace kept the root gathered (3.71 MB where the real run
    has 2.00 MB, fp32 LoRA) until ``trace.dist._already_resharded`` tested by storage. (LoRA
    under bf16-mixed is left out: the trace stores the frozen base in bf16, the usual recipe,
    where this run builds it in fp32.)"""
    from functools import partial

    from vramplan.trace.run import TraceOptions, trace_model
    from vramplan.trace.testing import block_inputs, block_model, real_dist_phase_peaks
    from vramplan.workload import Precision, Task, Workload

    make, inputs = partial(block_model, 128), partial(block_inputs, 128)
    real = real_dist_phase_peaks(make, inputs, world=2, layout=f"fsdp1-{strategy}", mixed=mixed, lora=lora)
    peft = {"peft": "lora", "lora_targets": lora} if lora else {}
    w = Workload(task=Task.TRAIN, precision=Precision.BF16_MIXED if mixed else Precision.FP32, **peft).replace(
        dp=2, zero=zero, engine="fsdp1", fsdp1_prefetch="none")
    for rank, peaks in enumerate(real):
        r = trace_model(make, inputs(), workload=w, options=TraceOptions(workspaces=False, count_flops=False, rank=rank))
        traced = {p.phase.value: p.allocated for p in r.phases}
        for phase in ("forward", "backward", "optimizer"):
            assert abs(traced[phase] - peaks[phase]) / peaks[phase] < 1e-4, (rank, phase, traced[phase], peaks[phase])


def test_tensor_parallel_generation_gloo_run_agrees_with_trace() -> None:
    """A tiny Llama (bf16) generating 4 tokens greedily from a 64-token prompt, sharded over 2
    gloo processes with the trace's TP plan, and the trace of the same workload on each rank:
    every forward's storage peak (the prefill, each decode step) within 0.1 % (what is left is
    32 B, as at tp=1: the rotary ``inv_freq`` / ``original_inv_freq`` buffers, float32 in the
    built model, bfloat16 in the trace).

    The real run leaves out functional collectives' ``AsyncCollectiveTensor`` wrappers (their CPU
    storage has the wrapped output's size and no memory: no data pointer; with CUDA no
    allocation either), which the bare measurement counted: 16 KiB more at the prefill's peak
    (the embeddings' all-reduced output, alive as ``inputs_embeds`` through the forward, and
    ``down_proj``'s). The trace used to over-count the same wrapper the other way, by running
    its meta kernel (``empty_like``) as a second buffer (7.5 KiB above at the prefill); it is an
    alias now (``trace.dispatch.WRAP_OP``). See :func:`~vramplan.trace.testing.
    real_tp_generate_peaks` for the sharding propagator's reference cycle, broken in both.

    The real run waits, at each collective's ``wait_tensor``, for gloo's worker thread to drop
    the work as well (``StoragePeak.await_collectives``). Without it the test failed now and
    then on a loaded machine (``pytest -n 2``: rank 0, decode step 3, 119,128 B real for
    118,968 traced; reproduced with both processes on one core, ``taskset -c 0``: 1 run in 8
    had 8 KiB more at the prefill, a second ``[1, 64, 64]`` all-reduce output alive at the
    peak): ``ProcessGroupGloo::runLoop`` completes the work's future, which ends the wait, and
    releases its own references to the work (which holds the all-reduced tensor) only once it
    is scheduled again, so a residual the model had already dropped stayed allocated into the
    next layer's allocations: one token's hidden state (128 B) in a decode step, 64 tokens'
    (8 KiB) at the prefill. A CUDA collective frees it when the caller does; the trace too."""
    from vramplan.trace.run import TraceOptions, trace_workload
    from vramplan.trace.testing import forward_peaks, real_tp_generate_peaks, tiny_spec
    from vramplan.workload import Parallel, Workload

    real = real_tp_generate_peaks("llama-3.1-8b", tp=2, prompt=64, new_tokens=4)
    w = Workload(task="generate", precision="bf16", batch=1, seq=64, new_tokens=4, parallel=Parallel(tp=2))
    for rank, peaks in enumerate(real):
        opts = TraceOptions(extrapolate_decode=False, workspaces=False, count_flops=False, rank=rank)
        traced = forward_peaks(trace_workload(tiny_spec("llama-3.1-8b"), w, options=opts, iterations=1).events)
        assert len(traced) == len(peaks) == 4, (traced, peaks)
        for step, (t, p) in enumerate(zip(traced, peaks, strict=True)):
            assert abs(t - p) / p < 1e-3, (rank, step, t, p)


def _parts_after_first_step(r) -> tuple[int, int, int]:  # noqa: ANN001
    """(parameter, gradient, optimizer-state) bytes live at the first optimizer step's last
    allocation (every state made, the gradients not yet zeroed)."""
    import numpy as np

    from vramplan.events import Category
    from vramplan.trace import analysis
    from vramplan.workload import Phase

    a = analysis.arrays(r.events)
    k = int(np.nonzero((a.phase == list(Phase).index(Phase.OPTIMIZER)) & (a.iteration == 1) & (a.delta > 0))[0][-1])
    live = analysis.live_at(a, k)
    return tuple(int(a.delta[live][a.cat[live] == int(c)].sum())  # type: ignore[return-value]
                 for c in (Category.PARAMETER, Category.GRADIENT, Category.OPTIMIZER_STATE))


def test_lora_under_tensor_parallelism_gloo_run_agrees_with_trace() -> None:
    """LoRA under transformers' tensor parallelism, as a transformers + peft user runs it
    (``from_pretrained(distributed_config=DistributedConfig(tp_size=2))``, ``get_peft_model``,
    AdamW over the adapters in one group per device mesh as transformers' Trainer makes them),
    run for real on 2 gloo processes and traced on the fake process group, per rank: the storage
    peak within 0.01 % (979,304 B traced, 979,352 B real: the 20 AdamW ``step`` scalars of 4 B, host
    tensors on a GPU, counted on the CPU, less the efficient kernel's two 8-byte RNG outputs per
    layer, which the CPU's kernel does not make); the parameters, gradients and optimizer states at
    the first step exactly.

    A tiny Llama-2 (multi-head attention): with grouped-query attention (Llama-3) the trace
    models CUDA's fp32 SDPA, the memory-efficient kernel, which takes no GQA (k and v expanded to
    the query heads and saved, +16 KiB here), where the CPU's flash kernel takes it natively."""
    from vramplan.trace.run import TraceOptions, trace_workload
    from vramplan.trace.testing import real_lora_tp_peaks, tiny_spec
    from vramplan.workload import Parallel, Workload

    targets = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # the column-sharded linears
    real = real_lora_tp_peaks("llama-2-7b", tp=2, batch=2, seq=32, targets=targets)
    w = Workload(task="train", precision="fp32", batch=2, seq=32, peft="lora", lora_targets=targets,
                 parallel=Parallel(tp=2))
    for rank, got in enumerate(real):
        r = trace_workload(tiny_spec("llama-2-7b"), w,
                           options=TraceOptions(workspaces=False, count_flops=False, rank=rank))
        assert abs(r.peak_allocated - got["peak"]) / got["peak"] < 1e-4, (rank, r.peak_allocated, got)
        assert _parts_after_first_step(r) == (got["weights"], got["gradients"], got["optimizer"]), rank
        assert any(f"rank {rank} of tp=2 with transformers' own tp_plan" in n for n in r.notes)


def test_lora_under_tensor_parallelism_of_a_tied_model_gloo_run_agrees_with_trace() -> None:
    """LoRA under transformers' tensor parallelism on a model whose head is tied to its embeddings
    (Llama-3.2-1B's ``tie_word_embeddings``): ``from_pretrained`` shards the model untied and ties
    it after loading, so the head and the embeddings share one vocabulary-sharded parameter; the
    trace failed with ``KeyError: 'lm_head.weight'`` (issue 34). Per rank against the real 2-process
    gloo run, with the same known difference as the untied test above (946,536 B traced,
    946,584 B real: 20 AdamW ``step`` scalars, less 2 RNG outputs of 8 B per layer), the
    parameters, gradients and optimizer states at the first step exactly.

    The tiny Llama-3.2-1B with multi-head attention (4 kv heads), for the reason the untied test
    gives: the trace models CUDA's fp32 SDPA, which takes no GQA, where the CPU's kernel does."""
    from vramplan.models.catalog import resolve
    from vramplan.models.normalize import spec_from_config
    from vramplan.trace.run import TraceOptions, trace_workload
    from vramplan.trace.testing import real_lora_tp_peaks, tiny_config
    from vramplan.workload import Parallel, Workload

    base = resolve("llama-3.2-1b")
    cfg = {**tiny_config(dict(base.config)), "num_key_value_heads": 4}
    spec = spec_from_config(cfg, name="tiny-llama-3.2-1b-mha", source=f"tiny copy of {base.source}, 4 kv heads")
    assert spec.tie_embeddings and spec.kv_heads == spec.heads
    targets = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    real = real_lora_tp_peaks(spec, tp=2, batch=2, seq=32, targets=targets)
    w = Workload(task="train", precision="fp32", batch=2, seq=32, peft="lora", lora_targets=targets,
                 parallel=Parallel(tp=2))
    for rank, got in enumerate(real):
        r = trace_workload(spec, w, options=TraceOptions(workspaces=False, count_flops=False, rank=rank))
        assert abs(r.peak_allocated - got["peak"]) / got["peak"] < 1e-4, (rank, r.peak_allocated, got)
        assert _parts_after_first_step(r) == (got["weights"], got["gradients"], got["optimizer"]), rank
        assert any("`lm_head.weight` to `model.embed_tokens.weight`" in n for n in r.notes), r.notes


def test_lora_under_tp_with_fsdp_fails_in_the_real_stacks_as_the_refusal_says() -> None:
    """LoRA × TP × FSDP2 (dp 2 × tp 2), run for real on 4 gloo processes with the installed
    transformers / peft / accelerate: accelerate's ND-parallel load cannot build its mesh, and
    transformers' own TP × FSDP2 load with peft's adapters fails in the LoRA forward — the causes
    the trace's refusal names (docs/research/lora-under-tp.md). When a new version trains it,
    this fails: trace it then."""
    from vramplan.errors import TraceError
    from vramplan.trace.run import trace_workload
    from vramplan.trace.testing import real_lora_tp_fsdp_failures, tiny_spec
    from vramplan.workload import Parallel, Workload

    real = real_lora_tp_fsdp_failures("llama-2-7b", dp=2, tp=2, batch=2, seq=32, targets=("q_proj", "v_proj"))
    for got in real:
        assert "The parallel mesh requires 2 processes, but world_size is 4" in got["accelerate"], got
        assert "RuntimeError: shape '[2, 32, 32]' is invalid for input of size 1024" == got["transformers"], got
    with pytest.raises(ImportError):  # what accelerate 1.16's prepare() imports under TP × FSDP2
        from transformers.integrations.tensor_parallel import ReplicateParallel  # noqa: F401
    w = Workload(task="train", precision="fp32", batch=2, seq=32, peft="lora", lora_targets=("q_proj", "v_proj"),
                 parallel=Parallel(dp=2, tp=2, zero=3))
    with pytest.raises(TraceError, match=r"world_size is 4.*ReplicateParallel.*shape \.\.\. is invalid"):
        trace_workload(tiny_spec("llama-2-7b"), w, iterations=1)
