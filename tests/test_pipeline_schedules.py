"""Pipeline schedules (GPipe, 1F1B, interleaved, looped, zero-bubble) traced with torch's own
schedule classes, the analytic in-flight counts checked against torch's action orders, and the
schedule knobs' errors (issue 12)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from vramplan import Parallel, Workload, estimate
from vramplan.analytic.estimate import build_arch
from vramplan.analytic.parallel import chunks_in_flight, interleaved_flight, stages
from vramplan.analytic.regime import regime, trainable
from vramplan.analytic.states import stage_states
from vramplan.cli.main import main
from vramplan.errors import WorkloadError
from vramplan.results import BREAKDOWN_KEYS
from vramplan.trace import analysis
from vramplan.trace.run import trace_pipeline_stages
from vramplan.trace.testing import tiny_spec
from vramplan.workload import PP_SCHEDULES, Method, Phase

sch = pytest.importorskip("torch.distributed.pipelining.schedules")


def _max_activations(t) -> int:
    """The most activation bytes alive at once over the trace."""
    a = analysis.arrays(t.events)
    bucket = analysis._BUCKET_OF_CATEGORY[a.cat]
    return int(np.cumsum(np.where(bucket == BREAKDOWN_KEYS.index("activations"), a.delta, 0)).max())


def _trace(schedule: str, m: int, *, layers: int = 4, pp: int = 2, seq: int = 64, iterations: int = 1):
    spec = tiny_spec("llama-3.1-8b", layers=layers)
    w = Workload(task="train", batch=1, seq=seq, grad_accum=m, parallel=Parallel(pp=pp, pp_schedule=schedule))
    return spec, w, dict(trace_pipeline_stages(spec, w, iterations=iterations))


# ----------------------------------------------------------------- the analytic counts vs torch
def _torch_order(name: str, pp: int, v: int, m: int, rank: int) -> list:
    """torch's own action list for ``rank`` (``_calculate_single_rank_operations``), computed
    without stages: the attributes it reads are set by hand."""
    cls = sch.get_schedule_class(name)
    s = cls.__new__(cls)
    s.pp_group_size, s._n_microbatches, s.n_local_stages, s.rank = pp, m, v, rank
    s.number_of_rounds = max(1, m // pp)
    s.microbatches_per_round = m // s.number_of_rounds
    s._stages, s.num_stages, s._num_stages = [None] * v, pp * v, pp * v
    return s._calculate_single_rank_operations(rank)


def _peak_forwards(ops: list, zero_bubble: bool) -> int:
    """The most forwards not yet backward; for the zero-bubble schedules until their separate
    weight-gradient step (W), which keeps part of what the forward saved."""
    c = sch._ComputationType
    release = (c.FULL_BACKWARD, c.BACKWARD_WEIGHT if zero_bubble else c.BACKWARD_INPUT)
    live = best = 0
    for a in ops:
        if a is None:
            continue
        if a.computation_type == c.FORWARD:
            live += 1
        elif a.computation_type in release:
            live -= 1
        best = max(best, live)
    return best


@pytest.mark.parametrize("name,virtual", [("Interleaved1F1B", (1, 2, 3, 4)), ("LoopedBFS", (1, 2, 3)),
                                          ("InterleavedZeroBubble", (1, 2, 4)), ("ZBVZeroBubble", (2,))])
def test_in_flight_counts_equal_torchs_own_action_orders(name, virtual):
    checked = 0
    for pp, v, m in itertools.product((2, 3, 4, 8), virtual, (1, 2, 3, 4, 6, 8, 12, 16)):
        if name.startswith("Interleaved") and m % max(1, m // pp):
            continue  # the schedule refuses it (see the error test below)
        for rank in range(pp):
            ops = _torch_order(name, pp, v, m, rank)
            assert chunks_in_flight(name, pp, v, m, rank) == _peak_forwards(ops, "ZeroBubble" in name), \
                (name, pp, v, m, rank)
            checked += 1
    assert checked > 100


def _torch_flight(ops: list, pp: int, rank: int, sizes: tuple[int, ...], last: bool) -> tuple[int, ...]:
    """From torch's action list: the layers in flight (each forward of a local stage not yet run
    backward, that stage's layers) at the backward with the most (``last``: of the last local stage)."""
    c = sch._ComputationType
    counts, best = [0] * len(sizes), -1
    for a in ops:
        if a is None:
            continue
        local = (a.stage_index - rank) // pp
        if a.computation_type == c.FORWARD:
            counts[local] += 1
        elif a.computation_type == c.FULL_BACKWARD:
            if local == len(sizes) - 1 or not last:
                best = max(best, sum(n * k for n, k in zip(counts, sizes, strict=True)))
            counts[local] -= 1
    return best


