"""Cutting a traced model into pipeline stages, without processes: the stages run one after
the other reproduce the model's loss and gradients exactly (float64), on several model
families; cut points are checked and refused by name; the planner's balance is optimal;
the zero-bubble split of a backward into input and weight gradients adds up to the whole
backward; a simulated pipeline plan shows its stages, bubbles and memory."""

from __future__ import annotations

import copy
import itertools
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import spmd
from spmd.lowering.balance import balance
from spmd.lowering.stages import candidates, cut, trace
from spmd.pipeline.split_backward import backward_input, backward_weight
from tests.llama import Llama
from tests.zoo import entry


def _run_stages(model, result, leaves):
    """Every stage in order on one process, values handed over directly (autograd flows
    through): the loss."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    values: dict[int, torch.Tensor] = {}
    loss = None
    for stage in result.stages:
        inputs = [params[n] if n in params else buffers[n]
                  for n in stage.params + stage.buffers]
        inputs += [leaves[i] for i in stage.inputs] + [values[c] for c in stage.received]
        outs = stage.code(*inputs)
        for k, c in enumerate(stage.sent):
            values[c] = outs[k]
        if stage.loss:
            loss = outs[-1]
    return loss


@pytest.mark.parametrize("name,stages", [("transformer", 3), ("llama", 3), ("gpt2", 2),
                                         ("qwen2", 3), ("llama_complex_repeat_interleave", 3)])
def test_stages_in_sequence_are_the_model(name, stages):
    e = entry(name)
    model, reference = e.model(), e.model()
    x, y = e.make_batch(rows=4)
    traced = trace(model, e.loss_fn, (x,), y, candidates(model), "test")
    points, why = balance(traced, stages, "test")
    result = cut(traced, points, "test", why)
    assert len(result.stages) == stages and result.stages[-1].loss
    owned = [n for s in result.stages for n in s.params]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    tied = set(result.tied)
    assert sorted(set(owned)) == sorted(trainable)  # every parameter has a stage
    assert len(owned) == len(trainable) + sum(len(v) - 1 for v in result.tied.values())
    if name == "gpt2":  # the head is the embedding: both ends hold it
        assert tied == {"hf.transformer.wte.weight"}
        assert result.tied["hf.transformer.wte.weight"] == (0, stages - 1)
    loss = _run_stages(model, result, [x, y])
    expected = e.loss_fn(reference(x), y)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-14)
    loss.backward()
    expected.backward()
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        # the same ops; autograd may add a value's gradients in another order (an ulp)
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-15, msg=n)


def test_checkpointed_blocks_stay_checkpointed():
    """A trace inlines torch's checkpoint; each stage checkpoints the same blocks again,
    so the memory the model was written to save stays saved, and the numbers agree."""
    import sys

    sys.path.insert(0, "benchmarks")
    import llm

    torch.set_default_dtype(torch.float64)
    try:
        model = llm.build(llm.TINY, 16, "full")
        reference = copy.deepcopy(model)
    finally:
        torch.set_default_dtype(torch.float32)
    x = torch.randint(0, llm.TINY.vocab, (2, 16))
    traced = trace(model, None, (x, x), None, candidates(model), "test")
    assert len(traced.regions) == llm.TINY.layers
    result = cut(traced, ["layers.1"], "test", "named")
    calls = [sum(1 for n in st.code.graph.nodes if n.target is torch.utils.checkpoint.checkpoint)
             for st in result.stages]
    assert calls == [1, llm.TINY.layers - 1]
    loss = _run_stages(model, result, [x, x])
    expected = reference(x, x)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-14)
    loss.backward()
    expected.backward()
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-15, msg=n)


def test_named_cut_points_and_what_crosses():
    torch.set_default_dtype(torch.float64)
    try:
        model = Llama(layers=4)
    finally:
        torch.set_default_dtype(torch.float32)
    x = torch.randint(0, 32, (2, 8))
    traced = trace(model, lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten()), (x,),
                   x.roll(1, 1), ["layers.2"], "test")
    result = cut(traced, ["layers.2"], "test", "named")
    first, second = result.stages
    assert all(n.startswith(("tok.", "layers.0.", "layers.1.")) for n in first.params)
    assert all(n.startswith(("layers.2.", "layers.3.", "norm.", "output.")) for n in second.params)
    # only the hidden state crosses; the rotary tables are buffers, recomputed per stage
    (crossing,) = result.crossings
    assert crossing.shape == (2, 8, 16) and crossing.grad and crossing.dsts == (1,)
    assert "cos" in second.buffers and first.inputs == (0,) and second.inputs == (1,)


def test_bad_cut_points_are_named():
    model = Llama(layers=4)
    x = torch.randint(0, 32, (2, 8))
    loss = lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten())  # noqa: E731
    with pytest.raises(ValueError, match=r"no module 'layers\.9' to cut at \(modules there"):
        trace(model, loss, (x,), x, ["layers.9"], "test")
    traced = trace(model, loss, (x,), x, ["layers.1", "layers.3"], "test")
    with pytest.raises(ValueError, match="must follow the forward's order: 'layers.1'"):
        cut(traced, ["layers.3", "layers.1"], "test", "named")
    traced = trace(model, loss, (x,), x, ["output"], "test")
    cut(traced, ["output"], "test", "named")  # the head alone is a stage: fine

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.unused = nn.Linear(4, 4)

        def forward(self, v):
            return self.b(self.a(self.a(v))).sum()

    with pytest.raises(ValueError, match="'a' runs 2 times in one forward"):
        trace(Twice(), None, (torch.randn(2, 4),), None, ["a"], "test")
    with pytest.raises(ValueError, match="'unused' does not run in the model's forward"):
        trace(Twice(), None, (torch.randn(2, 4),), None, ["unused"], "test")


def test_a_stage_with_no_work_and_a_loss_that_is_not_scalar_are_refused():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre = nn.Identity()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, v):
            return self.b(self.a(self.pre(v)))

    v = torch.randn(2, 4)
    traced = trace(Net(), lambda o, t: o.sum(), (v,), None, ["pre", "a", "b"], "test")
    with pytest.raises(ValueError, match=r"stage 0 \(from the start to 'pre'\) computes nothing"):
        cut(traced, ["pre", "b"], "test", "named")
    traced = trace(Net(), None, (v,), None, ["b"], "test")
    with pytest.raises(ValueError, match=r"the loss must be a scalar .* got shape \(2, 4\)"):
        cut(traced, ["b"], "test", "named")


class Chain(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])

    def forward(self, v):
        return self.blocks(v).sum()


@settings(max_examples=40, deadline=None)
@given(costs=st.lists(st.floats(0.5, 10.0), min_size=3, max_size=7), k=st.integers(2, 3))
def test_balance_is_optimal(costs, k):
    """Against every way to cut the blocks into k contiguous stages."""
    k = min(k, len(costs))
    model = Chain(len(costs))
    traced = trace(model, None, (torch.randn(2, 4),), None, candidates(model), "test")
    names = [f"blocks.{i}" for i in range(len(costs))]
    cost_of = dict(zip(names, costs))  # a span is named by the block it begins at
    points, _ = balance(traced, k, "test", lambda p, f: cost_of.get(p, 0.0))
    got = _largest(costs, [names.index(p) for p in points])
    best = min(_largest(costs, list(c))
               for c in itertools.combinations(range(1, len(costs)), k - 1))
    assert got == pytest.approx(best)


@settings(max_examples=30, deadline=None)
@given(costs=st.lists(st.floats(0.5, 10.0), min_size=3, max_size=7),
       most=st.lists(st.integers(1, 4), min_size=3, max_size=3))
def test_balance_within_memory_is_optimal(costs, most):
    """With a memory bound per stage (here: at most most[k] blocks on stage k, each block
    the same parameter bytes), the best cut among those that fit, or a refusal."""
    k = 3
    model = Chain(len(costs))
    block = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    traced = trace(model, None, (torch.randn(2, 4),), None, candidates(model), "test")
    names = [f"blocks.{i}" for i in range(len(costs))]
    cost_of = dict(zip(names, costs))
    fits = lambda stage, flops, nbytes: nbytes <= most[stage] * block  # noqa: E731
    feasible = [c for c in itertools.combinations(range(1, len(costs)), k - 1)
                if all(b - a <= most[i] for i, (a, b) in
                       enumerate(zip((0, *c), (*c, len(costs)))))]
    if not feasible:
        with pytest.raises(ValueError, match="fits every rank's memory"):
            balance(traced, k, "test", lambda p, f: cost_of.get(p, 0.0), fits)
        return
    points, why = balance(traced, k, "test", lambda p, f: cost_of.get(p, 0.0), fits)
    cuts = [names.index(p) for p in points]
    bounds = [0, *cuts, len(costs)]
    assert all(b - a <= most[i] for i, (a, b) in enumerate(zip(bounds, bounds[1:])))
    assert _largest(costs, cuts) == pytest.approx(min(_largest(costs, list(c))
                                                      for c in feasible))
    assert "within each rank's memory" in why


def _largest(costs, cuts):
    bounds = [0, *cuts, len(costs)]
    return max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))


def _split_equals_whole(make, x):
    torch.manual_seed(0)
    net = make().double()
    ref = make().double()
    ref.load_state_dict(net.state_dict())
    x = x.double()
    inp = x.clone().requires_grad_(True)
    out = net(inp)
    g = torch.randn_like(out)
    got, groups = backward_input([out], [g], [inp], list(net.parameters()))
    if groups:  # B computed no weight gradient
        assert all(p.grad is None for p in net.parameters())
    backward_weight(groups)
    rin = x.clone().requires_grad_(True)
    ref(rin).backward(g)
    assert torch.equal(got[0], rin.grad)
    for p, q in zip(net.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    return groups


def test_zero_bubble_split_adds_up_to_the_backward():
    groups = _split_equals_whole(
        lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)), torch.randn(5, 4))
    assert len(groups) == 2  # one per linear layer
    layer = lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0,  # noqa: E731
                                               batch_first=True)
    assert _split_equals_whole(layer, torch.randn(2, 5, 8))

    class Shared(nn.Module):  # one weight read twice: no split, still exact
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(4, 4)

        def forward(self, v):
            return self.w(torch.tanh(self.w(v)))

    assert _split_equals_whole(Shared, torch.randn(3, 4)) == []


def test_zero_bubble_first_stage_runs_its_backward_as_weights():
    torch.manual_seed(0)
    net = nn.Linear(4, 2).double()
    out = net(torch.randn(3, 4, dtype=torch.float64))
    got, groups = backward_input([out], [torch.ones_like(out)], [], list(net.parameters()))
    assert got == [] and net.weight.grad is None
    backward_weight(groups)
    assert net.weight.grad is not None


@pytest.mark.filterwarnings("ignore:the plan does not fit")  # the tiny device's, on purpose
def test_simulated_pipeline_plan():
    import sys

    sys.path.insert(0, "benchmarks")
    import llm

    with torch.device("meta"):
        model = llm.build(llm.TINY, 64, "full")
    tokens = torch.randint(0, llm.TINY.vocab, (8, 64), device="meta")
    hardware = spmd.hardware.H100_SXM()
    mesh = spmd.Mesh.simulated((2, 2), ("pp", "fsdp"), hardware=hardware)
    plan = spmd.inspect(model, tokens, tokens, mesh=mesh, strategy="fsdp",
                        pipeline=spmd.pp.schedule("1f1b", 4))
    assert len(plan.stages) == 2 and plan.stages[1].begins == plan.split_points[0]
    assert plan.stages[0].in_flight == 2 and plan.stages[1].in_flight == 1
    assert all(s.forward_seconds > 0 and s.backward_seconds > s.forward_seconds
               for s in plan.stages)
    assert all(s.fits for s in plan.stages)
    assert plan.bubble >= plan.theoretical_bubble > 0
    text = plan.explain("stages")
    assert f"Cut points: {plan.split_points[0]}" in text and "receives" in text
    assert "rank 1:" in plan.explain("schedule")
    assert "stage 0" in plan.explain("tok.weight") or "stage 0" in plan.explain(
        next(n for n, _ in model.named_parameters()))
    # a device too small for any stage: refused, naming the stage and what would fit
    small = replace(hardware, device=replace(hardware.device, memory_bytes=2**12))
    tiny = spmd.Mesh.simulated((2, 2), ("pp", "fsdp"), hardware=small)
    with pytest.raises(spmd.lowering.annotate.PlanningError,
                       match=r"stage \d .* does not fit: predicted peak"):
        spmd.inspect(model, tokens, tokens, mesh=tiny, strategy="fsdp",
                     pipeline=spmd.pp.schedule("1f1b", 4))


def test_mesh_slices():
    mesh = spmd.Mesh.simulated((2, 3, 4), ("pp", "fsdp", "tp"))
    sub = mesh["fsdp", "tp"]
    assert sub.shape == (3, 4) and sub.dim_names == ("fsdp", "tp") and sub.ranks[:2] == [0, 1]
    assert mesh["pp"].ranks == [0, 12]
    with pytest.raises(ValueError, match="in order"):
        mesh["tp", "pp"]


class TiedBN(nn.Module):
    """A head tied to the embedding, BatchNorm in each half, a counter buffer."""

    def __init__(self, share_stats: bool = False):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.bn_a, self.bn_b = nn.BatchNorm1d(8), nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.share_stats = share_stats

    def forward(self, x):
        h = torch.tanh(self.bn_b(self.b(self.bn_a(self.a(self.embed(x))))))
        if self.share_stats:  # the second half reads the first BatchNorm's statistics
            h = h + self.bn_a.running_mean
        return self.head(h)


def test_the_cut_does_not_depend_on_requires_grad():
    """A tied embedding frozen at the trace is still tied; its frozen ops are not
    recomputed as if free, and the hidden state's gradient still crosses."""
    x = torch.randint(0, 16, (6,))
    loss = lambda o, t: F.cross_entropy(o, t)  # noqa: E731
    cuts = []
    for frozen in (False, True):
        model = TiedBN()
        model.embed.weight.requires_grad_(not frozen)
        model.a.requires_grad_(not frozen)
        result = cut(trace(model, loss, (x,), x, ["b"], "test"), ["b"], "test", "named")
        cuts.append(([(s.params, s.buffers, s.received, s.sent) for s in result.stages],
                     [(c.src, c.dsts, c.grad) for c in result.crossings], result.tied))
    assert cuts[0] == cuts[1]
    assert cuts[0][2] == {"embed.weight": (0, 1)}


