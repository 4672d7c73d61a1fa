"""pack and unpack on both paths (the Triton kernel runs in Triton's interpreter on CPU),
each checked against an expectation computed here, independently of the library."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spmd.kernels import pack, packing_triton, unpack

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(params=["torch", "triton"])
def impl(request, monkeypatch):
    monkeypatch.setenv("SPMD_KERNELS", request.param)
    return request.param


def expected_pack(tensors, scale, dtype):
    """What pack promises: float32 value times float32 scale, rounded once to dtype."""
    s = torch.tensor(scale, dtype=torch.float32)
    return torch.cat([(t.reshape(-1).float() * s).to(dtype) for t in tensors])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, except that any NaN equals any NaN (torch's own bfloat16 conversion
    gives different NaN bits on its vectorised and scalar paths)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = torch.int16 if a.element_size() == 2 else torch.int32
    nan = a.isnan() & b.isnan()
    return bool(((a.view(bits) == b.view(bits)) | nan).all() and (a.isnan() == b.isnan()).all())


def mixed(dtype, seed=0):
    """Odd sizes, an empty tensor, a scalar, aligned and unaligned ones, strided views."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return [r(16), r(8, 8), r(3, 5), r(0), r(()), r(16), r(7, 9).t(), r(40)[3::3],
            r(2, 3, 4, 5).permute(3, 1, 0, 2), r(1, 1, 1)]


@pytest.mark.parametrize("src", DTYPES)
@pytest.mark.parametrize("dst", DTYPES)
@pytest.mark.parametrize("scale", [1.0, 0.25, 1 / 3])
def test_pack_scales_and_casts(impl, src, dst, scale):
    tensors = mixed(src)
    out = pack(tensors, scale=scale, dtype=dst)
    assert same(out, expected_pack(tensors, scale, dst))


def test_pack_keeps_the_common_dtype_and_fills_out_from_the_start(impl):
    tensors = mixed(torch.bfloat16, seed=1)
    assert pack(tensors).dtype == torch.bfloat16
    total = sum(t.numel() for t in tensors)
    out = torch.full((total + 5,), 7.0)
    assert pack(tensors, out, scale=2.0) is out
    assert same(out[:total], expected_pack(tensors, 2.0, torch.float32))
    assert out[total:].eq(7.0).all()


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # numpy
def test_pack_special_values(impl):
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.4e38, -3.4e38, 1e-40,
                      -0.0, 65520.0, 6e-8, 1.0 + 2**-8, 1.0 + 3 * 2**-8])
    for dtype in DTYPES:
        assert same(pack([x], dtype=dtype), expected_pack([x], 1.0, dtype))


def test_pack_mixed_dtypes_into_a_given_dtype(impl):
    tensors = [torch.randn(5), torch.randn(3, dtype=torch.bfloat16),
               torch.randn(9, dtype=torch.float16).view(3, 3).t()]
    out = pack(tensors, scale=0.5, dtype=torch.bfloat16)
    assert same(out, expected_pack(tensors, 0.5, torch.bfloat16))


