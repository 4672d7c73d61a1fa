"""The module attribute of a parameter stored in pieces, as eager code sees it.

With ``fsdp``/``hsdp`` or tensor parallelism ``model.fc.weight`` is the whole parameter
gathered from every rank's piece: a new tensor. Code that writes into it in place after
``parallelize`` (``nn.init.*_``, ``reset_parameters()``, ``weight.zero_()`` or
``weight.data.copy_(w)`` under ``no_grad``, ``weight.data = w``) would change that copy and
lose the write.
In eager code the attribute is therefore a :class:`WriteThrough` tensor: every in-place
op on it, or on a view of it (``weight[0].fill_(1)``, ``weight.data``, ``weight.t()``),
is written back to this rank's piece. Every rank runs the same code on the same whole
tensor, so each keeps its own part of what one process would have computed (random
init included, given the same seed on every rank).

Compiled graphs never see it (Dynamo traces the plain gather), and an in-place write with
autograd on raises as it would on the parameter itself, naming it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

__all__ = ["WriteThrough", "write_through"]

_INPLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__",
                    "__ifloordiv__", "__imod__", "__ipow__", "__iand__", "__ior__",
                    "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}


def _inplace(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    return name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("__"))


class WriteThrough(torch.Tensor):
    """A whole parameter (or a view of one) whose in-place writes reach the stored piece.

    ``_spmd_root`` is the whole tensor the write-back reads, ``_spmd_store`` writes it
    to this rank's piece, ``_spmd_name`` names the parameter in errors.
    """

    _spmd_root: torch.Tensor
    _spmd_store: Callable[[torch.Tensor, torch.Tensor | None], None]
    _spmd_name: str
    _spmd_partial_writes: bool  # store only the changed elements (see write_through)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if (getattr(func, "__self__", None) is _DATA and func.__name__ == "__set__"
                and isinstance(args[0], WriteThrough)):
            return _set_data(*args)
        # the tensor written: a method's self, or (``nn.init`` passes it by keyword) the
        # first keyword's
        target = args[0] if args else next(iter(kwargs.values()), None)
        out_arg = kwargs.get("out")
        written = [t for t in (target, out_arg) if isinstance(t, WriteThrough)
                   and (t is out_arg or _inplace(func))]
        for t in written:  # nn.init's functions write under no_grad themselves
            if (torch.is_grad_enabled() and t.requires_grad
                    and getattr(func, "__module__", "") != "torch.nn.init"):
                raise RuntimeError(
                    f"{t._spmd_name}: a parameter that requires grad is being written in "
                    f"place (as torch refuses for a leaf); write it under torch.no_grad()")
        before = [(t, t._spmd_root.detach().clone()) for t in written
                  if t._spmd_partial_writes]
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
            for t in written:
                old = next((b for w, b in before if w is t), None)
                t._spmd_store(t._spmd_root.detach(), old)
        if isinstance(target, WriteThrough):
            out = pytree.tree_map_only(torch.Tensor, lambda o: _alias(o, target), out)
        return out


_DATA = torch.Tensor.data  # its setter reaches __torch_function__ as _DATA.__set__


def _set_data(target: WriteThrough, value: Any) -> None:
    """``weight.data = tensor`` (loading weights the old way): the whole parameter's new
    values, stored into this rank's piece; a view's ``.data`` or another shape is
    refused, naming the parameter (the assignment would otherwise replace a temporary
    gathered copy and be lost)."""
    with torch._C.DisableTorchFunctionSubclass():
        root = target._spmd_root
        whole = (target.shape == root.shape and target.data_ptr() == root.data_ptr()
                 and target.stride() == root.stride())
        if not isinstance(value, torch.Tensor) or not whole or value.shape != root.shape:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
            raise RuntimeError(
                f"{target._spmd_name}.data = {shape}: a parameter stored in pieces takes a "
                f"new value for the whole tensor {tuple(root.shape)} through .data (or "
                f"copy_ under torch.no_grad()); assigning .data to a view or another "
                f"shape would be lost")
        target._spmd_store(value.detach().to(root.dtype), None)


def _alias(out: torch.Tensor, source: WriteThrough) -> torch.Tensor:
    """``out`` as a write-through view when it shares the parameter's memory."""
    if out is source or isinstance(out, WriteThrough):
        return out
    with torch._C.DisableTorchFunctionSubclass():
        root = source._spmd_root
        # the same storage, not the same address: every meta tensor's address is 0
        shares = (out.device == root.device and out.layout is torch.strided
                  and out.untyped_storage()._cdata == root.untyped_storage()._cdata)
    if not shares:
        return out
    view = out.as_subclass(WriteThrough)
    view._spmd_root, view._spmd_store = source._spmd_root, source._spmd_store
    view._spmd_name, view._spmd_partial_writes = source._spmd_name, source._spmd_partial_writes
    return view


def write_through(whole: torch.Tensor, store: Callable[[torch.Tensor, torch.Tensor | None], None],
                  name: str, stored_dtype: torch.dtype) -> torch.Tensor:
    """``whole`` (a parameter gathered from its pieces) as a :class:`WriteThrough`.

    ``store(values, changed)`` writes a whole tensor's values back to this rank's piece:
    all of them (``changed`` None) or where the boolean ``changed`` is set. Gathered in
    another dtype than stored (``param_dtype``), only the elements a write changed are
    stored, so the rest keep their full precision.
    """
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    if (torch.compiler.is_compiling() or type(whole) is not torch.Tensor
            or _get_current_dispatch_mode_stack()):
        return whole  # traced (Dynamo, make_fx, fake tensors): the plain gather

    def store_changed(new: torch.Tensor, old: torch.Tensor | None) -> None:
        with torch.no_grad():
            changed = None if old is None else (new != old) | (new.isnan() & ~old.isnan())
            store(new.to(stored_dtype), changed)

    out = whole.as_subclass(WriteThrough)
    out._spmd_root = whole.as_subclass(torch.Tensor)
    out._spmd_store, out._spmd_name = store_changed, name
    out._spmd_partial_writes = whole.dtype != stored_dtype
    return out
