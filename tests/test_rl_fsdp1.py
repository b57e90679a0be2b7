"""RL and preference objectives under FSDP1 (``engine=fsdp1``), as TRL 1.16 with accelerate runs
them: the policy wrapped with ``FullyShardedDataParallel`` (its root unit holding the embeddings,
the final norm and the head), TRL calling the prepared model (its fused LM head patched into the
wrapped model's forward), generating with the root unit's parameters gathered
(``summon_full_params(recurse=False)``). A reference model (``reference=model``) is a second FSDP
model, laid out as TRL's ``prepare_fsdp`` lays it out (FSDP1: the policy's units; FSDP2: one
unit, the root) and checked against a real gloo run with TRL's own ``prepare_fsdp``.
"""

from __future__ import annotations

import pytest

from vramplan.errors import WorkloadError
from vramplan.models.normalize import spec_from_config
from vramplan.trace.run import TraceOptions, trace_workload
from vramplan.workload import Parallel, Phase, Workload

pytest.importorskip("transformers")

CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 256,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1024,
          "max_position_embeddings": 256, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
          "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "attn_implementation": "eager"}
OPTS = TraceOptions(workspaces=False, count_flops=False)


def _real_and_traced(w: Workload, layout: str):
    """Per rank of a real 2-process gloo run of ``w``'s GRPO step (``layout``): the rank, its real
    part peaks, the rank's trace and the trace's part peaks (generation and actor)."""
    from vramplan.trace.testing import real_grpo_fsdp1_peaks

    real = real_grpo_fsdp1_peaks(CONFIG, w, world=2, layout=layout)
    spec = spec_from_config(CONFIG, name="llama-2l", source="test")
    for rank, got in enumerate(real):
        r = trace_workload(spec, w, options=TraceOptions(workspaces=False, count_flops=False, rank=rank))
        parts = dict(r.step_parts)
        assert set(parts) == {"generation", "actor"}, parts
        yield rank, got, r, parts


@pytest.mark.parametrize("layout", ["fsdp1", "ddp"])
def test_grpo_under_fsdp1_and_ddp_agrees_with_a_real_gloo_run(layout: str) -> None:
    """The same GRPO step run for real on 2 gloo processes (the policy wrapped with FSDP1 as
    accelerate wraps it, or with DDP) and traced on the fake process group, per rank, the peak of
    each part (generation and scoring, the policy's update) of the second step. What is left is
    itemised: AdamW's ``step`` counters, 4-byte host tensors the trace keeps off the device, one
    for each parameter with elements in the rank's shard (12 of the 21 here under FSDP1, all 21
    under DDP). DDP used to fail ("DistributedDataParallel is not one (use --loss full)": the
    fused-head forward looked for the causal LM at the wrapper); TRL calls the prepared model, so
    the forward runs through DDP's, which readies its reducer."""
    w = Workload(task="train", batch=2, grad_accum=2, seq=24, prompt=8, precision="fp32", objective="grpo",
                 generations=2, attention="eager").replace(dp=2, **(dict(zero=3, engine="fsdp1")
                                                                   if layout == "fsdp1" else {}))
    for rank, got, r, parts in _real_and_traced(w, layout):
        for part, traced in parts.items():
            assert traced == got[part] - 4 * got["adam_steps"], (rank, part, traced, got)
            assert abs(traced - got[part]) / got[part] < 1e-4
        assert got["adam_steps"] == (12 if layout.startswith("fsdp1") else 21), got
        assert any(n.startswith("FSDP1 (FULL_SHARD) over dp=2" if layout == "fsdp1" else "DDP over dp=2")
                   for n in r.notes), r.notes


