"""FSDP2 and DDP traced per rank on the fake process group, against the analytic figures.

Exact: each rank's parameters, gradients and optimizer states at the optimizer step (FSDP2
shards are 1/dp of every weight: Llama's dimensions divide 8 and 64 so no padding). Within a
tolerance: the peak, whose activations and temporaries the analytic model writes per layer.
"""

from __future__ import annotations

import pytest

from test_trace_agreement import _optimizer_states, _small, estimate
from test_trace_pipeline_parallel import _llama
from vramplan import estimate as estimate_report
from vramplan.errors import TraceError
from vramplan.events import Action, Category
from vramplan.models.catalog import resolve
from vramplan.trace.run import TraceOptions, trace_workload
from vramplan.workload import Method, Parallel, Phase, Workload

FAST = TraceOptions(count_flops=False)


def _w(**parallel: int) -> Workload:
    return Workload(task="train", batch=1, seq=64, precision="bf16-mixed").replace(**parallel)


@pytest.mark.parametrize("parallel", [{"dp": 8, "zero": 3}, {"dp": 64, "zero": 3}, {"dp": 8}],
                         ids=["fsdp2-8", "fsdp2-64", "ddp-8"])
def test_small_llama_states_exact_peak_close(parallel: dict[str, int]) -> None:
    spec = _small("llama-3.1-8b")
    w = _w(**parallel).replace(batch=2, seq=256)
    r = trace_workload(spec, w)
    a = estimate(spec, w)
    assert _optimizer_states(r) == (a.states.weights, a.states.gradients, a.states.optimizer)
    assert abs(r.peak_allocated - a.peak.allocated) / a.peak.allocated < 0.08, (r.peak_allocated, a.peak.allocated)


CATALOG = [
    ("llama-3.1-8b", {"dp": 8, "zero": 3}),
    ("llama-3.1-8b", {"dp": 64, "zero": 3}),
    ("llama-3.1-8b", {"dp": 8}),
    ("llama-3.1-70b", {"dp": 64, "zero": 3}),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "parallel"), CATALOG, ids=[f"{n}-{'-'.join(map(str, p.values()))}" for n, p in CATALOG])
def test_catalog_llama_states_equal_analytic(name: str, parallel: dict[str, int]) -> None:
    spec = resolve(name)
    w = _w(**parallel)
    r = trace_workload(spec, w, iterations=1, options=FAST)
    a = estimate(spec, w)
    assert _optimizer_states(r) == (a.states.weights, a.states.gradients, a.states.optimizer)


def test_llama_8b_fsdp2_states_equal_analytic() -> None:
    """The catalog 8B at 8 ranks (not marked slow: one short FSDP2 trace)."""
    spec = resolve("llama-3.1-8b")
    w = _w(dp=8, zero=3)
    r = trace_workload(spec, w, iterations=1, options=FAST)
    a = estimate(spec, w)
    assert _optimizer_states(r) == (a.states.weights, a.states.gradients, a.states.optimizer)
    assert any("FSDP2 (ZeRO-3 / FULL_SHARD) over dp=8: fully_shard on 32 blocks" in n for n in r.notes)


def test_fsdp2_comm_buffers_live_on_their_streams() -> None:
    """FSDP2 (torch 2.13 _fsdp_collectives.py): the flat all-gather buffers (and the 16-bit
    casts of the shards) are allocated on the all-gather copy-in stream, the unsharded
    parameters are copied out on the default stream, and the reduce-scattered gradient shards
    are allocated on the reduce-scatter stream."""
    spec = _small("llama-3.1-8b")
    r = trace_workload(spec, _w(dp=8, zero=3), iterations=1, options=FAST)
    log = r.events
    rows = [(log.stream[k], Category(log.category[k]), log.phase[k]) for k in range(len(log))
            if log.action[k] == Action.ALLOC and log.size[k]]
    gathered = {s for s, c, ph in rows if c is Category.PARAMETER and ph != 0}
    assert gathered == {0}
    side = {s for s, c, ph in rows if s != 0}
    assert len(side) == 2  # all-gather copy-in and reduce-scatter
    grads = {s for s, c, _ in rows if c is Category.GRADIENT}
    ag = {s for s, c, ph in rows if s != 0 and c is Category.TEMPORARY}
    assert len(grads) == 1 and len(ag) == 1 and grads != ag and grads | ag == side
    assert {ph for s, _, ph in rows if s in ag} == {1, 2}  # gathered again in backward


