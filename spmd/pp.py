"""Pipeline parallelism: ``spmd.pp.schedule`` and the one schedule representation.

    mesh = spmd.Mesh((2, 2), dim_names=("pp", "dp"))
    model = spmd.parallelize(Net(), mesh=mesh, strategy="ddp",
                             pipeline=spmd.pp.schedule("1f1b", microbatches=8))
    loss = model.step(x, y, F.cross_entropy)   # forward and backward of every microbatch
    opt.step()
    print(model.plan().explain("stages"))

The compiler traces the model with its loss, cuts the graph into stages (at the modules
named in ``split_points``, or balanced by the planner), puts stage ``s`` on the rank at
``s mod P`` of the ``"pp"`` dimension (``P`` ranks; several stages per rank with
``virtual_stages``), and runs the schedule's actions on each rank with the activations
and their gradients sent point to point (:mod:`spmd.pipeline.module`).

A schedule is, per rank, the ordered list of its :class:`Action` s: ``F`` (a
microbatch's forward through one stage), ``B`` (its backward; with a split backward only
the input gradient) and ``W`` (the weight gradient of a split backward). Every schedule
below is generated into that one form; :func:`simulate` runs any such form on stage costs
(the timeline, its bubbles, a deadlock named), and the runtime executes the same lists.

The schedules, for P pipeline ranks and M microbatches (bubble: idle share of the
step with equal stages, F = 1 and a backward of 2, free sends):

- ``gpipe``: every forward, then every backward. Bubble (P-1)/(M+P-1); holds all M.
- ``1f1b``: P-r-1 forwards, then a forward and a backward in turn, then the rest. The same
  bubble; rank r holds at most P-r microbatches.
- ``interleaved-1f1b``: Megatron-LM's, V stages per rank taken in turn by groups of P
  microbatches (M a multiple of P). Bubble (P-1)/(V*M+P-1).
- ``zb-h1``: 1F1B with each backward split into B (input gradient) and W (weight
  gradient); the Ws fill the waits. Bubble (P-1)/(3M+P-1); at most P microbatches held.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Sequence

__all__ = ["schedule", "Schedule", "Action", "Simulation", "simulate", "SCHEDULES"]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
_ALIASES = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved-1f1b": "interleaved-1f1b",
            "interleaved1f1b": "interleaved-1f1b", "interleaved": "interleaved-1f1b",
            "zb-h1": "zb-h1", "zbh1": "zb-h1", "zero-bubble": "zb-h1",
            "zerobubble": "zb-h1"}


@dataclass(frozen=True, kw_only=True, slots=True)
class Action:
    """One step of one rank: ``kind`` ``"F"``, ``"B"`` or ``"W"`` of ``microbatch``
    through ``stage``."""

    kind: str
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.microbatch}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """What ``spmd.pp.schedule`` returns: pass it as ``parallelize(..., pipeline=)``."""

    name: str
    microbatches: int
    virtual_stages: int = 1
    split_points: tuple[str, ...] | None = None
    dim: str = "pp"

    @property
    def split_backward(self) -> bool:
        """Whether backward runs as two actions (input gradient B, weight gradient W)."""
        return self.name == "zb-h1"

    def stages(self, ranks: int) -> int:
        return ranks * self.virtual_stages

    def rank_of(self, stage: int, ranks: int) -> int:
        """The pipeline rank holding ``stage``: stages go round the ranks in turn."""
        return stage % ranks

    def check(self, ranks: int, where: str) -> None:
        """``ValueError`` naming what does not fit ``ranks`` pipeline ranks."""
        if self.split_points is not None and len(self.split_points) + 1 != self.stages(ranks):
            raise ValueError(
                f"{where}: {len(self.split_points)} split_points make "
                f"{len(self.split_points) + 1} stages; {ranks} pipeline ranks x "
                f"{self.virtual_stages} virtual stages need {self.stages(ranks)}")
        if self.name == "interleaved-1f1b" and self.microbatches % ranks:
            raise ValueError(f"{where}: interleaved-1f1b needs microbatches to be a multiple "
                             f"of the {ranks} pipeline ranks, got {self.microbatches}")

    def actions(self, ranks: int) -> list[list[Action]]:
        """Each pipeline rank's actions, in order."""
        self.check(ranks, f"schedule({self.name!r})")
        make = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved-1f1b": _interleaved,
                "zb-h1": _zb_h1}[self.name]
        return [make(r, ranks, self.microbatches, self.virtual_stages) for r in range(ranks)]

    def bubble(self, ranks: int) -> float:
        """The schedule's bubble fraction with equal stage costs (F = 1, B = 2, W = 1 of
        B's 2 when split) and free sends: idle rank-time over the step's rank-time."""
        split = self.split_backward
        return simulate(self, ranks, lambda kind, stage: 1.0 if split or kind == "F"
                        else 2.0).bubble


