"""The web page's view data: JSON built from what the other renderers use.

The page's figures come from the same JSON as the CLI's ``--json`` (``MemoryReport.to_dict()``,
``FitResult.to_dict()``, …); this module adds only what the terminal does not print: the
timeline the ``--plot`` figure draws (:func:`vramplan.report.plot.report_data`) and the
catalog lists behind the page's pickers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vramplan.results import BREAKDOWN_KEYS, MemoryReport

from .doc import Doc, KeyValues, Notes, Table
from .plot import COLORS, LABELS, report_data


def timeline_json(report: MemoryReport) -> dict[str, Any]:
    """What ``vramplan estimate … --plot`` draws, in bytes: for a trace the allocated timeline
    stacked by category (decimated), reserved + overhead as a line, phase spans; for the analytic
    method one stacked bar per phase. (Top modules and tensors are in the estimate's JSON.)"""
    d = report_data(report)
    out: dict[str, Any] = {
        "kind": "timeline" if report.timeline is not None and report.timeline.index else "phases",
        "title": d.title, "x": list(d.x), "x_label": d.x_label,
        "stacked": {k: list(v) for k, v in d.stacked.items()},
        "lines": {k: list(v) for k, v in d.lines.items()},
        "levels": dict(d.levels), "bars": dict(d.bars),
        "spans": [list(s) for s in d.spans], "peak_x": d.peak_x, "unit": d.unit,
        "method": str(report.method),
        # what the page marks (as --plot does): where the peak is, and the figures shown above the chart
        "peak": {"x": d.peak_x, "phase": str(report.peak_phase), "allocated": report.peak.allocated,
                 "reserved": report.peak.reserved, "device_used": report.peak.device_used,
                 "overhead": report.overhead_total},
    }
    return out


def doc_json(doc: Doc) -> dict[str, Any]:
    """A report's :class:`~vramplan.report.doc.Doc` (what the terminal prints) as JSON, for the
    page to draw with the same rows and labels."""
    sections: list[dict[str, Any]] = []
    for sec in doc.sections:
        if isinstance(sec, Table):
            sections.append({"kind": "table", "title": sec.title, "columns": list(sec.columns),
                             "rows": [list(r) for r in sec.rows], "align": list(sec.align),
                             "footer": list(sec.footer) if sec.footer else None})
        elif isinstance(sec, KeyValues):
            sections.append({"kind": "values", "title": sec.title, "items": [list(kv) for kv in sec.items]})
        elif isinstance(sec, Notes):
            sections.append({"kind": "notes", "title": sec.title, "lines": list(sec.lines)})
    return {"title": doc.title, "subtitle": doc.subtitle, "sections": sections}


def legend_json() -> dict[str, Any]:
    """Colours and labels of the categories, shared with the matplotlib plots."""
    order = [*BREAKDOWN_KEYS, "unknown", "cache", "overhead"]
    return {"order": order, "colors": {k: COLORS[k] for k in order}, "labels": {k: LABELS[k] for k in order}}


def job_of(spec: Any) -> str:
    """The page's job view a model belongs to: ``vlm`` (takes images), ``diffusion`` (a denoiser),
    else ``lm`` (language and vision models: training objectives, inference, generation)."""
    from vramplan.models.arch import arch_of

    arch = arch_of(spec.config)
    kind = arch.kind if arch is not None else ""
    return "vlm" if kind == "vlm" else "diffusion" if kind in ("unet", "dit") else "lm"


def catalog_json(models: list[Any], gpus: list[Any], usable: Mapping[str, int]) -> dict[str, Any]:
    """The pickers' lists: catalog models (alias, family, params, the job kind they take) and GPUs
    (key, name, memory)."""
    return {
        "models": [{"alias": s.name, "hub_id": s.hub_id, "family": str(s.family), "params": s.params,
                    "job": job_of(s)} for s in models],
        "gpus": [{"key": g.key, "name": g.name, "vendor": g.vendor, "capacity": g.capacity,
                  "usable": usable[g.key]} for g in gpus],
    }

