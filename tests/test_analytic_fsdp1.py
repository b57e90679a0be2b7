"""The analytic method's FSDP1 formulas (``engine=fsdp1``, :mod:`vramplan.analytic.fsdp1`) against the trace,
which runs torch's own ``FullyShardedDataParallel`` on the fake process group (``trace/layout.py`` ``_fsdp1``).

The model is Llama's layout at width 1024 and 4 layers (vocab 8192): large enough that the flat
parameters, their gradients and the all-gather outputs dominate each phase, not the two cuBLAS
workspaces. Each phase's peak (the traced tensor bytes, not the allocator's rounding) must agree within
1 %: ``bench/analytic_fsdp1.py`` finds the backward within 0.2-0.9 % on this grid; a block's prefetched
parameters are 5-6 % of the backward peak (dp 2), a block's flat gradient as much, so a missing
one fails.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from vramplan import estimate  # noqa: E402
from vramplan.errors import WorkloadError  # noqa: E402
from vramplan.models.catalog import resolve  # noqa: E402
from vramplan.models.normalize import spec_from_config  # noqa: E402
from vramplan.workload import Phase, Workload  # noqa: E402


def _spec():
    c = dict(resolve("llama-3.1-8b").config)
    c.update(num_hidden_layers=4, hidden_size=1024, intermediate_size=2816, vocab_size=8192,
             num_attention_heads=8, num_key_value_heads=4, head_dim=128)
    return spec_from_config(c, name="tiny-llama-4x1024", source="test")


def _phases(w: Workload, method: str) -> dict[Phase, int]:
    return {p.phase: p.allocated for p in estimate(_spec(), w, method=method, search_max_batch=False).phases}


@pytest.mark.parametrize(("precision", "zero", "prefetch", "ckpt", "dp"), [
    ("bf16-mixed", 3, "backward-pre", "none", 2),
    ("bf16-mixed", 3, "backward-post", "full", 4),
    ("fp32", 2, "none", "none", 2),
    ("bf16-mixed", 3, "backward-pre", "accum", 2),  # (2 micro-batches: every gradient shard kept through the step)
])
def test_each_phase_matches_the_trace(precision: str, zero: int, prefetch: str, ckpt: str, dp: int) -> None:
    accum = 2 if ckpt == "accum" else 1
    ckpt = "none" if ckpt == "accum" else ckpt
    w = Workload(task="train", batch=1, seq=256, precision=precision, checkpointing=ckpt, grad_accum=accum).replace(
        dp=dp, zero=zero, engine="fsdp1", fsdp1_prefetch=prefetch)
    traced, analytic = _phases(w, "trace"), _phases(w, "analytic")
    assert set(analytic) == {Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER}
    for ph in (Phase.BACKWARD, Phase.OPTIMIZER):
        assert analytic[ph] == pytest.approx(traced[ph], rel=0.01), ph
    # (fp32's forward peaks inside the last block's forward, whose working set is not counted: within 2 %)
    assert analytic[Phase.FORWARD] == pytest.approx(traced[Phase.FORWARD], rel=0.02)


@pytest.mark.parametrize(("prefetch", "zero", "blocks"), [
    ("backward-pre", 3, 1), ("backward-post", 3, 0), ("none", 3, 0), ("backward-pre", 2, 0)])
def test_only_backward_pre_gathers_the_previous_block(prefetch: str, zero: int, blocks: int) -> None:
    """BACKWARD_PRE gathers the previous block while a block's backward runs: one block's 16-bit
    flat parameter; SHARD_GRAD_OP keeps every block gathered from its forward (nothing to prefetch)."""
    from vramplan.analytic.fsdp1 import layout

    w = Workload(task="train", precision="bf16-mixed").replace(dp=2, zero=zero, engine="fsdp1", fsdp1_prefetch=prefetch)
    f = layout(w, blocks=[11_798_529] * 4, root=100, head=50, tied=0, weight_b=4, gather_b=2)
    assert f.block == 11_798_530 * 2  # (padded to a multiple of the world size, as _get_shard pads)
    assert f.prefetched == blocks * f.block


@pytest.mark.parametrize(("changes", "what"), [
    ({"zero": 0}, "NO_SHARD"), ({"offload_params": True, "offload_optimizer": True}, "CPUOffload"),
])
def test_what_is_not_modelled_is_refused_by_name(changes: dict[str, object], what: str) -> None:
    w = Workload(task="train", batch=1, seq=256).replace(dp=2, zero=3, engine="fsdp1").replace(**changes)
    with pytest.raises(WorkloadError, match=what):
        estimate(_spec(), w, method="analytic", search_max_batch=False)


def test_lora_is_refused_by_name() -> None:
    w = Workload(task="train", batch=1, seq=256, peft="lora").replace(dp=2, zero=3, engine="fsdp1")
    with pytest.raises(WorkloadError, match="per-adapter units"):
        estimate(_spec(), w, method="analytic", search_max_batch=False)


def test_the_planner_screens_fsdp1_candidates() -> None:
    """`plan --engine fsdp1` screened no data-parallel FSDP1 candidate while the analytic method
    refused FSDP1: Llama-3.1-8B's full training (157.6 GiB on one GPU) fits 8 H100s only sharded."""
    from vramplan.planner.plan import plan

    w = Workload(task="train", seq=2048, precision="bf16-mixed").replace(engine="fsdp1")
    r = plan("llama-3.1-8b", w, gpu="h100", max_gpus=8, method="analytic", confirm=0)
    sharded = [p for p in r.plans if p.workload.parallel.dp > 1]
    assert sharded and all(p.workload.parallel.engine.value == "fsdp1" for p in sharded)
    assert any("FSDP1 FULL_SHARD ×8" in p.label for p in sharded), [p.label for p in sharded]


@pytest.mark.parametrize(("zero", "prefetch", "held", "said"), [
    (3, "none", "for its forward and again for its backward", "no backward prefetch"),
    (3, "backward-pre", "for its forward and again for its backward", "the next block gathered beside"),
    (2, "backward-post", "from its forward to its backward", "backward-post prefetch"),
])
def test_the_note_says_fsdp1s_strategy_and_prefetch(zero: int, prefetch: str, held: str, said: str) -> None:
    """The analytic note names FSDP1's strategy and the prefetch it was given (FSDP2's "plus the
    prefetched next one" was printed for FSDP1 under `fsdp1_prefetch=none` too)."""
    w = Workload(task="train", batch=1, seq=256).replace(dp=2, zero=zero, engine="fsdp1", fsdp1_prefetch=prefetch)
    every = estimate(_spec(), w, method="analytic", search_max_batch=False).notes
    notes = [n for n in every if n.startswith("FSDP1 ")]
    assert len(notes) == 1 and held in notes[0] and said in notes[0], notes
    assert "prefetched next one" not in " ".join(every)
