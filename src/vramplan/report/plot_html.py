"""A plot as a self-contained HTML page: the SVG inline and the data behind it as tables."""

from __future__ import annotations

import html

from vramplan.report.plot import LABELS, PlotData, decimate
from vramplan.units import GiB


def page(data: PlotData, svg: str, subtitle: str) -> str:
    """The figure (inline SVG) and the numbers behind it, in one file with no scripts."""
    start = svg.find("<svg")
    e = html.escape
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{e(data.title)}</title>",
        "<style>body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}"
        "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:2px 8px}"
        "td{text-align:right;font-variant-numeric:tabular-nums}td:first-child{text-align:left}"
        "svg{max-width:100%;height:auto}</style></head><body>",
        f"<h1>{e(data.title)}</h1>",
    ]
    if subtitle:
        parts.append(f"<p>{e(subtitle)}</p>")
    parts.append(svg[start:])
    if data.bars:
        parts.append("<h2>Breakdown at the peak</h2><table><tr><th>category</th><th>bytes</th><th>GiB</th></tr>")
        parts += [f"<tr><td>{e(LABELS.get(k, k))}</td><td>{v:,}</td><td>{v / GiB:,.3f}</td></tr>"
                  for k, v in data.bars.items()]
        parts.append("</table>")
    if data.levels:
        parts.append("<h2>Capacity</h2><table><tr><th>GPU</th><th>bytes</th><th>GiB</th></tr>")
        parts += [f"<tr><td>{e(k)}</td><td>{v:,}</td><td>{v / GiB:,.3f}</td></tr>" for k, v in data.levels.items()]
        parts.append("</table>")
    if data.points:
        parts.append(f"<h2>Data</h2><table><tr><th>series</th><th>{e(data.x_label)}</th><th>bytes</th><th>GiB</th></tr>")
        parts += [f"<tr><td>{e(name)}</td><td>{x:g}</td><td>{b:,}</td><td>{b / GiB:,.3f}</td></tr>"
                  for name, s in data.points.items() for x, b in s]
        parts.append("</table>")
    if data.x and (data.stacked or data.lines):
        cols = [*data.stacked, *data.lines]
        rows = decimate(list(data.stacked_total) or [0] * len(data.x), None, 400)
        parts.append(f"<details><summary>Series in bytes ({len(rows)} of {len(data.x)} points)</summary>")
        parts.append("<table><tr><th>" + e(data.x_label) + "</th>"
                     + "".join(f"<th>{e(LABELS.get(c, c))}</th>" for c in cols) + "</tr>")
        series = {**data.stacked, **data.lines}
        for k in rows:
            parts.append(f"<tr><td>{data.x[k]:g}</td>" + "".join(f"<td>{series[c][k]:,}</td>" for c in cols) + "</tr>")
        parts.append("</table></details>")
    parts.append("</body></html>\n")
    return "\n".join(parts)
