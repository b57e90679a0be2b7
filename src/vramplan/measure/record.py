"""One measurement as data, and as one JSON line beside vramplan's predictions.

A line (schema ``vramplan.measure/1``)::

    {"schema": ..., "id": ..., "model": ..., "workload": {...}, "env": {...},
     "measured": {"allocated", "reserved", "device_used", ...},
     "predicted": {"trace": {"allocated", "reserved", "device_used", ...}, "analytic": {...}},
     "error": {"trace": {"allocated": rel. error, ...}, ...}}

Relative error is (predicted − measured) / measured: positive means vramplan over-predicts.
``device_used`` compares with NVML's used memory minus what other processes held before the
run started (``device_used_baseline``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vramplan.errors import VramplanError
from vramplan.measure.env import Environment
from vramplan.workload import Workload

SCHEMA = "vramplan.measure/1"
METRICS = ("allocated", "reserved", "device_used")


@dataclass(frozen=True)
class Measured:
    """What the GPU showed (bytes)."""

    allocated: int
    """``torch.cuda.max_memory_allocated()`` over the timed steps (and set-up)."""
    reserved: int
    """``torch.cuda.max_memory_reserved()``."""
    device_used: int | None
    """Highest NVML used memory sampled after each step, minus ``device_used_baseline``."""
    device_used_baseline: int | None = None
    """NVML used memory before this process created its CUDA context (other processes)."""
    context: int | None = None
    """NVML used after CUDA initialisation, minus the baseline and reserved: the context's cost."""
    active: int = 0
    requested: int = 0
    alloc_retries: int = 0
    ooms: int = 0
    step_time_s: float | None = None
    """Median wall time of the timed steps (after warm-up)."""
    step_times_s: tuple[float, ...] = ()
    iterations: int = 0
    warmup: int = 0
    oom: bool = False
    """The run hit CUDA out-of-memory (figures are those reached before it)."""
    snapshot: str | None = None
    """Path of the memory snapshot pickle written during the run."""


@dataclass(frozen=True)
class Prediction:
    method: str
    allocated: int = 0
    reserved: int = 0
    device_used: int = 0
    peak_phase: str = ""
    seconds: float = 0.0
    """Time vramplan took to predict."""
    error: str = ""
    """Why there is no prediction (e.g. the analytic method does not cover this model)."""

    @property
    def ok(self) -> bool:
        return not self.error

    def to_dict(self) -> dict[str, Any]:
        """The JSON form inside a record's ``predicted`` (keyed by method, so without it)."""
        d = asdict(self)
        d.pop("method")
        if not self.error:
            d.pop("error")
        return d

    @classmethod
    def from_dict(cls, method: str, d: Mapping[str, Any]) -> Prediction:
        return cls(method=method, **d)


@dataclass(frozen=True)
class MeasureRecord:
    model: str
    workload: Workload
    env: Environment
    measured: Measured | None
    """None in prediction-only records (no GPU)."""
    predicted: tuple[Prediction, ...] = ()
    id: str = ""
    """A label for the run (the accuracy suite's workload id)."""
    time: str = ""
    """ISO-8601 UTC time of the run."""
    failure: str = ""
    """Why the measurement failed (other than OOM), if it did."""
    extra: Mapping[str, Any] = field(default_factory=dict)

    def errors(self) -> dict[str, dict[str, float]]:
        """Relative error of each prediction per metric (only where both numbers exist)."""
        return relative_errors(self.measured, self.predicted)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "schema": SCHEMA, "id": self.id, "time": self.time, "model": self.model,
            "workload": self.workload.to_dict(), "env": self.env.to_dict(),
            "measured": _measured_dict(self.measured),
            "predicted": {p.method: p.to_dict() for p in self.predicted},
            "error": self.errors(),
        }
        if self.failure:
            d["failure"] = self.failure
        if self.extra:
            d["extra"] = dict(self.extra)
        return d


def _measured_dict(m: Measured | None) -> dict[str, Any] | None:
    if m is None:
        return None
    d = asdict(m)
    d["step_times_s"] = list(m.step_times_s)
    return d


def errors_of_json(rec: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """:func:`relative_errors` of a record read back from JSON."""
    m = rec.get("measured")
    meas = Measured(**{**m, "step_times_s": tuple(m.get("step_times_s", ()))}) if m else None
    preds = [Prediction.from_dict(k, v) for k, v in (rec.get("predicted") or {}).items()]
    return relative_errors(meas, preds)


def relative_errors(measured: Measured | None, predicted: Iterable[Prediction]) -> dict[str, dict[str, float]]:
    if measured is None or measured.oom:
        return {}
    out: dict[str, dict[str, float]] = {}
    for p in predicted:
        if not p.ok:
            continue
        errs = {}
        for m in METRICS:
            truth = getattr(measured, m)
            if truth:
                errs[m] = (getattr(p, m) - truth) / truth
        out[p.method] = errs
    return out


def append_jsonl(record: MeasureRecord | Mapping[str, Any], path: str | Path) -> None:
    """Append one record as one line (creating the file and its folder)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    obj = record.to_json() if isinstance(record, MeasureRecord) else dict(record)
    with open(p, "a", encoding="utf-8") as f:
        f.write(json.dumps(obj, separators=(",", ":"), sort_keys=False) + "\n")


def read_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """The records of a results file (blank lines skipped; a bad line is a one-line error)."""
    p = Path(path)
    if not p.exists():
        raise VramplanError(f"no results file '{p}'", hint="give a .jsonl written by `vramplan measure --out`")
    with open(p, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise VramplanError(f"{p}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or obj.get("schema") != SCHEMA:
                raise VramplanError(f"{p}:{n}: not a vramplan measurement (schema {SCHEMA} expected)")
            yield obj
