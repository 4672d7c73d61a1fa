"""grouped_mm and grouped_mm_weight (a mixture of experts' products, ``spmd.kernels.grouped``)
on both paths (the Triton kernels run in Triton's interpreter on CPU), each against a float64
product of each expert's rows computed here: several tiles of rows, columns and the inner
dimension per expert, experts with no row or one, padding rows after the last expert,
weights read through a transposed view, a bias, every dtype the kernels take.

Error bound: float32 and float64 products summed in float32 are off by about
``K * 2**-24`` relatively; bfloat16 and float16 inputs are rounded first (``2**-8``,
``2**-11``), so the bound is taken from the inputs as rounded, and the result's own
rounding (one, in the output dtype) is added.
"""

from __future__ import annotations

import pytest
import torch

from spmd.kernels import grouped

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
# (rows per expert, padding rows, K, N): tiles of 64 rows, 64 columns, 32 inner
CASES = {
    "several tiles": ([70, 0, 1, 129], 9, 40, 70),
    "one expert": ([5], 0, 16, 16),
    "all padding": ([0, 0, 0], 12, 24, 8),
}


@pytest.fixture(params=["torch", "triton"])
def impl(request, monkeypatch):
    monkeypatch.setenv("SPMD_KERNELS", request.param)
    return request.param


def _operands(counts, padding, k, n, dtype, transposed):
    gen = torch.Generator().manual_seed(len(counts) * 100 + k)
    rows = sum(counts) + padding
    x = torch.randn(rows, k, generator=gen, dtype=torch.float64).to(dtype)
    x[sum(counts):] = 0  # what ep_scatter pads with
    experts = len(counts)
    if transposed:  # (E, N, K) weights read as (E, K, N)
        w = torch.randn(experts, n, k, generator=gen, dtype=torch.float64).to(dtype)
        w = w.transpose(1, 2)
    else:
        w = torch.randn(experts, k, n, generator=gen, dtype=torch.float64).to(dtype)
    b = torch.randn(experts, n, generator=gen, dtype=torch.float64).to(dtype)
    return x, w, b, torch.tensor(counts).cumsum(0)


def _bound(dtype, k, want):
    unit = {torch.float64: 2.0 ** -52, torch.float32: 2.0 ** -24,
            torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[dtype]
    sums = 2.0 ** -52 if dtype == torch.float64 else 2.0 ** -24
    return (k * sums * 4 + unit) * (1 + want.abs())


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("transposed", [False, True], ids=["k-n", "n-k"])
def test_grouped_products_equal_each_experts_product(impl, case, dtype, transposed):
    counts, padding, k, n = CASES[case]
    x, w, b, offs = _operands(counts, padding, k, n, dtype, transposed)
    ends = offs.tolist()
    for bias in (None, b):
        got = grouped.grouped_mm(x, w, offs, bias)
        assert got.dtype == dtype and got.shape == (x.shape[0], n)
        want = torch.zeros(x.shape[0], n, dtype=torch.float64)
        for e, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
            want[start:end] = x[start:end].double() @ w[e].double()
            if bias is not None:
                want[start:end] += bias[e].double()
        assert torch.all((got.double() - want).abs() <= _bound(dtype, k, want)), \
            float((got.double() - want).abs().max())
        assert torch.equal(got[sum(counts):], torch.zeros_like(got[sum(counts):]))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grouped_weight_products_equal_each_experts_product(impl, case, dtype):
    counts, padding, k, n = CASES[case]
    x, _, _, offs = _operands(counts, padding, k, n, dtype, False)
    gen = torch.Generator().manual_seed(9)
    g = torch.randn(x.shape[0], n, generator=gen, dtype=torch.float64).to(dtype)
    got = grouped.grouped_mm_weight(x.t(), g, offs, 0.5)  # (the weight gradient's form)
    assert got.dtype == dtype and got.shape == (len(counts), k, n)
    ends = offs.tolist()
    rows = max(ends[-1], 1)
    for e, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
        want = 0.5 * x[start:end].double().t() @ g[start:end].double()
        assert torch.all((got[e].double() - want).abs() <= _bound(dtype, rows, want)), e
        if end == start:  # an expert that received no row
            assert torch.equal(got[e], torch.zeros_like(got[e]))


def test_the_triton_path_is_the_one_that_ran(monkeypatch):
    """Under SPMD_KERNELS=triton the float32 products launch the kernels (what the tests
    above check on that path); float64 stays on the loop, which the kernels do not take."""
    monkeypatch.setenv("SPMD_KERNELS", "triton")
    assert grouped._triton(torch.zeros(1, dtype=torch.float32))
    assert not grouped._triton(torch.zeros(1, dtype=torch.float64))
    monkeypatch.setenv("SPMD_KERNELS", "auto")
    assert not grouped._triton(torch.zeros(1))  # CPU: the loop, measured faster


def test_bad_operands_are_refused_by_name():
    x, w, b, offs = _operands([2, 3], 1, 8, 4, torch.float32, False)
    with pytest.raises(ValueError, match=r"x \(R, K\), weight \(E, K, N\) and offs \(E,\)"):
        grouped.grouped_mm(x, w[:1], offs)
    with pytest.raises(ValueError, match="offs must be 1-D int64"):
        grouped.grouped_mm(x, w, offs.int())
    with pytest.raises(ValueError, match=r"bias must be \(E, N\)"):
        grouped.grouped_mm(x, w, offs, b.t())
    with pytest.raises(ValueError, match="dtypes differ"):
        grouped.grouped_mm(x, w.double(), offs)
    with pytest.raises(ValueError, match=r"a \(K, R\) and b \(R, N\)"):
        grouped.grouped_mm_weight(x, x, offs)
