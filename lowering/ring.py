"""Ring attention: scaled dot-product attention over a sequence sharded along one mesh
dimension (context parallelism), each rank holding its queries and passing key/value
blocks around the ring.

Rank ``r`` of ``n`` holds the sequence's positions ``[r * s, (r + 1) * s)`` of queries,
keys and values (``[batch, heads, s, head_dim]``). In ``n`` steps it attends its queries
to every rank's keys and values: step ``t`` uses the block of rank ``(r - t) mod n``,
received from the previous rank while the step before computes (``isend``/``irecv``
started before the block's kernel, waited after it). Each block's output and log-sum-exp
are merged with the running ones (the online softmax: ``lse = logaddexp(lse_a, lse_b)``,
``out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)``), exact in any dtype up to
rounding, and in float64 equal to one kernel over the whole sequence to the last bits
that reassociation leaves.

Backward runs the same ring: each block's gradient contributions come from the fused
backward kernel given the *merged* output and log-sum-exp (so its probabilities are the
whole softmax's), the query gradient accumulates in place, and the key/value gradients
travel with their block, one hop behind it, reaching their owner after the last step.

**Causal load balancing.** Under a causal mask, contiguous blocks give rank ``n - 1``
``n`` blocks of work and rank 0 one. With ``load_balance`` the op first exchanges halves
so that rank ``r`` holds chunks ``r`` and ``2n - 1 - r`` of ``2n`` (torch's
``context_parallel`` layout, "zigzag"): every step is then half a block on every rank
(the ranks ahead in the ring attend only their later chunk to it, the ranks behind
attend both chunks to its earlier one), and the results are exchanged back, so the op's
inputs and outputs are the contiguous pieces the rest of the graph holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

__all__ = ["RingSpec", "ring_forward", "ring_backward", "block_attention",
           "block_attention_backward", "math_attention", "zigzag_chunks"]

# p2p tags: key/value blocks, their gradients, the load-balancing exchange
_KV, _GRAD, _SWAP = 11, 12, 13


@dataclass(eq=False, kw_only=True)
class RingSpec:
    """The ring of one mesh dimension for an attention node: its ranks' group (None: a
    simulated mesh, where the op computes as one rank with its own block at every step)
    and whether causal attention is load-balanced."""

    dim: str
    size: int
    group: Any = None
    load_balance: bool = True

    def rank(self) -> int:
        return 0 if self.group is None else self.group.rank()

    def live(self) -> bool:
        from spmd.lowering.specs import sending

        return self.group is not None and self.size > 1 and sending()


def zigzag_chunks(rank: int, size: int) -> tuple[int, int]:
    """The two of ``2 * size`` sequence chunks rank ``rank`` holds load-balanced."""
    return rank, 2 * size - 1 - rank


# -- one block: the fused kernels (CPU), or attention written out elsewhere --------------


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def math_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   bias: torch.Tensor | None, is_causal: bool, scale: float | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention written out (the reference of the fused op): keys and values repeated
    to the query's heads, scores scaled, biased and causally masked, softmax, the
    weighted sum; and the rows' log-sum-exp in float32. A block's attention off CPU
    here, and the whole of ``spmd::attention`` (``spmd.lowering.meta_trace``)."""
    group = query.shape[-3] // key.shape[-3]
    if group > 1:
        key, value = (t.repeat_interleave(group, dim=-3) for t in (key, value))
    factor = scale if scale is not None else query.shape[-1] ** -0.5
    scores = (query @ key.transpose(-2, -1)) * factor
    if bias is not None:
        scores = scores + bias
    if is_causal:
        sq, sk = scores.shape[-2:]
        # top-left aligned, as SDPA's is_causal
        keep = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(keep.logical_not(), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1) @ value, lse.float()


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    scale: float | None, mask: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` to one block of keys and values (causal: top-left aligned, the
    block on the diagonal; ``mask``: the block of an explicit mask); its output and
    log-sum-exp in the accumulation dtype. A row the mask hides wholly has log-sum-exp
    ``-inf`` and output 0 (it adds nothing when merged)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    else:
        bias = mask
        if mask is not None and mask.dtype == torch.bool:
            bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(
                ~mask, float("-inf"))
        out, lse = math_attention(q, k, v, bias, causal, scale)
    acc = _acc(q.dtype)
    out, lse = out.to(acc), lse.to(acc)
    if mask is not None:  # (the CPU kernel gives such rows a log-sum-exp of 0)
        hidden = (~mask.any(-1) if mask.dtype == torch.bool
                  else torch.isneginf(mask).all(-1)).expand(lse.shape)
        lse = lse.masked_fill(hidden, float("-inf"))
        out = out.masked_fill(hidden.unsqueeze(-1), 0.0)
    return out, lse


def block_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                             causal: bool, scale: float | None,
                             mask: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's contributions to the query, key and value gradients, given the whole
    attention's output and log-sum-exp (the kernel's probabilities are then the whole
    softmax's, restricted to the block)."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse.to(_lse_dtype(q, lse)), 0.0, causal, attn_mask=mask,
            scale=scale)
    group = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(group, dim=1) for t in (k, v)) if group > 1 else (k, v)
    factor = scale if scale is not None else q.shape[-1] ** -0.5
    acc = _acc(q.dtype)
    s = (q.to(acc) @ kk.to(acc).transpose(-2, -1)) * factor
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    p = torch.exp(s - lse.to(acc).unsqueeze(-1))
    g = grad.to(acc)
    dv = p.transpose(-2, -1) @ g
    dp = g @ vv.to(acc).transpose(-2, -1)
    ds = p * (dp - (g * out.to(acc)).sum(-1, keepdim=True))
    dq = ds @ kk.to(acc) * factor
    dk = ds.transpose(-2, -1) @ q.to(acc) * factor
    if group > 1:
        dk = dk.unflatten(1, (k.shape[1], group)).sum(2)
        dv = dv.unflatten(1, (k.shape[1], group)).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _lse_dtype(q: torch.Tensor, lse: torch.Tensor) -> torch.dtype:
    """The CPU kernel keeps its log-sum-exp in the query's dtype (float for half types)."""
    return torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype


def _merge(out: torch.Tensor | None, lse: torch.Tensor | None, o: torch.Tensor,
           s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if out is None or lse is None:
        return o, s
    new = torch.logaddexp(lse, s)
    return (out * torch.exp(lse - new).unsqueeze(-1) + o * torch.exp(s - new).unsqueeze(-1),
            new)


# -- communication ----------------------------------------------------------------------


def _flat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.reshape(-1) for p in parts])


def _unflat(buffer: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, at = [], 0
    for t in like:
        out.append(buffer[at:at + t.numel()].view(t.shape))
        at += t.numel()
    return out


class _Ring:
    """Sends to the next rank of the group and receives from the previous one."""

    def __init__(self, spec: RingSpec) -> None:
        self.spec = spec
        self.n = spec.size
        self.r = spec.rank()
        ranks = spec.group.ranks
        self.next, self.prev = ranks[(self.r + 1) % self.n], ranks[(self.r - 1) % self.n]

    def start(self, buffer: torch.Tensor, tag: int) -> tuple[torch.Tensor, list[Any]]:
        from spmd.runtime import p2p

        incoming = torch.empty_like(buffer)
        works = [p2p.isend(buffer, self.next, group=self.spec.group, tag=tag),
                 p2p.irecv(incoming, self.prev, group=self.spec.group, tag=tag)]
        return incoming, works

    @staticmethod
    def finish(works: list[Any]) -> None:
        for w in works:
            w.wait()


def _swap(spec: RingSpec, parts: Sequence[torch.Tensor], dims: Sequence[int],
          to_zigzag: bool) -> list[torch.Tensor]:
    """``parts`` (each sharded along its ``dims`` entry) from the contiguous layout to the
    load-balanced one (``to_zigzag``) or back: each of this rank's two halves goes to the
    rank holding that chunk in the other layout."""
    from spmd.runtime import p2p

    n, r = spec.size, spec.rank()
    ranks = spec.group.ranks
    halves = [p.chunk(2, dim=d) for p, d in zip(parts, dims)]

    def holder(chunk: int, zigzag: bool) -> int:
        return (chunk if chunk < n else 2 * n - 1 - chunk) if zigzag else chunk // 2

    mine = zigzag_chunks(r, n) if not to_zigzag else (2 * r, 2 * r + 1)
    wanted = zigzag_chunks(r, n) if to_zigzag else (2 * r, 2 * r + 1)
    received: dict[int, list[torch.Tensor]] = {}
    works, buffers = [], []
    for slot, chunk in enumerate(mine):
        parts_of = [h[slot] for h in halves]
        dst = holder(chunk, to_zigzag)
        if dst == r:
            received[chunk] = [t.contiguous() for t in parts_of]
        else:
            buffer = _flat(parts_of).contiguous()
            buffers.append(buffer)
            works.append(p2p.isend(buffer, ranks[dst], group=spec.group, tag=_SWAP + 16 * chunk))
    incoming = {}
    for chunk in wanted:
        if chunk in received:
            continue
        like = [h[0] for h in halves]
        buffer = torch.empty(sum(t.numel() for t in like), dtype=parts[0].dtype,
                             device=parts[0].device)
        src = holder(chunk, not to_zigzag)
        works.append(p2p.irecv(buffer, ranks[src], group=spec.group, tag=_SWAP + 16 * chunk))
        incoming[chunk] = (buffer, like)
    for w in works:
        w.wait()
    for chunk, (buffer, like) in incoming.items():
        received[chunk] = _unflat(buffer, like)
    first, second = (received[c] for c in wanted)
    return [torch.cat([a, b], dim=d) for a, b, d in zip(first, second, dims)]


# -- the op -----------------------------------------------------------------------------


def _layout(spec: RingSpec, causal: bool, length: int) -> bool:
    """Whether this call runs load-balanced (causal, asked for, halves that split)."""
    return spec.load_balance and causal and spec.live() and length % 2 == 0


def _hides_all(block: torch.Tensor | None) -> bool:
    """Whether a mask block hides every key from every query (nothing to compute)."""
    if block is None:
        return False
    return bool((~block).all() if block.dtype == torch.bool else torch.isneginf(block).all())


def _mask_block(mask: torch.Tensor | None, rows: int, cols: int, length: int
                ) -> torch.Tensor | None:
    """The block of a whole mask (``[..., queries, keys]``, either of size 1 where it
    broadcasts) for this rank's queries (block ``rows``) and one rank's keys (``cols``),
    ``length`` positions a block."""
    if mask is None:
        return None
    if mask.shape[-2] > 1:
        mask = mask[..., rows * length:(rows + 1) * length, :]
    if mask.shape[-1] > 1:
        mask = mask[..., cols * length:(cols + 1) * length]
    return mask


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 scale: float | None, spec: RingSpec, mask: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's attention output and log-sum-exp (accumulation dtype) for its queries
    against the whole sequence's keys and values (see the module doc). ``mask``: an
    explicit mask over the whole sequence (every block is then computed, its part of
    the mask applied)."""
    live = spec.live()
    r = spec.rank()
    if mask is not None:
        return _masked_forward(q, k, v, scale, spec, mask)
    zigzag = _layout(spec, causal, q.shape[2])
    if zigzag:
        q, k, v = _swap(spec, [q, k, v], [2, 2, 2], True)
    half = q.shape[2] // 2
    out = lse = None
    for t, src, kt, vt in _ring_blocks(spec, k, v):
        if t == 0 or not live:
            o, s = block_attention(q, kt, vt, causal, scale)
            out, lse = _merge(out, lse, o, s)
        elif not causal:
            o, s = block_attention(q, kt, vt, False, scale)
            out, lse = _merge(out, lse, o, s)
        elif zigzag and src < r:  # both my chunks attend its earlier chunk
            o, s = block_attention(q, kt[:, :, :half], vt[:, :, :half], False, scale)
            out, lse = _merge(out, lse, o, s)
        elif zigzag:  # my later chunk attends both of its chunks
            o, s = block_attention(q[:, :, half:], kt, vt, False, scale)
            lo, hi = _merge(out[:, :, half:], lse[:, :, half:], o, s)
            out = torch.cat([out[:, :, :half], lo], dim=2)
            lse = torch.cat([lse[:, :, :half], hi], dim=2)
        elif src < r:  # contiguous: an earlier block, wholly visible; a later one, not
            o, s = block_attention(q, kt, vt, False, scale)
            out, lse = _merge(out, lse, o, s)
    assert out is not None and lse is not None
    if zigzag:
        out, lse = _swap(spec, [out, lse], [2, 2], False)
    return out, lse


def _ring_blocks(spec: RingSpec, k: torch.Tensor, v: torch.Tensor) -> Iterator[tuple]:
    """Each step's ``(step, source rank, keys, values)``: the block of rank
    ``(r - step) mod n`` (on a simulated mesh, this rank's own every step), the next one
    received from the previous rank while the caller computes with this one."""
    live = spec.live()
    n, r = spec.size, spec.rank()
    kv = _flat([k, v]).contiguous()
    ring = _Ring(spec) if live else None
    for t in range(n):
        incoming, works = (ring.start(kv, _KV) if ring is not None and t < n - 1
                           else (None, []))
        kt, vt = _unflat(kv, [k, v])
        yield t, (r - t) % n if live else r, kt, vt
        if incoming is not None:
            _Ring.finish(works)
            kv = incoming


def _masked_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
                    spec: RingSpec, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r = spec.rank()
    out = lse = None
    for t, src, kt, vt in _ring_blocks(spec, k, v):
        block = _mask_block(mask, r, src, q.shape[2])
        if t == 0 or not _hides_all(block):  # (a causal mask's later blocks: skipped)
            o, s = block_attention(q, kt, vt, False, scale, block)
            out, lse = _merge(out, lse, o, s)
    assert out is not None and lse is not None
    return out, lse


def ring_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float | None,
                  spec: RingSpec, mask: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's query, key and value gradients (see the module doc)."""
    live = spec.live()
    n, r = spec.size, spec.rank()
    zigzag = mask is None and _layout(spec, causal, q.shape[2])
    if zigzag:  # (the log-sum-exp on its own: its dtype may differ)
        grad, q, k, v, out = _swap(spec, [grad, q, k, v, out], [2] * 5, True)
        (lse,) = _swap(spec, [lse], [2], True)
    half = q.shape[2] // 2
    acc = _acc(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = _flat([k, v]).contiguous()
    dkv = torch.zeros(kv.numel(), dtype=acc, device=kv.device)
    ring = _Ring(spec) if live else None
    own_dkv = None
    for t in range(n):
        works: list[Any] = []
        incoming = None
        if ring is not None and t < n - 1:
            incoming, works = ring.start(kv, _KV)
        kt, vt = _unflat(kv, [k, v])
        dk, dv = _unflat(dkv, [k, v])
        src = (r - t) % n
        if mask is not None:
            block = _mask_block(mask, r, src if live else r, q.shape[2])
            if not _hides_all(block):
                g = block_attention_backward(grad, q, kt, vt, out, lse, False, scale, block)
                dq += g[0]
                dk += g[1]
                dv += g[2]
        elif t == 0 or not live or not causal:
            g = block_attention_backward(grad, q, kt, vt, out, lse, causal and t == 0, scale)
            dq += g[0]
            dk += g[1]
            dv += g[2]
        elif zigzag and src < r:
            g = block_attention_backward(grad, q, kt[:, :, :half], vt[:, :, :half], out, lse,
                                         False, scale)
            dq += g[0]
            dk[:, :, :half] += g[1]
            dv[:, :, :half] += g[2]
        elif zigzag:
            g = block_attention_backward(grad[:, :, half:], q[:, :, half:], kt, vt,
                                         out[:, :, half:], lse[:, :, half:], False, scale)
            dq[:, :, half:] += g[0]
            dk += g[1]
            dv += g[2]
        elif src < r:
            g = block_attention_backward(grad, q, kt, vt, out, lse, False, scale)
            dq += g[0]
            dk += g[1]
            dv += g[2]
        if ring is None:
            continue
        # the block's gradients follow it to the next rank; the next block's arrive from
        # the previous rank, which has just added its part
        moved, grad_works = ring.start(dkv, _GRAD)
        ring.finish(grad_works)
        dkv = moved
        if incoming is not None:
            ring.finish(works)
            kv = incoming
        else:
            own_dkv = dkv
    if ring is None:
        own_dkv = dkv
    assert own_dkv is not None
    dk, dv = (t.to(k.dtype) for t in _unflat(own_dkv, [k, v]))
    dq = dq.to(q.dtype)
    if zigzag:
        dq, dk, dv = _swap(spec, [dq, dk, dv], [2, 2, 2], False)
    return dq, dk, dv
