"""Collectives of picklable Python objects, and the barrier that names who is missing.

Objects travel as pickles in byte tensors over the group's backend, so they move at the
backend's speed. Unpickling runs code chosen by the sender: use these only between ranks
of one job, as with ``torch.distributed``.
"""

from __future__ import annotations

import pickle
import time
from datetime import timedelta
from typing import Any

import torch

from spmd.runtime import collectives as C
from spmd.runtime.errors import DistError, DistTimeoutError
from spmd.runtime.groups import resolve_group
from spmd.runtime.process_group import ProcessGroup
from spmd.runtime.store.base import as_seconds

__all__ = ["broadcast_object_list", "all_gather_object", "gather_object",
           "scatter_object_list", "monitored_barrier"]


def _device(pg: ProcessGroup, device: Any = None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if pg.backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode(obj: Any, device: torch.device) -> torch.Tensor:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _decode(t: torch.Tensor, size: int) -> Any:
    return pickle.loads(t[:size].cpu().numpy().tobytes())


def _object_list(items: Any, op: str, name: str) -> list:
    if not isinstance(items, list):
        raise TypeError(f"{op}: {name} must be a list (it is filled in place), got "
                        f"{type(items).__name__}")
    return items


def _pad(payload: torch.Tensor, width: int) -> torch.Tensor:
    padded = torch.zeros(width, dtype=torch.uint8, device=payload.device)
    padded[: payload.numel()] = payload
    return padded


def _encode_padded(pg: ProcessGroup, obj: Any, device: torch.device) -> tuple[torch.Tensor,
                                                                               list[int]]:
    """This rank's pickle padded to the largest of the group's, and every rank's size."""
    payload = _encode(obj, device)
    mine = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    every = torch.empty(pg.size(), dtype=torch.int64, device=device)
    C.all_gather_into_tensor(every, mine, group=pg)
    sizes = every.tolist()
    return _pad(payload, max(sizes)), sizes


def broadcast_object_list(object_list: list, src: int = 0, group: ProcessGroup | None = None,
                          device: Any = None) -> None:
    """Replace ``object_list``'s items on every rank by those of global rank ``src``."""
    pg = resolve_group(group, "broadcast_object_list")
    _object_list(object_list, "broadcast_object_list", "object_list")
    dev = _device(pg, device)
    is_src = pg.group_rank(src, "broadcast_object_list: src") == pg.rank()
    payloads = [_encode(o, dev) for o in object_list] if is_src else []
    sizes = torch.tensor([p.numel() for p in payloads] if is_src else [0] * len(object_list),
                         dtype=torch.int64, device=dev)
    C.broadcast(sizes, src, group=pg)
    data = (torch.cat(payloads) if payloads else torch.empty(0, dtype=torch.uint8, device=dev)
            ) if is_src else torch.empty(int(sizes.sum()), dtype=torch.uint8, device=dev)
    C.broadcast(data, src, group=pg)
    if not is_src:
        offset = 0
        for i, n in enumerate(sizes.tolist()):
            object_list[i] = _decode(data[offset:offset + n], n)
            offset += n


def all_gather_object(object_list: list, obj: Any, group: ProcessGroup | None = None) -> None:
    """``object_list[i]`` becomes the ``obj`` of the group's rank i, on every rank."""
    pg = resolve_group(group, "all_gather_object")
    _object_list(object_list, "all_gather_object", "object_list")
    if len(object_list) != pg.size():
        raise ValueError(f"all_gather_object: object_list has {len(object_list)} items; the "
                         f"group has {pg.size()} ranks")
    dev = _device(pg)
    padded, sizes = _encode_padded(pg, obj, dev)
    width = padded.numel()
    every = torch.empty(width * pg.size(), dtype=torch.uint8, device=dev)
    C.all_gather_into_tensor(every, padded, group=pg)
    for i, n in enumerate(sizes):
        object_list[i] = _decode(every[i * width:(i + 1) * width], n)


def gather_object(obj: Any, object_gather_list: list | None = None, dst: int = 0,
                  group: ProcessGroup | None = None) -> None:
    """The ``obj`` of every rank into ``object_gather_list`` on global rank ``dst``."""
    pg = resolve_group(group, "gather_object")
    root = pg.group_rank(dst, "gather_object: dst")
    if pg.rank() == root:
        _object_list(object_gather_list, "gather_object", "object_gather_list")
        assert object_gather_list is not None
        if len(object_gather_list) != pg.size():
            raise ValueError(f"gather_object: object_gather_list has {len(object_gather_list)} "
                             f"items; the group has {pg.size()} ranks")
    elif object_gather_list is not None:
        raise ValueError(f"gather_object: object_gather_list must be None on ranks other than "
                         f"dst={dst}")
    dev = _device(pg)
    padded, sizes = _encode_padded(pg, obj, dev)
    width = padded.numel()
    outputs = ([torch.empty(width, dtype=torch.uint8, device=dev) for _ in range(pg.size())]
               if pg.rank() == root else None)
    C.gather(padded, outputs, dst, group=pg)
    if outputs is not None and object_gather_list is not None:
        for i, n in enumerate(sizes):
            object_gather_list[i] = _decode(outputs[i], n)


def scatter_object_list(scatter_object_output_list: list, scatter_object_input_list: list | None
                        = None, src: int = 0, group: ProcessGroup | None = None) -> None:
    """Item i of ``scatter_object_input_list`` on ``src`` becomes
    ``scatter_object_output_list[0]`` on the group's rank i."""
    pg = resolve_group(group, "scatter_object_list")
    out = _object_list(scatter_object_output_list, "scatter_object_list",
                       "scatter_object_output_list")
    if not out:
        raise ValueError("scatter_object_list: scatter_object_output_list needs at least one "
                         "slot (Expected argument scatter_object_output_list to be a list of "
                         "size at least 1.)")
    root = pg.group_rank(src, "scatter_object_list: src")
    dev = _device(pg)
    if pg.rank() == root:
        items = _object_list(scatter_object_input_list, "scatter_object_list",
                             "scatter_object_input_list")
        if len(items) != pg.size():
            raise ValueError(f"scatter_object_list: scatter_object_input_list has {len(items)} "
                             f"items; the group has {pg.size()} ranks")
        payloads = [_encode(o, dev) for o in items]
        meta = torch.tensor([max(p.numel() for p in payloads)] + [p.numel() for p in payloads],
                            dtype=torch.int64, device=dev)
    else:
        meta = torch.zeros(pg.size() + 1, dtype=torch.int64, device=dev)
    C.broadcast(meta, src, group=pg)
    width = int(meta[0])
    chunks = [_pad(p, width) for p in payloads] if pg.rank() == root else None
    mine = torch.empty(width, dtype=torch.uint8, device=dev)
    C.scatter(mine, chunks, src, group=pg)
    out[0] = _decode(mine, int(meta[1 + pg.rank()]))


def monitored_barrier(group: ProcessGroup | None = None, timeout: timedelta | None = None,
                      wait_all_ranks: bool = False) -> None:
    """A barrier that names the ranks that did not arrive.

    The group's first rank collects arrivals through the store; if some rank is missing
    after ``timeout`` (default: the group's), every arrived rank raises
    ``DistTimeoutError`` naming the first missing rank, or all of them with
    ``wait_all_ranks=True``. Works on every backend.
    """
    pg = resolve_group(group, "monitored_barrier")
    seconds = pg.timeout.total_seconds() if timeout is None else as_seconds(timeout)
    if not isinstance(wait_all_ranks, bool):
        raise TypeError("monitored_barrier: wait_all_ranks must be a bool")
    seq = pg._begin("monitored_barrier", lambda: "")
    store = pg._store
    assert store is not None
    prefix = f"mb/{seq}"
    result_key = f"{prefix}/result"
    if pg.rank() == 0:
        deadline = time.monotonic() + seconds
        missing = []
        for r in range(1, pg.size()):
            key = f"{prefix}/arrived/{r}"
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise DistTimeoutError("deadline")
                store.wait([key], timedelta(seconds=left))
                store.delete_key(key)
            except DistTimeoutError:
                missing.append(pg.ranks[r])
                if not wait_all_ranks:
                    break
        if missing:
            names = ", ".join(map(str, missing))
            message = (f"monitored_barrier on process group {pg.name!r}: "
                       f"{'Rank' if len(missing) == 1 else 'Ranks'} {names} failed to pass "
                       f"monitoredBarrier in {seconds * 1000:g} ms (rank {names} did not arrive "
                       f"within the {seconds:g}s timeout)")
            store.set(result_key, message)
            raise DistTimeoutError(message)
        if pg._barrier_seq:  # everyone arrived here, so has read the last barrier's answer
            store.delete_key(f"mb/{pg._barrier_seq}/result")
        pg._barrier_seq = seq
        store.set(result_key, b"ok")
        return
    store.set(f"{prefix}/arrived/{pg.rank()}", b"1")
    try:
        store.wait([result_key], timedelta(seconds=seconds + 5.0))
    except DistTimeoutError:
        raise DistTimeoutError(
            f"monitored_barrier on process group {pg.name!r}: rank {pg.ranks[0]}, which "
            f"monitors the barrier, did not answer within {seconds + 5:g}s (the barrier's "
            f"timeout and 5s)") from None
    answer = store.get(result_key)
    if answer != b"ok":
        raise DistTimeoutError(answer.decode()) if b"did not arrive" in answer else DistError(
            answer.decode())
