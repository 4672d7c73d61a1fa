"""compile_compute=True: Inductor compiles the graphs' compute, collectives included."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.nn.functional as F

import spmd
from spmd import runtime as dist

from ..models import MODELS, batch


def job(rank: int) -> tuple:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=100))
    model = spmd.parallelize(MODELS["mlp"](), compile_compute=True, bucket_cap_mb=0)
    x, y = batch("mlp")
    rows = slice(rank * 6, (rank + 1) * 6)
    F.mse_loss(model(x[rows]), y[rows]).backward()
    plan = spmd.inspect(model)
    dist.destroy_process_group()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, plan.compute_paths, len(
        plan.collectives)


def test_inductor_compiled_graphs_reduce_gradients_correctly():
    out = dist.spawn(job, nprocs=2, start_method="forkserver", timeout=110)
    reference = MODELS["mlp"]()
    x, y = batch("mlp")
    F.mse_loss(reference(x), y).backward()
    for grads, paths, collectives in out:
        assert paths == {"graph0": "inductor (compile_compute=True)"}
        assert collectives == 6
        for name, p in reference.named_parameters():
            assert torch.allclose(grads[name], p.grad, atol=1e-5, rtol=1e-4), name


def test_the_planner_keeps_cpu_graphs_in_generated_python():
    model = spmd.parallelize(MODELS["mlp"](), mesh=spmd.Mesh.simulated(2))
    model(batch("mlp")[0]).sum().backward()
    assert spmd.inspect(model).compute_paths["graph0"].startswith("emit (CPU tensors")


def tp_job(rank: int) -> tuple:
    """Tensor parallelism with Inductor (the planner's choice on CUDA): the backward is
    compiled for the pieces its forward saved, laid out as the forward leaves them."""
    from ..llama import Llama, tokens

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=100))
    torch.set_default_dtype(torch.float64)
    model = spmd.parallelize(Llama(layers=1, rope="complex", gqa="enable_gqa"),
                             mesh=spmd.Mesh((2,), dim_names=("tp",)),
                             placements=spmd.tp.megatron(), compile_compute=True)
    out = model(tokens())
    out.pow(2).mean().backward()
    grads = {n: g.clone() for n, g in _whole_grads(model).items()}
    paths = spmd.inspect(model).compute_paths
    dist.destroy_process_group()
    return out.detach(), grads, paths


def _whole_grads(model) -> dict:
    """Each parameter's whole gradient (pieces gathered as state_dict gathers them)."""
    specs = model._spmd.layout.pieces
    found = {}
    for name, p in model.named_parameters():
        spec = specs.get(name)
        found[name] = spec.whole(p.grad) if spec is not None else p.grad
    return found


def test_inductor_compiles_tensor_parallel_graphs_for_their_pieces():
    from ..llama import Llama, tokens

    out = dist.spawn(tp_job, nprocs=2, start_method="forkserver", timeout=115)
    torch.set_default_dtype(torch.float64)
    try:
        reference = Llama(layers=1, rope="complex", gqa="enable_gqa")
        want = reference(tokens())
        want.pow(2).mean().backward()
    finally:
        torch.set_default_dtype(torch.float32)
    for got, grads, paths in out:
        assert paths == {"graph0": "inductor (compile_compute=True)"}
        assert (got - want).abs().max().item() <= 1e-9
        for name, p in reference.named_parameters():
            assert (grads[name] - p.grad).abs().max().item() <= 1e-9, name
