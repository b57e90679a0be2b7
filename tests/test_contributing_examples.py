"""The worked examples of CONTRIBUTING.md, run from the file itself so that they fail if the
documentation drifts from the code."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

import vramplan
from vramplan.errors import WorkloadError
from vramplan.models import arch as arch_module
from vramplan.models.catalog import resolve
from vramplan.models.spec import Family
from vramplan.workload import Method, Optimizer, Workload

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "CONTRIBUTING.md").read_text()


def _section(title: str) -> str:
    start = DOC.index(f"## {title}")
    end = DOC.find("\n## ", start + 1)
    return DOC[start:] if end < 0 else DOC[start:end]


def _code_blocks(section: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", section, re.S)


GRANITE = {
    "model_type": "granite", "architectures": ["GraniteForCausalLM"], "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 1000, "max_position_embeddings": 2048, "tie_word_embeddings": True,
    "attention_bias": False, "mlp_bias": False, "embedding_multiplier": 12.0,
    "residual_multiplier": 0.22, "attention_multiplier": 0.0078125, "logits_scaling": 8.0,
}


def _config(tmp_path: Path, name: str) -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(GRANITE))
    return str(d / "config.json")


def test_add_a_model_family(tmp_path, monkeypatch):
    section = _section("Worked example: add a model family")
    assert "one line in one file" in section and "src/vramplan/models/arch.py" in section
    (entry,) = _code_blocks(section)
    key, expr = re.fullmatch(r'\s*"(\w+)": (.*),\s*', entry).groups()
    assert key == GRANITE["model_type"] and key not in arch_module.ARCHS  # still an example to add

    before = resolve(_config(tmp_path, "before"))
    assert before.family is Family.OTHER and before.params == 0
    with pytest.raises(WorkloadError, match="not a transformer the analytic method knows"):
        vramplan.estimate(_config(tmp_path, "before2"), method="analytic", seq=128)

    # the documented step: the line, evaluated where it would be written
    monkeypatch.setitem(arch_module.ARCHS, key, eval(expr, vars(arch_module)))
    path = _config(tmp_path, "after")
    spec = resolve(path)
    assert spec.family is Family.DENSE and spec.model_type == "granite"
    from vramplan.models.build import build_model

    built = build_model(spec, task="train")
    assert spec.params == sum(p.numel() for p in built.parameters())  # the exact count
    analytic = vramplan.estimate(path, method="analytic", seq=128)
    traced = vramplan.estimate(path, method="trace", seq=128)
    assert analytic.method is Method.ANALYTIC and traced.method is Method.TRACE
    assert analytic.params == traced.params == spec.params
    # both methods agree on the model states of a plain AdamW step
    assert analytic.model_states is not None and traced.model_states is not None
    assert analytic.model_states.total == pytest.approx(traced.model_states.total, rel=0.01)
    # the step-time model reads the same shape and counts the analytic method's FLOPs
    from vramplan.hardware.catalog import get_gpu
    from vramplan.runtime import step_time

    t = step_time(spec, Workload(seq=128), get_gpu("h100-sxm"))
    assert t.flops == pytest.approx(analytic.flops_per_step, rel=0.02)


def test_bring_your_own_optimizer_snippet_runs():
    (snippet,) = _code_blocks(_section("Worked example: add an optimizer"))
    exec(compile(snippet, "CONTRIBUTING.md", "exec"), {"__name__": "contributing_example"})


HOOKS = re.compile(r"`(src/vramplan/[\w/]+\.py)` — (.*?)(?=\n\d\.|\n\n)", re.S)


def test_catalog_optimizer_steps_name_real_functions():
    section = _section("Worked example: add an optimizer")
    steps = HOOKS.findall(section)
    assert len(steps) == 5 and "five files" in section
    for path, text in steps:
        module = importlib.import_module(path.removeprefix("src/").removesuffix(".py").replace("/", "."))
        names = [n for n in re.findall(r"`(\w+)`", text) if n[0] == "_" or n.islower() or n == "Optimizer"]
        assert names, path
        for name in names:
            if name in ("optim",):  # the Trainer's argument, not ours
                continue
            assert hasattr(module, name), f"CONTRIBUTING names {path}: {name}, which does not exist"


@pytest.mark.parametrize("optimizer", list(Optimizer))
def test_every_optimizer_is_handled_by_each_step(optimizer):
    """A new Optimizer member must go through all five steps of CONTRIBUTING.md."""
    import torch

    from vramplan.planner import emit
    from vramplan.runtime.traffic import optimizer_bytes_per_param
    from vramplan.trace.optim import make_optimizer

    w = Workload(optimizer=optimizer, precision="bf16-mixed")
    opt, _ = make_optimizer(w, [torch.nn.Parameter(torch.zeros(64, 64))])  # 2
    assert opt is not None
    est = vramplan.estimate("qwen2.5-0.5b", w.replace(seq=256), method="analytic")  # 3
    assert est.model_states is not None
    # AMP keeps fp32 weights (no separate master copy): plain SGD has no state at all
    assert (est.model_states.optimizer > 0) == (optimizer is not Optimizer.SGD)
    assert optimizer_bytes_per_param(w) > 0  # 4
    assert emit._optimizer_line(w)[1] and optimizer in emit._HF_OPTIM  # 5