def test_buffer_writes_run_once_in_their_stage():
    """BatchNorm's running statistics and num_batches_tracked, written by the stages run
    in sequence, are the model's after one forward."""
    model, reference = TiedBN().double(), TiedBN().double()
    reference.load_state_dict(model.state_dict())
    x = torch.randint(0, 16, (6,))
    result = cut(trace(model, F.cross_entropy, (x,), x, ["b"], "test"), ["b"], "test", "n")
    assert "bn_a.num_batches_tracked" in result.stages[0].buffers
    assert "bn_b.num_batches_tracked" in result.stages[1].buffers
    _run_stages(model, result, [x, x])
    F.cross_entropy(reference(x), x)
    for (name, got), want in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=1e-14, atol=0, msg=name)
    assert model.bn_a.num_batches_tracked.item() == 1


def test_a_buffer_written_in_one_stage_and_read_in_another_is_refused():
    x = torch.randint(0, 16, (6,))
    traced = trace(TiedBN(share_stats=True), F.cross_entropy, (x,), x, ["b"], "test")
    with pytest.raises(ValueError, match=r"buffer 'bn_a.running_mean' is written in stage 0 "
                                         r"\(by batch_norm\) and read in stage\(s\) \[1\]"):
        cut(traced, ["b"], "test", "named")
