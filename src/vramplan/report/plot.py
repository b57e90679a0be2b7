"""Plots of predictions, sweeps and snapshots, as .png, .svg or a self-contained .html.

Every function returns a :class:`PlotData` holding the arrays it drew (in bytes), so tests
and callers can check the picture's numbers. Files are deterministic: fixed size and DPI,
no dates in the metadata, fixed SVG ids (``svg.hashsalt``). Only the Agg canvas is used;
pyplot's global state is never touched. Sizes are drawn in GiB (2**30 bytes), or in MiB
when everything is below 1 GiB.
"""

from __future__ import annotations

import functools
import importlib.util
import io
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

from vramplan.errors import VramplanError
from vramplan.events import Category
from vramplan.results import BREAKDOWN_KEYS, MemoryReport
from vramplan.units import GiB, MiB, fmt_bytes

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from vramplan.snapshot.analyze import SnapshotAnalysis

SUFFIXES = (".png", ".svg", ".html")
ORDER: tuple[str, ...] = (*BREAKDOWN_KEYS, "unknown")
COLORS: Mapping[str, str] = {
    "weights": "#4E79A7", "gradients": "#F28E2B", "optimizer": "#59A14F",
    "activations": "#E15759", "temporaries": "#B07AA1", "kv_cache": "#9C755F",
    "unknown": "#BAB0AC", "overhead": "#79706E", "cache": "#D7D2CB",
}
LABELS: Mapping[str, str] = {
    "weights": "weights", "gradients": "gradients", "optimizer": "optimizer states",
    "activations": "activations", "temporaries": "temporaries", "kv_cache": "KV cache",
    "unknown": "unknown", "overhead": "CUDA context & libraries (outside the allocator)",
    "cache": "allocator cache (reserved − allocated)",
}
SIZE_IN = (12.0, 5.6)
DPI = 100
MAX_POINTS = 3000
PHASE_SHADES: Mapping[str, tuple[str, float]] = {
    "setup": ("#000000", 0.03), "backward": ("#000000", 0.06), "recompute": ("#000000", 0.06),
    "optimizer": ("#4E79A7", 0.08), "prefill": ("#000000", 0.04),
}
"""Background of each phase span (forward and decode stay white)."""
MARKER_STYLES: tuple[tuple[str, str, bool], ...] = (
    ("D", "#222222", False), ("*", "#2E7D32", True), ("X", "#C00000", True), ("s", "#6A1B9A", False),
    ("^", "#8D6E00", True),
)
"""Sweep markers, in the order given: (shape, colour, filled)."""
OFF_SCALE = 2.5
"""A capacity line more than this many times the data's height is named, not drawn."""
_FINE = {c.label: c.bucket for c in Category}


@dataclass(frozen=True)
class PlotData:
    """What a plot shows, in bytes (the figure converts to GiB)."""

    path: str
    kind: str
    """``report`` | ``sweep`` | ``snapshot``."""
    title: str
    x: tuple[float, ...] = ()
    x_label: str = ""
    stacked: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Stacked areas, bottom to top (``overhead`` is the constant base when present)."""
    lines: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Lines over ``x`` (e.g. reserved + overhead)."""
    levels: Mapping[str, int] = field(default_factory=dict)
    """Horizontal lines (usable capacity of a GPU)."""
    bars: Mapping[str, int] = field(default_factory=dict)
    """The breakdown panel (bytes per category at the peak)."""
    spans: tuple[tuple[float, float, str], ...] = ()
    peak_x: float | None = None
    points: Mapping[str, tuple[tuple[float, int], ...]] = field(default_factory=dict)
    """Sweeps: series name → (x, bytes)."""
    extra_series: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    """Other drawn series that are not bytes (e.g. fragmentation as a fraction)."""
    markers: Mapping[str, tuple[tuple[float, int], ...]] = field(default_factory=dict)
    """Sweeps: points drawn as markers, not joined (name → (x, bytes)), e.g. traced points."""
    unit: str = "GiB"
    """The unit of the drawn axes: GiB, or MiB when everything is below 1 GiB."""

    @property
    def stacked_total(self) -> tuple[int, ...]:
        cols = list(self.stacked.values())
        return tuple(sum(c[k] for c in cols) for k in range(len(self.x))) if cols else ()