def test_interleaved_chunks_in_flight_by_stage_equal_torchs_action_order():
    """Interleaved1F1B with stages of unequal size (the embeddings' or the head's share): the mix of
    each local stage's chunks in flight at the backward with the most layers in flight, and at the last
    local stage's backward, is what torch's own action order holds (analytic ``interleaved_flight``)."""
    checked = 0
    for pp, v, m in itertools.product((2, 3, 4), (2, 3), (2, 4, 6, 8, 12)):
        if m % max(1, m // pp):
            continue
        for rank, sizes in itertools.product(range(pp), ((2, 1, 3)[:v], (1, 2, 2)[:v], (3, 1, 1)[:v])):
            ops = _torch_order("Interleaved1F1B", pp, v, m, rank)
            for last in (False, True):
                counts, back = interleaved_flight(pp, v, m, rank, sizes, last)
                assert sum(n * k for n, k in zip(counts, sizes, strict=True)) == _torch_flight(ops, pp, rank, sizes, last), \
                    (pp, v, m, rank, sizes, last)
                assert counts[back] > 0 and (back == v - 1 or not last)
                checked += 1
    assert checked > 100


def test_single_stage_in_flight_counts():
    assert [chunks_in_flight("GPipe", 4, 1, 6, r) for r in range(4)] == [6, 6, 6, 6]
    assert [chunks_in_flight("1F1B", 4, 1, 6, r) for r in range(4)] == [4, 3, 2, 1]
    assert [chunks_in_flight("1F1B", 4, 1, 2, r) for r in range(4)] == [2, 2, 2, 1]


# ----------------------------------------------------------------- traces against hand figures
@pytest.fixture(scope="module")
def gpipe():
    return {m: _trace("GPipe", m)[2] for m in (1, 2, 3)}


def test_gpipe_keeps_every_micro_batch_in_flight(gpipe):
    # fill-drain: every forward runs before any backward, on every rank: m × one micro-batch's
    for rank in (0, 1):
        one = _max_activations(gpipe[1][rank])
        assert one > 0
        for m in (2, 3):
            assert _max_activations(gpipe[m][rank]) == m * one


def test_1f1b_keeps_min_m_pp_minus_rank_in_flight(gpipe):
    pp, micro, seq, hidden = 2, 1, 64, tiny_spec("llama-3.1-8b", layers=4).hidden
    one_f1b = {m: _trace("1F1B", m)[2] for m in (2, 4, 6)}
    hidden_state = micro * seq * hidden * 4  # one fp32 micro-batch of hidden states
    for rank in (0, 1):
        acts = {m: _max_activations(traced[rank]) for m, traced in one_f1b.items()}
        buffer = (acts[6] - acts[4]) // 2  # each further micro-batch: its receive buffer (+ ids / loss)
        assert 0 <= buffer - hidden_state <= 1024
        for m in (2, 4, 6):
            k = min(m, pp - rank)  # Schedule1F1B's warm-up: min(m, stages − stage) forwards, then 1B1F
            # the in-flight part equals GPipe's with k micro-batches; beyond it each further micro-batch
            # adds its receive buffer, and in the 1B1F phase a rank that sends activations on (all but
            # the last) holds one more sent micro-batch until its fused send completes
            sending = hidden_state if m > k and rank < pp - 1 else 0
            assert acts[m] == _max_activations(gpipe[k][rank]) + (m - k) * buffer + sending, (rank, m)


def test_interleaved_holds_fewer_chunks_than_looped_bfs():
    # pp=2, v=2 stages of 2 layers per rank. LoopedBFS runs every forward first: m × v chunks.
    # Interleaved1F1B runs min((v − 1) × m + 2 (pp − 1 − rank), m v) warm-up chunks and one more
    # before its first backward: all 4 at m=2, 5 of 8 at m=4 on rank 0
    assert [chunks_in_flight("Interleaved1F1B", 2, 2, m, 0) for m in (2, 4)] == [4, 5]
    looped = {m: _max_activations(_trace("LoopedBFS", m, layers=8)[2][0]) for m in (2, 4)}
    inter = {m: _max_activations(_trace("Interleaved1F1B", m, layers=8)[2][0]) for m in (2, 4)}
    assert looped[4] == 2 * looped[2]
    assert inter[2] == looped[2]
    # two more micro-batches: 4 more chunks and 2 × 3 receive buffers (rank 0's stage 0 receives
    # gradients, its stage 2 activations and gradients); interleaved holds 3 chunks fewer
    buffer = 64 * tiny_spec("llama-3.1-8b", layers=8).hidden * 4
    chunk = (looped[4] - looped[2] - 6 * buffer) / 4
    assert looped[4] - inter[4] == pytest.approx(3 * chunk, rel=0.05)


@pytest.mark.parametrize("schedule", PP_SCHEDULES)
def test_each_schedule_traces_the_analytic_states_per_rank(schedule):
    spec, w, traced = _trace(schedule, 4, layers=8, seq=128, iterations=2)
    arch = build_arch(spec)
    rg, tr = regime(w), trainable(arch, w)
    v = w.parallel.stages_per_rank
    for st in stages(arch, w):
        a = stage_states(arch, st, w, rg, tr)
        b = [p for p in traced[st.index].phases if p.phase is Phase.OPTIMIZER][0].breakdown
        assert (b.gradients, b.optimizer) == (a.gradients, a.optimizer)
        assert 0 <= b.weights - a.weights <= 1024 * v  # + the rotary buffers each stage keeps
    worst = max(t.peak_allocated for t in traced.values())
    analytic = estimate(spec, w, method="analytic", search_max_batch=False).peak.allocated
    # the zero-bubble schedules' delayed weight-gradient steps keep more than the analytic counts
    tol = 0.15 if "ZeroBubble" in schedule else 0.05
    assert analytic == pytest.approx(worst, rel=tol)


def test_zbv_rank_0_holds_the_first_and_the_last_stage():
    spec = tiny_spec("llama-3.1-8b", layers=8)
    w = Workload(task="train", batch=1, seq=64, grad_accum=4, parallel=Parallel(pp=2, pp_schedule="zbvzerobubble"))
    assert w.parallel.pp_schedule == "ZBVZeroBubble" and w.parallel.stage_ids(0) == (0, 3)
    r = estimate(spec, w, method="trace", search_max_batch=False)
    note = next(n for n in r.notes if n.startswith("pipeline parallelism traced per rank"))
    # torchtitan's split of 8 layers into 4 stages: 2, 3, 2, 1 (the embeddings and the head count as one each)
    assert "rank 0 (layers 0–1, layer 7, embeddings, head + loss)" in note
    assert "ZBVZeroBubble over 4 micro-batches" in note
    assert r.method is Method.TRACE


# ----------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs,match", [
    (dict(pp=2, pp_schedule="zigzag"), "unknown pipeline schedule"),
    (dict(pp=2, pp_virtual=2), "one stage per rank"),
    (dict(pp=2, pp_schedule="ZBVZeroBubble", pp_virtual=3), "exactly 2 stages per rank"),
    (dict(pp=2, pp_virtual=-1), "pp_virtual"),
])
def test_bad_schedule_knobs_are_one_line_errors(kwargs, match):
    with pytest.raises(WorkloadError, match=match):
        Parallel(**kwargs)


