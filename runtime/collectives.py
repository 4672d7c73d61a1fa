"""Tensor collectives, with the signatures of ``torch.distributed``.

Each function checks its arguments (raising ``TypeError``/``ValueError`` before anything
is sent), takes the group's next sequence number, and launches the backend's operation
through ``ProcessGroup._launch``, which waits (or returns a ``Work`` with
``async_op=True``) and turns failures into errors naming ranks. Ranks in arguments are
global ranks.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy
import torch
import torch.distributed as _dist

from spmd.runtime import checks, sizecheck
from spmd.runtime.sizecheck import header
from spmd.runtime.groups import resolve_group
from spmd.runtime.process_group import ProcessGroup, Work
from spmd.runtime.reduction import ReduceOp

W = checks.wire

__all__ = [
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "gather",
    "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
    "barrier",
]

_OPTIONS: dict[tuple[type, ReduceOp], Any] = {}


def _options(kind: type, rop: ReduceOp) -> Any:
    """A reusable c10d options object for ``rop`` (the backend copies it per call)."""
    opts = _OPTIONS.get((kind, rop))
    if opts is None:
        opts = kind()
        opts.reduceOp = rop.to_torch()
        _OPTIONS[(kind, rop)] = opts
    return opts


_REDUCE_CODE = {op: i for i, op in enumerate(ReduceOp)}


def _reduce_code(op: Any) -> int:
    return 0 if op is ReduceOp.SUM else _REDUCE_CODE[ReduceOp.of(op)]


def _reduction(pg: ProcessGroup, op: Any, dtype: torch.dtype, name: str) -> tuple[ReduceOp, bool]:
    """(the op the backend runs, whether to divide by the group size afterwards)."""
    if op is ReduceOp.SUM:  # the hot path: defined for every dtype
        return op, False
    rop = ReduceOp.of(op)
    rop.check_dtype(dtype, name)
    if rop is ReduceOp.AVG and pg.backend != "nccl":
        return ReduceOp.SUM, True
    return rop, False


def _then(*steps: Callable[[], Any] | None) -> Callable[[], None] | None:
    live = [s for s in steps if s is not None]
    if not live:
        return None

    def run() -> None:
        for step in live:
            step()

    return run


def _staged(t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], Any] | None]:
    """A contiguous buffer for an in-place op on ``t`` and the copy back, if one is needed."""
    if t.is_contiguous():
        return t, None
    buf = t.contiguous()
    return buf, lambda: t.copy_(buf)


def _staged_all(ts: list[torch.Tensor]) -> tuple[list[torch.Tensor], Callable[[], None] | None]:
    """:func:`_staged` for each of ``ts``: the buffers and one step that copies all back."""
    staged = [_staged(t) for t in ts]
    return [b for b, _ in staged], _then(*(back for _, back in staged))


# reductions a small call does locally, on every rank alike, from the rows of its size
# check (sizecheck.fused): rank 0's value, then each next rank's, as a ring would
_LOCAL: dict[ReduceOp, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    ReduceOp.SUM: torch.Tensor.add_, ReduceOp.PRODUCT: torch.Tensor.mul_,
    ReduceOp.MIN: lambda acc, x: torch.minimum(acc, x, out=acc),
    ReduceOp.MAX: lambda acc, x: torch.maximum(acc, x, out=acc),
    ReduceOp.BAND: torch.Tensor.bitwise_and_, ReduceOp.BOR: torch.Tensor.bitwise_or_,
    ReduceOp.BXOR: torch.Tensor.bitwise_xor_,
}
# the same in numpy, for the dtypes sizecheck.NUMPY holds (IEEE operations: the same bits)
_LOCAL_NUMPY: dict[ReduceOp, Any] = {
    ReduceOp.SUM: numpy.add, ReduceOp.PRODUCT: numpy.multiply, ReduceOp.MIN: numpy.minimum,
    ReduceOp.MAX: numpy.maximum, ReduceOp.BAND: numpy.bitwise_and,
    ReduceOp.BOR: numpy.bitwise_or, ReduceOp.BXOR: numpy.bitwise_xor,
}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _parts(rows: sizecheck.Rows, like: torch.Tensor, count: int) -> torch.Tensor:
    """Every rank's payload from the size check's rows, ``(size, count)`` of ``like``'s
    dtype (a view: rows are 16-byte aligned)."""
    return rows.payload()[:, :count * like.element_size()].view(like.dtype)


def _reduced(rows: sizecheck.Rows, rop: ReduceOp, divide: bool, out: torch.Tensor,
             start: int = 0) -> None:
    """Elements ``start:start + out.numel()`` of every rank's payload reduced into
    ``out`` in rank order (divided by the group size for an average)."""
    count = out.numel()
    flat = sizecheck.as_array(out)
    if flat is not None:
        parts = [p[start:] for p in rows.arrays(sizecheck.NUMPY[out.dtype], start + count)]
        ufunc = _LOCAL_NUMPY[rop]
        if len(parts) == 2:
            ufunc(parts[0], parts[1], out=flat)
        else:
            numpy.copyto(flat, parts[0])
            for part in parts[1:]:
                ufunc(flat, part, out=flat)
        if divide:
            numpy.divide(flat, rows.size, out=flat)
        return
    parts = _parts(rows, out, start + count)[:, start:]
    acc = torch.empty(count, dtype=out.dtype)
    if len(parts) == 2 and rop is ReduceOp.SUM:
        torch.add(parts[0], parts[1], out=acc)
    else:
        acc.copy_(parts[0])
        step = _LOCAL[rop]
        for part in parts[1:]:
            step(acc, part)
    if divide:
        acc.div_(rows.size)
    out.copy_(acc.view(out.shape))


def all_reduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
               group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Reduce ``tensor`` across the group in place; every rank gets the result."""
    pg = resolve_group(group, "all_reduce")
    if isinstance(tensor, torch.Tensor) and tensor.is_sparse:
        return _sparse_all_reduce(tensor, op, pg, async_op)
    checks.tensor(tensor, "all_reduce", pg)
    rop, divide = _reduction(pg, op, tensor.dtype, "all_reduce")
    describe = lambda: f"{checks.describe(tensor)}, op={ReduceOp.of(op).name}"  # noqa: E731
    fields = header("all_reduce", tensor.numel(), tensor.dtype, -1, _reduce_code(op))
    small = rop in _LOCAL and sizecheck.fits(pg, _nbytes(tensor))
    seq = pg._begin("all_reduce", describe, None if small else fields)
    if pg.join_log is not None:
        pg.join_log[-1].update(shape=tuple(tensor.shape), dtype=tensor.dtype, reduce=op)
    if small:
        def finish(rows: sizecheck.Rows) -> None:
            _reduced(rows, rop, divide, tensor)

        return sizecheck.fused(pg, "all_reduce", seq, fields, tensor, finish, describe,
                               async_op)
    buf, back = _staged(tensor)
    opts = _options(_dist.AllreduceOptions, rop)
    size = pg.size()
    post = _then((lambda: buf.div_(size)) if divide else None, back)
    backend = pg._backend
    return pg._launch("all_reduce", seq, lambda: backend.allreduce([W(buf)], opts), async_op, post)


