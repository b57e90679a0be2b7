"""Recipes: cited knob defaults per framework, explicit values win, restrictions, the report header."""

from __future__ import annotations

import dataclasses
import json

import pytest

from vramplan import recipes
from vramplan.cli.main import main
from vramplan.errors import WorkloadError
from vramplan.workload import (
    Checkpointing,
    Loss,
    Optimizer,
    OptimizerImpl,
    Peft,
    Precision,
    Recipe,
    Workload,
)

ALL = [r.value for r in Recipe]
PEFTS = ["none", "lora", "qlora"]


RL = ("verl-grpo", "verl-ppo", "openrlhf-ppo", "openrlhf-grpo")
"""The recipes with a colocated vLLM rollout (sized by the GPU) and no QLoRA."""


def _valid(recipe: str, peft: str) -> bool:
    return not ((recipe == "torchtitan" and peft != "none") or (recipe in RL and peft == "qlora"))


NEEDS: dict[str, dict[str, int]] = {"trl-grpo": {"batch": 8, "seq": 1024, "prompt": 512},
                                    "verl-grpo": {"batch": 5}, "verl-ppo": {"seq": 1024, "prompt": 512},
                                    "openrlhf-ppo": {"prompt": 1024}, "openrlhf-grpo": {"batch": 8, "prompt": 1024}}
"""What a recipe cannot run without (GRPO: a prompt length, and a batch of whole groups of
`generations`), given as a user would."""


def _needs(recipe: str) -> dict[str, int]:
    return NEEDS.get(recipe, {})


def _flags(recipe: str) -> list[str]:
    gpu = ["--gpu", "h100"] if recipe in RL else []  # (the colocated vLLM engine is sized by the GPU)
    return [a for k, v in _needs(recipe).items() for a in (f"--{k}", str(v))] + gpu


def test_grpo_without_a_prompt_is_one_line_naming_the_fix() -> None:
    with pytest.raises(WorkloadError) as e:
        recipes.apply("trl-grpo", batch=8)
    assert e.value.field == "prompt" and "\n" not in str(e.value)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("peft", PEFTS)
def test_bundle_applies_every_default_with_its_source(name: str, peft: str) -> None:
    if not _valid(name, peft):
        with pytest.raises(WorkloadError, match="peft"):
            recipes.apply(name, peft=peft, **_needs(name))
        return
    w = recipes.apply(name, peft=peft, **_needs(name))
    assert w.recipe is Recipe(name)
    defaults = recipes.defaults(name, peft=peft)
    for d in defaults:
        value = getattr(w.parallel, d.field) if d.field in {f.name for f in dataclasses.fields(w.parallel)} \
            else getattr(w, d.field)
        assert value == d.value, (name, d.field)
        # a link to the framework's source (a tag or commit in it), or a file with its line and version
        assert "github.com" in d.source or ".py" in d.source, d
        assert d.source.count("github.com") == 0 or any(t in d.source for t in ("/blob/v", "/blob/2.", "/blob/")), d
    s = recipes.summary(w)
    assert not s.overridden and {k for k, _ in s.applied} == {d.field for d in defaults}
    if name == "plain":
        assert w == Workload(peft=peft) and s.empty


