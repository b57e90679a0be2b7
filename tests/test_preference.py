"""``objective=dpo`` / ``kto``: DPO and KTO as TRL 1.16's ``DPOTrainer`` and ``KTOTrainer`` run them
(:mod:`vramplan.trace.preference`).

The traced step is compared with TRL's own ``_compute_loss`` traced on the same model, called on
a stand-in for the trainer that holds the attributes the method reads (TRL 1.16's defaults: DPO's
sigmoid loss, KTO's ``kto`` loss with its KL term, β = 0.1, no weighting, no aux loss) and with the decisions TRL's head
takes on CUDA with Triton (``tests/test_trl_head.py``'s fixture). The stand-in's accelerator
answers the metrics' ``gather`` calls with host scalars, so the few device scalars the metrics
make are the one difference allowed (they are not modelled).
"""

from __future__ import annotations

import types
from collections import defaultdict
from typing import Any

import pytest
import torch
from torch import nn

from trl_harness import accelerate_autocast
from vramplan.errors import WorkloadError
from vramplan.events import Action
from vramplan.trace.preference import DPO_POLICY_OUTPUTS, KTO_POLICY_OUTPUTS
from vramplan.trace.run import TraceOptions, trace_model, trace_workload
from vramplan.workload import Parallel, Phase, Reference, Workload

transformers = pytest.importorskip("transformers")
dpo_trainer = pytest.importorskip("trl.trainer.dpo_trainer")
kto_trainer = pytest.importorskip("trl.trainer.kto_trainer")

NO_WS = TraceOptions(workspaces=False)
PAIRS, S, V, H = 2, 64, 512, 64


def _llama() -> nn.Module:
    cfg = transformers.LlamaConfig(hidden_size=H, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=4, vocab_size=V, max_position_embeddings=256, use_cache=False,
                                   tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg)


def _completion_mask(ids: torch.Tensor, prompt: int) -> torch.Tensor:
    m = torch.ones_like(ids)
    m[:, :prompt] = 0
    return m


def _inputs(source: Reference, *, attention_mask: bool, prompt: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, V, (2 * PAIRS, S), generator=torch.Generator().manual_seed(0))
    out = {"input_ids": ids, "completion_mask": _completion_mask(ids, prompt)}
    if attention_mask:
        out["attention_mask"] = torch.ones_like(ids)
    if source is Reference.PRECOMPUTED:
        out.update(ref_chosen_logps=torch.zeros(PAIRS), ref_rejected_logps=torch.zeros(PAIRS))
    return out


class _Accelerator:
    device = torch.device("meta")

    @staticmethod
    def unwrap_model(model: nn.Module) -> nn.Module:
        return model

    @staticmethod
    def gather_for_metrics(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros(())

    gather = gather_for_metrics


class _TrlDpoStep(nn.Module):
    """``DPOTrainer._compute_loss(self, model, inputs)`` as a module the trace can run."""

    def __init__(self, policy: nn.Module, ref: nn.Module | None, source: Reference) -> None:
        super().__init__()
        self.policy, self.ref = policy, ref
        self.source = source

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        trainer = types.SimpleNamespace(
            model=self.policy, ref_model=self.ref, accelerator=_Accelerator(), aux_loss_enabled=False, ld_alpha=None,
            precompute_ref_logps=self.source is Reference.PRECOMPUTED, f_divergence_type="reverse_kl",
            loss_types=["sigmoid"], loss_weights=[1.0], beta=0.1, use_weighting=False, label_smoothing=0.0,
            args=types.SimpleNamespace(gradient_checkpointing_kwargs=None),
            _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1)
        return dpo_trainer.DPOTrainer._compute_loss(trainer, self.policy, inputs, False)


def _prepared(model: nn.Module) -> nn.Module:
    """``model.forward`` wrapped as accelerate wraps it (a method, so that the trace's copy of the
    model calls its own forward)."""
    model._pre_accelerate_forward = model.forward

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with accelerate_autocast():
            return self._pre_accelerate_forward(*args, **kwargs)

    model.forward = types.MethodType(forward, model)
    return model


def _theirs(add_fused_lm_head: Any, source: Reference, peft: bool) -> nn.Module:
    policy = _llama()
    if peft:
        from peft import LoraConfig, get_peft_model

        from vramplan.workload import LORA_DEFAULT_TARGETS

        policy = get_peft_model(policy, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                   target_modules=list(LORA_DEFAULT_TARGETS)))
    # as DPOTrainer.__init__ adds the heads: on the base model (after PEFT) with its fields, and on the reference
    add_fused_lm_head(policy.get_base_model() if peft else policy, outputs=DPO_POLICY_OUTPUTS)
    ref = None
    if source is Reference.MODEL:
        ref = _llama()
        ref.requires_grad_(False)
        ref.eval()
        add_fused_lm_head(ref)
    return _TrlDpoStep(_prepared(policy), _prepared(ref) if ref is not None else None, source)


