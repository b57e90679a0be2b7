"""Framework recipes: the training loop a framework runs, as defaults for the workload's knobs.

``apply("torchtune", batch=2, peft="lora")`` is the Workload torchtune's LoRA recipe runs:
every knob the caller does not give takes the framework's default (each cites the source line
that sets it, :mod:`vramplan.recipes.catalog`); every knob given wins. ``Workload.recipe``
records the name, so the report can say which defaults were applied and which were replaced.
Recipe defaults apply to training only (inference runs no optimizer, loss or checkpointing).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import WorkloadError
from ..workload import Engine, Parallel, Peft, Recipe, Task, Workload, as_enum
from ._model import TRL_ROLLOUT, Default, LoopSummary, RecipeSpec, Restriction, RolloutRules
from .catalog import CATALOG

LOOP_KNOBS: tuple[str, ...] = (
    "optimizer_impl", "checkpoint_fraction", "checkpoint_every", "activation_offload", "keep_grads",
    "keep_outputs", "loss", "loss_chunks", "optimizer_in_backward", "compile", "peft_base_dtype",
    "bnb_compute_dtype", "bnb_single_quant", "bnb_version",
)
"""Knobs of the loop that the report header lists when they differ from vramplan's default
(task, shapes, precision, optimizer, checkpointing, PEFT and layout have their own words)."""

_PARALLEL = {f.name for f in dataclasses.fields(Parallel)}
_WORKLOAD_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(Workload)
                                      if f.default is not dataclasses.MISSING}
_PARALLEL_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(Parallel)}


def get(name: str | Recipe) -> RecipeSpec:
    """The recipe called ``name``; an unknown name is a one-line error listing the recipes."""
    return CATALOG[as_enum(Recipe, name, "recipe")]


def defaults(name: str | Recipe, *, peft: str | Peft = Peft.NONE, task: str | Task = Task.TRAIN,
             dp: int = 1) -> tuple[Default, ...]:
    """The knob defaults the recipe sets for this PEFT mode and data-parallel size (none
    outside training)."""
    spec = get(name)
    if as_enum(Task, task, "task") is not Task.TRAIN:
        return ()
    return spec.defaults(as_enum(Peft, peft, "peft"), dp if isinstance(dp, int) else 1)


def apply(name: str | Recipe, /, **fields: Any) -> Workload:
    """The Workload of ``fields`` (flat: ``dp=8`` as well as ``batch=4``) with the recipe's
    defaults for every knob not given, checked against what the framework can run."""
    spec = get(name)
    if "parallel" in fields:
        raise WorkloadError("give the layout as flat fields such as `dp` and `zero`, not a Parallel value", field="dp")
    every = defaults(spec.name, peft=fields.get("peft", Peft.NONE), task=fields.get("task", Task.TRAIN),
                     dp=fields.get("dp", 1))
    recipe_defaults = {d.field: d.value for d in every if d.when is None}
    merged = {**recipe_defaults, **fields, "recipe": spec.name}
    par = {k: merged.pop(k) for k in list(merged) if k in _PARALLEL}
    for d in every:  # the layout's own defaults (FSDP1 under ZeRO-3), in order, each on the layout so far
        if d.when is not None and d.field not in fields and d.when(Parallel(**par)):
            par[d.field] = recipe_defaults[d.field] = d.value
    try:
        w = Workload(**merged, parallel=Parallel(**par))
    except WorkloadError as e:
        if e.field == "grad_accum" and recipe_defaults.get("optimizer_in_backward") and \
                "optimizer_in_backward" not in fields:  # the recipe's default, not the user's choice
            raise _no_accumulation(spec.name) from None
        raise
    check(w)
    return w


def layout_defaults(w: Workload, par: Parallel) -> Parallel:
    """``par``, a layout for ``w`` (the planner's candidate), with ``w``'s recipe's layout defaults
    (FSDP1 under ZeRO-3 for accelerate, Trainer and TRL) where its engine is left to ``auto``; a
    layout default ``w`` took from its recipe is left to the candidate's layout, not kept."""
    if not w.training:
        return par
    took = {d.field for d in defaults(w.recipe, peft=w.peft, task=w.task, dp=w.parallel.dp)
            if d.when is not None and d.when(w.parallel) and _value(w, d.field) == d.value}
    if took:
        par = dataclasses.replace(par, **{f: _PARALLEL_DEFAULTS[f] for f in took})
    if par.engine is not Engine.AUTO:
        return par
    for d in defaults(w.recipe, peft=w.peft, task=w.task, dp=par.dp):
        if d.when is not None and d.when(par):
            par = dataclasses.replace(par, **{d.field: d.value})
    return par


def _no_accumulation(name: Recipe) -> WorkloadError:
    return WorkloadError(
        f"recipe {name} steps the optimizer inside backward by default, which needs no gradient accumulation "
        "(torchtune recipes/full_finetune_single_device.py L147-L156, v0.6.1)",
        hint="drop `grad_accum`, or turn `optimizer_in_backward` off", field="grad_accum")


def check(w: Workload) -> None:
    """Raise a one-line error when ``w`` sets a knob its recipe's framework cannot run."""
    spec = CATALOG[w.recipe]
    if not w.training:
        return
    for r in spec.restrictions:
        value = getattr(w.parallel if r.field in _PARALLEL else w, r.field)
        if value not in r.allowed:
            choices = " | ".join(_text(v) for v in r.allowed)
            raise WorkloadError(f"recipe {spec.name} cannot run `{r.field}={_text(value)}`: {r.why}",
                                hint=f"use {choices}, or `recipe=plain` for your own loop", field=r.field)


def allows(w: Workload) -> bool:
    """Whether the recipe's framework can run ``w`` (the planner skips what it cannot)."""
    try:
        check(w)
    except WorkloadError:
        return False
    return True


def notes(w: Workload) -> tuple[str, ...]:
    """What the recipe's framework does that the estimate does not model, for the report."""
    if not w.training:
        if w.recipe is Recipe.PLAIN:
            return ()
        return (f"recipe {w.recipe} sets training-loop knobs; none applies to `task={w.task}`",)
    return CATALOG[w.recipe].caveats(w)


def summary(w: Workload) -> LoopSummary:
    """The recipe, the defaults it applied, the values given instead, and the other loop
    knobs that differ from vramplan's defaults."""
    applied: list[tuple[str, Any]] = []
    overridden: list[tuple[str, Any, Any]] = []
    seen: set[str] = set()
    for d in defaults(w.recipe, peft=w.peft, task=w.task, dp=w.parallel.dp):
        if d.when is not None and not d.when(w.parallel):
            continue
        value = _value(w, d.field)
        seen.add(d.field)
        if value == d.value:
            applied.append((d.field, value))
        else:
            overridden.append((d.field, value, d.value))
    other = [(k, _value(w, k)) for k in LOOP_KNOBS if k not in seen and _value(w, k) != _WORKLOAD_DEFAULTS[k]]
    return LoopSummary(recipe=w.recipe, applied=tuple(applied), overridden=tuple(overridden), other=tuple(other))


def is_default(field: str, value: Any) -> bool:
    """Whether ``value`` is vramplan's own default for ``field`` (the `plain` loop's)."""
    table = _PARALLEL_DEFAULTS if field in _PARALLEL else _WORKLOAD_DEFAULTS
    return field in table and value == table[field]


def _value(w: Workload, field: str) -> Any:
    return getattr(w.parallel, field) if field in _PARALLEL else getattr(w, field)


def _text(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


__all__ = ["CATALOG", "LOOP_KNOBS", "TRL_ROLLOUT", "Default", "LoopSummary", "RecipeSpec", "Restriction",
           "RolloutRules", "allows", "apply",
           "check", "defaults", "get", "is_default", "layout_defaults", "notes", "summary"]