def schedule(name: str, microbatches: int, *, split_points: Sequence[str] | None = None,
             virtual_stages: int | None = None, dim: str = "pp") -> Schedule:
    """A pipeline schedule for ``parallelize(..., pipeline=)``.

    Args:
        name: ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"`` (several stages per rank) or
            ``"zb-h1"`` (zero-bubble: backward split into input and weight gradients).
        microbatches: how many pieces each step's batch is split into (along dim 0); they
            must divide it.
        split_points: the modules each stage after the first begins at, in forward order
            (torch's ``SplitPoint.BEGINNING``), e.g. ``["layers.4", "layers.8",
            "layers.12"]`` for 4 stages; None: the planner balances the stages by their
            predicted compute, cutting before the model's repeated blocks.
        virtual_stages: stages per pipeline rank (``interleaved-1f1b``: default 2; others:
            1).
        dim: the mesh dimension the stages are laid along.
    """
    if not isinstance(name, str) or name.lower() not in _ALIASES:
        raise ValueError(f"spmd.pp.schedule: unknown schedule {name!r}; one of "
                         f"{', '.join(SCHEDULES)}")
    kind = _ALIASES[name.lower()]
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"spmd.pp.schedule: microbatches must be a positive int, got "
                         f"{microbatches!r}")
    if virtual_stages is None:
        virtual_stages = 2 if kind == "interleaved-1f1b" else 1
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) \
            or virtual_stages < 1:
        raise ValueError(f"spmd.pp.schedule: virtual_stages must be a positive int, got "
                         f"{virtual_stages!r}")
    if virtual_stages > 1 and kind != "interleaved-1f1b":
        raise ValueError(f"spmd.pp.schedule: {kind} runs one stage per rank; "
                         f"virtual_stages={virtual_stages} needs 'interleaved-1f1b'")
    if split_points is not None:
        if isinstance(split_points, str) or not all(isinstance(p, str) for p in split_points):
            raise TypeError(f"spmd.pp.schedule: split_points must be a list of module names, "
                            f"got {split_points!r}")
        if len(set(split_points)) != len(split_points):
            raise ValueError(f"spmd.pp.schedule: split_points name a module twice: "
                             f"{list(split_points)}")
        split_points = tuple(split_points)
    if not isinstance(dim, str):
        raise TypeError(f"spmd.pp.schedule: dim must be a mesh dimension name, got {dim!r}")
    return Schedule(name=kind, microbatches=microbatches, virtual_stages=virtual_stages,
                    split_points=split_points, dim=dim)


# -- the schedules --------------------------------------------------------------------

def _gpipe(r: int, p: int, m: int, v: int) -> list[Action]:
    return ([Action(kind="F", stage=r, microbatch=i) for i in range(m)]
            + [Action(kind="B", stage=r, microbatch=i) for i in range(m)])


def _one_f_one_b(r: int, p: int, m: int, v: int) -> list[Action]:
    warmup = min(p - r - 1, m)
    out = [Action(kind="F", stage=r, microbatch=i) for i in range(warmup)]
    for i in range(m - warmup):
        out.append(Action(kind="F", stage=r, microbatch=warmup + i))
        out.append(Action(kind="B", stage=r, microbatch=i))
    out += [Action(kind="B", stage=r, microbatch=i) for i in range(m - warmup, m)]
    return out


