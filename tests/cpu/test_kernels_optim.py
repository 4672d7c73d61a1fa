"""sgd_step and adamw_step against torch.optim itself (foreach=False), step for step, on
both paths (the Triton kernels run in Triton's interpreter on CPU).

Tolerances: float32 SGD is bit-exact on both paths, and so is float32 AdamW on the torch
path. Triton's AdamW takes IEEE square roots where torch's CPU kernels use a vectorised
one that is sometimes one ulp off, so its parameters are compared with rtol=1e-6,
atol=1e-7 after several steps (its moments stay bit-exact). bfloat16/float16 parameters:
the two paths agree to one ulp of the dtype, torch.optim (AdamW fused=True, SGD
foreach=False) to a few ulps.
"""

from __future__ import annotations

import pytest
import torch

from spmd.kernels import adamw_step, optim, optim_triton, sgd_step

SHAPES = [(16,), (8, 8), (3, 5), (0,), (), (7,), (1, 1, 3)]  # 2 aligned, 4 not, 1 empty
STEPS = 4
F32_TRITON = dict(rtol=1e-6, atol=1e-7)


@pytest.fixture(params=["torch", "triton"])
def impl(request, monkeypatch):
    monkeypatch.setenv("SPMD_KERNELS", request.param)
    return request.param


@pytest.fixture
def ran(monkeypatch):
    """The implementations that ran, in order: each is wrapped, and still does its work."""
    calls = []

    def recorded(real, label):
        def run(*args, **kw):
            calls.append(label)
            return real(*args, **kw)
        return run

    for module, name, label in ((optim, "sgd_reference", "torch sgd"),
                                (optim, "adamw_reference", "torch adamw"),
                                (optim_triton, "sgd", "triton sgd"),
                                (optim_triton, "adamw", "triton adamw")):
        monkeypatch.setattr(module, name, recorded(getattr(module, name), label))
    return calls