def test_zero2_keeps_parameters_gathered_until_backward() -> None:
    if not hasattr(Parallel, "engine"):
        pytest.skip("`engine` (fsdp for ZeRO-2) not in this tree")
    spec = _small("llama-3.1-8b")
    z3 = trace_workload(spec, _w(dp=8, zero=3).replace(engine="fsdp"), iterations=1, options=FAST)
    z2 = trace_workload(spec, _w(dp=8, zero=2).replace(engine="fsdp"), iterations=1, options=FAST)
    assert any("SHARD_GRAD_OP" in n for n in z2.notes)
    fwd = {p.phase: p.breakdown.weights for p in z2.phases}
    fwd3 = {p.phase: p.breakdown.weights for p in z3.phases}
    assert max(fwd.values()) > max(fwd3.values())


def test_untraced_engines_are_refused() -> None:
    spec = _small("llama-3.1-8b")
    with pytest.raises(TraceError, match="DeepSpeed ZeRO-2 is not traced"):
        trace_workload(spec, _w(dp=8, zero=2), iterations=1)
    with pytest.raises(TraceError, match="offload"):  # (FSDP2's CPUOffloadPolicy is traced: test_trace_fsdp_offload)
        trace_workload(spec, _w(dp=8, zero=3, offload_optimizer=True), iterations=1)


def test_world_size_costs_nothing() -> None:
    """Rank 0 of 8 and of 1,024: the same events, only the shard sizes differ."""
    spec = _small("llama-3.1-8b")
    small = trace_workload(spec, _w(dp=8, zero=3), iterations=1, options=FAST)
    big = trace_workload(spec, _w(dp=1024, zero=3), iterations=1, options=FAST)

    def shape(r) -> list[tuple[int, int]]:
        log = r.events
        return [(log.action[k], log.stream[k]) for k in range(len(log)) if log.size[k] or log.action[k] != Action.ALLOC]

    assert len(shape(big)) == pytest.approx(len(shape(small)), rel=0.02)
    # (FSDP pads each weight to a multiple of the world size: 256 rows over 1,024 ranks is 1 row each)
    assert _optimizer_states(big)[2] * 32 < _optimizer_states(small)[2]


def test_ddp_bucket_view_keeps_one_copy_of_the_gradients() -> None:
    spec = _small("llama-3.1-8b")
    w = _w(dp=8).replace(batch=2, seq=256)
    view = w.replace(gradient_as_bucket_view=True)
    rv = trace_workload(spec, view, iterations=1, options=FAST)
    a, av = estimate(spec, w), estimate(spec, view)
    assert _optimizer_states(rv) == (av.states.weights, av.states.gradients, av.states.optimizer)
    assert any("gradient_as_bucket_view=True" in n for n in rv.notes)
    opt = {p.phase.value: p.breakdown.gradients for p in a.phases}["optimizer"]
    opt_view = {p.phase.value: p.breakdown.gradients for p in av.phases}["optimizer"]
    assert opt == 2 * opt_view == 2 * av.states.gradients  # buckets beside the gradients, or holding them
    traced = {p.phase.value: p.breakdown.gradients for p in rv.phases}
    assert traced["forward"] == traced["optimizer"] == av.states.gradients  # the buckets live all along


def test_bucket_cap_is_validated() -> None:
    from vramplan.errors import WorkloadError

    with pytest.raises(WorkloadError, match="bucket_cap_mb"):
        Parallel(dp=2, bucket_cap_mb=0)


def test_hsdp_shards_within_the_group_and_replicates_across() -> None:
    """HSDP on a 2-D mesh (2 replicas × 4 shards): each rank holds 1/4 of the states."""
    import torch
    from torch import nn

    from vramplan.target import DEFAULT_PROFILE
    from vramplan.trace.dist import World, rank_session
    from vramplan.trace.layout import Layout, apply_layout
    from vramplan.trace.session import TraceSession

    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(64, 64, bias=False) for _ in range(3)))
    layout = Layout(World((("dp_replicate", 2), ("dp", 4)), rank=5), "fsdp2")
    sess = TraceSession(DEFAULT_PROFILE)
    with rank_session(sess, layout.world) as ctx:
        _, notes = apply_layout(model, layout, ctx, Workload(task="train", precision="fp32"), torch.float32)
        shards = [p.to_local().shape for p in model.parameters()]
        x = torch.empty(4, 64, device="meta")
        model(x).sum().backward()  # the replicas' all-reduce runs on its own stream
        assert all(p.grad is not None and p.grad.to_local().shape == (16, 64) for p in model.parameters())
    log = sess.rec.log
    assert len({log.stream[k] for k in range(len(log)) if log.size[k]}) >= 3
    assert shards == [(16, 64)] * 3
    assert "HSDP: 2 replicas × shards over 4" in notes[0]


