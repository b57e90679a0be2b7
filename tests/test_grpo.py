"""``objective=grpo``: GRPO as TRL 1.16's ``GRPOTrainer`` runs it (:mod:`vramplan.trace.grpo`).

Each part of the traced step is compared with the code it models, traced on the same model:
the training micro-step with TRL's own ``GRPOTrainer._compute_loss`` (a stand-in for the
trainer holding the attributes it reads, TRL 1.16's defaults: ``loss_type='dapo'``, token-level
importance sampling, no entropy bonus; its accelerator answers the metrics' ``reduce``/``gather``
with host values, so the metrics' device scalars are the one difference allowed), the reference
scoring with TRL's ``_get_per_token_logps_and_entropies`` under ``no_grad``, and the rollout with
transformers' own ``generate`` (sampling; no EOS token, so that it runs to ``max_new_tokens``
without reading sampled values, as the trace's every-completion-at-full-length bound).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import types
from collections import Counter, defaultdict
from typing import Any

import pytest
import torch
from torch import nn

from trl_harness import accelerate_autocast
from vramplan.errors import WorkloadError
from vramplan.events import Action, Category
from vramplan.trace import grpo
from vramplan.trace.run import TraceOptions, trace_model, trace_workload
from vramplan.trace.session import TraceSession
from vramplan.workload import KVDtype, Objective, Parallel, Phase, Reference, Workload

transformers = pytest.importorskip("transformers")
grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")

NO_WS = TraceOptions(workspaces=False)
B, P, C, V, H = 4, 16, 48, 512, 64


def _llama(**kw: Any) -> nn.Module:
    cfg = transformers.LlamaConfig(hidden_size=H, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=V, max_position_embeddings=256,
                                   tie_word_embeddings=False, **kw)
    return transformers.LlamaForCausalLM(cfg)


def _window(n: int, *, ref: bool = False, vllm: bool = False) -> dict[str, torch.Tensor]:
    """A micro-batch as ``_generate_and_score_completions`` leaves it: left-padded prompts (one
    padded position), completions, their masks, advantages, the token count (with vLLM: the old and
    sampling log-probabilities and the sequence-level importance-sampling ratio)."""
    pm = torch.ones(n, P, dtype=torch.long)
    pm[0, 0] = 0
    out = {"prompt_ids": torch.zeros(n, P, dtype=torch.long), "prompt_mask": pm,
           "completion_ids": torch.zeros(n, C, dtype=torch.long), "completion_mask": torch.ones(n, C, dtype=torch.long),
           "advantages": torch.zeros(n), "num_items_in_batch": torch.tensor(n * C)}
    if ref:
        out["ref_per_token_logps"] = torch.zeros(n, C)
    if vllm:
        out.update(old_per_token_logps=torch.zeros(n, C), importance_sampling_ratio=torch.ones(n, 1),
                   sampling_per_token_logps=torch.zeros(n, C))
    return out


class _Accelerator:
    device = torch.device("meta")
    num_processes = 1
    is_main_process = True

    @staticmethod
    def autocast() -> Any:
        return contextlib.nullcontext()

    @staticmethod
    def reduce(t: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return torch.zeros(2)

    @staticmethod
    def gather(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros(1)


def _trainer(model: nn.Module, beta: float, vllm: bool = False) -> Any:
    t = types.SimpleNamespace(
        accelerator=_Accelerator(), top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=beta, loss_type="dapo", epsilon_low=0.2, epsilon_high=0.2,
        args=types.SimpleNamespace(delta=None, steps_per_generation=1, use_bias_correction_kl=False), use_vllm=vllm,
        vllm_importance_sampling_correction=vllm,
        model=model, current_gradient_accumulation_steps=1, _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)})
    t._get_per_token_logps_and_entropies = types.MethodType(
        grpo_trainer.GRPOTrainer._get_per_token_logps_and_entropies, t)
    return t


def _prepared(model: nn.Module) -> nn.Module:
    """``model.forward`` wrapped as accelerate wraps it: a method (the trace's copy of the model
    calls its own forward) that keeps the forward's signature (accelerate's ``functools.wraps``:
    ``generate`` sees ``position_ids`` and passes them)."""
    model._pre_accelerate_forward = model.forward
    sig = inspect.signature(model.forward)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with accelerate_autocast():
            return self._pre_accelerate_forward(*args, **kwargs)

    forward.__signature__ = sig.replace(  # type: ignore[attr-defined]
        parameters=[inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY), *sig.parameters.values()])
    model.forward = types.MethodType(forward, model)
    return model


class _TrlLoss(nn.Module):
    def __init__(self, model: nn.Module, beta: float, vllm: bool = False) -> None:
        super().__init__()
        self.m, self.beta, self.vllm = model, beta, vllm

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        return grpo_trainer.GRPOTrainer._compute_loss(_trainer(self.m, self.beta, self.vllm), self.m, inputs)


class _OurLoss(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        sess = TraceSession.current()
        assert sess is not None
        ac = sess.autocast.dtype if sess.autocast is not None and sess.autocast.enabled else None
        _held, loss = grpo.forward_loss(self.m, inputs, steps=1, autocast=ac, region=accelerate_autocast)
        return loss


def _allocs(r: Any) -> Counter[tuple[str, int]]:
    log = r.events
    return Counter((log.strings[log.desc[k]], log.phase[k]) for k in range(len(log))
                   if log.action[k] == int(Action.ALLOC))


SCALARS = {"f32[]", "i64[]", "f32[1]", "bool[]", "bool[4]"}
"""The metrics' (and generate's stopping checks') device scalars, read on the host."""


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
@pytest.mark.parametrize("beta,vllm", [(0.0, False), (0.04, False), (0.04, True)], ids=["no-reference", "kl", "vllm"])
def test_the_micro_step_allocates_what_trls_compute_loss_allocates(trl_on_cuda: Any, precision: str,
                                                                   beta: float, vllm: bool) -> None:
    add_fused_lm_head, set_autocast = trl_on_cuda
    set_autocast(torch.bfloat16 if precision.endswith("-mixed") else None)

    def theirs() -> nn.Module:
        m = _llama()
        add_fused_lm_head(m, outputs=grpo.POLICY_OUTPUTS)  # as GRPOTrainer.__init__ adds it
        return _TrlLoss(_prepared(m), beta, vllm)

    w = Workload(task="train", optimizer="adamw", precision=precision)
    window = _window(B, ref=beta > 0, vllm=vllm)
    a = trace_model(theirs, window, workload=w, loss_fn=lambda out: out, options=NO_WS)
    b = trace_model(lambda: _OurLoss(_llama()), window, workload=w, loss_fn=lambda out: out, options=NO_WS)
    for x, y in zip(a.phases, b.phases, strict=True):
        assert x.phase == y.phase
        assert 0 <= x.allocated - y.allocated <= 64, (x.phase, x.allocated, y.allocated)
    extra = _allocs(a) - _allocs(b)
    assert not _allocs(b) - _allocs(a)
    assert {d for d, _ in extra} <= SCALARS, extra
    # TRL's head scored the completion tokens only: B x C rows of the hidden states, no more
    assert any(d.endswith(f"[{B * C},{H}]") for d, _ in _allocs(b))
    assert not any(d.endswith(f"[{B * (P + C - 1)},{H}]") for d, _ in _allocs(b))


