"""spmd.kernels against torch on the same GPU, in the same run, as GB/s and as a share of
a device-to-device copy measured on that card.

    python benchmarks/kernel_speed.py [--layers 2] [--dim 1024] [--tiny 10000]
    python benchmarks/kernel_speed.py --device cpu --layers 1 --dim 64 --tiny 200   # checks the
                                                                # script; figures mean nothing
    python benchmarks/kernel_speed.py --host [--device cpu]   # host work per pack launch

``--host`` times what a pack launch costs the host before any kernel starts, for buckets
of 10 to 10,000 tiny tensors: the launch plan built from every tensor (``pack``'s path),
against a planned bucket's kept ``BucketTables`` (one address per tensor looked at). On
CPU that is all it times (the figures are the host's, whatever the device); on CUDA it
adds the whole ``pack`` call, launch included, each way (host time: a loop of calls, one
synchronize at its end).

Workloads (gradient buckets):

- ``transformer``: the parameters of ``--layers`` transformer layers of width ``--dim``
  (qkv, out, two MLP matrices, their biases, two layer norms), float32: every tensor is
  16-byte aligned in memory and in the bucket, the usual case.
- ``unaligned``: the same with a 1-element tensor in front, so every tensor sits at an odd
  offset in the bucket and the kernels take their unaligned path.
- ``tiny``: ``--tiny`` tensors of 1 to 64 elements, where launches, not bytes, cost.

Bytes (each element read or written once; itemsize of its tensor):

- copy: ``2 * n * 4`` (``dst.copy_(src)`` of ``n`` float32 of the bucket's total size)
- pack to float32: ``n * (4 + 4)``; pack with scale to bfloat16: ``n * (4 + 2)``
- unpack bfloat16, scaled, accumulating into float32: ``n * (2 + 4 + 4)``
- reduce_chunks of 8 received chunks (``n / 8`` elements each) to float32, x1/8:
  ``n * 2 + n / 8 * 4`` from bfloat16, ``n * 1 + n / 8 * 4`` from float8_e4m3fn (plus 32
  bytes of scales)
- sgd_step with momentum: ``n * (4 + 2*4 + 2*4)`` (gradient, parameter, buffer)
- adamw_step: ``n * (4 + 2*4 + 2*4 + 2*4)`` (gradient, parameter, two moments)

Peers, given the same buffers: ``torch.cat`` (with ``torch._foreach_mul`` before it when
scaling), ``torch._foreach_copy_``/``_foreach_add_``, and ``torch.optim`` SGD/AdamW with
``foreach=True`` and ``fused=True`` whose ``.grad`` are views into the bucket (as DDP's
``gradient_as_bucket_view``), so they read the same gradient bytes; for reduce_chunks
``torch.mean(chunks, 0, dtype=torch.float32)`` (one kernel) and, for float8, the usual
``(q.float() * scales[:, None]).sum(0).mul_(1 / 8)``. Times are medians of
``triton.testing.do_bench`` (L2 flushed before each call); "copy %" is our GB/s over the
copy's. Aims (issue "Kernels"): pack/unpack at least 85% of the copy, adamw_step faster
than ``fused=True``.
"""

from __future__ import annotations

import sys
import time

import torch

import harness


def transformer(layers: int, dim: int) -> list[tuple[int, ...]]:
    one = [(3 * dim, dim), (3 * dim,), (dim, dim), (dim,), (4 * dim, dim), (4 * dim,),
           (dim, 4 * dim), (dim,), (dim,), (dim,), (dim,), (dim,)]
    return one * layers


def tiny(count: int) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(0)
    return [(n,) for n in torch.randint(1, 65, (count,), generator=g).tolist()]


def timer(device: torch.device):
    """Seconds per call of ``fn``: do_bench on CUDA, a plain loop on CPU."""
    if device.type == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=200,
                                                  return_mode="median") * 1e-3

    def cpu(fn):
        fn()
        start, calls = time.perf_counter(), 0
        while time.perf_counter() - start < 0.2:
            fn()
            calls += 1
        return (time.perf_counter() - start) / calls
    return cpu


