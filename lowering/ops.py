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
its implementation lives (``optimizer_step``, ``gradient_of``); :data:`FAKES` and
:data:`IMPLEMENTATIONS` list them all for the emitter and the cost views.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from spmd.lowering import redistribute as table
from spmd.lowering import reduction
from spmd.lowering import ring
from spmd.lowering.flat import pack_planned
from spmd.lowering.specs import (CollectiveSpec, RankSpec, ShardBucketSpec,
                                 ShardSpec, TPSpec, gather_rows, lookup, sending)
from spmd.runtime import collectives

__all__ = ["bucket_all_reduce", "wait", "wait_cast", "all_gather", "reduce_scatter",
           "all_to_all", "local_redistribute", "shard_gather", "shard_reduce",
           "bucket_all_gather", "unpack_gathered", "bucket_reduce_scatter", "tp_param",
           "tp_grad", "place", "vocab_embedding", "vocab_embedding_backward", "Ranked",
           "RANKED", "define", "ring_attention", "ring_attention_backward"]


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
    flat = s.keep("flat", pack_planned(grads, 1.0 / s.size if average else 1.0, dtype, out))
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
    dtype = s.shards[0].gather_dtype
    flat = pack_planned(shards, 1.0, dtype)
    if not s.live:
        held = s.hold(shards, flat.repeat(s.size))
        return held.clone() if s.copy_held and s.shards[0].persistent else held
    from spmd.runtime.collectives import all_gather_into_tensor

    out = flat.new_empty(s.size * flat.numel())
    issued = time.perf_counter()
    if s.copy_held and s.shards[0].persistent:  # the held buffer never leaves: a copy does
        held = s.hold(shards, torch.empty_like(out))
        work = all_gather_into_tensor(held, flat, group=s.group, async_op=True)
        s.started(out, _CopyOnWait(work, held, out), issued)
        return out
    s.started(out, all_gather_into_tensor(out, flat, group=s.group, async_op=True), issued)
    return s.hold(shards, out)


def _unpack_gathered(flat: torch.Tensor, handle: int) -> list[torch.Tensor]:
    """The whole parameters out of a gathered bucket: rank r's rows of parameter i sit at
    ``[r, offset_i : offset_i + n_i]`` of the ``(size, total)`` buffer."""
    s: ShardBucketSpec = lookup(handle)
    return [shard.whole(c) for shard, c in zip(s.shards, s.columns(flat))]


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
    if s.shards[0].all_reduce:
        work = collectives.all_reduce(grid, group=s.group, async_op=True)
        s.started(out, _CopyOnWait(work, grid[s.shards[0].rank()], out), issued)
        return out
    from spmd.runtime.collectives import reduce_scatter_tensor

    s.started(out, reduce_scatter_tensor(out, grid.view(-1), group=s.group, async_op=True),
              issued)
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


# -- ops whose ranks compute differently ------------------------------------------------


