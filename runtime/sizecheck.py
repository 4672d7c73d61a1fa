"""The size check a collective runs before its data: ranks that disagree get an error.

Gloo ends the process (``std::terminate``: SIGABRT, no Python error on any rank) when a
rank receives more bytes than it posted, which is what a collective called with other
sizes on another rank does; with fewer bytes it may finish with wrong values. So before
an eager collective moves data, the ranks of its group all-gather a header of fixed size:
what each is about to run (the operation, its element count, dtype, root, reduction, and
the label of the caller, see :func:`labelled`). Every header has the same size whatever
the call, so ranks whose programs disagree meet header against header; every rank then
raises a :class:`~spmd.runtime.errors.DistError` that names each rank's call.

A compiled graph checks once per run instead: one header holding a hash of everything
its collectives send (``spmd.agreement``), then its collectives run inside
:func:`agreed`, which skips their own headers. A rank whose header never comes (it left,
or runs something else that blocks) is named within the group's timeout, as any
collective's peer is.

Cost: one all-gather of ``8 x FIELDS`` bytes a rank per eager collective (BENCHMARKS.md).
Off by default until it is cheap: ``SPMD_SIZE_CHECK=1`` turns it on (a group reads it
when it is made). It costs a round trip per eager call, and an ``async_op`` call waits for
its peers' headers, which would take the overlap from a whole step's bucketed
collectives (those do not run inside a compiled graph's one check per run).
"""

from __future__ import annotations

import contextlib
import contextvars
import zlib
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from spmd.runtime.errors import DistError

if TYPE_CHECKING:
    from spmd.runtime.process_group import ProcessGroup

__all__ = ["labelled", "agreed", "exchange", "FIELDS"]

# a header: operation, element count (-1: not compared), dtype, root, reduction, label
FIELDS = 6
_OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "gather",
        "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
        "all_to_all_single", "barrier", "graph", "inputs")
_DTYPES = (None, torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
           torch.uint8, torch.int32, torch.int64, torch.bool, torch.complex64,
           torch.complex128)
# the list and the flat-tensor forms of a collective move the same bytes and may meet
_OP_CODE = {op: i for i, op in enumerate(_OPS)} | {
    "all_gather_into_tensor": 3, "reduce_scatter_tensor": 7, "all_to_all_single": 9}
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}

_label: contextvars.ContextVar[tuple[str, str, int] | None] = contextvars.ContextVar(
    "spmd_collective_label", default=None)
_agreed: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "spmd_agreed", default=frozenset())


@contextlib.contextmanager
def labelled(caller: str, hint: str = "") -> Iterator[None]:
    """Collectives run inside carry ``caller`` (e.g. ``"state_dict()"``) in their header:
    a rank calling them where another calls something else is told who called what,
    and ``hint`` (e.g. "every rank must call it")."""
    token = _label.set((caller, hint, zlib.crc32(caller.encode()) & 0x7FFFFFFF))
    try:
        yield
    finally:
        _label.reset(token)


@contextlib.contextmanager
def agreed(groups: "list[ProcessGroup]") -> Iterator[None]:
    """Collectives on ``groups`` run inside skip their own header: the caller has
    checked their sizes already (a compiled graph, once per run, for everything it
    sends); other groups' still check."""
    token = _agreed.set(_agreed.get() | {id(g) for g in groups})
    try:
        yield
    finally:
        _agreed.reset(token)


def skipping(pg: "ProcessGroup") -> bool:
    return id(pg) in _agreed.get()


def check_signature(pg: "ProcessGroup", kind: str, signature: int,
                    describe: Callable[[], str]) -> None:
    """One header for what every rank of ``pg`` must have alike: ``"graph"``, a compiled
    graph's run (``signature``, 63 bits, hashes everything it sends; its collectives then
    run inside :func:`agreed`), or ``"inputs"``, the shapes a model was given."""
    if pg.size_check and not pg.debug:
        exchange(pg, kind, header(kind, signature),
                 lambda: f"{describe()} [signature {signature & 0xFFFFFFFF:08x}]")


