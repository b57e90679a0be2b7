"""Which of the loop's memory savings the plan searches for a workload: those that lower its
predicted peak (analytic screen, milliseconds each).

A knob that saves nothing for this model and loop (chunked cross-entropy on a model without a
vocabulary head, optimizer-in-backward under LoRA), or whose saving the screening method does
not model, is left out of the space instead of being ranked on its step time alone.
"""

from __future__ import annotations

from collections.abc import Callable

from vramplan.errors import VramplanError
from vramplan.workload import Checkpointing, Loss, Method, Workload

from .evaluator import Evaluator

KNOBS = ("loss", "optimizer_in_backward", "activation_offload", "op", "every")
"""Chunked cross-entropy, the optimizer step in backward, activation offload (with full
checkpointing), torchtitan's op-level selective checkpointing, full checkpointing of every
2nd layer."""


def saving_knobs(ev: Evaluator, w: Workload) -> frozenset[str]:
    """The knobs of :data:`KNOBS` that lower ``w``'s predicted allocated peak."""
    if not w.training or not ev.has_analytic(w):
        return frozenset()

    def peak(**changes: object) -> int | None:
        try:
            return ev.report(w.replace(**changes), gpu=None, method=Method.ANALYTIC).peak.allocated
        except VramplanError:
            return None

    none = {"checkpointing": Checkpointing.NONE, "checkpoint_fraction": 1.0, "checkpoint_every": 1}
    full = {"checkpointing": Checkpointing.FULL, "checkpoint_fraction": 1.0, "checkpoint_every": 1}
    probes: dict[str, Callable[[], bool]] = {
        "loss": lambda: w.loss is Loss.FULL and _lower(peak(loss=Loss.CHUNKED), peak()),
        "optimizer_in_backward": lambda: _lower(peak(grad_accum=1, optimizer_in_backward=True), peak(grad_accum=1)),
        "activation_offload": lambda: _lower(peak(**full, activation_offload=True), peak(**full)),
        "op": lambda: _lower(peak(checkpointing=Checkpointing.OP, checkpoint_fraction=1.0, checkpoint_every=1),
                             peak(**none)),
        "every": lambda: _between(peak(**{**full, "checkpoint_every": 2}), peak(**full), peak(**none)),
    }
    return frozenset(k for k, probe in probes.items() if probe())


def _lower(a: int | None, b: int | None) -> bool:
    return a is not None and b is not None and a < b


def _between(x: int | None, low: int | None, high: int | None) -> bool:
    """Every 2nd layer must save less than every layer and more than none: equal to either
    means the method does not model it."""
    return x is not None and low is not None and high is not None and low < x < high
