"""``@spmd.parallelize`` on a GPU, end to end (skipped without CUDA): module mode (Inductor
compiles the CUDA graphs, the Triton kernels pack each bucket) and whole-step mode (AdamW
runs from the buckets through the Triton kernel), each against plain torch training the
same model on the same batches. The mesh is simulated with 2 ranks, so the plan has
buckets and every kernel runs while the collectives themselves do nothing (one GPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

STEPS = 4
MESH = dict(mesh=spmd.Mesh.simulated(2))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    # bias=False: the key projection's bias has an identically zero gradient (softmax
    # ignores a shift); AdamW would turn the rounding noise on it into full steps
    layer = nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, dropout=0.0,
                                       batch_first=True, bias=False)
    return nn.Sequential(nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False),
                         nn.Linear(64, 8)).cuda()


def batches():
    g = torch.Generator(device="cuda").manual_seed(1)
    return [(torch.randn(16, 12, 64, device="cuda", generator=g),
             torch.randn(16, 12, 8, device="cuda", generator=g)) for _ in range(STEPS)]


OPTIMIZERS = {"sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
              "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3)}


def reference(data, opt_name):
    model = make_model()
    opt = OPTIMIZERS[opt_name](model.parameters())
    for x, y in data:
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model


def test_module_mode_on_cuda_uses_inductor_and_trains_like_torch():
    data = batches()
    model = spmd.parallelize(make_model(), bucket_cap_mb=1, **MESH)
    opt = OPTIMIZERS["sgd"](model.parameters())
    for x, y in data:
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    plan = spmd.inspect(model)
    assert all(path.startswith("inductor") for path in plan.compute_paths.values())
    assert plan.buckets and all(b.kernel == "triton" for b in plan.buckets)
    assert_same(model, reference(data, "sgd"))


def test_step_mode_on_cuda_runs_adamw_from_the_buckets():
    @spmd.parallelize(bucket_cap_mb=1, **MESH)
    def train_step(model, x, y, opt):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    data = batches()
    model = make_model()
    opt = OPTIMIZERS["adamw"](model.parameters())
    for x, y in data:
        train_step(model, x, y, opt)
    plan = spmd.inspect(train_step)
    (graph,) = plan.graphs.values()
    assert any("optimizer_step" in str(n.target) for n in graph.graph.nodes)
    assert_same(model, reference(data, "adamw"))


def assert_same(model, expected):
    for (name, a), b in zip(model.named_parameters(), expected.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
