"""Render a :class:`~vramplan.report.doc.Doc` as a rich terminal table or as markdown."""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Callable
from contextvars import ContextVar
from typing import IO, TYPE_CHECKING, Literal

from ..errors import with_flags
from .doc import Doc, KeyValues, Notes, Table

if TYPE_CHECKING:
    from rich.console import Console

FORMATS = ("table", "json", "markdown")
PIPE_WIDTH = 140
"""Columns of a table written to a pipe or file when VRAMPLAN_COLUMNS is not set."""

FLAG_OF: ContextVar[Callable[[str], str | None] | None] = ContextVar("flag_of", default=None)
"""How the front end names a library field (the CLI: ``max_gpus`` → ``--gpus``). Core notes
name fields in backticks (see :mod:`vramplan.errors`); :func:`emit` rewrites them with this
when it is set, so CLI users read flags and library users field names."""


def with_field_names(doc: Doc, flag_of: Callable[[str], str | None]) -> Doc:
    """A copy of ``doc`` with the field references in its text rewritten by ``flag_of``."""

    def t(s: str) -> str:
        return with_flags(s, flag_of)

    sections: list[Table | KeyValues | Notes] = []
    for s in doc.sections:
        if isinstance(s, Table):
            sections.append(dataclasses.replace(s, title=t(s.title), rows=[[t(c) for c in r] for r in s.rows],
                                                footer=[t(c) for c in s.footer] if s.footer else s.footer))
        elif isinstance(s, KeyValues):
            sections.append(dataclasses.replace(s, title=t(s.title), items=[(k, t(v)) for k, v in s.items]))
        else:
            sections.append(dataclasses.replace(s, lines=[t(x) for x in s.lines]))
    return Doc(t(doc.title), sections, subtitle=t(doc.subtitle))


def _align(t: Table, i: int) -> Literal["left", "right"]:
    if t.align and i < len(t.align):
        return "left" if t.align[i] == "l" else "right"
    return "left" if i == 0 else "right"


def render_console(doc: Doc, console: Console) -> None:
    # rich is imported here, not at module level: JSON and markdown output never load it
    from rich import box
    from rich.table import Table as RichTable
    from rich.text import Text

    console.print(Text(doc.title, style="bold"))
    if doc.subtitle:
        console.print(Text(doc.subtitle, style="dim"))
    for s in doc.sections:
        if isinstance(s, Table):
            rt = RichTable(title=s.title or None, box=box.SIMPLE_HEAVY, title_justify="left",
                           show_footer=False, min_width=len(s.title) + 4 if s.title else None)
            for i, c in enumerate(s.columns):
                rt.add_column(c, justify=_align(s, i), overflow="fold")
            for r in s.rows:
                rt.add_row(*r)
            if s.footer:
                rt.add_section()
                rt.add_row(*[Text(x, style="bold") for x in s.footer])
            console.print(rt)
        elif isinstance(s, KeyValues):
            rt = RichTable(title=s.title or None, box=None, show_header=False, title_justify="left",
                           padding=(0, 2, 0, 0))
            rt.add_column(style="bold")
            rt.add_column()
            for k, v in s.items:
                rt.add_row(k, v)
            console.print(rt)
            console.print()
        elif isinstance(s, Notes) and s.lines:
            console.print(Text(s.title, style="bold"))
            for line in s.lines:
                console.print(Text(f"  • {line}", style="dim"))


def to_text(doc: Doc, width: int = 110) -> str:
    """Plain text (no colour) — what tests compare."""
    from rich.console import Console

    buf = io.StringIO()
    render_console(doc, Console(file=buf, width=width, color_system=None, force_terminal=False,
                                 highlight=False, soft_wrap=False, emoji=False, markup=False))
    return buf.getvalue()


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|")


def to_markdown(doc: Doc) -> str:
    out: list[str] = [f"### {doc.title}", ""]
    if doc.subtitle:
        out += [f"_{doc.subtitle}_", ""]
    for s in doc.sections:
        if isinstance(s, Table):
            if s.title:
                out += [f"**{s.title}**", ""]
            out.append("| " + " | ".join(_md_escape(c) for c in s.columns) + " |")
            out.append("|" + "|".join(":--" if _align(s, i) == "left" else "--:" for i in range(len(s.columns))) + "|")
            for r in s.rows:
                out.append("| " + " | ".join(_md_escape(x) for x in r) + " |")
            if s.footer:
                out.append("| " + " | ".join(f"**{_md_escape(x)}**" if x else "" for x in s.footer) + " |")
            out.append("")
        elif isinstance(s, KeyValues):
            if s.title:
                out += [f"**{s.title}**", ""]
            for k, v in s.items:
                out.append(f"- **{_md_escape(k)}**: {_md_escape(v)}")
            out.append("")
        elif isinstance(s, Notes) and s.lines:
            out += [f"**{s.title}**", ""]
            out += [f"- {line}" for line in s.lines]
            out.append("")
    return "\n".join(out).rstrip() + "\n"


def emit(doc: Doc, fmt: str, stream: IO[str], json_obj: object | Callable[[], object] | None = None) -> None:
    """Write ``doc`` in ``fmt`` (table | markdown | json) to ``stream``. JSON keeps field names;
    tables and markdown name fields as :data:`FLAG_OF` says, when it is set. ``json_obj`` may be
    a function that returns it (e.g. ``report.to_dict``): called only for JSON."""
    flag_of = FLAG_OF.get()
    if flag_of is not None and fmt != "json":
        doc = with_field_names(doc, flag_of)
    if fmt == "json":
        import json

        obj = json_obj() if callable(json_obj) else json_obj
        stream.write(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    elif fmt == "markdown":
        stream.write(to_markdown(doc))
    else:
        isatty = getattr(stream, "isatty", lambda: False)()
        # Piped output: rich would assume 80 columns and cut long cells; use a wide page
        # (VRAMPLAN_COLUMNS when set, as the golden tests do).
        # emoji=False: no ":name:" in a report is an emoji code (and rich need not load its table);
        # markup=False: a "[...]" in a cell is text, never a rich style tag
        render_console(doc, _console_class()(file=stream, highlight=False, emoji=False, markup=False,
                                     width=None if isatty else _page_width()))


def _page_width() -> int:
    try:
        return max(40, int(os.environ["VRAMPLAN_COLUMNS"]))
    except (KeyError, ValueError):
        return PIPE_WIDTH


def _console_class() -> type[Console]:
    from rich.console import Console

    class _Console(Console):
        """rich exits with status 1 on a closed pipe (``vramplan gpus | head``); let the CLI decide."""

        def on_broken_pipe(self) -> None:
            self.quiet = True
            raise BrokenPipeError

    return _Console
