"""The planned graphs' packing path gives kernels.pack's result bit for bit, and a new
buffer: never a view of a gradient, which the collective then reduces in place."""

from __future__ import annotations

import pytest
import torch

import spmd.kernels as kernels
from spmd.lowering.flat import pack_planned

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.float(), b.float())


@pytest.mark.parametrize("src", DTYPES, ids=str)
@pytest.mark.parametrize("dst", DTYPES, ids=str)
@pytest.mark.parametrize("scale", [1.0, 0.25, 1 / 3])
@pytest.mark.parametrize("count", [1, 4])
def test_pack_planned_equals_kernels_pack(src, dst, scale, count):
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 5, generator=g).to(src), torch.randn(7, generator=g).to(src),
               torch.randn(4, 2, generator=g).to(src).t(), torch.randn(1, generator=g).to(src)]
    tensors = tensors[:count]
    before = [t.clone() for t in tensors]
    got = pack_planned(tensors, scale, dst)
    assert same(got, kernels.pack(tensors, scale=scale, dtype=dst))
    got.add_(1)  # the buffer is its own: the inputs stay as they were
    for t, b in zip(tensors, before):
        assert torch.equal(t, b)
