"""``strategy="auto"`` planned on simulated H100s (the roofline prices compute from
FLOPs: the same figures every run): the chosen layout is never slower than a hand-written
candidate that fits, respects the budget, is the same records a hand-written plan has
(``verify``, ``memory``, ``explain``), recomputes blocks when that is the only way to
fit, and a budget nothing fits is refused by name."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import spmd
from spmd.auto.search import parse_budget
from spmd.lowering.annotate import PlanningError
from spmd.auto.solver import solve
from tests.llama import Llama
from tests.models import MLP, Transformer


def _llama() -> torch.nn.Module:
    return Llama(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, hidden=64, length=16)


def _tokens(rows: int = 2) -> torch.Tensor:
    return torch.randint(0, 64, (rows, 16), generator=torch.Generator().manual_seed(0))


def _mesh(shape=(2, 2), names=("a", "b")) -> spmd.Mesh:
    return spmd.Mesh.simulated(shape, names, hardware=spmd.hardware.H100_SXM())


@pytest.fixture(scope="module")
def budgeted():
    """The layout chosen under a budget between fsdp's peak and ddp's (ddp ruled out)."""
    peaks = {s: spmd.inspect(_llama(), _tokens(), mesh=_mesh((4,), ("a",)), strategy=s)
             .memory().peak for s in ("ddp", "fsdp")}
    budget = (peaks["ddp"] + peaks["fsdp"]) // 2
    return budget, spmd.inspect(_llama(), _tokens(), mesh=_mesh(), strategy="auto",
                                memory_budget=budget)


def test_auto_never_loses_to_a_hand_written_layout_that_fits(budgeted):
    budget, plan = budgeted
    auto = plan.auto
    labels = [c.label for c in auto.candidates]
    for obvious in ("ddp", "fsdp", "hsdp", "zero2", "ddp x megatron tp on 'b'",
                    "fsdp x megatron tp on 'a'"):
        assert obvious in labels, labels
    assert not auto.candidates[labels.index("ddp")].fits(budget)  # the budget rules it out
    fitting = [c for c in auto.candidates if c.fits(budget)]
    assert auto.chosen in fitting
    assert all(auto.chosen.seconds <= c.seconds for c in fitting)
    # the chosen plan is an ordinary plan of that layout, within the budget
    assert plan.strategy == auto.chosen.strategy
    assert plan.memory().peak == auto.chosen.peak <= budget
    assert plan.predicted_timeline().step_seconds == auto.chosen.seconds
    plan.verify(numerics=0)
    text = plan.summary()
    assert "<- chosen" in text and "over budget" in text and "program for" in text


def test_explain_says_what_was_chosen_and_what_the_runner_up_costs(budgeted):
    _, plan = budgeted
    why = plan.explain("layers.0.feed_forward.w1.weight")
    assert "layers.*.feed_forward.w1.weight" in why and "chosen" in why
    assert "instead: predicted step" in why


def test_the_search_is_deterministic(budgeted):
    # the plans are priced by the roofline (FLOPs and bytes: no timer), and each program
    # solved again gives the same choices (ties go to the earliest choice)
    _, plan = budgeted
    solved = [search for search in plan.auto.searches if search.solution is not None]
    assert solved, plan.auto.searches  # the solver chose at least one program's layout
    for search in solved:
        again = solve(replace(search.problem, budget=search.target))
        assert again.choices == search.solution.choices
        assert again.recompute == search.solution.recompute


def test_recompute_is_chosen_when_it_is_the_only_way_to_fit():
    model = Transformer(layers=4, dim=32, vocab=32)
    x = torch.randint(0, 32, (4, 32), generator=torch.Generator().manual_seed(0))
    mesh = spmd.Mesh.simulated(1, hardware=spmd.hardware.H100_SXM())
    whole = spmd.inspect(model, x, mesh=mesh, strategy="ddp").memory()
    per_layer = dict((layer, n) for layer, n, _ in whole.saved_by_layer)["layers.0"]
    plan = spmd.inspect(model, x, mesh=mesh, strategy="auto",
                        memory_budget=whole.peak - per_layer // 2)
    chosen = plan.auto.chosen
    assert chosen.source == "solver" and chosen.recompute, plan.auto
    view = plan.memory()
    assert view.peak <= whole.peak - per_layer // 2
    checkpointed = {layer for layer, _, ckpt in view.saved_by_layer if ckpt}
    assert checkpointed == set(chosen.recompute)
    # recomputing costs time: it is slower than the plain layout it makes fit
    assert chosen.seconds > spmd.inspect(model, x, mesh=mesh, strategy="ddp") \
        .predicted_timeline().step_seconds


def test_a_budget_nothing_fits_is_refused_with_the_least_memory_found():
    with pytest.raises(PlanningError, match=r"no layout of MLP .* fits the memory budget of "
                                            r"1\.000 KiB; the least found is .* What would "
                                            r"fit: .*ranks.*batch.*recomputing"):
        spmd.inspect(MLP(), torch.randn(4, 8), mesh=_mesh((2,), ("a",)), strategy="auto",
                     memory_budget="1KiB")


def test_budgets_parse_and_bad_ones_are_named():
    assert parse_budget("70GiB", "x") == 70 * 2**30
    assert parse_budget("80GB", "x") == 80e9
    assert parse_budget("512 MiB", "x") == 512 * 2**20
    assert parse_budget(1000, "x") == 1000
    for bad, err in (("70 parsecs", ValueError), (-1, ValueError), (True, TypeError),
                     ([1], TypeError), ("0GiB", ValueError)):
        with pytest.raises(err, match="memory_budget"):
            parse_budget(bad, "x")


def test_auto_arguments_are_checked_before_anything_runs():
    with pytest.raises(TypeError, match="memory_budget= is the budget of strategy='auto'"):
        spmd.parallelize(_llama(), mesh=_mesh(), strategy="fsdp", memory_budget="1GiB")
    with pytest.raises(TypeError, match="memory_budget= is the budget of strategy='auto'"):
        spmd.inspect(_llama(), _tokens(), mesh=_mesh(), memory_budget="1GiB")
    with pytest.raises(TypeError, match="with pipeline= is searched by spmd.inspect"):
        spmd.parallelize(_llama(), mesh=_mesh(), strategy="auto",
                         pipeline=spmd.pp.schedule("1f1b", 2))
    with pytest.raises(TypeError, match="takes a model instance"):
        spmd.parallelize(lambda model, batch: None, mesh=_mesh(), strategy="auto")
    with pytest.raises(ValueError, match="memory_budget"):
        spmd.parallelize(_llama(), mesh=_mesh(), strategy="auto", memory_budget="lots")
    with pytest.raises(ValueError, match="one dimension"):
        spmd.inspect(_llama(), _tokens(), mesh=_mesh(), strategy="auto",
                     placements={"a": {"x": spmd.Shard(0)}, "b": {"x": spmd.Shard(0)}})
    with pytest.raises(TypeError, match="example inputs"):
        spmd.inspect(_llama(), mesh=_mesh(), strategy="auto")


def _lm_loss(out, y):
    return torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())


def test_pipeline_stages_are_searched_with_the_layout_beside_them():
    model = _llama()
    seq = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    x, y = seq[:, :-1], seq[:, 1:]
    schedule = spmd.pp.schedule("1f1b", 2)
    plan = spmd.inspect(model, x, mesh=_mesh((2, 2), ("pp", "b")), strategy="auto",
                        pipeline=schedule, loss_fn=_lm_loss, target=y)
    auto = plan.auto
    labels = [c.label for c in auto.candidates]
    assert labels == ["ddp", "fsdp", "zero2", "zero1", "megatron tp on 'b'"], labels
    fitting = [c for c in auto.candidates if c.fits(auto.budget)]
    assert auto.chosen in fitting and all(auto.chosen.seconds <= c.seconds for c in fitting)
    assert plan.step_seconds == auto.chosen.seconds and "<- chosen" in plan.summary()
    # the same as the hand-written pipeline of that layout (stages cut by the planner)
    if not auto.chosen.tp:
        hand = spmd.inspect(model, x, mesh=_mesh((2, 2), ("pp", "dp")),
                            strategy=auto.chosen.strategy, pipeline=schedule,
                            loss_fn=_lm_loss, target=y)
        assert hand.step_seconds == plan.step_seconds
        assert hand.split_points == plan.split_points