def _has_matplotlib() -> bool:
    try:
        return importlib.util.find_spec("matplotlib") is not None
    except ImportError:
        return False


def check_plot_path(path: str | Path) -> Path:
    """Fail early (before a long computation) on a suffix we cannot write, or without matplotlib."""
    p = Path(path)
    if not _has_matplotlib():
        raise VramplanError("plots need matplotlib, which is not installed", hint="pip install 'vramplan[plot]'")
    if p.suffix.lower() not in SUFFIXES:
        raise VramplanError(f"cannot write a plot to '{p}'", hint="use a .png, .svg or .html file name")
    if not p.parent.exists():
        raise VramplanError(f"cannot write a plot to '{p}': folder '{p.parent}' does not exist")
    if p.is_dir():
        raise VramplanError(f"cannot write a plot to '{p}': it is a folder", hint="name a file, e.g. out.png")
    if not os.access(p.parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise VramplanError(f"cannot write a plot to '{p}': not writable", hint="choose a file in a folder you can write")
    return p


F = TypeVar("F", bound=Callable[..., Any])


# --------------------------------------------------------------------------- public API
def _styled(fn: F) -> F:
    """Run a public plot function inside the project's matplotlib style (imported lazily)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _style():
            return fn(*args, **kwargs)

    return cast(F, wrapper)


def report_data(report: MemoryReport, path: str = "") -> PlotData:
    """What :func:`plot_report` draws, without drawing (no matplotlib): the timeline stacked by
    bucket (decimated to :data:`MAX_POINTS`), or one stacked bar per phase for the analytic
    method, the capacity levels and the breakdown at the peak. The web page draws the same data."""
    w = report.workload
    title = f"{report.model}: {w.task}, batch {w.batch}, seq {w.seq}, {w.precision} ({report.method})"
    overhead = report.overhead_total
    levels = _capacity(report)
    bars = {k: v for k, v in report.breakdown.as_dict().items() if v}
    cache = max(report.peak.reserved - report.peak.allocated, 0)
    if cache:
        bars["cache"] = cache
    if overhead:
        bars["overhead"] = overhead
    unit = _unit(report.peak.device_used, *levels.values())
    tl = report.timeline
    if tl is not None and tl.index:
        series = _buckets(tl.series, len(tl.index))
        keep = decimate([sum(c[k] for c in series.values()) for k in range(len(tl.index))],
                         list(tl.reserved) if tl.reserved else None)
        x = tuple(float(tl.index[k]) for k in keep)
        stacked: dict[str, tuple[int, ...]] = {"overhead": (overhead,) * len(keep)} if overhead else {}
        stacked.update({c: tuple(v[k] for k in keep) for c, v in series.items()})
        lines = {"reserved + overhead": tuple(tl.reserved[k] + overhead for k in keep)} if tl.reserved else {}
        totals = [sum(v[k] for v in series.values()) for k in keep]
        peak_x = x[max(range(len(totals)), key=totals.__getitem__)]
        data = PlotData(
            path=path, kind="report", title=title, x=x, x_label="allocator events (trace order)",
            stacked=stacked, lines=lines, levels=levels, bars=bars,
            spans=tuple((float(a), float(b), n) for a, b, n in _merge_spans(tl.phases)), peak_x=peak_x,
            unit=unit,
        )
    else:  # no timeline (analytic): one stacked bar per phase
        phases = report.phases or ()
        x = tuple(float(i) for i in range(len(phases)))
        stacked = {"overhead": (overhead,) * len(phases)} if overhead else {}
        for c in BREAKDOWN_KEYS:
            col = tuple(ph.breakdown.as_dict()[c] for ph in phases)
            if any(col):
                stacked[c] = col
        if cache:  # known at the peak only: drawn on the peak phase's bar
            stacked["cache"] = tuple(cache if ph.phase == report.peak_phase else 0 for ph in phases)
        data = PlotData(path=path, kind="report", title=title, x=x, x_label="phase",
                        stacked=stacked, levels=levels, bars=bars, unit=unit,
                        spans=tuple((i - 0.5, i + 0.5, str(ph.phase)) for i, ph in enumerate(phases)))
    return data


@_styled
def plot_report(report: MemoryReport, path: str | Path) -> PlotData:
    """A prediction: the timeline stacked by category (or per phase, for the analytic method),
    reserved as a line, phases shaded, the GPU's usable capacity, and the breakdown at the peak."""
    p = check_plot_path(path)
    data = report_data(report, str(p))
    unit, overhead, levels, bars = data.unit, report.overhead_total, data.levels, data.bars
    tl = report.timeline
    fig = _figure_two_panels()
    ax, axb = fig.axes
    if tl is not None and tl.index:
        _draw_timeline(ax, data)
        _mark_peak(ax, data.peak_x, report.peak.allocated + overhead,
                   f"peak: {_g(report.peak.allocated)} allocated\n{_g(report.peak.device_used)} device used "
                   f"({report.peak_phase})", unit)
    else:
        _draw_phase_bars(ax, data)
    _draw_levels(ax, levels, unit)
    _draw_bars(axb, bars, f"At the peak ({report.peak_phase})", unit)
    subtitle = _verdict_line(report)
    _finish(fig, ax, data.title, subtitle)
    _save(fig, data, subtitle)
    return data


@_styled
def plot_sweep(
    points: Mapping[str, Sequence[tuple[float, int]]], path: str | Path, *, x_label: str,
    capacities: Mapping[str, int] | None = None, title: str = "Predicted peak memory",
    y_label: str = "predicted peak, device used",
    markers: Mapping[str, Sequence[tuple[float, int]]] | None = None,
    paired: Mapping[str, str] | None = None,
) -> PlotData:
    """Memory against a swept quantity (batch size, sequence length): one line per series
    (``points``: name → [(x, bytes)]), one dashed line per GPU at its usable capacity
    (``capacities``: label → bytes), and optional unjoined ``markers`` (name → [(x, bytes)],
    e.g. traced points or a boundary; each name gets the next symbol of :data:`MARKER_STYLES`,
    in order: an empty one is not drawn but keeps its symbol, so that a role keeps its look).
    ``paired``: series name → capacity label; that capacity line takes the series' colour
    (one GPU per curve)."""
    p = check_plot_path(path)
    pts = {name: tuple(sorted((float(x), int(b)) for x, b in s)) for name, s in points.items()}
    if not any(pts.values()):
        raise VramplanError("nothing to plot: the sweep has no points")
    styles = {name: k for k, name in enumerate(markers or {})}
    marks = {name: tuple(sorted((float(x), int(b)) for x, b in s)) for name, s in (markers or {}).items() if s}
    levels = dict(capacities or {})
    unit = _unit(*(b for s in (*pts.values(), *marks.values()) for _, b in s), *levels.values())
    data = PlotData(path=str(p), kind="sweep", title=title, x_label=x_label, points=pts,
                    levels=levels, unit=unit, markers=marks)
    sc = _SCALE[unit]
    fig = _new_figure((9.0, 5.6))
    ax = fig.add_subplot(1, 1, 1)
    for i, (name, s) in enumerate(pts.items()):
        xs, ys = [a for a, _ in s], [b / sc for _, b in s]
        ax.plot(xs, ys, marker="o", ms=4, lw=1.8, color=_cycle(i), label=name)
    for name, s in marks.items():
        shape, color, filled = MARKER_STYLES[styles[name] % len(MARKER_STYLES)]
        ax.scatter([a for a, _ in s], [b / sc for _, b in s], marker=shape, s=70, zorder=5, linewidths=1.4,
                   facecolors=color if filled else "none", edgecolors=color, label=name)
    xs_all = [a for s in (*pts.values(), *marks.values()) for a, _ in s]
    if min(xs_all) > 0 and max(xs_all) / min(xs_all) >= 8:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(_int_formatter())
    elif all(float(a).is_integer() for a in xs_all):  # batch sizes, token counts: no 1.5 ticks
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    order = {name: i for i, name in enumerate(pts)}
    colors = {lv: _cycle(order[name]) for name, lv in (paired or {}).items() if name in order}
    _draw_levels(ax, data.levels, unit, clip=False, colors=colors)
    ax.set_xlabel(x_label)
    ax.set_ylabel(f"{y_label} ({unit})")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    if marks:  # below the axes: markers sit where the curves cross the capacity lines
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, fontsize=8, frameon=False)
    else:
        ax.legend(loc="upper left", fontsize=8, framealpha=0.9)
    ax.set_title(title, fontsize=12, loc="left")
    fig.tight_layout()
    _save(fig, data, "")
    return data


