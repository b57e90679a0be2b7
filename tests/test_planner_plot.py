"""`fit --plot` / `plan --plot`: the sweeps behind them (planner.sweep) and the files written.

Real catalog models with the analytic method (milliseconds a point) and the planner fakes
(an estimator with a known formula, its "trace" a distortion of its "analytic").
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from test_planner_fakes import (
    CNN,
    GPUS,
    H100,
    INSTANCES,
    RTX4090,
    SMALL,
    FakeEstimator,
    screen_for,
    usable,
)
from vramplan.cli.main import main
from vramplan.errors import PlanError, WorkloadError
from vramplan.hardware.catalog import get_gpu, usable_capacity
from vramplan.planner.fit import fit
from vramplan.planner.plan import plan
from vramplan.planner.rank import rank_gpus
from vramplan.planner.sweep import TRACED, fit_sweeps, plan_sweep, rank_sweep, short_gpu, sweep
from vramplan.report.plot import plot_sweep
from vramplan.workload import Method, Workload

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MiB = 1 << 20


def _increasing(pts):
    xs = [x for x, _ in pts]
    ys = [y for _, y in pts]
    return xs == sorted(set(xs)) and ys == sorted(ys)


def _marker(s, prefix):
    (name,) = [k for k in s.markers if k.startswith(prefix)]
    return s.markers[name]


def _draw(s, path):
    return plot_sweep(s.series, path, x_label=s.x_label, capacities=s.capacities, markers=s.markers,
                      paired=s.paired)


# --------------------------------------------------------------------------- fit (real model, analytic)
@pytest.fixture(scope="module")
def qwen_fit():
    r = fit("qwen2.5-0.5b", Workload(seq=2048), gpu="rtx-4090", method="analytic")
    return r, fit_sweeps("qwen2.5-0.5b", r)


def test_fit_batch_sweep_data(qwen_fit, tmp_path):
    r, (batch, _) = qwen_fit
    assert r.max_batch >= 1 and batch.axis == "batch" and batch.fixed == 2048
    (pts,) = batch.series.values()
    assert _increasing(pts)
    xs = [x for x, _ in pts]
    assert xs[0] == 1 and xs[-1] == 2 * r.max_batch  # 1 … 2 × max batch
    assert {1, 2, r.max_batch, r.max_batch + 1} <= set(xs)
    u = usable_capacity(get_gpu("rtx-4090"))[0]
    assert batch.capacities == {"RTX 4090 usable": u} and u == r.usable
    # the boundary: on the curve, under the capacity; the step above: on it, over the capacity
    curve = dict(pts)
    (fits,) = _marker(batch, "largest that fits")
    (over,) = _marker(batch, "does not fit")
    assert fits == (r.max_batch, r.batch.at.peak.device_used) and curve[r.max_batch] == fits[1] <= u
    assert over == (r.max_batch + 1, r.batch.above.peak.device_used) and curve[r.max_batch + 1] == over[1] > u
    assert batch.markers["traced (search)"] == () and batch.calibration is None  # analytic: nothing traced

    d = _draw(batch, tmp_path / "b.png")
    assert (tmp_path / "b.png").read_bytes()[:8] == PNG_MAGIC
    assert d.points == {k: tuple((float(x), y) for x, y in v) for k, v in batch.series.items()}
    assert d.levels == batch.capacities and d.unit == "GiB"
    assert d.markers[next(k for k in d.markers if k.startswith("largest"))] == ((float(r.max_batch), fits[1]),)
    assert "traced (search)" not in d.markers  # empty: not drawn


def test_fit_seq_sweep_data(qwen_fit):
    r, (_, seq) = qwen_fit
    assert seq is not None and seq.axis == "seq" and seq.fixed == r.workload.batch
    (pts,) = seq.series.values()
    assert _increasing(pts)
    xs = [x for x, _ in pts]
    assert xs[0] == 128 and xs[-1] == 2 * r.max_seq and r.max_seq in xs
    (fits,) = _marker(seq, "largest that fits")
    (over,) = _marker(seq, "does not fit")
    assert fits[0] == r.max_seq and over[0] == r.max_seq + r.seq.step
    assert fits[1] <= r.usable < over[1] and dict(pts)[over[0]] == over[1]


def test_seq_sweep_stops_at_max_positions():
    r = fit("gpt2", Workload(seq=512), gpu="h100-sxm", method="analytic")
    _, seq = fit_sweeps("gpt2", r)
    assert r.seq.limited_by == "max_positions"
    (pts,) = seq.series.values()
    assert pts[-1][0] == 1024 and all(x <= 1024 for x, _ in pts)
    assert _marker(seq, "largest that fits: seq 1,024, the model's max positions")
    assert _marker(seq, "does not fit") == ()


# --------------------------------------------------------------------------- fit calibrated to traces
class Recording(FakeEstimator):
    def __init__(self) -> None:
        super().__init__()
        self.reports = []

    def __call__(self, *a, **k):
        r = super().__call__(*a, **k)
        self.reports.append(r)
        return r


def test_fit_curve_is_calibrated_to_the_traced_points():
    est = Recording()
    w = Workload(batch=1, seq=2048)
    r = fit(SMALL, w, gpu=H100, method="trace", estimator=est)
    assert r.batch.at.method is Method.TRACE
    batch, seq = fit_sweeps(SMALL, r, reports=est.reports, gpu=H100, estimator=est)
    (pts,) = batch.series.values()
    curve = dict(pts)
    assert _increasing(pts) and batch.calibration is not None
    alpha, beta = batch.calibration
    assert 0.5 <= beta <= 2.0
    # the fake trace is the analytic formula × 1.03 + 300 MiB: the curve follows the traces
    traced = [*batch.markers["traced (search)"], *_marker(batch, "largest"), *_marker(batch, "does not fit")]
    assert len(traced) >= 2
    for x, used in traced:
        assert abs(curve[x] - used) <= 0.002 * used
        analytic = est(SMALL, w.replace(batch=x), gpu=H100, method="analytic").peak.device_used
        assert used - analytic > 300 * MiB  # without the calibration the curve would be off
    (fits,) = _marker(batch, "largest that fits")
    assert fits == (r.max_batch, r.batch.at.peak.device_used) and fits[1] <= usable(H100)
    assert seq is not None and seq.calibration is not None
    assert dict(seq.series[next(iter(seq.series))])[r.max_seq] == pytest.approx(r.seq.at.peak.device_used,
                                                                                 rel=0.002)


def test_fit_without_analytic_formulas_joins_the_traced_points():
    est = Recording()
    r = fit(CNN, Workload(batch=1), gpu=RTX4090, method="auto", estimator=est, max_batch=256)
    batch, seq = fit_sweeps(CNN, r, reports=est.reports, gpu=RTX4090, estimator=est)
    assert seq is None and batch.method is Method.TRACE and "sequence" not in batch.x_label
    (pts,) = batch.series.values()
    traced = {(x.workload.batch, x.peak.device_used) for x in est.reports if x.method is Method.TRACE}
    assert set(pts) == traced and len(pts) >= 3 and _increasing(pts)
    assert _marker(batch, "largest that fits: batch 256, the search limit") == ((256, r.batch.at.peak.device_used),)


# --------------------------------------------------------------------------- plan and ranking (fakes)
def test_plan_sweep_one_curve_per_plan_through_each_plan():
    est = FakeEstimator()
    res = plan(SMALL, Workload(batch=2, seq=2048), gpu=RTX4090, screen=screen_for(SMALL, est),
               instances=INSTANCES, method="trace", confirm=2)
    s = plan_sweep(SMALL, res, gpu=RTX4090, estimator=est)
    assert 1 <= len(s.series) <= 5 and s.capacities == {f"{RTX4090.name} usable": usable(RTX4090)}
    names = list(s.series)
    assert [n.split(". ", 1)[0] for n in names] == sorted((n.split(". ", 1)[0] for n in names), key=int)
    assert all(", batch" not in n for n in names)  # batch is the x axis
    (marks,) = s.markers.values()
    assert len(marks) == len(names)
    for name in names:
        p = res.plans[int(name.split(".")[0]) - 1]
        curve = dict(s.series[name])
        assert _increasing(s.series[name])
        assert (p.workload.batch, p.memory) in marks
        assert curve[p.workload.batch] == pytest.approx(p.memory, rel=0.001)  # calibrated when traced
    assert any(p.confirmed and p.method is Method.TRACE for p in res.plans[:2])


def test_rank_sweep_one_curve_per_gpu_type_with_its_capacity():
    est = FakeEstimator()
    ranking = rank_gpus(SMALL, Workload(batch=1, seq=1024), gpus=list(GPUS.values()), instances=INSTANCES,
                        screen=screen_for(SMALL, est), method="analytic")
    s = rank_sweep(SMALL, ranking, gpus=list(GPUS.values()), estimator=est)
    keys = list(dict.fromkeys(r.plan.gpu for r in ranking.ranked))
    assert len(s.series) == len(keys) and len(s.capacities) == len(keys)
    assert s.capacities == {f"{GPUS[k].name} usable": usable(GPUS[k]) for k in keys}
    assert set(s.paired) == set(s.series) and set(s.paired.values()) == set(s.capacities)
    for name, cap in s.paired.items():
        assert name.split(":")[0].split(" ×")[0] == cap.removesuffix(" usable")
        assert _increasing(s.series[name])


# --------------------------------------------------------------------------- sweep() itself
def test_sweep_per_gpu_where_overheads_differ():
    w = Workload(seq=1024)
    s = sweep("qwen2.5-0.5b", w, gpus=["rtx-4090", "h100-sxm"], axis="batch", values=[4, 1, 2])
    assert list(s.series) == ["qwen2.5-0.5b on RTX 4090", "qwen2.5-0.5b on H100 SXM5 80GB"]
    a, b = s.series.values()
    assert [x for x, _ in a] == [1, 2, 4] == [x for x, _ in b]
    assert all(y1 < y2 for (_, y1), (_, y2) in zip(a, b, strict=True))  # H100's context is larger
    assert s.capacities == {f"{short_gpu(get_gpu(k).name)} usable": usable_capacity(get_gpu(k))[0]
                            for k in ("rtx-4090", "h100-sxm")}
    one = sweep("qwen2.5-0.5b", w, gpus=["rtx-4090", "rtx-4090"], axis="batch", values=[1, 2])
    assert list(one.series) == ["qwen2.5-0.5b"] and one.paired == {}


def test_sweep_marks_only_traced_points_of_the_same_workload():
    est = FakeEstimator()
    w = Workload(seq=1024)
    t = est(SMALL, w.replace(batch=3), gpu=RTX4090, method="trace")
    other = est(SMALL, w.replace(batch=3, seq=512), gpu=RTX4090, method="trace")  # not on this axis
    s = sweep(SMALL, w, gpus=[RTX4090], axis="batch", traced=[t, other], values=[1, 2], estimator=est)
    assert s.markers[TRACED] == ((3, t.peak.device_used),)
    (pts,) = s.series.values()
    assert [x for x, _ in pts] == [1, 2, 3] and dict(pts)[3] == pytest.approx(t.peak.device_used, rel=1e-6)


def test_sweep_mistakes_are_plan_errors():
    w = Workload(seq=512)
    with pytest.raises(PlanError, match="axis"):
        sweep("gpt2", w, gpus=["t4"], axis="tokens")
    with pytest.raises(PlanError, match="positive"):
        sweep("gpt2", w, gpus=["t4"], axis="batch", values=[0, 2])
    with pytest.raises(PlanError, match="above the limit"):
        sweep("gpt2", w, gpus=["t4"], axis="seq", values=[4096])
    with pytest.raises(WorkloadError):  # the workload's own mistake, not "no formulas"
        sweep("gpt2", w.replace(seq=4096), gpus=["t4"], axis="batch")
    with pytest.raises(PlanError, match="no sequence axis"):
        sweep(CNN, w, gpus=[RTX4090], axis="seq", estimator=FakeEstimator())
    with pytest.raises(PlanError, match="no analytic formulas"):
        sweep(CNN, w, gpus=[RTX4090], axis="batch", estimator=FakeEstimator())


# --------------------------------------------------------------------------- the CLI
def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_fit_plot_writes_batch_and_seq_files(capsys, tmp_path):
    out = tmp_path / "fit.svg"
    code, _, err = _run(capsys, "fit", "qwen2.5-0.5b", "--gpu", "rtx-4090", "--method", "analytic",
                        "--plot", str(out))
    assert code == 0
    for p in (out, tmp_path / "fit-seq.svg"):
        ET.parse(p)
        assert f"plot written to {p}" in err
    text = out.read_text()
    assert "RTX 4090 usable" in text and "largest that fits: batch" in text and "(GiB)" in text
    # deterministic: the same command writes the same bytes
    first = out.read_bytes()
    _run(capsys, "fit", "qwen2.5-0.5b", "--gpu", "rtx-4090", "--method", "analytic", "--plot", str(out))
    assert out.read_bytes() == first


def test_plan_and_rank_plots(capsys, tmp_path):
    code, _, err = _run(capsys, "plan", "llama-3.2-1b", "--gpu", "rtx-4090", "--method", "analytic",
                        "--plot", str(tmp_path / "plan.html"))
    assert code == 0 and "plot written to" in err
    html = (tmp_path / "plan.html").read_text()
    assert html.startswith("<!DOCTYPE html>") and "<svg" in html and "RTX 4090 usable" in html
    assert "1. " in html and "top plans on 1× RTX 4090" in html
    code, _, _ = _run(capsys, "plan", "qwen2.5-0.5b", "--rank-gpus", "--gpus", "1", "--method", "analytic",
                      "--top", "3", "--plot", str(tmp_path / "rank.png"))
    assert code == 0 and (tmp_path / "rank.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("cmd", [["fit", "gpt2", "--gpu", "t4"], ["plan", "gpt2", "--gpu", "t4"]])
def test_bad_plot_path_fails_before_any_work(capsys, tmp_path, cmd):
    code, out, err = _run(capsys, *cmd, "--method", "analytic", "--plot", str(tmp_path / "p.jpg"))
    # (gpt2's own 1,024 positions are noted first: --seq was not given)
    lines = err.splitlines()
    assert code == 2 and out == "" and lines[-1].startswith("error: cannot write a plot")
    assert [x for x in lines if not x.startswith("note: --seq not given")] == lines[-1:]
