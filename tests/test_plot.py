"""vramplan.report.plot: the files are valid and the data behind them adds up."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from show_fixtures import GiB, MiB, fake_report, recorded_snapshot
from vramplan.errors import VramplanError
from vramplan.report.plot import check_plot_path, plot_report, plot_snapshot, plot_sweep
from vramplan.snapshot.analyze import analyze
from vramplan.workload import Method

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_report_timeline_data(tmp_path):
    r = fake_report()
    d = plot_report(r, tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:8] == PNG_MAGIC
    tl = r.timeline
    assert d.x == tuple(float(i) for i in tl.index)
    overhead = r.overhead_total
    assert list(d.stacked)[0] == "overhead" and set(d.stacked["overhead"]) == {overhead}
    # the stack is the overhead plus every category of the timeline, point by point
    for k in range(len(d.x)):
        assert d.stacked_total[k] == overhead + sum(v[k] for v in tl.series.values())
    assert d.lines["reserved + overhead"] == tuple(v + overhead for v in tl.reserved)
    assert max(d.stacked_total) == r.peak.allocated + overhead
    assert d.stacked_total[int(d.peak_x)] == max(d.stacked_total)
    assert d.levels == {"NVIDIA GeForce RTX 4090 usable": r.verdict.usable}
    assert [s[2] for s in d.spans] == ["forward", "backward", "optimizer"] * 2
    # the breakdown panel: categories at the peak, allocator cache and overhead = device used
    assert sum(d.bars.values()) == r.peak.device_used
    assert d.unit == "GiB"


def test_report_without_timeline_draws_phases(tmp_path):
    r = fake_report(timeline=False, method=Method.ANALYTIC)
    d = plot_report(r, tmp_path / "a.svg")
    assert [s[2] for s in d.spans] == ["forward", "backward", "optimizer"]
    for k, ph in enumerate(r.phases):
        cache = r.peak.reserved - r.peak.allocated if ph.phase == r.peak_phase else 0
        assert d.stacked_total[k] == ph.allocated + r.overhead_total + cache
    assert max(d.stacked_total) == r.peak.device_used  # the peak phase's bar reaches device used
    ET.parse(tmp_path / "a.svg")  # well-formed XML


def test_small_reports_use_mib_and_no_verdict(tmp_path):
    r = fake_report(verdict=False, scale=MiB)
    d = plot_report(r, tmp_path / "s.png")
    assert d.unit == "MiB" and d.levels == {}


def test_svg_is_deterministic_and_html_is_self_contained(tmp_path):
    r = fake_report(fits=False)
    plot_report(r, tmp_path / "a.svg")
    plot_report(r, tmp_path / "b.svg")
    a = (tmp_path / "a.svg").read_bytes()
    assert a == (tmp_path / "b.svg").read_bytes()
    assert b"<dc:date>" not in a
    d = plot_report(r, tmp_path / "r.html")
    html = (tmp_path / "r.html").read_text()
    assert html.startswith("<!DOCTYPE html>") and "<svg" in html
    assert "<script" not in html and "http" not in html.split("<svg", 1)[0]
    assert f"{d.bars['weights']:,}" in html  # the data table
    assert "does NOT fit" in html


def test_sweep(tmp_path):
    pts = {"LoRA": [(4, 30 * GiB), (1, 18 * GiB), (32, 70 * GiB), (2, 20 * GiB)], "QLoRA": [(1, 8 * GiB)]}
    caps = {"RTX 4090 usable": int(23.6 * GiB), "A100 80GB usable": int(79.2 * GiB)}
    d = plot_sweep(pts, tmp_path / "sw.html", x_label="batch size", capacities=caps)
    assert d.points["LoRA"] == ((1.0, 18 * GiB), (2.0, 20 * GiB), (4.0, 30 * GiB), (32.0, 70 * GiB))
    assert d.levels == caps
    html = (tmp_path / "sw.html").read_text()
    assert html.count("<tr>") == (1 + 2) + (1 + 5)  # capacity and data tables, with headers
    with pytest.raises(VramplanError, match="no points"):
        plot_sweep({"x": []}, tmp_path / "e.png", x_label="batch")


def test_snapshot_plot(tmp_path):
    a = analyze(recorded_snapshot())
    d = plot_snapshot(a, tmp_path / "s.png")
    assert (tmp_path / "s.png").read_bytes()[:8] == PNG_MAGIC
    assert d.stacked_total == a.timeline.allocated
    assert d.lines["reserved"] == a.timeline.reserved
    assert d.extra_series["fragmentation"] == a.timeline.fragmentation
    assert sum(d.bars.values()) == a.peak_allocated
    assert d.peak_x == 3.0 and d.unit == "MiB"


@pytest.mark.parametrize("name", ["plot.jpg", "plot", "missing/plot.png"])
def test_bad_paths_fail_before_any_work(tmp_path, name):
    with pytest.raises(VramplanError):
        check_plot_path(tmp_path / name)