@_styled
def plot_snapshot(analysis: SnapshotAnalysis, path: str | Path) -> PlotData:
    """A recorded snapshot: allocated by inferred category over the trace, reserved, OOMs,
    fragmentation below, and the breakdown at the allocated peak."""
    p = check_plot_path(path)
    tl = analysis.timeline
    x = tuple(float(i) for i in tl.index)
    stacked = {c: tuple(v) for c, v in tl.by_category.items() if any(v)}
    title = f"Memory snapshot, device {analysis.device}: {analysis.entries:,} trace entries"
    bars = {c: v for c, v in analysis.breakdown_at_peak.items() if v}
    unit = _unit(analysis.peak_reserved, analysis.peak_allocated)
    data = PlotData(
        path=str(p), kind="snapshot", title=title, x=x, x_label="trace entry",
        stacked=stacked, lines={"reserved": tuple(tl.reserved)}, bars=bars,
        peak_x=float(analysis.peak_allocated_index),
        extra_series={"fragmentation": tl.fragmentation}, unit=unit,
    )
    fig = _new_figure(SIZE_IN)
    gs = fig.add_gridspec(2, 2, width_ratios=(3, 1.25), height_ratios=(3, 1), hspace=0.08, wspace=0.32)
    ax = fig.add_subplot(gs[0, 0])
    axf = fig.add_subplot(gs[1, 0], sharex=ax)
    axb = fig.add_subplot(gs[:, 1])
    _draw_timeline(ax, data)
    _mark_peak(ax, data.peak_x, analysis.peak_allocated, f"peak: {_g(analysis.peak_allocated)} allocated", unit)
    for o in analysis.ooms:
        ax.axvline(o.index, color="#C00000", lw=1.2, ls="-", alpha=0.8)
        ax.annotate(f"OOM: asked {_g(o.size)}", (o.index, 0.97), xycoords=("data", "axes fraction"),
                    fontsize=8, color="#C00000", ha="right", va="top", rotation=90)
    ax.tick_params(labelbottom=False)
    ax.set_xlabel("")
    axf.fill_between(x, [f * 100 for f in data.extra_series["fragmentation"]], step="post",
                     color="#888888", alpha=0.5, lw=0)
    axf.set_ylim(0, 100)
    axf.set_ylabel("unallocated\nreserved %", fontsize=8)
    axf.set_xlabel(data.x_label)
    axf.grid(True, alpha=0.3)
    _draw_bars(axb, bars, "At the allocated peak (inferred categories)", unit)
    sub = (f"peak allocated {_g(analysis.peak_allocated)} · peak reserved {_g(analysis.peak_reserved)} · "
           f"fragmentation at the reserved peak {analysis.fragmentation_at_peak:.0%}")
    _finish(fig, ax, title, sub)
    _save(fig, data, sub)
    return data