@pytest.mark.parametrize("kw", [{"peft": "lora"}, {"precision": "bf16"}, {"precision": "fp32"},
                                {"checkpointing": "full"}, {"grad_accum": 2}],
                         ids=["lora", "bf16", "fp32", "full-ckpt", "accum2"])
def test_fsdp2_states_exact_across_workload_features(kw: dict) -> None:
    spec = _small("llama-3.1-8b")
    w = Workload(**{"task": "train", "batch": 2, "seq": 128, "precision": "bf16-mixed", **kw}).replace(dp=8, zero=3)
    r = trace_workload(spec, w, iterations=1, options=FAST)
    a = estimate(spec, w)
    assert _optimizer_states(r) == (a.states.weights, a.states.gradients, a.states.optimizer)


def _buffers_at_step(r) -> int:
    from vramplan.trace import analysis
    from vramplan.workload import Phase

    a = analysis.arrays(r.events)
    k = analysis.peak_of(a, (a.phase == list(Phase).index(Phase.OPTIMIZER)) & (a.iteration == 1))
    live = analysis.live_at(a, k)
    return int(a.delta[live][a.cat[live] == int(Category.BUFFER)].sum())


@pytest.mark.parametrize("kw", [{}, {"precision": "bf16"}, {"bnb_single_quant": True}], ids=["mixed", "bf16", "single"])
def test_fsdp_qlora_weights_per_rank_equal_analytic(kw: dict) -> None:
    """FSDP-QLoRA (accelerate / HF: bnb Params4bit with bnb_4bit_quant_storage = the gather dtype):
    each rank holds 1/dp of the packed 4-bit weights and of the other parameters, and the whole
    quant state (absmax, codes), which is no parameter. The analytic figure used to divide the
    quant state too; the trace used to keep the packed weights whole (buffers are not sharded)."""
    spec = _small("llama-3.1-8b")
    w = Workload(**{"task": "train", "batch": 2, "seq": 128, "precision": "bf16-mixed", "peft": "qlora",
                    "quant": "nf4", **kw}).replace(dp=8, zero=3)
    r = trace_workload(spec, w, iterations=1, options=FAST)
    plain = trace_workload(spec, w.replace(quant="none", peft="lora"), iterations=1, options=FAST)
    a = estimate(spec, w)
    params, grads, states = _optimizer_states(r)
    quant_state = _buffers_at_step(r) - _buffers_at_step(plain)  # (the rotary buffers of both)
    assert params + quant_state == a.states.weights
    assert (grads, states) == (a.states.gradients, a.states.optimizer)
    assert 0 < quant_state < params  # absmax + codes, replicated on every rank
    assert any("bnb_4bit_quant_storage" in n for n in r.notes)


FSDP2_PEAKS = [  # seq, dp; Llama-3.1-8B's width with 4 layers, bf16-mixed (MixedPrecisionPolicy(param_dtype=bf16))
    # the loss's backward peaks: the root unit gathered again, the last block's all-gather output that the
    # root's pre-backward prefetches, the loss's fp32 log-softmax output and gradients
    (2048, 4),
    # the root unit's post-backward peaks: its 16-bit gradients beside the fp32 reduce-scatter input
    (1024, 8),
    # a moment later at dp 2: the reduce-scatter output (the root's gradient shard) beside the input and the
    # head's 16-bit gradient, which foreach_reduce's loop variable keeps (it was 0.949 of the trace)
    (1024, 2),
]


