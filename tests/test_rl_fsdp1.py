"""RL and preference objectives under FSDP1 (``engine=fsdp1``), as TRL 1.16 with accelerate runs
them: the policy wrapped with ``FullyShardedDataParallel`` (its root unit holding the embeddings,
the final norm and the head), TRL calling the prepared model (its fused LM head patched into the
wrapped model's forward), generating with the root unit's parameters gathered
(``summon_full_params(recurse=False)``). A reference model would be a second FSDP1 model (TRL's
``prepare_fsdp``): refused, as under FSDP2.
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
    from vramplan.trace.testing import real_grpo_fsdp1_peaks

    w = Workload(task="train", batch=2, grad_accum=2, seq=24, prompt=8, precision="fp32", objective="grpo",
                 generations=2, attention="eager").replace(dp=2, **(dict(zero=3, engine="fsdp1")
                                                                   if layout == "fsdp1" else {}))
    real = real_grpo_fsdp1_peaks(CONFIG, w, world=2, layout=layout)
    spec = spec_from_config(CONFIG, name="llama-2l", source="test")
    for rank, got in enumerate(real):
        r = trace_workload(spec, w, options=TraceOptions(workspaces=False, count_flops=False, rank=rank))
        parts = dict(r.step_parts)
        assert set(parts) == {"generation", "actor"}, parts
        for part, traced in parts.items():
            assert traced == got[part] - 4 * got["adam_steps"], (rank, part, traced, got)
            assert abs(traced - got[part]) / got[part] < 1e-4
        assert got["adam_steps"] == (12 if layout == "fsdp1" else 21), got
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


def test_a_reference_model_under_fsdp1_is_refused_with_its_cause() -> None:
    with pytest.raises(WorkloadError, match="own FSDP units under FSDP1") as e:
        Workload(task="train", batch=2, seq=32, objective="dpo", reference="model",
                 parallel=Parallel(dp=2, zero=3, engine="fsdp1")).check_reference_model()
    assert e.value.field == "reference"
