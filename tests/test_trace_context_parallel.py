"""Context parallelism traced with PyTorch's own ring attention on a fake process group (issue 12)."""

from __future__ import annotations

import collections

import pytest

from vramplan import Parallel, Workload, estimate
from vramplan.errors import TraceError
from vramplan.trace.run import trace_workload
from vramplan.trace.testing import tiny_spec
from vramplan.workload import Method, Phase


def _forward_activations(r):
    return [p for p in r.phases if p.phase is Phase.FORWARD][0].breakdown.activations


def test_ring_attention_runs_on_the_local_shard():
    spec = tiny_spec("llama-3.1-8b")
    tr = trace_workload(spec, Workload(task="train", batch=1, seq=512, parallel=Parallel(cp=4)), iterations=1)
    log = tr.events
    ops = collections.Counter(log.strings[log.op[k]] for k in range(len(log)) if log.action[k] == 0)
    # the key/value shards travel around the ring through functional collectives
    assert ops["_c10d_functional.all_to_all_single.default"] > 0 or ops["_c10d_functional.all_gather_into_tensor.default"] > 0
    assert ops["aten._scaled_dot_product_flash_attention_backward.default"] > 0
    assert any("rank 0 of cp=4" in n for n in tr.notes)


def test_activations_shrink_with_the_context_parallel_size_and_states_do_not():
    spec = tiny_spec("llama-3.1-8b")
    one = estimate(spec, Workload(task="train", batch=1, seq=1024), method="trace", search_max_batch=False)
    cp4 = estimate(spec, Workload(task="train", batch=1, seq=1024, parallel=Parallel(cp=4)), method="trace",
                   search_max_batch=False)
    assert cp4.method is Method.TRACE and cp4.fallback is None
    assert 0.2 < _forward_activations(cp4) / _forward_activations(one) < 0.3
    a = estimate(spec, Workload(task="train", batch=1, seq=1024, parallel=Parallel(cp=4)), method="analytic",
                 search_max_batch=False)
    assert (cp4.model_states.gradients, cp4.model_states.optimizer) == (a.model_states.gradients, a.model_states.optimizer)
    assert abs(_forward_activations(cp4) / _forward_activations(a) - 1) < 0.1


@pytest.mark.parametrize("sp", [False, True])
def test_context_with_tensor_parallelism_states_exact_peak_close(sp):
    """TP × CP on a (cp, tp) mesh as torchtitan combines them: the Llama plan on mesh["tp"], ring
    attention on mesh["cp"], the loss-parallel cross-entropy around both."""
    spec = tiny_spec("llama-3.1-8b")
    w = Workload(task="train", batch=2, seq=1024, parallel=Parallel(cp=2, tp=2, sp=sp))
    t = estimate(spec, w, method="trace", search_max_batch=False)
    a = estimate(spec, w, method="analytic", search_max_batch=False)
    assert t.method is Method.TRACE and t.fallback is None
    assert (t.model_states.gradients, t.model_states.optimizer) == (a.model_states.gradients, a.model_states.optimizer)
    assert any("rank 0 of cp=2" in n for n in t.notes) and any("rank 0 of tp=2" in n for n in t.notes)
    assert abs(t.peak.allocated / a.peak.allocated - 1) < 0.1, (t.peak.allocated, a.peak.allocated)
    tp = estimate(spec, w.replace(parallel=Parallel(tp=2, sp=sp)), method="trace", search_max_batch=False)
    assert _forward_activations(t) < 0.6 * _forward_activations(tp)