def _sparse_all_reduce(tensor: torch.Tensor, op: ReduceOp, pg: ProcessGroup,
                       async_op: bool) -> Work | None:
    """A sparse COO ``tensor`` summed (or averaged) in place, as torch's Gloo does it: each
    rank's indices and values are gathered and the sum coalesced, so the result holds the
    union of every rank's indices. Gloo only; SUM and AVG only."""
    rop = ReduceOp.of(op)
    if tensor.layout is not torch.sparse_coo:
        raise TypeError(f"all_reduce: tensor is a {tensor.layout} tensor; sparse tensors must "
                        f"be torch.sparse_coo")
    if pg.backend != "gloo" or not tensor.is_cpu:
        raise ValueError(f"all_reduce: a sparse tensor on {tensor.device} over "
                         f"{pg.backend!r}: only Gloo reduces sparse tensors, on the CPU")
    if rop not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"all_reduce of a sparse tensor takes ReduceOp.SUM or AVG, not "
                         f"{rop.name}")
    if tensor.dtype not in checks.GLOO_DTYPES:
        raise TypeError(f"all_reduce: Gloo cannot move {tensor.dtype} tensors")
    seq = pg._begin("all_reduce", lambda: f"sparse {checks.describe(tensor)}, op={rop.name}",
                    header("all_reduce", -tensor.numel() - 1, tensor.dtype, -1, _reduce_code(rop)))
    if pg.join_log is not None:
        pg.join_log[-1].update(shape=tuple(tensor.shape), dtype=tensor.dtype, reduce=op,
                               sparse_dim=tensor.sparse_dim())
    size = pg.size()
    post = (lambda: tensor.div_(size)) if rop is ReduceOp.AVG else None
    opts = _options(_dist.AllreduceOptions, ReduceOp.SUM)
    backend = pg._backend
    return pg._launch("all_reduce", seq, lambda: backend.allreduce([tensor], opts), async_op,
                      post)


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None,
              async_op: bool = False) -> Work | None:
    """Copy ``tensor`` from global rank ``src`` to every rank of the group."""
    pg = resolve_group(group, "broadcast")
    checks.tensor(tensor, "broadcast", pg)
    root = pg.group_rank(src, "broadcast: src")
    describe = lambda: f"{checks.describe(tensor)}, src={src}"  # noqa: E731
    fields = header("broadcast", tensor.numel(), tensor.dtype, root)
    small = sizecheck.fits(pg, _nbytes(tensor))
    seq = pg._begin("broadcast", describe, None if small else fields)
    if pg.join_log is not None:
        pg.join_log[-1].update(shape=tuple(tensor.shape), dtype=tensor.dtype, src=src)
    if small:
        def finish(rows: sizecheck.Rows) -> None:
            if pg.rank() == root:
                return
            flat = sizecheck.as_array(tensor)
            if flat is not None:
                flat[:] = rows.arrays(sizecheck.NUMPY[tensor.dtype], tensor.numel())[root]
            else:
                tensor.copy_(_parts(rows, tensor, tensor.numel())[root].view(tensor.shape))

        return sizecheck.fused(pg, "broadcast", seq, fields, tensor, finish, describe,
                               async_op)
    buf, back = _staged(tensor)
    opts = _dist.BroadcastOptions()
    opts.rootRank = root
    backend = pg._backend
    return pg._launch("broadcast", seq, lambda: backend.broadcast([W(buf)], opts), async_op, back)


