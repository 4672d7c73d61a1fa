"""The modules of a parallelized model, and the refusal of a parameter registered on one
after ``parallelize``.

A plan covers the parameters the model had when it was parallelized: their buckets,
their shards, their pieces. A parameter that arrives later (``model.head =
nn.Linear(...)``, an adapter added for fine-tuning, ``model.fc.weight =
nn.Parameter(...)``) is in none of them: under ``ddp`` its gradient would never be
averaged and every rank would train its own copy; under a sharded strategy its whole
tensor would meet graphs planned for shards. Neither is acceptable silently, and torch's
DDP and FSDP2 take it silently; so the assignment itself raises, naming the parameter,
through torch's global registration hooks (one dictionary lookup per registration
anywhere in the process). Buffers may still arrive (models register caches lazily).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

__all__ = ["own"]

# the attribute that marks a module of a parallelized model: (its path there, what
# parallelized it). On the module itself, not in a table here: Dynamo names a module by
# the first global path it finds to it, and a table of modules would be that path
_MARK = "_spmd_owned_by"
_HOOKS: list[Any] = []


def own(model: nn.Module, where: str) -> None:
    """Mark every module of ``model`` as planned by ``where``: registering a parameter the
    plan does not know (or a module holding one) on any of them from now on raises
    ``RuntimeError``; moving the model's own modules and parameters around does not."""
    if not _HOOKS:
        from torch.nn.modules import module as torch_module

        _HOOKS.append(torch_module.register_module_parameter_registration_hook(_parameter))
        _HOOKS.append(torch_module.register_module_module_registration_hook(_module))
    for path, sub in model.named_modules(remove_duplicate=False):
        if _MARK not in sub.__dict__:
            object.__setattr__(sub, _MARK, (path, where))


def _refuse(owner: nn.Module, name: str, what: str) -> None:
    path, where = owner.__dict__[_MARK]
    full = f"{path}.{name}" if path else name
    raise RuntimeError(
        f"{where}: {what} {full!r} is registered after spmd.parallelize: the plan (its "
        f"buckets, shards and pieces) covers the parameters the model had then, so its "
        f"gradient would go unsynchronised or meet graphs planned for others. Change the "
        f"model (replace a head, add adapters) before parallelizing it")


def _planned(param: Any) -> bool:
    return getattr(param, "_spmd_placement", None) is not None


def _parameter(module: nn.Module, name: str, param: Any) -> None:
    if _MARK in module.__dict__ and param is not None and not _planned(param):
        _refuse(module, name, "parameter")


def _module(module: nn.Module, name: str, child: Any) -> None:
    if _MARK in module.__dict__ and child is not None and not all(
            _planned(p) for p in child.parameters()):
        _refuse(module, name, f"module ({type(child).__name__}, holding parameters)")