@pytest.mark.parametrize("seq, dp", FSDP2_PEAKS)
def test_fsdp2_analytic_peak_is_the_traces(seq: int, dp: int) -> None:
    """FSDP2 ZeRO-3 under mixed precision (issue 34): the analytic method's peak and temporaries at it
    within 1 % of the trace's (docs/research/pipeline-fsdp.md, FSDP2 mixed precision) — the norms'
    16-bit outputs, the prefetched all-gather, the root's reduce-scatter — and the forward's too where
    the loss ends it (the last block's all-gather output kept until the root's post-forward)."""
    spec = _llama(4)
    w = Workload(task="train", batch=1, seq=seq, precision="bf16-mixed", parallel=Parallel(dp=dp, zero=3))
    t = estimate_report(spec, w, method="trace", search_max_batch=False)
    a = estimate_report(spec, w, method="analytic", search_max_batch=False)
    assert t.method is Method.TRACE and a.method is Method.ANALYTIC
    assert a.peak.allocated == pytest.approx(t.peak.allocated, rel=0.01)
    assert a.breakdown.temporaries == pytest.approx(t.breakdown.temporaries, rel=0.01)
    if dp == 4:
        tf, af = ([p.allocated for p in r.phases if p.phase is Phase.FORWARD][0] for r in (t, a))
        assert af == pytest.approx(tf, rel=0.01)
    else:  # the root's reduce-scatter: both threads' cuBLAS workspaces (the forward's stays cached), 0.9985 with one
        assert a.breakdown.temporaries == pytest.approx(t.breakdown.temporaries, rel=5e-4)


def _tied_llama(layers: int):
    """Llama-3.2-1B (its head tied to the embeddings) with ``layers`` layers."""
    from vramplan.models.normalize import spec_from_config

    spec = resolve("llama-3.2-1b")
    return spec_from_config({**spec.config, "num_hidden_layers": layers}, name=f"llama-3.2-1b-{layers}-layers",
                            source=spec.source)


@pytest.mark.parametrize("peft, seq", [("lora", 512), ("none", 2048), ("none", 512)])
def test_fsdp2_analytic_gathers_a_tied_root_once(peft: str, seq: int) -> None:
    """FSDP2 ZeRO-3, a head tied to the embeddings (issue 34): the root unit (embeddings = head, final
    norm) is gathered once, beside the running block, not 2 x the largest unit (the analytic weights at
    the peak were the trace's + the whole table, 1.30 / 1.08 of the trace's peak); under LoRA the adapters
    are gathered in param_dtype, so PEFT casts no input copy for them. Weights equal but the rotary
    buffers, the peak within 1 %. At seq 512 the peak is the embeddings' backward, where the first block's
    reduce-scatter input, kept until the root's post-backward, sits beside the three tables (0.938 without)."""
    spec = _tied_llama(4)
    w = Workload(task="train", batch=1, seq=seq, peft=peft, parallel=Parallel(dp=4, zero=3))
    t = estimate_report(spec, w, method="trace", search_max_batch=False)
    a = estimate_report(spec, w, method="analytic", search_max_batch=False)
    assert 0 <= t.breakdown.weights - a.breakdown.weights <= 1024
    assert a.peak.allocated == pytest.approx(t.peak.allocated, rel=0.01)


def _untied_llama(layers: int):
    """Llama-3.1-8B's width (an untied head) with ``layers`` layers."""
    from vramplan.models.normalize import spec_from_config

    spec = resolve("llama-3.1-8b")
    return spec_from_config({**spec.config, "num_hidden_layers": layers}, name=f"llama-3.1-8b-{layers}-layers",
                            source=spec.source)


@pytest.mark.parametrize("dp", [4, 8])
def test_fsdp2_zero2_embeddings_backward_holds_only_the_root_gathered(dp: int) -> None:
    """FSDP2 ZeRO-2 (``reshard_after_forward=False``), a tied head: each block's post-backward reshards it
    all the same (``reshard`` returns early only in the forward), so at the embeddings' backward only the
    root unit is gathered beside the shards. The analytic instant counted every block still gathered
    (1.117 / 1.147 of the trace's peak at dp 4 / 8). Weights at the peak equal but the rotary buffers;
    the peak within 1 % (0.9990 / 0.9969)."""
    spec = _tied_llama(4)
    w = Workload(task="train", batch=1, seq=512, parallel=Parallel(dp=dp, zero=2, engine="fsdp"))
    t = estimate_report(spec, w, method="trace", search_max_batch=False)
    a = estimate_report(spec, w, method="analytic", search_max_batch=False)
    assert 0 <= t.breakdown.weights - a.breakdown.weights <= 1024, (a.breakdown, t.breakdown)
    assert a.peak.allocated == pytest.approx(t.peak.allocated, rel=0.01)


