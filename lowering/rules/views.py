"""Views and layout: ``view``/``reshape``, ``transpose``/``t``/``permute``, ``expand``,
``unsqueeze``/``squeeze``, ``slice``/``select`` and their backward, ``split``,
``cat``/``stack``, ``constant_pad_nd``, ``view_as_complex``/``view_as_real``.

A sharded dimension survives a reshape when it is the outermost dimension (of size > 1)
of the group of dimensions merged or split with it, and the dimension it becomes there
divides: chunks of the outermost dimension of a row-major block are contiguous ranges of
the whole block, the same ranges as chunks of the dimension it becomes. Cutting or
joining along a sharded dimension needs the whole tensor. ``Partial`` values pass through
every view (a view of a sum is the sum of the views).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch.fx as fx

from spmd.lowering.placements import Partial, Placement, Replicate, Shard, StridedShard
from spmd.lowering.rules.registry import (Decision, norm_dim, op, outputs_of, register,
                                          replicate_all, shape, tensor_args)

__all__ = ["reshape_map"]


def reshape_map(src: Sequence[int], dst: Sequence[int], dim: int, size: int) -> int | None:
    """The dimension of ``dst`` that sharded dimension ``dim`` of ``src`` becomes under a
    reshape, or None where the shards are not contiguous pieces of one dimension there.

    Chunk r of ``src``'s dimension ``dim`` is, for each index of the dimensions before
    it, the r-th of ``size`` equal contiguous ranges of the elements from there on. A
    dimension ``e`` of ``dst`` with the same number of elements before it (the same
    prefix product) and a size ``size`` divides has exactly the same chunks.
    """
    if math.prod(src) != math.prod(dst):
        return None
    before = math.prod(src[:dim])
    for e in range(len(dst)):
        if math.prod(dst[:e]) == before and dst[e] > 1 and dst[e] % size == 0:
            return e
    return None


def _whole(node: fx.Node, inputs: tuple[Placement, ...], why: str) -> list[Decision]:
    return [replicate_all(node, why)]


def strided_map(src: Sequence[int], dst: Sequence[int], dim: int, size: int
                ) -> tuple[int, int] | None:
    """Where sharded dimension ``dim`` of ``src`` goes when a reshape merges it with
    dimensions in front of it: ``(e, split)`` for ``StridedShard(e, split)`` of ``dst``
    (dimension ``e`` read as ``split`` blocks, one per index merged in front, each
    holding the whole of ``dim`` and split as it is), or None.

    An element at index ``b`` of the ``before`` indices in front of ``dim``, ``s`` along
    it and ``t`` of the ``T`` after it sits at ``(b * S + s) * T + t``. With ``L`` the
    product of ``dst``'s dimensions before ``e`` dividing ``before`` and ``P`` the product
    of those after it dividing the block ``S * T``, dimension ``e`` holds
    ``split = before / L`` blocks of ``S * T / P``, ``s`` outermost in each: rank r's
    ``s`` are one contiguous range of every block where ``P`` divides a rank's part of
    the block (torch's attention merging the batch with the heads of a split
    embedding, ``[S, B, E] -> [S, B * H, E / H]``, is such a merge)."""
    if math.prod(src) != math.prod(dst) or src[dim] % size:
        return None
    before = math.prod(src[:dim])
    block = src[dim] * math.prod(src[dim + 1:])
    for e in range(len(dst)):
        lead, after = math.prod(dst[:e]), math.prod(dst[e + 1:])
        if before % lead or block % after or (block // size) % after:
            continue
        split = before // lead
        if split > 1 and dst[e] == split * (block // after):
            return e, split
    return None


def unstride_map(src: Sequence[int], dst: Sequence[int], p: StridedShard, size: int
                 ) -> Placement | None:
    """Where ``StridedShard(d, k)`` of ``src`` goes under a reshape: ``Shard(e)`` where the
    blocks are split back out in front of a dimension ``e`` that divides; the same
    ``StridedShard`` on dimension ``e`` where ``d`` is untouched, merged with the
    dimensions after it, or split from some of them so that each rank's part of a block
    stays whole indices of ``e`` (an MoE layer's tokens of a split sequence repeated for
    their ``k`` choices, ``[T, k, H] -> [T * k, H]``, and back); else None."""
    if math.prod(src) != math.prod(dst):
        return None
    d, k = p.dim, p.split
    before = math.prod(src[:d])
    rest = math.prod(src[d:]) // k
    # one rank's contiguous part of each block, in elements of dimension d and after it
    part = src[d] // (k * size) * math.prod(src[d + 1:]) if src[d] % (k * size) == 0 else 0
    for e in range(len(dst)):
        if (math.prod(dst[:e]) == before * k and math.prod(dst[e:]) == rest and dst[e] > 1
                and dst[e] % size == 0):
            return Shard(e)
    for e in range(len(dst)):
        inner = math.prod(dst[e + 1:])
        if (math.prod(dst[:e]) == before and part and part % inner == 0
                and dst[e] * inner == src[d] * math.prod(src[d + 1:])):
            return StridedShard(e, k)
    return None


# merges: its StridedShard is context parallelism's
@register(op("view.default"), op("_unsafe_view.default"), op("reshape.default"), strided=True,
          merges=True)
def view(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    p = inputs[0]
    src, dst = shape(tensor_args(node)[0]), shape(node)
    if isinstance(p, StridedShard):
        out = unstride_map(src, dst, p, size)
        if out is None:
            return _whole(node, inputs, f"reshape {list(src)} -> {list(dst)} splits the "
                                        f"blocks of {p!r}")
        return [Decision(output=out, reason=f"{p!r} becomes {out!r}")]
    if not isinstance(p, Shard):
        return [Decision(output=p, reason="a view of a whole or partial value")]
    mapped = reshape_map(src, dst, p.dim, size)
    if mapped is None:
        strided = strided_map(src, dst, p.dim, size)
        if strided is not None:
            e, split = strided
            return [Decision(output=StridedShard(e, split),
                             reason=f"dimension {p.dim} merged with the {split} indices in "
                                    f"front of it: each block of {e} split alike"),
                    replicate_all(node, f"reshape {list(src)} -> {list(dst)} merges sharded "
                                        f"dimension {p.dim} with those in front: gathered")]
        return _whole(node, inputs, f"reshape {list(src)} -> {list(dst)} splits the pieces "
                                    f"of sharded dimension {p.dim}")
    return [Decision(output=Shard(mapped), reason=f"dimension {p.dim} becomes {mapped}")]




@register(op("t.default"), op("transpose.int"), op("permute.default"), strided=True)
def transpose(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    (p,) = inputs
    ndim = len(shape(node))
    if not isinstance(p, (Shard, StridedShard)):
        return [Decision(output=p, reason="a view of a whole or partial value")]
    if node.target is op("permute.default"):
        order = [norm_dim(d, ndim) for d in node.args[1]]
        dim = order.index(p.dim)
    else:
        if node.target is op("t.default"):
            d0, d1 = (0, 1) if ndim == 2 else (0, 0)
        else:
            d0, d1 = (norm_dim(d, ndim) for d in node.args[1:3])
        dim = d1 if p.dim == d0 else d0 if p.dim == d1 else p.dim
    moved = StridedShard(dim, p.split) if isinstance(p, StridedShard) else Shard(dim)
    return [Decision(output=moved, reason=f"dimension {p.dim} moves to {dim}")]




def _moved(p: Shard | StridedShard, dim: int) -> Placement:
    """``p`` on dimension ``dim`` instead (a ``StridedShard`` keeps its blocks)."""
    return StridedShard(dim, p.split) if isinstance(p, StridedShard) else Shard(dim)


@register(op("expand.default"), strided=True)
def expand(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    (p,) = inputs
    if not isinstance(p, (Shard, StridedShard)):
        return [Decision(output=p, reason="a view of a whole or partial value")]
    src, dst = shape(tensor_args(node)[0]), shape(node)
    od = p.dim + len(dst) - len(src)
    if src[p.dim] != dst[od]:
        return _whole(node, inputs, "expanded along its sharded dimension")
    return [Decision(output=_moved(p, od), reason="a broadcast view keeps the shards")]


def _squeezes(node: fx.Node, dim: int, ndim: int) -> bool:
    """Whether a squeeze names dimension ``dim`` (``squeeze.default`` names every one): it
    removes it wherever it is 1 long, so on ranks that hold one index of it."""
    if node.target is op("squeeze.default"):
        return True
    if node.target is op("squeeze.dim"):
        return norm_dim(int(node.args[1]), ndim) == dim
    if node.target is op("squeeze.dims"):
        return dim in [norm_dim(int(d), ndim) for d in node.args[1]]
    return False


@register(op("unsqueeze.default"), op("squeeze.dim"), op("squeeze.dims"), op("squeeze.default"),
          strided=True)
def squeeze(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    (p,) = inputs
    if not isinstance(p, (Shard, StridedShard)):
        return [Decision(output=p, reason="a view of a whole or partial value")]
    src, dst = shape(tensor_args(node)[0]), shape(node)
    if src[p.dim] == size and _squeezes(node, p.dim, len(src)):
        return _whole(node, inputs, f"sharded dimension {p.dim} is 1 long on each rank, "
                                    f"where the squeeze would remove it")
    mapped = reshape_map(src, dst, p.dim, size)
    if mapped is None or (isinstance(p, StridedShard) and dst[mapped] != src[p.dim]):
        return _whole(node, inputs, "squeezes its sharded dimension")
    return [Decision(output=_moved(p, mapped), reason=f"dimension {p.dim} becomes {mapped}")]


def _cut_dim(node: fx.Node) -> int:
    ndim = len(shape(tensor_args(node)[0]))
    target = node.target
    if target in (op("slice.Tensor"), op("select.int")):
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    else:  # split / split_with_sizes / unbind / chunk: dim after the sizes
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        if target is op("unbind.int"):
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    return norm_dim(int(dim), ndim)


@register(op("slice.Tensor"), op("select.int"), op("split.Tensor"),
          op("split_with_sizes.default"), op("unbind.int"), op("chunk.default"), strided=True)
def cut(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    """Pieces along one dimension: along another than the sharded one, each piece is
    sharded as the input (a dimension removed by ``select``/``unbind`` shifts it)."""
    (p,) = inputs
    count = outputs_of(node)
    if isinstance(p, StridedShard):
        return _cut_blocks(node, p, count, inputs)
    if not isinstance(p, Shard):
        out: Placement | tuple = (p,) * count if count > 1 or isinstance(
            node.meta.get("val"), (tuple, list)) else p
        return [Decision(output=out, reason="pieces of a whole or partial value")]
    dim = _cut_dim(node)
    if dim == p.dim:
        src = shape(tensor_args(node)[0])
        if node.target is op("slice.Tensor") and shape(node) == src:
            return [Decision(output=p, reason="a slice of everything")]
        return _whole(node, inputs, f"cut along its sharded dimension {dim}")
    removes = node.target in (op("select.int"), op("unbind.int"))
    new = Shard(p.dim - 1 if removes and p.dim > dim else p.dim)
    out = (new,) * count if isinstance(node.meta.get("val"), (tuple, list)) else new
    return [Decision(output=out, reason=f"cut along dimension {dim}, sharded along {p.dim}")]


def _cut_blocks(node: fx.Node, p: StridedShard, count: int, inputs: tuple[Placement, ...]
                ) -> list[Decision]:
    """``StridedShard(d, k)`` cut into its ``k`` blocks along ``d`` (a fused
    query-key-value projection's output split into q, k and v): each block ``Shard(d)``,
    every rank its part of each."""
    dim = _cut_dim(node)
    src = shape(tensor_args(node)[0])
    blocks = isinstance(node.meta.get("val"), (tuple, list)) and count == p.split and all(
        tuple(v.shape)[dim] * p.split == src[dim] for v in node.meta["val"])
    if dim == p.dim and blocks and node.target in (op("split.Tensor"), op("chunk.default"),
                                                   op("split_with_sizes.default")):
        return [Decision(output=(Shard(dim),) * count,
                         reason=f"{p!r} cut into its {p.split} blocks: each Shard({dim})")]
    return _whole(node, inputs, f"cut along {dim} other than into the blocks of {p!r}")



@register(op("slice_backward.default"), op("select_backward.default"))
def cut_backward(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    """The gradient of a slice or a selection: zeros of the input's shape with the piece's
    gradient written in. Linear in it (a partial gradient gives a partial result); sharded
    along another dimension than the cut one, each rank writes its piece into its zeros
    (``tensor_parallel`` rewrites ``input_sizes`` to the local shape, as for a view)."""
    (p,) = inputs
    if isinstance(p, Partial):
        return [Decision(output=p, reason="linear in the gradient")]
    if not isinstance(p, Shard):
        return [Decision(output=p, reason="zeros around a whole gradient")]
    sizes = [int(n) for n in node.args[1]]
    dim = norm_dim(int(node.args[2]), len(sizes))
    selects = node.target is op("select_backward.default")
    out = p.dim + 1 if selects and p.dim >= dim else p.dim
    if out == dim or sizes[out] % size:
        return _whole(node, inputs, f"cut along its sharded dimension {dim}")
    return [Decision(output=Shard(out), reason=f"cut along {dim}, sharded along {out}")]


@register(op("slice_scatter.default"), op("select_scatter.default"))
def scatter_into(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    """``self`` with a slice (or selection) replaced by ``src``: what a slice's gradient
    becomes under Inductor's decompositions (zeros with the piece's gradient written in).
    Both sharded alike along another dimension than the cut one, each rank writes its
    piece into its own; both partial alike, the parts' results add up (a replicated
    ``self``, zeros, becomes a partial one locally: one rank's copy, zeros elsewhere)."""
    ps, pv = inputs
    ndim = len(shape(node))
    dim = norm_dim(int(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)), ndim)
    selects = node.target is op("select_scatter.default")
    decisions = []
    partial = [p for p in inputs if isinstance(p, Partial)]
    if partial and all(isinstance(p, (Partial, Replicate)) for p in inputs):
        decisions.append(Decision(output=partial[0], inputs=(partial[0], partial[0]),
                                  reason="linear in both: the parts' results add up"))
    shards = [p for p in (ps,) if isinstance(p, Shard)] or (
        [Shard(pv.dim + 1 if selects and pv.dim >= dim else pv.dim)]
        if isinstance(pv, Shard) else [])
    for p in shards:
        src_dim = p.dim - 1 if selects and p.dim > dim else p.dim
        if p.dim != dim and shape(node)[p.dim] % size == 0:
            decisions.append(Decision(output=p, inputs=(p, Shard(src_dim)),
                                      reason=f"cut along {dim}, sharded along {p.dim}"))
    decisions.append(replicate_all(node, f"cut along its sharded dimension {dim}"))
    return decisions