def test_pack_reads_expanded_views(impl):
    t = torch.randn(3, 1).expand(3, 4)
    assert same(pack([t]), t.reshape(-1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("flat_dtype", DTYPES)
@pytest.mark.parametrize("accumulate", [False, True])
def test_unpack(impl, dtype, flat_dtype, accumulate):
    targets = mixed(dtype, seed=2)
    before = [t.clone() for t in targets]
    total = sum(t.numel() for t in targets)
    flat = torch.randn(total + 3).to(flat_dtype)
    unpack(flat, targets, scale=0.125, accumulate=accumulate)
    s = torch.tensor(0.125)
    start = 0
    for t, old in zip(targets, before):
        piece = flat[start:start + t.numel()].float().view(t.shape) * s
        start += t.numel()
        assert same(t, ((old.float() + piece) if accumulate else piece).to(dtype))


def test_one_launch_per_group_aligned_strided_or_neither(monkeypatch):
    """``mixed`` holds three aligned tensors (16-byte addresses, counts and offsets that are
    multiples of 8: the first two, and the 16 elements at offset 96), three unaligned
    contiguous ones and three strided views: three launches each way. Unpacking, every
    tensor is cut into chunks of its own. Packing, the unaligned and
    strided groups are chunked on the flat buffer's grid: the strided views (63, 13 and
    120 elements at offsets 112, 175 and 188, 128-element chunks) touch flat chunks
    0-1, 1 and 1-2, five programs; the unaligned ones (15, 1 and 1 at 80, 95 and 308,
    16-element chunks) one each."""
    monkeypatch.setenv("SPMD_KERNELS", "triton")
    launches = []
    real = packing_triton.launchable

    def spy(kernel, device):
        launch = real(kernel, device)

        class Recorder:
            def __getitem__(self, grid):
                def run(*args, **kw):
                    launches.append((grid[0], kw["STRIDED"], kw["ALIGNED"], kw["FLAT_GRID"]))
                    return launch[grid](*args, **kw)
                return run
        return Recorder()

    monkeypatch.setattr(packing_triton, "launchable", spy)
    tensors = mixed(torch.float32)
    flat = pack(tensors)
    assert same(flat, expected_pack(tensors, 1.0, torch.float32))
    assert sorted(launches) == [(3, False, False, True), (3, False, True, False),
                                (5, True, False, True)]
    launches.clear()
    targets = [torch.zeros_like(t) for t in tensors]
    unpack(flat, targets)
    # zeros_like keeps the transposed and permuted views' strides; the every-third-element
    # slice's target is contiguous, so unaligned (13 at 175): four, three and two programs
    assert sorted(launches) == [(2, True, False, False), (3, False, True, False),
                                (4, False, False, False)]
    assert all(torch.equal(t, u) for t, u in zip(tensors, targets))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packing_large_tensors_at_odd_offsets(impl, dtype):
    """Tensors of several 4096-element chunks at odd offsets: on the flat buffer's grid,
    whole chunks in the middle, masked first and last ones that share a flat chunk with
    the tensor before or after (which they must not touch), and nothing written past the
    end of the bucket."""
    g = torch.Generator().manual_seed(5)
    tensors = [torch.randn(3, generator=g), torch.randn(20001, generator=g),
               torch.randn(90, 130, generator=g).t(), torch.randn(7, generator=g),
               torch.randn(9000, generator=g)[1::2]]
    total = sum(t.numel() for t in tensors)
    out = torch.full((total + 100,), 7.0, dtype=dtype)
    pack(tensors, out, scale=0.5)
    assert same(out[:total], expected_pack(tensors, 0.5, dtype))
    assert out[total:].eq(7.0).all()


def test_unpack_then_pack_round_trips(impl):
    tensors = mixed(torch.float16, seed=3)
    flat = pack(tensors)
    targets = [torch.zeros_like(t) for t in tensors]
    unpack(flat, targets)
    for t, u in zip(tensors, targets):
        assert same(t.contiguous(), u.contiguous())


def test_unpack_into_views_of_the_buffer_itself(impl):
    """Gradients as views of the bucket (DDP's gradient_as_bucket_view): scale in place."""
    flat = torch.arange(20.0)
    views = [flat[:6].view(2, 3), flat[6:7].view(()), flat[7:20]]
    unpack(flat, views, scale=0.5)
    assert torch.equal(flat, torch.arange(20.0) * 0.5)


def test_thousands_of_tiny_tensors(impl):
    g = torch.Generator().manual_seed(4)
    sizes = torch.randint(1, 4, (2000,), generator=g).tolist()
    tensors = [torch.randn(n, generator=g) for n in sizes]
    flat = pack(tensors, scale=0.5, dtype=torch.bfloat16)
    assert same(flat, expected_pack(tensors, 0.5, torch.bfloat16))
    targets = [torch.ones(n) for n in sizes]
    unpack(flat, targets, accumulate=True)
    assert same(torch.cat(targets), 1.0 + flat.float())


@settings(max_examples=25, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=3), max_size=6),
       transpose=st.booleans(), scale=st.sampled_from([1.0, 0.5, 4.0]),
       dtype=st.sampled_from(DTYPES), impl_name=st.sampled_from(["torch", "triton"]))