def vocab_lookup(rank: int, weight: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Rank ``rank``'s part of ``embedding(whole table, indices)`` from its rows of the
    table (``weight``, rows ``rank * len(weight)`` on): the rows of the indices in its
    range, zeros elsewhere. The ranks' parts add up to the lookup."""
    rows = weight.shape[0]
    local = indices - rank * rows
    inside = (local >= 0) & (local < rows)
    out = torch.nn.functional.embedding(torch.where(inside, local, 0), weight)
    return torch.where(inside.unsqueeze(-1), out, out.new_zeros(()))


def vocab_lookup_backward(rank: int, grad: torch.Tensor, indices: torch.Tensor, rows: int,
                          padding_idx: int) -> torch.Tensor:
    """Rank ``rank``'s rows (``rows`` of them) of the table's gradient: the output
    gradients of the indices in its range, summed per row (the padding row gets none)."""
    local = indices - rank * rows
    inside = (local >= 0) & (local < rows)
    if padding_idx >= 0:
        inside = inside & (indices != padding_idx)
    kept = torch.where(inside.unsqueeze(-1), grad, grad.new_zeros(()))
    return torch.ops.aten.embedding_dense_backward(kept, torch.where(inside, local, 0), rows,
                                                   -1, False)


def _vocab_embedding(weight: torch.Tensor, indices: torch.Tensor, padding_idx: int,
                     handle: int) -> torch.Tensor:
    return vocab_lookup(lookup(handle).rank(), weight, indices)


def _fake_vocab_embedding(weight: torch.Tensor, indices: torch.Tensor, padding_idx: int,
                          handle: int) -> torch.Tensor:
    return weight.new_empty((*indices.shape, weight.shape[1]))


def _vocab_embedding_backward(grad: torch.Tensor, indices: torch.Tensor, num_weights: int,
                              padding_idx: int, handle: int) -> torch.Tensor:
    s: RankSpec = lookup(handle)
    return vocab_lookup_backward(s.rank(), grad, indices, num_weights // s.size, padding_idx)


def _fake_vocab_embedding_backward(grad: torch.Tensor, indices: torch.Tensor,
                                   num_weights: int, padding_idx: int, handle: int
                                   ) -> torch.Tensor:
    s: RankSpec = lookup(handle)
    return grad.new_empty((num_weights // s.size, grad.shape[-1]))


vocab_embedding = define(
    "vocab_embedding(Tensor weight, Tensor indices, int padding_idx, int handle) -> Tensor",
    _vocab_embedding, _fake_vocab_embedding)
vocab_embedding_backward = define(
    "vocab_embedding_backward(Tensor grad, Tensor indices, int num_weights, int padding_idx, "
    "int handle) -> Tensor", _vocab_embedding_backward, _fake_vocab_embedding_backward)


def _ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attn_mask: torch.Tensor | None, is_causal: bool, scale: float | None,
                    lse_float: bool, handle: int) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = ring.ring_forward(query, key, value, is_causal, scale, lookup(handle),
                                 attn_mask)
    return out.to(query.dtype), lse.to(_lse_dtype(query, lse_float))


def _lse_dtype(query: torch.Tensor, lse_float: bool) -> torch.dtype:
    return torch.float32 if lse_float else query.dtype


def _fake_ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attn_mask: torch.Tensor | None, is_causal: bool,
                         scale: float | None, lse_float: bool, handle: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    return (query.new_empty((*query.shape[:-1], value.shape[-1])),
            query.new_empty(query.shape[:-1], dtype=_lse_dtype(query, lse_float)))


def _ring_attention_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, out: torch.Tensor, logsumexp: torch.Tensor,
                             attn_mask: torch.Tensor | None, is_causal: bool,
                             scale: float | None, handle: int
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = ring.ring_backward(grad_out, query, key, value, out, logsumexp, is_causal, scale,
                               lookup(handle), attn_mask)
    return tuple(g.contiguous() for g in grads)  # type: ignore[return-value]


def _fake_ring_attention_backward(grad_out: torch.Tensor, query: torch.Tensor,
                                  key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
                                  logsumexp: torch.Tensor, attn_mask: torch.Tensor | None,
                                  is_causal: bool, scale: float | None, handle: int
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


ring_attention = define(
    "ring_attention(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, "
    "bool is_causal, float? scale, bool lse_float, int handle) -> (Tensor, Tensor)", _ring_attention, _fake_ring_attention)
ring_attention_backward = define(
    "ring_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, "
    "Tensor out, Tensor logsumexp, Tensor? attn_mask, bool is_causal, float? scale, "
    "int handle) -> "
    "(Tensor, Tensor, Tensor)", _ring_attention_backward, _fake_ring_attention_backward)


def _attention_arg(node: Any, name: str, default: Any = None) -> Any:
    """An attention node's argument by its schema name (positional or keyword); the mask
    by either name (``attn_mask``, the meta op's ``attn_bias``)."""
    names = [a.name for a in node.target._schema.arguments]
    if name == "attn_mask" and name not in names:
        name = "attn_bias"
    if name in node.kwargs:
        return node.kwargs[name]
    i = names.index(name)
    return node.args[i] if i < len(node.args) else default


def _ring_args(node: Any) -> tuple:
    val = node.meta["val"]
    lse_float = val[1].dtype == torch.float32 and val[0].dtype != torch.float32
    return (_attention_arg(node, "query"), _attention_arg(node, "key"),
            _attention_arg(node, "value"), _attention_arg(node, "attn_mask"),
            bool(_attention_arg(node, "is_causal", False)), _attention_arg(node, "scale"),
            lse_float)


def _ring_backward_args(node: Any) -> tuple:
    return (*(_attention_arg(node, n) for n in ("grad_out", "query", "key", "value", "out",
                                                "logsumexp", "attn_mask")),
            bool(_attention_arg(node, "is_causal", False)), _attention_arg(node, "scale"))


def _whole_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None, causal: bool, scale: float | None,
                     lse_float: bool, handle: Any = None) -> tuple:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    return out, lse.to(_lse_dtype(q, lse_float))


def _whole_attention_backward(g: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                              mask: torch.Tensor | None, causal: bool, scale: float | None,
                              handle: Any = None) -> tuple:
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        g, q, k, v, out, lse.to(ring._lse_dtype(q, lse)), 0.0, causal, attn_mask=mask,
        scale=scale)


def _ring_local(r: int, size: int, qs: list, ks: list, vs: list, masks: list | None,
                causal: bool, scale: float | None, lse_float: bool, handle: Any = None
                ) -> tuple:
    """Rank ``r``'s part of the whole attention, from every rank's pieces (the mask is
    whole on each)."""
    out, lse = _whole_attention(*(torch.cat(t, dim=2) for t in (qs, ks, vs)),
                                None if masks is None else masks[0], causal, scale,
                                lse_float)
    return out.chunk(size, dim=2)[r], lse.chunk(size, dim=2)[r]


def _ring_backward_local(r: int, size: int, *args: Any) -> tuple:
    tensors = [torch.cat(t, dim=2) for t in args[:6]]
    mask = None if args[6] is None else args[6][0]
    grads = _whole_attention_backward(*tensors, mask, *args[7:9])
    return tuple(g.chunk(size, dim=2)[r] for g in grads)


def _ring_spec(dim: str, size: int, group: Any, strategy: Any) -> Any:
    return ring.RingSpec(dim=dim, size=size, group=group,
                         load_balance=strategy.load_balance.get(dim, True))


# -- loss parallelism: cross-entropy over logits split along the classes ---------------


def _reduce_over(t: torch.Tensor, spec: RankSpec, op: str) -> torch.Tensor:
    """``t`` reduced in place over ``spec``'s group (max or sum); as it is on a simulated
    mesh or inside ``dry_run``."""
    if spec.group is not None and spec.size > 1 and sending():
        from spmd.runtime.reduction import ReduceOp

        collectives.all_reduce(t, ReduceOp.MAX if op == "max" else ReduceOp.SUM,
                               group=spec.group)
    return t


def sharded_log_softmax_local(x: torch.Tensor, dim: int, half_to_float: bool,
                              reduce: Any) -> torch.Tensor:
    """``log_softmax`` along ``dim`` of a tensor split along it, from this rank's piece:
    the row maximum and the sum of exponentials are reduced over the ranks
    (``reduce(t, op)``), never the logits."""
    acc = torch.float32 if half_to_float or x.dtype in (torch.float16, torch.bfloat16) \
        else x.dtype
    xf = x.to(acc)
    top = reduce(xf.amax(dim, keepdim=True).detach().clone(), "max")
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    total = reduce((xf - top).exp().sum(dim, keepdim=True), "sum")
    out = xf - top - total.log()
    return out if half_to_float else out.to(x.dtype)


def sharded_log_softmax_backward_local(grad: torch.Tensor, output: torch.Tensor, dim: int,
                                       input_dtype: torch.dtype, reduce: Any
                                       ) -> torch.Tensor:
    """``log_softmax``'s backward on pieces split along ``dim``: ``grad - exp(output) *
    sum(grad)``, the sum reduced over the ranks."""
    total = reduce(grad.sum(dim, keepdim=True).clone(), "sum")
    return (grad - output.exp() * total).to(input_dtype)


def sharded_nll_local(rank: int, logp: torch.Tensor, target: torch.Tensor, reduction: int,
                      ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s part of ``nll_loss`` over log-probabilities split along the classes
    (its ``logp.shape[1]`` classes from ``rank * logp.shape[1]``): the targets in its range
    picked, the others read as 0, so the ranks' losses add up to the loss; the total
    weight (the targets counted) is every rank's alike."""
    classes = logp.shape[1]
    local = target - rank * classes
    valid = target != ignore_index
    inside = valid & (local >= 0) & (local < classes)
    picked = logp.gather(1, torch.where(inside, local, 0).unsqueeze(1)).squeeze(1)
    picked = torch.where(inside, picked, picked.new_zeros(()))
    total_weight = valid.sum().to(logp.dtype)
    if reduction == 0:
        return -picked, total_weight
    loss = -picked.sum()
    return (loss / total_weight if reduction == 1 else loss), total_weight


def sharded_nll_backward_local(rank: int, grad: torch.Tensor, logp: torch.Tensor,
                               target: torch.Tensor, reduction: int, ignore_index: int,
                               total_weight: torch.Tensor) -> torch.Tensor:
    """Rank ``rank``'s columns of ``nll_loss``'s input gradient: ``-grad`` (over the total
    weight for a mean) at each target in its range, zeros elsewhere."""
    classes = logp.shape[1]
    local = target - rank * classes
    valid = target != ignore_index
    inside = valid & (local >= 0) & (local < classes)
    scale = -grad if reduction == 0 else (-grad / total_weight if reduction == 1 else -grad)
    values = torch.where(inside, scale.expand(target.shape).to(logp.dtype),
                         logp.new_zeros(()))
    out = torch.zeros_like(logp)
    return out.scatter_(1, torch.where(inside, local, 0).unsqueeze(1), values.unsqueeze(1))


def _spec_reduce(handle: int) -> Any:
    spec: RankSpec = lookup(handle)
    return lambda t, op: _reduce_over(t, spec, op)


sharded_log_softmax = define(
    "sharded_log_softmax(Tensor x, int dim, bool half_to_float, int handle) -> Tensor",
    lambda x, dim, half, handle: sharded_log_softmax_local(x, dim, half, _spec_reduce(handle)),
    lambda x, dim, half, handle: x.new_empty(
        x.shape, dtype=torch.float32 if half else x.dtype))
sharded_log_softmax_backward = define(
    "sharded_log_softmax_backward(Tensor grad_output, Tensor output, int dim, "
    "ScalarType input_dtype, int handle) -> Tensor",
    lambda g, o, dim, dtype, handle: sharded_log_softmax_backward_local(
        g, o, dim, dtype, _spec_reduce(handle)),
    lambda g, o, dim, dtype, handle: g.new_empty(g.shape, dtype=dtype))
sharded_nll_loss = define(
    "sharded_nll_loss(Tensor logp, Tensor target, int reduction, int ignore_index, "
    "int handle) -> (Tensor, Tensor)",
    lambda logp, t, red, ig, handle: sharded_nll_local(lookup(handle).rank(), logp, t, red,
                                                       ig),
    lambda logp, t, red, ig, handle: (
        logp.new_empty(t.shape if red == 0 else ()), logp.new_empty(())))
sharded_nll_loss_backward = define(
    "sharded_nll_loss_backward(Tensor grad_output, Tensor logp, Tensor target, "
    "int reduction, int ignore_index, Tensor total_weight, int handle) -> Tensor",
    lambda g, logp, t, red, ig, tw, handle: sharded_nll_backward_local(
        lookup(handle).rank(), g, logp, t, red, ig, tw),
    lambda g, logp, t, red, ig, tw, handle: logp.new_empty(logp.shape))


def _softmax_local(r: int, size: int, xs: list, dim: int, half: bool, h: Any = None) -> Any:
    whole = torch.ops.aten._log_softmax(torch.cat(xs, dim=dim), dim, half)
    return whole.chunk(size, dim=dim)[r]


def _softmax_backward_local(r: int, size: int, gs: list, outs: list, dim: int,
                            dtype: torch.dtype, h: Any = None) -> Any:
    whole = torch.ops.aten._log_softmax_backward_data(torch.cat(gs, dim=dim),
                                                      torch.cat(outs, dim=dim), dim, dtype)
    return whole.chunk(size, dim=dim)[r]


def _weightless(n: Any) -> bool:
    """The meta trace's fused ``spmd::nll`` / ``spmd::nll_backward``: aten's arguments
    without the class weights."""
    return "weight" not in [a.name for a in n.target._schema.arguments]


def _nll_args(n: Any) -> tuple:
    if _weightless(n):
        return (n.args[0], n.args[1], int(n.args[2]), int(n.args[3]))
    args = list(n.args) + [None] * 5
    return (args[0], args[1], int(args[3] if args[3] is not None else
                                  n.kwargs.get("reduction", 1)),
            int(args[4] if args[4] is not None else n.kwargs.get("ignore_index", -100)))


def _nll_backward_args(n: Any) -> tuple:
    a = n.args
    if _weightless(n):
        return (a[0], a[1], a[2], int(a[3]), int(a[4]), a[5])
    return (a[0], a[1], a[2], int(a[4]), int(a[5]), a[6])


@dataclass(frozen=True)
class Ranked:
    """An op whose ranks compute differently, put in place of an aten op by a sharding
    decision (``Decision.ranked``).

    Attributes:
        op: the ``spmd`` op; its last argument is a :class:`RankSpec` handle.
        args: the aten node's arguments -> the op's, without the handle.
        whole: the aten op's meaning on whole tensors, from the op's arguments (what the
            verifier compares with).
        local: ``local(rank, size, *args)``: rank ``rank``'s output from its pieces (the
            verifier runs it for every rank).
        peers: ``local`` takes every rank's pieces (a list per tensor argument): the op
            communicates along the dimension (ring attention).
        spec: ``spec(dim, size, group, strategy)``, the handle's object; None: a
            :class:`RankSpec`.
    """

    op: Any
    args: Any
    whole: Any
    local: Any
    peers: bool = False
    spec: Any = None


RANKED: dict[Any, Ranked] = {
    vocab_embedding: Ranked(
        op=vocab_embedding,
        args=lambda n: (n.args[0], n.args[1], int(n.args[2]) if len(n.args) > 2 else -1),
        whole=lambda w, i, p=-1, h=None: torch.ops.aten.embedding(w, i, p),
        local=lambda r, size, w, i, p=-1, h=None: vocab_lookup(r, w, i)),
    vocab_embedding_backward: Ranked(
        op=vocab_embedding_backward,
        args=lambda n: (n.args[0], n.args[1], int(n.args[2]), int(n.args[3])),
        whole=lambda g, i, n, p, h=None: torch.ops.aten.embedding_dense_backward(
            g, i, n, p, False),
        local=lambda r, size, g, i, n, p, h=None: vocab_lookup_backward(r, g, i, n // size,
                                                                       p)),
    sharded_log_softmax: Ranked(
        op=sharded_log_softmax, args=lambda n: (n.args[0], int(n.args[1]), bool(n.args[2])),
        whole=lambda x, dim, half, h=None: torch.ops.aten._log_softmax(x, dim, half),
        local=_softmax_local, peers=True),
    sharded_log_softmax_backward: Ranked(
        op=sharded_log_softmax_backward,
        args=lambda n: (n.args[0], n.args[1], int(n.args[2]), n.args[3]),
        whole=lambda g, o, dim, dtype, h=None: torch.ops.aten._log_softmax_backward_data(
            g, o, dim, dtype),
        local=_softmax_backward_local, peers=True),
    sharded_nll_loss: Ranked(
        op=sharded_nll_loss, args=_nll_args,
        whole=lambda x, t, red, ig, h=None: torch.ops.aten.nll_loss_forward(x, t, None, red,
                                                                            ig),
        local=lambda r, size, x, t, red, ig, h=None: sharded_nll_local(r, x, t, red, ig)),
    sharded_nll_loss_backward: Ranked(
        op=sharded_nll_loss_backward, args=_nll_backward_args,
        whole=lambda g, x, t, red, ig, tw, h=None: torch.ops.aten.nll_loss_backward(
            g, x, t, None, red, ig, tw),
        local=lambda r, size, g, x, t, red, ig, tw, h=None: sharded_nll_backward_local(
            r, g, x, t, red, ig, tw)),
    ring_attention: Ranked(op=ring_attention, args=_ring_args, whole=_whole_attention,
                           local=_ring_local, peers=True, spec=_ring_spec),
    ring_attention_backward: Ranked(op=ring_attention_backward, args=_ring_backward_args,
                                    whole=_whole_attention_backward,
                                    local=_ring_backward_local, peers=True, spec=_ring_spec),
}

COLLECTIVE_OPS = {"all_reduce": bucket_all_reduce, "all_gather": all_gather,
                  "reduce_scatter": reduce_scatter, "all_to_all": all_to_all}
# the bucketed parameter collectives of sharded strategies
SHARD_OPS = {"all_gather": bucket_all_gather, "reduce_scatter": bucket_reduce_scatter}
WAIT_OPS = (wait, wait_cast)