@pytest.mark.parametrize("outputs", [grpo.REF_OUTPUTS, grpo.POLICY_OUTPUTS], ids=["reference", "policy-old-logps"])
def test_the_scoring_is_trls_in_chunks_of_the_micro_batch(trl_on_cuda: Any, outputs: tuple[str, ...]) -> None:
    """The reference's log-probabilities, and the policy's own under ``no_grad`` (with vLLM: TRL's
    ``old_per_token_logps`` through the policy's head, which has the entropy output too)."""
    add_fused_lm_head, set_autocast = trl_on_cuda
    set_autocast(None)
    window = 3 * B

    class Theirs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = _llama()
            add_fused_lm_head(self.m, outputs=outputs)

        def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                logps, _e, _a = _trainer(self.m, 0.04)._get_per_token_logps_and_entropies(
                    self.m, ids, mask, C, batch_size=B)
            return logps

    class Ours(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = _llama()

        def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                logps, _e = grpo._logps(self.m, ids, mask, C, B, None, contextlib.nullcontext, outputs,
                                        entropy=False)
            return logps

    mask = torch.ones(window, P + C, dtype=torch.long)
    mask[0, 0] = 0
    inputs = {"ids": torch.zeros(window, P + C, dtype=torch.long), "mask": mask}
    w = Workload(task="infer", precision="fp32")
    a, b = (trace_model(m, inputs, workload=w, options=NO_WS) for m in (Theirs, Ours))
    # TRL's head also computes its (unused) mean loss per chunk: a few device scalars
    assert not _allocs(b) - _allocs(a)
    assert {d for d, _ in _allocs(a) - _allocs(b)} <= SCALARS
    assert 0 <= a.peak_allocated - b.peak_allocated <= 512


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_the_rollout_allocates_what_transformers_generate_allocates(precision: str) -> None:
    new = 12
    kw = {"eos_token_id": None, "bos_token_id": None, "pad_token_id": 0}

    class Theirs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = _prepared(_llama(**kw))

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            cfg = transformers.GenerationConfig(max_new_tokens=new, do_sample=True, temperature=1.0, top_p=1.0,
                                                top_k=0, pad_token_id=0, eos_token_id=None, disable_compile=True)
            with torch.no_grad():
                return self.m.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=cfg)

    class Ours(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = _llama(**kw)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            sess = TraceSession.current()
            with torch.no_grad():
                return grpo.generate(sess, self.m, input_ids, attention_mask, new, accelerate_autocast, "dynamic",
                                     KVDtype.AUTO, torch.bfloat16 if precision != "fp32" else torch.float32, [],
                                     eos=False)

    mask = torch.ones(B, P, dtype=torch.long)
    mask[0, 0] = 0
    inputs = {"input_ids": torch.zeros(B, P, dtype=torch.long), "attention_mask": mask}
    # (task=train runs the forward under autocast as the trainer's model does; nothing here has gradients)
    w = Workload(task="infer", precision="fp32")
    if precision != "fp32":
        w = Workload(task="infer", precision="bf16-mixed")
    a, b = (trace_model(m, inputs, workload=w, options=NO_WS) for m in (Theirs, Ours))
    assert 0 <= a.peak_allocated - b.peak_allocated <= 64, (a.peak_allocated, b.peak_allocated)
    theirs, ours = (Counter(d for (d, _p), n in _allocs(r).items() for _ in range(n)) for r in (a, b))
    extra = theirs - ours  # (by shape: the trace's rollout names its phases prefill and decode)
    assert not ours - theirs
    # transformers' own bookkeeping: stopping-check scalars, the prompt mask's padding checks and
    # the rotary inv_freq moved to the device once more
    assert set(extra) <= SCALARS | {f"bool[{B},{P}]", f"f32[{H // 4 // 2}]"}, extra


def test_multinomial_holds_a_temporary_the_size_of_the_probabilities() -> None:
    """ATen's one-sample path: ``q = empty_like(p).exponential_(1)``, ``p / q``, argmax."""

    class Draw(nn.Module):
        def forward(self, p: torch.Tensor) -> torch.Tensor:
            return torch.multinomial(p, 1)

    r = trace_model(Draw, {"p": torch.rand(8, 1000)}, workload=Workload(task="infer", precision="fp32"),
                    options=NO_WS)
    log = r.events
    temps = [log.size[k] for k in range(len(log)) if log.action[k] == int(Action.ALLOC)
             and log.category[k] == int(Category.TEMPORARY) and log.strings[log.desc[k]] == "f32[8,1000]"]
    assert temps == [8 * 1000 * 4] * 2  # (one per traced iteration)


def _llama_1b_two_layers() -> Any:
    """Llama-3.2-1B at its full width, cut to 2 layers: what the step tests check holds per layer
    and per phase (every layer is traced here: the GRPO step's notes keep layers from being
    replicated), so 2 layers check it as 16 do, at an eighth of the trace."""
    from vramplan.models.catalog import resolve
    from vramplan.models.normalize import spec_from_config

    spec = resolve("llama-3.2-1b")
    return spec_from_config({**spec.config, "num_hidden_layers": 2}, name="llama-3.2-1b-2l", source=spec.source)


def test_a_step_is_a_rollout_then_the_micro_steps() -> None:
    spec = _llama_1b_two_layers()
    w = Workload(task="train", batch=2, grad_accum=2, seq=80, prompt=16, precision="bf16-mixed", objective="grpo",
                 generations=4, peft="lora")
    r = trace_workload(spec, w)
    phases = {p.phase: p for p in r.phases}
    assert {Phase.PREFILL, Phase.DECODE, Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER} <= set(phases)
    # the rollout's KV cache: the whole window (batch x grad_accum) at prompt + completion tokens, bf16
    c = spec.config
    per_token = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * (c["hidden_size"] // c["num_attention_heads"]) * 2
    assert phases[Phase.DECODE].breakdown.kv_cache >= per_token * 4 * (80 - 1)
    assert phases[Phase.DECODE].breakdown.kv_cache <= per_token * 4 * 80
    assert phases[Phase.FORWARD].breakdown.kv_cache == 0
    assert any(n.startswith("GRPO peaks: generation") for n in r.notes)
    assert any("rollout decode steps" in n for n in r.notes)  # the decode steps' exact progression


@pytest.mark.parametrize("kw", [{}, {"reference": "model"}, {"peft": "lora"}, {"precision": "bf16"},
                                {"batch": 2, "grad_accum": 4, "generations": 8}],
                         ids=["full", "reference", "lora", "bf16", "window"])
def test_analytic_agrees_with_the_trace(small_llama: Any, kw: dict) -> None:
    from vramplan.analytic.estimate import estimate

    w = Workload(**{"task": "train", "batch": 4, "seq": 512, "prompt": 128, "precision": "bf16-mixed",
                    "objective": "grpo", "generations": 4, **kw})
    a, r = estimate(small_llama, w), trace_workload(small_llama, w)
    assert abs(r.peak_allocated - a.peak.allocated) / a.peak.allocated < 0.05, (r.peak_allocated, a.peak.allocated)
    gen = {p.phase: p.allocated for p in a.phases}
    traced = {p.phase: p.allocated for p in r.phases}
    assert abs(gen[Phase.DECODE] - traced[Phase.DECODE]) / traced[Phase.DECODE] < 0.05


def test_grpo_workloads_are_checked() -> None:
    with pytest.raises(WorkloadError, match="prompt"):
        Workload(task="train", objective="grpo", batch=8)
    with pytest.raises(WorkloadError, match="whole groups"):
        Workload(task="train", objective="grpo", batch=6, seq=64, prompt=8)
    with pytest.raises(WorkloadError, match="cannot be precomputed"):
        Workload(task="train", objective="grpo", batch=8, seq=64, prompt=8, reference="precomputed")
    with pytest.raises(WorkloadError, match="needs a reference"):
        Workload(task="train", objective="dpo", reference="none")
    w = Workload(task="train", objective="grpo", batch=8, seq=64, prompt=8)
    assert (w.reference_source, w.completion, w.sequences, w.batch_step) == (Reference.NONE, 56, 8, 8)
    assert Workload(task="train", objective="grpo", batch=2, grad_accum=4, seq=64, prompt=8).batch_step == 2
    assert Workload(task="train", objective="grpo", batch=8, seq=64, prompt=8, peft="lora",
                    reference="auto").reference_source is Reference.NONE
    assert w.objective is Objective.GRPO


def test_the_largest_batch_holds_whole_groups(small_llama: Any) -> None:
    from vramplan.engine import estimate as run_estimate

    w = Workload(task="train", objective="grpo", batch=8, seq=256, prompt=64, precision="bf16-mixed")
    r = run_estimate(small_llama, w, gpu="rtx-4090", method="analytic")
    assert r.verdict is not None and r.verdict.max_batch and r.verdict.max_batch % 8 == 0


def test_trls_own_grpo_script_under_vramplan_run_agrees_with_the_recipe(tmp_path: Any) -> None:
    """``vramplan run -- python trl/scripts/grpo.py …`` (TRL's script, unmodified: its trainer's
    ``generate``, the completions decoded for the reward function, the step) and ``estimate
    --recipe trl-grpo`` with the same settings: batch 2, 2 generations, 16-token completions after
    the chat template's 21-token prompts, fp32, the zoo's 2-layer Llama."""
    import sys
    from pathlib import Path

    import vramplan
    from vramplan.engine import resolve_gpu, resolve_model
    from vramplan.hardware.target import device_profile
    from vramplan.recipes import apply

    sys.path.insert(0, str(Path(__file__).parent))
    from zoo import fixtures, package_dir

    fixtures(tmp_path)
    script = package_dir("trl")
    assert script is not None
    argv = ["--model_name_or_path", str(tmp_path / "hf/model"), "--per_device_train_batch_size", "2",
            "--max_steps", "3", "--output_dir", str(tmp_path / "out"), "--report_to", "none", "--save_strategy", "no",
            "--dataloader_num_workers", "0", "--bf16", "False", "--dataset_name", str(tmp_path / "hf/prompts"),
            "--reward_funcs", "think_format_reward", "--num_generations", "2", "--max_completion_length", "16"]
    run = vramplan.run_script(script / "scripts" / "grpo.py", argv, gpu="h100-sxm", workspaces=False, steps=2)
    w = apply("trl-grpo", task="train", batch=2, seq=37, prompt=21, generations=2, precision="fp32")
    est = trace_workload(resolve_model(str(tmp_path / "hf/model")), w,
                         device=device_profile(resolve_gpu("h100-sxm"), workspaces=False))
    assert abs(est.peak_allocated - run.peak.allocated) <= 0.005 * run.peak.allocated, (est.peak_allocated,
                                                                                       run.peak.allocated)


# --------------------------------------------------------------------------- rollout=vllm (colocated)
def _engine(sleep: bool, scale: int = 1) -> Any:
    from vramplan.target import RolloutEngine

    mib = 2**20 * scale
    return RolloutEngine(engine="vLLM test", budget=40 * mib, weights=10 * mib, kv_pool=20 * mib, graphs=3 * mib,
                         activations=5 * mib, sleep=sleep)


@pytest.mark.parametrize("sleep", [False, True], ids=["awake", "sleep-mode"])
def test_the_colocated_engine_takes_its_blocks_around_the_trainers_step(sleep: bool) -> None:
    """The engine's blocks in the trainer's allocator, against an engine of no bytes: its weights,
    KV cache and graphs' pool held through the training phases (sleep mode: the graphs' pool only),
    all of them and its activations at the generation; sleep mode empties the cache before it wakes
    and when it sleeps."""
    from vramplan.target import DEFAULT_PROFILE, RolloutEngine

    spec = _llama_1b_two_layers()
    w = Workload(task="train", batch=2, grad_accum=2, seq=48, prompt=16, precision="bf16-mixed", objective="grpo",
                 generations=4, peft="lora", rollout="vllm", vllm_sleep=sleep)
    zero = RolloutEngine(engine="none", budget=0, weights=0, kv_pool=0, graphs=0, activations=0, sleep=sleep)
    e = _engine(sleep, scale=64)  # (larger than any of the trainer's own phases: the step's peak is the generation)
    base, r = (trace_workload(spec, w, device=dataclasses.replace(DEFAULT_PROFILE, rollout=x)) for x in (zero, e))
    a, b = ({p.phase: p.allocated for p in x.phases} for x in (base, r))
    assert set(a) == set(b) and Phase.PREFILL not in b  # (no generate in the trainer)
    held = e.graphs + (0 if sleep else e.weights + e.kv_pool)
    for phase in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER):
        assert b[phase] - a[phase] == held, phase
    assert b[Phase.DECODE] - a[Phase.DECODE] == e.graphs + e.weights + e.kv_pool + e.activations
    log = r.events
    empties = sum(1 for k in range(len(log)) if log.action[k] == int(Action.EMPTY_CACHE))
    assert empties == (4 if sleep else 0)  # (two per generation, one generation per traced step)
    assert any("colocated vLLM engine" in n for n in r.notes)


@pytest.mark.parametrize("sleep", [False, True], ids=["awake", "sleep-mode"])
def test_analytic_agrees_with_the_trace_with_a_colocated_engine(small_llama: Any, sleep: bool) -> None:
    from vramplan.engine import estimate as run_estimate

    kw = {"task": "train", "batch": 4, "seq": 512, "prompt": 128, "precision": "bf16-mixed", "objective": "grpo",
          "generations": 4, "rollout": "vllm", "vllm_sleep": sleep, "vllm_max_len": 1024, "gpu": "l4",
          "search_max_batch": False}
    a, t = run_estimate(small_llama, method="analytic", **kw), run_estimate(small_llama, method="trace", **kw)
    assert abs(t.peak.allocated - a.peak.allocated) / t.peak.allocated < 0.03, (t.peak.allocated, a.peak.allocated)
    ta, aa = ({p.phase: p.allocated for p in x.phases} for x in (t, a))
    assert abs(ta[Phase.DECODE] - aa[Phase.DECODE]) / ta[Phase.DECODE] < 0.03
    assert abs(ta[Phase.BACKWARD] - aa[Phase.BACKWARD]) / ta[Phase.BACKWARD] < 0.05
    # the engine fills its budget (0.3 of an L4's CUDA total) with its KV cache: the generation's peak holds it
    assert t.verdict is not None and ta[Phase.DECODE] > 0.3 * t.verdict.usable * 0.9


def test_vllm_refuses_to_start_as_vllm_does_and_the_fix_is_its_context_length() -> None:
    """Llama 3.1 8B with LoRA on an H100 at TRL's 0.3: vLLM's KV cache cannot hold one sequence of
    the model's 131,072 positions (TRL passes no max_model_len), so the engine refuses to start,
    whatever the bytes; a context of one prompt and completion starts it."""
    from vramplan.engine import estimate as run_estimate
    from vramplan.hardware.catalog import get_gpu
    from vramplan.models.catalog import resolve
    from vramplan.planner.nextstep import cheapest_fix

    kw = {"task": "train", "recipe": "trl-grpo", "peft": "lora", "batch": 8, "seq": 1536, "prompt": 512,
          "rollout": "vllm", "gpu": "h100", "method": "analytic", "search_max_batch": False}
    r = run_estimate("llama-3.1-8b", **kw)
    assert r.verdict is not None and not r.verdict.fits and r.verdict.headroom > 0
    assert "max seq len (131072)" in r.verdict.refused and "decreasing `max_model_len`" in r.verdict.refused
    fix = cheapest_fix(resolve("llama-3.1-8b"), r.workload, get_gpu("h100"))
    assert fix is not None and fix.flags == "--vllm-max-len 1536"
    ok = run_estimate("llama-3.1-8b", **kw, vllm_max_len=1536)
    assert ok.verdict is not None and ok.verdict.fits and not ok.verdict.refused
    # the trainer's model is on the device before vLLM starts: too little left for its budget
    big = run_estimate("llama-3.1-8b", **{**kw, "peft": "none", "optimizer": "sgd"}, vllm_max_len=1536,
                       vllm_memory=0.7)
    assert big.verdict is not None and big.verdict.refused.startswith("Free memory on device")


def test_colocated_vllm_workloads_are_checked() -> None:
    from vramplan.engine import estimate as run_estimate

    base = {"task": "train", "objective": "grpo", "batch": 8, "seq": 64, "prompt": 8, "rollout": "vllm"}
    with pytest.raises(WorkloadError, match="vllm_memory"):
        Workload(**base, vllm_memory=1.2)
    with pytest.raises(WorkloadError, match="shorter than a prompt"):
        Workload(**base, vllm_max_len=32)
    with pytest.raises(WorkloadError, match="data parallelism only"):
        Workload(**base, parallel=Parallel(tp=2))
    with pytest.raises(WorkloadError, match="sizes vLLM by the GPU"):
        run_estimate("qwen2.5-0.5b", Workload(**base), method="analytic")
    notes = Workload(task="train", batch=8, rollout="vllm", vllm_sleep=True).setting_notes()
    assert any("`rollout` applies with `objective=grpo`" in n for n in notes)


def _live_at_forward_end(log: Any) -> list[tuple[str, str, int]]:
    """(module, op, bytes) of the activations live when the last iteration's backward starts."""
    from vramplan.events import PHASES

    last, backward = max(log.iteration), PHASES.index("backward")
    k = next(i for i in range(len(log)) if log.iteration[i] == last and log.phase[i] == backward)
    live: dict[int, tuple[str, str, int]] = {}
    for i in range(k):
        if log.action[i] == int(Action.ALLOC) and log.category[i] == int(Category.ACTIVATION):
            live[log.id[i]] = (log.strings[log.module[i]], log.strings[log.op[i]], log.size[i])
        elif log.action[i] == int(Action.FREE):
            live.pop(log.id[i], None)
    return list(live.values())


@pytest.mark.parametrize("gpu", [None, "h100"], ids=["a100-class", "h100"])
def test_the_training_step_saves_repeated_kv_and_the_padding_mask_as_the_trace_does(gpu: str | None) -> None:
    """TRL pads GRPO's prompts, so the training forward passes a 4-D mask: transformers 5.24 then
    repeats k and v to every head (``use_gqa_in_sdpa``), and SDPA's fused kernel (memory-efficient on
    an A100-class GPU, cuDNN on an H100) saves them with the per-layer additive mask. The analytic
    attention terms of one layer are the trace's attention storages at the end of the forward."""
    from vramplan.analytic.blocks import Ctx, block_saved
    from vramplan.analytic.estimate import build_arch, estimate
    from vramplan.analytic.regime import regime, trainable
    from vramplan.hardware.catalog import get_gpu
    from vramplan.hardware.target import device_profile
    from vramplan.workload import Attention

    spec = _llama_1b_two_layers()
    b, s = 4, 160
    w = Workload(task="train", batch=b, seq=s, prompt=128, precision="bf16-mixed", objective="grpo", generations=4)
    r = trace_workload(spec, w, **({"device": device_profile(get_gpu(gpu))} if gpu else {}))
    live = _live_at_forward_end(r.events)
    attn = sum(n for m, op, n in live if m == "model.layers.0.self_attn" and n > 64)  # (not the kernel's rng scalars)
    assert not [x for x in live if x[0] in ("model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj")
                and x[1] == "aten.mm.default"]  # the kv-head k and v are not what the kernel saves
    arch = build_arch(spec)
    sft = w.replace(objective=Objective.SFT, loss="trl", generations=8)
    rg, tr = regime(sft), trainable(arch, sft)
    terms = block_saved(arch.groups[0], Ctx(rg, tr, Attention.SDPA, padded=True), arch.hidden)
    modelled = sum(t.per_token * b * s + t.per_pair * b * s * s for t in terms if t.name.startswith("attn: "))
    assert modelled == attn
    unpadded = block_saved(arch.groups[0], Ctx(rg, tr, Attention.SDPA), arch.hidden)
    assert sum(t.per_token * b * s + t.per_pair * b * s * s for t in unpadded if t.name.startswith("attn: ")) < attn
    # and the analytic GRPO step carries them (Ctx.padded through grpo._grpo)
    a = {p.phase: p.breakdown.activations for p in estimate(spec, w).phases}[Phase.FORWARD]
    a_sft = {p.phase: p.breakdown.activations for p in estimate(spec, sft).phases}[Phase.FORWARD]
    assert a - a_sft == 2 * (modelled - sum(t.per_token * b * s + t.per_pair * b * s * s for t in unpadded
                                            if t.name.startswith("attn: ")))