def test_framework_defaults_read_from_their_sources() -> None:
    hf = recipes.apply("hf-trainer")
    assert (hf.optimizer, hf.optimizer_impl, hf.checkpointing, hf.loss) == (
        Optimizer.ADAMW, OptimizerImpl.FUSED, Checkpointing.NONE, Loss.FULL)
    assert not hf.keep_grads and not hf.keep_outputs
    assert recipes.apply("trl-sft").checkpointing is Checkpointing.FULL  # base_config.py gradient_checkpointing=True
    tt = recipes.apply("torchtune")
    assert (tt.precision, tt.optimizer, tt.optimizer_in_backward, tt.loss, tt.loss_chunks, tt.checkpointing) == (
        Precision.BF16, Optimizer.PAGED_ADAMW_8BIT, True, Loss.CHUNKED, 8, Checkpointing.FULL)
    lora = recipes.apply("torchtune", peft="lora")
    assert (lora.optimizer, lora.optimizer_impl, lora.optimizer_in_backward) == (Optimizer.ADAMW, OptimizerImpl.FUSED,
                                                                                False)
    titan = recipes.apply("torchtitan")
    assert titan.checkpointing is Checkpointing.OP and titan.parallel.zero == 0  # no FSDP on one GPU
    assert recipes.apply("torchtitan", dp=8).parallel.zero == 3  # FSDP2 over every rank
    un = recipes.apply("unsloth", peft="qlora")
    assert un.checkpointing is Checkpointing.FULL and un.activation_offload and un.loss is Loss.LIGER


def test_explicit_values_beat_the_recipe() -> None:
    w = recipes.apply("torchtune", loss="full", optimizer_in_backward=False, precision="bf16-mixed")
    assert (w.loss, w.optimizer_in_backward, w.precision) == (Loss.FULL, False, Precision.BF16_MIXED)
    s = recipes.summary(w)
    assert {k for k, _, _ in s.overridden} == {"loss", "optimizer_in_backward", "precision"}
    assert ("loss", Loss.FULL, Loss.CHUNKED) in s.overridden


def test_recipe_defaults_apply_to_training_only() -> None:
    w = recipes.apply("torchtune", task="infer")
    assert w.recipe is Recipe.TORCHTUNE and w.loss is Loss.FULL and not w.optimizer_in_backward
    assert w.setting_notes() == () and recipes.notes(w) == ("recipe torchtune sets training-loop knobs; none applies "
                                                             "to `task=infer`",)


@pytest.mark.parametrize(("name", "changes", "field"), [
    ("hf-trainer", {"optimizer_in_backward": True}, "optimizer_in_backward"),
    ("hf-trainer", {"checkpointing": "op"}, "checkpointing"),
    ("trl-sft", {"loss": "chunked"}, "loss"),
    ("torchtitan", {"peft": "lora"}, "peft"),
    ("torchtitan", {"loss": "cce"}, "loss"),
    ("deepspeed", {"optimizer_in_backward": True}, "optimizer_in_backward"),
    ("torchtune", {"grad_accum": 2}, "grad_accum"),  # optimizer_in_bwd needs gradient_accumulation_steps=1
])
def test_a_knob_the_framework_cannot_run_is_one_line_naming_the_choices(name: str, changes: dict[str, object],
                                                                        field: str) -> None:
    with pytest.raises(WorkloadError) as e:
        recipes.apply(name, **changes)
    assert e.value.field == field and "\n" not in str(e.value)
    if field == "grad_accum":  # Workload itself refuses accumulation with the optimizer in backward
        assert "optimizer_in_backward" in e.value.hint and name in str(e.value)
        return
    # the same check guards a Workload built directly, in the estimate pipeline
    w = recipes.apply(name).replace(**changes)  # Workload.replace validates the fields, not the recipe
    assert not recipes.allows(w)


def test_unknown_recipe_lists_the_recipes() -> None:
    with pytest.raises(WorkloadError, match="plain \\| hf-trainer .* unsloth"):
        recipes.apply("megatron")
    with pytest.raises(WorkloadError, match="recipe"):
        Workload(recipe="megatron")  # type: ignore[arg-type]


