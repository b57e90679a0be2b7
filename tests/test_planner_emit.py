"""Runnable output: DeepSpeed JSON, Accelerate YAML, FSDP2 snippet, TrainingArguments, alloc conf."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from test_planner_fakes import INSTANCES, SMALL, screen_for
from vramplan.errors import PlanError
from vramplan.planner.emit import FORMATS, accelerate_config, backend, emit, to_yaml
from vramplan.planner.plan import plan
from vramplan.workload import Workload


@pytest.fixture(scope="module")
def base_plan():
    from test_planner_fakes import H100

    r = plan(SMALL, Workload(batch=4, seq=2048), gpu=H100, screen=screen_for(SMALL), instances=INSTANCES,
             method="analytic")
    return r.plans[0]


def _with(p, n=8, **changes):
    return replace(p, workload=p.workload.replace(**changes), num_gpus=n)


def parse_yaml(text: str) -> dict:
    """A strict parser for the block-YAML subset to_yaml writes (2-space nesting, key: scalar)."""
    root: dict = {}
    stack = [(-1, root)]
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        indent = len(line) - len(line.lstrip(" "))
        assert indent % 2 == 0, line
        key, sep, value = line.strip().partition(":")
        assert sep and key and " " not in key, line
        while stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1]
        if value.strip() == "":
            parent[key] = {}
            stack.append((indent, parent[key]))
        else:
            parent[key] = json.loads(value.strip()) if value.strip()[0] in '"0123456789-tf' else value.strip()
    return root


def test_deepspeed_json_has_the_plan_fields(base_plan):
    p = _with(base_plan, 8, dp=8, zero=3, offload_optimizer=True, offload_params=True, batch=2, grad_accum=4,
              precision="bf16-mixed", optimizer="adamw")
    cfg = json.loads(emit(p, "deepspeed").text)
    z = cfg["zero_optimization"]
    assert z["stage"] == 3 and z["offload_optimizer"]["device"] == "cpu" and z["offload_param"]["device"] == "cpu"
    assert cfg["train_micro_batch_size_per_gpu"] == 2 and cfg["gradient_accumulation_steps"] == 4
    assert cfg["train_batch_size"] == 2 * 4 * 8
    assert cfg["bf16"] == {"enabled": True} and "fp16" not in cfg
    assert cfg["optimizer"]["type"] == "AdamW"


def test_deepspeed_fp16_and_client_optimizer(base_plan):
    p = _with(base_plan, 1, zero=2, offload_optimizer=True, precision="fp16-mixed", optimizer="adafactor",
              optimizer_impl="foreach")
    e = emit(p, "deepspeed")
    cfg = json.loads(e.text)
    assert cfg["fp16"]["enabled"] is True and "bf16" not in cfg and "optimizer" not in cfg
    assert "offload_param" not in cfg["zero_optimization"]
    assert any("adafactor" in n for n in e.notes)


@pytest.mark.parametrize("changes,kind", [
    ({}, "none"), ({"dp": 4}, "ddp"), ({"dp": 4, "zero": 2}, "deepspeed"),
    ({"dp": 8, "zero": 3}, "fsdp"), ({"dp": 8, "zero": 3, "offload_optimizer": True}, "deepspeed"),
])
def test_accelerate_yaml_is_valid_and_matches_the_backend(base_plan, changes, kind):
    p = _with(base_plan, changes.get("dp", 1), **changes)
    assert backend(p.workload) == kind
    text = emit(p, "accelerate").text
    parsed = parse_yaml(text)
    assert parsed == json.loads(json.dumps(accelerate_config(p)))
    assert parsed["num_processes"] == p.num_gpus
    assert parsed["distributed_type"] == {"none": "NO", "ddp": "MULTI_GPU", "deepspeed": "DEEPSPEED",
                                          "fsdp": "FSDP"}[kind]
    if kind == "deepspeed":
        assert parsed["deepspeed_config"]["zero_stage"] == p.workload.parallel.zero
    yaml = pytest.importorskip("yaml")  # PyYAML when present: the same document
    assert yaml.safe_load(text) == parsed


def test_to_yaml_quotes_ambiguous_strings():
    assert parse_yaml(to_yaml({"a": "no", "b": "x y", "c": {"d": True}})) == {"a": "no", "b": "x y", "c": {"d": True}}


@pytest.mark.parametrize("changes", [
    {}, {"checkpointing": "full"}, {"checkpointing": "selective"}, {"checkpointing": "full", "checkpoint_fraction": 0.5},
    {"dp": 8, "zero": 3, "offload_optimizer": True, "offload_params": True}, {"optimizer": "adamw-8bit"},
    {"precision": "fp32"}, {"peft": "lora"}, {"dp": 2, "zero": 2},
])
def test_fsdp_snippet_and_trainer_args_compile(base_plan, changes):
    p = _with(base_plan, changes.get("dp", 1), **changes)
    for fmt in ("fsdp", "trainer"):
        src = emit(p, fmt).text
        compile(src, f"<{fmt}>", "exec")
    fs = emit(p, "fsdp").text
    assert "fully_shard(model, **kwargs)" in fs
    if p.workload.parallel.offload_params:
        assert "CPUOffloadPolicy(pin_memory=True)" in fs
    if p.workload.checkpointing.value != "none":
        assert "checkpoint_wrapper(block" in fs


def test_fsdp_snippet_runs_on_a_fake_process_group(base_plan):
    p = _with(base_plan, 2, dp=2, zero=3, checkpointing="selective", optimizer="adamw", optimizer_impl="foreach")
    code = emit(p, "fsdp").text + '''
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(8, 8)
    def forward(self, x):
        return self.l(x).relu()
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Block() for _ in range(3)])
    def forward(self, x):
        for b in self.layers:
            x = b(x)
        return x
model = Net()
shard(model, model.layers)
opt = make_optimizer(model)
print(type(model.layers[0]).__name__, type(opt).__name__, sum(1 for _ in model.parameters()))
'''
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "CheckpointWrapper" in out.stdout and "AdamW" in out.stdout


def test_trainer_args_name_the_plan_settings(base_plan):
    p = _with(base_plan, 1, peft="qlora", quant="nf4", checkpointing="full", optimizer="paged-adamw-8bit",
              batch=2, grad_accum=8, precision="bf16-mixed")
    src = emit(p, "trainer").text
    for s in ("per_device_train_batch_size=2", "gradient_accumulation_steps=8", "bf16=True",
              "gradient_checkpointing=True", 'optim="paged_adamw_8bit"', 'bnb_4bit_quant_type="nf4"', "LoraConfig(r=16"):
        assert s in src


def test_trainer_args_carry_dora_and_rslora(base_plan):
    src = emit(_with(base_plan, 1, peft="lora", lora_dora=True, lora_rslora=True, lora_modules_to_save="lm_head",
                     precision="bf16-mixed"), "trainer").text
    assert "use_dora=True, use_rslora=True, modules_to_save=['lm_head']" in src
    assert "use_dora" not in emit(_with(base_plan, 1, peft="lora", precision="bf16-mixed"), "trainer").text


def test_alloc_conf_recommends_expandable_segments_when_tight_or_fragmented(base_plan):
    tight = replace(base_plan, memory=int(base_plan.usable * 0.95))
    assert "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in emit(tight, "alloc-conf").text.splitlines()
    roomy = replace(base_plan, memory=int(base_plan.usable * 0.5), fragmentation=0.01)
    lines = emit(roomy, "alloc-conf").text.splitlines()
    assert all(line.startswith("#") for line in lines)
    from vramplan.workload import Method

    frag = replace(roomy, fragmentation=0.2, confirmed=True, method=Method.TRACE)
    assert "fragmentation 20%" in emit(frag, "alloc-conf").text


def test_every_format_and_bad_format(base_plan):
    for fmt in FORMATS:
        e = emit(base_plan, fmt)
        assert e.text.endswith("\n") and e.filename
    with pytest.raises(PlanError, match="unknown `emit` format"):
        emit(base_plan, "yaml")


def test_float8_training_is_named_where_the_config_cannot_say_it(base_plan):
    for fmt in ("torchtitan", "trainer", "fsdp"):
        out = emit(_with(base_plan, 8, zero=3, float8="rowwise"), fmt)
        assert any("float8 training (rowwise) is not written" in n for n in out.notes), fmt
    assert not any("float8" in n for n in emit(_with(base_plan, 8, zero=3), "torchtitan").notes)