@pytest.mark.parametrize("extra, match", [
    ({"peft": "qlora", "precision": "bf16-mixed"}, "quantised or QLoRA stages are not traced"),
    ({"peft": "lora", "parallel": Parallel(cp=2, pp=2, dp=2, zero=3)}, "full-weight training; `peft=lora` is not"),
])
def test_context_with_pipeline_parallelism_refuses_the_rest_with_its_cause(extra, match):
    """PP × CP is traced for full-weight training, LoRA and one-pass inference
    (tests/test_trace_pipeline_parallel.py, tests/test_pipeline_gloo.py); QLoRA stages under it, and
    LoRA with FSDP2 on the stages, are refused with their cause, and the analytic method answers."""
    spec = tiny_spec("llama-3.1-8b")
    w = Workload(**{"task": "train", "seq": 256, "grad_accum": 2, "parallel": Parallel(cp=2, pp=2), **extra})
    with pytest.raises(TraceError, match=match):
        estimate(spec, w, method="trace", search_max_batch=False)
    assert estimate(spec, w, search_max_batch=False).method is Method.ANALYTIC


@pytest.mark.parametrize("dp, cp, tp, shard", [(1, 4, 1, 0), (2, 2, 1, 0), (4, 2, 1, 2), (2, 2, 2, 0)])
def test_context_with_fsdp_shards_over_dp_times_cp(dp, cp, tp, shard):
    """CP × FSDP2 as torchtitan runs it (issue 34): fully_shard over the flattened dp × cp mesh
    (HSDP: replicas × that), ring attention on mesh["cp"]; each rank's gradients and optimizer
    states are 1 / (dp_shard × cp), as the analytic method now counts them."""
    spec = tiny_spec("llama-3.1-8b")
    w = Workload(task="train", batch=1, seq=1024,
                 parallel=Parallel(dp=dp, cp=cp, tp=tp, sp=tp > 1, zero=3, dp_shard=shard))
    t = estimate(spec, w, method="trace", search_max_batch=False)
    a = estimate(spec, w, method="analytic", search_max_batch=False)
    assert t.method is Method.TRACE and t.fallback is None
    assert (t.model_states.gradients, t.model_states.optimizer) == (a.model_states.gradients, a.model_states.optimizer)
    assert any("the flattened dp × cp mesh" in n for n in t.notes) and any(f"rank 0 of cp={cp}" in n for n in t.notes)
    assert abs(t.peak.allocated / a.peak.allocated - 1) < 0.05, (t.peak.allocated, a.peak.allocated)


def test_fsdp_one_by_cp_eight_shards_the_states_eightfold():
    """FSDP 1 × CP 8 (torchtitan's long-context layout): the states of Llama-3.1-8B sharded over
    the 8 context-parallel ranks, as FSDP × 8 shards them (they used to be whole: 120 GiB)."""
    from vramplan.models.catalog import resolve

    spec = resolve("llama-3.1-8b")
    cp8 = estimate(spec, Workload(task="train", seq=8192, parallel=Parallel(cp=8, zero=3)), method="analytic",
                   search_max_batch=False)
    dp8 = estimate(spec, Workload(task="train", seq=8192, parallel=Parallel(dp=8, zero=3)), method="analytic",
                   search_max_batch=False)
    assert cp8.model_states == dp8.model_states
    assert cp8.model_states.optimizer == 2 * 4 * spec.params // 8  # AdamW's fp32 states, an eighth each


def test_context_with_ddp_is_refused_with_the_fix():
    with pytest.raises(TraceError, match="context parallelism is traced with FSDP2"):
        estimate(tiny_spec("llama-3.1-8b"), Workload(task="train", seq=256, parallel=Parallel(dp=2, cp=2)),
                 method="trace", search_max_batch=False)


def test_a_trace_after_another_world_does_not_reuse_its_meshes():
    """Two distributed traces in one process (the planner traces several layouts; a library user
    calls estimate() again): DTensor's sharding propagation caches an op's output spec, mesh
    included, and meshes compare by shape and names, so the tp mesh of a (dp=4, tp=2) world
    answered for the tp mesh of a later (dp=2, cp=2, tp=2) one, and its collectives named a
    process group of the destroyed world ("Could not resolve the process group registered under
    the name 3")."""
    spec = tiny_spec("llama-3.1-8b")
    trace_workload(spec, Workload(task="train", batch=1, seq=32, parallel=Parallel(dp=4, tp=2, zero=3)), iterations=1)
    tr = trace_workload(spec, Workload(task="train", batch=1, seq=256,
                                       parallel=Parallel(dp=2, cp=2, tp=2, sp=True, zero=3)), iterations=1)
    assert any("rank 0 of cp=2" in n for n in tr.notes) and any("rank 0 of tp=2" in n for n in tr.notes)


