"""`--emit` round trip: the config a plan emits, read back with the fields it does not state
taken from the command line, is the plan's workload — so it gets the same prediction."""

from __future__ import annotations

import dataclasses
import re
import sys

import pytest

from vramplan.analytic import estimate
from vramplan.cli.main import main
from vramplan.errors import PlanError
from vramplan.models.catalog import resolve
from vramplan.planner.emit import emit
from vramplan.planner.layout import CARRIES, read_layout
from vramplan.planner.plan import plan
from vramplan.planner.results import Plan
from vramplan.workload import Parallel, Workload

SPEC = resolve("llama-3.2-1b")


@pytest.fixture(scope="module")
def template() -> Plan:
    return plan(SPEC, Workload(seq=1024), gpu="h100", max_gpus=8, method="analytic", confirm=0).plans[0]


def _plan(template: Plan, **fields) -> Plan:
    par = {k: fields.pop(k) for k in list(fields) if k in Parallel.__dataclass_fields__}
    w = Workload(seq=1024, parallel=Parallel(**par), **fields)
    return dataclasses.replace(template, workload=w, num_gpus=w.parallel.world_size)


def _base(w: Workload, fmt: str) -> Workload:
    """What the command line gives: the plan's workload with the format's fields at their defaults."""
    d, pd = Workload(), Parallel()
    carried = CARRIES[fmt]
    changes = {k: getattr(d, k) for k in carried if k in Workload.__dataclass_fields__}
    par = {k: getattr(pd, k) for k in carried if k in Parallel.__dataclass_fields__}
    if fmt != "torchtitan":  # tp / pp / cp are the command line's for the other formats
        par = {k: v for k, v in par.items() if k not in ("tp", "pp", "cp", "sp")}
    base = dataclasses.replace(w, parallel=dataclasses.replace(w.parallel, **{**par, "dp_shard": 0, "zero": 0,
                                                                               "offload_params": False,
                                                                               "offload_optimizer": False,
                                                                               "engine": "auto"}))
    return dataclasses.replace(base, **changes)


CASES = {
    "deepspeed": [
        dict(dp=8, zero=2, engine="deepspeed"),
        dict(dp=8, zero=1, engine="deepspeed", optimizer="adam", batch=2, grad_accum=4),
        dict(dp=16, zero=3, engine="deepspeed", offload_optimizer=True, offload_params=True, precision="fp16-mixed"),
        dict(dp=4, zero=2, engine="deepspeed", offload_optimizer=True, precision="fp32"),
        dict(dp=8, zero=3, engine="deepspeed", optimizer="sgd-momentum"),
        dict(dp=8, zero=2, engine="deepspeed", optimizer="adafactor", checkpointing="full"),
    ],
    "accelerate": [
        dict(dp=8, zero=3, engine="fsdp"),
        dict(dp=8, zero=2, engine="fsdp", precision="bf16"),
        dict(dp=16, zero=3, engine="fsdp", offload_params=True, offload_optimizer=True),
        dict(dp=8, zero=2, engine="deepspeed", offload_optimizer=True),
        dict(dp=4, engine="ddp", precision="fp16-mixed"),
        dict(dp=8, zero=2, engine="deepspeed", tp=2, sp=True),
        dict(dp=8, zero=3, engine="fsdp1"),  # FSDP1: fsdp_version 1 and its fsdp_sharding_strategy
        dict(dp=8, zero=2, engine="fsdp1", precision="bf16"),
        dict(dp=4, zero=0, engine="fsdp1"),
        dict(dp=16, zero=3, engine="fsdp1", dp_shard=8),
        dict(dp=16, zero=2, engine="fsdp1", dp_shard=8, fsdp1_prefetch="none"),
        dict(dp=8, zero=3, engine="fsdp1", fsdp1_prefetch="backward-post"),
    ],
    "fsdp": [
        dict(dp=8, zero=3, engine="fsdp"),
        dict(dp=32, zero=3, engine="fsdp", dp_shard=8, batch=4, grad_accum=2),
        dict(dp=8, zero=2, engine="fsdp", precision="bf16", optimizer="adamw-8bit"),
        dict(dp=16, zero=3, engine="fsdp", offload_params=True, offload_optimizer=True, optimizer_impl="fused"),
        dict(dp=8, zero=3, engine="fsdp", precision="fp32", optimizer="sgd"),
    ],
    "torchtitan": [
        dict(dp=8, zero=3, engine="fsdp"),
        dict(dp=4, zero=3, engine="fsdp", tp=2, sp=True, checkpointing="full"),
        dict(dp=2, zero=3, engine="fsdp", pp=4, grad_accum=8, checkpointing="op"),
        dict(dp=2, zero=3, engine="fsdp", pp=4, grad_accum=8, pp_schedule="Interleaved1F1B"),
        dict(dp=2, zero=3, engine="fsdp", pp=4, grad_accum=8, pp_schedule="ZBVZeroBubble"),
        dict(dp=2, engine="ddp", pp=4, grad_accum=8, pp_first_less=0, pp_last_less=2),
        dict(dp=2, engine="ddp", pp=4, batch=2, grad_accum=2, pp_schedule="GPipe"),
        dict(dp=2, zero=3, engine="fsdp", cp=2, tp=2, sp=True, optimizer_impl="fused"),
        dict(dp=32, zero=3, engine="fsdp", dp_shard=8, checkpointing="full", checkpoint_fraction=0.5),
        dict(dp=8, engine="ddp", optimizer="adam", batch=2, grad_accum=2),
        dict(dp=8, zero=2, engine="fsdp", offload_params=False),
    ],
}


