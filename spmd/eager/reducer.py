"""The eager side of data parallelism: coalesced broadcasts and the safety-net reducer.

``broadcast_coalesced`` sends many tensors from one rank in one collective per dtype
(parameters and buffers at parallelize time, buffers before each forward).

``EagerReducer`` averages gradient contributions that no compiled graph reduced: from a
region Dynamo could not capture, from a model that refused capture, or accumulated under
``no_sync()``. It buckets them with the same cap and the same kernels as the compiled
path, and once backward is over sets ``.grad`` to ``base + avg(part)``, where ``base`` is
what the gradient held that every rank holds alike (an earlier step's average, a planned
bucket's share): the same bits on every rank, so replicas never drift apart (correcting
by ``grad + avg(part) - part`` would round differently on each rank). Its buckets are checked across ranks once, as a
compiled graph's collectives are (one row holding a hash of their sizes,
``spmd.runtime.sizecheck``), not one row each.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any, Iterable

import torch

from spmd.lowering import flat as buffers
from spmd.lowering.bucketing import plan_buckets
from spmd.runtime import sizecheck

__all__ = ["broadcast_coalesced", "EagerReducer"]


def broadcast_coalesced(tensors: Iterable[torch.Tensor], src: int, group: Any) -> None:
    """Overwrite ``tensors`` on every rank with ``src``'s values; one broadcast per dtype."""
    from spmd.runtime.collectives import broadcast

    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_dtype.setdefault(t.dtype, []).append(t.detach())
    for items in by_dtype.values():
        flat = buffers.pack(items)
        broadcast(flat, src=src, group=group)
        buffers.unpack(flat, items)


class EagerReducer:
    """Collects ``(param, local part)`` pairs during backward; :meth:`finish` averages them."""

    def __init__(self, group: Any, world_size: int, cap_bytes: int,
                 wire_dtype: torch.dtype | None, sync: Any = None) -> None:
        self.group = group
        self.world_size = world_size
        self.cap_bytes = max(cap_bytes, 1)
        self.wire_dtype = wire_dtype
        self.sync = sync  # the model's SyncState: its communication hook, if any
        self.pending: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self.bases: dict[int, torch.Tensor | None] = {}  # by id(param), for dense parts

    def add(self, param: torch.nn.Parameter, part: torch.Tensor,
            base: torch.Tensor | None = None) -> None:
        """``param.grad`` becomes ``base + avg(part)`` at :meth:`finish` (dense parts;
        ``base``: what every rank holds alike, None for nothing)."""
        self.pending.append((param, part))
        self.bases[id(param)] = base

    def finish(self) -> None:
        """Average every pending part across ranks and fix ``.grad``."""
        pending, self.pending = self.pending, []
        bases, self.bases = self.bases, {}
        if not pending or self.group is None or self.world_size <= 1:
            return
        sparse = [(p, part) for p, part in pending if part.is_sparse]
        if sparse:
            pending = [(p, part) for p, part in pending if not part.is_sparse]
            self._finish_sparse(sparse)
            if not pending:
                return
        parts = [part for _, part in pending]
        sizes = [p.numel() * p.element_size() for p in parts]
        hook = self.sync.comm_hook if self.sync is not None else None
        works = []
        groups = plan_buckets(sizes, [p.dtype for p in parts], self.cap_bytes)
        with self._checked(parts, groups):
            self._launch(pending, parts, groups, hook, works)
        with torch.no_grad():
            for members, flat, work in works:
                work.wait()
                for i in members:
                    param = pending[i][0]
                    if param.grad is None:
                        param.grad = torch.zeros_like(param)
                grads = [pending[i][0].grad for i in members]
                buffers.unpack(flat, grads)  # avg(part)
                for i, grad in zip(members, grads):
                    base = bases.get(id(pending[i][0]))
                    if base is not None:
                        grad.add_(base.to(grad.dtype))  # + what every rank holds alike

    def _checked(self, parts: list[torch.Tensor], groups: list[list[int]]) -> Any:
        """Every rank's buckets compared once (their shapes, dtypes and hook), before the
        first moves data; its collectives then skip their own rows."""
        if not getattr(self.group, "size_check", False) or self.group.join_log is not None:
            return contextlib.nullcontext()  # (under spmd.Join a joined rank shadows each)
        what = repr(([[(tuple(parts[i].shape), str(parts[i].dtype)) for i in members]
                      for members in groups], self.wire_dtype,
                     self.sync is not None and self.sync.comm_hook is not None)).encode()
        signature = int(hashlib.sha256(what).hexdigest()[:15], 16)
        count = sum(parts[i].numel() for members in groups for i in members)
        sizecheck.check_signature(
            self.group, "buckets", signature,
            lambda: f"gradient buckets reduced after backward ({len(groups)} buckets, "
                    f"{count} elements)", defer=True)
        return sizecheck.agreed([self.group])

    def _launch(self, pending: list, parts: list[torch.Tensor], groups: list[list[int]],
                hook: Any, works: list) -> None:
        from spmd.lowering import reduction

        for index, members in enumerate(groups):
            chunk = [parts[i] for i in members]
            if hook is not None:  # the hook gets the sums and averages itself
                flat = buffers.pack(chunk)
                views = buffers.views(flat, chunk)
                bucket = reduction.GradBucket(10**6 + index, flat,
                                              [pending[i][0] for i in members], views,
                                              index == len(groups) - 1)
                works.append((members, flat, reduction.run_hook(
                    hook, self.sync.comm_state, bucket)))
                continue
            wire = self.wire_dtype or chunk[0].dtype
            algorithm, _ = reduction.choose(wire, chunk[0].dtype, self.world_size)
            flat = buffers.pack(chunk, scale=1.0 / self.world_size,
                                dtype=None if algorithm == "fp32" else self.wire_dtype)
            works.append((members, flat, reduction.start(flat, self.group, algorithm, wire)))
        sizecheck.settle(self.group)  # (a hook that sent nothing on the group)

    def _finish_sparse(self, pending: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
        """Sparse parts (``nn.Embedding(sparse=True)``): one sparse all-reduce each, as
        torch's DDP does; ``.grad`` becomes ``grad - part + avg(part)``, still sparse."""
        from spmd.runtime.collectives import ReduceOp, all_reduce

        if self.sync is not None and self.sync.comm_hook is not None:
            names = ", ".join(str(tuple(p.shape)) for p, _ in pending)
            raise RuntimeError(f"spmd: a communication hook takes dense buckets, and "
                               f"parameters of shape {names} have sparse gradients; "
                               f"register no hook or make their gradients dense")
        works = []
        for param, part in pending:
            avg = part.clone().coalesce()  # part itself is subtracted below
            works.append((param, part, avg, all_reduce(avg, op=ReduceOp.AVG,
                                                       group=self.group, async_op=True)))
        with torch.no_grad():
            for param, part, avg, work in works:
                work.wait()
                param.grad = (param.grad - part + avg).coalesce()