def reduce(tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM,
           group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Reduce ``tensor`` across the group into global rank ``dst``'s copy."""
    pg = resolve_group(group, "reduce")
    checks.tensor(tensor, "reduce", pg)
    root = pg.group_rank(dst, "reduce: dst")
    rop, divide = _reduction(pg, op, tensor.dtype, "reduce")
    seq = pg._begin("reduce", lambda: f"{checks.describe(tensor)}, op={ReduceOp.of(op).name}, "
                                      f"dst={dst}",
                    header("reduce", tensor.numel(), tensor.dtype, root, _reduce_code(op)))
    buf, back = _staged(tensor)
    opts = _dist.ReduceOptions()
    opts.reduceOp = rop.to_torch()
    opts.rootRank = root
    size = pg.size()
    on_root = divide and pg.rank() == root
    post = _then((lambda: buf.div_(size)) if on_root else None, back)
    backend = pg._backend
    return pg._launch("reduce", seq, lambda: backend.reduce([W(buf)], opts), async_op, post)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor,
               group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Every rank's ``tensor`` into ``tensor_list[rank]`` on every rank."""
    pg = resolve_group(group, "all_gather")
    checks.tensor(tensor, "all_gather", pg)
    outputs = checks.tensor_list(tensor_list, "all_gather", pg, "tensor_list", like=tensor)
    checks.contiguous(tensor, "all_gather")
    fields = header("all_gather", tensor.numel(), tensor.dtype)
    small = sizecheck.fits(pg, _nbytes(tensor))
    seq = pg._begin("all_gather", lambda: checks.describe(tensor), None if small else fields)
    if small:
        def finish(rows: sizecheck.Rows) -> None:
            parts = _parts(rows, tensor, tensor.numel())
            for out, part in zip(outputs, parts):
                out.copy_(part.view(out.shape))

        return sizecheck.fused(pg, "all_gather", seq, fields, tensor, finish,
                               lambda: checks.describe(tensor), async_op)
    bufs, post = _staged_all(outputs)
    backend = pg._backend
    return pg._launch("all_gather", seq, lambda: backend.allgather([[W(b) for b in bufs]], [W(tensor)]), async_op,
                      post)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                           group: ProcessGroup | None = None,
                           async_op: bool = False) -> Work | None:
    """Every rank's ``input_tensor`` concatenated (or stacked) into ``output_tensor``."""
    pg = resolve_group(group, "all_gather_into_tensor")
    op = "all_gather_into_tensor"
    checks.tensor(output_tensor, op, pg, "output_tensor")
    checks.tensor(input_tensor, op, pg, "input_tensor")
    checks.same_dtype(output_tensor, input_tensor, op, "output_tensor", "input_tensor")
    if output_tensor.numel() != pg.size() * input_tensor.numel():
        raise ValueError(f"{op}: output_tensor has {output_tensor.numel()} elements; it needs "
                         f"{pg.size()} x {input_tensor.numel()} = "
                         f"{pg.size() * input_tensor.numel()} (group size x input)")
    checks.contiguous(output_tensor, op, "output_tensor")
    checks.contiguous(input_tensor, op, "input_tensor")
    describe = lambda: checks.describe([output_tensor, input_tensor])  # noqa: E731
    fields = header(op, input_tensor.numel(), input_tensor.dtype)
    small = sizecheck.fits(pg, _nbytes(input_tensor))
    seq = pg._begin(op, describe, None if small else fields)
    if small:
        def finish(rows: sizecheck.Rows) -> None:
            flat = sizecheck.as_array(output_tensor)
            if flat is None:
                output_tensor.view(pg.size(), -1).copy_(
                    _parts(rows, input_tensor, input_tensor.numel()))
                return
            count = input_tensor.numel()
            for r, part in enumerate(rows.arrays(sizecheck.NUMPY[output_tensor.dtype], count)):
                flat[r * count:(r + 1) * count] = part

        return sizecheck.fused(pg, op, seq, fields, input_tensor, finish, describe, async_op)
    backend = pg._backend
    return pg._launch(op, seq, lambda: backend._allgather_base(W(output_tensor).view(-1), W(input_tensor).view(-1)),
                      async_op)


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0,
           group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Every rank's ``tensor`` into ``gather_list`` on global rank ``dst`` only."""
    pg = resolve_group(group, "gather")
    checks.tensor(tensor, "gather", pg)
    checks.contiguous(tensor, "gather")
    root = pg.group_rank(dst, "gather: dst")
    if pg.rank() == root:
        if gather_list is None:
            raise ValueError(f"gather: rank {dst} is the destination and must pass gather_list")
        outputs = checks.tensor_list(gather_list, "gather", pg, "gather_list", like=tensor)
    else:
        if gather_list:
            raise ValueError(f"gather: gather_list must be None on ranks other than dst={dst}")
        outputs = []
    seq = pg._begin("gather", lambda: f"{checks.describe(tensor)}, dst={dst}",
                    header("gather", tensor.numel(), tensor.dtype, root))
    opts = _dist.GatherOptions()
    opts.rootRank = root
    bufs, post = _staged_all(outputs)
    lists = [bufs] if outputs else []  # one output list on dst, none elsewhere
    backend = pg._backend
    return pg._launch("gather", seq, lambda: backend.gather([[W(b) for b in bs] for bs in lists], [W(tensor)], opts), async_op, post)


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0,
            group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """``scatter_list[i]`` of global rank ``src`` into ``tensor`` on the group's rank i."""
    pg = resolve_group(group, "scatter")
    checks.tensor(tensor, "scatter", pg)
    root = pg.group_rank(src, "scatter: src")
    if pg.rank() == root:
        if scatter_list is None:
            raise ValueError(f"scatter: rank {src} is the source and must pass scatter_list")
        sources = checks.tensor_list(scatter_list, "scatter", pg, "scatter_list", like=tensor)
        inputs = [[t.contiguous() for t in sources]]
    else:
        if scatter_list:
            raise ValueError(f"scatter: scatter_list must be None on ranks other than src={src}")
        inputs = []
    seq = pg._begin("scatter", lambda: f"{checks.describe(tensor)}, src={src}",
                    header("scatter", tensor.numel(), tensor.dtype, root))
    opts = _dist.ScatterOptions()
    opts.rootRank = root
    buf, back = _staged(tensor)
    backend = pg._backend
    return pg._launch("scatter", seq, lambda: backend.scatter([W(buf)], [[W(t) for t in ts] for ts in inputs], opts), async_op, back)