def test_efficient_kernel_chunks_not_a_multiple_of_32_are_refused_with_the_cause(monkeypatch):
    """fp32 attention runs the memory-efficient kernel, whose logsumexp is padded to 32 queries;
    torch's load-balanced ring fails to merge chunks of seq / (2·cp) = 16 tokens. Refused with the
    fix; without the refusal the ring itself fails (so the refusal is torch's, not ours); 32-token
    chunks, and half precision (flash attention), run."""
    from vramplan.trace import context_parallel

    spec = tiny_spec("llama-2-7b")

    def w(seq, precision="fp32"):
        return Workload(task="train", precision=precision, batch=1, seq=seq, parallel=Parallel(cp=2))

    with pytest.raises(TraceError, match=r"`seq` / \(2 × `cp`\) = 16 tokens fail") as e:
        trace_workload(spec, w(64), iterations=1)
    assert "multiple of 128" in e.value.hint
    monkeypatch.setattr(context_parallel, "check_kernel", lambda *a: None)
    with pytest.raises(TraceError, match=r"size of tensor|broadcast"):
        trace_workload(spec, w(64), iterations=1)
    monkeypatch.undo()
    ok = trace_workload(spec, w(128), iterations=1)
    log = ok.events
    ops = {log.strings[log.op[k]] for k in range(len(log)) if log.action[k] == 0}
    assert "aten._scaled_dot_product_efficient_attention_backward.default" in ops
    trace_workload(spec, w(64, "bf16"), iterations=1)


@pytest.mark.parametrize(("seq", "precision", "refused"), [(64, "fp32", True), (128, "fp32", False), (64, "bf16", False)])
def test_the_analytic_method_refuses_the_ring_the_trace_refuses(seq, precision, refused):
    """The analytic method gives no figure for a ring that fails on a GPU (fp32 attention runs the
    memory-efficient kernel; 16-token chunks), and still estimates what the trace runs."""
    from vramplan.analytic import estimate as analytic_estimate
    from vramplan.errors import WorkloadError

    spec = tiny_spec("llama-2-7b")
    w = Workload(task="train", precision=precision, batch=1, seq=seq, parallel=Parallel(cp=2))
    if refused:
        with pytest.raises(WorkloadError, match=r"`seq` / \(2 × `cp`\) = 16 tokens fail") as e:
            analytic_estimate(spec, w)
        assert "multiple of 128" in e.value.hint
        with pytest.raises(TraceError, match="16 tokens fail"):
            trace_workload(spec, w, iterations=1)
    else:
        assert analytic_estimate(spec, w).peak.allocated > 0


def test_a_forward_only_ring_is_traced_on_its_heaviest_rank():
    """Inference under cp: the last cp rank runs only whole-query rounds and peaks highest (rank 0 the
    lightest; real pp × cp runs, tests/test_pipeline_gloo.py): the default trace is that rank's."""
    from vramplan.trace.run import TraceOptions

    spec = tiny_spec("llama-2-7b")
    w = Workload(task="infer", precision="bf16", batch=1, seq=256, parallel=Parallel(cp=4))
    default = trace_workload(spec, w, options=TraceOptions(workspaces=False, count_flops=False))
    assert any("traced as rank 3 of cp=4" in n for n in default.notes), default.notes
    last = trace_workload(spec, w, options=TraceOptions(workspaces=False, count_flops=False, rank=3))
    second = trace_workload(spec, w, options=TraceOptions(workspaces=False, count_flops=False, rank=1))
    assert default.peak_allocated == last.peak_allocated >= second.peak_allocated
