"""The size check a collective runs before its data: ranks that disagree get an error.

Gloo ends the process (``std::terminate``: SIGABRT, no Python error on any rank) when a
rank receives more bytes than it posted, which is what a collective called with other
sizes on another rank does; with fewer bytes it may finish with wrong values. So before
an eager collective moves data, the ranks of its group all-gather a row of fixed size
(:data:`ROW` bytes): a header saying what each is about to run (the operation, its
element count, dtype, root, reduction, and the label of the caller, see
:func:`labelled`), then room for a small payload. Every row has the same size whatever
the call, so ranks whose programs disagree meet row against row; every rank then raises
a :class:`~spmd.runtime.errors.DistError` that names each rank's call, and no data moved.

Where it is cheap the check rides on the data: a call whose payload fits the row's
:data:`SLOT` (a loss, a flag, a metric: up to 976 bytes) travels in the row itself,
and the exchange *is* the collective (:func:`fused`: the reduction, the broadcast's root
row or the gathered rows are taken locally, the same on every rank), so it costs what the
collective alone would. A larger call sends its row first and its data after: one more
round trip, a small share of a call that moves that much. ``async_op`` calls: a fused one
returns at once as any async call does (a disagreement raises from ``wait()``); a larger
one returns once every peer has reached it (its row), its data still in flight.

A compiled graph checks once per run instead: one row holding a hash of everything its
collectives send (``spmd.lowering.run_check``), launched as the run starts and settled
(:func:`settle`) by the first collective on the group, so the backward's compute hides
it; its collectives run inside :func:`agreed`, which skips their own rows. A rank whose
row never comes (it left, or runs something else that blocks) is named within the
group's timeout, as any collective's peer is.

On by default; ``SPMD_SIZE_CHECK=0`` turns it off (a group reads it when it is made).
Cost: BENCHMARKS.md ("The size check").
"""

from __future__ import annotations

import contextlib
import contextvars
import struct
import zlib
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy
import torch

from spmd.runtime.errors import DistError

if TYPE_CHECKING:
    from spmd.runtime.process_group import ProcessGroup

__all__ = ["labelled", "agreed", "exchange", "exchange_splits", "fused", "fits", "settle",
           "FIELDS", "ROW", "SLOT"]

# a header: operation, element count (-1: not compared), dtype, root, reduction, label
FIELDS = 6
HEAD = FIELDS * 8
ROW = 1024  # bytes of one rank's row: the header, then a small call's payload
SLOT = ROW - HEAD  # 976: a multiple of 16, so every row's payload is aligned for any dtype
_PACK = struct.Struct(f"<{FIELDS}q")
_OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "gather",
        "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
        "all_to_all_single", "barrier", "graph", "inputs", "buckets",
        # spmd.runtime.hierarchical: one row on the parent group for the whole call
        "all_reduce_hierarchical", "all_gather_hierarchical", "reduce_scatter_hierarchical")
_DTYPES = (None, torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
           torch.uint8, torch.int32, torch.int64, torch.bool, torch.complex64,
           torch.complex128)
# the list and the flat-tensor forms of a collective move the same bytes and may meet
_OP_CODE = {op: i for i, op in enumerate(_OPS)} | {
    "all_gather_into_tensor": 3, "reduce_scatter_tensor": 7, "all_to_all_single": 9}
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}
_SIGNED = ("graph", "inputs", "buckets")  # rows holding a signature of many calls

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


def checking(pg: "ProcessGroup") -> bool:
    """Whether a collective on ``pg`` called now sends its row first (the check is on,
    not in debug mode, which compares calls through the store, and no compiled graph
    has checked the call already)."""
    return pg.size_check and not pg.debug and not skipping(pg)


def fits(pg: "ProcessGroup", nbytes: int) -> bool:
    """Whether a call moving ``nbytes`` a rank travels inside its row (:func:`fused`)."""
    return nbytes <= SLOT and checking(pg)


def check_signature(pg: "ProcessGroup", kind: str, signature: int,
                    describe: Callable[[], str], defer: bool = False) -> bool:
    """One row for what every rank of ``pg`` must have alike: ``"graph"``, a compiled
    graph's run (``signature``, 63 bits, hashes everything it sends; its collectives then
    run inside :func:`agreed`), or ``"inputs"``, the shapes a model was given.

    ``defer``: launch the row and return; the next collective on ``pg`` (or
    :func:`settle`) waits for it and raises on a disagreement, so the compute before
    that collective hides the round trip. Returns whether a row was sent."""
    if not pg.size_check or pg.debug:
        return False
    work = _start(pg, kind, header(kind, signature), None,
                  lambda: f"{describe()} [signature {signature & 0xFFFFFFFF:08x}]", None, True)
    if defer:
        pg._pending.append(work)
    else:
        _wait(work)
    return True


