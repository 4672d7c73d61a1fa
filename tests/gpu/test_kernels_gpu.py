"""The compiled Triton kernels at full size on a GPU (skipped without CUDA), against
expectations computed here with plain torch on the same device and against torch.optim."""

from __future__ import annotations

import pytest
import torch

from spmd.kernels import adamw_step, implementation, pack, sgd_step, unpack

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# AdamW's and SGD's parameters against torch.optim(foreach=False) on CUDA: torch's kernels
# let nvcc contract multiply-adds where ours fuse only where torch's CPU kernels do.
TOL = dict(rtol=1e-6, atol=1e-7)


@pytest.fixture(autouse=True)
def _auto(monkeypatch):
    monkeypatch.delenv("SPMD_KERNELS", raising=False)


def bucket(dtype=torch.float32, seed=0):
    """About 13M elements: transformer-sized matrices, biases, odd sizes (which put the
    tensors after them on the unaligned path) and strided views."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g).to(dtype)  # noqa: E731
    return [r(3072, 1024), r(3072), r(1024, 4096).t(), r(4096), r(1024, 1024), r(1000),
            r(3), r(0), r(()), r(4096, 1024), r(7, 1025)[:, 1::2], r(2048, 8, 3).permute(2, 0, 1)]


def same(a, b):
    bits = torch.int16 if a.element_size() == 2 else torch.int32
    return a.dtype == b.dtype and bool(((a.view(bits) == b.view(bits))
                                        | (a.isnan() & b.isnan())).all())


def test_cuda_uses_compiled_triton():
    from triton.runtime.jit import JITFunction

    from spmd.kernels import packing_triton
    from spmd.kernels.dispatch import launchable

    assert implementation("cuda") == "triton"
    assert isinstance(launchable(packing_triton.copy_kernel, torch.device("cuda")), JITFunction)


@pytest.mark.parametrize("src", DTYPES)
@pytest.mark.parametrize("dst", DTYPES)
def test_pack_full_size(src, dst):
    tensors = bucket(src)
    out = pack(tensors, scale=0.125, dtype=dst)
    s = torch.tensor(0.125, device="cuda")
    assert same(out, torch.cat([(t.reshape(-1).float() * s).to(dst) for t in tensors]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("accumulate", [False, True])
def test_unpack_full_size(dtype, accumulate):
    targets = bucket(dtype, seed=1)
    before = [t.clone() for t in targets]
    flat = torch.randn(sum(t.numel() for t in targets), device="cuda").to(torch.bfloat16)
    unpack(flat, targets, scale=0.5, accumulate=accumulate)
    start = 0
    for t, old in zip(targets, before):
        piece = flat[start:start + t.numel()].float().view(t.shape) * 0.5
        start += t.numel()
        assert same(t, ((old.float() + piece) if accumulate else piece).to(dtype))


def test_ten_thousand_tensors_in_one_launch():
    g = torch.Generator(device="cuda").manual_seed(2)
    sizes = torch.randint(1, 5000, (10000,)).tolist()
    tensors = [torch.randn(n, device="cuda", generator=g) for n in sizes]
    flat = pack(tensors, dtype=torch.bfloat16)
    assert same(flat, torch.cat(tensors).to(torch.bfloat16))
    targets = [torch.zeros_like(t) for t in tensors]
    unpack(flat, targets)
    assert same(torch.cat(targets), flat.float())


def test_tensors_on_another_gpu_than_the_current_one():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    tensors = [torch.randn(1000, device="cuda:1"), torch.randn(37, device="cuda:1")]
    with torch.cuda.device(0):
        assert same(pack(tensors), torch.cat(tensors))


def _optim_case(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(1024, 1024), (1024,), (1000,), (3,), (4096, 256), (0,)]
    params = [torch.randn(s, device="cuda", generator=g) for s in shapes]
    total = sum(p.numel() for p in params)
    flats = [torch.randn(total, device="cuda", generator=g) for _ in range(3)]
    return params, flats


def _torch_optim(cls, params, flats, **hyper):
    ps = [p.clone().requires_grad_() for p in params]
    opt = cls(ps, foreach=False, **hyper)
    for flat in flats:
        for p, piece in zip(ps, flat.split([p.numel() for p in ps])):
            p.grad = piece.view(p.shape).clone()
        opt.step()
    return [p.detach() for p in ps], [opt.state[p] for p in ps]


@pytest.mark.parametrize("hyper", [dict(lr=0.1, momentum=0.9, weight_decay=0.01),
                                   dict(lr=0.1, momentum=0.9, nesterov=True)])
def test_sgd_against_torch_optim(hyper):
    params, flats = _optim_case(3)
    expected, state = _torch_optim(torch.optim.SGD, params, flats, **hyper)
    buffers = [None] * len(params)
    for flat in flats:
        sgd_step(params, flat, buffers, **hyper)
    for p, e, b, s in zip(params, expected, buffers, state):
        torch.testing.assert_close(p, e, **TOL)
        torch.testing.assert_close(b, s["momentum_buffer"], **TOL)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adamw_against_torch_optim(amsgrad):
    params, flats = _optim_case(4)
    expected, state = _torch_optim(torch.optim.AdamW, params, flats, lr=1e-2, amsgrad=amsgrad)
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    vmax = [torch.zeros_like(p) for p in params] if amsgrad else None
    for step, flat in enumerate(flats, 1):
        adamw_step(params, flat, m, v, vmax, step=step, lr=1e-2, amsgrad=amsgrad)
    for p, e, mi, vi, s in zip(params, expected, m, v, state):
        torch.testing.assert_close(p, e, **TOL)
        torch.testing.assert_close(mi, s["exp_avg"], **TOL)
        torch.testing.assert_close(vi, s["exp_avg_sq"], **TOL)


def test_kernels_match_the_torch_path_on_the_same_gpu(monkeypatch):
    params, flats = _optim_case(5)
    results = []
    for impl in ("triton", "torch"):
        monkeypatch.setenv("SPMD_KERNELS", impl)
        ps = [p.clone() for p in params]
        m, v = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
        for step, flat in enumerate(flats, 1):
            adamw_step(ps, flat, m, v, step=step, lr=1e-2, grad_scale=0.25)
        results.append(ps + m + v)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, **TOL)


WIRE = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("wire", WIRE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1 << 22, (1 << 20) + 7])  # 16-byte aligned chunks, and not
def test_reduce_chunks_full_size_against_the_torch_path(monkeypatch, wire, dtype, n):
    from spmd.kernels import quantize_chunks, reduce_chunks

    if wire == torch.float8_e4m3fn and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton loads float8_e4m3fn on sm_89 and later only")
    g = torch.Generator(device="cuda").manual_seed(6)
    p = 8
    x = torch.randn(p, n, device="cuda", generator=g) * torch.logspace(-2, 2, p,
                                                                        device="cuda")[:, None]
    chunks, scales = quantize_chunks(x, wire)
    if scales is None:
        scales = torch.rand(p, device="cuda", generator=g) + 0.5
    results = []
    for impl in ("triton", "torch"):  # the torch path: separate multiplies and adds, in order
        monkeypatch.setenv("SPMD_KERNELS", impl)
        results.append(reduce_chunks(chunks, scales=scales, scale=1 / p, dtype=dtype))
    assert same(*results)


@pytest.mark.parametrize("wire", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_reduce_chunks_decodes_every_float8_bit_pattern(wire):
    """NaN and e5m2's infinities included, which Triton's interpreter gets wrong on CPU."""
    from spmd.kernels import reduce_chunks

    if wire == torch.float8_e4m3fn and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton loads float8_e4m3fn on sm_89 and later only")
    chunks = torch.arange(256, dtype=torch.uint8, device="cuda").view(wire).view(1, 256)
    assert same(reduce_chunks(chunks), chunks[0].float())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grouped_kernels_compiled_equal_the_loop_at_an_experts_size(dtype, monkeypatch):
    """spmd's Triton grouped products compiled (a Mixtral-like layer's rows: 8 experts
    of 1408 x 2048, 12,000 real rows of 16,384, uneven, one expert idle) against the loop
    of torch.mm on the same card, to the dtype's rounding over K = 2048 terms."""
    from spmd.kernels import grouped

    g = torch.Generator(device="cuda").manual_seed(1)
    counts = torch.tensor([3000, 0, 1, 2999, 1500, 1500, 2000, 1000])
    offs = counts.cumsum(0).cuda()
    x = torch.randn(16384, 2048, device="cuda", generator=g).to(dtype)
    x[int(counts.sum()):] = 0
    w = torch.randn(8, 1408, 2048, device="cuda", generator=g).to(dtype).transpose(1, 2)
    grad = torch.randn(16384, 1408, device="cuda", generator=g).to(dtype)
    got = grouped.grouped_mm(x, w, offs)
    got_w = grouped.grouped_mm_weight(x.t(), grad, offs, 0.5)
    monkeypatch.setenv("SPMD_KERNELS", "torch")
    want = grouped.grouped_mm(x.float(), w.float(), offs)
    want_w = grouped.grouped_mm_weight(x.t().float(), grad.float(), offs, 0.5)
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}[dtype]
    assert float((got.float() - want).abs().max()) <= tol * (1 + float(want.abs().max()))
    assert float((got_w.float() - want_w).abs().max()) <= tol * (1 + float(want_w.abs().max()))
    assert torch.equal(got_w[1], torch.zeros_like(got_w[1]))  # the idle expert