def _alloc_bytes(r: Any) -> int:
    log = r.events
    return sum(log.size[k] for k in range(len(log)) if log.action[k] == int(Action.ALLOC))


CASES = [(Reference.MODEL, "none", "fp32"), (Reference.MODEL, "none", "bf16-mixed"),
         (Reference.PRECOMPUTED, "none", "bf16-mixed"), (Reference.ADAPTERS, "lora", "bf16-mixed"),
         (Reference.ADAPTERS, "lora", "fp32")]


def test_the_reference_model_is_a_frozen_copy_in_the_policys_dtype() -> None:
    from vramplan.models.catalog import resolve

    spec = resolve("llama-3.2-1b")
    w = Workload(task="train", batch=1, seq=64, precision="bf16-mixed", objective="dpo")
    ref = trace_workload(spec, w)
    pre = trace_workload(spec, w.replace(reference="precomputed"))
    # the frozen copy: the model's fp32 weights and buffers once more, and no gradient or optimizer state
    assert ref.breakdown_at_peak.weights == 2 * pre.breakdown_at_peak.weights > 4 * ref.params
    assert ref.breakdown_at_peak.optimizer == pre.breakdown_at_peak.optimizer
    assert ref.trainable_params == pre.trainable_params == ref.params
    assert any(n.startswith("DPO reference: a frozen copy") for n in ref.notes)


def test_pairs_double_the_sequences_and_layers_are_replicated_exactly() -> None:
    from vramplan.models.catalog import resolve

    spec = resolve("llama-3.2-1b")
    w = Workload(task="train", batch=2, seq=64, precision="bf16-mixed", objective="dpo", peft="lora")
    fast = trace_workload(spec, w)
    full = trace_workload(spec, w, options=TraceOptions(replicate_layers=False))
    assert fast.peak_allocated == full.peak_allocated
    assert any("identical layers traced once" in n for n in fast.notes)
    sft = trace_workload(spec, w.replace(objective="sft", batch=4, loss="trl"))
    assert fast.peak_allocated > sft.peak_allocated * 0.9  # the same 4 sequences, plus a reference forward


@pytest.mark.parametrize("method", ["trace", "analytic"])
def test_a_reference_copy_under_parallelism_is_refused_by_both_methods(small_llama: Any, method: str) -> None:
    from vramplan.analytic.estimate import estimate

    # (DeepSpeed ZeRO-2: TRL's prepare_deepspeed, whose engine neither method runs (the trace refuses the policy's
    # layout first); DDP's replica and FSDP's layouts are modelled, tests/test_rl_fsdp1.py)
    from vramplan.errors import TraceError

    w = Workload(task="train", batch=1, seq=64, objective="dpo", parallel=Parallel(dp=2, zero=2))
    with pytest.raises((WorkloadError, TraceError), match="reference model under data or model parallelism|"
                                                          "DeepSpeed ZeRO-2 is not traced"):
        estimate(small_llama, w) if method == "analytic" else trace_workload(small_llama, w)


