"""Point-to-point: send, recv, isend, irecv and batch_isend_irecv, as in torch.distributed.

Ranks are global. A peer that dies makes the waiting side raise a ``DistError`` naming
it; a peer that never posts the matching call ends in ``DistTimeoutError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from spmd.runtime import checks
from spmd.runtime.groups import resolve_group
from spmd.runtime.process_group import ProcessGroup, Work

__all__ = ["send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv"]


def _tag(tag: object, op: str) -> int:
    if not isinstance(tag, int) or isinstance(tag, bool) or tag < 0:
        raise ValueError(f"{op}: tag must be a non-negative int, got {tag!r}")
    return tag


def _peer(pg: ProcessGroup, peer: int, op: str, what: str) -> int:
    index = pg.group_rank(peer, f"{op}: {what}")
    if index == pg.rank():
        raise ValueError(f"{op}: {what}={peer} is this rank; a rank cannot {op} to itself")
    return index


def isend(tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None,
          tag: int = 0) -> Work:
    """Start sending ``tensor`` to global rank ``dst``; a ``Work`` to wait on."""
    pg = resolve_group(group, "isend")
    checks.tensor(tensor, "isend", pg)
    checks.contiguous(tensor, "isend")
    tag = _tag(tag, "isend")
    peer = _peer(pg, dst, "send", "dst")
    backend = pg._backend
    return pg._launch("send", None, lambda: backend.send([checks.wire(tensor)], peer, tag), True,
                      peers=[peer])


def irecv(tensor: torch.Tensor, src: int | None = None, group: ProcessGroup | None = None,
          tag: int = 0) -> Work:
    """Start receiving into ``tensor`` from ``src`` (None: any rank); ``Work.result()`` is
    the sender's global rank."""
    pg = resolve_group(group, "irecv")
    checks.tensor(tensor, "irecv", pg)
    checks.contiguous(tensor, "irecv")
    tag = _tag(tag, "irecv")
    backend = pg._backend
    if src is None:
        sender: Callable[[object], int] = lambda inner: pg.ranks[inner._source_rank()]
        return pg._launch("recv", None, lambda: backend.recv_anysource([checks.wire(tensor)], tag), True,
                          result=sender)
    peer = _peer(pg, src, "recv", "src")
    return pg._launch("recv", None, lambda: backend.recv([checks.wire(tensor)], peer, tag), True,
                      peers=[peer], result=lambda _: pg.ranks[peer])


def send(tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None, tag: int = 0) -> None:
    """Send ``tensor`` to global rank ``dst`` and wait until it is handed over."""
    isend(tensor, dst, group, tag).wait()


def recv(tensor: torch.Tensor, src: int | None = None, group: ProcessGroup | None = None,
         tag: int = 0) -> int:
    """Receive into ``tensor`` from ``src`` (None: any rank); returns the sender's rank."""
    return irecv(tensor, src, group, tag).result()


@dataclass
class P2POp:
    """One send or receive for :func:`batch_isend_irecv`: ``P2POp(isend, t, peer)``."""

    op: Callable[..., Work]
    tensor: torch.Tensor
    peer: int
    group: ProcessGroup | None = None
    tag: int = 0

    def __post_init__(self) -> None:
        if self.op not in (isend, irecv):
            raise ValueError(f"P2POp op must be spmd.runtime.isend or irecv, got {self.op!r}")
        if not isinstance(self.tensor, torch.Tensor):
            raise TypeError(f"P2POp tensor must be a torch.Tensor, got {type(self.tensor)}")
        if not isinstance(self.peer, int) or isinstance(self.peer, bool):
            raise TypeError(f"P2POp peer must be an int (a global rank), got {self.peer!r}")


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Work]:
    """Start every send and receive of the list; their ``Work`` handles, in order.

    All operations are checked before the first one starts.
    """
    if not isinstance(p2p_op_list, (list, tuple)) or not p2p_op_list:
        raise ValueError("batch_isend_irecv: expects a non-empty list of P2POp")
    for i, p in enumerate(p2p_op_list):
        if not isinstance(p, P2POp):
            raise TypeError(f"batch_isend_irecv: item {i} is {type(p).__name__}, not a P2POp")
        pg = resolve_group(p.group, "batch_isend_irecv")
        checks.tensor(p.tensor, "batch_isend_irecv", pg, f"item {i}'s tensor")
        checks.contiguous(p.tensor, "batch_isend_irecv", f"item {i}'s tensor")
        _peer(pg, p.peer, "send" if p.op is isend else "recv", "peer")
        _tag(p.tag, "batch_isend_irecv")
    return [p.op(p.tensor, p.peer, p.group, p.tag) for p in p2p_op_list]
