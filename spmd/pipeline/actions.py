"""What a pipeline rank does for each action of its schedule (:mod:`spmd.pp`): post the
receives one action ahead, run a stage's forward (``F``), its backward (``B``) or its
weight gradient (``W``), send what crosses to the next stage; and, once the schedule's
actions are done, sum tied parameters' gradients across their holders, average the data
dimensions' gradients and take the loss. A mixin of
:class:`~spmd.pipeline.module.PipelineModule`, which owns the stages and the state these
methods read."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from spmd.lowering.stages import Cut
from spmd.pp import Action
from spmd.pipeline.split_backward import backward_input, backward_weight

__all__ = ["Actions", "Traced", "StepState"]


@dataclass(kw_only=True)
class Traced:
    """One microbatch shape: the cut and the leaves' layout."""

    cut: Cut
    spec: Any  # the pytree spec of (args, target)
    # the model's plain attributes when it was traced (spmd.program.step._attributes)
    attributes: list = field(default_factory=list)


@dataclass(kw_only=True)
class StepState:
    microbatches: list[list[Any]]  # per microbatch: flat leaves of (args, target)
    saved: dict[tuple[int, int], tuple[list, tuple]] = field(default_factory=dict)
    local: dict[tuple[int, int, int], torch.Tensor] = field(default_factory=dict)
    grads: dict[tuple[int, int, int], torch.Tensor] = field(default_factory=dict)
    posted: dict[tuple, tuple[Any, torch.Tensor]] = field(default_factory=dict)
    sends: list[Any] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)
    spans: list[tuple[Action, float, float]] = field(default_factory=list)
    waited: float = 0.0  # seconds spent waiting for receives
    weight: dict[tuple[int, int], Any] = field(default_factory=dict)



