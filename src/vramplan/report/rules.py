"""Doc builder for ``vramplan rules``: each closed-form rule's steps, formula and numbers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .doc import Doc, KeyValues, Notes

if TYPE_CHECKING:
    from vramplan.hardware.rules import RuleResult

_TITLES = {"bandwidth": "Memory bandwidth", "render": "Rendering memory", "video": "NVENC encode sessions",
           "array": "Array memory"}


def rule_doc(result: RuleResult) -> Doc:
    """The rule's steps (label, formula with the numbers filled in) and its notes."""
    doc = Doc(_TITLES.get(result.rule, result.rule))
    doc.add(KeyValues([(s.label, s.formula) for s in result.steps]))
    doc.add(Notes(list(result.notes)))
    return doc
