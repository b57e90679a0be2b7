"""Activation checkpointing policies (issue 10): every k-th layer, torchtitan's op-level SAC,
a user SAC policy — checked against a real CPU run of the same step (torch's own checkpoint
and SAC machinery on real tensors), by hand-computed deltas, and against the analytic path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.checkpoint import CheckpointPolicy

from vramplan.analytic import estimate
from vramplan.errors import VramplanError
from vramplan.trace import features, sac
from vramplan.trace.run import TraceOptions, trace_model, trace_workload
from vramplan.trace.testing import real_peak, tiny_spec
from vramplan.workload import Workload

NO_WS = TraceOptions(workspaces=False)
aten = torch.ops.aten


def _llama(layers: int = 4):
    def make():
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)
        cfg._attn_implementation = "eager"
        return LlamaForCausalLM(cfg)
    return make


def _inputs():
    ids = torch.randint(0, 256, (2, 128))
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}  # no KV cache in training


def _workload(**kw) -> Workload:
    return Workload(task="train", precision="fp32", optimizer="adamw", attention="eager", **kw)


# --------------------------------------------------------------------------- policy rules
def test_torchtitan_op_policy_saves_every_other_mm_and_the_save_list() -> None:
    policy = sac.torchtitan_op_policy()
    ctx = SimpleNamespace(is_recompute=False)
    x = torch.empty(2, 2, device="meta")
    ops = [aten.mm.default, aten.mm.default, aten.add.Tensor, aten.mm.default, aten.mm.default,
           aten._scaled_dot_product_flash_attention.default, aten.max.default, aten.silu.default]
    got = [policy(ctx, op, x, x) for op in ops]
    S, R = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert got == [S, R, R, S, R, S, S, R]
    # a fresh policy per checkpointed call (torchtitan's context_fn builds one each time)
    assert sac.torchtitan_op_policy()(ctx, aten.mm.default, x, x) is S


def test_torchtitan_save_list_is_v0_2_2s() -> None:
    assert aten.mm.default in sac.TORCHTITAN_OP_SAVE_LIST
    assert aten._scaled_dot_product_flash_attention.default in sac.TORCHTITAN_OP_SAVE_LIST
    assert aten.max.default in sac.TORCHTITAN_OP_SAVE_LIST
    assert aten.addmm.default not in sac.TORCHTITAN_OP_SAVE_LIST  # biased linears are recomputed


@given(n=st.integers(1, 64), k=st.integers(1, 8), frac=st.sampled_from([0.25, 0.5, 0.75, 1.0]))
def test_every_kth_layer_is_torchtitans_rule(n: int, k: int, frac: float) -> None:
    w = Workload(task="train", checkpointing="full", checkpoint_every=k, checkpoint_fraction=frac)
    got = sac.checkpointed(n, w)
    first = min(n, int(frac * n + 0.5))
    # torchtitan: a global count from 1 over the blocks, wrapped when count % k == 0
    assert got == [i for i in range(first) if (i + 1) % k == 0]
    from vramplan.analytic.activations import checkpointed_layers

    assert checkpointed_layers(w, n) == len(got)


def test_bad_user_policy_is_one_line() -> None:
    with pytest.raises(VramplanError, match="checkpoint_policy"):
        sac.context_fn(Workload(task="train"), policy=["mm"])
    with pytest.raises(VramplanError, match="checkpoint_policy"):
        sac.context_fn(Workload(task="train"), policy=42)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- real CPU runs
CASES = {
    "full": dict(checkpointing="full"),
    "every-2": dict(checkpointing="full", checkpoint_every=2),
    "op": dict(checkpointing="op"),
    "op-every-2": dict(checkpointing="op", checkpoint_every=2),
    "selective": dict(checkpointing="selective"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_policy_matches_a_real_cpu_run_within_one_percent(case: str) -> None:
    """The same model with the same policy run for real (torch.utils.checkpoint and
    create_selective_checkpoint_contexts on CPU tensors) vs its trace."""
    w = _workload(**CASES[case])
    make = _llama()

    def real_model():
        m = make()
        features.apply_checkpointing(m, w)
        return m

    ref = real_peak(real_model, _inputs)
    r = trace_model(make, _inputs, workload=w, options=NO_WS)
    assert abs(r.peak_allocated - ref) / ref < 0.01, (r.peak_allocated, ref)


def test_user_policy_matches_a_real_cpu_run() -> None:
    """A user's policy (save every mm and bmm) through the library argument."""
    policy = [aten.mm.default, aten.bmm.default]
    w = _workload()
    make = _llama()

    def real_model():
        m = make()
        features.apply_checkpointing(m, w, policy)
        return m

    ref = real_peak(real_model, _inputs)
    r = trace_model(make, _inputs, workload=w, options=NO_WS, checkpoint_policy=policy)
    assert abs(r.peak_allocated - ref) / ref < 0.01, (r.peak_allocated, ref)
    assert any("given policy" in n for n in r.notes)


