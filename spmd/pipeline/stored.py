"""A pipeline's parameters as checkpoints and optimizers see them: the whole model's state
dict gathered from the stages' holders, loading into the stages this rank holds,
releasing what it does not hold (and its optimizer state), and the layout record of each
parameter. A mixin of :class:`~spmd.pipeline.module.PipelineModule`."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

__all__ = ["Stored"]


class Stored:
    """State-dict, release and layout methods of :class:`PipelineModule`."""

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """This rank's stages' parameters and persistent buffers, whole, under the names
        the model's own ``state_dict()`` gives them (a tied parameter under each of its
        names, ``num_batches_tracked`` with its BatchNorm's statistics; a pipeline
        checkpoint is one file per pipeline rank, as with torch's pipelining), in the
        model's order; before the first step, the whole model's."""
        if not self._stages:
            return self.module.state_dict(*args, **kwargs)
        out: dict[str, Any] = {}
        for module in self._stages.values():
            out.update(module.state_dict(*args, **kwargs))
        prefix = kwargs.get("prefix", "")
        if self._unread and self._pp_rank == 0:
            whole = self.module.state_dict(prefix=prefix,
                                           keep_vars=kwargs.get("keep_vars", False))
            out.update({prefix + n: whole[prefix + n] for n in self._unread
                        if prefix + n in whole})
        for alias, name in _aliases(self.module).items():
            if prefix + name in out:
                out[prefix + alias] = out[prefix + name]
        order = {k: i for i, k in enumerate(self.module.state_dict(prefix=prefix,
                                                                      keep_vars=True))}
        keys = sorted(out, key=lambda k: order.get(k, len(order)))
        return {k: out[k] for k in keys}

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False
                        ) -> Any:
        """Load what this rank's stages hold from ``state_dict`` (entries of other
        stages are skipped; the first pipeline rank also loads what no stage reads); with
        ``strict``, every entry of this rank's stages must be there, and no entry the
        model does not have."""
        from torch.nn.modules.module import _IncompatibleKeys

        from spmd.state.layout import local_state_dicts

        if not self._stages:  # not cut yet: what the checkpoint holds (a stage's entries)
            result = self.module.load_state_dict(state_dict, strict=False, assign=assign)
            if strict and result.unexpected_keys:
                raise RuntimeError(f"{self._where}.load_state_dict: entries the model does "
                                   f"not have: {', '.join(result.unexpected_keys[:5])}")
            return result
        plain = set(self.module.state_dict(keep_vars=True))
        unexpected = [k for k in state_dict if k not in plain]
        if strict and unexpected:
            raise RuntimeError(f"{self._where}.load_state_dict: entries the model does not "
                               f"have: {', '.join(unexpected[:5])}"
                               + (" ..." if len(unexpected) > 5 else ""))
        # the keys each stage holds, read without gathering (a composed stage's
        # state_dict() would gather every parameter over its group)
        with local_state_dicts(lambda name, stored, shard, piece: stored):
            owners: list[tuple[nn.Module, list[str]]] = [
                (module, list(module.state_dict(keep_vars=True)))
                for module in self._stages.values()]
        if self._unread and self._pp_rank == 0:
            owners.append((self.module, [n for n in self._unread if n in plain]))
        missing: list[str] = []
        for module, own in owners:
            part = {k: state_dict[k] for k in own if k in state_dict}
            missing += [k for k in own if k not in state_dict]
            module.load_state_dict(part, strict=False, assign=assign)
        if strict and missing:
            raise RuntimeError(f"{self._where}.load_state_dict: missing entries of this "
                               f"rank's stages: {', '.join(missing[:5])}"
                               + (" ..." if len(missing) > 5 else ""))
        return _IncompatibleKeys(missing, unexpected)

    def release_with(self, optimizer: torch.optim.Optimizer) -> None:
        """Keep ``optimizer``'s state to what this rank holds: the state of the parameters
        it releases dropped, and where each stage is parallelized over the other mesh
        dimensions, state shaped like a whole parameter cut to the part this rank stores
        (as the parameter was): now if the stages are cut, else at the cut (the first
        step). Before the cut every rank holds the whole model, so state loaded then (a
        checkpoint loaded before the first step) is every stage's and whole; without this
        each rank would keep the other stages' state, stale, for good, and a sharded
        parameter would meet whole state at the optimizer's step.
        ``spmd.checkpoint.get_state_dict``/``set_state_dict`` call it.

        Example::

            model.release_with(opt)
            opt.load_state_dict(torch.load(path))  # a plain model's, before the first step
        """
        from spmd.state.layout import layout_of, stored_part

        if not self._stages:
            self._optimizers.add(optimizer)
            return
        for name in self._released:
            optimizer.state.pop(self.module.get_parameter(name), None)
        for stage in self._stages.values():
            layout = layout_of(stage)
            placed = () if layout is None else sorted(set(layout.shards) | set(layout.pieces))
            for name in placed:
                record = layout.records[name]
                state = optimizer.state.get(self.module.get_parameter(name))
                if not state or record.shape == record.local_shape:
                    continue
                for key, value in list(state.items()):
                    if isinstance(value, torch.Tensor) and value.dim() \
                            and tuple(value.shape) == record.shape:
                        state[key] = stored_part(layout, name, value,
                                                 f"{name}: {key}").clone()

    def layout(self) -> Any:
        """The :class:`spmd.state.layout.Layout` of this rank's stages merged (each parallelized
        on its own over the other mesh dimensions; names are the model's); None where no
        stage is (a pipeline alone, or before the cut)."""
        from spmd.state.layout import Layout, layout_of

        parts = [p for p in map(layout_of, self._stages.values()) if p is not None]
        if not parts:
            return None
        merged = Layout(records={}, shards={}, pieces={})
        for part in parts:
            merged.records.update(part.records)
            merged.shards.update(part.shards)
            merged.pieces.update(part.pieces)
        return merged

    def held(self) -> set[str] | None:
        """The parameters this rank holds, by their first names (``named_parameters()``
        of the model); None before the cut, when every rank holds them all."""
        if not self._stages:
            return None
        return {n for n, _ in self.module.named_parameters() if n not in self._released}

    def others(self) -> dict[str, tuple[torch.Size, torch.dtype, torch.device]]:
        """The entries of the model's ``state_dict()`` that this rank's ``state_dict()``
        lacks (other stages' parameters and buffers), each with its whole shape, its dtype
        and device; empty before the cut."""
        if not self._stages:
            return {}
        mine = _all_keys_local(self)
        aliases = _aliases(self.module)
        out: dict[str, tuple[torch.Size, torch.dtype, torch.device]] = {}
        for key, value in self.module.state_dict(keep_vars=True).items():
            if key in mine:
                continue
            shape, _ = self._released.get(aliases.get(key, key), (value.shape, None))
            out[key] = (torch.Size(shape), value.dtype, value.device)
        return out

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip every stage's gradients by the norm of the whole model's gradient, as
        ``torch.nn.utils.clip_grad_norm_`` does on one process (which, on these
        parameters, is rerouted to do the same); the total norm, on every rank. Every rank
        must call it, after ``step``."""
        from spmd.eager.clip import clip_grad_norm_

        return clip_grad_norm_(self.module.parameters(), max_norm, norm_type)


def _all_keys_local(pipe: Stored) -> set[str]:
    """The keys of ``pipe.state_dict()``, read without gathering."""
    from spmd.state.layout import local_state_dicts

    with local_state_dicts(lambda name, stored, shard, piece: stored):
        return set(pipe.state_dict(keep_vars=True))


def _aliases(model: nn.Module) -> dict[str, str]:
    """Every second name of a parameter or buffer (a head tied to the embedding) -> the
    name the model's ``named_parameters()`` gives it (the name a stage holds it by)."""
    out: dict[str, str] = {}
    for named in (model.named_parameters, model.named_buffers):
        first: dict[int, str] = {}
        for name, tensor in named(remove_duplicate=False):
            if id(tensor) in first:
                out[name] = first[id(tensor)]
            else:
                first[id(tensor)] = name
    return out
