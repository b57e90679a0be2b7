"""A tiny document model so that every report renders as a table, markdown or JSON.

Core results are turned into a :class:`Doc` by ``report.<thing>.to_doc(result)``; the
renderers in :mod:`vramplan.report.render` draw a Doc for the terminal (rich) or as
markdown. JSON is the result's own ``to_dict()``, never the Doc.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Table:
    """A table section: columns, rows and an optional footer."""

    columns: list[str]
    rows: list[list[str]]
    title: str = ""
    align: list[str] = field(default_factory=list)
    """Per column 'l' or 'r' (default: first column left, the rest right)."""
    footer: list[str] | None = None
    """An emphasised last row (e.g. totals)."""


@dataclass
class KeyValues:
    """A section of labelled values."""

    items: list[tuple[str, str]]
    title: str = ""


@dataclass
class Notes:
    """A section of bulleted notes."""

    lines: list[str]
    title: str = "Notes"


Section = Table | KeyValues | Notes


@dataclass
class Doc:
    """A report as plain data, rendered by :mod:`vramplan.report.render`."""

    title: str
    sections: list[Section] = field(default_factory=list)
    subtitle: str = ""

    def add(self, section: Section) -> Doc:
        self.sections.append(section)
        return self
