"""``objective=ppo`` (a value model beside the policy) and a reward model (:mod:`vramplan.trace.ppo`).

The traced PPO step is compared with the same step run for real on the CPU: the step code of
:func:`vramplan.trace.steps.grpo_step` on real tensors of a real transformers Llama (a real
``generate``-style sampling loop, the critic's values, GAE, the critic's update, the policy's),
its live storage bytes tracked op by op (``trace.testing``'s tracker, as the model-zoo tests do).
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

from vramplan.models.normalize import spec_from_config
from vramplan.trace import ppo
from vramplan.trace.run import TraceOptions, trace_workload
from vramplan.trace.steps import StepPlan, grpo_step
from vramplan.trace.testing import _StoragePeak
from vramplan.workload import Objective, Phase, Reference, Workload

transformers = pytest.importorskip("transformers")

CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 256,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
          "max_position_embeddings": 256, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
          "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
B, ACCUM, SEQ, PROMPT = 2, 2, 40, 16


class _RealSession:
    """What the step asks of a trace session, for a real run: no recording, no decode extrapolation."""

    extrapolate = False

    def __init__(self) -> None:
        self.rec = type("Rec", (), {"log": []})()
        self.dispatch = type("Dispatch", (), {"bool_reads": False})()
        self.autocast = None

    def phase(self, _p: Any) -> Any:
        return contextlib.nullcontext()

    def backward(self) -> Any:
        return contextlib.nullcontext()

    def autocast_region(self, _on: bool) -> Any:
        return contextlib.nullcontext()

    def label_cache(self, *_a: Any) -> None: ...

    def label_grads(self, *_a: Any) -> None: ...

    def label_optimizer(self, *_a: Any) -> None: ...


def _real_peak(w: Workload) -> int:
    """Peak live CPU storage bytes of two PPO steps run for real (fp32, AdamW foreach, as the trace)."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tracker = _StoragePeak()
    try:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
        critic = ppo.value_copy(model, w, trained=True)
        reward = ppo.value_copy(model, w, trained=False) if w.reward_model else None
        for m in (model, critic, reward):
            if m is not None:
                for t in [*m.parameters(), *m.buffers()]:
                    tracker.add(t)
        model.train()
        with tracker:
            params = [p for p in model.parameters() if p.requires_grad]
            plan = StepPlan(model=model, batch=((), {}), optimizer=torch.optim.AdamW(params, foreach=True),
                            grad_accum=w.grad_accum, trainable=params, compute_dtype=torch.float32,
                            objective=Objective.PPO, reference=None, reference_source=Reference.NONE,
                            prompt=w.prompt, micro_batch=w.batch, completion=w.completion, critic=critic,
                            critic_optimizer=torch.optim.AdamW(list(critic.parameters()), foreach=True),
                            reward_model=reward)
            sess = _RealSession()
            for _ in range(2):
                grpo_step(sess, plan)  # type: ignore[arg-type]
        return tracker.peak
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("reward_model", [False, True], ids=["rule-reward", "reward-model"])
def test_the_traced_ppo_step_matches_a_real_cpu_run(reward_model: bool) -> None:
    w = Workload(task="train", batch=B, grad_accum=ACCUM, seq=SEQ, prompt=PROMPT, precision="fp32", objective="ppo",
                 generations=1, reward_model=reward_model)
    spec = spec_from_config(CONFIG, name="llama-2l", source="test")
    r = trace_workload(spec, w, options=TraceOptions(workspaces=False))
    real = _real_peak(w)
    assert abs(r.peak_allocated - real) / real < 0.01, (r.peak_allocated, real)
    limit = next(n for n in r.notes if n.startswith("PPO peaks"))
    assert "generation (and scoring)" in limit and "critic training" in limit and "actor training" in limit


def test_the_critic_trains_in_full_beside_the_policy() -> None:
    """The critic's weights, gradients and optimizer states (the backbone and a scalar head, no LM head)."""
    spec = spec_from_config(CONFIG, name="llama-2l", source="test")
    base = dict(task="train", batch=B, grad_accum=ACCUM, seq=SEQ, prompt=PROMPT, precision="fp32")
    grpo = trace_workload(spec, Workload(**base, objective="grpo", generations=2), options=TraceOptions(workspaces=False))
    r = trace_workload(spec, Workload(**base, objective="ppo", generations=1), options=TraceOptions(workspaces=False))
    h, v = CONFIG["hidden_size"], CONFIG["vocab_size"]
    policy = sum(p.numel() for p in transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).parameters())
    critic = policy - v * h + h  # (the LM head dropped, a scalar head added)
    opt = {p.phase: p.breakdown for p in r.phases}[Phase.OPTIMIZER]
    opt0 = {p.phase: p.breakdown for p in grpo.phases}[Phase.OPTIMIZER]
    assert 0 <= opt.weights - opt0.weights - critic * 4 <= 512  # (+ the rotary buffer's copy)
    assert opt.optimizer - opt0.optimizer == critic * 8  # (AdamW's two fp32 moments; the step counters are scalars)


@pytest.mark.parametrize("kw", [{}, {"reward_model": True, "reference": "model"}], ids=["critic", "all-models"])
def test_analytic_agrees_with_the_trace(kw: dict) -> None:
    from vramplan.analytic.estimate import estimate

    cfg = {**CONFIG, "hidden_size": 256, "intermediate_size": 768, "vocab_size": 2048}
    spec = spec_from_config(cfg, name="small-llama", source="test")
    w = Workload(task="train", batch=4, seq=512, prompt=128, precision="bf16-mixed", objective="ppo", generations=1,
                 **kw)
    a, r = estimate(spec, w), trace_workload(spec, w)
    assert abs(r.peak_allocated - a.peak.allocated) / r.peak_allocated < 0.05, (r.peak_allocated, a.peak.allocated)


def test_ppo_workloads_are_checked() -> None:
    from vramplan.errors import WorkloadError

    with pytest.raises(WorkloadError, match="one GPU"):
        Workload(task="train", objective="ppo", batch=2, seq=64, prompt=8, generations=1,
                 parallel=__import__("vramplan.workload", fromlist=["Parallel"]).Parallel(dp=2))
    w = Workload(task="train", objective="ppo", batch=3, seq=64, prompt=8, generations=1)
    assert (w.rl, w.reference_source, w.batch_step) == (True, Reference.NONE, 1)
    assert any("`reward_model` applies" in n for n in Workload(task="train", reward_model=True).setting_notes())