def workload(shapes, device):
    g = torch.Generator(device=device).manual_seed(1)
    params = [torch.randn(s, device=device, generator=g) for s in shapes]
    total = sum(p.numel() for p in params)
    flat = torch.randn(total, device=device, generator=g)
    views = list(flat.split([p.numel() for p in params]))
    return params, flat, [v.view(p.shape) for v, p in zip(views, params)], total


def measure(name: str, shapes, device, bench) -> list[tuple]:
    """Rows (kernel, workload, bytes, {label: seconds}) for one workload."""
    from spmd import kernels

    params, flat, grads, n = workload(shapes, device)
    rows = []
    bf16 = torch.empty(n, dtype=torch.bfloat16, device=device)
    out32 = torch.empty(n, device=device)
    src = torch.empty(n, device=device)
    rows.append(("copy", name, 2 * n * 4, {"torch copy_": bench(lambda: out32.copy_(src))}))

    rows.append(("pack fp32", name, n * 8, {
        "spmd": bench(lambda: kernels.pack(grads, out32)),
        "torch.cat": bench(lambda: torch.cat([g.reshape(-1) for g in grads], out=out32))}))
    rows.append(("pack x1/8 to bf16", name, n * 6, {
        "spmd": bench(lambda: kernels.pack(grads, bf16, scale=0.125)),
        "foreach_mul+cat": bench(lambda: torch.cat(
            [g.reshape(-1) for g in torch._foreach_mul(grads, 0.125)], out=bf16))}))
    bf16_views = [v.view(p.shape) for v, p in zip(bf16.split([p.numel() for p in params]),
                                                   params)]
    rows.append(("unpack bf16 x1/8 +=", name, n * 10, {
        "spmd": bench(lambda: kernels.unpack(bf16, params, scale=0.125, accumulate=True)),
        "foreach_add_": bench(lambda: torch._foreach_add_(params, bf16_views, alpha=0.125))}))

    p, m = 8, n // 8
    chunks = torch.randn(p, m, device=device).to(torch.bfloat16)
    out_m = torch.empty(m, device=device)
    rows.append(("reduce_chunks 8 bf16", name, p * m * 2 + m * 4, {
        "spmd": bench(lambda: kernels.reduce_chunks(chunks, out_m, scale=1 / p)),
        "torch.mean": bench(lambda: torch.mean(chunks, 0, dtype=torch.float32, out=out_m))}))
    q, scales = kernels.quantize_chunks(chunks.float(), torch.float8_e4m3fn)
    rows.append(("reduce_chunks 8 fp8", name, p * m + m * 4, {
        "spmd": bench(lambda: kernels.reduce_chunks(q, out_m, scales=scales, scale=1 / p)),
        "float+mul+sum": bench(lambda: (q.float() * scales[:, None]).sum(0).mul_(1 / p))}))

    sgd = dict(lr=1e-3, momentum=0.9)
    buffers = [torch.zeros_like(p) for p in params]
    ours = {"spmd": bench(lambda: kernels.sgd_step(params, flat, buffers, **sgd))}
    for flavour in ("foreach", "fused"):
        ours[f"SGD {flavour}"] = bench(_torch_step(torch.optim.SGD, params, grads, flavour, sgd))
    rows.append(("sgd_step momentum", name, n * 20, ours))

    adam = dict(lr=1e-3, weight_decay=1e-2)
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    ours = {"spmd": bench(lambda: kernels.adamw_step(params, flat, m, v, step=10, **adam))}
    for flavour in ("foreach", "fused"):
        ours[f"AdamW {flavour}"] = bench(_torch_step(torch.optim.AdamW, params, grads, flavour,
                                                     adam))
    rows.append(("adamw_step", name, n * 28, ours))
    return rows


def _torch_step(cls, params, grads, flavour, hyper):
    """A zero-argument torch.optim step over copies of ``params`` whose ``.grad`` are the
    bucket views ``grads``; state is created by a first step outside the timing."""
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    for p, g in zip(ps, grads):
        p.grad = g
    opt = cls(ps, **hyper, **{flavour: True})
    opt.step()
    return opt.step