def test_caveats_say_what_is_not_modelled() -> None:
    assert any("FSDP2" in n for n in recipes.notes(recipes.apply("torchtitan")))
    assert any("engine specifics" in n for n in recipes.notes(recipes.apply("deepspeed")))
    assert recipes.apply("trl-sft").loss is Loss.TRL  # TRL's own fused head, no longer estimated as another
    assert any("precision" in n for n in recipes.notes(recipes.apply("hf-trainer")))
    assert recipes.notes(recipes.apply("plain")) == ()
    verl = recipes.notes(recipes.apply("verl-grpo", batch=5))
    assert any("param_offload" in n and "upper bound" in n for n in verl)  # the reference offloaded by verl
    assert any("full-vocabulary logits" in n for n in verl)
    rm = recipes.notes(recipes.apply("verl-ppo", reward_model=True))  # the reward model offloaded by verl
    assert any("CPUOffload" in n and "use_reward_loop" in n and "upper bound" in n for n in rm)
    assert not any("use_reward_loop" in n for n in recipes.notes(recipes.apply("verl-ppo")))
    assert any("colocate_all" in n for n in recipes.notes(recipes.apply("openrlhf-ppo", prompt=512)))


def test_rl_framework_defaults_read_from_their_sources() -> None:
    from vramplan.workload import Objective, Reference, Rollout

    ppo = recipes.apply("verl-ppo")
    assert (ppo.objective, ppo.generations, ppo.reference, ppo.rollout, ppo.vllm_memory, ppo.vllm_sleep) == (
        Objective.PPO, 1, Reference.NONE, Rollout.VLLM, 0.5, True)
    assert (ppo.checkpointing, ppo.precision, ppo.seq, ppo.prompt) == (Checkpointing.FULL, Precision.BF16_MIXED,
                                                                        1024, 512)
    grpo = recipes.apply("verl-grpo", batch=5)
    assert (grpo.objective, grpo.generations, grpo.reference) == (Objective.GRPO, 5, Reference.MODEL)
    orl = recipes.apply("openrlhf-ppo", prompt=512)
    assert (orl.objective, orl.reference, orl.reward_model, orl.checkpointing, orl.optimizer_impl, orl.vllm_max_len) \
        == (Objective.PPO, Reference.MODEL, True, Checkpointing.NONE, OptimizerImpl.FUSED, 2048)
    assert recipes.apply("openrlhf-grpo", batch=8, prompt=512).objective is Objective.GRPO
    # each framework's vLLM release: verl 0.7.0 allows up to 0.12.0, OpenRLHF 0.11.0 pins 0.27.1
    assert recipes.get("verl-ppo").rollout.engine_version == "0.12.0"
    assert recipes.get("openrlhf-ppo").rollout.engine_version == "0.27.1"
    assert recipes.get("trl-grpo").rollout.engine_version == "0.10.1.1"


