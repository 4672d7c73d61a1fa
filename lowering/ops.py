"""The collectives of a planned graph, as ``torch.library`` ops in the ``spmd`` namespace.

An async collective is a pair of nodes:

    flat = spmd.bucket_all_reduce([g0, g1, ...], handle)   # pack, start the all-reduce
    ...                                                    # compute overlaps here
    flat = spmd.wait(flat, handle)                         # block where the value is needed

``bucket_all_reduce`` packs its gradients into one flat buffer (scaled by 1/world size
and cast to the wire dtype in the same pass, through ``spmd.kernels.pack``), starts the
all-reduce on it and returns it at once; ``wait`` blocks on that buffer's pending work
and returns the same tensor (an alias, as PyTorch's own ``wait_tensor`` does), and
``wait_cast`` also casts the result back to the gradients' dtype. ``all_gather``,
``reduce_scatter`` and ``all_to_all`` realise the rest of the redistribution table the
same way, along dimension 0 of a staging buffer (the pass around them moves the sharded
dimension there and back); ``local_redistribute`` does the table's local steps. Moving
the ``wait`` is how the scheduler overlaps. Every op has a fake (meta) implementation,
so the graphs stay ordinary fx graphs for make_fx, Dynamo and Inductor.

``handle`` names a :class:`~spmd.lowering.specs.CollectiveSpec` (``spmd.lowering.specs``:
group, scale, wire dtype, the owner's sync switch, the work in flight).

This is the one ``spmd`` op library: every op is made by :func:`define` (schema,
implementation, fake kernel, and the backward where autograd needs one), here or where
its implementation lives (``optimizer_step``, ``gradient_of``; the ops whose ranks compute
differently in ``spmd.lowering.ranked``); :data:`FAKES` and :data:`IMPLEMENTATIONS` list
them all for the emitter and the cost views.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from spmd.lowering import redistribute as table
from spmd.lowering import reduction
from spmd.lowering.flat import pack_planned
from spmd.lowering.specs import (CollectiveSpec, ShardBucketSpec,
                                 ShardSpec, TPSpec, _version_key, gather_rows, lookup,
                                 sending)
from spmd.runtime import collectives

__all__ = ["bucket_all_reduce", "wait", "wait_cast", "all_gather", "reduce_scatter",
           "all_to_all", "local_redistribute", "shard_gather", "shard_reduce",
           "bucket_all_gather", "unpack_gathered", "bucket_reduce_scatter", "tp_param",
           "tp_grad", "place", "define"]


def _dim0(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` with ``dim`` moved to the front, contiguous: the layout collectives send."""
    return (x if dim == 0 else x.movedim(dim, 0)).contiguous()