def _scattered(pg: ProcessGroup, output: torch.Tensor, rop: ReduceOp,
               divide: bool) -> Callable[[torch.Tensor], None]:
    """A small reduce-scatter's result from its rows: the reduction of every rank's
    whole input, this rank's chunk of it."""
    start = pg.rank() * output.numel()

    def finish(rows: sizecheck.Rows) -> None:
        _reduced(rows, rop, divide, output, start)

    return finish


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor],
                   op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
                   async_op: bool = False) -> Work | None:
    """Reduce ``input_list[i]`` across ranks into ``output`` of the group's rank i."""
    pg = resolve_group(group, "reduce_scatter")
    checks.tensor(output, "reduce_scatter", pg, "output")
    inputs = checks.tensor_list(input_list, "reduce_scatter", pg, "input_list", like=output)
    rop, divide = _reduction(pg, op, output.dtype, "reduce_scatter")
    describe = lambda: f"{checks.describe(output)}, op={ReduceOp.of(op).name}"  # noqa: E731
    fields = header("reduce_scatter", output.numel(), output.dtype, -1, _reduce_code(op))
    small = rop in _LOCAL and sizecheck.fits(pg, pg.size() * _nbytes(output))
    seq = pg._begin("reduce_scatter", describe, None if small else fields)
    if small:
        flat = torch.cat([t.reshape(-1) for t in inputs])
        return sizecheck.fused(pg, "reduce_scatter", seq, fields, flat,
                               _scattered(pg, output, rop, divide), describe, async_op)
    opts = _options(_dist.ReduceScatterOptions, rop)
    buf, back = _staged(output)
    ins = [t.contiguous() for t in inputs]
    size = pg.size()
    post = _then((lambda: buf.div_(size)) if divide else None, back)
    backend = pg._backend
    return pg._launch("reduce_scatter", seq, lambda: backend.reduce_scatter([W(buf)], [[W(t) for t in ins]], opts),
                      async_op, post)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor,
                          op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
                          async_op: bool = False) -> Work | None:
    """Reduce ``input`` (group size x ``output``) across ranks; rank i keeps chunk i."""
    name = "reduce_scatter_tensor"
    pg = resolve_group(group, name)
    checks.tensor(output, name, pg, "output")
    checks.tensor(input, name, pg, "input")
    checks.same_dtype(output, input, name)
    if input.numel() != pg.size() * output.numel():
        raise ValueError(f"{name}: input has {input.numel()} elements; it needs {pg.size()} x "
                         f"{output.numel()} = {pg.size() * output.numel()} (group size x output)")
    checks.contiguous(output, name, "output")
    checks.contiguous(input, name, "input")
    rop, divide = _reduction(pg, op, output.dtype, name)
    describe = lambda: f"{checks.describe([output, input])}, op={ReduceOp.of(op).name}"  # noqa: E731
    fields = header(name, output.numel(), output.dtype, -1, _reduce_code(op))
    small = rop in _LOCAL and sizecheck.fits(pg, _nbytes(input))
    seq = pg._begin(name, describe, None if small else fields)
    if small:
        return sizecheck.fused(pg, name, seq, fields, input,
                               _scattered(pg, output, rop, divide), describe, async_op)
    opts = _options(_dist.ReduceScatterOptions, rop)
    size = pg.size()
    post = (lambda: output.div_(size)) if divide else None
    backend = pg._backend
    return pg._launch(name, seq, lambda: backend._reduce_scatter_base(W(output).view(-1), W(input).view(-1), opts),
                      async_op, post)


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor],
               group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """``input_tensor_list[j]`` of rank i lands in ``output_tensor_list[i]`` of rank j."""
    pg = resolve_group(group, "all_to_all")
    outs = checks.tensor_list(output_tensor_list, "all_to_all", pg, "output_tensor_list")
    ins = checks.tensor_list(input_tensor_list, "all_to_all", pg, "input_tensor_list")
    for i, (o, t) in enumerate(zip(outs, ins)):
        if o.dtype != t.dtype:
            raise TypeError(f"all_to_all: output_tensor_list[{i}] is {o.dtype} but "
                            f"input_tensor_list[{i}] is {t.dtype}")
    describe = lambda: f"{checks.describe(outs)} <- {checks.describe(ins)}"  # noqa: E731
    fields = header("all_to_all", -1, outs[0].dtype if outs else None)
    if sizecheck.checking(pg):  # what each rank sends each other, checked pair by pair
        seq = pg._begin("all_to_all", describe)
        sizecheck.exchange_splits(pg, "all_to_all", fields, [t.numel() for t in ins],
                                  [o.numel() for o in outs], describe)
    else:
        seq = pg._begin("all_to_all", describe, fields)
    bufs, post = _staged_all(outs)
    contiguous_ins = [t.contiguous() for t in ins]
    opts = _dist.AllToAllOptions()
    backend = pg._backend
    return pg._launch("all_to_all", seq, lambda: backend.alltoall([W(b) for b in bufs], [W(t) for t in contiguous_ins], opts),
                      async_op, post)


