"""parallelize on a module: DDP's semantics, the decorator forms, the levers, the plan."""

from __future__ import annotations

import logging
import re
from datetime import timedelta

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd
from spmd import runtime as dist
from spmd.runtime import HashStore

from ..models import MODELS, MLP, batch

TOL = dict(atol=1e-5, rtol=1e-4)


def _shard(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return x[rank * len(x) // world:(rank + 1) * len(x) // world]


def _grads(model: nn.Module) -> dict:
    return {n: (p.grad.clone() if p.grad is not None else None)
            for n, p in model.named_parameters()}


def semantics(rank: int) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    world = dist.get_world_size()
    out: dict = {}

    # no_sync: two micro-batches accumulated locally, the third synchronised
    model = spmd.parallelize(MODELS["mlp"]())
    for micro in range(3):
        x, y = batch("mlp", step=micro)
        context = model.no_sync() if micro < 2 else torch.enable_grad()
        with context:
            F.mse_loss(model(_shard(x, rank, world)), _shard(y, rank, world)).backward()
    out["no_sync grads"] = _grads(model)

    # levers: bucketing off, overlap off, bf16 on the wire give the same gradients
    x, y = batch("mlp")
    for name, kwargs in {"default": {}, "cap0": {"bucket_cap_mb": 0},
                         "no overlap": {"overlap": False},
                         "bf16": {"reduce_dtype": torch.bfloat16},
                         # a 2-D mesh: "dp" carries the batch, a size-1 "tp" nothing
                         "2-D mesh": {"mesh": spmd.Mesh((world, 1), dim_names=("dp", "tp"))},
                         }.items():
        m = spmd.parallelize(MODELS["mlp"](), **kwargs)
        F.mse_loss(m(_shard(x, rank, world)), _shard(y, rank, world)).backward()
        out[("lever", name)] = _grads(m)
        out[("buckets", name)] = len(spmd.inspect(m).buckets)

    # any reduce_dtype: the graphs reduce every gradient, so the plan lists no fallback and
    # the only all-reduces that run are the buckets' (each call of the runtime's all_reduce
    # is counted, and still runs)
    import spmd.runtime.collectives as collectives

    real, counted = collectives.all_reduce, []
    collectives.all_reduce = lambda *a, **k: (counted.append(1), real(*a, **k))[1]
    try:
        for dtype in (torch.bfloat16, torch.float16, torch.float64):
            m = spmd.parallelize(MODELS["mlp"](), reduce_dtype=dtype, bucket_cap_mb=0.0002)
            counted.clear()
            for step in range(4):
                xs, ys = batch("mlp", step=step)
                F.mse_loss(m(_shard(xs, rank, world)), _shard(ys, rank, world)).backward()
            plan = spmd.inspect(m)
            out[("wire", dtype)] = (len(counted), 4 * len(plan.buckets),
                                    [f.param for f in plan.fallbacks],
                                    {b.wire_dtype for b in plan.buckets})
    finally:
        collectives.all_reduce = real

    # stays an nn.Module: state_dict keys, eval mode, hooks
    plain = MODELS["mlp"]()
    model = spmd.parallelize(MODELS["mlp"]())
    fired = []
    model.register_forward_hook(lambda mod, args, output: fired.append(output.shape))
    out["isinstance"] = isinstance(model, MLP)
    out["state_dict keys"] = list(model.state_dict()) == list(plain.state_dict())
    plain.load_state_dict(model.state_dict())
    model.eval()
    with torch.no_grad():
        out["eval equal"] = torch.allclose(model(x), plain(x))
    out["hook fired"] = fired == [torch.Size([12, 4])]

    # a parameter unused on every rank this step keeps no gradient and nothing hangs
    unused = spmd.parallelize(MODELS["sometimes_unused"]())
    F.mse_loss(unused(_shard(x, rank, world)), _shard(y, rank, world)).backward()
    out["unused grad"] = unused.extra.weight.grad is None

    # the decorator on a class, with arguments
    @spmd.parallelize(bucket_cap_mb=0)
    class Decorated(MLP):
        pass

    decorated = Decorated()
    F.mse_loss(decorated(_shard(x, rank, world)), _shard(y, rank, world)).backward()
    plan = spmd.inspect(decorated)
    out["decorated buckets"] = len(plan.buckets)
    out["provenance"] = [(c.provenance.pass_name, c.provenance.params) for c in plan.collectives]
    out["summary"] = plan.summary()

    calibrated = spmd.parallelize(MODELS["mlp"](), calibrate=True)
    out["calibrated"] = spmd.inspect(calibrated).cost_model.source
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def runs():
    return dist.spawn(semantics, nprocs=2, start_method="forkserver", timeout=110)


def _reference_grads(micro_steps: int) -> dict:
    model = MODELS["mlp"]()
    for micro in range(micro_steps):
        x, y = batch("mlp", step=micro)
        F.mse_loss(model(x), y).backward()
    return _grads(model)


def test_no_sync_accumulates_then_averages_everything(runs):
    want = _reference_grads(3)
    for r in runs:
        for name, g in r["no_sync grads"].items():
            assert torch.allclose(g, want[name], **TOL), name


def test_levers_change_the_plan_not_the_result(runs):
    want = _reference_grads(1)
    for r in runs:
        for lever in ("default", "cap0", "no overlap", "2-D mesh"):
            for name, g in r[("lever", lever)].items():
                assert torch.allclose(g, want[name], **TOL), (lever, name)
        for name, g in r[("lever", "bf16")].items():  # bf16 keeps ~3 significant digits
            assert torch.allclose(g, want[name], atol=1e-2, rtol=2e-2), name
    assert runs[0][("buckets", "cap0")] == 6 > runs[0][("buckets", "default")]


def test_any_reduce_dtype_runs_no_eager_collective_and_lists_no_fallback(runs):
    for r in runs:
        for dtype in (torch.bfloat16, torch.float16, torch.float64):
            calls, bucket_calls, fallbacks, wires = r[("wire", dtype)]
            assert fallbacks == [] and wires == {dtype}
            assert calls == bucket_calls >= 8  # 4 steps x several buckets, nothing else


def test_the_model_stays_an_nn_module(runs):
    r = runs[0]
    assert r["isinstance"] and r["state_dict keys"] and r["eval equal"] and r["hook fired"]


def test_a_parameter_unused_everywhere_keeps_no_gradient(runs):
    assert all(r["unused grad"] for r in runs)


def test_decorated_class_plan_and_provenance(runs):
    r = runs[0]
    assert r["decorated buckets"] == 6
    for pass_name, params in r["provenance"]:
        assert pass_name == "insert_collectives" and len(params) == 1
    assert "bucket" in r["summary"] and "fc1.weight" in r["summary"]
    assert r["calibrated"].startswith("calibrated on the live group")


# -- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"strategy": "zero3"}, ValueError, "strategy 'zero3' is not supported"),
        ({"strategy": "fsdp", "param_dtype": torch.int8}, ValueError,
         "param_dtype must be a floating dtype"),
        ({"strategy": "fsdp", "param_dtype": "bf16"}, TypeError,
         "param_dtype must be a torch.dtype"),
        ({"param_dtype": torch.bfloat16}, ValueError, "param_dtype applies to the sharded"),
        ({"reshard_after_forward": False}, ValueError,
         "reshard_after_forward=False applies to the sharded"),
        ({"strategy": "fsdp", "reshard_after_forward": 1.5}, TypeError,
         "reshard_after_forward must be a bool or an int"),
        ({"strategy": "fsdp", "reshard_after_forward": 0}, ValueError,
         "reshard_after_forward=0: an integer is the number of ranks"),
        ({"reshard_after_forward": 2}, ValueError,
         "reshard_after_forward=2 applies to the sharded"),
        ({"strategy": "hsdp", "mesh": spmd.Mesh.simulated(4)}, ValueError,
         "'hsdp' needs a 2-D mesh"),
        ({"strategy": "fsdp", "mesh": spmd.Mesh.simulated((2, 2), ("dp", "tp"))}, ValueError,
         "mesh dimension 'tp' \\(size 2\\) is not used by strategy 'fsdp'"),
        ({"strategy": 3}, TypeError, "strategy must be a str"),
        ({"bucket_cap_mb": -1}, ValueError, "bucket_cap_mb must be >= 0"),
        ({"bucket_cap_mb": "big"}, TypeError, "bucket_cap_mb must be a number"),
        ({"overlap": "yes"}, TypeError, "overlap must be a bool"),
        ({"reduce_dtype": torch.int32}, ValueError, "reduce_dtype must be a floating dtype"),
        ({"reduce_dtype": "bf16"}, TypeError, "reduce_dtype must be a torch.dtype"),
        ({"compile_compute": 1}, TypeError, "compile_compute must be a bool or None"),
        ({"mesh": "dp"}, TypeError, "mesh must be an spmd.Mesh"),
    ],
)
def test_bad_options_are_rejected_before_tracing(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        spmd.parallelize(MLP(), **kwargs)
    with pytest.raises(exc, match=match):
        spmd.parallelize(**kwargs)


def test_unknown_object_and_missing_process_group():
    with pytest.raises(TypeError, match="expected an nn.Module"):
        spmd.parallelize(3)
    with pytest.raises(RuntimeError, match="init_process_group.*Mesh.simulated"):
        spmd.parallelize(MLP())


def test_simulated_mesh_plans_without_processes():
    model = spmd.parallelize(MODELS["encoder"](), mesh=spmd.Mesh.simulated(64))
    x, y = batch("encoder")
    F.mse_loss(model(x), y).backward()  # runs locally, collectives inert
    plan = spmd.inspect(model)
    assert plan.world_size == 64 and plan.buckets
    assert all(b.predicted_seconds > 0 for b in plan.buckets)


def test_debug_plan_logs_every_pass(monkeypatch, caplog):
    monkeypatch.setenv("SPMD_DEBUG", "plan")
    model = spmd.parallelize(MODELS["mlp"](), mesh=spmd.Mesh.simulated(4))
    with caplog.at_level(logging.INFO, logger="spmd.lowering"):
        F.mse_loss(model(batch("mlp")[0]), batch("mlp")[1]).backward()
    for name in ("annotate", "propagate", "insert_collectives", "bucketing", "schedule"):
        assert f"pass {name} on graph0" in caplog.text


def _mismatched(rank):
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    model = nn.Linear(4, 4 if rank == 0 else 5)
    try:
        spmd.parallelize(model)
    except ValueError as e:
        return str(e)


def test_models_that_differ_across_ranks_are_named():
    out = dist.spawn(_mismatched, nprocs=2, start_method="forkserver", timeout=60)
    for message in out:
        assert "parameter 'weight' is shape=(4, 4)" in message and "on rank 0" in message
        assert "shape=(5, 4)" in message and "on rank 1" in message


class _Diverging(MLP):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def forward(self, x):
        h = F.relu(self.fc1(x))
        if self.rank == 0:  # a different graph on rank 0: the plans cannot agree
            h = F.relu(self.fc2(h))
        return self.out(F.pad(h, (0, 0)) if self.rank else h)


def _diverging(rank):
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = spmd.parallelize(_Diverging(rank))
    try:
        model(torch.ones(2, 8)).sum().backward()
    except dist.DistError as e:
        return str(e)


def test_ranks_that_trace_different_graphs_get_an_error_not_a_hang():
    # named by the size check's row at the backward's first run (each rank's graph and
    # its signature), before the plans are compared (with SPMD_SIZE_CHECK=0 the plan
    # comparison names them: "planned graph0 differently"). Each rank's own words come
    # through the store when they arrive within a few seconds; on a loaded machine a
    # rank's may not, and its line is then what its header says (the graph's signature)
    out = dist.spawn(_diverging, nprocs=2, start_method="forkserver", timeout=60)
    for message in out:
        assert message is not None and "collectives disagree" in message, message
        for rank in (0, 1):
            assert re.search(rf"rank {rank}: (graph0 backward|a compiled graph \(signature)",
                             message), message
        assert "rank(s) 1 differ from rank 0" in message, message


def test_single_rank_group_runs_without_collectives():
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        model = spmd.parallelize(MODELS["mlp"]())
        x, y = batch("mlp")
        F.mse_loss(model(x), y).backward()
        want = _reference_grads(1)
        for name, p in model.named_parameters():
            assert torch.allclose(p.grad, want[name], **TOL)
        assert spmd.inspect(model).collectives == []
    finally:
        dist.destroy_process_group()


def _refuse(self, gm, example_inputs):  # fault injection: the backend fails to compile
    raise RuntimeError("injected capture failure")


def _capture_fails(rank):
    from spmd.lowering.capture import Capture

    Capture.__call__ = _refuse  # this rank's process only
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    world = dist.get_world_size()
    model = spmd.parallelize(MODELS["mlp"]())
    x, y = batch("mlp")
    for _ in range(2):
        F.mse_loss(model(_shard(x, rank, world)), _shard(y, rank, world)).backward()
    plan = spmd.inspect(model)
    return _grads(model), [(f.param, f.reason) for f in plan.fallbacks]


def test_a_model_that_cannot_be_captured_still_trains_correctly():
    out = dist.spawn(_capture_fails, nprocs=2, start_method="forkserver", timeout=100)
    want = _reference_grads(1)
    for grads, fallbacks in out:
        for name, g in grads.items():  # two backward passes accumulated, each averaged
            assert torch.allclose(g, 2 * want[name], **TOL), name
        assert sorted(p for p, _ in fallbacks) == sorted(want)
        assert all("could not be captured" in reason and "injected capture failure" in reason
                   for _, reason in fallbacks)


class _SparseBag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 4, sparse=True)
        self.head = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(1))


