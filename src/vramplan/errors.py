"""The one small exception hierarchy of vramplan.

Every error a user can cause is a :class:`VramplanError` (or subclass). The CLI prints
``error: <message>`` on one line (plus ``hint: <fix>`` when there is one) and exits 2.
Anything else escaping the core is a bug in vramplan, not a user mistake.

Core messages name the *fields* of the library (``batch``, ``method``, ``max_gpus``), never
command-line flags: a reference is written in backticks, either a bare field name
(`` `batch` must be a positive integer``) or a field with a value (``use `method=trace` ``).
A library user reads them as they are; the CLI rewrites each reference into its flag
(``--batch``, ``--method trace``) with :meth:`VramplanError.render` and a mapping derived
from its parser. :attr:`VramplanError.field` names the one field an error is about (when
there is one), for front ends that point at the input to fix.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

FIELD_REF = re.compile(r"`([a-z][a-z0-9_]*)(?:=([^`\s]*))?`")
"""A field reference in a message: `` `name` `` or `` `name=value` ``."""
_QUOTES = "'\""


def with_flags(text: str, flag_of: Callable[[str], str | None]) -> str:
    """Rewrite the field references in ``text`` with ``flag_of(field)`` (e.g. ``--batch``).

    `` `tp=2` `` becomes ``--tp 2``; a boolean flag with ``=True`` becomes the flag alone.
    References ``flag_of`` does not know (it returns None) stay as written.
    """

    def sub(m: re.Match[str]) -> str:
        flag = flag_of(m.group(1))
        if flag is None:
            return m.group(0)
        value = m.group(2)
        if value is None or value == "True":
            return flag
        return f"{flag} {value.strip(_QUOTES)}"

    return FIELD_REF.sub(sub, text)


class VramplanError(Exception):
    """A user-facing error: one line that says what is wrong and how to fix it."""

    exit_code = 2

    def __init__(self, message: str, *, hint: str | None = None, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.field = field
        """The input field this error is about (``batch``, ``tp``), or None."""

    def render(self, flag_of: Callable[[str], str | None] | None = None) -> str:
        """The one-line message; with ``flag_of``, field references become flags."""
        text = self.message if not self.hint else f"{self.message} ({self.hint})"
        if flag_of is not None:
            text = with_flags(text, flag_of)
        return " ".join(text.split())

    def __str__(self) -> str:  # one line, always
        return self.render()


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
        super().__init__(message, hint="check the code for a loop that never ends, or raise `timeout`")


class SnapshotError(VramplanError):
    """A memory snapshot that cannot be read (malformed, or unsafe to unpickle)."""


class NoGPUError(VramplanError):
    """An operation that needs a real CUDA GPU, run where there is none."""


class PlanError(VramplanError):
    """The planner found no plan meeting the constraints."""


def did_you_mean(name: str, choices: Iterable[str], *, kind: str, listing: str | None = None) -> UnknownNameError:
    """Build an UnknownNameError that suggests the nearest known names."""
    import difflib  # only when a name is unknown: not on every command's start-up

    pool = sorted(set(choices))
    close = difflib.get_close_matches(name.lower(), [c.lower() for c in pool], n=3, cutoff=0.5)
    lower_to_real = {c.lower(): c for c in pool}
    if close:
        names = ", ".join(lower_to_real[c] for c in close)
        hint = f"did you mean {names}?"
    else:
        hint = f"see `{listing}` for the list" if listing else f"known: {', '.join(pool[:8])}…"
    return UnknownNameError(f"unknown {kind} '{name}'", hint=hint)