@pytest.mark.parametrize(("objective", "more"), [
    ("dpo", dict(reference="precomputed")), ("kto", dict(reference="precomputed")),
    ("dpo", dict(peft="lora", reference="adapters")),
])
def test_preference_objectives_under_fsdp1_run_through_the_root_unit(objective: str, more: dict) -> None:
    """DPO/KTO under FSDP1 used to fail (the backbone called past the root unit: its embedding a
    1-D flat shard). Traced, their weights, gradients and optimizer states at the step are the SFT
    step's under the same FSDP1 layout (the same flat shards)."""
    spec = spec_from_config(CONFIG, name="llama-2l", source="test")
    base = dict(task="train", batch=2, seq=32, precision="bf16-mixed", attention="eager", **more)
    par = Parallel(dp=2, zero=3, engine="fsdp1")
    pref = trace_workload(spec, Workload(objective=objective, parallel=par, **base), options=OPTS)
    sft = trace_workload(spec, Workload(parallel=par, **base), options=OPTS)
    states = [{p.phase: p.breakdown for p in r.phases}[Phase.OPTIMIZER] for r in (pref, sft)]
    assert [(b.weights, b.gradients, b.optimizer) for b in states] == [(states[1].weights, states[1].gradients,
                                                                          states[1].optimizer)] * 2
    assert states[0].weights > 0 and states[0].optimizer > 0
    assert any(n.startswith("FSDP1 (FULL_SHARD) over dp=2") for n in pref.notes)


@pytest.mark.parametrize("engine", ["fsdp1", "fsdp"])
def test_sft_with_a_loss_implementation_under_fsdp_runs_through_the_root(engine: str) -> None:
    """SFT with TRL's fused head (`loss=trl`) under FSDP1 or FSDP2 used to fail (the backbone
    called past the sharded root); traced, its states are the plain loss's under the same layout."""
    spec = spec_from_config(CONFIG, name="llama-2l", source="test")
    par = Parallel(dp=2, zero=3, engine=engine)
    got = [trace_workload(spec, Workload(task="train", batch=2, seq=32, precision="bf16-mixed", attention="eager",
                                         loss=loss, parallel=par), options=OPTS) for loss in ("trl", "full")]
    states = [{p.phase: p.breakdown for p in r.phases}[Phase.OPTIMIZER] for r in got]
    assert [(b.weights, b.gradients, b.optimizer) for b in states] == [(states[1].weights, states[1].gradients,
                                                                          states[1].optimizer)] * 2
    assert max(p.allocated for p in got[0].phases) != max(p.allocated for p in got[1].phases)


@pytest.mark.parametrize("layout", ["fsdp1", "fsdp2", "ddp"])
def test_grpo_reference_under_fsdp_agrees_with_trl_prepare_fsdp_on_gloo(layout: str) -> None:
    """GRPO with a reference model (``beta > 0``) under ZeRO-3: the same step run for real on 2
    gloo processes (the policy wrapped as accelerate wraps it, the reference prepared by TRL
    1.16.0's own ``prepare_fsdp`` under accelerate's own plugin) and traced on the fake process
    group, per rank, the peak of each part of the second step. Under DDP (``zero=0``) the policy
    is wrapped in ``DistributedDataParallel`` and the reference left a whole replica, as
    ``accelerator.prepare_model(ref, evaluation_mode=True)`` leaves it. The update's agree to the byte but
    for AdamW's ``step`` counters (host tensors, as above); the rollout's too, but for those and the
    shuffle's permutation, live while the reference scores the window
    (``torch.randperm`` of the window on the host: 8 B per sequence, 32 B here; with
    ``grad_accum=3`` 48 B, checked once), a host tensor too."""
    w = Workload(task="train", batch=2, grad_accum=2, seq=24, prompt=8, precision="fp32", objective="grpo",
                 generations=2, attention="eager", reference="model").replace(dp=2, **_engine(layout))
    for rank, got, r, parts in _real_and_traced(w, layout):
        steps = 4 * got["adam_steps"]
        assert parts["actor"] == got["actor"] - steps, (rank, parts, got)
        order = 8 * w.batch * w.grad_accum  # (the window's int64 permutation)
        assert parts["generation"] == got["generation"] - steps - order, (rank, parts, got)
        for part, traced in parts.items():
            assert abs(traced - got[part]) / got[part] < 1e-4
        if layout == "fsdp2":  # (the whole reference gathered: the step's peak)
            assert r.peak_module == "reference", r.peak_module
        assert got["adam_steps"] == (12 if layout.startswith("fsdp1") else 21), got
        assert any(n.startswith(_REF_NOTE[layout]) for n in r.notes), r.notes