def make(dtype=torch.float32, shapes=SHAPES, seed=0, flat_dtype=torch.float32):
    """Parameters and one flat gradient bucket per step."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    total = sum(p.numel() for p in params)
    flats = [torch.randn(total, generator=g).to(flat_dtype) for _ in range(STEPS)]
    return params, flats


def torch_optim(cls, params, flats, grad_scale=1.0, start=None, **hyper):
    """Run torch.optim on copies of ``params``, gradients read from each flat bucket as the
    kernels read them (float32 times float32 grad_scale). Returns (params, optimizer)."""
    ps = [p.detach().clone().requires_grad_() for p in params]
    opt = cls(ps, **hyper)
    for flat in flats:
        grad = flat.float() * torch.tensor(grad_scale)
        for p, piece in zip(ps, grad.split([p.numel() for p in ps])):
            p.grad = piece.view(p.shape).to(p.dtype)
        opt.step()
    return [p.detach() for p in ps], opt


def assert_same(a, b, **tol):
    for x, y in zip(a, b, strict=True):
        if tol:
            torch.testing.assert_close(x, y, **tol)
        else:
            assert torch.equal(x, y), (x - y).abs().max()


SGD_CASES = [
    dict(lr=0.1),
    dict(lr=0.1, momentum=0.9),
    dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
    dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.1),
    dict(lr=0.1, momentum=0.5, maximize=True),
]


@pytest.mark.parametrize("hyper", SGD_CASES)
@pytest.mark.parametrize("grad_scale, flat_dtype", [(1.0, torch.float32),
                                                    (0.25, torch.bfloat16)])
def test_sgd_matches_torch_optim(impl, hyper, grad_scale, flat_dtype):
    params, flats = make(flat_dtype=flat_dtype)
    expected, opt = torch_optim(torch.optim.SGD, params, flats, grad_scale, foreach=False,
                                **hyper)
    buffers = [None] * len(params)
    for flat in flats:
        before = flat.clone()
        sgd_step(params, flat, buffers, grad_scale=grad_scale, **hyper)
        assert torch.equal(flat, before)  # the bucket is read, never written
    assert_same(params, expected)
    if hyper.get("momentum"):
        assert_same(buffers, [opt.state[p]["momentum_buffer"] for p in opt.param_groups[0]
                              ["params"]])
    else:
        assert buffers == [None] * len(params)


def test_one_launch_per_group(monkeypatch):
    """Groups: aligned or not, and (SGD) whether the momentum buffer is new."""
    monkeypatch.setenv("SPMD_KERNELS", "triton")
    launches = []
    real = optim_triton.launchable

    def spy(kernel, device):
        launch = real(kernel, device)

        class Recorder:
            def __getitem__(self, grid):
                def run(*args, **kw):
                    launches.append((grid[0], kw.get("FIRST"), kw["ALIGNED"]))
                    return launch[grid](*args, **kw)
                return run
        return Recorder()

    monkeypatch.setattr(optim_triton, "launchable", spy)
    params, flats = make()
    buffers = [None] * len(params)
    sgd_step(params, flats[0], buffers, lr=0.1, momentum=0.9)
    assert sorted(launches) == [(2, True, True), (4, True, False)]
    launches.clear()
    buffers[1] = buffers[5] = None
    sgd_step(params, flats[1], buffers, lr=0.1, momentum=0.9)
    assert sorted(launches) == [(1, False, True), (1, True, False), (1, True, True),
                                (3, False, False)]
    launches.clear()
    adamw_step(params, flats[0], *adamw_state(params, False), step=1, lr=0.1)
    assert sorted(launches) == [(2, None, True), (4, None, False)]


def test_sgd_buffer_that_is_none_again_restarts_from_the_gradient(impl):
    params, flats = make()
    hyper = dict(lr=0.1, momentum=0.9, dampening=0.2)
    expected, opt = torch_optim(torch.optim.SGD, params, flats[:2], foreach=False, **hyper)
    ps = opt.param_groups[0]["params"]
    del opt.state[ps[0]]["momentum_buffer"]  # torch.optim now sees None for param 0
    for p, piece in zip(ps, flats[2].split([p.numel() for p in ps])):
        p.grad = piece.view(p.shape).clone()
    opt.step()
    buffers = [None] * len(params)
    for flat in flats[:2]:
        sgd_step(params, flat, buffers, **hyper)
    buffers[0] = None
    sgd_step(params, flats[2], buffers, **hyper)
    assert_same(params, [p.detach() for p in ps])
    assert_same(buffers, [opt.state[p]["momentum_buffer"] for p in ps])


ADAMW_CASES = [
    dict(lr=1e-2),
    dict(lr=1e-2, amsgrad=True, weight_decay=0.0),
    dict(lr=3e-3, betas=(0.3, 0.9), eps=1e-6, weight_decay=0.1, amsgrad=True),
    dict(lr=1e-2, maximize=True, weight_decay=0.05),
]


def adamw_state(params, amsgrad):
    zeros = lambda: [torch.zeros_like(p) for p in params]  # noqa: E731
    return zeros(), zeros(), zeros() if amsgrad else None


@pytest.mark.parametrize("hyper", ADAMW_CASES)
@pytest.mark.parametrize("grad_scale, flat_dtype", [(1.0, torch.float32),
                                                    (0.5, torch.float16)])
def test_adamw_matches_torch_optim(impl, hyper, grad_scale, flat_dtype):
    params, flats = make(flat_dtype=flat_dtype, seed=1)
    expected, opt = torch_optim(torch.optim.AdamW, params, flats, grad_scale, foreach=False,
                                **hyper)
    m, v, vmax = adamw_state(params, hyper.get("amsgrad", False))
    for step, flat in enumerate(flats, 1):
        adamw_step(params, flat, m, v, vmax, step=step, grad_scale=grad_scale, **hyper)
    assert_same(params, expected, **(F32_TRITON if impl == "triton" else {}))
    state = [opt.state[p] for p in opt.param_groups[0]["params"]]
    assert_same(m, [s["exp_avg"] for s in state])
    assert_same(v, [s["exp_avg_sq"] for s in state])
    if vmax is not None:
        assert_same(vmax, [s["max_exp_avg_sq"] for s in state])


@pytest.mark.parametrize("kind, hyper", [("sgd", SGD_CASES[3]), ("sgd", SGD_CASES[4]),
                                         ("adamw", ADAMW_CASES[0]), ("adamw", ADAMW_CASES[-1])])
def test_small_tensors_in_foreach_calls_and_large_ones_in_the_loop(monkeypatch, kind, hyper):
    """The torch path takes float32 tensors of up to ``FOREACH_MAX`` elements in foreach
    calls and larger ones in its loop: with both in one bucket, every tensor still equals
    torch.optim's (foreach=False) bit for bit, step after step (SGD's momentum buffers
    start as None, which the loop takes on the first step)."""
    monkeypatch.setenv("SPMD_KERNELS", "torch")
    limit = optim.FOREACH_MAX
    shapes = [(limit + 1,), (16,), (limit,), (3, 5), (), (2, limit // 2 + 1)]
    params, flats = make(shapes=shapes, seed=4)
    cls = torch.optim.SGD if kind == "sgd" else torch.optim.AdamW
    expected, opt = torch_optim(cls, params, flats, 0.5, foreach=False, **hyper)
    state = [opt.state[p] for p in opt.param_groups[0]["params"]]
    if kind == "sgd":
        buffers = [None] * len(params)
        for flat in flats:
            sgd_step(params, flat, buffers, grad_scale=0.5, **hyper)
        assert_same(buffers, [s["momentum_buffer"] for s in state])
    else:
        m, v, _ = adamw_state(params, False)
        for step, flat in enumerate(flats, 1):
            adamw_step(params, flat, m, v, step=step, grad_scale=0.5, **hyper)
        assert_same(m, [s["exp_avg"] for s in state])
        assert_same(v, [s["exp_avg_sq"] for s in state])
    assert_same(params, expected)


def test_adamw_takes_over_torch_optim_state(impl):
    """Two steps of torch.optim, its state handed to adamw_step for two more, equals four
    steps of torch.optim."""
    params, flats = make(seed=2)
    hyper = dict(lr=1e-2, weight_decay=0.02, amsgrad=True)
    expected, _ = torch_optim(torch.optim.AdamW, params, flats, foreach=False, **hyper)
    halfway, opt = torch_optim(torch.optim.AdamW, params, flats[:2], foreach=False, **hyper)
    state = [opt.state[p] for p in opt.param_groups[0]["params"]]
    m, v, vmax = ([s[k] for s in state] for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"))
    for flat in flats[2:]:
        step = int(state[0]["step"]) + 1
        adamw_step(halfway, flat, m, v, vmax, step=torch.tensor(float(step)), **hyper)
        for s in state:
            s["step"] += 1
    assert_same(halfway, expected, **(F32_TRITON if impl == "triton" else {}))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_agree_across_paths_and_with_torch_optim(monkeypatch, dtype):
    params, flats = make(dtype, seed=3)
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    results = {}
    for impl in ("torch", "triton"):
        monkeypatch.setenv("SPMD_KERNELS", impl)
        ps = [p.clone() for p in params]
        m, v, vmax = adamw_state(ps, True)
        qs = [p.clone() for p in params]
        buffers = [None] * len(qs)
        for step, flat in enumerate(flats, 1):
            adamw_step(ps, flat, m, v, vmax, step=step, lr=1e-2, amsgrad=True)
            sgd_step(qs, flat, buffers, lr=0.1, momentum=0.9, weight_decay=0.01)
        results[impl] = ps + m + v + vmax + qs + buffers
    assert_same(results["torch"], results["triton"], rtol=ulp, atol=1e-5)
    fused_adamw, _ = torch_optim(torch.optim.AdamW, params, flats, fused=True, lr=1e-2,
                                 amsgrad=True)
    # Not fused=True for SGD: torch 2.13's fused CPU SGD on bfloat16 disagrees with its own
    # foreach=False by up to 1.3 on 16-element tensors; the per-operation rounding of
    # foreach=False is within a few ulps of ours.
    fused_sgd, _ = torch_optim(torch.optim.SGD, params, flats, foreach=False, lr=0.1,
                               momentum=0.9, weight_decay=0.01)
    n = len(params)
    assert_same(results["triton"][:n], fused_adamw, rtol=4 * ulp, atol=4 * ulp)
    assert_same(results["triton"][4 * n:5 * n], fused_sgd, rtol=4 * ulp, atol=4 * ulp)


def test_thousands_of_tiny_params(impl):
    g = torch.Generator().manual_seed(4)
    shapes = [(n,) for n in torch.randint(1, 4, (2000,), generator=g).tolist()]
    params, flats = make(shapes=shapes, seed=5)
    hyper = dict(lr=1e-2, amsgrad=True)
    expected, _ = torch_optim(torch.optim.AdamW, params, flats[:1], foreach=False, **hyper)
    adamw_step(params, flats[0], *adamw_state(params, True), step=1, **hyper)
    assert_same(params, expected, **F32_TRITON)


def test_hyperparameters_may_be_one_element_tensors_as_in_torch_optim(impl):
    params, flats = make(seed=6)
    expected, _ = torch_optim(torch.optim.AdamW, params, flats[:1], foreach=False, lr=1e-2,
                              betas=(0.8, 0.99))
    m, v, _ = adamw_state(params, False)
    adamw_step(params, flats[0], m, v, step=1, lr=torch.tensor(1e-2),
               betas=(torch.tensor(0.8), 0.99))
    assert_same(params, expected, **F32_TRITON)


def test_each_setting_runs_its_implementation(impl, ran):
    params, flats = make(shapes=[(4,), (3,)])
    m, v, _ = adamw_state(params, False)
    sgd_step(params, flats[0], None, lr=0.1)
    adamw_step(params, flats[1], m, v, step=1, lr=0.1)
    assert ran == [f"{impl} sgd", f"{impl} adamw"]


def test_empty_param_list_is_a_no_op(impl, ran):
    flat = torch.arange(3.0)
    buffers, m, v = [], [], []
    assert sgd_step([], flat[:0], buffers, lr=0.1, momentum=0.9) is None
    assert adamw_step([], flat, m, v, step=1, lr=0.1) is None
    assert ran == []  # neither implementation was started
    assert torch.equal(flat, torch.arange(3.0)) and buffers == m == v == []
    with pytest.raises(ValueError, match="must be >= 0"):  # but the arguments are checked
        sgd_step([], flat[:0], buffers, lr=-0.1)


# ---- bad input: clear errors, raised before anything is written ----------------------

def test_errors(impl):
    p, flat = [torch.ones(2, 2)], torch.ones(4)
    state = [torch.zeros(2, 2)]
    with pytest.raises(ValueError, match=r"params\[0\].*not contiguous"):
        sgd_step([torch.ones(2, 2).t()], flat, None, lr=0.1)
    with pytest.raises(TypeError, match=r"params\[0\] is torch.float64"):
        sgd_step([torch.ones(4, dtype=torch.float64)], flat, None, lr=0.1)
    with pytest.raises(ValueError, match="flat_grad holds 3 elements but the tensors need 4"):
        sgd_step(p, torch.ones(3), None, lr=0.1)
    with pytest.raises(ValueError, match=r"params\[0\] is on meta"):
        sgd_step([torch.ones(4, device="meta")], flat, None, lr=0.1)
    with pytest.raises(ValueError, match="nesterov"):
        sgd_step(p, flat, [None], lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="lr, momentum and weight_decay must be >= 0"):
        sgd_step(p, flat, None, lr=-1.0)
    with pytest.raises(TypeError, match="momentum_buffers must be a list"):
        sgd_step(p, flat, (None,), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="momentum_buffers has 2 entries for 1 params"):
        sgd_step(p, flat, [None, None], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"momentum_buffers\[0\] has shape \(4,\)"):
        sgd_step(p, flat, [torch.zeros(4)], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="step must be an integer >= 1"):
        adamw_step(p, flat, state, state, step=0, lr=0.1)
    with pytest.raises(ValueError, match="0 <= betas < 1"):
        adamw_step(p, flat, state, state, step=1, lr=0.1, betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="amsgrad=True needs max_exp_avg_sqs"):
        adamw_step(p, flat, state, state, step=1, lr=0.1, amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad=False"):
        adamw_step(p, flat, state, state, state, step=1, lr=0.1)
    with pytest.raises(ValueError, match=r"exp_avg_sqs\[0\].*not contiguous"):
        adamw_step(p, flat, state, [torch.zeros(2, 2).t()], step=1, lr=0.1)
    with pytest.raises(TypeError, match=r"exp_avgs\[0\] is a NoneType"):
        adamw_step(p, flat, [None], state, step=1, lr=0.1)
    with pytest.raises(TypeError, match="lr must be a number"):
        adamw_step(p, flat, state, state, step=1, lr=None)


def test_an_error_leaves_everything_untouched(impl):
    params = [torch.ones(3), torch.ones(2)]
    buffers = [None, torch.zeros(3)]
    with pytest.raises(ValueError):
        sgd_step(params, torch.ones(5), buffers, lr=0.1, momentum=0.9)
    assert buffers[0] is None and all(p.eq(1).all() for p in params)