def test_dpo_workloads_are_checked() -> None:
    with pytest.raises(WorkloadError, match="training objective"):
        Workload(task="infer", objective="dpo")
    with pytest.raises(WorkloadError, match="no adapters|there are none"):
        Workload(task="train", objective="dpo", reference="adapters")
    assert Workload(task="train", objective="dpo").reference_source is Reference.MODEL
    assert Workload(task="train", objective="dpo", peft="lora").reference_source is Reference.ADAPTERS
    assert Workload(task="train", objective="dpo", batch=3).sequences == 6
    assert any("`reference`" in n for n in Workload(task="train", reference="model").setting_notes())


@pytest.mark.parametrize("objective", ["dpo", "kto"])
@pytest.mark.parametrize("kw", [{}, {"peft": "lora"}, {"reference": "precomputed"}, {"precision": "bf16"},
                                {"parallel": Parallel(dp=2, zero=3)}],
                         ids=["model", "adapters", "precomputed", "bf16", "fsdp2"])
def test_analytic_agrees_with_the_trace(small_llama: Any, objective: str, kw: dict) -> None:
    from vramplan.analytic.estimate import estimate

    batch = 2 if objective == "dpo" else 4  # (four sequences either way)
    w = Workload(**{"task": "train", "batch": batch, "seq": 512, "precision": "bf16-mixed", "objective": objective,
                    **kw})
    a, r = estimate(small_llama, w), trace_workload(small_llama, w)
    assert abs(r.peak_allocated - a.peak.allocated) / a.peak.allocated < 0.05, (r.peak_allocated, a.peak.allocated)


