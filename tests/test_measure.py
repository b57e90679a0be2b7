"""vramplan measure without a GPU: the no-GPU error, the timed loop against a fake device,
and the JSON line beside the predictions."""

from __future__ import annotations

import io
import json

import pytest

import vramplan
from show_fixtures import GiB, MiB
from vramplan.cli.main import main
from vramplan.errors import NoGPUError, VramplanError
from vramplan.measure import harness
from vramplan.measure.env import Environment, environment
from vramplan.measure.record import (
    SCHEMA,
    Measured,
    MeasureRecord,
    Prediction,
    append_jsonl,
    read_jsonl,
    relative_errors,
)
from vramplan.report.measure import to_doc
from vramplan.report.render import emit, to_text
from vramplan.workload import Workload


class OOM(Exception):
    pass


class FakeCuda:
    """A device whose NVML reads and peak counters are scripted."""

    def __init__(self, *, available=True, oom_at=None, used=None):
        self._available = available
        self.oom_at = oom_at
        self.used_values = list(used or [1 * GiB, 1 * GiB + 500 * MiB] + [6 * GiB] * 10)
        self.calls: list[str] = []
        self.history: list[int | None] = []

    def available(self):
        return self._available

    def start(self):
        self.calls.append("start")

    def sync(self):
        self.calls.append("sync")

    def empty_cache(self):
        self.calls.append("empty_cache")

    def reset_peaks(self):
        self.calls.append("reset_peaks")

    def reserved(self):
        return 2 * MiB

    def stats(self):
        return {"allocated_bytes.all.peak": 3 * GiB, "reserved_bytes.all.peak": 4 * GiB,
                "active_bytes.all.peak": 3 * GiB + MiB, "requested_bytes.all.peak": 3 * GiB - MiB,
                "num_alloc_retries": 1, "num_ooms": 0}

    def used(self):
        return self.used_values.pop(0) if self.used_values else None

    def record_history(self, max_entries):
        self.history.append(max_entries)

    def dump_snapshot(self, path):
        self.calls.append(f"dump {path}")

    def is_oom(self, exc):
        return isinstance(exc, OOM)


def counting_build(steps: list[int], oom_at: int | None = None):
    def build():
        def step():
            steps.append(len(steps))
            if oom_at is not None and len(steps) > oom_at:
                raise OOM()
        return step
    return build