def _splits(splits: Sequence[int] | None, t: torch.Tensor, size: int, name: str) -> list[int]:
    if splits is None or len(splits) == 0:
        if t.dim() == 0 or t.shape[0] % size:
            raise ValueError(f"all_to_all_single: without {name}, dimension 0 of the tensor "
                             f"({tuple(t.shape)}) must divide evenly by the group size {size}")
        return []
    values = list(splits)
    if len(values) != size or any(not isinstance(v, int) or v < 0 for v in values):
        raise ValueError(f"all_to_all_single: {name} must be {size} non-negative ints, got "
                         f"{values}")
    rows = t.shape[0] if t.dim() else 0
    if sum(values) != rows:
        raise ValueError(f"all_to_all_single: {name} sum to {sum(values)} but dimension 0 of the "
                         f"tensor is {rows}")
    return values


def all_to_all_single(output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None,
                      group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Split ``input`` along dim 0, send piece j to rank j, concatenate what arrives."""
    name = "all_to_all_single"
    pg = resolve_group(group, name)
    checks.tensor(output, name, pg, "output")
    checks.tensor(input, name, pg, "input")
    checks.same_dtype(output, input, name)
    out_splits = _splits(output_split_sizes, output, pg.size(), "output_split_sizes")
    in_splits = _splits(input_split_sizes, input, pg.size(), "input_split_sizes")
    checks.contiguous(output, name, "output")
    checks.contiguous(input, name, "input")
    # uneven splits: each rank's own sizes differ by design; the row carries the table of
    # what each sends and expects, checked pair by pair (sizecheck.exchange_splits)
    even = not out_splits and not in_splits
    describe = lambda: f"{checks.describe([output, input])}"  # noqa: E731
    fields = header(name, input.numel() if even else -1, input.dtype)
    if even or not sizecheck.checking(pg):
        seq = pg._begin(name, describe, fields)
    else:
        seq = pg._begin(name, describe)
        size = pg.size()
        width_in = input[0].numel() if input.dim() and input.shape[0] else 0
        width_out = output[0].numel() if output.dim() and output.shape[0] else 0
        sends = [n * width_in for n in in_splits] if in_splits else \
            [input.numel() // size] * size
        receives = [n * width_out for n in out_splits] if out_splits else \
            [output.numel() // size] * size
        sizecheck.exchange_splits(pg, name, fields, sends, receives, describe)
    opts = _dist.AllToAllOptions()
    backend = pg._backend
    return pg._launch(name, seq,
                      lambda: backend.alltoall_base(W(output), W(input), out_splits, in_splits, opts),
                      async_op)


def barrier(group: ProcessGroup | None = None, async_op: bool = False,
            device_ids: list[int] | None = None) -> Work | None:
    """Block until every rank of the group has reached this barrier."""
    pg = resolve_group(group, "barrier")
    if sizecheck.checking(pg):  # the size check's rows meet only when every rank is here
        seq = pg._begin("barrier", lambda: "")
        return sizecheck.fused(pg, "barrier", seq, header("barrier", 0), None, None,
                               lambda: "", async_op)
    seq = pg._begin("barrier", lambda: "", header("barrier", 0))
    opts = _dist.BarrierOptions()
    if device_ids is not None:
        opts.device_ids = list(device_ids)
    backend = pg._backend
    return pg._launch("barrier", seq, lambda: backend.barrier(opts), async_op)