# --------------------------------------------------------------------------- data helpers
def _buckets(series: Mapping[str, Sequence[int]], n: int) -> dict[str, list[int]]:
    """Series keyed by breakdown bucket (fine event categories are summed into theirs), in ORDER."""
    acc: dict[str, list[int]] = {}
    for key, vals in series.items():
        b = key if key in ORDER else _FINE.get(key, "unknown")
        col = acc.setdefault(b, [0] * n)
        for k, v in enumerate(vals):
            col[k] += int(v)
    return {c: acc[c] for c in ORDER if c in acc and any(acc[c])}


def decimate(total: Sequence[int], other: Sequence[int] | None, max_points: int = MAX_POINTS) -> list[int]:
    """Indices to keep: all when few, else per bin the highest total (and highest ``other``)."""
    n = len(total)
    if n <= max_points:
        return list(range(n))
    bins = max_points // 2
    keep = {0, n - 1}
    for b in range(bins):
        lo, hi = b * n // bins, (b + 1) * n // bins
        if hi > lo:
            keep.add(max(range(lo, hi), key=total.__getitem__))
            if other is not None:
                keep.add(max(range(lo, hi), key=other.__getitem__))
    return sorted(keep)


def _merge_spans(spans: Sequence[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    out: list[tuple[int, int, str]] = []
    for a, b, name in spans:
        if out and out[-1][2] == name and a <= out[-1][1] + 1:
            out[-1] = (out[-1][0], b, name)
        else:
            out.append((a, b, name))
    return out


def _capacity(report: MemoryReport) -> dict[str, int]:
    v = report.verdict
    if v is None:
        return {}
    name = v.gpu_name or v.gpu
    return {f"{name} usable": v.usable}


def _verdict_line(report: MemoryReport) -> str:
    v = report.verdict
    pk = report.peak
    head = f"allocated {_g(pk.allocated)} · reserved {_g(pk.reserved)} · device used {_g(pk.device_used)}"
    if v is None:
        return head
    word = "fits" if v.fits else "does NOT fit"
    room = f"{_g(abs(v.headroom))} {'headroom' if v.headroom >= 0 else 'short'}"
    worst = report.worst_gpu
    which = f", GPU {worst.gpu} the fullest of {len(report.gpus)}" if worst is not None else ""
    return f"{head} · {word} on {v.gpu_name or v.gpu} ({room}{which})"


def _g(n: float) -> str:
    return f"{n / GiB:,.2f} GiB" if abs(n) >= GiB else f"{n / MiB:,.1f} MiB"


_SCALE = {"GiB": GiB, "MiB": MiB}


def _unit(*values: int) -> str:
    return "GiB" if max([0, *values]) >= GiB else "MiB"


# --------------------------------------------------------------------------- drawing helpers
def _style() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise VramplanError("plots need matplotlib", hint="pip install 'vramplan[plot]'") from None

    return matplotlib.rc_context({"svg.hashsalt": "vramplan", "svg.fonttype": "none", "font.size": 9,
                                  "axes.titlesize": 10, "path.simplify": True,
                                  "font.family": "DejaVu Sans"})


def _new_figure(size: tuple[float, float]) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=size, dpi=DPI)


def _figure_two_panels() -> Figure:
    fig = _new_figure(SIZE_IN)
    gs = fig.add_gridspec(1, 2, width_ratios=(3, 1.25), wspace=0.32)
    fig.add_subplot(gs[0, 0])
    fig.add_subplot(gs[0, 1])
    return fig


def _cycle(i: int) -> str:
    palette = ("#4E79A7", "#F28E2B", "#59A14F", "#E15759", "#76B7B2", "#EDC948", "#B07AA1",
               "#FF9DA7", "#9C755F", "#BAB0AC")
    return palette[i % len(palette)]


def _int_formatter() -> Any:
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _pos: f"{v:g}")