# --------------------------------------------------------------------------- no GPU
def test_cli_without_gpu_is_one_line_exit_2(capsys):
    assert main(["measure", "gpt2", "--seq", "128"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: no CUDA GPU found: `vramplan measure` needs one; "
                   "use `vramplan estimate` to predict")


def test_library_without_gpu_raises_no_gpu_error():
    with pytest.raises(NoGPUError, match="no CUDA GPU found"):
        vramplan.measure("gpt2", Workload(seq=128))
    with pytest.raises(NoGPUError):
        harness.run_steps(counting_build([]), cuda=FakeCuda(available=False))


def test_environment_reads_versions_without_a_gpu():
    env = environment()
    assert env.gpu_name is None and env.torch and env.python
    assert env.transformers  # installed in the dev environment


# --------------------------------------------------------------------------- the timed loop
def test_run_steps_counts_and_subtracts_the_baseline(tmp_path):
    steps: list[int] = []
    cuda = FakeCuda()
    m = harness.run_steps(counting_build(steps), iterations=3, warmup=2, snapshot=tmp_path / "s.pickle",
                          max_entries=1234, cuda=cuda)
    assert len(steps) == 5 and len(m.step_times_s) == 3 and m.step_time_s is not None
    assert (m.allocated, m.reserved, m.active, m.requested) == (3 * GiB, 4 * GiB, 3 * GiB + MiB, 3 * GiB - MiB)
    assert m.device_used == 5 * GiB  # 6 GiB sampled − 1 GiB of other processes
    assert m.device_used_baseline == GiB
    assert m.context == 500 * MiB - 2 * MiB  # NVML after init − baseline − the first segment
    assert m.alloc_retries == 1 and not m.oom
    # build-time temporaries are dropped and peaks reset before the first step
    assert cuda.calls[:4] == ["start", "sync", "empty_cache", "reset_peaks"]
    assert cuda.history == [1234, None] and f"dump {tmp_path / 's.pickle'}" in cuda.calls
    assert m.snapshot == str(tmp_path / "s.pickle")


def test_run_steps_reports_oom_as_a_result():
    steps: list[int] = []
    cuda = FakeCuda()
    m = harness.run_steps(counting_build(steps, oom_at=1), iterations=3, warmup=1, snapshot="x.pickle", cuda=cuda)
    assert m.oom and len(steps) == 2 and m.step_times_s == ()
    assert "dump x.pickle" in cuda.calls and cuda.history[-1] is None  # snapshot still written


def test_run_steps_lets_other_errors_through():
    def build():
        raise RuntimeError("bug")
    with pytest.raises(RuntimeError, match="bug"):
        harness.run_steps(build, cuda=FakeCuda())


def test_run_steps_without_nvml():
    m = harness.run_steps(counting_build([]), iterations=1, warmup=0, cuda=FakeCuda(used=[None] * 5))
    assert m.device_used is None and m.context is None


# --------------------------------------------------------------------------- records
ENV = Environment(gpu_name="NVIDIA H200", gpu_memory=150_000_000_000, compute_capability="9.0",
                  driver="570.00", cuda="12.8", torch="2.13.0", transformers="5.0", peft=None,
                  bitsandbytes=None, vramplan="0.1.0", python="3.11", platform="Linux")
MEAS = Measured(allocated=10 * GiB, reserved=12 * GiB, device_used=13 * GiB, step_time_s=0.5, iterations=3)


def test_relative_errors():
    preds = (Prediction("trace", allocated=11 * GiB, reserved=12 * GiB, device_used=12 * GiB),
             Prediction("analytic", error="not a transformer"))
    errs = relative_errors(MEAS, preds)
    assert errs == {"trace": {"allocated": pytest.approx(0.1), "reserved": 0.0,
                              "device_used": pytest.approx(-1 / 13)}}
    assert relative_errors(Measured(allocated=1, reserved=1, device_used=1, oom=True), preds) == {}
    assert relative_errors(None, preds) == {}


def test_measure_assembles_one_json_line(tmp_path, monkeypatch):
    """measure() with a fake device and build, and the real analytic prediction."""
    from vramplan.measure import step as step_mod

    steps: list[int] = []
    monkeypatch.setattr(step_mod, "build_step", lambda spec, w: counting_build(steps)())
    out = tmp_path / "results" / "run.jsonl"
    w = Workload(batch=2, seq=256)
    for label in ("a", "b"):
        rec = vramplan.measure("gpt2", w, gpu="h100-sxm", iterations=2, warmup=1, out=out,
                               methods=("analytic",), label=label, cuda=FakeCuda())
    assert len(steps) == 6
    lines = list(read_jsonl(out))
    assert [x["id"] for x in lines] == ["a", "b"]
    line = lines[-1]
    assert line["schema"] == SCHEMA and line["model"] == "gpt2"
    assert line["workload"]["batch"] == 2 and line["workload"]["seq"] == 256
    assert line["measured"]["allocated"] == 3 * GiB and line["measured"]["device_used"] == 5 * GiB
    assert set(line["env"]) >= {"gpu_name", "driver", "cuda", "torch", "transformers", "vramplan"}
    pred = line["predicted"]["analytic"]
    assert pred["allocated"] == rec.predicted[0].allocated > 0
    assert line["error"]["analytic"]["allocated"] == pytest.approx((pred["allocated"] - 3 * GiB) / (3 * GiB))
    assert line["extra"] == {"gpu": "h100-sxm"}


def test_prediction_failures_are_recorded_not_raised(monkeypatch):
    from vramplan.measure import predict as pred_mod

    def boom(*a, **k):
        raise VramplanError("cannot trace this")
    monkeypatch.setattr("vramplan.engine.estimate", boom)
    (p,) = pred_mod.predict("gpt2", Workload(seq=128), methods=("trace",))
    assert not p.ok and "cannot trace this" in p.error


def test_read_jsonl_errors(tmp_path):
    with pytest.raises(VramplanError, match="no results file"):
        list(read_jsonl(tmp_path / "none.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"schema": "vramplan.measure/1"}\n\nnot json\n')
    with pytest.raises(VramplanError, match=r"bad.jsonl:3: not valid JSON"):
        list(read_jsonl(bad))
    other = tmp_path / "other.jsonl"
    append_jsonl({"schema": "something else"}, other)
    with pytest.raises(VramplanError, match="not a vramplan measurement"):
        list(read_jsonl(other))


@pytest.mark.parametrize("fmt", ["table", "markdown", "json"])
def test_measure_report_renders(fmt):
    rec = MeasureRecord(model="gpt2", workload=Workload(seq=128), env=ENV, measured=MEAS,
                        predicted=(Prediction("trace", allocated=11 * GiB, reserved=12 * GiB, device_used=14 * GiB,
                                              peak_phase="backward", seconds=1.5),
                                   Prediction("analytic", error="no formula")))
    buf = io.StringIO()
    emit(to_doc(rec), fmt, buf, rec.to_json())
    text = buf.getvalue()
    if fmt == "json":
        assert json.loads(text)["error"]["trace"]["allocated"] == pytest.approx(0.1)
    else:
        assert "+10.0%" in text and "no formula" in text
    assert "+10.0%" in to_text(to_doc(rec))