def test_verl_ppo_on_llama_8b_answers_with_each_part_of_the_step(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(capsys, "estimate", "llama-3.1-8b", "--recipe", "verl-ppo", "--gpu", "h100", "--method",
                        "analytic", "--json")
    assert rc == 0, err
    d = json.loads(out)
    notes = " ".join(d["notes"])
    assert "PPO peaks: generation" in notes and "critic training" in notes and "actor training" in notes
    assert "vLLM 0.12.0 colocated (verl 0.7.0 hybrid engine)" in notes


# --- CLI ----------------------------------------------------------------------------------
def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("peft", PEFTS)
def test_estimate_with_every_recipe_on_llama_8b(name: str, peft: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(capsys, "estimate", "llama-3.1-8b", "--task", "train", "--recipe", name, "--peft", peft,
                        "--method", "analytic", "--json", *_flags(name))
    if not _valid(name, peft):
        assert rc == 2 and err.count("\n") == 1 and "--peft" in err and "use none" in err
        return
    assert rc == 0, err
    d = json.loads(out)
    assert d["workload"]["recipe"] == name and d["loop"]["recipe"] == name
    assert set(d["loop"]["applied"]) == {x.field for x in recipes.defaults(name, peft=peft)}
    assert d["loop"]["overridden"] == {}


def test_explicit_flag_beats_the_recipe_and_switches_turn_off(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(capsys, "estimate", "llama-3.1-8b", "--recipe", "torchtune", "--no-optimizer-in-backward",
                        "--loss", "full", "--checkpointing", "none", "--method", "analytic", "--json")
    assert rc == 0, err
    d = json.loads(out)
    w = d["workload"]
    assert (w["optimizer_in_backward"], w["loss"], w["checkpointing"]) == (False, "full", "none")
    assert w["optimizer"] == "paged-adamw-8bit" and w["precision"] == "bf16"  # not given: the recipe's
    assert set(d["loop"]["overridden"]) == {"optimizer_in_backward", "loss", "checkpointing"}
    # a flag left at its argparse default does not override the recipe: --loss-chunks was not given
    assert w["loss_chunks"] == 8


def test_checkpointing_auto_follows_the_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    # plain: --peft turns checkpointing on (auto); hf-trainer: its default, off
    _, out, _ = _run(capsys, "estimate", "llama-3.1-8b", "--peft", "lora", "--method", "analytic", "--json")
    assert json.loads(out)["workload"]["checkpointing"] == "full"
    _, out, _ = _run(capsys, "estimate", "llama-3.1-8b", "--peft", "lora", "--recipe", "hf-trainer",
                     "--method", "analytic", "--json")
    assert json.loads(out)["workload"]["checkpointing"] == "none"


def test_unknown_recipe_flag_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:  # argparse's choices, through the one-line parser error
        main(["estimate", "llama-3.1-8b", "--recipe", "megatron"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "invalid choice: 'megatron'" in err and "unsloth" in err and err.count("\n") == 1


@pytest.mark.parametrize("argv", [
    ("--recipe", "hf-trainer", "--checkpointing", "op"),
    ("--recipe", "torchtitan", "--peft", "lora"),
    ("--recipe", "torchtune", "--grad-accum", "4"),
])
def test_a_knob_the_recipe_cannot_take_is_one_line_exit_2(argv: tuple[str, ...],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _run(capsys, "estimate", "llama-3.1-8b", "--method", "analytic", *argv)
    assert rc == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert argv[2] in err  # names the flag to change


def test_report_header_names_the_recipe_and_what_it_applied(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "estimate", "llama-3.1-8b", "--recipe", "torchtune", "--loss", "full",
                      "--keep-grads", "--method", "analytic", "--format", "markdown")
    assert rc == 0
    head = out[:1500]
    assert "loop: recipe torchtune (torchtune 0.6.1" in head
    assert "optimizer-in-backward on" in head and "precision bf16" in head
    assert "loss full (recipe: chunked)" in head
    assert "keep-grads on (recipe: off)" in head
    # the plain loop with every default: no loop line
    _, out, _ = _run(capsys, "estimate", "llama-3.1-8b", "--method", "analytic")
    assert "loop:" not in out
    # a knob set without a recipe is listed too
    _, out, _ = _run(capsys, "estimate", "llama-3.1-8b", "--keep-outputs", "--method", "analytic")
    assert "loop: keep-outputs on" in out


def test_engine_estimate_takes_recipe_as_a_keyword() -> None:
    import vramplan

    r = vramplan.estimate("llama-3.1-8b", recipe="torchtune", batch=2, loss="full", method="analytic")
    assert r.workload.recipe is Recipe.TORCHTUNE and r.workload.loss is Loss.FULL and r.workload.optimizer_in_backward
    with pytest.raises(WorkloadError):
        vramplan.estimate("llama-3.1-8b", Workload(recipe="torchtitan", peft="lora"), method="analytic")


def test_web_query_applies_the_recipe() -> None:
    from vramplan.web.params import FieldError, fields, parse_workload

    assert any(f.key == "recipe" and "torchtune" in f.choices for f in fields())
    w = parse_workload({"recipe": "torchtune", "batch": "2"})
    assert w.optimizer_in_backward and w.loss is Loss.CHUNKED and w.batch == 2
    with pytest.raises(FieldError) as e:
        parse_workload({"recipe": "torchtitan", "peft": "lora"})
    assert e.value.field == "peft"


def test_peft_none_recipes_keep_plain_peft_defaults() -> None:
    assert recipes.apply("unsloth").peft is Peft.NONE


@pytest.mark.slow
@pytest.mark.parametrize(("name", "peft"), [*((r, "none") for r in ALL), ("trl-sft", "lora"), ("unsloth", "qlora")])
def test_every_recipe_traces_llama(name: str, peft: str) -> None:
    """The default method (a trace) runs every recipe's loop on Llama-3.1-8B (short sequences); the
    RL recipes, whose step generates, scores and trains (20-25 s each at 8B), on Llama-3.2-1B — the
    same architecture, the same loop."""
    import vramplan

    model = "llama-3.2-1b" if name in RL or name == "trl-grpo" else "llama-3.1-8b"
    r = vramplan.estimate(model, recipe=name, peft=peft, method="trace", search_max_batch=False,
                          **{**_needs(name), "seq": 128, **({"prompt": 64} if _needs(name) else {}),
                             **({"gpu": "h100"} if name in RL else {})})
    assert r.method.value == "trace" and r.workload.recipe is Recipe(name)
    assert r.peak.allocated > r.breakdown.weights > 0
    assert tuple(recipes.notes(r.workload)) == tuple(n for n in r.notes if n in recipes.notes(r.workload))


# --- accelerate's FSDP plugin: FSDP1 under ZeRO-3 for accelerate, HF Trainer and TRL ---------
FSDP1_RECIPES = ("accelerate", "hf-trainer", "trl-sft", "trl-dpo")


@pytest.mark.parametrize("name", FSDP1_RECIPES)
def test_zero3_over_several_gpus_runs_fsdp1_as_the_plugin_defaults(name: str) -> None:
    from vramplan.workload import Engine, Fsdp1Prefetch

    w = recipes.apply(name, dp=8, zero=3)
    assert (w.parallel.engine, w.parallel.fsdp1_prefetch, w.parallel.fsdp1_strategy) == (
        Engine.FSDP1, Fsdp1Prefetch.NONE, "FULL_SHARD")
    applied = dict(recipes.summary(w).applied)
    assert applied["engine"] is Engine.FSDP1 and applied["fsdp1_prefetch"] is Fsdp1Prefetch.NONE
    sources = {d.field: d.source for d in recipes.defaults(name, dp=8)}
    assert "accelerate/blob/v1.14.0" in sources["engine"] and "FSDP_VERSION" in sources["engine"]
    assert "BACKWARD_PREFETCH" in sources["fsdp1_prefetch"]
    assert any("TRANSFORMER_BASED_WRAP" in n and "`engine=fsdp`" in n for n in recipes.notes(w))


@pytest.mark.parametrize("name", FSDP1_RECIPES)
def test_fsdp1_is_not_chosen_where_the_framework_would_not_run_it(name: str) -> None:
    from vramplan.workload import Engine

    # one GPU; DDP (zero 0); ZeRO-2 (`auto`: DeepSpeed's accounting); ZeRO-3 with the optimizer alone on the host
    # tensor / context parallelism: accelerate's ParallelismConfig runs FSDP2 only
    for kw in ({"dp": 1, "zero": 3}, {"dp": 8}, {"dp": 8, "zero": 2}, {"dp": 8, "zero": 3, "offload_optimizer": True},
               {"dp": 4, "zero": 3, "tp": 2}, {"dp": 4, "zero": 3, "cp": 2}):
        w = recipes.apply(name, **kw)
        assert w.parallel.engine is Engine.AUTO and w.parallel.framework is not Engine.FSDP1, kw
        assert not {"engine", "fsdp1_prefetch"} & {k for k, _ in recipes.summary(w).applied}, kw
        assert not any("TRANSFORMER_BASED_WRAP" in n for n in recipes.notes(w)), kw
    tp = recipes.apply(name, dp=4, zero=3, tp=2)
    assert tp.parallel.framework is Engine.FSDP and any("ParallelismConfig" in n for n in recipes.notes(tp))
    for other in ("plain", "deepspeed", "lightning"):  # recipes that do not go through accelerate's plugin
        assert recipes.apply(other, dp=8, zero=3).parallel.framework is Engine.FSDP


def test_fsdp2_stays_the_users_choice_and_the_report_says_so() -> None:
    from vramplan.workload import Engine, Fsdp1Prefetch

    w = recipes.apply("accelerate", dp=8, zero=3, engine="fsdp")
    assert w.parallel.framework is Engine.FSDP and w.parallel.fsdp1_prefetch is Fsdp1Prefetch.BACKWARD_PRE
    assert recipes.summary(w).overridden == (("engine", Engine.FSDP, Engine.FSDP1),)
    assert any("FSDP2's (`fsdp_version: 2`)" in n and "`engine=fsdp1`" in n for n in recipes.notes(w))
    # FSDP1's prefetch given: the engine still the recipe's
    w = recipes.apply("hf-trainer", dp=8, zero=3, fsdp1_prefetch="backward-pre")
    assert w.parallel.engine is Engine.FSDP1
    assert recipes.summary(w).overridden == (("fsdp1_prefetch", Fsdp1Prefetch.BACKWARD_PRE, Fsdp1Prefetch.NONE),)
    # SHARD_GRAD_OP chosen by name: the plugin's prefetch with it
    assert recipes.apply("accelerate", dp=8, zero=2, engine="fsdp1").parallel.fsdp1_prefetch is Fsdp1Prefetch.NONE


def test_the_recipes_fsdp1_is_the_estimate_of_fsdp1_without_prefetch() -> None:
    """accelerate's other loop defaults are vramplan's: its estimate is plain `engine=fsdp1
    fsdp1_prefetch=none` (the analytic FSDP1 formulas), and no longer FSDP2's."""
    import vramplan

    kw = dict(task="train", dp=8, zero=3, seq=2048, method="analytic", search_max_batch=False)
    acc = vramplan.estimate("llama-3.1-8b", recipe="accelerate", **kw)
    fsdp1 = vramplan.estimate("llama-3.1-8b", recipe="plain", engine="fsdp1", fsdp1_prefetch="none", **kw)
    fsdp2 = vramplan.estimate("llama-3.1-8b", recipe="accelerate", engine="fsdp", **kw)
    assert acc.peak.allocated == fsdp1.peak.allocated and acc.peak.reserved == fsdp1.peak.reserved
    assert acc.peak.allocated != fsdp2.peak.allocated


def test_planner_candidates_follow_the_recipes_engine() -> None:
    from vramplan.workload import Engine, Fsdp1Prefetch, Parallel

    w = recipes.apply("accelerate", dp=8, zero=3)  # FSDP1 taken from the recipe: each candidate its own engine
    got = {z: recipes.layout_defaults(w, Parallel(dp=8, zero=z, engine=w.parallel.engine,
                                                  fsdp1_prefetch=w.parallel.fsdp1_prefetch)) for z in (0, 2, 3)}
    assert [got[z].framework for z in (0, 2, 3)] == [Engine.DDP, Engine.DEEPSPEED, Engine.FSDP1]
    assert got[3].fsdp1_prefetch is Fsdp1Prefetch.NONE and got[0].fsdp1_prefetch is Fsdp1Prefetch.BACKWARD_PRE
    given = recipes.apply("accelerate", dp=8, zero=3, engine="fsdp")  # the user's FSDP2 stays
    assert recipes.layout_defaults(given, Parallel(dp=4, zero=3, engine="fsdp")).engine is Engine.FSDP
    plain = recipes.apply("plain", dp=8, zero=3)
    assert recipes.layout_defaults(plain, Parallel(dp=4, zero=3)).engine is Engine.AUTO