_REF_NOTE = {"fsdp1": "reference: FSDP1 (TRL's prepare_fsdp", "fsdp2": "reference: FSDP2 (TRL's prepare_fsdp",
             "fsdp2-zero2": "reference: FSDP2 (TRL's prepare_fsdp", "fsdp1-zero2": "reference: FSDP1 (TRL's prepare_fsdp",
             "ddp": "reference: a whole replica on each of the dp=2 ranks, not wrapped"}


def _engine(layout: str) -> dict:
    return {"fsdp1": dict(zero=3, engine="fsdp1"), "fsdp2": dict(zero=3, engine="fsdp"),
            "fsdp2-zero2": dict(zero=2, engine="fsdp"), "fsdp1-zero2": dict(zero=2, engine="fsdp1"),
            "ddp": dict(zero=0)}[layout]


@pytest.mark.parametrize("layout", ["fsdp1", "fsdp2", pytest.param("fsdp2-zero2", marks=pytest.mark.slow),
                                    pytest.param("fsdp1-zero2", marks=pytest.mark.slow), "ddp"])
def test_dpo_with_a_reference_under_fsdp_agrees_with_a_real_gloo_run(layout: str) -> None:
    """DPO (reference not precomputed) under ZeRO-3 (and ZeRO-2: FSDP2's ``reshard_after_forward=False``,
    FSDP1's SHARD_GRAD_OP, for the policy and, through accelerate's plugin, the reference, which then
    stays gathered from its first forward on): two real DPO steps on 2 gloo processes, the
    policy wrapped as accelerate wraps it and the reference prepared by TRL 1.16.0's own
    ``prepare_fsdp``, against the trace per rank: the storage peak to the byte but for AdamW's
    ``step`` counters (host tensors). Under FSDP2 the step peaks in the reference's forward (the
    whole reference gathered beside the policy's activations). Under DDP the reference is a
    replica on each rank (TRL's ``prepare_model(ref, evaluation_mode=True)``: no DDP wrapper)."""
    from vramplan.trace.testing import real_grpo_fsdp1_peaks

    w = Workload(task="train", batch=2, seq=24, precision="fp32", objective="dpo", attention="eager",
                 reference="model").replace(dp=2, **_engine(layout))
    real = real_grpo_fsdp1_peaks(CONFIG, w, world=2, layout=layout)
    spec = spec_from_config(CONFIG, name="llama-2l", source="test")
    for rank, got in enumerate(real):
        r = trace_workload(spec, w, options=TraceOptions(workspaces=False, count_flops=False, rank=rank))
        assert r.peak_allocated == got["peak"] - 4 * got["adam_steps"], (rank, r.peak_allocated, got)
        assert got["adam_steps"] == (12 if layout.startswith("fsdp1") else 21), got
        assert (r.peak_module == "reference") is (layout == "fsdp2"), r.peak_module
        assert any(n.startswith(_REF_NOTE[layout]) for n in r.notes), r.notes