def _sparse_ids() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 12, (8, 3), generator=g), torch.randn(8, 1, generator=g)


def _sparse_steps(model: nn.Module, ids: torch.Tensor, y: torch.Tensor, wrapped: nn.Module,
                  grads: list) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(3):
        F.mse_loss(wrapped(ids), y).backward()
        grads.append(model.emb.weight.grad.is_sparse)
        opt.step()
        opt.zero_grad()


def _sparse_embedding(rank):
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = _SparseBag()
    ids, y = _sparse_ids()
    world = dist.get_world_size()
    sparse: list = []
    _sparse_steps(model, _shard(ids, rank, world), _shard(y, rank, world),
                  spmd.parallelize(model), sparse)
    plan = spmd.inspect(model)
    return ({k: v.detach() for k, v in model.state_dict().items()}, sparse,
            [(f.param, f.reason) for f in plan.fallbacks])


def test_sparse_embedding_gradients_are_averaged_sparse_as_one_process_would():
    """torch DDP takes nn.Embedding(sparse=True): its gradient is all-reduced as a sparse
    tensor. The graph reduces dense buckets only, so the step goes to the eager safety
    net, which says so in the plan and gives one process's result on the whole batch."""
    out = dist.spawn(_sparse_embedding, nprocs=2, start_method="forkserver", timeout=100)
    torch.manual_seed(0)
    reference = _SparseBag()
    ids, y = _sparse_ids()
    _sparse_steps(reference, ids, y, reference, [])
    for state, sparse, fallbacks in out:
        assert sparse == [True, True, True]  # still sparse after averaging
        for name, want in reference.state_dict().items():
            assert torch.allclose(state[name], want, **TOL), name
        assert any(p == "emb.weight" for p, _ in fallbacks), fallbacks
        assert all("sparse" in reason for _, reason in fallbacks), fallbacks
