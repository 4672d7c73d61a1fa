"""Tensor parallelism on a GPU (skipped without CUDA), where Inductor compiles the graphs'
compute (the planner's choice for CUDA tensors) and the CUDA kernels' decompositions
differ from the CPU's: LLaMA-family models planned for tp=2 and fsdp x tp on simulated
meshes, each plan verified as it is made (``SPMD_VERIFY=1``), every op placed by a rule,
and the compiled forward and backward run on the pieces. (Real ranks need one GPU each:
Gloo here takes CPU tensors, NCCL one device per rank.)"""

from __future__ import annotations

import pytest
import torch

import spmd

from ..llama import Llama, tokens
from ..zoo import entry

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MESHES = [((2,), ("tp",), "ddp"), ((2, 2), ("fsdp", "tp"), "fsdp")]


def _check(model, x, shape, names, strategy, placements, gathers: bool = False) -> None:
    plan = spmd.inspect(model, x, strategy=strategy, mesh=spmd.Mesh.simulated(shape, names),
                        placements=placements)
    assert all(p.startswith("inductor") for p in plan.compute_paths.values())
    unruled = sorted({p.op for p in plan.placed if p.fallback})
    assert unruled == [] and plan.fallbacks == [], (unruled, plan.fallbacks)
    on_tp = {c.kind for c in plan.collectives if c.mesh_dim == "tp"}
    assert on_tp == ({"all_reduce", "all_gather"} if gathers else {"all_reduce"}), on_tp
    print(names, plan.verify(numerics=0))


@pytest.mark.parametrize("shape,names,strategy", MESHES)
@pytest.mark.parametrize("form", [dict(rope="complex", gqa="enable_gqa", norm="nn"),
                                  dict(rope="half", gqa="repeat_interleave", norm="F"),
                                  dict(rope="half", gqa="expand", norm="hand")],
                         ids=["complex-enable_gqa-nn", "half-repeat_interleave-F",
                              "half-expand-hand"])
def test_our_llama_forms_plan_compile_and_run_on_cuda(form, shape, names, strategy):
    # float32 enable_gqa on CUDA takes the math path (no fused kernel pairs unequal head
    # counts there): its batched product merges batch and the sharded heads into one
    # dimension, which is no shard, so each block gathers (correct, and the plan says so)
    _check(Llama(**form).cuda(), tokens().cuda(), shape, names, strategy,
           spmd.tp.megatron(), gathers=form["gqa"] == "enable_gqa")


@pytest.mark.parametrize("shape,names,strategy", MESHES)
@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen2"])
def test_hugging_face_models_plan_compile_and_run_on_cuda(name, shape, names, strategy):
    pytest.importorskip("transformers")
    e = entry(name)
    x, _ = e.make_batch(0, 4)
    _check(e.model().cuda().float(), x.cuda(), shape, names, strategy, e.placements)