@pytest.mark.parametrize("fmt, fields", [(f, c) for f, cs in CASES.items() for c in cs])
def test_emitted_layout_reads_back_to_the_same_workload_and_prediction(template, fmt, fields):
    p = _plan(template, **fields)
    out = emit(p, fmt)
    assert not any(w in n for n in out.notes for w in ("predicted for", "written as", "runs as", "not the pure")), \
        out.notes  # nothing the format could not express
    layout = read_layout(fmt, out.text, _base(p.workload, fmt))
    assert layout.workload == p.workload
    assert layout.notes == ()
    if p.workload.parallel.engine.value != "fsdp1":  # (FSDP1 is traced only: the workloads' equality says it)
        assert estimate(SPEC, layout.workload).peak.allocated == estimate(SPEC, p.workload).peak.allocated


def test_an_accelerate_fsdp_config_without_a_version_is_fsdp1(template):
    """accelerate's FullyShardedDataParallelPlugin defaults to fsdp_version 1 (FSDP_VERSION, "1"):
    a config file written by `accelerate config` before FSDP2, with its 1-based strategy index."""
    text = ("distributed_type: FSDP\nnum_processes: 16\nnum_machines: 2\nmixed_precision: bf16\n"
            "fsdp_config:\n  fsdp_sharding_strategy: 4\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n")
    w = read_layout("accelerate", text, Workload(seq=1024)).workload
    assert (w.parallel.engine.value, w.parallel.zero, w.parallel.dp, w.parallel.dp_shard) == ("fsdp1", 3, 16, 8)
    assert w.parallel.fsdp1_strategy == "HYBRID_SHARD"
    assert w.parallel.fsdp1_prefetch.value == "none"  # no fsdp_backward_prefetch: accelerate's None
    with pytest.raises(PlanError, match="fsdp_sharding_strategy"):
        read_layout("accelerate", text.replace("strategy: 4", "strategy: SIDEWAYS"), Workload(seq=1024))


def test_trainer_emits_fsdp1_as_the_trace_ran_it(template):
    out = emit(_plan(template, dp=16, zero=2, engine="fsdp1", dp_shard=8), "trainer").text
    assert 'fsdp="hybrid_shard_zero2 auto_wrap"' in out
    assert '{"fsdp_version": 1, "backward_prefetch": "BACKWARD_PRE"}' in out


def test_every_front_plan_round_trips_through_its_own_framework(template):
    res = plan(SPEC, Workload(seq=1024), gpu="h100", max_gpus=16, method="analytic", confirm=0, sort="memory")
    done = 0
    for p in res.plans:
        fmt = {"deepspeed": "deepspeed", "fsdp": "fsdp"}.get(p.workload.parallel.framework.value)
        if fmt is None or p.workload.peft.value != "none" or p.workload.parallel.tp > 1:
            continue
        out = emit(p, fmt)
        if any("fp32 master weights" in n or "no built-in" in n for n in out.notes):
            continue  # pure bf16 runs bf16-mixed under DeepSpeed; an 8-bit optimizer is not in its JSON (notes)
        assert read_layout(fmt, out.text, _base(p.workload, fmt)).workload == p.workload, p.label
        done += 1
    assert done > 0


def test_deepspeed_sizes_the_prediction_does_not_model_are_notes():
    text = ('{"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 8, '
            '"bf16": {"enabled": true}, "zero_optimization": {"stage": 2, "reduce_bucket_size": 2e8}}')
    layout = read_layout("deepspeed", text, Workload())
    assert layout.workload.parallel.dp == 8 and layout.workload.parallel.zero == 2
    assert any("reduce_bucket_size" in n for n in layout.notes)


@pytest.mark.parametrize("fmt, text, match", [
    ("deepspeed", "{not json", "invalid JSON"),
    ("deepspeed", '{"train_batch_size": 8}', "no zero_optimization"),
    ("accelerate", "a: [", "invalid YAML"),
    ("fsdp", "print('hi')", "no fully_shard"),
    ("torchtitan", "[training]\nseq_len = 8\n", "no [parallelism]"),
    ("yaml", "", "unknown layout format"),
])
def test_bad_configs_are_one_line_errors(fmt, text, match):
    if fmt == "torchtitan" and sys.version_info < (3, 11):
        pytest.skip("tomllib")
    with pytest.raises(PlanError, match=re.escape(match)):
        read_layout(fmt, text, Workload())


def test_what_a_format_cannot_express_is_a_note(template):
    out = emit(_plan(template, dp=8, zero=3, engine="fsdp", optimizer="adamw-8bit"), "torchtitan")
    assert any("AdamW" in n for n in out.notes[1:])
    out = emit(_plan(template, dp=8, zero=2, engine="deepspeed", precision="bf16"), "deepspeed")
    assert any("fp32 master weights" in n for n in out.notes[1:])


