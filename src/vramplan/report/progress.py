"""A progress bar on stderr for long searches (``vramplan plan``), drawn only on a terminal.

The planner reports progress through a plain ``progress(stage, done, total)`` callback; this is
the terminal's rendering of it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

STAGES = {"screen": "screening candidates", "confirm": "confirming finalists (trace)"}


@contextlib.contextmanager
def progress_bar() -> Iterator[Callable[[str, int, int], None]]:
    """A ``progress(stage, done, total)`` callback drawing a rich bar on stderr (a terminal only)."""
    console = Console(stderr=True)
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=console, transient=True, disable=not console.is_terminal)
    tasks: dict[str, Any] = {}

    def update(stage: str, done: int, total: int) -> None:
        if stage not in tasks:
            tasks[stage] = bar.add_task(STAGES.get(stage, stage), total=total)
        bar.update(tasks[stage], completed=done, total=total)

    with bar:
        yield update