def _split_front(x: torch.Tensor, dim: int, parts: int) -> torch.Tensor:
    """``x`` cut into ``parts`` along ``dim``, the pieces stacked in front, contiguous."""
    shape = list(x.shape)
    shape[dim:dim + 1] = [parts, shape[dim] // parts]
    return x.reshape(shape).movedim(dim, 0).contiguous()


_lib = torch.library.Library("spmd", "DEF")
FAKES: dict[Any, Any] = {}  # op -> its fake (meta) kernel
IMPLEMENTATIONS: dict[Any, Any] = {}  # op -> its Python implementation (the emitter calls it)


def define(schema: str, impl: Any, fake: Any, backward: Any = None,
           setup_context: Any = None) -> Any:
    """Define ``spmd::<schema>`` with its implementation, fake kernel and (optionally) a
    backward ``backward(ctx, *grads) -> grads``, whose ``ctx.handle`` is the op's second
    argument unless ``setup_context(ctx, inputs, output)`` keeps something else; the op's
    overload. The one way an ``spmd`` op is made."""
    name = schema.split("(", 1)[0]
    _lib.define(schema)
    _lib.impl(name, impl, "CompositeExplicitAutograd")
    # on meta tensors (a model planned on the meta device, its graphs timed there) the
    # fake kernel is the op: shapes only, nothing read or sent
    _lib.impl(name, fake, "Meta")
    torch.library.register_fake(f"spmd::{name}", fake, lib=_lib)
    op = getattr(torch.ops.spmd, name).default
    if backward is not None:
        torch.library.register_autograd(f"spmd::{name}", backward,
                                        setup_context=setup_context or _keep_handle,
                                        lib=_lib)
    FAKES[op], IMPLEMENTATIONS[op] = fake, impl
    return op


def _keep_handle(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.handle = inputs[1]


def _bucket_all_reduce(grads: list[torch.Tensor], handle: int) -> torch.Tensor:
    s: CollectiveSpec = lookup(handle)
    active = s.active
    hook = s.sync.comm_hook if s.sync is not None else None
    # averaged by pre-dividing, then summing; a communication hook gets the sums and
    # averages itself, as torch's DDP hooks do
    average = active and s.step.src.reduce_op == "avg" and hook is None
    dtype = s.wire_dtype or grads[0].dtype
    if hook is not None:
        dtype = grads[0].dtype  # the hook chooses what goes on the wire
    numel = sum(g.numel() for g in grads)
    out = s.buffer("flat", numel, dtype, grads[0].device)
    flat = s.keep("flat", pack_planned(grads, 1.0 / s.size if average else 1.0, dtype, out,
                                       s.tables))
    if active:
        issued = time.perf_counter()
        s.started(flat, reduction.start_bucket(s, flat, grads), issued)
        if s.result_dtype is None and s.sync is not None:
            s.sync.record(s, flat)
    return flat


def _wait(tensor: torch.Tensor, handle: int) -> torch.Tensor:
    lookup(handle).finish(tensor)
    return tensor


def _wait_cast(tensor: torch.Tensor, handle: int) -> torch.Tensor:
    s: CollectiveSpec = lookup(handle)
    s.finish(tensor)
    old = s.buffer("cast", tensor.numel(), s.result_dtype, tensor.device)
    out = s.keep("cast", old.copy_(tensor) if old is not None else tensor.to(s.result_dtype))
    if s.active and s.sync is not None:
        s.sync.record(s, out)
    return out


def _all_gather(x: torch.Tensor, handle: int) -> torch.Tensor:
    s: CollectiveSpec = lookup(handle)
    src = _dim0(x, s.step.src.dim)
    if not s.live:
        return torch.cat([src] * s.size)
    from spmd.runtime.collectives import all_gather_into_tensor

    out = src.new_empty((src.shape[0] * s.size, *src.shape[1:]))
    issued = time.perf_counter()
    s.started(out, all_gather_into_tensor(out, src, group=s.group, async_op=True), issued)
    return out


def _reduce_scatter(x: torch.Tensor, handle: int) -> torch.Tensor:
    s: CollectiveSpec = lookup(handle)
    src = _dim0(x, s.step.dst.dim)
    if not s.live:
        piece = src.chunk(s.size)[0]
        return piece.clone() if s.step.src.reduce_op == "avg" else piece * s.size
    from spmd.runtime.collectives import ReduceOp, reduce_scatter_tensor

    out = src.new_empty((src.shape[0] // s.size, *src.shape[1:]))
    op = ReduceOp.AVG if s.step.src.reduce_op == "avg" else ReduceOp.SUM
    issued = time.perf_counter()
    s.started(out, reduce_scatter_tensor(out, src, op=op, group=s.group, async_op=True), issued)
    return out


def _all_to_all(x: torch.Tensor, handle: int) -> torch.Tensor:
    s: CollectiveSpec = lookup(handle)
    src = _split_front(x, s.step.dst.dim, s.size)
    if not s.live:
        return src.clone()
    from spmd.runtime.collectives import all_to_all_single

    out = torch.empty_like(src)
    issued = time.perf_counter()
    s.started(out, all_to_all_single(out, src, group=s.group, async_op=True), issued)
    return out


def _local_redistribute(x: torch.Tensor, handle: int) -> torch.Tensor:
    s: CollectiveSpec = lookup(handle)
    rank = s.group.rank() if s.live else 0
    kind = s.step.kind
    if kind == "slice":
        return x.chunk(s.size, dim=s.step.dst.dim)[rank].clone()
    if kind == "zero":
        return x.clone() if rank == 0 else torch.zeros_like(x)
    return table.simulate(s.step, [x] * s.size)[0]  # "scale": the same factor on every rank


def _shard_gather(shard: torch.Tensor, handle: int) -> torch.Tensor:
    """The whole parameter from every rank's shard, in ``param_dtype``: one blocking
    all-gather (the eager form; compiled graphs bucket and overlap it instead). A
    persistent spec (zero1/zero2) gathers only when the shard changed since the last."""
    s: ShardSpec = lookup(handle)
    s.check_stored(shard)
    s.eager = True  # planned graphs run bucket_all_gather instead: this read is eager
    if not s.persistent:
        return s.gather(shard, s.gather_dtype)
    columns = s.held_columns(shard)
    if columns is None:  # gathered, and kept where any graph finds it until it changes
        src = shard.detach().to(s.gather_dtype)
        flat = gather_rows(src, s.size, s.group if s.live else None).reshape(-1)
        s.keep(shard, flat, s.local_numel, 0)
        columns = flat.view(s.size, s.local_numel)
    return s.whole(columns).detach()  # a new tensor: autograd's record is its own


def _shard_reduce(grad: torch.Tensor, handle: int) -> torch.Tensor:
    """This rank's shard of the gradient averaged over every rank's batch: one blocking
    reduce-scatter in ``reduce_dtype`` (zero1: an all-reduce of the whole, this rank's rows
    kept; hybrid sharding: then an all-reduce across replicas), in the parameter's
    dtype."""
    s: ShardSpec = lookup(handle)
    wire = s.reduce_dtype or grad.dtype
    padded = s.padded(grad.detach(), wire)
    if not s.live:
        out = s.rank_part(padded, 0).clone()
    elif s.all_reduce:
        whole = padded.mul(1.0 / s.size)
        collectives.all_reduce(whole, group=s.group)
        out = s.rank_part(whole, s.rank()).clone()
    else:
        from spmd.runtime.collectives import reduce_scatter_tensor

        out = padded.new_empty(s.local_shape)
        reduce_scatter_tensor(out, padded.mul(1.0 / s.size), group=s.group)
    if s.replicate_group is not None and s.replicate_size > 1 and sending():
        collectives.all_reduce(out, group=s.replicate_group)
        out.mul_(1.0 / s.replicate_size)
    return out.to(s.dtype)


def _bucket_all_gather(shards: list[torch.Tensor], handle: int) -> torch.Tensor:
    """Start one all-gather of a bucket of shards: each rank's shards packed into one flat
    buffer (cast to ``param_dtype`` on the way); the result is ``size`` such buffers. A
    persistent bucket (zero1/zero2) returns the last result while no shard changed: the
    parameters are gathered once per optimizer step."""
    s: ShardBucketSpec = lookup(handle)
    held = s.held_result(shards)
    if held is not None:
        return held
    if s.regathers and s.live:
        regathered = _regather(s, shards)
        if regathered is not None:
            return regathered
    if s.keeps_parts:
        s.versions = tuple(_version_key(t) for t in shards)
    dtype = s.shards[0].gather_dtype
    flat = pack_planned(shards, 1.0, dtype, tables=s.tables)
    if not s.live:
        held = s.hold(shards, flat.repeat(s.size))
        return held.clone() if s.copy_held and s.shards[0].persistent else held
    out = flat.new_empty(s.size * flat.numel())
    issued = time.perf_counter()
    if s.copy_held and s.shards[0].persistent:  # the held buffer never leaves: a copy does
        held = s.hold(shards, torch.empty_like(out))
        work = _gather(s)(held, flat, group=s.group, async_op=True)
        s.started(out, _CopyOnWait(work, held, out), issued)
        return out
    s.started(out, _gather(s)(out, flat, group=s.group, async_op=True), issued)
    return s.hold(shards, out)


def _gather(s: CollectiveSpec) -> Any:
    """The all-gather a bucket runs: the flat one, or the two-level one across hosts."""
    if s.algorithm == "hierarchical":
        from spmd.runtime.hierarchical import all_gather_hierarchical

        return all_gather_hierarchical
    from spmd.runtime.collectives import all_gather_into_tensor

    return all_gather_into_tensor


def _unpack_gathered(flat: torch.Tensor, handle: int) -> list[torch.Tensor]:
    """The whole parameters out of a gathered bucket: rank r's rows of parameter i sit at
    ``[r, offset_i : offset_i + n_i]`` of the ``(size, total)`` buffer."""
    s: ShardBucketSpec = lookup(handle)
    wholes = [shard.whole(c) for shard, c in zip(s.shards, s.columns(flat))]
    if s.keeps_parts and s.versions:  # reshard_after_forward=N: 1/N kept for backward
        for shard, key, whole in zip(s.shards, s.versions, wholes):
            shard.keep_part(key, whole)
        s.versions = ()
    return wholes


def _regather(s: ShardBucketSpec, shards: list[torch.Tensor]) -> torch.Tensor | None:
    """A backward gather under ``reshard_after_forward=N``: every parameter's part kept by
    the forward, gathered among the N ranks of its group (none for N = 1) and laid out as
    the full gather lays its result out (``(size, total)``, rank r's shards in row r), so
    the unpacking after the wait is the same. None when a part is missing (the forward
    ran elsewhere, or a shard changed since): the caller gathers every rank's shard."""
    parts = [spec.take_part(t) for spec, t in zip(s.shards, shards)]
    if any(p is None for p in parts):
        return None
    first = s.shards[0]
    flat = torch.cat([p.reshape(-1) for p in parts])
    out = flat.new_empty(s.size * s.total)
    issued = time.perf_counter()
    if first.regroup is None:  # N = 1: this rank kept the whole
        gathered, work = flat, None
    else:
        from spmd.runtime.collectives import all_gather_into_tensor

        gathered = flat.new_empty(first.regroup_size * flat.numel())
        work = all_gather_into_tensor(gathered, flat, group=first.regroup, async_op=True)
    s.regathered += 1
    s.started(out, _Regathered(work, gathered, out, s), issued)
    return out


class _Regathered:
    """The wait of :func:`_regather`: the N ranks' parts, once arrived, become each whole
    parameter and are laid out rank by rank into the buffer the graph holds."""

    def __init__(self, work: Any, gathered: torch.Tensor, out: torch.Tensor,
                 spec: ShardBucketSpec) -> None:
        self.work, self.gathered, self.out, self.spec = work, gathered, out, spec

    def wait(self) -> bool:
        if self.gathered is None:
            return True
        if self.work is not None:
            self.work.wait()
        s = self.spec
        n = s.shards[0].regroup_size
        grid = self.gathered.view(n, -1)
        at = 0
        for shard, target in zip(s.shards, s.columns(self.out)):
            numel = shard.part_rows * (shard.local_numel // shard.rows)
            whole = shard.whole_from_parts(grid[:, at:at + numel])
            target.copy_(shard.padded(whole, whole.dtype).reshape(s.size, -1))
            at += numel
        self.gathered = None
        return True

    def get_future(self) -> Any:
        raise RuntimeError("no future: the layout is made at the wait")


def _bucket_reduce_scatter(grads: list[torch.Tensor], handle: int) -> torch.Tensor:
    """Start one reduce-scatter of a bucket of gradients: each laid out so rank r's rows
    of every parameter are contiguous (``(size, total)``), padded, pre-divided by the
    number of ranks and cast to the wire dtype in the same copy. zero1 all-reduces the
    whole grid instead and keeps this rank's row when waited on."""
    s: ShardBucketSpec = lookup(handle)
    wire = s.wire_dtype or grads[0].dtype
    if not s.live:  # every rank is taken to hold these gradients: the average is them
        pieces = [sh.rank_part(sh.padded(g, wire), 0).reshape(-1)
                  for sh, g in zip(s.shards, grads)]
        return torch.cat(pieces)
    grid = torch.empty((s.size, s.total), dtype=wire, device=grads[0].device)
    for shard, g, c in zip(s.shards, grads, s.columns(grid)):
        c.copy_(shard.padded(g, g.dtype).reshape(s.size, -1))
    grid.mul_(1.0 / s.size)
    out = grid.new_empty(s.total)
    issued = time.perf_counter()
    two_level = s.algorithm == "hierarchical"
    if s.shards[0].all_reduce:
        if two_level:
            from spmd.runtime.hierarchical import all_reduce_hierarchical as reduce
        else:
            reduce = collectives.all_reduce
        work = reduce(grid, group=s.group, async_op=True)
        s.started(out, _CopyOnWait(work, grid[s.shards[0].rank()], out), issued)
        return out
    if two_level:
        from spmd.runtime.hierarchical import reduce_scatter_hierarchical as scatter
    else:
        from spmd.runtime.collectives import reduce_scatter_tensor as scatter
    work = scatter(out, grid.view(-1), group=s.group, async_op=True)
    first = s.shards[0]
    if first.replicate_group is not None and first.replicate_size > 1:
        # hybrid sharding: average across the replicas as soon as the shard is reduced,
        # overlapping the rest of the backward, instead of blocking at the wait
        from spmd.runtime.hierarchical import then_all_reduce

        work = then_all_reduce(work, out, first.replicate_group,
                               scale=1.0 / first.replicate_size)
        s.chained = True
    s.started(out, work, issued)
    return out


class _CopyOnWait:
    """A collective into ``src`` whose wait copies ``src`` into ``out`` (the tensor the
    graph holds) and drops ``src``: zero1's reduce-scatter by all-reduce keeps this
    rank's row of the grid, a held gather hands out a copy."""

    def __init__(self, work: Any, src: torch.Tensor, out: torch.Tensor) -> None:
        self.work, self.src, self.out = work, src, out

    def wait(self) -> bool:
        self.work.wait()
        if self.src is not None:
            self.out.copy_(self.src)
            self.src = None
        return True

    def get_future(self) -> Any:
        raise RuntimeError("no future: the copy is made at the wait")


def _tp_param(local: torch.Tensor, handle: int) -> torch.Tensor:
    """The whole parameter from its tensor-parallel pieces (eager: a blocking all-gather
    per sharded dimension; planned graphs keep the pieces instead)."""
    return lookup(handle).whole(local)


def _tp_grad(grad: torch.Tensor, handle: int) -> torch.Tensor:
    """This rank's piece of the whole parameter's gradient. Eagerly every rank of a
    tensor-parallel dimension computed the same whole gradient (they see the same batch),
    so the piece is a slice."""
    return lookup(handle).piece(grad.detach()).clone()


def _place(x: torch.Tensor, handle: int) -> torch.Tensor:
    """An activation placed where its ``PlaceSpec`` says. Eagerly every rank holds
    the whole value, so this is the value itself (a copy: an op's output may not alias
    its input); a planned graph keeps the piece instead (``tensor_parallel``)."""
    return x.clone()


def _fake_place(x: torch.Tensor, handle: int) -> torch.Tensor:
    lookup(handle)  # a graph that outlived its model fails here, naming why
    return torch.empty_like(x)


def _fake_tp_param(local: torch.Tensor, handle: int) -> torch.Tensor:
    s: TPSpec = lookup(handle)
    return local.new_empty(s.shape)


def _fake_tp_grad(grad: torch.Tensor, handle: int) -> torch.Tensor:
    s: TPSpec = lookup(handle)
    return grad.new_empty(s.local_shape)


def _fake_shard_gather(shard: torch.Tensor, handle: int) -> torch.Tensor:
    s: ShardSpec = lookup(handle)
    s.check_stored(shard)
    return shard.new_empty(s.shape, dtype=s.gather_dtype)


def _fake_shard_reduce(grad: torch.Tensor, handle: int) -> torch.Tensor:
    s: ShardSpec = lookup(handle)
    return grad.new_empty(s.local_shape, dtype=s.dtype)


def _fake_bucket_all_gather(shards: list[torch.Tensor], handle: int) -> torch.Tensor:
    s: ShardBucketSpec = lookup(handle)
    return shards[0].new_empty((s.size * s.total,), dtype=s.shards[0].gather_dtype)


def _fake_unpack_gathered(flat: torch.Tensor, handle: int) -> list[torch.Tensor]:
    s: ShardBucketSpec = lookup(handle)
    return [flat.new_empty(sh.shape) for sh in s.shards]


def _fake_bucket_reduce_scatter(grads: list[torch.Tensor], handle: int) -> torch.Tensor:
    s: ShardBucketSpec = lookup(handle)
    return grads[0].new_empty((s.total,), dtype=s.wire_dtype or grads[0].dtype)


def _fake_bucket_all_reduce(grads: list[torch.Tensor], handle: int) -> torch.Tensor:
    s: CollectiveSpec = lookup(handle)
    numel = sum(g.numel() for g in grads)
    return grads[0].new_empty((numel,), dtype=s.wire_dtype or grads[0].dtype)


def _fake_wait(tensor: torch.Tensor, handle: int) -> torch.Tensor:
    return tensor


def _fake_wait_cast(tensor: torch.Tensor, handle: int) -> torch.Tensor:
    return tensor.new_empty(tensor.shape, dtype=lookup(handle).result_dtype)


def _fake_all_gather(x: torch.Tensor, handle: int) -> torch.Tensor:
    s: CollectiveSpec = lookup(handle)
    src = x.movedim(s.step.src.dim, 0)
    return x.new_empty((src.shape[0] * s.size, *src.shape[1:]))


def _fake_reduce_scatter(x: torch.Tensor, handle: int) -> torch.Tensor:
    s: CollectiveSpec = lookup(handle)
    src = x.movedim(s.step.dst.dim, 0)
    return x.new_empty((src.shape[0] // s.size, *src.shape[1:]))


def _fake_all_to_all(x: torch.Tensor, handle: int) -> torch.Tensor:
    s: CollectiveSpec = lookup(handle)
    shape = list(x.shape)
    dim = s.step.dst.dim
    shape[dim:dim + 1] = [shape[dim] // s.size]
    return x.new_empty((s.size, *shape))


def _fake_local_redistribute(x: torch.Tensor, handle: int) -> torch.Tensor:
    s: CollectiveSpec = lookup(handle)
    if s.step.kind == "slice":
        return x.chunk(s.size, dim=s.step.dst.dim)[0].clone()
    return torch.empty_like(x)


def _gather_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    # a sharded parameter's gradient leaves its gather as the reduce-scatter of its
    # gradient: autograd (eager) and AOTAutograd (compiled) both see the pair
    return shard_reduce(grad, ctx.handle), None


def _param_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return tp_grad(grad, ctx.handle), None


def _place_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    # an activation's gradient lives where the activation does (Megatron-SP reduce-
    # scatters a row-parallel layer's input gradient into the sequence shards)
    return place(grad, ctx.handle), None


bucket_all_reduce = define("bucket_all_reduce(Tensor[] grads, int handle) -> Tensor",
                           _bucket_all_reduce, _fake_bucket_all_reduce)
wait = define("wait(Tensor(a) tensor, int handle) -> Tensor(a)", _wait, _fake_wait)
wait_cast = define("wait_cast(Tensor tensor, int handle) -> Tensor", _wait_cast,
                   _fake_wait_cast)
all_gather = define("all_gather(Tensor x, int handle) -> Tensor", _all_gather,
                    _fake_all_gather)
reduce_scatter = define("reduce_scatter(Tensor x, int handle) -> Tensor", _reduce_scatter,
                        _fake_reduce_scatter)
all_to_all = define("all_to_all(Tensor x, int handle) -> Tensor", _all_to_all,
                    _fake_all_to_all)
local_redistribute = define("local_redistribute(Tensor x, int handle) -> Tensor",
                            _local_redistribute, _fake_local_redistribute)
shard_reduce = define("shard_reduce(Tensor grad, int handle) -> Tensor", _shard_reduce,
                      _fake_shard_reduce)
shard_gather = define("shard_gather(Tensor shard, int handle) -> Tensor", _shard_gather,
                      _fake_shard_gather, backward=_gather_backward)
bucket_all_gather = define("bucket_all_gather(Tensor[] shards, int handle) -> Tensor",
                           _bucket_all_gather, _fake_bucket_all_gather)
unpack_gathered = define("unpack_gathered(Tensor flat, int handle) -> Tensor[]",
                         _unpack_gathered, _fake_unpack_gathered)
bucket_reduce_scatter = define("bucket_reduce_scatter(Tensor[] grads, int handle) -> Tensor",
                               _bucket_reduce_scatter, _fake_bucket_reduce_scatter)
tp_grad = define("tp_grad(Tensor grad, int handle) -> Tensor", _tp_grad, _fake_tp_grad)
tp_param = define("tp_param(Tensor local, int handle) -> Tensor", _tp_param, _fake_tp_param,
                  backward=_param_backward)
place = define("place(Tensor x, int handle) -> Tensor", _place, _fake_place,
               backward=_place_backward)


COLLECTIVE_OPS = {"all_reduce": bucket_all_reduce, "all_gather": all_gather,
                  "reduce_scatter": reduce_scatter, "all_to_all": all_to_all}
# the bucketed parameter collectives of sharded strategies
SHARD_OPS = {"all_gather": bucket_all_gather, "reduce_scatter": bucket_reduce_scatter}
WAIT_OPS = (wait, wait_cast)