def header(op: str, count: int, dtype: torch.dtype | None = None, root: int = -1,
           reduce: int = -1) -> list[int]:
    """The fields of one call's header (the label is added by :func:`exchange`)."""
    return [_OP_CODE.get(op, 99), count, _DTYPE_CODE.get(dtype, 99), root, reduce, 0]


def exchange(pg: "ProcessGroup", op: str, fields: list[int],
             describe: Callable[[], str] | None) -> None:
    """All-gather ``fields`` over ``pg`` before ``op``'s data; raise on every rank (naming
    each rank's call) when they differ."""
    label = _label.get()
    if label is not None:
        fields = fields[:-1] + [label[2]]
    size = pg.size()
    mine = torch.tensor(fields, dtype=torch.int64)
    every = torch.empty(size * FIELDS, dtype=torch.int64)
    pg._checks += 1
    what = op if label is None else f"{op} in {label[0]}"  # a timeout here is the op's
    backend = pg._backend
    # the collective this header precedes: an eager one has taken its number, a graph's
    # first is the next (a peer that left before it is named after a second)
    seq = pg._seq + 1 if op in ("graph", "inputs") else pg._seq
    work = pg._launch(what, seq, lambda: backend._allgather_base(every, mine), True)
    try:
        work.wait()
    except DistError as e:
        if label is not None and label[1]:
            raise type(e)(f"{e}; {label[0]}: {label[1]}") from e
        raise
    rows = every.view(size, FIELDS).tolist()
    if any(row != rows[0] for row in rows):
        raise _mismatch(pg, op, rows, describe, label)


def _mismatch(pg: "ProcessGroup", op: str, rows: list[list[int]],
              describe: Callable[[], str] | None, label: tuple | None) -> DistError:
    """The error for headers that differ: each rank's own words for its call when they
    arrive through the store within a few seconds, else what its header says."""
    me, n = pg.rank(), pg._checks
    text = describe() if describe is not None else ""
    call = text if op in ("graph", "inputs") else f"{op}({text})"
    if label is not None:
        call += f" in {label[0]}" + (f" ({label[1]})" if label[1] else "")
    calls = [_decode(row) for row in rows]
    store = pg.store
    if store is not None:
        try:
            store.set(f"sc/{n}/{me}", call)
            calls = [c.decode() for c in store._multi_get(
                [f"sc/{n}/{r}" for r in range(pg.size())], 5.0)]
        except Exception:  # a rank that raised first may have taken the store with it
            calls[me] = call
    differ = [pg.ranks[r] for r, row in enumerate(rows) if row != rows[0]]
    lines = "\n".join(f"  rank {pg.ranks[r]}: {c}" for r, c in enumerate(calls))
    return DistError(
        f"collectives disagree on process group {pg.name!r} (collective {pg._seq}): every "
        f"rank of a group must run the same collectives with the same sizes in the same "
        f"order; each rank called:\n{lines}\nrank(s) {', '.join(map(str, differ))} differ "
        f"from rank {pg.ranks[0]} (no data moved; the group can go on)")


def _decode(row: list[int]) -> str:
    code, count, dtype, root, reduce, label = row
    op = _OPS[code] if 0 <= code < len(_OPS) else f"operation {code}"
    if op in ("graph", "inputs"):
        return f"a compiled graph (signature {count & 0xFFFFFFFF:08x})" if op == "graph" \
            else f"a model's forward on inputs of signature {count & 0xFFFFFFFF:08x}"
    kind = _DTYPES[dtype] if 0 <= dtype < len(_DTYPES) else None
    text = f"{op} of {count} {str(kind).removeprefix('torch.')} elements"
    if root >= 0:
        text += f", root {root}"
    return text + (f" (caller label {label})" if label else "")