def test_trl_gathers_the_whole_reference_under_fsdp2_one_block_under_fsdp1() -> None:
    """TRL's FSDP2 ``prepare_fsdp`` calls ``fully_shard`` on the reference's root alone: its
    forward gathers the whole model at once, where FSDP1's units gather one block at a time; FSDP1
    keeps the root unit (embeddings, final norm, head) gathered after a forward (for a backward
    that never comes under no_grad), so the reference holds it from its first forward on. DPO
    (reference not precomputed), traced: at the optimizer step the reference holds its shard and its
    buffers (FSDP1: and its root unit whole); its forward adds more than its whole weights to the
    peak under FSDP2 only. (The same residency is in the real FSDP1/FSDP2 runs above: their update
    parts agree to the byte.)"""
    import torch
    import transformers

    with torch.device("meta"):
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    full = sum(p.nbytes for p in m.parameters())
    buffers = sum(b.nbytes for b in m.buffers())
    root = sum(p.nbytes for p in (m.model.embed_tokens.weight, m.model.norm.weight, m.lm_head.weight))
    spec = spec_from_config(CONFIG, name="llama-2l", source="test")
    grow = {}
    for engine in ("fsdp1", "fsdp"):
        got = {}
        for ref in ("model", "precomputed"):
            w = Workload(task="train", batch=2, seq=24, precision="fp32", objective="dpo", attention="eager",
                         reference=ref).replace(dp=2, zero=3, engine=engine)
            got[ref] = trace_workload(spec, w, options=OPTS)
        held = [{p.phase: p.breakdown for p in got[k].phases}[Phase.OPTIMIZER].weights for k in got]
        assert held[0] - held[1] == full // 2 + buffers + (root if engine == "fsdp1" else 0), (engine, held)
        grow[engine] = got["model"].peak_allocated - got["precomputed"].peak_allocated
    assert grow["fsdp"] > full > grow["fsdp1"], (grow, full)


def test_a_reference_model_outside_the_traced_layouts_is_refused_with_its_cause() -> None:
    """The trace lays the reference out under DDP (a replica) and under ZeRO-3 and ZeRO-2 with
    FSDP1/FSDP2; the analytic method models DPO's, KTO's and GRPO's under DDP and FSDP2 (one unit)
    and refuses FSDP1's; both refuse DeepSpeed's engine, CPU offload and HSDP."""
    from vramplan.analytic.estimate import estimate

    spec = spec_from_config(CONFIG, name="llama-2l", source="test")
    w = Workload(task="train", batch=2, seq=32, objective="dpo", reference="model",
                 parallel=Parallel(dp=2, zero=3, engine="fsdp"))
    grpo = Workload(task="train", batch=2, seq=32, prompt=8, objective="grpo", generations=2, reference="model",
                    parallel=Parallel(dp=2, zero=3, engine="fsdp"))
    zero2 = Parallel(dp=2, zero=2, engine="fsdp")  # (FSDP2, reshard_after_forward=False)
    for x in (w, grpo, w.replace(parallel=Parallel(dp=2)), grpo.replace(parallel=Parallel(dp=2, engine="ddp")),
              w.replace(parallel=zero2), grpo.replace(parallel=zero2)):
        x.check_reference_model(traced=True)
        assert estimate(spec, x).peak.allocated > 0
    for zero in (3, 2):
        fsdp1 = w.replace(parallel=Parallel(dp=2, zero=zero, engine="fsdp1"))
        fsdp1.check_reference_model(traced=True)
        with pytest.raises(WorkloadError, match="under FSDP1 the trace does") as e:
            fsdp1.check_reference_model()
        assert e.value.field == "reference"
    for par in (Parallel(dp=2, zero=3, engine="fsdp", offload_params=True), Parallel(dp=4, zero=3, dp_shard=2)):
        for traced in (True, False):
            with pytest.raises(WorkloadError, match="only DDP's replica and its ZeRO-3 and ZeRO-2 layouts") as e:
                w.replace(parallel=par).check_reference_model(traced=traced)
            assert e.value.field == "reference"
    for par in (Parallel(dp=2, zero=2), Parallel(dp=2, zero=1), Parallel(dp=2, zero=3, engine="deepspeed")):
        for traced in (True, False):  # (TRL's prepare_deepspeed: no DeepSpeed engine is traced, for the policy either)
            with pytest.raises(WorkloadError, match="TRL prepares it with `prepare_deepspeed`.*runs no DeepSpeed") as e:
                w.replace(parallel=par).check_reference_model(traced=traced)
            assert e.value.field == "reference"
    ppo = Workload(task="train", batch=2, seq=32, prompt=8, objective="ppo", generations=1, reference="model",
                   parallel=Parallel(dp=2, zero=3))
    with pytest.raises(WorkloadError, match="PPO's reference is verl's") as e:
        ppo.check_reference_model(traced=True)
