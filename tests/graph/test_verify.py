"""The plan verifier (``spmd.lowering.verify``) on simulated meshes: it passes correct plans
of every strategy composition, and it catches, by itself, each kind of defect planted into
the compiler: a missing reduction (the fsdp x tp defect: a replicated weight's
tensor-parallel partial gradient reduce-scattered as if whole), a wrong sharding rule
(grouped-query attention pairing each rank's query heads with the wrong key/value heads;
a non-linear op said to keep a partial sum), a value brought to the wrong placement, an
unreduced data-parallel gradient, and a parameter's stored shard read as if whole.

The tests run with ``SPMD_VERIFY=1`` (tests/conftest.py): every plan is verified as it is
made, so each planted defect must make planning itself raise.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd
from spmd.lowering import pipeline, rules, tensor_parallel
from spmd.lowering.placements import Partial, Replicate, Shard
from spmd.lowering.rules import Decision
from spmd.lowering.state import find
from spmd.lowering.verify import PlanVerificationError, Verified

from ..llama import Llama, tokens

aten = torch.ops.aten
TP = {"tp": {"w1.weight": spmd.Shard(0), "w2.weight": spmd.Shard(1)}}


class Scaled(nn.Module):
    """``w2(silu(w1(x * scale)))``: ``scale`` is replicated on "tp" and its gradient a
    tensor-parallel partial sum (the issue's reproduction)."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8, dtype=torch.float64))
            self.w1 = nn.Linear(8, 16, bias=False, dtype=torch.float64)
            self.w2 = nn.Linear(16, 8, bias=False, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x * self.scale)))


X = torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _plan(model: nn.Module, x: torch.Tensor, shape: tuple[int, ...], names: tuple[str, ...],
          strategy: str = "ddp", placements=TP):
    return spmd.inspect(model, x, mesh=spmd.Mesh.simulated(shape, names), strategy=strategy,
                        placements=placements)


@pytest.mark.parametrize("shape,names,strategy", [
    ((2,), ("tp",), "ddp"), ((2, 2), ("dp", "tp"), "ddp"), ((2, 2), ("fsdp", "tp"), "fsdp"),
    ((2, 2, 2), ("dp", "fsdp", "tp"), "hsdp"), ((4,), ("dp",), "ddp"),
    ((4,), ("fsdp",), "fsdp"), ((2, 2), ("dp", "fsdp"), "hsdp")])
def test_correct_plans_of_every_composition_verify(shape, names, strategy):
    placements = None if "tp" not in names else spmd.tp.megatron()
    plan = _plan(Llama(), tokens(), shape, names, strategy, placements)
    report = plan.verify()
    assert set(report.graphs) == {"graph0.forward", "graph0.backward"}
    for name, gm in plan.graphs.items():  # verified as planned, too (SPMD_VERIFY=1)
        assert find(gm, Verified) is not None, name
    if "tp" in names:  # every distinct decision checked on real shards, in this process
        assert "sharding decision(s) checked on real shards" in str(report)


def test_a_missing_tensor_parallel_reduction_before_fsdp_is_caught(monkeypatch):
    """Before the fix, fsdp's reduce-scatter took ``scale``'s gradient as it was: each tp
    rank's partial sum. The verifier names the parameter and the dimension."""
    monkeypatch.setattr(tensor_parallel._Localizer, "reduce_pieces", lambda self, node: None)
    with pytest.raises(PlanVerificationError, match=r"gradient of scale.*Partial\('sum'\) "
                                                    r"on 'tp'"):
        _plan(Scaled(), X, (2, 2), ("fsdp", "tp"), "fsdp")


def test_the_fixed_composition_reduces_over_tp_first():
    plan = _plan(Scaled(), X, (2, 2), ("fsdp", "tp"), "fsdp")
    on_tp = [c for c in plan.collectives if c.mesh_dim == "tp" and c.phase == "backward"]
    assert any("scale's gradient is reduce-scattered" in c.provenance.reason for c in on_tp)


def _gqa_rule_of_before(node, inputs, size):
    """The attention rule as it was: queries sharded along heads, keys and values whole
    when their head count differs from the queries' (each rank then pairs its query heads
    with the wrong key/value heads)."""
    args = rules.tensor_args(node)
    query = args[1] if "backward" in str(node.target) else args[0]
    heads = query.meta["val"].shape[1]
    val = node.meta["val"]
    outs = list(val) if isinstance(val, (tuple, list)) else [val]

    def placed(t):
        return Shard(1) if isinstance(t, torch.Tensor) and t.dim() > 1 and \
            t.shape[1] == heads else Replicate()

    out = tuple(placed(o) for o in outs)
    return [Decision(output=out if len(outs) > 1 else out[0],
                     inputs=tuple(placed(a.meta["val"]) for a in args),
                     reason="each rank its heads"),
            rules.replicate_all(node, "whole")]