def _mem_axis(ax: Axes, unit: str) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_ylabel(f"GPU memory ({unit})")
    ax.yaxis.set_major_locator(MaxNLocator(nbins=8, steps=[1, 2, 2.5, 5, 10]))
    ax.grid(True, axis="y", alpha=0.3)


def _draw_timeline(ax: Axes, data: PlotData) -> None:
    x = list(data.x)
    sc = _SCALE[data.unit]
    names = list(data.stacked)
    ys = [[v / sc for v in data.stacked[c]] for c in names]
    if ys:
        ax.stackplot(x, *ys, labels=[LABELS.get(c, c) for c in names],
                     colors=[COLORS.get(c, "#999999") for c in names], step="post", lw=0, alpha=0.9)
        # A peak that lasts a few events of thousands is narrower than a pixel and the filled
        # areas do not show it; the outline of their top does.
        top = [sum(col) for col in zip(*ys, strict=True)]
        ax.step(x, top, where="post", color="#333333", lw=0.5, alpha=0.8)
    for name, vals in data.lines.items():
        ax.step(x, [v / sc for v in vals], where="post", color="black", lw=1.1, ls="-", label=name)
    lo, hi = (x[0], x[-1]) if x else (0.0, 1.0)
    width = max(hi - lo, 1.0)
    for a, b, name in data.spans:
        shade = PHASE_SHADES.get(name)
        if shade is not None:
            ax.axvspan(a, b, color=shade[0], alpha=shade[1], lw=0, zorder=0)
        if (b - a) / width >= 0.05:
            ax.annotate(name, ((a + b) / 2, 1.0), xycoords=("data", "axes fraction"),
                        xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                        fontsize=8, color="#444444", annotation_clip=False)
    ax.set_xlim(lo, hi if hi > lo else lo + 1)
    ax.set_xlabel(data.x_label)
    ax.set_ylim(0, _ymax(data))
    _mem_axis(ax, data.unit)