def settle(pg: "ProcessGroup") -> None:
    """Wait for ``pg``'s deferred rows (:func:`check_signature`); raise on every rank
    when they disagree, before anything else runs on the group."""
    pending, pg._pending = pg._pending, []
    for work in pending:
        _wait(work)


def header(op: str, count: int, dtype: torch.dtype | None = None, root: int = -1,
           reduce: int = -1) -> list[int]:
    """The fields of one call's header (the label is added by :func:`exchange`)."""
    return [_OP_CODE.get(op, 99), count, _DTYPE_CODE.get(dtype, 99), root, reduce, 0]


def exchange(pg: "ProcessGroup", op: str, fields: list[int],
             describe: Callable[[], str] | None) -> None:
    """All-gather ``fields`` over ``pg`` before ``op``'s data; raise on every rank (naming
    each rank's call) when they differ."""
    _start(pg, op, fields, None, describe, None, False)


def exchange_splits(pg: "ProcessGroup", op: str, fields: list[int], sends: list[int],
                    receives: list[int], describe: Callable[[], str] | None) -> None:
    """The row of an all-to-all with uneven sizes: ``sends[j]`` elements go to group rank
    j, ``receives[j]`` are expected from it. Every rank checks the whole table (rank i's
    ``sends[j]`` against rank j's ``receives[i]``) and raises on every rank, naming each
    pair that disagrees, before any data moves. Past :data:`SLOT` (groups of more than 61
    ranks) only the header is compared."""
    size = pg.size()
    if 2 * size * 8 > SLOT:
        exchange(pg, op, fields, describe)
        return
    payload = torch.tensor(list(sends) + list(receives), dtype=torch.int64)

    def check(rows: Rows) -> None:
        table = [part.tolist() for part in rows.arrays(numpy.dtype(numpy.int64), 2 * size)]
        bad = [(i, j, table[i][j], table[j][size + i]) for i in range(size)
               for j in range(size) if table[i][j] != table[j][size + i]]
        if bad:
            pairs = "; ".join(f"rank {pg.ranks[i]} sends {sent} elements to rank "
                              f"{pg.ranks[j]}, which expects {expected}"
                              for i, j, sent, expected in bad)
            raise DistError(
                f"{op} on process group {pg.name!r} (collective {pg._seq}): the ranks' split "
                f"sizes disagree: {pairs} (each rank's input split j must equal rank j's "
                f"output split for it; no data moved, the group can go on)")

    _start(pg, op, fields, payload, describe, check, False)


def fused(pg: "ProcessGroup", op: str, seq: int, fields: list[int],
          payload: torch.Tensor | None, finish: Callable[[Rows], Any] | None,
          describe: Callable[[], str] | None, async_op: bool) -> Any:
    """``op`` done by its row alone: ``payload`` (at most :data:`SLOT` bytes) travels
    with the header, and once the headers agree ``finish`` gets every rank's row
    (:class:`Rows`) to make the result from. Returns what
    ``ProcessGroup._launch`` does (``None``, or a ``Work`` with ``async_op``)."""
    return _start(pg, op, fields, payload, describe, finish, async_op, seq)


class Rows:
    """Every rank's row once the exchange is done: ``array``, the ``size * ROW`` bytes as a
    numpy array (what a small call's result is made from, cheaply), and ``payload()``,
    the ``(size, SLOT)`` payload bytes as a tensor (for dtypes numpy lacks)."""

    __slots__ = ("every", "array", "size")

    def __init__(self, every: torch.Tensor, array: numpy.ndarray, size: int) -> None:
        self.every, self.array, self.size = every, array, size

    def payload(self) -> torch.Tensor:
        return self.every.view(self.size, ROW)[:, HEAD:]

    def arrays(self, dtype: numpy.dtype, count: int) -> list[numpy.ndarray]:
        """Each rank's first ``count`` payload values of ``dtype`` (views)."""
        end = HEAD + count * dtype.itemsize
        return [self.array[r * ROW + HEAD:r * ROW + end].view(dtype) for r in range(self.size)]


# torch dtypes a small call's payload and result move through numpy for (a few µs less
# than torch's per-op dispatch, per op); any other dtype goes through torch
NUMPY = {torch.float32: numpy.dtype(numpy.float32), torch.float64: numpy.dtype(numpy.float64),
         torch.int32: numpy.dtype(numpy.int32), torch.int64: numpy.dtype(numpy.int64),
         torch.uint8: numpy.dtype(numpy.uint8), torch.int8: numpy.dtype(numpy.int8)}


