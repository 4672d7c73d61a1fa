"""Argument checks shared by every kernel: they run before any work, on both paths, so
a call that fails on a GPU fails the same way on a CPU."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from spmd.kernels.layout import MAX_DIMS, SUPPORTED_DTYPES, collapse, overlaps_itself

_DTYPE_NAMES = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)


def tensor_list(fn: str, name: str, tensors: Any) -> list[torch.Tensor]:
    """``tensors`` as a list, after checking every element is a tensor."""
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"{fn}: {name} must be a list or tuple of tensors, "
                        f"got {type(tensors).__name__}")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name}[{i}] is a {type(t).__name__}, not a tensor")
    return list(tensors)


def dtype(fn: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{fn}: {name} is {t.dtype}; the kernels take {_DTYPE_NAMES}")


def dtype_arg(fn: str, value: object) -> None:
    if value not in SUPPORTED_DTYPES:
        raise TypeError(f"{fn}: dtype={value} is not supported; the kernels take {_DTYPE_NAMES}")


def same_device(fn: str, device: torch.device, name: str, t: torch.Tensor) -> None:
    if t.device != device:
        raise ValueError(f"{fn}: {name} is on {t.device}, expected {device} like the others")


def strided(fn: str, name: str, t: torch.Tensor, *, written: bool) -> None:
    """A tensor the copy kernels can walk: at most MAX_DIMS dimensions once merged, and,
    when it is written, no two elements sharing memory."""
    if t.is_contiguous():
        return  # one dimension once merged, no element shared: the common case, cheaply
    sizes, strides = collapse(t)
    if len(sizes) > MAX_DIMS:
        raise ValueError(f"{fn}: {name} (shape {tuple(t.shape)}, stride {t.stride()}) walks "
                         f"memory in {len(sizes)} dimensions, more than {MAX_DIMS}; pass "
                         f"{name}.contiguous()")
    if written and overlaps_itself(sizes, strides):
        raise ValueError(f"{fn}: {name} (shape {tuple(t.shape)}, stride {t.stride()}) has "
                         f"elements that share memory (an expanded view?); cannot write it")


def contiguous(fn: str, name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{fn}: {name} (shape {tuple(t.shape)}, stride {t.stride()}) is not "
                         f"contiguous; the flat optimizer steps need contiguous tensors")


def flat(fn: str, name: str, t: Any, needed: int) -> torch.Tensor:
    """A 1-D, stride-1 buffer holding at least ``needed`` elements."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a tensor, got {type(t).__name__}")
    dtype(fn, name, t)
    if t.dim() != 1 or (t.numel() > 1 and t.stride(0) != 1):
        raise ValueError(f"{fn}: {name} must be a 1-D contiguous buffer, got shape "
                         f"{tuple(t.shape)} with stride {t.stride()}")
    if t.numel() < needed:
        raise ValueError(f"{fn}: {name} holds {t.numel()} elements but the tensors need "
                         f"{needed}")
    return t


def scalar(fn: str, name: str, value: Any) -> float:
    """A Python number, or a one-element tensor (as torch.optim allows for ``lr``), as float.
    Reading a CUDA tensor waits for the device."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{fn}: {name} must be a number, got {type(value).__name__}")
    return float(value)