@pytest.mark.parametrize("fmt, name, fields", [
    ("torchtitan", "job.toml", dict(dp=4, zero=3, engine="fsdp", tp=2, sp=True, checkpointing="full")),
    ("deepspeed", "ds_config.json", dict(dp=8, zero=2, engine="deepspeed", batch=2)),
    ("fsdp", "fsdp_setup.py", dict(dp=16, zero=3, engine="fsdp", dp_shard=8)),
])
def test_cli_estimate_with_an_emitted_layout_gives_the_plans_prediction(template, tmp_path, capsys, fmt, name, fields):
    import json

    if fmt == "torchtitan" and sys.version_info < (3, 11):
        pytest.skip("tomllib")
    p = _plan(template, **fields)
    f = tmp_path / name
    f.write_text(emit(p, fmt).text)
    extra = ["--checkpointing", "full"] if fmt != "torchtitan" and p.workload.checkpointing.value == "full" else []
    assert main(["estimate", "llama-3.2-1b", "--method", "analytic", "--seq", "1024", "--layout", str(f),
                 "--json", *extra]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["peak"]["allocated"] == estimate(SPEC, p.workload).peak.allocated


def test_cli_flag_contradicting_the_layout_is_an_error(template, tmp_path, capsys):
    f = tmp_path / "ds_config.json"
    f.write_text(emit(_plan(template, dp=8, zero=2, engine="deepspeed"), "deepspeed").text)
    assert main(["estimate", "llama-3.2-1b", "--method", "analytic", "--layout", str(f), "--dp", "4"]) == 2
    assert "--dp 4 contradicts the deepspeed layout file, which says 8" in capsys.readouterr().err
    assert main(["estimate", "llama-3.2-1b", "--method", "analytic", "--layout", str(f), "--dp", "8", "--json"]) == 0


def test_torchtitan_schedule_with_more_stages_per_rank(template):
    # torchtitan infers 2 stages per rank for a looped schedule; other counts go through
    # pipeline_parallel_layers_per_stage, which needs the model's layers: a note, and the
    # command line's `pp_virtual` when the file sets it
    p = _plan(template, dp=2, zero=3, engine="fsdp", pp=2, grad_accum=4, pp_schedule="Interleaved1F1B", pp_virtual=4)
    out = emit(p, "torchtitan")
    assert 'pipeline_parallel_schedule = "Interleaved1F1B"' in out.text
    assert any("pipeline_parallel_layers_per_stage" in n and "layers / 8" in n for n in out.notes)
    base = p.workload  # the command line gives `--pp-schedule interleaved1f1b --pp-virtual 4`
    as_written = read_layout("torchtitan", out.text, base).workload
    assert as_written.parallel.stages_per_rank == 2  # what torchtitan runs from this file
    edited = out.text.replace("[parallelism]\n", "[parallelism]\npipeline_parallel_layers_per_stage = 2\n")
    assert read_layout("torchtitan", edited, base).workload == p.workload


def test_torchtitan_schedule_vramplan_does_not_predict_is_one_line():
    text = "[parallelism]\npipeline_parallel_degree = 2\npipeline_parallel_schedule = \"DualPipeV\"\n"
    with pytest.raises(PlanError, match="DualPipeV.*not one vramplan predicts"):
        read_layout("torchtitan", text, Workload(grad_accum=4))


def test_the_accelerate_recipes_fsdp1_plan_emits_and_reads_back(template):
    """`plan --recipe accelerate` predicts ZeRO-3 as accelerate's plugin runs it (FSDP1, no backward
    prefetch); the accelerate file it writes reads back, on the same command line, to that workload."""
    from vramplan import recipes
    from vramplan.engine import resolve_gpu
    from vramplan.planner.space import candidates

    cmdline = recipes.apply("accelerate", seq=1024, precision="bf16-mixed")
    gpu = resolve_gpu("h100")
    assert gpu is not None
    cands = candidates(cmdline, gpu, counts=[8])
    engines = {(c.workload.parallel.zero, c.workload.parallel.framework.value) for c in cands
               if c.workload.parallel.world_size == c.workload.parallel.dp}
    assert {(0, "ddp"), (3, "fsdp1")} <= engines and (3, "fsdp") not in engines
    # beside tensor / pipeline / context parallelism accelerate's FSDP is FSDP2 (ParallelismConfig)
    assert all(c.workload.parallel.framework.value != "fsdp1" for c in cands
               if c.workload.parallel.world_size > c.workload.parallel.dp)
    w = next(c.workload for c in cands if c.workload.parallel.zero == 3 and not c.workload.parallel.offload_params)
    p = dataclasses.replace(template, workload=w, num_gpus=8)
    assert p.workload.parallel.fsdp1_prefetch.value == "none" and p.workload.recipe.value == "accelerate"
    out = emit(p, "accelerate")
    assert "fsdp_version: 1" in out.text and "NO_PREFETCH" in out.text
    assert read_layout("accelerate", out.text, cmdline).workload == p.workload
