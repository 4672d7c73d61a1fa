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


def test_a_buckets_kept_tables_are_rebuilt_when_an_address_moves(monkeypatch):
    """With the bucket's ``BucketTables`` (the Triton path, interpreted here), a step over
    the same tensors reuses the launch plan, and a step where one gradient was allocated
    anew builds a new one: the kernel reads the new tensor, not the old address (kept
    alive here, so a stale plan would read its values and fail the comparison)."""
    from spmd.kernels.layout import BucketTables

    monkeypatch.setenv("SPMD_KERNELS", "triton")
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(3, 5, generator=g), torch.randn(8, generator=g),
             torch.randn(4, 2, generator=g).t()]
    tables = BucketTables()
    out = torch.empty(31, dtype=torch.bfloat16)
    for _ in range(3):  # the same tensors and buffer, step after step
        got = pack_planned(grads, 0.5, torch.bfloat16, out, tables)
        assert same(got, kernels.pack(grads, scale=0.5, dtype=torch.bfloat16))
    assert tables.builds == 1
    old = grads[1]
    grads[1] = torch.randn(8, generator=g)  # a new allocation: another address
    got = pack_planned(grads, 0.5, torch.bfloat16, out, tables)
    assert tables.builds == 2
    assert same(got, kernels.pack(grads, scale=0.5, dtype=torch.bfloat16))
    assert not torch.equal(old, grads[1])
    other = torch.empty(31, dtype=torch.bfloat16)  # a new buffer is an address too
    assert same(pack_planned(grads, 1.0, torch.bfloat16, other, tables),
                kernels.pack(grads, dtype=torch.bfloat16))
    assert tables.builds == 3
