"""Pipeline schedules as data: every schedule's per-rank action lists are complete, run
without deadlock, hold the bubble theory gives them, and hold no more microbatches than
their memory bound. No process is started."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import spmd
from spmd.pipeline.plan import in_flight
from spmd.pp import SCHEDULES, Action, schedule, simulate

UNIT = {"F": 1.0, "B": 2.0, "W": 1.0}


def _costs(s):
    return (lambda kind, stage: 1.0) if s.split_backward else \
        (lambda kind, stage: UNIT[kind])


def _valid(name, p, m):
    return name != "interleaved-1f1b" or m % p == 0


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(SCHEDULES), p=st.integers(1, 6), m=st.integers(1, 12))
def test_every_action_once_in_a_runnable_order(name, p, m):
    if not _valid(name, p, m):
        with pytest.raises(ValueError, match="multiple"):
            schedule(name, m).actions(p)
        return
    s = schedule(name, m)
    actions = s.actions(p)
    kinds = ("F", "B", "W") if s.split_backward else ("F", "B")
    for r, mine in enumerate(actions):
        stages = [st_ for st_ in range(s.stages(p)) if s.rank_of(st_, p) == r]
        expected = {(k, st_, mb) for k in kinds for st_ in stages for mb in range(m)}
        got = [(a.kind, a.stage, a.microbatch) for a in mine]
        assert sorted(got) == sorted(expected) and len(got) == len(set(got))
        for st_ in stages:  # each stage takes its microbatches in order, forward and back
            for k in kinds:
                order = [a.microbatch for a in mine if a.kind == k and a.stage == st_]
                assert order == sorted(order)
    sim = simulate(s, p, _costs(s))  # raises on a deadlock
    assert all(len(spans) == len(a) for spans, a in zip(sim.spans, actions))
    assert 0.0 <= sim.bubble < 1.0


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4), (8, 16), (3, 9)])
def test_bubbles_are_the_theory(p, m):
    assert schedule("gpipe", m).bubble(p) == pytest.approx((p - 1) / (m + p - 1))
    assert schedule("1f1b", m).bubble(p) == pytest.approx((p - 1) / (m + p - 1))
    v = 2
    assert schedule("interleaved-1f1b", m).bubble(p) == pytest.approx(
        (p - 1) / (v * m + p - 1))
    # ZB-H1 (Qi et al.): (p-1)(F+B-W) over the step, a third of 1F1B's with F = B = W
    assert schedule("zb-h1", m).bubble(p) == pytest.approx((p - 1) / (3 * m + p - 1))


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 16)])
def test_microbatches_held(p, m):
    assert in_flight(schedule("gpipe", m), p) == {s: m for s in range(p)}
    assert in_flight(schedule("1f1b", m), p) == {s: min(p - s, m) for s in range(p)}
    zb = in_flight(schedule("zb-h1", m), p)
    assert max(zb.values()) <= p  # the pipeline's peak stays 1F1B's first rank's
    assert schedule("zb-h1", m).bubble(p) < schedule("1f1b", m).bubble(p)


def test_a_deadlocking_order_is_named():
    s = schedule("1f1b", 2)
    good = s.actions(2)
    # rank 0 waits for a backward before running the forward rank 1 needs first
    bad = [[Action(kind="B", stage=0, microbatch=0), *[a for a in good[0] if not (
        a.kind == "B" and a.stage == 0 and a.microbatch == 0)]], good[1]]
    with pytest.raises(ValueError, match=r"deadlocks: rank 0 at B0\.0"):
        simulate(s, 2, _costs(s), actions=bad)


def test_sends_and_uneven_stages_shape_the_timeline():
    s = schedule("1f1b", 4)
    even = simulate(s, 2, _costs(s))
    slow = simulate(s, 2, lambda k, st_: UNIT[k] * (3.0 if st_ == 1 else 1.0))
    sent = simulate(s, 2, _costs(s), send=lambda a, b: 0.5)
    assert slow.step > even.step and slow.bubble > even.bubble
    # at least one hop there and one back lie on the critical path
    assert sent.step >= even.step + 2 * 0.5
    text = even.text(40).splitlines()
    assert len(text) == 2 and all(len(line) == len("rank 0: ") + 40 for line in text)


def test_schedule_arguments_are_checked():
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'"):
        spmd.pp.schedule("pipedream", 4)
    with pytest.raises(ValueError, match="microbatches must be a positive int"):
        spmd.pp.schedule("1f1b", 0)
    with pytest.raises(ValueError, match="needs 'interleaved-1f1b'"):
        spmd.pp.schedule("1f1b", 4, virtual_stages=2)
    with pytest.raises(TypeError, match="split_points must be a list of module names"):
        spmd.pp.schedule("1f1b", 4, split_points="layers.2")
    with pytest.raises(ValueError, match="name a module twice"):
        spmd.pp.schedule("1f1b", 4, split_points=["layers.2", "layers.2"])
    s = spmd.pp.schedule("gpipe", 4, split_points=["layers.2"])
    with pytest.raises(ValueError, match="1 split_points make 2 stages; 4 pipeline ranks"):
        s.check(4, "here")
    assert spmd.pp.schedule("ZeroBubble", 4).name == "zb-h1"
    assert spmd.pp.schedule("interleaved", 4).virtual_stages == 2
