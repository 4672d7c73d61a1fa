"""``shard_placement_fn`` (FSDP2's name): the dimension each parameter is sharded along.
``spmd.shard_evenly`` cuts a weight whose dim 0 does not divide along one that does (no
padding); on 2 process ranks, in float64, fsdp and zero2 then train as one process on the
whole batch does, with clipping and AdamW, and the record, the plan, state dicts and
sharded checkpoints say and keep the choice. A choice that cannot be kept is refused by
name before anything runs."""

from __future__ import annotations

import tempfile
from datetime import timedelta

import pytest
import torch
import torch.nn as nn

import spmd
from spmd import runtime as dist

from ..models import MODELS
from ..models import batch as model_batch
from .test_zero import Net, assert_trained_like_one_process, batch, make, train

WORLD = 2


def job(rank: int, path: str) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    out: dict = {}
    for strategy in ("fsdp", "zero2"):
        model = spmd.parallelize(make(), strategy=strategy,
                                 shard_placement_fn=spmd.shard_evenly)
        out[strategy] = train(model, rank)
        placed = spmd.placement_of(model.fc2.weight)
        out[(strategy, "placement")] = (repr(placed.stored), placed.local_shape,
                                        placed.padding)
        out[(strategy, "bias")] = spmd.placement_of(model.fc2.bias).local_shape
        out[(strategy, "local")] = dict(model.named_parameters())["fc2.weight"].detach().clone()
        out[(strategy, "summary")] = spmd.inspect(model).summary()
    # a second family: torch's transformer encoder, every matrix sharded along dim 1
    out["encoder"] = train_encoder(rank)
    # a sharded checkpoint of the Shard(1) weight, loaded into a fresh model
    import torch.distributed.checkpoint as dcp

    model = spmd.parallelize(make(), strategy="fsdp", shard_placement_fn=spmd.shard_evenly)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    x, y = batch(0, rank)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    model_sd, optim_sd = spmd.checkpoint.get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    fresh = spmd.parallelize(Net().double(), strategy="fsdp",
                             shard_placement_fn=spmd.shard_evenly)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.05)
    model_sd, optim_sd = spmd.checkpoint.get_state_dict(fresh, fresh_opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    spmd.checkpoint.set_state_dict(fresh, fresh_opt, model_state_dict=model_sd,
                                   optim_state_dict=optim_sd)
    out["checkpoint"] = (saved, fresh.state_dict())
    dist.destroy_process_group()
    return out


def _columns(param: torch.Tensor):
    return spmd.Shard(1) if param.dim() == 2 else None


def train_encoder(rank: int | None) -> dict:
    """torch's TransformerEncoder (attention's packed in_proj_weight included), fsdp with
    every matrix sharded along dim 1, 3 SGD steps on the rows of this rank."""
    model = MODELS["encoder"]().double()
    if rank is not None:
        model = spmd.parallelize(model, strategy="fsdp", shard_placement_fn=_columns)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = model_batch("encoder")
    rows = slice(None) if rank is None else slice(rank * 6, (rank + 1) * 6)
    for _ in range(3):
        nn.functional.mse_loss(model(x[rows].double()), y[rows].double()).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory() as path:
        yield dist.spawn(job, args=(path,), nprocs=WORLD, start_method="forkserver",
                         timeout=110)


@pytest.mark.parametrize("strategy", ["fsdp", "zero2"])
def test_trains_like_one_process(runs, strategy):
    assert_trained_like_one_process(runs, strategy)


@pytest.mark.parametrize("strategy", ["fsdp", "zero2"])
def test_the_record_and_the_plan_say_which_dimension(runs, strategy):
    whole = make().fc2.weight.detach()  # (5, 16): dim 0 does not divide over 2 ranks
    for rank, out in enumerate(runs):
        stored, local, padding = out[(strategy, "placement")]
        assert "Shard(1)" in stored and local == (5, 8) and padding == 0
        assert out[(strategy, "bias")] == (3,)  # (5,): no other dimension, dim 0 padded
        assert "fc2.weight Shard(1)" in out[(strategy, "summary")]
    # each rank holds its 8 columns (trained, so compare the untrained layout by shape)
    assert runs[0][(strategy, "local")].shape == whole[:, :8].shape


def test_a_second_family_sharded_along_dim_1_trains_like_one_process(runs):
    want = train_encoder(None)
    for rank, out in enumerate(runs):
        for key, value in want.items():
            assert torch.allclose(out["encoder"][key], value, rtol=1e-12, atol=1e-12), \
                (rank, key)


def test_state_dicts_and_checkpoints_keep_the_choice(runs):
    for saved, loaded in (out["checkpoint"] for out in runs):
        assert saved and saved.keys() == loaded.keys()
        for key in saved:
            assert torch.equal(saved[key], loaded[key]), key


def test_choices_that_cannot_be_kept_are_refused_by_name():
    mesh = spmd.Mesh.simulated(2)
    with pytest.raises(ValueError, match=r"fc1.bias \(shape \(16,\)\) Shard\(1\), out of range"):
        spmd.parallelize(make(), strategy="fsdp", mesh=mesh,
                         shard_placement_fn=lambda p: spmd.Shard(1) if p.dim() == 1 else None)
    with pytest.raises(ValueError, match=r"out.weight .* dimension 1 \(5\), which 2 ranks "
                                         r"do not divide"):
        spmd.parallelize(make(), strategy="fsdp", mesh=mesh,
                         shard_placement_fn=lambda p: spmd.Shard(1) if tuple(p.shape) == (4, 5)
                         else None)
    with pytest.raises(ValueError, match="shard_placement_fn applies to the sharded"):
        spmd.parallelize(make(), mesh=mesh, shard_placement_fn=spmd.shard_evenly)
    with pytest.raises(TypeError, match="shard_placement_fn must be a callable"):
        spmd.parallelize(make(), strategy="fsdp", mesh=mesh, shard_placement_fn=1)