def host_loop(fn, device: torch.device, seconds: float = 0.3) -> float:
    """Host seconds per call of ``fn``, the median of 5 rounds of repeated calls."""
    fn()
    rounds = []
    for _ in range(5):
        start, calls = time.perf_counter(), 0
        while time.perf_counter() - start < seconds / 5:
            fn()
            calls += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        rounds.append((time.perf_counter() - start) / calls)
    return sorted(rounds)[2]


def host(device: torch.device, counts=(10, 100, 1000, 10000)) -> None:
    """Print the ``--host`` table (see the module docstring)."""
    from spmd.kernels import packing_triton
    from spmd.kernels.layout import BucketTables
    from spmd.lowering.flat import pack_planned

    print("\n| tensors | plan from every tensor (µs) | kept tables (µs) | ratio |"
          + (" pack, no tables (µs) | pack, kept tables (µs) |" if device.type == "cuda"
             else ""))
    print("|---:|---:|---:|---:|" + ("---:|---:|" if device.type == "cuda" else ""))
    for n in counts:
        g = torch.Generator().manual_seed(n)
        tensors = [torch.randn(s, generator=g).to(device) for s in tiny(n)]
        flat = torch.empty(sum(t.numel() for t in tensors), device=device)
        tables = BucketTables()
        every = host_loop(lambda: packing_triton.host_plan(tensors, flat), device)
        kept = host_loop(lambda: packing_triton.host_plan(tensors, flat, True, tables), device)
        line = f"| {n:,} | {every * 1e6:,.1f} | {kept * 1e6:,.1f} | {every / kept:.1f}x |"
        if device.type == "cuda":
            whole = host_loop(lambda: pack_planned(tensors, 1.0, torch.float32, flat), device)
            ours = host_loop(lambda: pack_planned(tensors, 1.0, torch.float32, flat, tables),
                             device)
            line += f" {whole * 1e6:,.1f} | {ours * 1e6:,.1f} |"
            # the kept plan's result is the bucket itself, bit for bit
            if not torch.equal(flat, torch.cat([t.reshape(-1) for t in tensors])):
                raise SystemExit(f"--host: the pack with kept tables differs ({n} tensors)")
        print(line)


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--host", action="store_true",
                        help="time the host work of a pack launch per number of tensors")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--tiny", type=int, default=10000)
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.host and device.type == "cuda" and not torch.cuda.is_available():
        device = torch.device("cpu")
    if args.host:
        print(f"# host work per pack launch on {device} ({time.strftime('%Y-%m-%d')})")
        host(device)
        return
    if device.type == "cuda" and not torch.cuda.is_available():
        print("benchmarks/kernel_speed.py: no CUDA device here; nothing measured")
        sys.exit(0)
    import triton

    from spmd.kernels import implementation

    bench = timer(device)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"# {card}; torch {torch.__version__}, triton {triton.__version__}; "
          f"spmd.kernels uses {implementation(device)} here; {time.strftime('%Y-%m-%d')}")
    shapes = transformer(args.layers, args.dim)
    rows = []
    for name, workload_shapes in (("transformer", shapes), ("unaligned", [(1,), *shapes]),
                                  ("tiny", tiny(args.tiny))):
        rows += measure(name, workload_shapes, device, bench)
    copy = {name: nbytes / times["torch copy_"] for kernel, name, nbytes, times in rows
            if kernel == "copy"}
    print()
    harness.table(("kernel", "workload", "MiB moved", "spmd µs", "spmd GB/s", "copy %", "peer",
                   "peer µs", "peer GB/s", "spmd speed-up"), "llrrrrlrrr")
    for kernel, name, nbytes, times in rows:
        if kernel == "copy":
            print(f"| copy_ (reference) | {name} | {nbytes / 2**20:,.1f} | "
                  f"{times['torch copy_'] * 1e6:,.1f} | {copy[name] / 1e9:,.1f} | 100 | | | | |")
            continue
        ours = times.pop("spmd")
        for peer, t in times.items():
            print(f"| {kernel} | {name} | {nbytes / 2**20:,.1f} | {ours * 1e6:,.1f} | "
                  f"{nbytes / ours / 1e9:,.1f} | {100 * nbytes / ours / copy[name]:.0f} | "
                  f"{peer} | {t * 1e6:,.1f} | {nbytes / t / 1e9:,.1f} | {t / ours:.2f}x |")


if __name__ == "__main__":
    main()
