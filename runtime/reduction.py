"""Reduction operators, as ``torch.distributed.ReduceOp`` names them."""

from __future__ import annotations

import enum

import torch
import torch.distributed as _dist

__all__ = ["ReduceOp"]


class UnsupportedComplexOpError(TypeError, ValueError):
    """MIN, MAX or PRODUCT asked of complex tensors: a ``TypeError`` as our other dtype
    refusals are, and the ``ValueError`` torch raises there."""


class ReduceOp(enum.Enum):
    """How collectives combine the ranks' values.

    ``AVG`` works on every backend: where the backend has no average (older Gloo), the
    sum is divided by the group size after the collective. ``BAND``, ``BOR`` and ``BXOR``
    take integer or bool tensors only.
    """

    SUM = "SUM"
    PRODUCT = "PRODUCT"
    MIN = "MIN"
    MAX = "MAX"
    AVG = "AVG"
    BAND = "BAND"
    BOR = "BOR"
    BXOR = "BXOR"

    def __repr__(self) -> str:
        return f"ReduceOp.{self.name}"

    @classmethod
    def of(cls, op: object) -> "ReduceOp":
        """Ours from ours, from ``torch.distributed.ReduceOp``, or from a name."""
        if isinstance(op, cls):
            return op
        if isinstance(op, str) and op.upper() in cls.__members__:
            return cls[op.upper()]
        name = getattr(op, "name", None)  # torch's RedOpType members
        if name is None and isinstance(op, _dist.ReduceOp):
            name = str(op).rsplit(".", 1)[-1]
        if isinstance(name, str) and name in cls.__members__:
            return cls[name]
        raise TypeError(f"op must be a ReduceOp (SUM, PRODUCT, MIN, MAX, AVG, BAND, BOR, BXOR), "
                        f"got {op!r}")

    def check_dtype(self, dtype: torch.dtype, what: str) -> None:
        """Raise ``TypeError`` when this op is undefined for ``dtype``."""
        if self in _BITWISE and dtype.is_complex:
            raise UnsupportedComplexOpError(
                f"{what}: ReduceOp.{self.name} needs an integer or bool tensor, got {dtype}: "
                f"{what} does not support {self.name} on complex tensors")
        if self in _BITWISE and dtype.is_floating_point:
            raise TypeError(f"{what}: ReduceOp.{self.name} needs an integer or bool tensor, "
                            f"got {dtype}")
        if self is ReduceOp.AVG and not (dtype.is_floating_point or dtype.is_complex):
            raise TypeError(f"{what}: ReduceOp.AVG needs a floating-point or complex tensor "
                            f"(an integer average is not exact), got {dtype}")
        if self in (ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT) and dtype.is_complex:
            raise UnsupportedComplexOpError(
                f"{what}: ReduceOp.{self.name} is not supported for complex tensors (they "
                f"travel as pairs of reals): {what} does not support {self.name} on complex "
                f"tensors")

    def to_torch(self) -> _dist.ReduceOp:
        return getattr(_dist.ReduceOp, self.name)


_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)