def _ymax(data: PlotData) -> float:
    """Room for the data, and for capacity lines unless they would squash it (> OFF_SCALE ×)."""
    top = max([*data.stacked_total, 0])
    for vals in data.lines.values():
        top = max(top, *vals) if vals else top
    near = [v for v in data.levels.values() if v <= OFF_SCALE * top]
    return max(top * 1.25, *(v * 1.08 for v in near), 1) / _SCALE[data.unit]


def _draw_phase_bars(ax: Axes, data: PlotData) -> None:
    bottom = [0.0] * len(data.x)
    for c, vals in data.stacked.items():
        v = [b / _SCALE[data.unit] for b in vals]
        ax.bar(list(data.x), v, bottom=bottom, color=COLORS.get(c, "#999999"), label=LABELS.get(c, c), width=0.6,
               hatch="//" if c == "cache" else None, edgecolor="#999999" if c == "cache" else None, lw=0)
        bottom = [a + b for a, b in zip(bottom, v, strict=True)]
    ax.set_xticks(list(data.x), [s[2] for s in data.spans])
    ax.set_xlabel("phase (analytic method: peak per phase)")
    ax.set_ylim(0, _ymax(data))
    _mem_axis(ax, data.unit)


def _draw_levels(ax: Axes, levels: Mapping[str, int], unit: str, clip: bool = True,
                 colors: Mapping[str, str] | None = None) -> None:
    """Dashed capacity lines; with ``clip``, one above the y range is named at the top instead.
    ``colors``: level name → colour, for those not in the default palette's order."""
    sc = _SCALE[unit]
    palette = ("#C00000", "#1F4E9A", "#2E7D32", "#6A1B9A", "#8D6E00", "#00695C")
    styles = ("--", "-.", ":", (0, (5, 1, 1, 1)))
    above = 0
    near = 0.05 * max(ax.get_ylim()[1] * sc, *levels.values(), 0)  # about a line of text: names overlap
    left: list[int] = []
    left_below: list[int] = []
    named_right: list[int] = []
    for k, (name, v) in enumerate(levels.items()):
        color = (colors or {}).get(name) or palette[k % len(palette)]
        if clip and v / sc > ax.get_ylim()[1]:
            ax.annotate(f"▲ {name}: {_g(v)} (above the plot)", (1.0, 1.0), xycoords="axes fraction",
                        xytext=(-4, -4 - 12 * above), textcoords="offset points", ha="right", va="top",
                        fontsize=8, color=color)
            above += 1
            continue
        ax.axhline(v / sc, color=color, lw=1.4, ls=styles[k % len(styles)], label=f"{name} ({_g(v)})")
        # names go above their line at the left; one too close to a name there goes below its
        # line when it is the lower one, else to the right end
        close = [u for u in left if abs(v - u) < near]
        below = bool(close) and all(v < u for u in close) and not any(abs(v - u) < near for u in left_below)
        right = bool(close) and not below
        (named_right if right else left_below if below else left).append(v)
        ax.annotate(f"{name}: {_g(v)}", (1.0 if right else 0.0, v / sc), xycoords=("axes fraction", "data"),
                    xytext=(-4 if right else 4, -3 if below else 3), textcoords="offset points",
                    ha="right" if right else "left", va="top" if below else "bottom", fontsize=8, color=color)


