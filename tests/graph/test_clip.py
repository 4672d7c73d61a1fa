"""``clip_grad_norm_`` of a parallelized model takes the norm in the gradients' dtype, as
torch's does: float64 gradients get a float64 norm (it was taken in float32, 1e-8 off)."""

from __future__ import annotations

import torch

from spmd.eager.clip import clip_grad_norm_, total_norm


def _params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, dtype=dtype, generator=gen)) for n in (7, 33)]
    for p in params:
        p.grad = torch.randn(p.shape, dtype=dtype, generator=gen) * 1e3
    return params


def test_float64_gradients_get_a_float64_norm_equal_to_torchs():
    ours, theirs = _params(torch.float64), _params(torch.float64)
    for norm_type in (2.0, 1.0, float("inf")):
        got = total_norm(ours, norm_type)
        want = torch.nn.utils.get_total_norm([p.grad for p in theirs], norm_type)
        assert got.dtype == torch.float64
        assert abs(got.item() - want.item()) <= 1e-12 * want.item(), norm_type
    got = clip_grad_norm_(ours, 1.0)
    want = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert abs(got.item() - want.item()) <= 1e-12 * want.item()
    for a, b in zip(ours, theirs):
        assert (a.grad - b.grad).abs().max().item() <= 1e-12


def test_float32_gradients_keep_a_float32_norm():
    assert total_norm(_params(torch.float32), 2.0).dtype == torch.float32
