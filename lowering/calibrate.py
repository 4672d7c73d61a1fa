"""Fit the cost model's α and β to a measurement of the live group.

``spmd.runtime.calibration`` times all-reduces of a few sizes (decided on the group's
first rank and shared). A line T(n) = a + b·n is fitted by least squares on relative
error, and mapped back through the ring formula — a = 2(p-1)·α, b = 2(p-1)/p·β — so the
model keeps its shape and only its constants change.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

import numpy as np

from spmd.lowering.cost_model import CostModel, NetworkLink

__all__ = ["calibrate", "fit", "probe_network"]


def fit(samples: list[tuple[int, float]], model: CostModel) -> CostModel:
    """``model`` with α, β fitted to ``(bytes, seconds)`` samples of ring all-reduces."""
    if len(samples) < 2:
        raise ValueError("calibration needs at least two sizes")
    intercept, slope = _line(samples)
    p = model.world_size
    alpha = max(float(intercept), 1e-7) / (2 * (p - 1))
    beta = max(slope, 1e-13) * p / (2 * (p - 1))
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return model.with_measurement(alpha, beta, f"calibrated on the live group, {stamp}")


def calibrate(group: Any, model: CostModel) -> CostModel:
    """Measure ``group``'s all-reduce and fit ``model`` to it (same result on every rank)."""
    from spmd.runtime.calibration import measure_all_reduce

    if group is None or group.size() <= 1:
        return model
    return fit(measure_all_reduce(group), model)


def probe_network(group: Any, model: CostModel,
                  kinds: tuple[str, ...] = ("all_reduce",)) -> CostModel:
    """``model`` with the link between hosts measured, where ``group`` spans hosts (a
    short all-reduce probe among one rank per host, and the group's own flat and
    two-level collectives of ``kinds`` timed where it spans hosts evenly; the same result
    on every rank), else ``model`` itself."""
    from spmd.runtime.calibration import measure_algorithms, measure_network

    if group is None or group.size() <= 1:
        return model
    found = measure_network(group)
    if found is None:
        return model
    hosts, samples = found
    fitted = fit(samples, CostModel(backend=model.backend, world_size=hosts, alpha=0.0,
                                    beta=0.0))
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = tuple((kind, name, group.size(), tuple((int(n), float(t)) for n, t in points))
                  for (kind, name), points in measure_algorithms(group, kinds=kinds).items())
    timed = ", ".join(k.replace("_", "-") + "s" for k in kinds)
    link = NetworkLink(alpha=fitted.alpha, beta=fitted.beta, lines=lines,
                       source=f"probed at start-up over {hosts} hosts, {stamp}"
                              + (f"; the group's flat and two-level {timed} timed"
                                 if lines else ""))
    return replace(model, network=link)


def _line(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """(a, b) of T(n) = a + b·n fitted to ``samples`` by least squares on relative error
    (weights 1/t: every size counts in proportion, so the small messages' latency is not
    drowned by the large ones' absolute noise); neither below 0."""
    sizes = np.array([s for s, _ in samples], dtype=float)
    times = np.array([t for _, t in samples], dtype=float)
    slope, intercept = (float(c) for c in np.polyfit(sizes, times, 1, w=1.0 / times))
    return max(intercept, 0.0), max(slope, 0.0)