@pytest.mark.parametrize("objective", ["dpo", "kto"])
def test_the_analytic_fsdp2_reference_gathers_as_the_trace_does(objective: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under FSDP2 TRL shards the reference as one unit: its forward, after the policy's, gathers all of
    it (the flat all-gather output and the parameters copied out of it). Llama-3.2-1B's width with 2
    layers, where the gather is the forward's peak: the analytic forward phase is the trace's within 1 %
    (weights but for the two copies' rotary buffers), and not without the gather (the policy's own forward instant)."""
    import importlib

    from vramplan.models.catalog import resolve
    from vramplan.models.normalize import spec_from_config
    from vramplan.trace import analysis
    from vramplan.workload import Phase

    analytic = importlib.import_module("vramplan.analytic.estimate")
    c = dict(resolve("llama-3.2-1b").config)
    c["num_hidden_layers"] = 2
    spec = spec_from_config(c, name="llama-3.2-1b-2-layers", source="test")
    w = Workload(task="train", batch=1 if objective == "dpo" else 2, seq=256, precision="bf16-mixed",
                 objective=objective, parallel=Parallel(dp=2, zero=3))
    a, r = analytic.estimate(spec, w), trace_workload(spec, w)
    fa = next(ph for ph in a.phases if ph.phase is Phase.FORWARD)
    ft = next(ph for ph in analysis.phase_peaks(analysis.arrays(r.events)) if ph.phase is Phase.FORWARD)
    assert 0 <= ft.breakdown.weights - fa.breakdown.weights <= 512, (fa.breakdown, ft.breakdown)  # (2 rotary inv_freq)
    assert abs(fa.allocated - ft.allocated) / ft.allocated < 0.01, (fa.allocated, ft.allocated)
    assert any("gathers all of it at once" in n for n in a.notes)
    monkeypatch.setattr(analytic, "_sharded_reference_forward", lambda ph, *rest: ph)  # (the policy's instant)
    without = next(ph for ph in analytic.estimate(spec, w).phases if ph.phase is Phase.FORWARD)
    # (4.9 %: the policy's own forward instant holds its last block's all-gather output since session 53)
    assert (ft.allocated - without.allocated) / ft.allocated > 0.04, (without.allocated, ft.allocated)


def _two_layer_1b() -> Any:
    from vramplan.models.catalog import resolve
    from vramplan.models.normalize import spec_from_config

    c = dict(resolve("llama-3.2-1b").config)
    c["num_hidden_layers"] = 2
    return spec_from_config(c, name="llama-3.2-1b-2-layers", source="test")


def test_the_analytic_fsdp2_grpo_reference_gathers_in_the_rollout_as_the_trace_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """GRPO's reference under FSDP2 (one unit, TRL's prepare_fsdp) scores the window in the rollout,
    after the generation: each chunk's forward gathers all of it (the flat all-gather output, held
    through the forward, and the parameters copied out of it) beside the policy's shards and
    optimizer states. Llama-3.2-1B's width with 2 layers: the analytic forward phase is the trace's
    within 1 %, its weights to the byte but for the two copies' rotary buffers; without the gather
    (the policy's training forward alone) it is over 2 % low."""
    import importlib

    from vramplan.results import Breakdown, PhasePeak
    from vramplan.trace import analysis

    analytic = importlib.import_module("vramplan.analytic.estimate")
    spec = _two_layer_1b()
    w = Workload(task="train", batch=2, seq=40, prompt=32, generations=2, precision="bf16-mixed", objective="grpo",
                 reference="model", parallel=Parallel(dp=2, zero=3))
    a, r = analytic.estimate(spec, w), trace_workload(spec, w)
    fa = next(ph for ph in a.phases if ph.phase is Phase.FORWARD)
    ft = next(ph for ph in analysis.phase_peaks(analysis.arrays(r.events)) if ph.phase is Phase.FORWARD)
    assert 0 <= ft.breakdown.weights - fa.breakdown.weights <= 512, (fa.breakdown, ft.breakdown)
    assert abs(fa.allocated - ft.allocated) / ft.allocated < 0.01, (fa.allocated, ft.allocated)
    assert any("scoring forwards" in n for n in a.notes)
    grpo = importlib.import_module("vramplan.analytic.grpo")
    monkeypatch.setattr(grpo, "_sharded_reference_scoring", lambda *args: PhasePeak(Phase.FORWARD, 0, Breakdown()))
    without = next(ph for ph in analytic.estimate(spec, w).phases if ph.phase is Phase.FORWARD)
    assert (ft.allocated - without.allocated) / ft.allocated > 0.02, (without.allocated, ft.allocated)


@pytest.mark.parametrize("objective", ["dpo", "grpo"])
def test_a_reference_under_ddp_is_a_replica_in_both_methods(objective: str) -> None:
    """Under DDP TRL leaves the reference unwrapped (``prepare_model(ref, evaluation_mode=True)``): a
    whole replica per rank. What it adds to the step's peak, traced and analytic, is its whole
    weights (the traced ones with its two rotary buffers), the same in both methods (Llama-3.2-1B's
    width with 2 layers, where the step peaks in the backward; the analytic SFT step itself is ~5 %
    under the trace there, with or without a reference: its 128k-vocabulary head dominates)."""
    import importlib

    analytic = importlib.import_module("vramplan.analytic.estimate")
    spec = _two_layer_1b()
    base = dict(task="train", batch=1, seq=64, precision="bf16-mixed", parallel=Parallel(dp=2), objective=objective)
    if objective == "grpo":
        base.update(batch=2, prompt=56, generations=2)
    without = "none" if objective == "grpo" else "precomputed"
    a = {ref: analytic.estimate(spec, Workload(reference=ref, **base)).peak.allocated for ref in ("model", without)}
    t = {ref: trace_workload(spec, Workload(reference=ref, **base)).peak_allocated for ref in ("model", without)}
    weights = 4 * (spec.params or 0)  # (fp32: the policy's dtype, as TRL loads the reference)
    assert a["model"] - a[without] == weights, a
    assert 0 <= t["model"] - t[without] - weights <= 512, (t, weights)



@pytest.mark.parametrize("objective", ["dpo", "kto", "grpo"])
def test_a_zero2_fsdp2_reference_stays_gathered_in_both_methods(objective: str, small_llama: Any) -> None:
    """FSDP2 ZeRO-2 (``reshard_after_forward=False``, which TRL's prepare_fsdp passes to the one unit
    over the reference): its first forward gathers it and no backward reshards it, so from then on it
    holds its shard and its whole weights in the gathered dtype. At the optimizer step (where the
    first step's forward has run) the reference adds exactly that in the trace (and its two rotary
    buffers) and in the analytic method, and what it adds to the step's peak agrees within 1 %."""
    import importlib

    analytic = importlib.import_module("vramplan.analytic.estimate")
    base = dict(task="train", batch=1, seq=64, precision="bf16-mixed", objective=objective,
                parallel=Parallel(dp=2, zero=2, engine="fsdp"))
    if objective == "grpo":
        base.update(batch=2, prompt=56, generations=2)
    without = "none" if objective == "grpo" else "precomputed"
    a = {ref: analytic.estimate(small_llama, Workload(reference=ref, **base)) for ref in ("model", without)}
    t = {ref: trace_workload(small_llama, Workload(reference=ref, **base)) for ref in ("model", without)}
    params = small_llama.params or 0
    held = 4 * params // 2 + 2 * params  # (its fp32 shard, dp 2, and its whole bf16 weights)

    def at_step(r: Any) -> int:
        return next(ph.breakdown.weights for ph in r.phases if ph.phase is Phase.OPTIMIZER)

    assert at_step(a["model"]) - at_step(a[without]) == held
    assert 0 <= at_step(t["model"]) - at_step(t[without]) - held <= 512, (at_step(t["model"]), at_step(t[without]))
    # (the step's peak: what the reference adds to it is the same in both methods, within 1 % of the peak;
    # the analytic policy step itself is ~2 % under the trace on this model, with or without a reference)
    grow_a = a["model"].peak.allocated - a[without].peak.allocated
    grow_t = t["model"].peak_allocated - t[without].peak_allocated
    assert abs(grow_a - grow_t) < 0.01 * t["model"].peak_allocated, (grow_a, grow_t)
    assert any("reshard_after_forward=False" in n for n in a["model"].notes)


@pytest.mark.parametrize("objective", ["dpo", "grpo"])
def test_the_first_zero2_reference_forward_gathers_before_the_optimizer_states_exist(
        objective: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """At dp 8 the optimizer's shard is small beside the reference's second copy: the forward phase
    is the first step's reference gather (the flat all-gather output and the parameters copied out of
    it, before AdamW's first step creates its states). Llama-3.2-1B's width with 2 layers: the
    analytic forward phase within 1 % of the trace's, its weights to the rotary buffers. (DPO: a later
    step's first policy gathers, the first block's unshard beside the root's all-gather output, come
    within 0.3 % of it in the trace and in the analytic method, 0.9992 of the trace's: the first
    step's gather is checked with that instant left out, and the forward phase with it. GRPO's policy
    under ZeRO-2 stays gathered from the rollout: its training forward gathers nothing.)"""
    import importlib

    from vramplan.trace import analysis

    analytic = importlib.import_module("vramplan.analytic.estimate")
    spec = _two_layer_1b()
    kw: dict[str, Any] = dict(batch=1, seq=256) if objective == "dpo" else dict(batch=2, seq=40, prompt=32, generations=2)
    w = Workload(task="train", precision="bf16-mixed", objective=objective, reference="model",
                 parallel=Parallel(dp=8, zero=2, engine="fsdp"), **kw)
    r = trace_workload(spec, w)
    ft = next(ph for ph in analysis.phase_peaks(analysis.arrays(r.events)) if ph.phase is Phase.FORWARD)
    fa = next(ph for ph in analytic.estimate(spec, w).phases if ph.phase is Phase.FORWARD)
    assert abs(fa.allocated - ft.allocated) / ft.allocated < 0.01, (fa.allocated, ft.allocated)
    monkeypatch.setattr(analytic, "with_forward_start", lambda st, ws, phases: phases)
    fa = next(ph for ph in analytic.estimate(spec, w).phases if ph.phase is Phase.FORWARD)
    assert fa.breakdown.optimizer == ft.breakdown.optimizer == 0, (fa.breakdown, ft.breakdown)
    assert 0 <= ft.breakdown.weights - fa.breakdown.weights <= 512, (fa.breakdown, ft.breakdown)
    assert abs(fa.allocated - ft.allocated) / ft.allocated < 0.01, (fa.allocated, ft.allocated)


# --------------------------------------------------------------------------- KTO
def _kto_inputs(source: Reference, *, attention_mask: bool, prompt: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (PAIRS, S), generator=g)
    out = {"input_ids": ids, "completion_mask": _completion_mask(ids, prompt), "KL_input_ids": ids.roll(1, 0),
           "KL_completion_mask": _completion_mask(ids, prompt), "label": torch.tensor([True, False])}
    if attention_mask:
        out.update(attention_mask=torch.ones_like(ids), KL_attention_mask=torch.ones_like(ids))
    if source is Reference.PRECOMPUTED:
        out.update(ref_logps=torch.zeros(PAIRS), ref_KL_logps=torch.zeros(PAIRS))
    return out


class _TrlKtoStep(_TrlDpoStep):
    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        trainer = types.SimpleNamespace(
            model=self.policy, ref_model=self.ref, accelerator=_Accelerator(), aux_loss_enabled=False,
            calculate_KL=True, precompute_ref_logps=self.source is Reference.PRECOMPUTED, loss_type="kto", beta=0.1,
            desirable_weight=1.0, undesirable_weight=1.0,
            args=types.SimpleNamespace(gradient_checkpointing_kwargs=None),
            _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
        trainer._compute_kl_logps = types.MethodType(kto_trainer.KTOTrainer._compute_kl_logps, trainer)
        return kto_trainer.KTOTrainer._compute_loss(trainer, self.policy, inputs, False)


def _theirs_kto(add_fused_lm_head: Any, source: Reference, peft: bool) -> nn.Module:
    def heads(m: nn.Module, outputs: tuple[str, ...] = ("log_probs",)) -> None:  # as KTOTrainer.__init__ adds them
        add_fused_lm_head(m, outputs=KTO_POLICY_OUTPUTS if outputs != ("log_probs",) else outputs)

    step = _theirs(heads, source, peft)
    return _TrlKtoStep(step.policy, step.ref, source)


@pytest.mark.parametrize("objective", ["dpo", "kto"])
@pytest.mark.parametrize(("source", "peft", "precision"), CASES, ids=[f"{s}-{p}-{q}" for s, p, q in CASES])
def test_the_step_allocates_what_trls_compute_loss_allocates(trl_on_cuda: Any, objective: str, source: Reference,
                                                             peft: str, precision: str) -> None:
    add_fused_lm_head, set_autocast = trl_on_cuda
    set_autocast(torch.bfloat16 if precision.endswith("-mixed") else None)
    theirs_step, inputs = (_theirs, _inputs) if objective == "dpo" else (_theirs_kto, _kto_inputs)
    base = Workload(task="train", optimizer="adamw", precision=precision)
    theirs = trace_model(lambda: theirs_step(add_fused_lm_head, source, peft == "lora"),
                         inputs(source, attention_mask=True), workload=base, loss_fn=lambda out: out, options=NO_WS)
    # (TRL's policy here is the fp32 model with fp32 LoRA adapters: vramplan's LoRA base is bf16 unless told)
    w = base.replace(objective=objective, reference=source, peft=peft,
                     **({"peft_base_dtype": "fp32"} if peft == "lora" else {}))
    ours = trace_model(_llama, inputs(source, attention_mask=False), workload=w, options=NO_WS)
    assert ours.trainable_params == theirs.trainable_params
    # every trainable parameter has its gradient before the step (a weight cast cached under no_grad and
    # reused with gradients would leave some without)
    step = next(p for p in ours.phases if p.phase is Phase.OPTIMIZER)
    assert step.breakdown.gradients >= 2 * ours.trainable_params
    # theirs holds the collator's all-ones attention masks as inputs (DPO: one of 2·PAIRS sequences; KTO: the
    # batch's and the KL batch's, PAIRS sequences each; the trace leaves them out: transformers builds no mask
    # from them) and a few bytes of the metrics' device scalars
    masks = 2 * PAIRS * S * 8
    for a, b in zip(ours.phases, theirs.phases, strict=True):
        assert a.phase == b.phase
        assert masks <= b.allocated - a.allocated <= masks + 64, (a.phase, a.allocated, b.allocated)
    assert masks <= theirs.peak_allocated - ours.peak_allocated <= masks + 64


def test_kto_runs_one_sequence_per_example() -> None:
    assert Workload(task="train", objective="kto", batch=3).sequences == 3
    assert Workload(task="train", objective="kto", peft="lora").reference_source is Reference.ADAPTERS


@pytest.mark.parametrize("objective", ["dpo", "kto"])
def test_a_prompt_is_not_scored(objective: str) -> None:
    """``prompt=P``: the head copies and scores ``S - P`` positions per sequence (TRL's
    ``hidden[mask]`` over the completion tokens; the trace takes them by slicing, a copy of the
    same size, since it does not hold the mask's values), not the ``S - 1`` of ``prompt=0``."""
    prompt = 24
    sequences = 2 * PAIRS if objective == "dpo" else PAIRS
    inputs = _inputs if objective == "dpo" else _kto_inputs
    w = Workload(task="train", optimizer="adamw", precision="fp32", objective=objective, reference="precomputed",
                 seq=S, prompt=prompt)
    rows = {}
    for p in (0, prompt):
        r = trace_model(_llama, inputs(Reference.PRECOMPUTED, attention_mask=False, prompt=p),
                        workload=w.replace(prompt=p), options=NO_WS)
        rows[p] = {d for _, d in _allocs_with_desc(r)}
    assert f"f32[{sequences * (S - 1)},{H}]" in rows[0] and f"f32[{sequences * (S - prompt)},{H}]" not in rows[0]
    assert f"f32[{sequences * (S - prompt)},{H}]" in rows[prompt] and f"f32[{sequences * (S - 1)},{H}]" not in rows[prompt]
    with pytest.raises(WorkloadError, match="prompt"):
        Workload(task="train", objective=objective, seq=64, prompt=64)


def _allocs_with_desc(r: Any) -> list[tuple[int, str]]:
    log = r.events
    return [(log.size[k], log.strings[log.desc[k]]) for k in range(len(log)) if log.action[k] == int(Action.ALLOC)]


# --------------------------------------------------------------------------- a vision-language policy
def _qwen_vl() -> nn.Module:
    from test_vlm import TINY

    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in TINY.items() if k != "architectures"})
    return transformers.Qwen2_5_VLForConditionalGeneration(cfg)


def test_dpo_of_a_vision_language_model_allocates_what_trls_compute_loss_allocates(trl_on_cuda: Any) -> None:
    """DPOTrainer on Qwen2.5-VL: its collator repeats each pair's images for the chosen and the
    rejected sequence, and ``_compute_loss`` passes the pixels and the image grid to the policy and
    to the reference (``model_kwargs``: every input but its own keys)."""
    from test_vlm import TINY
    from vramplan.models.normalize import spec_from_config
    from vramplan.models.vlm import inputs as vlm_inputs

    add_fused_lm_head, set_autocast = trl_on_cuda
    set_autocast(None)
    spec = spec_from_config(TINY, name="tiny-qwen-vl", source="test")
    kw, _ = vlm_inputs(spec, batch=2 * PAIRS, seq=S, images=1, width=112, height=84, device="cpu", labels=False)
    kw["completion_mask"] = torch.ones_like(kw["input_ids"])

    def theirs_step() -> nn.Module:
        policy, ref = _qwen_vl(), _qwen_vl()
        ref.requires_grad_(False)
        ref.eval()
        add_fused_lm_head(policy, outputs=DPO_POLICY_OUTPUTS)
        add_fused_lm_head(ref)
        return _TrlDpoStep(_prepared(policy), _prepared(ref), Reference.MODEL)

    base = Workload(task="train", optimizer="adamw", precision="fp32")
    assert "attention_mask" in kw  # (the processor's, as TRL's collator passes it)
    theirs = trace_model(theirs_step, dict(kw), workload=base, loss_fn=lambda out: out, options=NO_WS)
    ours = trace_model(_qwen_vl, dict(kw), workload=base.replace(objective="dpo", reference="model"), options=NO_WS)
    assert ours.trainable_params == theirs.trainable_params
    for a, b in zip(ours.phases, theirs.phases, strict=True):
        assert a.phase == b.phase
        assert 0 <= b.allocated - a.allocated <= 64, (a.phase, a.allocated, b.allocated)  # (the metrics' scalars)
