"""Which implementation runs a kernel: Triton on CUDA, the plain-torch reference elsewhere.

=================  ========  ==========================================================
variable           default   meaning
=================  ========  ==========================================================
``SPMD_KERNELS``   ``auto``  ``auto``: Triton on CUDA tensors, torch elsewhere;
                             ``torch``: the torch reference everywhere;
                             ``triton``: Triton everywhere (CPU tensors run in Triton's
                             interpreter, which is how the tests check the kernels)
=================  ========  ==========================================================

Triton is imported here, lazily, the first time a Triton kernel is launched: ``import
spmd.kernels`` and every call that takes the torch path never import it.

A ``@triton.jit`` kernel is launched in the form its tensors' device needs: compiled on
CUDA, interpreted on CPU. Triton 3.9 decides between the two when the decorator runs,
from ``TRITON_INTERPRET`` (``triton.knobs.runtime.interpret``); left at that, one process
could not run the interpreted CPU tests and the compiled GPU tests side by side, and an
interpreted kernel cannot follow the raw CUDA addresses in our pointer tables. So when a
kernel module's form does not suit the device, ``launchable`` executes that module's file
a second time, with the variable set the other way, and launches the kernel of that copy
(``@triton.jit`` helpers, its own or imported from another kernel module, in the same form).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import threading
from types import ModuleType
from typing import Any

import torch

__all__ = ["kernels_setting", "implementation", "launchable", "on_device"]

log = logging.getLogger("spmd.kernels")

ENV = "SPMD_KERNELS"
SETTINGS = ("auto", "torch", "triton")

_forms: dict[tuple[str, bool], ModuleType] = {}
_forms_lock = threading.RLock()


def kernels_setting() -> str:
    """The kernel choice from ``SPMD_KERNELS``: ``"auto"`` (unset or empty), ``"torch"`` or
    ``"triton"``. Read on every call, so a test can change it with ``monkeypatch.setenv``.

    Example::

        >>> os.environ["SPMD_KERNELS"] = "torch"
        >>> kernels_setting()
        'torch'
    """
    raw = os.environ.get(ENV, "").strip().lower() or "auto"
    if raw not in SETTINGS:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: expected one of {', '.join(SETTINGS)}")
    return raw


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def implementation(device: torch.device | str) -> str:
    """``"triton"`` or ``"torch"``: what ``pack``, ``unpack`` and the optimizer steps use for
    tensors on ``device``, given ``SPMD_KERNELS``.

    ``auto`` picks Triton on CUDA (when Triton is installed) and torch elsewhere; ``triton``
    forces Triton on CUDA and CPU (interpreted there) and rejects other devices.

    Example::

        >>> implementation("cpu")
        'torch'
        >>> implementation(torch.device("cuda", 0))   # with SPMD_KERNELS unset
        'triton'
    """
    device = torch.device(device)
    setting = kernels_setting()
    if setting == "torch":
        return "torch"
    if setting == "triton":
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"{ENV}=triton: Triton kernels run on cuda (compiled) and cpu "
                             f"(interpreted), not on {device.type}; unset {ENV} to use torch")
        if not _triton_installed():
            raise RuntimeError(f"{ENV}=triton but triton is not installed")
        return "triton"
    return "triton" if device.type == "cuda" and _triton_installed() else "torch"


def launchable(kernel: Any, device: torch.device) -> Any:
    """The form of ``kernel`` (a ``@triton.jit`` function) that runs on ``device``:
    compiled for CUDA, interpreted for CPU."""
    from triton.runtime.interpreter import InterpretedFunction

    interpreted = device.type == "cpu"
    if isinstance(kernel, InterpretedFunction) == interpreted:
        return kernel
    return getattr(_module_form(kernel.fn.__module__, interpreted), kernel.fn.__name__)


def _module_form(name: str, interpreted: bool) -> ModuleType:
    """A private copy of module ``name`` whose kernels are all interpreted (or compiled)."""
    with _forms_lock:
        module = _forms.get((name, interpreted))
        if module is None:
            spec = importlib.util.find_spec(name)
            module = importlib.util.module_from_spec(spec)
            saved = os.environ.get("TRITON_INTERPRET")
            os.environ["TRITON_INTERPRET"] = "1" if interpreted else "0"
            try:
                spec.loader.exec_module(module)
            finally:
                if saved is None:
                    del os.environ["TRITON_INTERPRET"]
                else:
                    os.environ["TRITON_INTERPRET"] = saved
            _forms[(name, interpreted)] = module
            # @triton.jit helpers the module imported from another kernel module: their
            # copies of the same form, since kernels find helpers in their module's globals.
            from triton.runtime.interpreter import InterpretedFunction
            from triton.runtime.jit import JITFunction

            for attr, value in list(vars(module).items()):
                if (isinstance(value, (JITFunction, InterpretedFunction))
                        and value.fn.__module__ != name):
                    other = _module_form(value.fn.__module__, interpreted)
                    setattr(module, attr, getattr(other, value.fn.__name__))
            log.debug("spmd.kernels: loaded %s with %s kernels", name,
                      "interpreted" if interpreted else "compiled")
    return module


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` current while launching: Triton launches on the current CUDA device,
    which need not be the one the tensors live on."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
