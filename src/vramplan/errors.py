"""The one small exception hierarchy of vramplan.

Every error a user can cause is a :class:`VramplanError` (or subclass). The CLI prints
``error: <message>`` on one line (plus ``hint: <fix>`` when there is one) and exits 2.
Anything else escaping the core is a bug in vramplan, not a user mistake.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class VramplanError(Exception):
    """A user-facing error: one line that says what is wrong and how to fix it."""

    exit_code = 2

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:  # one line, always
        text = self.message if not self.hint else f"{self.message} ({self.hint})"
        return " ".join(text.split())


class WorkloadError(VramplanError):
    """Invalid or unsupported workload description (sizes, combinations, parallelism)."""


class UnknownNameError(VramplanError):
    """A model, GPU, instance or option name that is not in the catalog."""


class ConfigError(VramplanError):
    """A malformed model config.json or allocator configuration string."""


class TraceError(VramplanError):
    """A model or step that cannot be traced on fake tensors."""


class TraceTimeoutError(TraceError):
    """User code under a trace ran past its time limit (``--timeout``), e.g. a loop that never ends."""

    def __init__(self, message: str) -> None:
        super().__init__(message, hint="check the code for a loop that never ends, or raise --timeout")


class SnapshotError(VramplanError):
    """A memory snapshot that cannot be read (malformed, or unsafe to unpickle)."""


class NoGPUError(VramplanError):
    """An operation that needs a real CUDA GPU, run where there is none."""


class PlanError(VramplanError):
    """The planner found no plan meeting the constraints."""


def did_you_mean(name: str, choices: Iterable[str], *, kind: str, listing: str | None = None) -> UnknownNameError:
    """Build an UnknownNameError that suggests the nearest known names."""
    pool = sorted(set(choices))
    close = difflib.get_close_matches(name.lower(), [c.lower() for c in pool], n=3, cutoff=0.5)
    lower_to_real = {c.lower(): c for c in pool}
    if close:
        names = ", ".join(lower_to_real[c] for c in close)
        hint = f"did you mean {names}?"
    else:
        hint = f"see `{listing}` for the list" if listing else f"known: {', '.join(pool[:8])}…"
    return UnknownNameError(f"unknown {kind} '{name}'", hint=hint)