# --------------------------------------------------------------------------- hand-computed deltas
def _forward_end(r) -> int:
    from vramplan.trace import analysis
    from vramplan.workload import Phase

    log = r.events
    fwd = [k for k in range(len(log)) if log.phase[k] == list(Phase).index(Phase.FORWARD) and log.iteration[k] == 1]
    return analysis.breakdown_at(analysis.arrays(log), fwd[-1]).activations


def test_op_sac_keeps_the_odd_matmul_outputs_over_full_checkpointing() -> None:
    """Op-level SAC keeps, beyond full checkpointing's layer inputs, exactly the outputs of the
    1st, 3rd, 5th and 7th mm of each layer (q, v, gate, down) — the attention here is eager."""
    h, kv, i, tokens, layers = 64, 32, 128, 2 * 128, 4
    full = trace_model(_llama(), _inputs, workload=_workload(checkpointing="full"), options=NO_WS)
    op = trace_model(_llama(), _inputs, workload=_workload(checkpointing="op"), options=NO_WS)
    per_layer = 4 * tokens * (h + kv + i + h)  # fp32 outputs of q_proj, v_proj, gate_proj, down_proj
    assert _forward_end(op) - _forward_end(full) == layers * per_layer


def test_every_second_layer_saves_half_the_layers() -> None:
    none = _forward_end(trace_model(_llama(), _inputs, workload=_workload(), options=NO_WS))
    full = _forward_end(trace_model(_llama(), _inputs, workload=_workload(checkpointing="full"), options=NO_WS))
    half = _forward_end(trace_model(_llama(), _inputs, workload=_workload(checkpointing="full", checkpoint_every=2),
                                    options=NO_WS))
    # half the layers keep their whole saved set (within one boundary tensor the neighbours share)
    assert half - full == pytest.approx((none - full) / 2, rel=0.025)


# --------------------------------------------------------------------------- analytic agreement
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16"])
@pytest.mark.parametrize("kw", [dict(checkpointing="op"), dict(checkpointing="full", checkpoint_every=2),
                                dict(checkpointing="op", checkpoint_every=2)])
def test_analytic_agrees_with_the_trace(precision: str, kw: dict) -> None:
    spec = tiny_spec("llama-3.1-8b", layers=4)
    w = Workload(task="train", batch=2, seq=256, precision=precision, **kw)
    r = trace_workload(spec, w, options=NO_WS)
    a = estimate(spec, w, workspace_bytes=0)
    assert abs(a.peak.allocated - r.peak_allocated) / r.peak_allocated < 0.03, (a.peak.allocated, r.peak_allocated)


def test_policies_order_memory_and_recompute_time() -> None:
    """Saved memory: none > op > full; recompute FLOPs the other way round."""
    from vramplan.analytic.flops import step_flops  # noqa: F401 (the analytic FLOPs model)

    spec = tiny_spec("llama-3.1-8b", layers=4)
    peaks, flops = {}, {}
    for ck in ("none", "op", "full"):
        a = estimate(spec, Workload(task="train", batch=2, seq=256, checkpointing=ck), workspace_bytes=0)
        peaks[ck], flops[ck] = a.peak.allocated, a.flops_per_step
    assert peaks["none"] > peaks["op"] > peaks["full"]
    assert flops["none"] < flops["op"] < flops["full"]


def test_estimate_takes_a_policy_under_the_trace_only() -> None:
    import vramplan

    spec = tiny_spec("llama-3.1-8b", layers=2)
    kw = dict(task="train", batch=1, seq=64, precision="bf16", search_max_batch=False)
    with pytest.raises(VramplanError, match="checkpoint_policy"):
        vramplan.estimate(spec, method="analytic", checkpoint_policy=[aten.mm.default], **kw)
    saved = vramplan.estimate(spec, checkpoint_policy=[aten.mm.default], **kw)
    plain = vramplan.estimate(spec, **kw)
    assert str(saved.method) == "trace"
    assert saved.peak.allocated < plain.peak.allocated