def _mark_peak(ax: Axes, x: float | None, value: int, text: str, unit: str) -> None:
    if x is None:
        return
    ax.axvline(x, color="black", lw=0.8, ls=":")
    lo, hi = ax.get_xlim()
    right = (x - lo) > 0.65 * (hi - lo)
    ax.annotate(text, (x, value / _SCALE[unit]), xytext=(-8 if right else 8, 8), textcoords="offset points",
                fontsize=8, ha="right" if right else "left", va="bottom", bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": "#888888", "lw": 0.6},
                arrowprops={"arrowstyle": "-", "color": "#555555", "lw": 0.6})


def _draw_bars(ax: Axes, bars: Mapping[str, int], title: str, unit: str) -> None:
    names = [c for c in (*ORDER, "cache", "overhead") if bars.get(c)]
    sc = _SCALE[unit]
    vals = [bars[c] / sc for c in names]
    ys = list(range(len(names)))[::-1]
    ax.barh(ys, vals, color=[COLORS.get(c, "#999999") for c in names], height=0.65)
    short = {"overhead": "CUDA context & libs", "cache": "allocator cache"}
    ax.set_yticks(ys, [short.get(c, LABELS.get(c, c)) for c in names])
    top = max(vals, default=1.0) or 1.0
    for y, v in zip(ys, vals, strict=True):
        ax.annotate(f"{v:,.2f}" if v >= 0.1 else fmt_bytes(v * sc, "auto", 1), (v, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
    ax.set_xlim(0, top * 1.3)
    ax.set_xlabel(unit)
    ax.set_title(title, fontsize=9, loc="left")
    ax.grid(True, axis="x", alpha=0.3)
    ax.spines[["top", "right"]].set_visible(False)


def _finish(fig: Figure, ax: Axes, title: str, subtitle: str) -> None:
    fig.suptitle(title, x=0.01, y=0.985, ha="left", fontsize=12, fontweight="bold")
    if subtitle:
        fig.text(0.01, 0.925, subtitle, ha="left", va="top", fontsize=9, color="#333333")
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(4, len(handles)), fontsize=8,
                   frameon=False, bbox_to_anchor=(0.5, 0.0))
    rows = (len(handles) + 3) // 4
    fig.subplots_adjust(left=0.06, right=0.98, top=0.86, bottom=0.12 + 0.04 * rows)


# --------------------------------------------------------------------------- output
def _save(fig: Figure, data: PlotData, subtitle: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    path = Path(data.path)
    try:
        _write(fig, data, subtitle, path)
    except OSError as e:
        raise VramplanError(f"cannot write a plot to '{path}': {e.strerror or e}",
                            hint="choose a file in a folder you can write") from None


def _write(fig: Figure, data: PlotData, subtitle: str, path: Path) -> None:
    suffix = path.suffix.lower()
    if suffix == ".png":
        fig.savefig(path, format="png", dpi=DPI, metadata={"Software": None})
    else:
        buf = io.StringIO()
        fig.savefig(buf, format="svg", dpi=DPI, metadata={"Date": None, "Creator": None})
        svg = buf.getvalue()
        if suffix == ".svg":
            text = svg
        else:
            from vramplan.report.plot_html import page

            text = page(data, svg, subtitle)
        path.write_text(text, encoding="utf-8")