def _interleaved(r: int, p: int, m: int, v: int) -> list[Action]:
    """Megatron-LM's interleaved 1F1B: microbatches in groups of ``p``; each group goes
    through the rank's first virtual stage, then its second, ...; backward in reverse."""
    total = m * v

    def forward(k: int) -> Action:
        group, within = divmod(k, p * v)
        chunk = within // p
        return Action(kind="F", stage=chunk * p + r, microbatch=group * p + within % p)

    def backward(k: int) -> Action:
        group, within = divmod(k, p * v)
        chunk = v - 1 - within // p
        return Action(kind="B", stage=chunk * p + r, microbatch=group * p + within % p)

    warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
    out = [forward(k) for k in range(warmup)]
    for i in range(total - warmup):
        out.append(forward(warmup + i))
        out.append(backward(i))
    out += [backward(k) for k in range(total - warmup, total)]
    return out


def _zb_h1(r: int, p: int, m: int, v: int) -> list[Action]:
    return list(_zb_orders(p, m)[r])


@functools.lru_cache(maxsize=64)
def _zb_orders(p: int, m: int) -> tuple[tuple[Action, ...], ...]:
    """ZB-H1 (Qi et al., 2023, "Zero Bubble Pipeline Parallelism"): 1F1B's order of
    forwards and input-gradient backwards, each rank's weight gradients (W) placed where it
    would otherwise wait. Generated by running the ranks together on unit costs (F = B = W
    = 1): a rank whose next F or B has not arrived runs a pending W instead; the rest run
    at the end. The pipeline's peak activations stay 1F1B's: before a forward, a rank
    holding ``p`` microbatches (1F1B's first rank's most) runs a pending W first."""
    fb = [[a for a in _one_f_one_b(r, p, m, 1)] for r in range(p)]
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    position = [0] * p
    pending: list[list[int]] = [[] for _ in range(p)]
    out: list[list[Action]] = [[] for _ in range(p)]
    inflight = [0] * p  # microbatches forwarded whose weight gradient has not run

    def ready(a: Action) -> float | None:
        if a.kind == "F":
            keys = [("F", a.stage - 1, a.microbatch)] if a.stage else []
        else:
            keys = [("F", a.stage, a.microbatch)]
            keys += [("B", a.stage + 1, a.microbatch)] if a.stage + 1 < p else []
        if any(k not in done for k in keys):
            return None
        return max([done[k] for k in keys], default=0.0)

    while any(position[r] < len(fb[r]) or pending[r] for r in range(p)):
        # the rank that can act earliest acts next (ties: lowest rank)
        best = None
        for r in range(p):
            t_next = None
            if position[r] < len(fb[r]):
                t = ready(fb[r][position[r]])
                if t is not None:
                    t_next = max(free[r], t)
            full = (position[r] < len(fb[r]) and fb[r][position[r]].kind == "F"
                    and inflight[r] >= p)  # as many held as 1F1B's first rank
            if full and pending[r]:
                choice = (free[r], r, "W")
            elif t_next is not None and (not pending[r] or t_next <= free[r]):
                choice = (t_next, r, "next")
            elif pending[r]:
                choice = (free[r], r, "W")
            elif t_next is not None:
                choice = (t_next, r, "next")
            else:
                continue
            if best is None or choice[:2] < best[:2]:
                best = choice
        assert best is not None, "1F1B's order cannot deadlock"
        start, r, what = best
        if what == "W":
            a = Action(kind="W", stage=r, microbatch=pending[r].pop(0))
            inflight[r] -= 1
        else:
            a = fb[r][position[r]]
            position[r] += 1
            if a.kind == "B":
                pending[r].append(a.microbatch)
            else:
                inflight[r] += 1
        free[r] = start + 1.0
        done[(a.kind, a.stage, a.microbatch)] = free[r]
        out[r].append(a)
    return tuple(tuple(o) for o in out)


# -- simulation -----------------------------------------------------------------------

