"""Sharded checkpoints of sharded models through torch.distributed.checkpoint: saved on
N ranks, loaded on M, optimizer state included; training goes on as if never stopped."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import runtime as dist

from ..models import SHARDED_MODELS, batch

SAVED_AT, STEPS = 3, 5


def _rows(x, rank, world):
    return x[rank * len(x) // world:(rank + 1) * len(x) // world]


def _train(model, opt, name, rank, world, steps) -> None:
    for step in steps:
        x, y = batch(name, step=step)
        F.mse_loss(model(_rows(x, rank, world)), _rows(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()


def _mesh(strategy, world):
    return spmd.Mesh((2, world // 2), dim_names=("dp", "fsdp")) if strategy == "hsdp" else None


def save_job(rank: int, name: str, path: str, strategy: str) -> None:
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    try:
        world = dist.get_world_size()
        model = spmd.parallelize(SHARDED_MODELS[name](), strategy=strategy,
                                 mesh=_mesh(strategy, world))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        _train(model, opt, name, rank, world, range(SAVED_AT))
        model_sd, optim_sd = spmd.checkpoint.get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    finally:
        dist.destroy_process_group()


def load_job(rank: int, name: str, path: str, strategy: str) -> dict:
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    try:
        world = dist.get_world_size()
        model = spmd.parallelize(SHARDED_MODELS[name](), strategy=strategy,
                                 mesh=_mesh(strategy, world))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        model_sd, optim_sd = spmd.checkpoint.get_state_dict(model, opt)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        spmd.checkpoint.set_state_dict(model, opt, model_state_dict=model_sd,
                                       optim_state_dict=optim_sd)
        loaded = {k: v.clone() for k, v in model.state_dict().items()}
        _train(model, opt, name, rank, world, range(SAVED_AT, STEPS))
        return {"loaded": loaded, "final": {k: v.clone() for k, v in model.state_dict().items()},
                "steps": sorted({int(s["step"]) for s in opt.state.values()})}
    finally:
        dist.destroy_process_group()


def _reference(name: str, steps: int) -> dict:
    model = SHARDED_MODELS[name]()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, opt, name, 0, 1, range(steps))
    return model.state_dict()


@pytest.mark.parametrize("name, saved_on, loaded_on, strategy", [
    ("encoder", 2, 3, "fsdp"),   # uneven rows on 3: padding moves
    ("mlp", 3, 2, "fsdp"),
    ("tied", 4, 2, "hsdp"),      # a 2x2 hybrid mesh's checkpoint on a 2x1 one
])
def test_save_on_n_ranks_load_on_m(tmp_path, name, saved_on, loaded_on, strategy):
    path = str(tmp_path / "ckpt")
    dist.spawn(save_job, args=(name, path, strategy), nprocs=saved_on,
               start_method="forkserver", timeout=100)
    runs = dist.spawn(load_job, args=(name, path, strategy), nprocs=loaded_on,
                      start_method="forkserver", timeout=100)
    at_save, at_end = _reference(name, SAVED_AT), _reference(name, STEPS)
    for run in runs:
        for key, want in at_save.items():
            assert torch.allclose(run["loaded"][key], want, atol=1e-6), key
        for key, want in at_end.items():  # the optimizer's moments came back too
            diff = (run["final"][key] - want).abs().max().item()
            assert diff <= 1e-3, f"{key} differs by {diff:.3g} after resuming"
        assert run["steps"] == [STEPS]


def test_the_checkpoint_loads_into_a_plain_model(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = str(tmp_path / "ckpt")
    dist.spawn(save_job, args=("mlp", path, "fsdp"), nprocs=2, start_method="forkserver",
               timeout=100)
    dcp_to_torch_save(path, str(tmp_path / "whole.pt"))
    saved = torch.load(str(tmp_path / "whole.pt"), weights_only=False)
    plain = SHARDED_MODELS["mlp"]()
    plain.load_state_dict(saved["model"])
    for key, want in _reference("mlp", SAVED_AT).items():
        assert torch.allclose(plain.state_dict()[key], want, atol=1e-6), key


def test_a_plain_models_state_dicts_are_torchs():
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = SHARDED_MODELS["tied"]()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ours, theirs = spmd.checkpoint.get_state_dict(model, opt), get_state_dict(model, opt)
    for mine, torchs in zip(ours, theirs):
        assert list(mine) == list(torchs)
    assert ours[1]["param_groups"] == theirs[1]["param_groups"]
    assert {k: list(v) for k, v in ours[1]["state"].items()} == \
        {k: list(v) for k, v in theirs[1]["state"].items()}