class Actions:
    """The schedule's actions, run by :meth:`PipelineModule.step`."""

    def _rank(self, stage: int) -> int:
        """The global rank holding ``stage`` (in this rank's pipeline)."""
        assert self._group is not None
        return self._group.ranks[self.schedule.rank_of(stage, self._ranks)]

    def _local(self, stage: int) -> bool:
        return self.schedule.rank_of(stage, self._ranks) == self._pp_rank

    def _tag(self, program: Traced, crossing: int, mb: int, dst: int, backward: bool) -> int:
        n = len(program.cut.crossings)
        stages = self.schedule.stages(self._ranks)
        return (((mb * n + crossing) * stages + dst) * 2) + int(backward)

    def _post(self, program: Traced, state: StepState, action: Action) -> None:
        """Post the receives ``action`` needs (once)."""
        from spmd.runtime.p2p import irecv

        crossings = program.cut.crossings
        stage = program.cut.stages[action.stage]
        wanted: list[tuple[int, int, int, bool]] = []  # crossing, from stage, to stage
        if action.kind == "F":
            wanted = [(c, crossings[c].src, action.stage, False) for c in stage.received]
        elif action.kind == "B":
            wanted = [(c, d, action.stage, True) for c in stage.sent if crossings[c].grad
                      for d in crossings[c].dsts]
        for c, frm, to, backward in wanted:  # frm: the stage it comes from
            if self._local(frm):
                continue
            key = (c, action.microbatch, to if not backward else frm, backward)
            if key in state.posted:
                continue
            info = crossings[c]
            buffer = torch.empty(info.shape, dtype=info.dtype)
            work = irecv(buffer, src=self._rank(frm), group=self._group,
                         tag=self._tag(program, c, action.microbatch,
                                       to if not backward else frm, backward))
            state.posted[key] = (work, buffer)

    def _take(self, state: StepState, key: tuple) -> torch.Tensor:
        work, buffer = state.posted.pop(key)
        start = time.perf_counter()
        work.wait()
        state.waited += time.perf_counter() - start
        return buffer

    def _forward(self, program: Traced, state: StepState, action: Action,
                 training: bool) -> None:
        from spmd.runtime.p2p import isend

        crossings = program.cut.crossings
        stage = program.cut.stages[action.stage]
        mb = action.microbatch
        leaves = state.microbatches[mb]
        received = []
        for c in stage.received:
            src = crossings[c].src
            if self._local(src):
                value = state.local.pop((c, mb, action.stage))
            else:
                value = self._take(state, (c, mb, action.stage, False))
            if training and crossings[c].grad:
                value = value.detach().requires_grad_(True)
            received.append(value)
        module = self._stages[action.stage]
        with _no_sync(module, training):
            outs = module(*[leaves[i] for i in stage.inputs], *received)
        if not isinstance(outs, (tuple, list)):
            outs = (outs,)
        for k, c in enumerate(stage.sent):
            value = outs[k].detach()
            for dst in crossings[c].dsts:
                if self._local(dst):
                    state.local[(c, mb, dst)] = value
                else:
                    state.sends.append(isend(value.contiguous(), dst=self._rank(dst),
                                             group=self._group,
                                             tag=self._tag(program, c, mb, dst, False)))
        if stage.loss:
            state.losses.append(outs[-1].detach())
        if training:
            state.saved[(action.stage, mb)] = (received, tuple(outs))

    def _backward(self, program: Traced, state: StepState, action: Action) -> None:
        from spmd.runtime.p2p import isend

        crossings = program.cut.crossings
        stage = program.cut.stages[action.stage]
        mb = action.microbatch
        received, outs = state.saved[(action.stage, mb)]
        roots, grads = [], []
        for k, c in enumerate(stage.sent):
            if not crossings[c].grad or not outs[k].requires_grad:
                continue
            total = None
            for dst in crossings[c].dsts:
                if self._local(dst):
                    g = state.grads.pop((c, mb, dst))
                else:
                    g = self._take(state, (c, mb, dst, True))
                total = g if total is None else total + g
            roots.append(outs[k])
            grads.append(total)
        if stage.loss and outs[-1].requires_grad:
            roots.append(outs[-1])
            grads.append(torch.full_like(outs[-1], 1.0 / self.schedule.microbatches))
        needs = [r for r in received if r.requires_grad]
        module = self._stages[action.stage]
        split = self.schedule.split_backward and not self._composed
        if roots:
            with _no_sync(module, True):
                if split:
                    weights = [p for p in module.parameters() if p.requires_grad]
                    got, groups = backward_input(roots, grads, needs, weights)
                    state.weight[(action.stage, mb)] = groups
                    for r, g in zip(needs, got):
                        r.grad = g
                else:
                    torch.autograd.backward(roots, grads, inputs=needs + [
                        p for p in module.parameters() if p.requires_grad] or None)
        k = 0
        for c in stage.received:
            if not crossings[c].grad:
                continue
            value = received[k] if received[k].requires_grad else None
            k += 1
            grad = value.grad if value is not None and value.grad is not None else \
                torch.zeros(crossings[c].shape, dtype=crossings[c].dtype)
            src = crossings[c].src
            if self._local(src):
                state.grads[(c, mb, action.stage)] = grad
            else:
                state.sends.append(isend(grad.contiguous(), dst=self._rank(src),
                                         group=self._group,
                                         tag=self._tag(program, c, mb, action.stage, True)))
        if not split:
            del state.saved[(action.stage, mb)]

    def _weight(self, program: Traced, state: StepState, action: Action) -> None:
        key = (action.stage, action.microbatch)
        groups = state.weight.pop(key, None)
        if groups is not None:
            backward_weight(groups)
        state.saved.pop(key, None)

    def _reduce_accumulated(self) -> None:
        """``ddp`` stages: the microbatches' summed gradients averaged over the data
        dimension, once per step (an expert's, ``spmd.ep``, complete along its own
        dimension: averaged along the others only)."""
        if not self._composed:
            return
        from spmd.runtime.collectives import all_reduce

        for module in self._stages.values():
            st = getattr(module, "_spmd", None)
            if st is None or st.sharded or not st.communicates:
                continue
            strategy = st.setup.strategy
            named = [(n, p) for n, p in module.named_parameters() if p.grad is not None]
            grads = [p.grad for n, p in named if n not in strategy.experts]
            for name, p in named:
                own = strategy.experts.get(name)
                for dim in (d for d in strategy.data_dims if own and d != own):
                    size = strategy.mesh.size(dim)
                    if size > 1:
                        all_reduce(p.grad, group=strategy.mesh.get_group(dim))
                        p.grad /= size
            for dtype in sorted({g.dtype for g in grads}, key=str):
                same = [g for g in grads if g.dtype == dtype]
                flat = torch.cat([g.reshape(-1) for g in same])
                all_reduce(flat, group=st.group)
                flat /= st.world_size
                offset = 0
                for g in same:
                    g.copy_(flat[offset:offset + g.numel()].view_as(g))
                    offset += g.numel()

    def _tied_here(self, program: Traced) -> list[tuple[int, str, list[int]]]:
        """(tag offset, name, holders) of each tied parameter this rank holds with other
        pipeline ranks."""
        tied = program.cut.tied
        out = []
        if self._group is None:
            return out
        for k, name in enumerate(sorted(tied)):
            holders = sorted({self.schedule.rank_of(s, self._ranks) for s in tied[name]})
            if self._pp_rank in holders and len(holders) > 1:
                out.append((k, name, holders))
        return out

    def _set_aside_tied(self, program: Traced) -> dict[str, torch.Tensor | None]:
        """The ``.grad`` tied parameters held before the step (accumulated by earlier
        steps, already summed across holders), set aside: only what this step adds is
        summed across holders, then added to it."""
        before: dict[str, torch.Tensor | None] = {}
        for _, name, _ in self._tied_here(program):
            param = self.module.get_parameter(name)
            before[name] = param.grad
            param.grad = None
        return before

    def _sum_tied(self, program: Traced, before: dict[str, torch.Tensor | None]) -> None:
        """A parameter read in stages on several pipeline ranks (tied weights): what this
        step added to every holder's gradient summed, in pipeline-rank order, on each
        holder, and added to what ``.grad`` held before the step (``before``). A
        parameter no holder computed a gradient for keeps what it held; a frozen one sends
        nothing (every rank of a pipeline runs the same loop: they agree)."""
        from spmd.runtime.p2p import irecv, isend

        for k, name, holders in self._tied_here(program):
            param = self.module.get_parameter(name)
            if not param.requires_grad and param.grad is None:
                param.grad = before.get(name)
                continue
            # the gradient, flattened, and one element more: whether it was computed
            mine = torch.zeros(param.numel() + 1, dtype=param.dtype, device=param.device)
            if param.grad is not None:
                mine[:-1] = param.grad.detach().reshape(-1)
                mine[-1] = 1
            tag = 2 ** 30 + k  # above every activation's tag
            works, got = [], {}
            for r in holders:
                if r == self._pp_rank:
                    continue
                peer = self._group.ranks[r]
                works.append(isend(mine, dst=peer, group=self._group, tag=tag))
                got[r] = torch.empty_like(mine)
                works.append(irecv(got[r], src=peer, group=self._group, tag=tag))
            for w in works:
                w.wait()
            total = None
            for r in holders:
                part = mine if r == self._pp_rank else got[r]
                total = part.clone() if total is None else total + part
            assert total is not None
            held = before.get(name)
            if not total[-1]:
                param.grad = held
                continue
            grad = total[:-1].view_as(param)
            if held is None:
                param.grad = grad
            else:
                param.grad = held.add_(grad)

    def _broadcast_buffers(self) -> None:
        """Each stage's buffers from the first rank of its data group, as DDP does before
        a training forward: once per step."""
        from spmd.eager.reducer import broadcast_coalesced

        for module in self._stages.values():
            st = getattr(module, "_spmd", None)
            buffers = list(module.buffers())
            if st is not None and st.communicates and buffers:
                broadcast_coalesced(buffers, st.group.ranks[0], st.group)

    def _loss(self, program: Traced, state: StepState) -> torch.Tensor:
        last = self.schedule.stages(self._ranks) - 1
        if state.losses:
            loss = torch.stack(state.losses).mean()
        else:
            val = program.cut.stages[last].code.graph.find_nodes(op="output")[0].args[0][-1]
            loss = torch.zeros((), dtype=val.meta["val"].dtype)
        if self._group is not None and self._ranks > 1:
            from spmd.runtime.collectives import broadcast

            loss = loss.detach().clone().reshape(())
            broadcast(loss, src=self._rank(last), group=self._group)
        return loss


def _no_sync(module: nn.Module, training: bool) -> Any:
    import contextlib

    if training and hasattr(module, "_spmd") and not module._spmd.sharded:
        return module.no_sync()  # averaged once, at the end of the step
    return contextlib.nullcontext()