@dataclass(kw_only=True)
class Simulation:
    """A schedule run on stage costs: each action's (start, end) per rank, in seconds."""

    schedule: Schedule
    ranks: int
    spans: list[list[tuple[Action, float, float]]]
    step: float = 0.0
    busy: list[float] = field(default_factory=list)

    @property
    def bubble(self) -> float:
        """Idle rank-time over the step's rank-time, between the first start and the last end."""
        if not self.step:
            return 0.0
        return 1.0 - sum(self.busy) / (self.ranks * self.step)

    def text(self, width: int = 72) -> str:
        """Each rank's row of actions over time (``.`` where it idles)."""
        scale = width / self.step if self.step else 1.0
        lines = []
        for r, spans in enumerate(self.spans):
            row = [" "] * width
            for x in range(width):
                row[x] = "."
            for action, start, end in spans:
                a, b = int(start * scale), max(int(start * scale) + 1, int(end * scale))
                mark = {"F": "F", "B": "B", "W": "W"}[action.kind]
                for x in range(a, min(b, width)):
                    row[x] = mark if x > a or b - a == 1 else "|"
            lines.append(f"rank {r}: " + "".join(row))
        return "\n".join(lines)


def simulate(schedule: Schedule, ranks: int, cost: Callable[[str, int], float],
             send: Callable[[int, int], float] | None = None,
             producers: dict[int, Sequence[int]] | None = None,
             actions: list[list[Action]] | None = None) -> Simulation:
    """Run ``schedule`` on ``ranks`` pipeline ranks with ``cost(kind, stage)`` seconds
    per action and ``send(from_stage, to_stage)`` seconds per hop between ranks
    (default: free). ``producers``: stage -> the stages it receives from (default: the
    one before). An action starts when its rank is free and its inputs have arrived:
    ``F`` after its producers' ``F``, ``B`` after its own ``F`` and its consumers' ``B``,
    ``W`` after its ``B``. A schedule whose order can never finish raises ``ValueError``
    naming the actions each rank is stuck on. ``actions``: each rank's order to run
    instead of the schedule's own (to try an order of your own)."""
    plans = actions if actions is not None else schedule.actions(ranks)
    n = schedule.stages(ranks)
    if producers is None:
        producers = {s: ([s - 1] if s else []) for s in range(n)}
    consumers: dict[int, list[int]] = {s: [] for s in range(n)}
    for s, ps in producers.items():
        for q in ps:
            consumers[q].append(s)
    hop = send or (lambda a, b: 0.0)
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * ranks
    position = [0] * ranks
    spans: list[list[tuple[Action, float, float]]] = [[] for _ in range(ranks)]
    busy = [0.0] * ranks

    def ready(a: Action) -> float | None:
        deps: list[tuple[tuple[str, int, int], float]] = []
        if a.kind == "F":
            deps = [(("F", q, a.microbatch), hop(q, a.stage)) for q in producers[a.stage]]
        elif a.kind == "B":
            deps = [(("F", a.stage, a.microbatch), 0.0)]
            deps += [(("B", c, a.microbatch), hop(c, a.stage)) for c in consumers[a.stage]]
        else:
            deps = [(("B", a.stage, a.microbatch), 0.0)]
        t = 0.0
        for key, delay in deps:
            if key not in done:
                return None
            t = max(t, done[key] + (delay if schedule.rank_of(key[1], ranks)
                                    != schedule.rank_of(a.stage, ranks) else 0.0))
        return t

    remaining = sum(len(p) for p in plans)
    while remaining:
        progressed = False
        for r in range(ranks):
            while position[r] < len(plans[r]):
                a = plans[r][position[r]]
                t = ready(a)
                if t is None:
                    break
                seconds = cost(a.kind, a.stage)
                start = max(free[r], t)
                end = start + seconds
                free[r] = end
                busy[r] += seconds
                done[(a.kind, a.stage, a.microbatch)] = end
                spans[r].append((a, start, end))
                position[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = ", ".join(f"rank {r} at {plans[r][position[r]]}" for r in range(ranks)
                              if position[r] < len(plans[r]))
            raise ValueError(f"schedule {schedule.name!r} deadlocks: {stuck}")
    step = max(free) if ranks else 0.0
    return Simulation(schedule=schedule, ranks=ranks, spans=spans, step=step, busy=busy)