@pytest.mark.parametrize("zero, dp", [(3, 2), (2, 8)])
def test_fsdp2_first_block_gathers_beside_the_roots_all_gather_output(zero: int, dp: int) -> None:
    """FSDP2, LoRA on an untied 8B-wide model: each step's forward gathers the root unit (embeddings and
    head, frozen but sharded), then the first block, and the root's all-gather output outlives the block's
    copy-out (``wait_for_unshard``'s local reference), so the forward peaks there: the shards, both units'
    parameters and both all-gather outputs. The analytic forward lacked that instant (0.754 / 0.979 of the
    trace's peak with full checkpointing); now weights equal but the rotary buffers, the peak within 0.5 %
    (0.9991 / 0.9989; the trace's all-gather output is padded a few KiB more)."""
    spec = _untied_llama(4)
    w = Workload(task="train", batch=1, seq=512, peft="lora", checkpointing="full",
                 parallel=Parallel(dp=dp, zero=zero, engine="fsdp"))
    t = estimate_report(spec, w, method="trace", search_max_batch=False)
    a = estimate_report(spec, w, method="analytic", search_max_batch=False)
    tf, af = ([p for p in r.phases if p.phase is Phase.FORWARD][0] for r in (t, a))
    assert 0 <= tf.breakdown.weights - af.breakdown.weights <= 1024, (af.breakdown, tf.breakdown)
    assert af.allocated == pytest.approx(tf.allocated, rel=0.005)
    assert a.peak.allocated == pytest.approx(t.peak.allocated, rel=0.005)


@pytest.mark.parametrize("zero", [3, 2])
def test_fsdp2_trl_head_casts_its_fp32_weight_gradient_to_param_dtype(zero: int) -> None:
    """DPO through TRL's fused head under FSDP2 mixed precision: the head weight it reads is FSDP2's
    unsharded ``param_dtype`` (bf16) parameter, not the fp32 shard, so its backward casts the fp32
    ``grad_weight`` back to bf16 (the vocabulary × hidden copy) and casts no 32,768-row weight slice.
    Before, the analytic backward counted the slice and not the copy (0.963 / 1.049 of the trace's peak
    at ZeRO-3 / ZeRO-2: at ZeRO-2 the tied embeddings' instant over-counted as well); within 0.5 % now."""
    spec = _tied_llama(4)
    w = Workload(task="train", batch=1, seq=512, objective="dpo", reference="precomputed",
                 parallel=Parallel(dp=4, zero=zero, engine="fsdp"))
    t = estimate_report(spec, w, method="trace", search_max_batch=False)
    a = estimate_report(spec, w, method="analytic", search_max_batch=False)
    tb, ab = ([p for p in r.phases if p.phase is Phase.BACKWARD][0] for r in (t, a))
    assert ab.allocated == pytest.approx(tb.allocated, rel=0.005)
    assert ab.breakdown.temporaries == pytest.approx(tb.breakdown.temporaries, rel=0.01)


FULL_SIZE = [  # bench/fsdp2_analytic.py's rows (H100, seq 512, batch 1), analytic / trace before → after session 56
    ("llama-3.2-1b", {}, {"dp": 4, "zero": 2}),  # 1.1392 → 0.9998 (the embeddings' backward)
    ("llama-3.2-1b", {"objective": "dpo", "reference": "model"}, {"dp": 4, "zero": 2}),  # 0.9709 → 1.0001 (TRL's head)
    ("llama-3.2-1b", {"objective": "dpo", "reference": "model"}, {"dp": 2, "zero": 2}),  # 1.0167 → 0.9999
    ("8b-4-layers", {"peft": "lora", "checkpointing": "full"}, {"dp": 8, "zero": 3}),  # 0.6927 → 0.9989 (first gathers)
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "kw", "parallel"), FULL_SIZE,
                         ids=[f"{n}-{kw.get('objective', kw.get('peft', 'sft'))}-dp{p['dp']}-z{p['zero']}"
                              for n, kw, p in FULL_SIZE])
def test_fsdp2_full_size_analytic_peak_is_the_traces(name: str, kw: dict, parallel: dict[str, int]) -> None:
    """The three FSDP2 mechanisms above at full size (Llama-3.2-1B; Llama-3.1-8B's width with 4 layers): the
    analytic peak within 0.5 % of the trace's (the largest gap left in bench/fsdp2_analytic.py's SFT and DPO
    rows is 0.9936, checkpointed ZeRO-2 at dp 8, not among these)."""
    spec = resolve(name) if name != "8b-4-layers" else _untied_llama(4)
    w = Workload(task="train", batch=1, seq=512, parallel=Parallel(engine="fsdp", **parallel), **kw)
    t = estimate_report(spec, w, gpu="h100", method="trace", search_max_batch=False)
    a = estimate_report(spec, w, gpu="h100", method="analytic", search_max_batch=False)
    assert a.peak.allocated == pytest.approx(t.peak.allocated, rel=0.005)
