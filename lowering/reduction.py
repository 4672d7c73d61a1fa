"""How a bucket of gradients is all-reduced: the backend's all-reduce, ours (low-precision
wire, float32 addition), or the user's communication hook.

- ``native``: the backend's all-reduce on the packed bucket, in the wire dtype.
- ``hierarchical``: ``spmd.runtime.all_reduce_hierarchical``: within each host, across
  hosts on a share of the bytes, within again; where the group spans hosts and the cost
  model prices it below the flat ring (``spmd.lowering.collectives``).
- ``fp32``: ``spmd.runtime.all_reduce_compressed``: sent in a low-precision ``reduce_dtype``
  by all-to-all, added in float32 by ``spmd.kernels.reduce_chunks``, all-gathered. The
  planner takes it where the backend would round partial sums in the wire dtype (bfloat16
  or float16 over more than 2 ranks, a ``reduce_dtype`` or the parameters' own: ``p - 1``
  roundings, an error that grows with the ranks) or cannot add at all (float8); over 2 ranks one addition rounds once either way,
  and the backend's single collective is kept.
- a communication hook with torch's DDP signature, ``hook(state, bucket) -> Future``
  (``torch.distributed.algorithms.ddp_comm_hooks``: ``bf16_compress_hook``,
  ``powerSGD_hook`` with its ``PowerSGDState``, or the user's own), given a
  :class:`GradBucket` over the packed, unscaled bucket as torch's DDP gives it; the
  future's tensor is the reduced bucket.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from spmd.lowering.flat import views
from spmd.runtime import collectives
from spmd.runtime.compressed import FLOAT8_DTYPES as FP8, all_reduce_compressed

__all__ = ["choose", "start", "start_bucket", "GradBucket", "HookWork", "check_hook", "FP8"]



def choose(wire: torch.dtype, dtype: torch.dtype, ranks: int) -> tuple[str, str]:
    """(``"native"`` or ``"fp32"``, why) for a bucket of ``dtype`` gradients sent in
    ``wire`` over ``ranks`` ranks."""
    if wire in FP8:
        return "fp32", (f"{str(wire)[6:]} on the wire: backends cannot add float8; sent by "
                        f"all-to-all with a scale per chunk, added in float32 "
                        f"(spmd.kernels.reduce_chunks), all-gathered")
    if wire.itemsize >= 4:  # float32 (or wider) sums: the backend's all-reduce
        return "native", ""
    if ranks <= 2:
        return "native", (f"{str(wire)[6:]} on the wire over {ranks} ranks: one addition, "
                          f"rounded once either way; the backend's all-reduce")
    return "fp32", (f"{str(wire)[6:]} on the wire over {ranks} ranks: the backend's all-reduce "
                    f"would round {ranks - 1} partial sums to {str(wire)[6:]}; sent by "
                    f"all-to-all, added in float32 (spmd.kernels.reduce_chunks), all-gathered: "
                    f"one rounding")


def _combine(chunks: torch.Tensor, scales: torch.Tensor | None, scale: float) -> torch.Tensor:
    from spmd.kernels import reduce_chunks

    return reduce_chunks(chunks, scales=scales, scale=scale, dtype=torch.float32)


def start(flat: torch.Tensor, group: Any, algorithm: str, wire: torch.dtype | None) -> Any:
    """Start all-reducing (summing) the packed ``flat``; the work to wait on."""
    if algorithm == "fp32":
        return all_reduce_compressed(flat, group=group, async_op=True, wire_dtype=wire,
                                     combine=_combine)
    if algorithm == "hierarchical":
        from spmd.runtime.hierarchical import all_reduce_hierarchical

        return all_reduce_hierarchical(flat, group=group, async_op=True)
    return collectives.all_reduce(flat, group=group, async_op=True)


def start_bucket(spec: Any, flat: torch.Tensor, grads: list[torch.Tensor]) -> Any:
    """Start reducing a planned bucket (a ``CollectiveSpec``, its packed buffer and the
    gradients packed in it) as the spec and its owner's hook say; the work to wait on."""
    sync = spec.sync
    if sync is not None and sync.comm_hook is not None:
        bucket = GradBucket(spec.index, flat, [], views(flat, grads), spec.last)
        return run_hook(sync.comm_hook, sync.comm_state, bucket)
    return start(flat, spec.group, spec.algorithm, spec.compress)


class GradBucket:
    """A bucket as torch's DDP hands it to a communication hook
    (``torch.distributed.GradBucket``'s methods): the flat buffer of this rank's summed,
    unscaled gradients, its index (stable from step to step, so hooks keep state per
    bucket, as PowerSGD's error feedback does), whether it is the step's last, and the
    parameters and gradients it holds."""

    def __init__(self, index: int, buffer: torch.Tensor, params: list[torch.Tensor],
                 grads: list[torch.Tensor], last: bool) -> None:
        self._index, self._buffer, self._last = index, buffer, last
        self._params, self._grads = params, grads

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer.copy_(buffer)

    def gradients(self) -> list[torch.Tensor]:
        return list(self._grads)

    def parameters(self) -> list[torch.Tensor]:
        return list(self._params)

    def is_last(self) -> bool:
        return self._last

    def __repr__(self) -> str:
        return f"GradBucket(index={self._index}, numel={self._buffer.numel()})"


class HookWork:
    """A communication hook's future, waited on like a collective's work: the reduced
    bucket is written back into the buffer the graph reads."""

    def __init__(self, future: Any, buffer: torch.Tensor, name: str) -> None:
        self._future, self._buffer, self._name = future, buffer, name

    def wait(self, timeout: Any = None) -> bool:
        value = self._future.wait()
        if isinstance(value, (list, tuple)) and len(value) == 1:
            value = value[0]
        if not isinstance(value, torch.Tensor) or value.numel() != self._buffer.numel():
            raise TypeError(f"communication hook {self._name}: its future must hold the "
                            f"reduced bucket, a tensor of {self._buffer.numel()} elements; got "
                            f"{type(value).__name__}"
                            + (f" of {value.numel()}" if isinstance(value, torch.Tensor)
                               else ""))
        if value.data_ptr() != self._buffer.data_ptr():
            self._buffer.copy_(value.view(self._buffer.shape))
        return True

    def get_future(self) -> Any:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()


def run_hook(hook: Callable, state: Any, bucket: GradBucket) -> HookWork:
    """Call ``hook(state, bucket)``; ``TypeError`` if it does not return a future."""
    future = hook(state, bucket)
    if not hasattr(future, "wait"):
        raise TypeError(f"communication hook {_name(hook)} must return a torch.futures.Future "
                        f"(as torch's DDP hooks do), got {type(future).__name__}")
    return HookWork(future, bucket.buffer(), _name(hook))


def _name(hook: Callable) -> str:
    return getattr(hook, "__qualname__", getattr(hook, "__name__", repr(hook)))


def check_hook(hook: Any, where: str) -> None:
    """``TypeError`` unless ``hook`` can be called as ``hook(state, bucket)``."""
    import inspect

    if not callable(hook):
        raise TypeError(f"{where}: comm_hook must be callable as hook(state, bucket) -> "
                        f"torch.futures.Future, got {type(hook).__name__}")
    try:
        inspect.signature(hook).bind(None, None)
    except TypeError:
        raise TypeError(f"{where}: comm_hook {_name(hook)} must take two arguments (state, "
                        f"bucket), as torch's DDP communication hooks do") from None
    except ValueError:  # a builtin without a signature: trust it
        pass