def test_a_wrong_attention_rule_is_caught_on_real_shards(monkeypatch):
    from spmd.lowering.rules import attention

    for target in (*attention._FORWARD, *attention._BACKWARD):
        if target is not None:
            monkeypatch.setitem(rules._RULES, target, _gqa_rule_of_before)
    with pytest.raises(PlanVerificationError,
                       match=r"scaled_dot_product.*layers\.0\.attention.*enable_gqa=True"
                             r".*does not hold on real shards"):
        _plan(Llama(gqa="enable_gqa"), tokens(), (2,), ("tp",), placements=spmd.tp.megatron())


class RowThenExp(nn.Module):
    """``exp(w2(w1(x)))``: the row-parallel w2 hands exp a partial sum, its only reader."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(8, 16, bias=False, dtype=torch.float64)
        self.w2 = nn.Linear(16, 8, bias=False, dtype=torch.float64)

    def forward(self, x):
        return torch.exp(self.w2(self.w1(x)))


def test_a_rule_keeping_a_partial_sum_through_a_nonlinear_op_is_caught(monkeypatch):
    def exp_is_linear(node, inputs, size):
        if isinstance(inputs[0], Partial):
            return [Decision(output=inputs[0], reason="planted: exp said linear")]
        return rules.lookup(aten.gelu.default)(node, inputs, size)

    monkeypatch.setitem(rules._RULES, aten.exp.default, exp_is_linear)
    with pytest.raises(PlanVerificationError, match=r"exp.*planted: exp said linear.*does not "
                                                    r"hold on real shards"):
        _plan(RowThenExp(), X, (2,), ("tp",))


def test_a_partial_brought_to_no_reduction_is_caught(monkeypatch):
    """The tensor-parallel pass skips every all-reduce: each op's decision still needs
    its inputs whole, and the verifier sees them arrive partial."""
    bring = tensor_parallel._Localizer.bring

    def forgetful(self, value, dim, want, user, choice, *args, **kwargs):
        if isinstance(value.meta["sharding"][dim], Partial) and isinstance(want, Replicate):
            return value
        return bring(self, value, dim, want, user, choice, *args, **kwargs)

    monkeypatch.setattr(tensor_parallel._Localizer, "bring", forgetful)
    with pytest.raises(PlanVerificationError, match=r"exp.*reads mm_1 as Partial\('sum'\) on "
                                                    r"'tp', but its decision needs Replicate"):
        _plan(RowThenExp(), X, (2,), ("tp",))


def test_an_unreduced_data_parallel_gradient_is_caught(monkeypatch):
    skipped = [(n, (lambda gm, ctx: gm) if n == "insert_collectives" else p)
               for n, p in pipeline.PASSES]
    monkeypatch.setattr(pipeline, "PASSES", skipped)
    with pytest.raises(PlanVerificationError, match=r"gradient of \S+, which leaves the graph "
                                                    r"Varying\(\) on 'dp'"):
        _plan(Scaled(), X, (4,), ("dp",), placements=None)


def test_a_parameter_shard_read_as_whole_is_caught(monkeypatch):
    skipped = [(n, (lambda gm, ctx: gm) if n == "shard_params" else p)
               for n, p in pipeline.PASSES]
    monkeypatch.setattr(pipeline, "PASSES", skipped)
    with pytest.raises(PlanVerificationError, match=r"a parameter's stored shard"):
        _plan(Scaled(), X, (4,), ("fsdp",), "fsdp", placements=None)


def test_errors_name_the_node_its_placements_the_rule_and_the_model_code(monkeypatch):
    from spmd.lowering.rules import attention

    for target in (*attention._FORWARD, *attention._BACKWARD):
        if target is not None:
            monkeypatch.setitem(rules._RULES, target, _gqa_rule_of_before)
    with pytest.raises(PlanVerificationError) as caught:
        _plan(Llama(gqa="enable_gqa"), tokens(), (2,), ("tp",), placements=spmd.tp.megatron())
    text = str(caught.value)
    assert "graph0 (forward)" in text
    assert "tests/llama.py:" in text  # the model's source line
    assert "rule " in text and "_gqa_rule_of_before" in text
    assert "[inputs: " in text and "Sharding(tp: Shard(1))" in text


def test_verify_switches(monkeypatch):
    monkeypatch.setenv("SPMD_VERIFY", "0")
    plan = _plan(Scaled(), X, (2,), ("tp",))
    assert all(find(gm, Verified) is None for gm in plan.graphs.values())
    report = plan.verify(numerics=0)  # on demand, structure only
    assert report.decisions == 0 and set(report.graphs) == set(plan.graphs)
    monkeypatch.setenv("SPMD_VERIFY", "structure")
    plan = _plan(Scaled(), X, (2,), ("tp",))
    assert all(find(gm, Verified).decisions == 0 for gm in plan.graphs.values())
    monkeypatch.setenv("SPMD_VERIFY", "maybe")
    with pytest.raises(ValueError, match="SPMD_VERIFY='maybe'"):
        _plan(Scaled(), X, (2,), ("tp",))
