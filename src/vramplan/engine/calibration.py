"""The one calibration of the analytic curve to confirmed (traced) points.

The analytic formulas give the shape of memory against batch or sequence in milliseconds;
a trace gives the exact figure at a point. Calibration maps one onto the other as
``confirmed ≈ α + β · analytic`` — least squares through the points when they span a range
and the slope is plausible, else a constant offset from the point nearest the question.
The boundary search (:mod:`.boundary`) asks it where the usable bytes fall on the analytic
curve; the sweeps draw the calibrated curve.
"""

from __future__ import annotations

from collections.abc import Sequence

BETA_RANGE = (0.5, 2.0)
"""Plausible slopes of confirmed against analytic memory; outside, a constant offset is used."""

MIN_SPAN = 1 << 20
"""Two points closer than this (in analytic bytes) do not determine a slope."""


def line(pairs: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """(α, β) of ``confirmed ≈ α + β · analytic`` by least squares over ``(analytic, confirmed)``
    pairs; a constant offset (β = 1) when they do not span a range or the slope is implausible."""
    if not pairs:
        return None
    n = len(pairs)
    ma = sum(a for a, _ in pairs) / n
    mt = sum(t for _, t in pairs) / n
    var = sum((a - ma) ** 2 for a, _ in pairs)
    if n >= 2 and var > 0:
        beta = sum((a - ma) * (t - mt) for a, t in pairs) / var
        if BETA_RANGE[0] <= beta <= BETA_RANGE[1]:
            return (mt - beta * ma, beta)
    return (mt - ma, 1.0)


class Calibration:
    """Confirmed points gathered during a search, and the analytic threshold they imply."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.pairs: list[tuple[int, int]] = []

    def add(self, analytic: int, confirmed: int) -> None:
        if (analytic, confirmed) not in self.pairs:
            self.pairs.append((analytic, confirmed))

    def threshold(self) -> float:
        """The analytic device_used that corresponds to the limit: through the two confirmed
        points nearest the limit (a slope in :data:`BETA_RANGE`), else the nearest one's offset."""
        if not self.pairs:
            return float(self.limit)
        near = sorted(self.pairs, key=lambda p: abs(p[1] - self.limit))
        a1, t1 = near[0]
        if len(near) >= 2:
            a2, t2 = near[1]
            if abs(a1 - a2) > MIN_SPAN:
                beta = (t1 - t2) / (a1 - a2)
                if BETA_RANGE[0] <= beta <= BETA_RANGE[1]:
                    return a1 + (self.limit - t1) / beta
        return float(self.limit - (t1 - a1))


__all__ = ["Calibration", "line", "BETA_RANGE"]
