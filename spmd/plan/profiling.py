"""``spmd.profile``: record what really happens in a parallelized model's steps.

While armed, the captured graphs stamp when each forward and backward starts and ends,
and each bucket's all-reduce when it is issued, when the network finishes it and how
long the step waited for it. Each profiled step becomes a measured
:class:`~spmd.plan.timeline.Timeline`, which the plan shows beside the predicted one. Nothing
is recorded, and nothing costs, when no profile is armed.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from spmd.plan.timeline import Span, Timeline

__all__ = ["Profiler", "profile"]


class Profiler:
    """Events of the current step, and the timelines of the steps already profiled."""

    def __init__(self, steps: int) -> None:
        self.steps_left = steps
        self.timelines: list[Timeline] = []
        self.raw: list[list[tuple[str, str, float]]] = []  # each step's events, absolute
        self._events: list[tuple[str, str, float]] = []
        self._lock = threading.Lock()

    def event(self, kind: str, label: str, t: float | None = None) -> None:
        stamp = time.perf_counter() if t is None else t
        with self._lock:
            self._events.append((kind, label, stamp))

    def begin_step(self) -> None:
        with self._lock:
            self._events = []

    def end_step(self) -> Timeline:
        with self._lock:
            events, self._events = self._events, []
        timeline = _timeline(events)
        self.timelines.append(timeline)
        self.raw.append(events)
        self.steps_left -= 1
        return timeline

    @property
    def done(self) -> bool:
        return self.steps_left <= 0


def completions(events: list[tuple[str, str, float]]) -> dict[str, float]:
    """When each collective was known to be complete: Gloo's completion callback, or the
    end of the wait on it if that came first (the callback needs the GIL, which the
    training thread may hold for milliseconds after it woke from the wait)."""
    out: dict[str, float] = {}
    for kind, label, t in events:
        if kind in ("done", "wait_end"):
            out[label] = min(out.get(label, t), t)
    return out


def _timeline(events: list[tuple[str, str, float]]) -> Timeline:
    timeline = Timeline(source="measured")
    if not events:
        return timeline
    finished = completions(events)
    events = [e for e in events if e[0] != "done"] + [("done", k, t) for k, t in finished.items()]
    t0 = min(t for _, _, t in events)
    opened: dict[tuple[str, str], float] = {}
    pairs = {"compute_end": ("compute_start", "compute"), "done": ("issue", "communication"),
             "wait_end": ("wait_start", "exposed")}
    for kind, label, t in sorted(events, key=lambda e: e[2]):
        if kind in pairs:
            opener, lane = pairs[kind]
            start = opened.pop((opener, label), None)
            if start is not None:
                name = label.split(":", 1)[-1] if lane != "compute" else label
                if lane == "exposed":
                    name = f"wait {name}"
                timeline.spans.append(Span(lane=lane, label=name, start=start - t0, end=t - t0))
        else:
            opened[(kind, label)] = t
    return timeline


def profile(model: Any, steps: int = 1) -> Profiler:
    """Record the next ``steps`` training steps of a parallelized ``model``.

    Returns the :class:`Profiler`; its ``timelines`` fill as the steps run, and
    ``spmd.inspect(model)`` then carries the last one as ``plan.measured``.

    Example::

        prof = spmd.profile(model, steps=3)
        for x, y in batches[:3]:
            loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
        spmd.inspect(model).timeline()        # predicted beside measured
    """
    from spmd.program.module import ModuleState
    from spmd.program.program import program_of

    state = program_of(model)
    if not isinstance(state, ModuleState):
        raise TypeError(f"spmd.profile: {type(model).__name__} is not a parallelized module")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"spmd.profile: steps must be a positive int, got {steps!r}")
    profiler = Profiler(steps)
    state.attach_profiler(profiler)
    return profiler