@pytest.mark.parametrize("parallel,accum,match", [
    (dict(pp=4), 2, "at least 4 micro-batches"),
    (dict(pp=4, pp_schedule="Interleaved1F1B"), 9, "rounds"),
    (dict(pp=2, pp_schedule="Interleaved1F1B", pp_virtual=20), 4, "40 pipeline stages cannot be cut from 32 layers"),
])
def test_schedule_checks_against_the_model(parallel, accum, match):
    w = Workload(task="train", grad_accum=accum, parallel=Parallel(**parallel))
    with pytest.raises(WorkloadError, match=match):
        estimate("llama-3.1-8b", w, method="analytic", search_max_batch=False)


def test_cli_schedule_flags(capsys):
    assert main(["estimate", "llama-3.1-8b", "--pp", "4", "--grad-accum", "8", "--pp-schedule", "interleaved1f1b",
                 "--pp-virtual", "2", "--method", "analytic", "--json"]) == 0
    assert '"pp_schedule": "Interleaved1F1B"' in capsys.readouterr().out
    assert main(["estimate", "llama-3.1-8b", "--pp", "4", "--pp-schedule", "zigzag", "--method", "analytic"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown pipeline schedule" in err[0] and "GPipe" in err[0]


# ----------------------------------------------------------------- step time and plan
def test_bubble_follows_the_schedule():
    from vramplan.hardware.catalog import get_gpu
    from vramplan.models.catalog import resolve
    from vramplan.runtime import step_time

    spec, gpu = resolve("llama-3.1-8b"), get_gpu("h100")
    w = Workload(batch=1, seq=2048, grad_accum=8, optimizer_impl="fused", parallel=Parallel(pp=4))
    t = {s: step_time(spec, w.replace(pp_schedule=s), gpu) for s in PP_SCHEDULES}
    per_mb = t["1F1B"].bubble / 3  # (p − 1) micro-batch times
    assert t["GPipe"].bubble == pytest.approx(t["1F1B"].bubble)
    assert t["Interleaved1F1B"].bubble == pytest.approx(3 * per_mb / 2)  # / v, v = 2
    assert t["LoopedBFS"].bubble == pytest.approx(t["Interleaved1F1B"].bubble)
    assert t["ZBVZeroBubble"].bubble == pytest.approx(3 * per_mb / 6)
    four = step_time(spec, w.replace(pp_schedule="Interleaved1F1B", pp_virtual=4), gpu)
    assert four.bubble == pytest.approx(3 * per_mb / 4)
    assert any("ZBVZeroBubble" in n and "(p − 1) / (3 v)" in n for n in t["ZBVZeroBubble"].notes)


def test_plan_searches_schedules_for_the_pipelines_it_lays_out():
    from vramplan.hardware.catalog import get_gpu
    from vramplan.planner.space import PP_SEARCHED, candidates

    gpu = get_gpu("h100")
    found = {c.workload.parallel.pp_schedule for c in candidates(Workload(seq=2048, grad_accum=8), gpu, max_gpus=8,
                                                                 compact=True) if c.workload.parallel.pp > 1}
    assert found == set(PP_SEARCHED)
    given = Workload(seq=2048, grad_accum=8, parallel=Parallel(pp=2, pp_schedule="GPipe"))
    kept = {c.workload.parallel.pp_schedule for c in candidates(given, gpu, max_gpus=8, compact=True)}
    assert kept == {"GPipe"}


# ----------------------------------------------------------------- LoRA and inference
@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B", "ZBVZeroBubble"])
def test_lora_pipeline_is_traced_and_matches_the_analytic(schedule):
    spec = tiny_spec("llama-3.1-8b", layers=8)
    w = Workload(task="train", batch=2, seq=128, grad_accum=4, peft="lora",
                 parallel=Parallel(pp=2, pp_schedule=schedule))
    t = estimate(spec, w, method="trace", search_max_batch=False)
    a = estimate(spec, w, method="analytic", search_max_batch=False)
    assert t.method is Method.TRACE
    assert (t.breakdown.gradients, t.breakdown.optimizer) == (a.breakdown.gradients, a.breakdown.optimizer)
    assert t.trainable_params == a.trainable_params < t.params  # the whole model's adapters
    # (ZBV: a rank's two stages differ in size under torchtitan's split — 2 and 1 layers on rank 0,
    # 3 and 2 on rank 1 — and the analytic method averages a micro-batch's chunks over them)
    assert t.peak.allocated == pytest.approx(a.peak.allocated, rel=0.06 if schedule == "ZBVZeroBubble" else 0.03)


def test_pipeline_inference_is_one_forward_only_micro_batch():
    spec = tiny_spec("llama-3.1-8b", layers=8)
    w = Workload(task="infer", batch=2, seq=256, parallel=Parallel(pp=4))
    t = estimate(spec, w, method="trace", search_max_batch=False)
    assert t.method is Method.TRACE and t.breakdown.gradients == t.breakdown.optimizer == 0
    note = next(n for n in t.notes if n.startswith("pipeline parallelism traced per rank"))
    assert "GPipe forward-only over one micro-batch of 2" in note and "rank 3 (layer 7, head)" in note
    a = estimate(spec, w, method="analytic", search_max_batch=False)
    assert t.breakdown.weights == pytest.approx(a.breakdown.weights, abs=1024)
    looped = w.replace(pp_schedule="Interleaved1F1B")
    assert estimate(spec, looped, search_max_batch=False).method is Method.ANALYTIC  # refused with a reason


@pytest.mark.parametrize("layers, pp, v, sizes", [
    (126, 8, 1, (15, 16, 16, 16, 16, 16, 16, 15)),  # Llama-3.1-405B on 8 stages (torchtitan's 405B split)
    (32, 4, 1, (8, 9, 8, 7)),  # 34 effective layers: 8 each and 2 over, to the first stages
    (32, 4, 2, (4, 5, 4, 4, 4, 4, 4, 3)),
    (8, 8, 1, (1, 2, 1, 1, 1, 1, 1, 0)),  # the last stage holds only the norm and the head
])
def test_stages_split_as_torchtitan_splits_them(layers, pp, v, sizes):
    """torchtitan's generate_llm_fqn_per_model_part (pipeline_parallel.py): effective layers =
    layers + 1 (embeddings) + 1 (norm and head), shared evenly, the remainder to the first stages."""
    p = Parallel(pp=pp, pp_schedule="Interleaved1F1B" if v > 1 else "1F1B", pp_virtual=v if v > 1 else 0)
    bounds = p.stage_bounds(layers)
    assert tuple(hi - lo for lo, hi in bounds) == sizes
    assert bounds[0][0] == 0 and bounds[-1][1] == layers and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    even = Parallel(pp=pp, pp_first_less=0, pp_last_less=0).stage_bounds(layers) if layers % pp == 0 else None
    assert even is None or {hi - lo for lo, hi in even} == {layers // pp}


def test_a_405b_on_eight_stages_is_estimated_and_names_the_split():
    """126 layers on 8 stages used to be refused ("does not divide"); torchtitan runs it."""
    r = estimate("llama-3.1-405b", Workload(task="train", seq=4096, grad_accum=8, parallel=Parallel(pp=8)),
                 method="analytic", search_max_batch=False)
    assert any("stages of 15–16 layers as torchtitan splits 126" in n for n in r.notes)
    with pytest.raises(WorkloadError, match="`pp_first_less=20`"):
        Parallel(pp=8, pp_first_less=20).stage_bounds(126)
