"""``RemoteModule``: a module built on another worker and called like a local one, as
``torch.distributed.nn.RemoteModule`` (the embedding table on a parameter server in the
tutorial "Combining Distributed DataParallel with Distributed RPC Framework").

    emb = RemoteModule("ps/cpu", nn.EmbeddingBag, args=(100, 16), kwargs={"mode": "sum"})
    out = emb(indices, offsets)                    # runs on "ps"; differentiable inside
                                                   # dist_autograd.context()
    opt = DistributedOptimizer(optim.SGD, emb.remote_parameters(), lr=0.05)

``forward`` is an ``rpc_sync`` to the owner, ``forward_async`` an ``rpc_async``: inside a
distributed-autograd context both record the send and the reply, so
``dist_autograd.backward`` reaches the remote module's parameters, whose gradients stay
in the owner's context for ``DistributedOptimizer``. Methods that would need the module
here (``parameters()``, ``state_dict()``, ``to()``, ...) raise, naming the remote way.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from spmd.runtime.rpc import api
from spmd.runtime.rpc.rref import RRef

__all__ = ["RemoteModule"]


class NotAModuleError(TypeError, ValueError):
    """module_cls built something that is not an nn.Module: a ``TypeError``, and the
    ``ValueError`` torch raises there."""


def _create(module_cls: Callable[..., nn.Module], args: tuple, kwargs: dict,
            device: str) -> nn.Module:
    module = module_cls(*args, **kwargs)
    if not isinstance(module, nn.Module):
        raise NotAModuleError(f"RemoteModule: module_cls must build an nn.Module, got "
                              f"{type(module).__name__} (Expect `module_cls(*args, **kwargs)` "
                              f"returns an instance of <class nn.Module>, but it returns an "
                              f"instance of {type(module)}.)")
    return module.to(device)


def _forward(rref: RRef, args: tuple, kwargs: dict) -> Any:
    return rref.local_value()(*args, **kwargs)


def _parameter_rrefs(rref: RRef, recurse: bool) -> list[RRef]:
    return [RRef(p) for p in rref.local_value().parameters(recurse)]


def _call_method(rref: RRef, name: str, args: tuple, kwargs: dict) -> Any:
    return getattr(rref.local_value(), name)(*args, **kwargs)


def _parse(remote_device: str) -> tuple[str | int, str]:
    """``"worker/device"``, ``"rank:N/device"`` or a bare worker name -> (worker, device)."""
    if not isinstance(remote_device, str) or not remote_device:
        raise TypeError(f"RemoteModule: remote_device must be a str like 'worker1/cpu' or "
                        f"'rank:1/cuda:0', got {remote_device!r}")
    worker, _, device = remote_device.partition("/")
    device = device or "cpu"
    try:
        torch.device(device)
    except RuntimeError:
        raise ValueError(f"RemoteModule: {device!r} in remote_device {remote_device!r} is not "
                         f"a device") from None
    if worker.startswith("rank:"):
        number = worker[5:]
        if not number.isdigit():
            raise ValueError(f"RemoteModule: {worker!r} in remote_device {remote_device!r} is "
                             f"not 'rank:<number>'")
        return int(number), device
    if not worker:
        raise ValueError(f"RemoteModule: remote_device {remote_device!r} names no worker")
    return worker, device


class RemoteModule(nn.Module):
    """A module of class ``module_cls`` built on the worker ``remote_device`` names, with
    ``module_cls(*args, **kwargs)``, and moved to that device.

    Args:
        remote_device: ``"<worker name>/<device>"`` or ``"rank:<n>/<device>"`` (the device
            defaults to ``cpu``).
        module_cls: the module's class (or any callable returning an ``nn.Module``); it
            must be importable on the remote worker.
        args, kwargs: its constructor's arguments.
    """

    def __init__(self, remote_device: str, module_cls: Callable[..., nn.Module],
                 args: tuple | None = None, kwargs: dict | None = None) -> None:
        super().__init__()
        self.on, self.device = _parse(remote_device)
        if not callable(module_cls):
            raise TypeError(f"RemoteModule: module_cls must be callable, got "
                            f"{type(module_cls).__name__}")
        self.module_rref = api.remote(self.on, _create, args=(
            module_cls, tuple(args or ()), dict(kwargs or {}), self.device))
        self.module_rref.to_here()  # built (or its constructor's error raised) here, now

    @classmethod
    def init_from_module_rref(cls, remote_device: str, module_rref: RRef,
                              _module_interface_cls: Any = None) -> "RemoteModule":
        """A ``RemoteModule`` over an existing module RRef, as torch's: it shares the module
        with whoever holds the RRef (every handle calls the same remote module). Calls go
        to the RRef's owner; ``remote_device`` gives the device, as in the constructor.

        Example::

            other = rpc.rpc_sync("worker2", RemoteModule.init_from_module_rref,
                                 ("worker2", remote_module.get_module_rref()))
        """
        _, device = _parse(remote_device)
        if not isinstance(module_rref, RRef):
            raise TypeError(f"RemoteModule.init_from_module_rref: module_rref must be an RRef, "
                            f"got {type(module_rref).__name__}")
        if _module_interface_cls is not None:
            raise ValueError("RemoteModule.init_from_module_rref: _module_interface_cls is "
                             "TorchScript's module interface, which this runtime does not "
                             "compile; leave it None")
        return _rebuild(module_rref.owner_name(), device, module_rref)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return api.rpc_sync(self.on, _forward, args=(self.module_rref, args, kwargs))

    def forward_async(self, *args: Any, **kwargs: Any) -> torch.futures.Future:
        return api.rpc_async(self.on, _forward, args=(self.module_rref, args, kwargs))

    def remote_parameters(self, recurse: bool = True) -> list[RRef]:
        """RRefs to the remote module's parameters (for ``DistributedOptimizer``)."""
        return api.rpc_sync(self.on, _parameter_rrefs, args=(self.module_rref, recurse))

    def get_module_rref(self) -> RRef:
        """The RRef of the remote module itself."""
        return self.module_rref

    def train(self, mode: bool = True) -> "RemoteModule":
        api.rpc_sync(self.on, _call_method, args=(self.module_rref, "train", (mode,), {}))
        self.training = mode
        return self

    def eval(self) -> "RemoteModule":
        return self.train(False)

    def __repr__(self) -> str:
        return f"RemoteModule(on={self.on!r}, device={self.device!r})"

    def __reduce__(self) -> tuple:
        """Sent over RPC (an argument, a return value), it arrives as a handle to the same
        remote module, as torch's does."""
        return _rebuild, (self.on, self.device, self.module_rref)


def _rebuild(on: str | int, device: str, rref: RRef) -> RemoteModule:
    module = RemoteModule.__new__(RemoteModule)
    nn.Module.__init__(module)
    module.on, module.device, module.module_rref = on, device, rref
    return module


def _refuse(name: str) -> Callable[..., Any]:
    hint = ". Please use ``remote_parameters`` instead" if name == "parameters" else ""

    def method(self: RemoteModule, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(f"Method ``{name}`` not supported for RemoteModule{hint} (the module "
                         f"lives on {self.on!r}; use remote_parameters() or get_module_rref())")
    method.__name__ = name
    return method


for _name in ("parameters", "named_parameters", "buffers", "named_buffers", "children",
              "named_children", "modules", "named_modules", "state_dict", "load_state_dict",
              "to", "cuda", "cpu", "type", "float", "double", "half", "bfloat16",
              "requires_grad_", "zero_grad", "share_memory", "apply",
              "register_buffer", "register_parameter", "add_module", "ipu", "xpu",
              "register_backward_hook", "register_forward_pre_hook", "register_forward_hook",
              "extra_repr"):
    setattr(RemoteModule, _name, _refuse(_name))
