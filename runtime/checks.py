"""Argument checks shared by every operation: bad input fails here, before any byte moves."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from spmd.runtime.process_group import ProcessGroup

__all__ = ["tensor", "tensor_list", "contiguous", "same_dtype", "describe", "wire"]

# What Gloo moves (measured on torch 2.13: int16, the unsigned types above uint8 and the
# float8 types raise "Invalid scalar type" inside Gloo). Complex tensors travel as their
# real view, so they are accepted too.
GLOO_DTYPES = frozenset({
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool,
})


def tensor(t: Any, op: str, pg: ProcessGroup, name: str = "tensor") -> torch.Tensor:
    """A dense tensor on a device the group's backend can use."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if pg.backend == "gloo" and t.is_cpu and t.dtype in GLOO_DTYPES and t.layout is torch.strided:
        return t  # the common case in one line
    if t.layout is not torch.strided:
        raise TypeError(f"{op}: {name} is a {t.layout} tensor; only dense (strided) tensors "
                        f"are supported")
    device = t.device.type
    if pg.backend == "gloo" and device != "cpu":
        raise ValueError(f"{op}: {name} is on {t.device}, but process group {pg.name!r} uses "
                         f"Gloo, which takes CPU tensors; move it with .cpu() or use 'nccl'")
    if pg.backend == "nccl" and device != "cuda":
        raise ValueError(f"{op}: {name} is on {t.device}, but process group {pg.name!r} uses "
                         f"NCCL, which takes CUDA tensors")
    if pg.backend == "gloo" and t.dtype not in GLOO_DTYPES and not t.is_complex():
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in GLOO_DTYPES))
        raise TypeError(f"{op}: Gloo cannot move {t.dtype} tensors ({name}); cast to one of "
                        f"{names}")
    return t


def wire(t: torch.Tensor) -> torch.Tensor:
    """What the backend is handed: complex tensors as their (shared-storage) real view."""
    return torch.view_as_real(t) if t.is_complex() else t


def contiguous(t: torch.Tensor, op: str, name: str = "tensor") -> None:
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous (call .contiguous() first); "
                         f"got shape {tuple(t.shape)} with strides {t.stride()}")


def tensor_list(
    items: Any, op: str, pg: ProcessGroup, name: str, like: torch.Tensor | None = None,
    length: int | None = None,
) -> list[torch.Tensor]:
    """A list of ``length`` dense tensors, each with ``like``'s dtype and number of elements."""
    if isinstance(items, torch.Tensor) or not isinstance(items, (list, tuple)):
        raise TypeError(f"{op}: {name} must be a list of tensors, got {type(items).__name__}")
    n = pg.size() if length is None else length
    if len(items) != n:
        raise ValueError(f"{op}: {name} has {len(items)} tensors; process group {pg.name!r} has "
                         f"{pg.size()} ranks, so it needs {n}")
    for i, t in enumerate(items):
        tensor(t, op, pg, f"{name}[{i}]")
        if like is not None:
            if t.dtype != like.dtype:
                raise TypeError(f"{op}: {name}[{i}] is {t.dtype} but the tensor is {like.dtype}")
            if t.numel() != like.numel():
                raise ValueError(f"{op}: {name}[{i}] has shape {tuple(t.shape)} but the tensor has "
                                 f"shape {tuple(like.shape)}")
    return list(items)


def same_dtype(output: torch.Tensor, input: torch.Tensor, op: str, output_name: str = "output",
               input_name: str = "input") -> None:
    if output.dtype != input.dtype:
        raise TypeError(f"{op}: {output_name} is {output.dtype} but {input_name} is "
                        f"{input.dtype}")


def describe(tensors: Sequence[torch.Tensor] | torch.Tensor) -> str:
    """Shapes and dtypes, for debug-mode fingerprints."""
    if isinstance(tensors, torch.Tensor):
        return f"{tuple(tensors.shape)}:{str(tensors.dtype).removeprefix('torch.')}"
    return "[" + ", ".join(describe(t) for t in tensors) + "]"
