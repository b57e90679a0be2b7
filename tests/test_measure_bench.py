"""bench/accuracy.py without a GPU: the case list, prediction-only mode, and --summarize."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from show_fixtures import GiB
from vramplan.measure.env import Environment
from vramplan.measure.record import Measured, MeasureRecord, Prediction, append_jsonl
from vramplan.measure.step import check_measurable
from vramplan.models.catalog import resolve
from vramplan.workload import Workload

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_accuracy", ROOT / "bench" / "accuracy.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_accuracy"] = mod  # dataclasses look their module up while being built
    spec.loader.exec_module(mod)
    return mod


def test_cases_are_valid_and_cover_the_matrix(bench):
    cases = bench.CASES
    assert len(cases) >= 20 and len({c.id for c in cases}) == len(cases)
    for c in cases:
        w = bench.workload(c)
        check_measurable(w)
        resolve(c.model)
    ws = [c.workload for c in cases]
    assert {w.get("task") for w in ws} == {"train", "infer", "generate"}
    assert {w.get("precision") for w in ws} >= {"fp32", "bf16", "bf16-mixed", "fp16-mixed"}
    assert {w.get("peft") for w in ws} >= {"lora", "qlora"} and any(w.get("checkpointing") for w in ws)
    assert {c.model for c in cases} >= {"resnet-50", "vit-base", "bert-base", "gpt2", "qwen2.5-0.5b",
                                        "llama-3.2-1b", "qwen2.5-1.5b", "qwen2.5-3b", "llama-3.1-8b"}
    moe = [c for c in cases if resolve(c.model).is_moe]
    assert moe and all(c.reduce for c in moe)


def test_reduced_config_is_written(bench, tmp_path):
    (case,) = [c for c in bench.CASES if c.reduce]
    path = bench.model_ref(case, tmp_path)
    spec = resolve(path)
    assert spec.layers == 4 and spec.is_moe


def test_prediction_only_subset(bench, capsys):
    assert bench.main(["--predict-only", "--only", "gpt2-train-fp32,llama1b-lora", "--methods", "analytic"]) == 0
    out = capsys.readouterr()
    assert "prediction-only" in out.err
    lines = out.out.splitlines()
    assert lines[2].startswith("| gpt2-train-fp32 | not measured | ") and "n/a / n/a / n/a" in lines[2]
    assert lines[3].startswith("| llama1b-lora |")
    assert "| allocated | n/a | n/a | 0 |" in out.out


def test_limit_and_unknown_ids(bench, capsys):
    assert bench.main(["--predict-only", "--limit", "2", "--methods", "analytic"]) == 0
    out = capsys.readouterr().out
    assert "resnet50-train-fp32" in out and "vit-base" not in out
    with pytest.raises(SystemExit, match="unknown case"):
        bench.main(["--predict-only", "--only", "nope"])
    assert bench.main(["--methods", "magic"]) == 2


def _record(id: str, measured: int, trace: int, analytic: int | None) -> MeasureRecord:
    env = Environment(gpu_name="NVIDIA H200", gpu_memory=None, compute_capability=None, driver=None, cuda=None,
                      torch=None, transformers=None, peft=None, bitsandbytes=None, vramplan=None, python="3",
                      platform="x")
    preds = [Prediction("trace", allocated=trace, reserved=trace, device_used=trace)]
    preds.append(Prediction("analytic", allocated=analytic, reserved=analytic, device_used=analytic)
                 if analytic else Prediction("analytic", error="not a transformer"))
    return MeasureRecord(model="m", workload=Workload(), env=env, id=id,
                         measured=Measured(allocated=measured, reserved=measured, device_used=measured),
                         predicted=tuple(preds))


def test_summarize_committed_results(bench, tmp_path, capsys):
    f = tmp_path / "h200.jsonl"
    append_jsonl(_record("a", 10 * GiB, 11 * GiB, 8 * GiB), f)   # trace +10 %, analytic −20 %
    append_jsonl(_record("b", 10 * GiB, 9 * GiB, None), f)       # trace −10 %
    append_jsonl(_record("c", 10 * GiB, 10 * GiB + GiB // 2, 12 * GiB), f)  # trace +5 %, analytic +20 %
    assert bench.main(["--summarize", str(f)]) == 0
    out = capsys.readouterr().out
    assert "| allocated | 10.0% | +10.0% | 20.0% | -20.0% | 3 |" in out
    assert "no prediction: not a transformer" in out
    s = bench.summarize([r.to_json() for r in (_record("x", 4, 5, 2),)])
    assert s["trace"]["reserved"] == {"n": 1, "median": 0.25, "worst": 0.25}