def as_array(t: torch.Tensor) -> numpy.ndarray | None:
    """``t``'s elements as a flat numpy view, when numpy holds its dtype and it is a plain
    contiguous CPU tensor; None otherwise."""
    if t.dtype in NUMPY and t.is_contiguous() and not t.requires_grad and t.device.type == "cpu":
        return t.numpy().reshape(-1)
    return None


def _buffers(pg: "ProcessGroup", size: int, reuse: bool) -> tuple:
    """(row, every, row array, every array): a synchronous call reuses its group's (no
    call of the group runs meanwhile); an asynchronous one gets its own."""
    cached = pg._rows if reuse else None
    if cached is None or cached[1].numel() != size * ROW:
        mine = torch.empty(ROW, dtype=torch.uint8)
        every = torch.empty(size * ROW, dtype=torch.uint8)
        cached = (mine, every, mine.numpy(), every.numpy())
        if reuse:
            pg._rows = cached
    return cached


def _start(pg: "ProcessGroup", op: str, fields: list[int], payload: torch.Tensor | None,
           describe: Callable[[], str] | None, finish: Callable[[Rows], Any] | None,
           async_op: bool, seq: int | None = None) -> Any:
    # kept lean: a small collective's whole cost is this function and one all-gather
    label = _label.get()
    if label is not None:
        fields = fields[:-1] + [label[2]]
    size = pg.size()
    mine, every, mine_np, every_np = _buffers(pg, size, not async_op)
    _PACK.pack_into(mine_np, 0, *fields)
    if payload is not None and payload.numel():
        values = as_array(payload)
        if values is not None:
            data = values.view(numpy.uint8)
            mine_np[HEAD:HEAD + data.size] = data
        else:
            raw = payload.detach().contiguous().view(-1).view(torch.uint8)
            mine[HEAD:HEAD + raw.numel()].copy_(raw)
    pg._checks += 1
    number = pg._checks
    what = op if label is None else f"{op} in {label[0]}"  # a timeout here is the op's
    if seq is None:
        # the collective this row precedes: an eager one has taken its number, a graph's
        # first is the next (a peer that left before it is named after a second)
        seq = pg._seq + 1 if op in _SIGNED else pg._seq

    def post() -> Any:
        view = every_np.data
        first = view[:HEAD]
        if any(view[r * ROW:r * ROW + HEAD] != first for r in range(1, size)):
            heads = [list(_PACK.unpack_from(every_np, r * ROW)) for r in range(size)]
            raise _mismatch(pg, op, heads, describe, label, number)
        return None if finish is None else finish(Rows(every, every_np, size))

    backend = pg._backend
    try:
        return pg._launch(what, seq, lambda: backend._allgather_base(every, mine), async_op,
                          post)
    except DistError as e:
        raise _hinted(e, label) from e


def _wait(work: Any) -> None:
    label = _label.get()
    try:
        work.wait()
    except DistError as e:
        raise _hinted(e, label) from e


def _hinted(e: DistError, label: tuple | None) -> DistError:
    """A timeout or a dead peer met in a labelled call, with the caller's hint."""
    if label is None or not label[1] or "collectives disagree" in str(e):
        return e
    return type(e)(f"{e}; {label[0]}: {label[1]}")


def _mismatch(pg: "ProcessGroup", op: str, rows: list[list[int]],
              describe: Callable[[], str] | None, label: tuple | None,
              number: int) -> DistError:
    """The error for headers that differ: each rank's own words for its call when they
    arrive through the store within a few seconds, else what its header says."""
    me = pg.rank()
    text = describe() if describe is not None else ""
    call = text if op in _SIGNED else f"{op}({text})"
    if label is not None:
        call += f" in {label[0]}" + (f" ({label[1]})" if label[1] else "")
    calls = [_decode(row) for row in rows]
    store = pg.store
    if store is not None:
        try:
            store.set(f"sc/{number}/{me}", call)
            calls = [c.decode() for c in store._multi_get(
                [f"sc/{number}/{r}" for r in range(pg.size())], 5.0)]
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
    if op in _SIGNED:
        return {"graph": "a compiled graph", "buckets": "gradient buckets after backward",
                "inputs": "a model's forward on inputs"}[op] + \
            f" (signature {count & 0xFFFFFFFF:08x})"
    kind = _DTYPES[dtype] if 0 <= dtype < len(_DTYPES) else None
    text = f"{op} of {count} {str(kind).removeprefix('torch.')} elements"
    if root >= 0:
        text += f", root {root}"
    return text + (f" (caller label {label})" if label else "")