def test_round_trip_property(shapes, transpose, scale, dtype, impl_name):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPMD_KERNELS", impl_name)
        tensors = [torch.randn(tuple(s)).to(dtype) for s in shapes]
        tensors = [t.t() if transpose and t.dim() == 2 else t for t in tensors]
        if not tensors:
            return
        flat = pack(tensors, scale=scale, dtype=torch.float32)
        assert same(flat, expected_pack(tensors, scale, torch.float32))
        targets = [torch.empty_like(t) for t in tensors]
        unpack(flat, targets, scale=1 / scale)
        for t, u in zip(tensors, targets):
            assert torch.equal(t, u)  # scaling by powers of two is exact


# ---- bad input: clear errors, raised before anything is written ----------------------

def test_errors(impl):
    ok = [torch.ones(3), torch.ones(2)]
    with pytest.raises(TypeError, match="list or tuple of tensors"):
        pack(torch.ones(3))
    with pytest.raises(TypeError, match=r"tensors\[1\] is a int"):
        pack([torch.ones(1), 3])
    with pytest.raises(TypeError, match=r"tensors\[0\] is torch.float64"):
        pack([torch.ones(2, dtype=torch.float64)])
    with pytest.raises(TypeError, match=r"tensors\[0\] is torch.int32"):
        unpack(torch.ones(2), [torch.ones(2, dtype=torch.int32)])
    with pytest.raises(TypeError, match="dtype=torch.float64 is not supported"):
        pack(ok, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"tensors\[1\] is on meta, expected cpu"):
        pack([torch.ones(2), torch.ones(2, device="meta")])
    with pytest.raises(ValueError, match="mix dtypes"):
        pack([torch.ones(2), torch.ones(2, dtype=torch.float16)])
    with pytest.raises(ValueError, match="out holds 4 elements but the tensors need 5"):
        pack(ok, torch.empty(4))
    with pytest.raises(ValueError, match="1-D contiguous"):
        pack(ok, torch.empty(2, 5))
    with pytest.raises(ValueError, match="1-D contiguous"):
        pack(ok, torch.empty(10)[::2])
    with pytest.raises(ValueError, match="dtype=torch.float16 but out is torch.float32"):
        pack(ok, torch.empty(5), dtype=torch.float16)
    with pytest.raises(ValueError, match="no tensors and no out"):
        pack([])
    with pytest.raises(TypeError, match="scale must be a number"):
        pack(ok, scale="2")
    with pytest.raises(ValueError, match="flat holds 4 elements"):
        unpack(torch.empty(4), ok)
    with pytest.raises(ValueError, match="share memory"):
        unpack(torch.empty(12), [torch.ones(3, 1).expand(3, 4)])
    with pytest.raises(ValueError, match="more than 4"):
        pack([torch.ones(2, 2, 2, 2, 2)[:, :, :, :, :1].permute(4, 3, 2, 1, 0)
              .expand(3, 2, 2, 2, 2)])


def test_an_error_leaves_out_and_targets_untouched(impl):
    out = torch.zeros(6)
    with pytest.raises(TypeError):
        pack([torch.ones(3), torch.ones(3, dtype=torch.int64)], out)
    assert out.eq(0).all()
    targets = [torch.zeros(3), torch.ones(3, 1).expand(3, 2)]
    with pytest.raises(ValueError):
        unpack(torch.ones(9), targets)
    assert targets[0].eq(0).all()


def test_empty_inputs(impl):
    out = torch.full((3,), 5.0)
    assert pack([], out) is out and out.eq(5.0).all()
    assert pack([torch.empty(0)]).shape == (0,)
    unpack(torch.empty(0), [torch.empty(0, 3)])