@register(op("constant_pad_nd.default"))
def pad(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    """Padding with a constant (``F.pad``; CUDA's attention pads the head dimension to a
    multiple of 8): a shard along a dimension that is not padded stays; a partial value
    stays partial padded with zeros (the parts' pads add up to zero)."""
    (p,) = inputs
    widths = [int(w) for w in node.args[1]]
    value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
    ndim = len(shape(node))
    padded = {ndim - 1 - k // 2 for k, w in enumerate(widths) if w}
    if isinstance(p, Partial):
        if value == 0:
            return [Decision(output=p, reason="padded with zeros: the parts' pads add up")]
        return _whole(node, inputs, f"padded with {value}: each part would add it")
    if isinstance(p, Shard) and p.dim in padded:
        return _whole(node, inputs, f"padded along its sharded dimension {p.dim}")
    return [Decision(output=p, reason="padded along other dimensions than the sharded one")]


@register(op("cat.default"), op("stack.default"))
def cat(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    """Joined along a dimension other than the one every piece is sharded along, the
    result is sharded there; otherwise the pieces are gathered first."""
    args = tensor_args(node)
    ndim_in = len(shape(args[0]))
    raw = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    stack = node.target is op("stack.default")
    dim = norm_dim(int(raw), ndim_in + 1 if stack else ndim_in)
    first = inputs[0]
    if all(p == first for p in inputs) and isinstance(first, Partial):
        return [Decision(output=first, reason="pieces of one partial sum")]
    decisions = []
    shards = [p for p in inputs if isinstance(p, Shard)]
    if shards:
        d = shards[0].dim
        out_dim = d + 1 if stack and d >= dim else d
        if d != dim or stack:
            if all(shape(a)[d] % size == 0 for a in args):
                decisions.append(Decision(output=Shard(out_dim), inputs=(Shard(d),) * len(args),
                                          reason=f"joined along {dim}, sharded along {d}"))
        elif not stack and len(args) > 1 and len({shape(a) for a in args}) == 1 and shape(
                args[0])[d] % size == 0:
            # blocks each split alike joined along that dimension: every rank its part of
            # each block (the gradients of q, k and v into a fused projection's)
            decisions.append(Decision(output=StridedShard(d, len(args)),
                                      inputs=(Shard(d),) * len(args),
                                      reason=f"{len(args)} blocks each Shard({d}) joined "
                                             f"along {d}: StridedShard({d}, {len(args)})"))
    decisions.append(replicate_all(node, "joined along its sharded dimension"))
    return decisions


@register(op("view_as_complex.default"), op("view_as_real.default"))
def complex_view(node: fx.Node, inputs: tuple[Placement, ...], size: int) -> list[Decision]:
    """Real pairs ``[..., 2]`` read as complex numbers ``[...]`` and back (LLaMA's rotary
    embeddings): the trailing pair appears or disappears, a shard on any other dimension
    stays where it is, and a partial sum of pairs is a partial sum of complex numbers. A
    shard of the pair itself (a real or an imaginary part per rank) is no complex number:
    gathered first."""
    (p,) = inputs
    if not isinstance(p, Shard):
        return [Decision(output=p, reason="a view of a whole or partial value")]
    pair = len(shape(tensor_args(node)[0])) - 1
    if node.target is op("view_as_complex.default") and p.dim == pair:
        return _whole(node, inputs, "the real and imaginary parts of a pair are on different "
                                    "ranks")
    return [Decision(output=p, reason=f"dimension {p.dim} is not the pair")]
