"""What a recipe is: knob defaults with their sources, the knob values the framework can run,
and what vramplan does not model of it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import field
from typing import Any

from vramplan._dataclass import dataclass

from ..workload import Parallel, Peft, Recipe, Workload


@dataclass(frozen=True)
class Default:
    """One knob value a framework sets when the user does not, and the line that sets it."""

    field: str
    """The `Workload` (or `Parallel`) field."""
    value: Any
    source: str
    """A link to the framework's source line (tag or commit in the URL), or a file and line with the version."""
    when: Callable[[Parallel], bool] | None = None
    """Applies only to layouts this accepts (None: always): the layout of the given knobs and the
    unconditional defaults (the ``engine`` default under ZeRO-3, then ``fsdp1_prefetch`` under FSDP1)."""


@dataclass(frozen=True)
class Restriction:
    """Values of one knob the framework can run; another value is an error naming these."""

    field: str
    allowed: tuple[Any, ...]
    why: str
    """Why others are not possible, with the source (one clause)."""


@dataclass(frozen=True)
class RolloutRules:
    """How a framework starts its colocated vLLM engine (``rollout=vllm``): the vLLM release whose
    start-up sizing applies and the engine arguments it passes (None: vLLM's own default)."""

    framework: str
    """The framework and version, for the report ("TRL 1.16 vllm_mode=colocate")."""
    engine_version: str
    """The vLLM release (:mod:`vramplan.pools.vllm_release`) the framework pins or was checked against."""
    max_num_batched_tokens: int | None
    max_num_seqs: int | None
    """None: the window (``batch`` x ``grad_accum``; TRL) when ``window_seqs``, else vLLM's default."""
    window_seqs: bool
    source: str
    """Where each value is set."""


TRL_ROLLOUT = RolloutRules(
    "TRL 1.16 vllm_mode=colocate", "0.10.1.1", 4096, None, True,
    "trl/generation/vllm_generation.py (TRL 1.16): max_num_batched_tokens=4096, max_num_seqs = per-device batch x "
    "vllm_tensor_parallel_size x steps_per_generation; the release is the one TRL 1.16's colocate mode was checked "
    "against here")


@dataclass(frozen=True)
class RecipeSpec:
    """One training recipe: its framework, defaults and the knobs it allows."""

    name: Recipe
    framework: str
    """The framework and the version whose sources the defaults are read from."""
    summary: str
    defaults: Callable[[Peft, int], tuple[Default, ...]]
    """The knob defaults for training, per PEFT mode (LoRA recipes differ from full
    fine-tuning) and data-parallel size (FSDP only over several GPUs)."""
    restrictions: tuple[Restriction, ...] = ()
    caveats: Callable[[Workload], tuple[str, ...]] = field(default=lambda w: ())
    """What the framework does that the estimate does not model, for this workload: notes
    in the report (never silently ignored)."""
    rollout: RolloutRules = TRL_ROLLOUT
    """The colocated rollout engine's settings (``rollout=vllm``)."""


@dataclass(frozen=True)
class LoopSummary:
    """The report header's account of the loop: the recipe, the defaults it applied, the
    values given instead of its defaults, and every other knob that differs from vramplan's
    own default."""

    recipe: Recipe
    applied: tuple[tuple[str, Any], ...]
    overridden: tuple[tuple[str, Any, Any], ...]
    """(field, value given, the recipe's default)."""
    other: tuple[tuple[str, Any], ...]

    @property
    def empty(self) -> bool:
        return self.recipe is Recipe.PLAIN and not (self.applied or self.overridden or self.other)

    def to_dict(self) -> dict[str, Any]:
        from .._json import jsonable

        return {
            "recipe": str(self.recipe),
            "applied": {k: jsonable(v) for k, v in self.applied},
            "overridden": {k: {"value": jsonable(v), "recipe_default": jsonable(d)} for k, v, d in self.overridden},
            "other": {k: jsonable(v) for k, v in self.other},
        }


Catalog = Mapping[Recipe, RecipeSpec]
